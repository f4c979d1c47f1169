"""A training run that checkpoints every 2 steps and resumes from the latest checkpoint.

Started by tests/strategies/test_checkpoint_kill.py on 2 ranks (one process each, rank
variables set by the test). ``COMM_TEST_KILL`` makes every rank SIGKILL itself:
``train:N`` right after the optimizer step N, ``save:N`` inside the save at step N, once
every rank has written its files and before the folder is renamed into place. With
``--async-save`` the saves are ``async_save=True`` (the kill ``save:N`` then comes from the
background thread that writes the save of step N, while training goes on; ``train:N``
waits for the last save to be published first); the last handle is waited for before the
parameters are written.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import comm_core  # noqa: E402
from comm_strategies.checkpoint import (  # noqa: E402
    SaveHandle,
    find_latest,
    load_checkpoint,
    save_checkpoint,
)
from tests.helpers import full_params  # noqa: E402
from tests.strategies.ckpt_models import build, strategy_of, torch_optimizer  # noqa: E402
from tests.strategies.ckpt_seams import patch_step  # noqa: E402
from tests.wrappers.net import batch  # noqa: E402


def _die(*_: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    kill = os.environ.get("COMM_TEST_KILL", "")
    when, _, at = kill.partition(":")
    torch.set_num_threads(1)
    # A file store (fresh for each run): no port to race for on a shared machine.
    comm_core.init_dist("pytorch", "gloo", init_method=f"file://{os.environ['COMM_TEST_STORE']}")
    rank = comm_core.get_rank()
    model, optim = build(args.kind)
    scheduler = torch.optim.lr_scheduler.StepLR(torch_optimizer(optim), step_size=2, gamma=0.5)
    torch.manual_seed(100 + rank)
    start = 0
    handle = None
    latest = find_latest(args.work_dir)
    if latest is not None:
        extra = load_checkpoint(
            latest,
            model=model,
            optim_wrapper=optim,
            schedulers=[scheduler],
        )
        start = int(extra["step"])
    for step in range(start, args.steps):
        inputs, targets = batch(step, 0, rank)
        # Noise from the global generator: the run depends on the restored RNG state.
        inputs = inputs + 0.1 * torch.randn_like(inputs)
        model.train_step((inputs, targets), optim)
        scheduler.step()
        done = step + 1
        if when == "train" and int(at) == done:
            if isinstance(handle, SaveHandle):  # killed once the last save is published
                handle.wait()
            _die()
        if done % 2 == 0:
            if when == "save" and int(at) == done:
                patch_step("written", _die)
            handle = save_checkpoint(
                Path(args.work_dir) / f"step_{done}",
                model=model,
                optim_wrapper=optim,
                schedulers=[scheduler],
                strategy=strategy_of(args.kind),
                extra={"step": done},
                async_save=args.async_save,
            )
    if isinstance(handle, SaveHandle):
        handle.wait()
    params = full_params(model)
    if rank == 0:
        torch.save({"params": params, "start": start}, args.out)
    comm_core.destroy_dist()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown: torch 2.13's gloo may abort a finished process
    # there ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
