"""collect_results' streamed parts, whose handshake travels while the sender pickles, under
every header route (plain, the compact exchange of worlds over 64 ranks, the CPU side
group of the nccl layout, debug mode) and combined failures."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

import comm_collectives as dist
from comm_collectives import _capacity, _compact, _route
from comm_core import CollectiveMismatchError, RemoteRankError, process_group

from .cases import Unpicklable

ITEMS = 30_000  # about 260 KB pickled: streamed


@contextlib.contextmanager
def _on_route(mode: str) -> Iterator[None]:
    saved = _compact.COMPACT_ABOVE, _route.side_channel, process_group._CPU_BACKENDS
    previous = os.environ.get("COMM_DEBUG")
    if mode == "compact":
        _compact.COMPACT_ABOVE = 1
    elif mode == "side":
        _route.side_channel, process_group._CPU_BACKENDS = True, ()
    elif mode == "debug":
        os.environ["COMM_DEBUG"] = "1"
    try:
        yield
    finally:
        _compact.COMPACT_ABOVE, _route.side_channel, process_group._CPU_BACKENDS = saved
        if previous is None:
            os.environ.pop("COMM_DEBUG", None)
        else:
            os.environ["COMM_DEBUG"] = previous


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


def _capacities() -> list[int]:
    group = dist.get_cpu_group()
    state = _capacity.capacity_state(group)
    default = _capacity.capacity_state(None)
    return [state.capacity, state.quiet, default.capacity, default.quiet]


def streamed_matrix(mode: str) -> dict[str, Any]:
    """Each scenario of a world of 3 (ranks 1 and 2 send streamed parts): what every rank
    raised, whether the next calls worked, and the inline states after it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    with _on_route(mode):
        # 1. no failure: rank 0 gets the parts interleaved
        part = [f"{rank}-{i}" for i in range(ITEMS)]
        got = _outcome(dist.collect_results, part, world * ITEMS)
        if rank == 0 and not got["raised"]:
            want = [f"{i % world}-{i // world}" for i in range(world * ITEMS)]
            got["value"] = got["value"] == want
        out["ok"] = got
        out["ok_next"] = _follow_up(rank, world)
        out["ok_states"] = _capacities()
        # 2. rank 2's item 10,000 cannot be pickled: its handshake is under way then
        _run(out, "announcing", _strings(rank, {2: {10_000: Unpicklable()}}), world * ITEMS)
        # 3. rank 1 fails before its first frame (reported in the handshake); rank 2 fails
        #    while its handshake travels: every rank raises the handshake's error
        failing = {1: {10: Unpicklable()}, 2: {10_000: Unpicklable()}}
        _run(out, "both", _strings(rank, failing), world * ITEMS)
        # 4. rank 2 passes a tmpdir, the others do not: rank 1 learns of the mismatch
        #    from inside its pickler's write
        tmpdir = "/tmp/comm-streamed-mismatch" if rank == 2 else None
        _run(out, "mismatch", _strings(rank), world * ITEMS, tmpdir=tmpdir)
        out["end_states"] = _capacities()
    return out
