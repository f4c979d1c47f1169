"""An MMEngine runner job that survives its own death: run under torchrun by
test_recovery_runners.py.

What a user writes: ``resume=True`` and a ``work_dir``, a ``CheckpointHook`` saving every
``--save-every`` iterations (``by_epoch=False``, ``max_keep_ckpts=2``), and either

- ``--runner flexible``: MMEngine's ``FlexibleRunner`` with ``CommDDPStrategy`` or
  ``CommFSDPStrategy`` (``fsdp_version=2``);
- ``--runner classic``: MMEngine's ``Runner`` (``launcher="pytorch"``) with
  ``CommDistributedDataParallel`` and ``CommRunnerHook``; nothing is called before the
  runner is built (importing the integration is all).

The model and data are test_runner.py's. With ``--kill WHERE:ITER`` rank ``--kill-rank``
SIGKILLs itself once in the job (the first process to get there leaves ``OUT/killed``):

- ``step:N``: after iteration N (N not a save's);
- ``pointer:N``: once the save of iteration N returned, before ``CheckpointHook`` writes
  ``work_dir/last_checkpoint`` (rank 0 writes it: use ``--kill-rank 0``);
- ``save:N`` (flexible): inside comm's save of iteration N, when rank 0 is about to
  publish it (every rank wrote its part; the folder is still temporary).

Each process writes ``OUT/attempt-<token>-rank<R>.json`` (world, the iteration it resumed
from, what ``last_checkpoint`` named when it started, timestamps); rank 0 writes the final
parameters to ``OUT/final.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

STARTED = time.time()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.*

import torch  # noqa: E402
from mmengine.hooks import Hook  # noqa: E402
from mmengine.runner import FlexibleRunner, Runner  # noqa: E402

from comm_core._attempt import current_attempt  # noqa: E402
from comm_strategies.checkpoint import _publish  # noqa: E402
from tests.strategies.test_runner import Classifier, Points  # noqa: E402

STRATEGIES = {
    "ddp": {"type": "CommDDPStrategy"},
    "fsdp2": {"type": "CommFSDPStrategy", "fsdp_version": 2},
}


def _die(out: Path, where: str) -> None:
    """Leave the mark (the kill happens once a job), note the time, SIGKILL this process."""
    try:
        with open(out / "killed", "x") as mark:
            json.dump({"where": where, "time": time.time(), "pid": os.getpid()}, mark)
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


class RecoveryHook(Hook):  # type: ignore[misc]
    """Records each attempt, and kills this rank where ``--kill`` says."""

    priority = "LOWEST"  # after CheckpointHook and CommRunnerHook

    def __init__(self, out: Path, kill: str, victim: int, pointer: str | None) -> None:
        where, _, at = kill.partition(":")
        armed = bool(where) and not (out / "killed").exists()
        self.out, self.where, self.at = out, where if armed else "", int(at or -1)
        self.victim, self.pointer = victim, pointer

    def before_run(self, runner: Any) -> None:
        if runner.rank != self.victim:
            return
        if self.where == "pointer":
            original = runner.save_checkpoint

            def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
                result = original(*args, **kwargs)
                filename = kwargs.get("filename", args[1] if len(args) > 1 else "")
                if filename == f"iter_{self.at}.pth":
                    _die(self.out, self.where)
                return result

            runner.save_checkpoint = save_checkpoint
        elif self.where == "save":
            finish = _publish.finish

            def finishing(temporary: Path, final: Path) -> None:
                if final.name == f"iter_{self.at}.pth":
                    _die(self.out, self.where)
                finish(temporary, final)

            _publish.finish = finishing  # type: ignore[assignment]

    def before_train(self, runner: Any) -> None:
        record = {
            "rank": runner.rank,
            "world": runner.world_size,
            "attempt": current_attempt(),
            "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
            "resumed_from": runner.iter,
            "pointer_at_start": self.pointer,
            "started": STARTED,
            "training": time.time(),
        }
        name = f"attempt-{current_attempt()}-rank{runner.rank}.json"
        (self.out / name).write_text(json.dumps(record))

    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None
    ) -> None:
        if self.where == "step" and runner.rank == self.victim and runner.iter + 1 == self.at:
            _die(self.out, self.where)


def _runner(args: argparse.Namespace, hook: Hook) -> Any:
    common: dict[str, Any] = {
        "model": Classifier(),
        "work_dir": args.work_dir,
        "train_dataloader": {
            "dataset": Points(),
            "sampler": {"type": "DefaultSampler", "shuffle": True, "seed": 3},
            "batch_size": 4,
            "num_workers": 0,
        },
        "optim_wrapper": {
            "type": "OptimWrapper",
            "optimizer": {"type": "SGD", "lr": 0.2, "momentum": 0.9},
        },
        "param_scheduler": {
            "type": "MultiStepLR",
            "milestones": [args.iters // 2],
            "gamma": 0.5,
            "by_epoch": False,
        },
        "train_cfg": {"by_epoch": False, "max_iters": args.iters},
        "default_hooks": {
            "logger": {"type": "LoggerHook", "interval": 100},
            "checkpoint": {
                "type": "CheckpointHook",
                "interval": args.save_every,
                "by_epoch": False,
                "max_keep_ckpts": 2,
            },
        },
        "launcher": "pytorch",
        "env_cfg": {"dist_cfg": {"backend": "gloo"}},
        "randomness": {"seed": 0},
        "resume": True,
        "log_level": "WARNING",
    }
    if args.runner == "flexible":
        return FlexibleRunner(strategy=STRATEGIES[args.strategy], custom_hooks=[hook], **common)
    return Runner(
        custom_hooks=[{"type": "CommRunnerHook"}, hook],
        cfg={"model_wrapper_cfg": {"type": "CommDistributedDataParallel"}},
        **common,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runner", choices=["flexible", "classic"], default="flexible")
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="ddp")
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kill", default="")
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import comm_strategies.integrations.mmengine  # noqa: F401 - registers, routes init

    out = Path(args.out)
    pointer_file = Path(args.work_dir) / "last_checkpoint"
    pointer = pointer_file.read_text().strip() if pointer_file.is_file() else None
    hook = RecoveryHook(out, args.kill, args.kill_rank, pointer)
    runner = _runner(args, hook)
    runner.train()
    if args.runner == "flexible":
        state = runner.strategy.model_state_dict()
    else:
        state = {k: v.detach().cpu() for k, v in runner.model.module.state_dict().items()}
    if runner.rank == 0:
        torch.save({"params": state, "iter": runner.iter}, out / "final.pt")


if __name__ == "__main__":
    main()
