"""collect_results' streamed parts (about 260 KB pickled a rank, sent while pickled): the
parts, and one call with what every rank raised and whether the next calls still work.

Shared by test_streamed_handshake.py and test_stream_failures.py.
"""

from __future__ import annotations

from typing import Any

import torch

import comm_collectives as dist
from comm_core import CollectiveMismatchError, RemoteRankError

ITEMS = 30_000  # about 260 KB pickled: streamed


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        value = fn(*args, **kwargs)
    except RemoteRankError as exc:
        return {"raised": "RemoteRankError", "ranks": list(exc.ranks), "text": str(exc)}
    except CollectiveMismatchError as exc:
        return {"raised": "CollectiveMismatchError", "ranks": None, "text": str(exc)}
    except Exception as exc:
        return {"raised": f"unexpected {type(exc).__name__}", "ranks": None, "text": str(exc)}
    return {"raised": "", "ranks": None, "value": value}


def _follow_up(rank: int, world: int) -> bool:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    again = dist.collect_results([f"again {rank}"], world)
    want = [f"again {r}" for r in range(world)] if rank == 0 else None
    return float(t) == world * (world + 1) / 2 and again == want


def _strings(rank: int, failing: dict[int, dict[int, Any]] | None = None) -> list[Any]:
    """This rank's part of ``ITEMS`` short strings; ``failing[rank]`` replaces items by index."""
    part: list[Any] = [f"{rank}-{i}" for i in range(ITEMS)]
    for index, item in (failing or {}).get(rank, {}).items():
        part[index] = item
    return part


def _run(out: dict[str, Any], name: str, part: list[Any], size: int, **kwargs: Any) -> None:
    """collect_results of ``part`` as ``out[name]``, then whether the next calls work."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out[name] = _outcome(dist.collect_results, part, size, **kwargs)
    out[f"{name}_next"] = _follow_up(rank, world)
