"""Rank functions for the transport tests: the adaptive inline capacity and reused buffers."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from comm_collectives import buffers
from comm_collectives.protocol import inline_capacity


def capacity_adapts() -> dict[str, Any]:
    """Every rank records the capacity after each step; a fresh group starts at 4 KiB."""
    rank, world = dist.get_dist_info()
    group = torch_dist.new_group(list(range(world)))
    caps = {"start": inline_capacity(group)}
    blob = bytes([rank]) * 10_000  # pickles to ~10 KB: too big for 4 KiB, fits 12 KiB
    first = dist.all_gather_object(blob, group=group)  # long path; the capacity grows
    caps["after 10 KB"] = inline_capacity(group)
    second = dist.all_gather_object(blob, group=group)  # inline now
    caps["again"] = inline_capacity(group)
    for _ in range(32):  # 32 calls using a quarter of it or less: halved
        dist.all_reduce(torch.ones(1), group=group)
    caps["after 32 small"] = inline_capacity(group)
    huge = dist.all_gather_object(np.full(100_000, rank, dtype=np.float64), group=group)
    caps["after 800 KB"] = inline_capacity(group)  # beyond the budget: not grown
    # one rank's object fits, the other's does not: both take the long path together
    mixed = dist.all_gather_object(b"s" if rank == 0 else b"L" * 20_000, group=group)
    caps["after mixed"] = inline_capacity(group)
    torch_dist.destroy_process_group(group)
    return {
        "caps": caps,
        "first_second": (
            [len(b) for b in first],
            [b[0] for b in first],
            first == second,
        ),
        "huge": [(a.shape, float(a.min()), float(a.max())) for a in huge],
        "mixed": [(b[:1], len(b)) for b in mixed],
    }


def _summary(arrays: list[Any]) -> list[tuple[float, float, int]]:
    return [(float(a.min()), float(a.max()), int(a.size)) for a in arrays]


def buffers_reused_safely() -> dict[str, Any]:
    """Large results stay intact while later calls reuse the transfer buffers."""
    rank = dist.get_rank()
    n = 1 << 19  # 4 MiB of float64 a rank: far beyond any inline capacity
    first = dist.all_gather_object(np.full(n, rank, dtype=np.float64))
    kept_tensor = dist.all_gather(torch.full((n + rank,), float(10 + rank)))
    for step in range(3):  # buffers come and go; the kept results must not change
        dist.all_gather_object(np.full(n, 100 + step, dtype=np.float64))
    box = [np.full(n, 7.0) if rank == 0 else None]
    dist.broadcast_object_list(box)
    out: dict[str, Any] = {
        "first": _summary(first),
        "kept_tensor": [(float(t.min()), float(t.max()), t.numel()) for t in kept_tensor],
        "broadcast": _summary(box),
    }
    del first, kept_tensor, box
    gc.collect()
    out["cached_after_release"] = buffers._pool.cached_bytes() > 0
    again = dist.all_gather_object(np.full(n, -rank, dtype=np.float64))
    out["again"] = _summary(again)
    dist.empty_cache()
    out["cached_after_empty"] = buffers._pool.cached_bytes()
    return out


def collectives_per_call() -> dict[str, int]:
    """How many collectives each small call issues, read from the group's sequence number."""
    rank = dist.get_rank()
    group = torch_dist.distributed_c10d._get_default_group()
    calls = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(3)),
        "broadcast": lambda: dist.broadcast(torch.ones(3)),
        "all_gather": lambda: dist.all_gather(torch.ones(rank + 1)),
        "gather": lambda: dist.gather(torch.ones(rank + 1)),
        "all_gather_object": lambda: dist.all_gather_object({"rank": rank}),
        "gather_object": lambda: dist.gather_object({"rank": rank}),
        "broadcast_object_list": lambda: dist.broadcast_object_list([rank]),
        "all_reduce_dict": lambda: dist.all_reduce_dict({"a": torch.ones(()), "b": torch.ones(2)}),
        "sync_random_seed": dist.sync_random_seed,
    }
    counts = {}
    for name, call in calls.items():
        before = group._get_sequence_number_for_group()
        call()
        counts[name] = group._get_sequence_number_for_group() - before
    return counts


def collectives_per_call_long() -> dict[str, int]:
    """The same calls with inline data switched off: handshake plus data transfer."""
    from comm_collectives.protocol import inline_limit

    with inline_limit(0):
        return collectives_per_call()
