"""comm-doctor checks of this layer (entry point ``comm.doctor``: ``collectives``)."""

from __future__ import annotations

import time

import torch

from comm_core import get_rank, get_world_size
from comm_core.doctor import CheckResult

from .objects import all_gather_object
from .tensors import all_gather

# CheckResult is re-exported so the layers above build their checks through this layer.
__all__ = ["CheckResult", "check"]


def check() -> list[CheckResult]:
    """Check an object all-gather (with a tensor inside) and an uneven tensor all-gather."""
    rank, world = get_rank(), get_world_size()
    start = time.perf_counter()
    objects = all_gather_object({"rank": rank, "t": torch.full((rank + 1,), float(rank))})
    ms = 1000 * (time.perf_counter() - start)
    ok = [o["rank"] for o in objects] == list(range(world)) and all(
        o["t"].tolist() == [float(r)] * (r + 1) for r, o in enumerate(objects)
    )
    results = [CheckResult("all_gather_object", ok, f"{ms:.2f} ms" if ok else repr(objects))]
    parts = all_gather(torch.arange(rank + 1))
    ok = [p.tolist() for p in parts] == [list(range(r + 1)) for r in range(world)]
    results.append(
        CheckResult("uneven all_gather", ok, "shapes " + ",".join(str(len(p)) for p in parts))
    )
    return results
