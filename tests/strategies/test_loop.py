"""examples/train_loop.py runs unchanged under every strategy."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "examples" / "train_loop.py"
STEPS = "12"


def _losses(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"loss (\d+\.\d+)", text)]


def run_loop_in_world(strategies: list[str]) -> dict[str, list[float]]:
    """Run the example's main on this rank of the test world, once per strategy."""
    spec = importlib.util.spec_from_file_location("train_loop", LOOP)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = {}
    for strategy in strategies:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            module.main(["--strategy", strategy, "--steps", STEPS])
        out[strategy] = _losses(buffer.getvalue())
    return out


def _run_script(strategy: str, nproc: int) -> list[float]:
    return _losses(_script_output(strategy, nproc).stdout)


def _script_output(strategy: str, nproc: int) -> subprocess.CompletedProcess[str]:
    args = [str(LOOP), "--strategy", strategy, "--steps", STEPS]
    if nproc == 1:
        command = [sys.executable, *args]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args,
        ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-6000:]
    return done


def test_the_loop_gives_the_same_losses_under_every_strategy(comm_run_distributed: Any) -> None:
    # Every strategy computes the same updates from the same global batches: the printed
    # (rank-averaged) losses agree to the printed digits.
    reference = _run_script("single", 1)  # a plain process
    assert len(reference) == 3
    assert reference[-1] < reference[0]
    names = ["ddp", "fsdp", "fsdp2", "deepspeed"]
    by_rank = comm_run_distributed(run_loop_in_world, names, timeout=240)
    for name in names:
        assert by_rank[0][name] == pytest.approx(reference, abs=2e-4), name
    # The script itself under torchrun, and a distributed strategy in a plain process (a
    # private world of one).
    assert _run_script("fsdp", 2) == pytest.approx(reference, abs=2e-4)
    assert _run_script("ddp", 1) == pytest.approx(reference, abs=2e-4)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_example_ends_like_an_ordinary_program(strategy: str) -> None:
    # No os._exit at its end: the interpreter's own teardown runs after comm's exit
    # teardown destroyed the group (20 runs a strategy in the note; two here).
    for _ in range(2):
        done = _script_output(strategy, 2)
        assert "terminate called" not in done.stderr, done.stderr[-4000:]
        assert len(_losses(done.stdout)) == 3
