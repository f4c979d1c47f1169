"""Kill every rank with SIGKILL during training and during a save, restart, compare.

Each run is the same command on 2 ranks (``ckpt_train.py``); the restarted run resumes
from the last whole checkpoint (found by its manifest) and must end with exactly the
parameters of a run that was never interrupted. The async case saves with
``async_save=True`` and is killed from the background thread writing a save, while the
training thread goes on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("ckpt_train.py")
RUN_TIMEOUT_S = 120


def _run(kind: str, work_dir: Path, out: Path, kill: str = "", mode: str = "sync") -> list[int]:
    """Start the 2 ranks, wait (bounded), return their exit codes."""
    store = tempfile.mktemp(prefix="comm-kill-store-", dir=work_dir.parent)
    processes = []
    for rank in range(2):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            COMM_TEST_STORE=store,
            GLOO_SOCKET_IFNAME="lo",
            COMM_TEST_KILL=kill,
        )
        command = [sys.executable, str(SCRIPT), "--kind", kind, "--work-dir", str(work_dir)]
        if mode == "async":
            command.append("--async-save")
        processes.append(
            subprocess.Popen(
                [*command, "--out", str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    codes, logs = [], []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            output, _ = process.communicate()
            codes.append(-999)
        else:
            codes.append(process.returncode)
        logs.append(output.decode(errors="replace")[-3000:])
    if kill == "" and codes != [0, 0]:
        pytest.fail(f"ranks exited with {codes}:\n" + "\n---\n".join(logs))
    return codes


def _finished(work_dir: Path) -> list[str]:
    return sorted(p.name for p in work_dir.iterdir() if (p / "manifest.json").is_file())


@pytest.mark.parametrize(
    ("kind", "mode"), [("fsdp2", "sync"), ("zero3", "sync"), ("fsdp2", "async")]
)
def test_kill_in_training_and_in_save_then_resume_equals_uninterrupted(
    tmp_path: Path, kind: str, mode: str
) -> None:
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    _run(kind, reference_dir, tmp_path / "reference.pt", mode=mode)
    reference = torch.load(tmp_path / "reference.pt")
    assert reference["start"] == 0

    # Killed right after step 3: step_2 is the last whole checkpoint.
    assert _run(kind, resumed_dir, tmp_path / "x.pt", kill="train:3", mode=mode) == [-9, -9]
    assert _finished(resumed_dir) == ["step_2"]
    # Restarted, then killed inside the save of step 4: files written, folder not renamed.
    assert _run(kind, resumed_dir, tmp_path / "x.pt", kill="save:4", mode=mode) == [-9, -9]
    assert _finished(resumed_dir) == ["step_2"]
    leftovers = [p.name for p in resumed_dir.iterdir() if p.name.startswith(".step_4.tmp-")]
    assert len(leftovers) == 1  # the killed save's files, never taken for a checkpoint
    # The same command once more: resumes from step_2 and finishes.
    _run(kind, resumed_dir, tmp_path / "resumed.pt", mode=mode)
    resumed = torch.load(tmp_path / "resumed.pt")
    assert resumed["start"] == 2
    assert _finished(resumed_dir) == ["step_2", "step_4", "step_6"]
    assert not [p for p in resumed_dir.iterdir() if p.name.startswith(".")]  # stale removed
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name
