"""Save ``latest`` twice in one process; SIGKILL it between the second save's two renames
(the old ``latest`` hidden, the new one not yet renamed into place). Started by
test_checkpoint_recovery_edges.py: ``recovery_cut_publish.py WORK_DIR``."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from comm_strategies import build_strategy
from comm_strategies.checkpoint import _publish

strategy = build_strategy("single", seed=0, work_dir=sys.argv[1])
strategy.setup_env()
strategy.prepare(
    torch.nn.Linear(4, 1), optim_wrapper={"type": "OptimWrapper", "optimizer": {"type": "SGD"}}
)
strategy.save_checkpoint("latest", extra={"step": 100})
replace = os.replace


def replace_then_die(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    replace(source, target)
    if ".old-" in Path(target).name:
        os.kill(os.getpid(), signal.SIGKILL)


_publish.os.replace = replace_then_die  # type: ignore[assignment]
strategy.save_checkpoint("latest", extra={"step": 200})
