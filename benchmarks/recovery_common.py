"""What the recovery benchmark's two jobs share (comm's and plain torch's): no comm import.

The process's start time, the kill schedule and the kill itself, and the checkpoint-cost
blocks. Imported first by each job (before torch) so that the process start is read early.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The global batch (samples per optimizer step over all ranks) and AdamW's learning rate.
GLOBAL_BATCH = 64
LR = 2e-3


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The jobs' command line (both jobs take the same)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp2"])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-attempts", type=int, default=0)
    parser.add_argument("--cost", default="", help="K1,K2,..: the checkpoint-cost mode")
    parser.add_argument("--block-steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    return parser.parse_args(argv)


def process_start() -> float:
    """This process's start (exec) as a ``time.time()`` value, from /proc (10 ms ticks)."""
    try:
        with open("/proc/self/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
        return time.time() - (uptime - int(fields[19]) / ticks)
    except (OSError, ValueError, IndexError):
        return float("nan")


def restart_count() -> int:
    """The launch attempt: torchrun's restart count (0 for the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Record:
    """This process's timestamps, in ``OUT/attempt-<restart count>-rank<RANK>.json``.

    Rewritten at each mark, so that a process that hangs or dies shows the last phase
    it finished. The rank is torchrun's ``RANK`` (known before the process group).
    """

    def __init__(self, out: Path, started: float, imported: float) -> None:
        rank = int(os.environ.get("RANK", "0"))
        self.path = out / f"attempt-{restart_count()}-rank{rank}.json"
        self.values: dict[str, Any] = {
            "rank": rank,
            "restart_count": restart_count(),
            "process_start": started,
            "imported": imported,
        }

    def mark(self, phase: str, **facts: Any) -> None:
        """Note that ``phase`` ended now (with ``facts``), and rewrite the file."""
        self.values[phase] = time.time()
        self.values.update(facts)
        self.path.write_text(json.dumps(self.values))


def kill_step(
    *, kill_at: int, kill_rank: int, kill_attempts: int, save_every: int, rank: int, resumed: int
) -> int:
    """The step after which this rank dies in this attempt (-1: it does not).

    ``kill_attempts`` > 0 (the stress run): in each of the first ``kill_attempts``
    attempts (restart count c), rank ``c % 2`` dies ``save_every + 1 + c % (save_every - 1)``
    steps after the step it resumed from. Otherwise rank ``kill_rank`` dies after step
    ``kill_at`` (> 0) of the first attempt.
    """
    count = restart_count()
    if kill_attempts:
        if count >= kill_attempts or rank != count % 2:
            return -1
        return resumed + save_every + 1 + count % max(save_every - 1, 1)
    if kill_at > 0 and count == 0 and rank == kill_rank:
        return kill_at
    return -1


def die(out: Path, step: int, rank: int, resumed: int) -> None:
    """Note the kill in ``OUT/killed-<restart count>.json`` and SIGKILL this process."""
    record = {
        "time": time.time(),
        "step": step,
        "rank": rank,
        "resumed_from": resumed,
        "restart_count": restart_count(),
        "pid": os.getpid(),
    }
    with open(out / f"killed-{restart_count()}.json", "x") as mark:
        json.dump(record, mark)
    os.kill(os.getpid(), signal.SIGKILL)


def slowest(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks (of the default process group)."""
    import torch
    import torch.distributed as torch_dist

    tensor = torch.tensor(values, dtype=torch.float64)
    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


def cost_blocks(
    *,
    intervals: list[int],
    block_steps: int,
    repeats: int,
    warmup: int,
    step: Callable[[], None],
    save: Callable[[int, int], Any],
    wait: Callable[[Any], None],
    staged: Callable[[], float],
) -> dict[str, list[dict[str, float]]]:
    """Blocks of ``block_steps`` steps: none, or a save every k steps, in rotating order.

    A block with saves starts one at steps 0, k, 2k, ... of the block (so that the last
    one has k steps to be written before the block ends) and waits for the last one at
    the end, inside the block's time. Per block, the slowest rank's: the block's time,
    the time spent waiting for the previous save (``wait_s``), in the save call
    (``call_s``), and in its CPU copy (``stage_s``, inside the call; comm only).
    """
    import torch.distributed as torch_dist

    kinds = [0, *intervals]
    samples: dict[str, list[dict[str, float]]] = {str(k): [] for k in kinds}
    for repeat in range(warmup + repeats):
        shift = repeat % len(kinds)
        for every in kinds[shift:] + kinds[:shift]:
            handle = None
            waited = called = 0.0
            stage_before = staged()
            torch_dist.barrier()
            start = time.perf_counter()
            for index in range(block_steps):
                if every and index % every == 0:
                    if handle is not None:
                        mark = time.perf_counter()
                        wait(handle)
                        waited += time.perf_counter() - mark
                    mark = time.perf_counter()
                    handle = save(every, index)
                    called += time.perf_counter() - mark
                step()
            if handle is not None:
                mark = time.perf_counter()
                wait(handle)
                waited += time.perf_counter() - mark
            elapsed = time.perf_counter() - start
            stage_s = staged() - stage_before
            block, wait_s, call_s, stage_s = slowest([elapsed, waited, called, stage_s])
            if repeat >= warmup:
                samples[str(every)].append(
                    {"block_s": block, "wait_s": wait_s, "call_s": call_s, "stage_s": stage_s}
                )
    return samples
