"""Module-level functions for test_rendezvous_agree.py, run on every rank of a real gloo world."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from comm_collectives import _route, _store
from comm_core import CommTimeoutError, RemoteRankError, process_group

# "/data/café-R" written in Latin-1: the byte 0xE9 is not UTF-8, as in a path read from disk
NOT_UTF8 = b"/data/caf\xe9-".decode("utf-8", "surrogateescape")


def rendezvous_values(key: str) -> dict[str, Any]:
    """Rank-dependent strings on the world, a string that is not UTF-8, and a subgroup of
    the first and the last rank (group ranks 0 and 1)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    out["plain"] = dist.rendezvous(f"{key}/plain", f"rank {rank} " * (rank + 1), timeout=3.0)
    out["bytes"] = [
        s.encode("utf-8", "surrogateescape")
        for s in dist.rendezvous(f"{key}/bytes", f"{NOT_UTF8}{rank}", timeout=3.0)
    ]
    ends = torch_dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        out["ends"] = dist.rendezvous(f"{key}/ends", f"end {rank}", timeout=3.0, group=ends)
    torch_dist.destroy_process_group(ends)
    return out


def rendezvous_without_a_rank(key: str, timeout: float, withdraw: bool) -> dict[str, Any]:
    """Every rank but the last calls; what they raised, how fast, and whether the key stays."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == world - 1:
        return {}
    start = time.monotonic()
    try:
        dist.rendezvous(key, f"v{rank}", timeout=timeout, withdraw_on_timeout=withdraw)
    except CommTimeoutError as exc:
        seconds = time.monotonic() - start
        mine_left = _store.default_store().check([f"{key}/{rank}"])
        return {
            "message": str(exc),
            "missing": exc.missing,  # type: ignore[attr-defined]
            "seconds": seconds,
            "mine_left": mine_left,
        }
    return {"message": "returned"}


def agree_outcomes(side: bool) -> dict[str, Any]:
    """Nobody failed, one rank failed, two ranks failed; with and without a timeout
    (``side``: the votes on a CPU side group, as under nccl)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = _route.side_channel, process_group._CPU_BACKENDS
    if side:
        _route.side_channel, process_group._CPU_BACKENDS = True, ()
    out: dict[str, Any] = {}
    try:
        for timeout in (None, 3.0):
            out[f"none/{timeout}"] = _outcome("load", None, timeout)
            one = ValueError(f"bad shard {rank}") if rank == 1 else None
            out[f"one/{timeout}"] = _outcome("load", one, timeout)
            two = OSError(f"disk full on {rank}") if rank != 1 else None
            out[f"two/{timeout}"] = _outcome("save", two, timeout)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        out["next"] = float(t) == world * (world + 1) / 2
    finally:
        _route.side_channel, process_group._CPU_BACKENDS = saved
    return out


def _outcome(step: str, error: BaseException | None, timeout: float | None) -> Any:
    try:
        dist.agree(step, error, timeout=timeout)
    except RemoteRankError as exc:
        return {
            "ranks": list(exc.ranks),
            "types": [f.error_type for f in exc.failures],
            "messages": [f.message for f in exc.failures],
            "text": str(exc),
        }
    return "returned"


def agree_without_a_rank(timeout: float) -> dict[str, Any]:
    """Rank 0 votes; the other ranks never do. What rank 0 raised and how fast."""
    if dist.get_rank() != 0:
        return {}
    start = time.monotonic()
    try:
        dist.agree("write shards", timeout=timeout)
    except CommTimeoutError as exc:
        return {"message": str(exc), "seconds": time.monotonic() - start}
    return {"message": "returned"}
