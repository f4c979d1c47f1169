"""A rank that leaves a call after a transport error does not leave a live peer waiting.

The backend tells a rank nothing when the peer it waits on is alive but has left the call
(its own exchange with a dead rank failed first): the connection between the two is fine.
The leaving rank posts a failure notice in the store, and the watched waits of the
collectives (``comm_collectives._watch``) find it and leave too, naming the same lost ranks.
Here the "transport error" is simulated on one live rank, so every rank is alive and the
liveness check names no rank as lost: each rank reports the failure it saw.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from comm_collectives import _faults, _watch
from comm_core import RemoteRankError
from comm_core.testing import WorldPool

BOUND_S = 5.0  # far above a watched wait's first look at the store (50 ms)


def _leave(operation: str) -> None:
    """Leave the call as a rank does whose exchange with a dead peer failed."""
    with _faults.transport(operation, None):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1 (simulated)")


def _outcome(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except RemoteRankError as exc:
        return {
            "raised": "RemoteRankError",
            "seconds": time.monotonic() - start,
            "ranks": list(exc.ranks),
            "types": sorted({f.error_type for f in exc.failures}),
            "message": str(exc),
        }
    return {"raised": "", "seconds": time.monotonic() - start}


def left_peer(case: str) -> dict[str, Any]:
    """``"p2p"``: rank 1 leaves; rank 0 waits for a message from it, rank 2 sends it one.
    ``"collective"``: rank 2 leaves; ranks 0 and 1 start an all_reduce (the handshake's
    all-to-all waits for rank 2's frame)."""
    _faults._LIVENESS_WAIT_S = 1.0
    rank = dist.get_rank()
    message = torch.zeros(4)

    def p2p() -> None:
        if rank == 1:
            _leave("collect_results")
        work = torch_dist.irecv(message, 1) if rank == 0 else torch_dist.isend(message, 1)
        assert work is not None
        _watch.wait_p2p(work, "collect_results", None, torch.device("cpu"))

    def collective() -> None:
        if rank == 2:
            _leave("all_reduce")
        dist.all_reduce(torch.ones(4))

    return _outcome(p2p if case == "p2p" else collective)


@pytest.fixture(scope="module")
def world_of_3() -> Iterator[WorldPool]:
    with WorldPool(3, timeout=60.0, pg_timeout=10.0) as pool:
        yield pool


@pytest.mark.parametrize(("case", "leaver"), [("p2p", 1), ("collective", 2)])
def test_a_rank_waiting_on_a_peer_that_left_the_call_leaves_too(
    world_of_3: WorldPool, case: str, leaver: int
) -> None:
    try:
        out = world_of_3.run(left_peer, case)
    finally:
        world_of_3.restart()  # the group is broken: the next case starts a fresh one
    for rank, got in enumerate(out):
        assert got["raised"] == "RemoteRankError", (rank, got)
        assert got["seconds"] < BOUND_S, (rank, got)
        # every rank is alive: none is named lost, each reports what it saw
        assert got["types"] == ["comm.TransportError"], (rank, got)
        assert got["ranks"] == [rank], (rank, got)
        if rank != leaver:
            expected = f"rank {leaver} left the call: Connection closed by peer"
            assert expected in got["message"], (rank, got)
