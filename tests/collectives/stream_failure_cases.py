"""collect_results' streamed parts with a pickling failure at other positions: at the end
of a part whose chunks already went, in a part holding out-of-band tensors, combined with
a failure while another rank's handshake travels, and an error that cannot be pickled."""

from __future__ import annotations

from typing import Any

import torch

import comm_collectives as dist

from .cases import Unpicklable
from .streamed_cases import ITEMS, _run, _strings


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
    _run(out, "last", _strings(rank, {2: {ITEMS - 1: Unpicklable()}}), world * ITEMS)
    # 2. rank 1 fails at its end (streaming), rank 2 while its handshake travels
    failing = {1: {ITEMS - 1: Unpicklable()}, 2: {10_000: Unpicklable()}}
    _run(out, "late_and_travelling", _strings(rank, failing), world * ITEMS)
    # 3. tensors travel out of band; rank 1 fails after them, at its end
    part: list[Any] = [torch.full((5000,), float(rank * 100 + i)) for i in range(40)]
    part.append(Unpicklable() if rank == 1 else torch.zeros(1))
    _run(out, "after_buffers", part, world * 41)
    # 4. an error that itself cannot be pickled, while rank 1's handshake travels
    _run(out, "opaque", _strings(rank, {1: {10_000: _RaisesOpaque()}}), world * ITEMS)
    # 5. the same, before the first frame (reported in the handshake itself)
    _run(out, "opaque_early", _strings(rank, {1: {3: _RaisesOpaque()}}), world * ITEMS)
    return out
