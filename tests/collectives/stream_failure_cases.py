"""collect_results' streamed parts with a pickling failure at other positions: at the end
of a part whose chunks already went, in a part holding out-of-band tensors, combined with
a failure while another rank's handshake travels, and an error that cannot be pickled."""

from __future__ import annotations

from typing import Any

import torch

import comm_collectives as dist

from .cases import Unpicklable
from .streamed_cases import ITEMS, _follow_up, _outcome


class _Opaque(Exception):
    """An error whose own pickling fails (a lock is not picklable)."""

    def __init__(self) -> None:
        import threading

        super().__init__("opaque failure")
        self.lock = threading.Lock()


class _RaisesOpaque:
    def __reduce__(self) -> Any:
        raise _Opaque


def stream_failure_positions() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    # 1. rank 2's last item fails: its handshake is through and chunks already went
    part: list[Any] = [f"{rank}-{i}" for i in range(ITEMS)]
    if rank == 2:
        part[-1] = Unpicklable()
    out["last"] = _outcome(dist.collect_results, part, world * ITEMS)
    out["last_next"] = _follow_up(rank, world)
    # 2. rank 1 fails at its end (streaming), rank 2 while its handshake travels
    part = [f"{rank}-{i}" for i in range(ITEMS)]
    if rank == 1:
        part[-1] = Unpicklable()
    if rank == 2:
        part[10_000] = Unpicklable()
    out["late_and_travelling"] = _outcome(dist.collect_results, part, world * ITEMS)
    out["late_and_travelling_next"] = _follow_up(rank, world)
    # 3. tensors travel out of band; rank 1 fails after them, at its end
    part = [torch.full((5000,), float(rank * 100 + i)) for i in range(40)]
    if rank == 1:
        part.append(Unpicklable())
    else:
        part.append(torch.zeros(1))
    out["after_buffers"] = _outcome(dist.collect_results, part, world * 41)
    out["after_buffers_next"] = _follow_up(rank, world)
    # 4. an error that itself cannot be pickled, while rank 1's handshake travels
    part = [f"{rank}-{i}" for i in range(ITEMS)]
    if rank == 1:
        part[10_000] = _RaisesOpaque()
    out["opaque"] = _outcome(dist.collect_results, part, world * ITEMS)
    out["opaque_next"] = _follow_up(rank, world)
    # 5. the same, before the first frame (reported in the handshake itself)
    part = [f"{rank}-{i}" for i in range(ITEMS)]
    if rank == 1:
        part[3] = _RaisesOpaque()
    out["opaque_early"] = _outcome(dist.collect_results, part, world * ITEMS)
    out["opaque_early_next"] = _follow_up(rank, world)
    return out
