"""A killed worker or a lost node costs only the steps since the last checkpoint.

Every case runs tests/strategies/recovery_train.py (a plain loop: `ElasticSampler`,
``resume(missing_ok=True)``, a checkpoint every 5 steps with ``keep_last=2``) under real
torchrun, started by scripts/launch/torchrun.sh, and compares the final parameters with
one run that never stopped (DDP, world 2: DDP, FSDP2 and DeepSpeed ZeRO-2 train the same
model to the same values on the same global batches, checked by the reference cases).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch" / "torchrun.sh"
JOB = ROOT / "tests" / "strategies" / "recovery_train.py"
TOLERANCE = 1e-5


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHON_RANK"] = sys.executable
    env.update(extra)
    return env


def _restart_run(tmp: Path, rdzv: str, *args: str, timeout: float = 200.0) -> Path:
    """Run the job under ``torchrun.sh restart RDZV``; return its output folder."""
    out = tmp / "out"
    out.mkdir()
    command = ["bash", str(LAUNCH), "restart", rdzv, str(JOB), "--work-dir", str(tmp / "w")]
    proc = subprocess.run(
        [*command, "--out", str(out), *args],
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
        by_token.setdefault(record["attempt"], []).append(record)
    attempts = [sorted(records, key=lambda r: r["rank"]) for records in by_token.values()]
    return sorted(attempts, key=lambda records: min(r["started"] for r in records))


def _difference(out: Path, reference: Path) -> float:
    final = torch.load(out / "final.pt")["params"]
    expected = torch.load(reference / "final.pt")["params"]
    assert sorted(final) == sorted(expected)
    return max(float((final[k] - expected[k]).abs().max()) for k in expected)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run that never stopped: DDP on 2 ranks, 30 steps."""
    out = _restart_run(tmp_path_factory.mktemp("reference"), "static")
    assert len(_attempts(out)) == 1
    return out


# (strategy, rendezvous, kill, the step the restart resumes from)
KILLS = [
    ("ddp", "static", "step:12", 10),
    ("fsdp2", "c10d", "step:12", 10),
    ("deepspeed", "static", "step:12", 10),
    ("ddp", "c10d", "save:10", 5),  # the save of step 10 never published
    ("ddp", "static", "retention:15", 15),  # step_15 published, step_5 half removed
]


@pytest.mark.parametrize(("strategy", "rdzv", "kill", "resumed"), KILLS)
def test_a_rank_killed_mid_run_is_restarted_and_resumes_exactly(
    tmp_path: Path, reference: Path, strategy: str, rdzv: str, kill: str, resumed: int
) -> None:
    out = _restart_run(tmp_path, rdzv, "--strategy", strategy, "--kill", kill)
    assert json.loads((out / "killed").read_text())["where"] == kill.split(":")[0]
    first, second = _attempts(out)
    assert [r["resumed_from"] for r in first] == [0, 0]
    assert [r["resumed_from"] for r in second] == [resumed, resumed]
    assert [r["world"] for r in second] == [2, 2]
    assert first[0]["attempt"] != second[0]["attempt"]
    assert _difference(out, reference) <= TOLERANCE
    # nothing of the dead attempt is left: no temporary or half-removed folder
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["step_25", "step_30"]


def test_a_rank_killed_while_an_async_save_writes_resumes_from_the_last_complete_one(
    tmp_path: Path, reference: Path
) -> None:
    out = _restart_run(tmp_path, "static", "--async-save", "--kill", "async:10")
    first, second = _attempts(out)
    assert [r["resumed_from"] for r in first] == [0, 0]
    # the save of step 10 never completed: the restart goes on from step 5
    assert [r["resumed_from"] for r in second] == [5, 5]
    assert _difference(out, reference) <= TOLERANCE
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["step_25", "step_30"]


# ------------------------------------------------------------------ elastic membership


