"""MMEngine's runners, started again by torchrun after a kill, go on from the latest
complete checkpoint and end where a run that never stopped ends.

The jobs run tests/strategies/recovery_runner_mmengine.py (``resume=True``, a
``CheckpointHook`` every 4 of 12 iterations, ``by_epoch=False``, ``max_keep_ckpts=2``) under
real torchrun with ``--max-restarts 1`` (scripts/launch/torchrun.sh restart). One
reference run that never stopped serves every case: ``FlexibleRunner`` with
``CommDDPStrategy``, ``CommFSDPStrategy`` (FSDP2) and the classic ``Runner`` with
``CommDistributedDataParallel`` train test_runner.py's model to the same values on the
same data (measured equal to 0.0 here; the cases check 1e-5).

The faster cases below check `repair_pointer` alone: what ``work_dir/last_checkpoint``
names after each way a kill can leave it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mmengine")
pytest.importorskip("cv2")  # mmengine.runner imports it

import torch

from comm_strategies.checkpoint import read_manifest, save_checkpoint
from comm_strategies.integrations import _mmengine_runner
from comm_strategies.integrations._mmengine_resume import (
    repair_pointer,
    template_pattern,
    write_whole_files,
)

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch" / "torchrun.sh"
JOB = ROOT / "tests" / "strategies" / "recovery_runner_mmengine.py"
TOLERANCE = 1e-5
ITERS = 12


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHON_RANK"] = sys.executable
    env["COMM_MAX_RESTARTS"] = "1"
    return env


def _run(tmp: Path, rdzv: str, *args: str, timeout: float = 150.0) -> Path:
    """Run the job under ``torchrun.sh restart RDZV``; return its output folder."""
    out = tmp / "out"
    out.mkdir()
    command = ["bash", str(LAUNCH), "restart", rdzv, str(JOB), "--work-dir", str(tmp / "w")]
    proc = subprocess.run(
        [*command, "--out", str(out), "--iters", str(ITERS), *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return out


def _attempts(out: Path) -> list[list[dict[str, Any]]]:
    """Each attempt's records (one a rank), in the order the attempts started."""
    by_token: dict[str, list[dict[str, Any]]] = {}
    for path in out.glob("attempt-*.json"):
        record = json.loads(path.read_text())
        by_token.setdefault(str(record["attempt"]), []).append(record)
    attempts = [sorted(records, key=lambda r: r["rank"]) for records in by_token.values()]
    return sorted(attempts, key=lambda records: min(r["started"] for r in records))


