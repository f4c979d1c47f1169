"""The project modules a default FSDP2 ``dcp`` save runs through, in order.

One process (a gloo group of 1) prepares a small model under the ``fsdp2`` strategy and
saves it with ``Strategy.save_checkpoint`` (format ``dcp``, no ``timeout=``) under a
profiler. A stop is a call into another project module (comm-strategies, comm-wrappers)
made by the save's own code (``_checkpointing`` and the checkpoint package) or by torch
calling back into project code; what an adapter calls inside comm-wrappers is the
adapter's own business and not followed. A jump back is a stop into a module that is
still running further up the stack: control coming back up, as a callback does. Prints
the stops in order, the number of modules (the first included) and of jump backs.

    python benchmarks/trace_save.py            # this checkout
    PYTHONPATH=OLD/packages/comm-strategies/src:OLD/packages/comm-wrappers/src \
        python benchmarks/trace_save.py        # another checkout's packages
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

PACKAGES = ("comm_strategies", "comm_wrappers")
OWN = ("comm_strategies/checkpoint/", "comm_strategies/_checkpointing")


def module_of(filename: str) -> str | None:
    parts = Path(filename).parts
    for index, part in enumerate(parts):
        if part in PACKAGES:
            return "/".join(parts[index:]).removesuffix(".py")
    return None


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import torch

    from comm_strategies import build_strategy

    strategy = build_strategy("fsdp2", seed=0)
    strategy.prepare(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)),
        optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.1}},
    )
    folder = Path(tempfile.mkdtemp()) / "step_1"
    strategy.save_checkpoint(folder)  # the first save imports lazily; trace the second
    stops: list[tuple[str, bool]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = module_of(frame.f_code.co_filename)
        if callee is None:
            return
        caller, foreign = None, False
        above: list[str] = []
        back = frame.f_back
        while back is not None:
            module = module_of(back.f_code.co_filename)
            if module is None:
                foreign = foreign or caller is None
            elif caller is None:
                caller = module
            else:
                above.append(module)
            back = back.f_back
        if caller == callee and not foreign:
            return
        if not foreign and (caller is None or not caller.startswith(OWN)):
            return
        stops.append((callee, callee in above))

    sys.setprofile(profile)
    try:
        strategy.save_checkpoint(folder)
    finally:
        sys.setprofile(None)
    first = "comm_strategies/_checkpointing"
    seen = {first}
    print(f"  {first}")
    jumps = 0
    for module, back in stops:
        if back:
            jumps += 1
            print(f"  back to {module}")
        elif module not in seen:
            print(f"  {module}")
        seen.add(module)
    print(f"{len(seen)} project modules, {jumps} jumps back")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
