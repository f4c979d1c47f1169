"""A streamed part's handshake travels while its sender pickles: every header route and
combined failures raise the same error on every rank, and the group stays usable."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

import comm_collectives as dist
from comm_collectives import _capacity, _compact, _route
from comm_core import process_group
from tests.helpers import Unpicklable

from .streamed_parts import ITEMS, _follow_up, _outcome, _run, _strings

MODES = ["plain", "compact", "side", "debug"]


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


@pytest.mark.parametrize("mode", MODES)
def test_streamed_parts_under_every_route(comm_run_distributed: Any, mode: str) -> None:
    results = comm_run_distributed(streamed_matrix, mode, world_size=3, timeout=120)
    assert results[0]["ok"] == {"raised": "", "ranks": None, "value": True}
    assert [r["ok"]["raised"] for r in results] == ["", "", ""]
    for rank, r in enumerate(results):
        where = f"rank {rank}: {r}"
        for step in ("ok", "announcing", "both", "mismatch"):
            assert r[f"{step}_next"] is True, where
        assert r["announcing"]["raised"] == "RemoteRankError", where
        assert r["announcing"]["ranks"] == [2], where
        assert "this object refuses to be pickled" in r["announcing"]["text"], where
        # the handshake saw rank 1's failure first: that is the error of every rank
        assert r["both"]["raised"] == "RemoteRankError", where
        assert r["both"]["ranks"] == [1], where
        assert r["mismatch"]["raised"] == "CollectiveMismatchError", where
        assert "tmpdir" in r["mismatch"]["text"], where
        if mode == "debug":
            assert "call site" in r["mismatch"]["text"], where
    # the inline capacities stay equal on every rank
    assert results[0]["ok_states"] == results[1]["ok_states"] == results[2]["ok_states"]
    assert results[0]["end_states"] == results[1]["end_states"] == results[2]["end_states"]