def _difference(out: Path, reference: Path) -> float:
    final = torch.load(out / "final.pt")
    expected = torch.load(reference / "final.pt")
    assert final["iter"] == expected["iter"] == ITERS
    assert sorted(final["params"]) == sorted(expected["params"])
    return max(
        float((final["params"][k] - expected["params"][k]).abs().max()) for k in expected["params"]
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run that never stopped: FlexibleRunner, CommDDPStrategy, 2 ranks, 12 iterations."""
    out = _run(tmp_path_factory.mktemp("reference"), "static")
    (attempt,) = _attempts(out)
    assert [r["resumed_from"] for r in attempt] == [0, 0]
    return out


# (runner and strategy, rendezvous, kill, killed rank, the iteration the restart resumes
# from, what last_checkpoint named when the restart began)
KILLS = [
    # iter_8 saved, last_checkpoint still names iter_4: MMEngine alone would go back to 4
    pytest.param(
        ["--strategy", "ddp"], "static", "pointer:8", 0, 8, "iter_4.pth", id="flexible-ddp-pointer"
    ),
    pytest.param(
        ["--strategy", "fsdp2"], "c10d", "step:10", 1, 8, "iter_8.pth", id="flexible-fsdp2-step"
    ),
    # iter_8 never published (its temporary folder stays): iter_4 is the latest complete
    pytest.param(
        ["--strategy", "ddp"], "c10d", "save:8", 0, 4, "iter_4.pth", id="flexible-ddp-save"
    ),
    # the classic Runner: nothing called before it is built
    pytest.param(
        ["--runner", "classic"], "static", "pointer:8", 0, 8, "iter_4.pth", id="classic-ddp-pointer"
    ),
]


@pytest.mark.parametrize(("job", "rdzv", "kill", "victim", "resumed", "pointer"), KILLS)
def test_a_runner_killed_mid_run_is_restarted_and_resumes_from_the_latest_complete_checkpoint(
    tmp_path: Path,
    reference: Path,
    job: list[str],
    rdzv: str,
    kill: str,
    victim: int,
    resumed: int,
    pointer: str,
) -> None:
    out = _run(tmp_path, rdzv, *job, "--kill", kill, "--kill-rank", str(victim))
    assert json.loads((out / "killed").read_text())["where"] == kill.split(":")[0]
    first, second = _attempts(out)
    assert [r["resumed_from"] for r in first] == [0, 0]
    assert [r["restart_count"] for r in second] == ["1", "1"]
    assert first[0]["attempt"] != second[0]["attempt"]  # comm's init_dist, once an attempt
    assert [Path(r["pointer_at_start"]).name for r in second] == [pointer, pointer]
    assert [r["resumed_from"] for r in second] == [resumed, resumed]
    assert [r["world"] for r in second] == [2, 2]
    assert _difference(out, reference) <= TOLERANCE
    work = tmp_path / "w"
    assert Path((work / "last_checkpoint").read_text()) == work / "iter_12.pth"
    checkpoints = sorted(p.name for p in work.iterdir() if "iter_" in p.name)
    assert checkpoints == ["iter_12.pth", "iter_8.pth"]  # nothing temporary or half removed


# ------------------------------------------------------------------ repair_pointer


def _comm(folder: Path, name: str) -> Path:
    return Path(save_checkpoint(folder / name, model=torch.nn.Linear(2, 1), strategy="single"))


def _pth(folder: Path, name: str) -> Path:
    path = folder / name
    torch.save({"state_dict": torch.nn.Linear(2, 1).state_dict()}, path)
    return path


def _point(work: Path, target: Path | str) -> None:
    (work / "last_checkpoint").write_text(str(target))


def _named(work: Path) -> str | None:
    pointer = work / "last_checkpoint"
    return Path(pointer.read_text()).name if pointer.exists() else None


def test_a_missing_pointer_names_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    _comm(tmp_path, "iter_4.pth")
    _comm(tmp_path, "iter_8.pth")
    assert repair_pointer(tmp_path) == tmp_path / "iter_8.pth"
    assert _named(tmp_path) == "iter_8.pth"


def test_a_pointer_older_than_the_newest_checkpoint_moves_to_it(tmp_path: Path) -> None:
    older = _comm(tmp_path, "iter_4.pth")
    _comm(tmp_path, "iter_8.pth")
    _point(tmp_path, older)
    repair_pointer(tmp_path)
    assert _named(tmp_path) == "iter_8.pth"


@pytest.mark.parametrize("damage", ["removed", "half_removed", "no_manifest", "empty_pointer"])
def test_a_pointer_to_what_a_kill_left_falls_back_to_the_latest_complete(
    tmp_path: Path, damage: str
) -> None:
    _comm(tmp_path, "iter_4.pth")
    newest = _comm(tmp_path, "iter_8.pth")
    # a whole checkpoint under a hidden name (a replaced one, hidden before its removal)
    # never counts, although it is the newest
    os.replace(_comm(tmp_path, "iter_12.pth"), tmp_path / ".iter_12.pth.old-0123456789ab")
    _point(tmp_path, newest)
    if damage == "removed":  # max_keep_ckpts removed it before the next save finished
        shutil.rmtree(newest)
    elif damage == "half_removed":  # killed inside MMEngine's rmtree: the manifest is left
        listed = sorted(read_manifest(newest).files)
        (newest / listed[0]).unlink()
    elif damage == "no_manifest":  # a save killed before its manifest
        (newest / "manifest.json").unlink()
    else:  # killed while CheckpointHook rewrote the file: iter_8 is whole
        (tmp_path / "last_checkpoint").write_text("")
    expected = "iter_8.pth" if damage == "empty_pointer" else "iter_4.pth"
    assert repair_pointer(tmp_path) == tmp_path / expected
    assert _named(tmp_path) == expected


def test_a_stale_pointer_with_no_complete_checkpoint_is_removed(tmp_path: Path) -> None:
    _point(tmp_path, tmp_path / "iter_4.pth")
    assert repair_pointer(tmp_path) is None
    assert not (tmp_path / "last_checkpoint").exists()  # the runner starts from scratch


def test_a_right_pointer_and_another_storage_are_left_alone(tmp_path: Path) -> None:
    _comm(tmp_path, "iter_4.pth")
    newest = _comm(tmp_path, "iter_8.pth")
    _point(tmp_path, newest)
    before = (tmp_path / "last_checkpoint").stat()
    assert repair_pointer(tmp_path) == newest
    after = (tmp_path / "last_checkpoint").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    _point(tmp_path, "s3://bucket/iter_12.pth")
    assert repair_pointer(tmp_path) is None
    assert (tmp_path / "last_checkpoint").read_text() == "s3://bucket/iter_12.pth"


def test_classic_files_a_truncated_one_and_other_names_do_not_count(tmp_path: Path) -> None:
    names = template_pattern("iter_{}.pth")
    _pth(tmp_path, "iter_4.pth")
    truncated = _pth(tmp_path, "iter_8.pth")
    truncated.write_bytes(truncated.read_bytes()[:100])  # a kill during MMEngine's write
    assert not zipfile.is_zipfile(truncated)
    _pth(tmp_path, "best_accuracy_iter_8.pth")  # not CheckpointHook's regular name
    _point(tmp_path, truncated)
    assert repair_pointer(tmp_path, names=names) == tmp_path / "iter_4.pth"
    # checkpoints in CheckpointHook's out_dir: found through the pointer's folder
    out_dir = tmp_path / "elsewhere"
    out_dir.mkdir()
    newest = _pth(out_dir, "iter_12.pth")
    _point(tmp_path, out_dir / "iter_4.pth")
    assert repair_pointer(tmp_path, names=names) == newest


def test_the_classic_runner_save_writes_a_whole_file_or_none(tmp_path: Path) -> None:
    class FakeRunner:
        rank = 0
        killed = True

        def save_checkpoint(
            self,
            out_dir: str,
            filename: str,
            file_client_args: Any = None,
            save_optimizer: bool = True,
            backend_args: Any = None,
        ) -> None:
            path = Path(out_dir) / filename
            path.write_bytes(b"partial")
            if self.killed:
                message = "killed during the write"
                raise RuntimeError(message)
            torch.save({"ok": 1}, path)

    runner = FakeRunner()
    write_whole_files(runner)
    write_whole_files(runner)  # once a runner (before_run runs again)
    (tmp_path / ".iter_4.pth.tmp-0123456789ab").write_bytes(b"left by a kill")
    with pytest.raises(RuntimeError, match="killed"):
        runner.save_checkpoint(str(tmp_path), "iter_4.pth")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    runner.killed = False
    runner.save_checkpoint(str(tmp_path), "iter_4.pth", save_optimizer=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_4.pth"]
    assert torch.load(tmp_path / "iter_4.pth") == {"ok": 1}


def test_importing_the_integration_under_torchrun_restarts_routes_the_runner_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mmengine.runner.runner as runner_module

    monkeypatch.setattr(runner_module, "init_dist", runner_module.init_dist)  # restored after
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    assert not _mmengine_runner.restarts_allowed()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    _mmengine_runner._register()
    assert runner_module.init_dist is not _mmengine_runner._comm_init_dist
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    _mmengine_runner._register()
    assert runner_module.init_dist is _mmengine_runner._comm_init_dist
