"""What a restart finds after a crash: the newest checkpoint that is whole, in one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from comm_strategies import build_strategy
from comm_strategies.checkpoint import find_latest, read_manifest

ROOT = Path(__file__).resolve().parents[2]


def _strategy(work_dir: Path) -> Any:
    strategy = build_strategy("single", seed=0, work_dir=str(work_dir))
    strategy.setup_env()
    strategy.prepare(
        torch.nn.Linear(4, 1),
        optim_wrapper={"type": "OptimWrapper", "optimizer": {"type": "SGD", "lr": 0.1}},
    )
    return strategy


def test_a_checkpoint_with_a_short_file_is_passed_over_for_the_one_before(tmp_path: Path) -> None:
    strategy = _strategy(tmp_path)
    for step in (5, 10):
        strategy.save_checkpoint(f"step_{step}", extra={"step": step}, keep_last=2)
    listed = read_manifest(tmp_path / "step_10").files
    name = max(listed, key=lambda n: listed[n])  # a file a crash left short
    (tmp_path / "step_10" / name).write_bytes(b"")
    assert find_latest(tmp_path) == tmp_path / "step_5"
    assert _strategy(tmp_path).resume(missing_ok=True)["step"] == 5


@pytest.mark.skipif(sys.platform != "linux", reason="SIGKILLs a child process")
def test_a_save_killed_between_its_two_renames_is_resumed_and_put_back(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "strategies" / "recovery_cut_publish.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -9, done.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n.split("-")[0] for n in names] == [".latest.old", ".latest.tmp"], names
    # no folder named latest: the finished temporary folder is the newest checkpoint
    found = find_latest(tmp_path)
    assert found is not None
    assert found.name.startswith(".latest.tmp-")
    strategy = _strategy(tmp_path)
    assert strategy.resume(missing_ok=True)["step"] == 200
    strategy.save_checkpoint("step_201", extra={"step": 201})
    # the first save put it back under its name and removed the hidden copy it replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_201"]
    assert _strategy(tmp_path).resume("latest")["step"] == 200