def _agent(port: int, out: Path, work: Path, *args: str) -> subprocess.Popen[bytes]:
    """One node agent of the elastic job, in a session of its own (a node to kill whole)."""
    command = ["bash", str(LAUNCH), "agent", str(port), str(JOB), "--work-dir", str(work)]
    log = open(out / f"agent-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
    return subprocess.Popen(
        [*command, "--out", str(out), *args],
        env=_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (read from /proc: torchrun's workers may live in
    a process group of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def _kill_node(agent: subprocess.Popen[bytes]) -> None:
    """SIGKILL a node: its agent and every worker the agent started."""
    for pid in _descendants(agent.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def _progress(out: Path) -> int:
    steps = [int(p.read_text() or 0) for p in out.glob("progress-rank*")]
    return max(steps, default=0)


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _finish(agents: list[subprocess.Popen[bytes]], out: Path, timeout: float = 150.0) -> str:
    """Wait for the agents (killing what is left after ``timeout``); return their logs."""
    try:
        for agent in agents:
            agent.wait(timeout=timeout)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_node(agent)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in out.glob("agent-*.log"))
    assert all(agent.returncode == 0 for agent in agents), logs
    return logs


def test_a_lost_node_leaves_a_smaller_world_that_resumes_exactly(
    tmp_path: Path, reference: Path
) -> None:
    out, work, port = tmp_path / "out", tmp_path / "w", free_port()
    out.mkdir()
    args = ("--step-delay", "0.1")
    host = _agent(port, out, work, *args)  # hosts the rendezvous: the node that stays
    time.sleep(1.0)
    lost = _agent(port, out, work, *args)
    _wait(lambda: _progress(out) >= 12, 120, "step 12 at world 2")
    _kill_node(lost)
    logs = _finish([host], out)
    attempts = _attempts(out)
    assert [len(a) for a in attempts] == [2, 1], logs
    assert attempts[-1][0]["world"] == 1
    assert attempts[-1][0]["resumed_from"] in (10, 15)
    assert _difference(out, reference) <= TOLERANCE


def test_a_node_joining_restarts_into_a_larger_world_that_resumes_exactly(
    tmp_path: Path, reference: Path
) -> None:
    out, work, port = tmp_path / "out", tmp_path / "w", free_port()
    out.mkdir()
    args = ("--step-delay", "0.4")  # world 1 is still training when the node has joined
    first = _agent(port, out, work, *args)
    _wait(lambda: _progress(out) >= 6, 120, "step 6 at world 1")
    joining = _agent(port, out, work, *args)
    logs = _finish([first, joining], out)
    attempts = _attempts(out)
    assert [len(a) for a in attempts] == [1, 2], logs
    assert [r["world"] for r in attempts[-1]] == [2, 2]
    assert attempts[-1][0]["resumed_from"] >= 5
    assert _difference(out, reference) <= TOLERANCE


# ------------------------------------------------------------------ the example


EXAMPLE = ROOT / "examples" / "train_loop.py"


def _losses_by_step(text: str) -> dict[int, str]:
    """The example's printed losses by step (a step printed again after a resume: the last)."""
    found = {}
    for line in text.splitlines():
        if line.startswith("step "):
            _, step, _, loss = line.split()
            found[int(step)] = loss
    return found


def _example(work: Path, *, kill_after: str | None) -> str:
    """Run the example under ``torchrun.sh restart static``; with ``kill_after``, SIGKILL
    one of its workers once that checkpoint exists. Return what rank 0 printed."""
    args = ["--strategy", "ddp", "--steps", "400", "--work-dir", str(work), "--save-every", "10"]
    proc = subprocess.Popen(
        ["bash", str(LAUNCH), "restart", "static", str(EXAMPLE), *args],
        env=_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        if kill_after is not None:
            # that checkpoint or a later one: keep_last=2 removes it 20 steps on, a window
            # a poll can miss on a busy machine
            least = int(kill_after.removeprefix("step_"))
            saved = lambda: [p for p in work.glob("step_*") if p.name[5:].isdigit()]  # noqa: E731
            _wait(lambda: any(int(p.name[5:]) >= least for p in saved()), 120, kill_after)
            workers = [pid for pid in _descendants(proc.pid) if _is_worker(pid)]
            assert workers, "no worker process found"
            os.kill(workers[-1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            for pid in _descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-6000:]
    return stdout


def _is_worker(pid: int) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"torch.distributed.run" not in command and any(
        part.endswith(b"train_loop.py") for part in command
    )


def test_the_example_resumes_where_it_was_after_a_worker_is_killed(tmp_path: Path) -> None:
    reference = _losses_by_step(_example(tmp_path / "reference", kill_after=None))
    printed = _example(tmp_path / "killed", kill_after="step_20")
    assert "resumed from step" in printed, printed
    resumed = int(printed.split("resumed from step")[1].split()[0])
    assert 20 <= resumed < 400
    assert _losses_by_step(printed) == reference  # every printed step, to the digit
