"""Restart probe: a job whose first attempt dies, run under ``torchrun --max-restarts 1``.

Usage: restart_probe.py OUTDIR WHERE. In the first attempt (``TORCHELASTIC_RESTART_COUNT``
0) one rank SIGKILLs itself at WHERE:

- ``asked``: rank 1, once it has this attempt's token, before the group is made;
- ``answered``: rank 0, once it has answered every rank, before the group is made;
- ``collective``: rank 1, after rank 0 has posted ``probe/value`` in the group's store
  and both have taken part in one all_reduce.

Every attempt that gets that far posts ``probe/value`` (rank 0, half a second late: its
attempt's name), which rank 1 reads at once: the next attempt must wait for its own value,
never read the dead one's. Each
rank of the last attempt writes OUTDIR/rank<R>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as torch_dist

import comm_core as dist
from comm_core import _attempt, process_group


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    outdir, where = sys.argv[1], sys.argv[2]
    first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    if first and where in ("asked", "answered"):
        agree = _attempt.attempt_store

        def agree_then_die(*args: Any, **kwargs: Any) -> Any:
            store = agree(*args, **kwargs)
            if rank == (1 if where == "asked" else 0):
                _die()
            return store

        process_group.attempt_store = agree_then_die  # type: ignore[assignment]
    dist.init_dist("pytorch", timeout=60)
    store = torch_dist.distributed_c10d._get_default_store()
    if rank == 0:  # late on purpose: rank 1's read waits for it, unless a stale value is there
        time.sleep(0.5)
        store.set("probe/value", f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}")
    seen = store.get("probe/value").decode() if rank == 1 else ""
    total = torch.tensor([rank + 1.0])
    torch_dist.all_reduce(total)
    if first and where == "collective" and rank == 1:
        _die()
    seen = seen or store.get("probe/value").decode()
    record = {
        "rank": rank,
        "restart_count": os.environ["TORCHELASTIC_RESTART_COUNT"],
        "attempt": _attempt.current_attempt(),
        "sum": total.item(),
        "seen": seen,
    }
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    dist.barrier()
    dist.destroy_dist()


if __name__ == "__main__":
    main()
