"""collect_results' streamed parts failing at other pickling positions raise the same error
everywhere: at the end of a part whose chunks already went, in a part holding out-of-band
tensors, combined with a failure while another rank's handshake travels, and an error that
cannot be pickled."""

from __future__ import annotations

from typing import Any

import torch

import comm_collectives as dist
from tests.helpers import Unpicklable

from .streamed_parts import ITEMS, _run, _strings


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


def test_stream_failures_at_other_positions(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(stream_failure_positions, world_size=3, timeout=120)
    for rank, r in enumerate(results):
        where = f"rank {rank}: {r}"
        for step, ranks, text in (
            ("last", [2], "this object refuses to be pickled"),
            ("late_and_travelling", [1, 2], "this object refuses to be pickled"),
            ("after_buffers", [1], "this object refuses to be pickled"),
            ("opaque", [1], "opaque failure"),
            ("opaque_early", [1], "opaque failure"),
        ):
            assert r[f"{step}_next"] is True, (step, where)
            assert r[step]["raised"] == "RemoteRankError", (step, where)
            assert r[step]["ranks"] == ranks, (step, where)
            assert text in r[step]["text"], (step, where)
