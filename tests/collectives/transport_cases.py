"""Rank functions for the transport tests: the adaptive inline capacity and reused buffers."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from comm_collectives import _buffers as buffers
from comm_collectives._capacity import inline_capacity


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
    from comm_collectives._capacity import inline_limit

    with inline_limit(0):
        return collectives_per_call()


def _large_object(src: int) -> dict[str, Any]:
    """An object whose frame has pieces above and below the direct threshold (4 MiB)."""
    n = (4 << 20) // 4 + 7  # a float32 array just over 4 MiB
    grid = torch.arange(2048 * 1024, dtype=torch.float32).reshape(2048, 1024) + src
    return {
        "array": np.arange(n, dtype=np.float32) * (src + 1),
        "small": torch.arange(10) * (src + 2),
        "text": f"from rank {src}",
        "float64": torch.full((1 << 19,), float(src) + 0.5, dtype=torch.float64),  # 4 MiB
        "read_only": np.frombuffer(bytes(range(256)) * (1 << 14), dtype=np.uint8),  # 4 MiB
        "strided": grid[:, ::2],  # not contiguous: pickled as a contiguous 4 MiB copy
        "bf16": torch.full((3,), 1.5 + src, dtype=torch.bfloat16),
        "words": [f"w{i}" for i in range(600_000)],  # an in-band stream over 4 MiB
    }


def _describe(obj: dict[str, Any]) -> dict[str, Any]:
    array, grid = obj["array"], obj["strided"]
    return {
        "array": (array.shape, float(array[1]), float(array[-1])),
        "small": obj["small"].tolist(),
        "text": obj["text"],
        "float64": (obj["float64"].dtype, obj["float64"].numel(), float(obj["float64"].sum())),
        "read_only": (
            obj["read_only"].size,
            int(obj["read_only"][257]),
            int(obj["read_only"].sum()),
        ),
        "strided": (tuple(grid.shape), float(grid[1, 1]), float(grid[-1, -1])),
        "bf16": (obj["bf16"].dtype, obj["bf16"].tolist()),
        "words": (len(obj["words"]), obj["words"][0], obj["words"][-1]),
    }


def expected_large_object(src: int) -> dict[str, Any]:
    """Hand-derived description of :func:`_large_object` (independent of pickling)."""
    n = (4 << 20) // 4 + 7
    return {
        "array": ((n,), float(src + 1), float((n - 1) * (src + 1))),
        "small": [k * (src + 2) for k in range(10)],
        "text": f"from rank {src}",
        "float64": (torch.float64, 1 << 19, (float(src) + 0.5) * (1 << 19)),
        "read_only": (4 << 20, 1, (255 * 256 // 2) * (1 << 14)),
        "strided": ((2048, 512), 1024.0 + 2 + src, 2047 * 1024 + 1022 + src),
        "bf16": (torch.bfloat16, [1.5 + src] * 3),
        "words": (600_000, "w0", "w599999"),
    }


def broadcast_large_pieces(src: int, long_path: bool) -> dict[str, Any]:
    """broadcast_object_list of :func:`_large_object` from ``src``; every rank records the
    plan of messages it derived and how many collectives the call took."""
    from comm_collectives import objects
    from comm_collectives._capacity import inline_limit

    rank = dist.get_rank()
    group = torch_dist.distributed_c10d._get_default_group()
    plans: list[list[tuple[int, int, int]]] = []
    sent: list[tuple[int, str | None]] = []  # the root's messages: piece, memory they lie in
    original, original_message = objects._broadcast_plan, objects._plan_message
    obj = _large_object(src)
    sources = {
        "array": (obj["array"].ctypes.data, obj["array"].nbytes),
        "float64": (obj["float64"].data_ptr(), obj["float64"].numel() * 8),
        "read_only": (obj["read_only"].ctypes.data, obj["read_only"].nbytes),
    }

    def recording(*args: Any) -> list[tuple[int, int, int]]:
        plan = original(*args)
        plans.append(plan)
        return plan

    def recording_message(encoded: Any, first: int, end: int, piece: int) -> torch.Tensor:
        message = original_message(encoded, first, end, piece)
        address = message.data_ptr()
        inside = [name for name, (a, n) in sources.items() if a <= address < a + n]
        sent.append((piece, inside[0] if inside else None))
        return message

    objects._broadcast_plan = recording  # type: ignore[assignment]
    objects._plan_message = recording_message  # type: ignore[assignment]
    try:
        box: list[Any] = [obj if rank == src else None]
        before = group._get_sequence_number_for_group()
        if long_path:
            with inline_limit(0):
                dist.broadcast_object_list(box, src=src)
        else:
            dist.broadcast_object_list(box, src=src)
        collectives = group._get_sequence_number_for_group() - before
        # one big array alone: the handshake and one message, as for a copied frame
        single: list[Any] = [np.full(1 << 21, 3.0) if rank == src else None]
        before = group._get_sequence_number_for_group()
        dist.broadcast_object_list(single, src=src)
        single_collectives = group._get_sequence_number_for_group() - before
    finally:
        objects._broadcast_plan = original  # type: ignore[assignment]
        objects._plan_message = original_message  # type: ignore[assignment]
    return {
        "object": _describe(box[0]),
        "plans": plans,
        "sent": sent,
        "collectives": collectives,
        "single": (float(single[0].min()), float(single[0].max()), single[0].size),
        "single_collectives": single_collectives,
    }
