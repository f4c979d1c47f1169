"""``settle``: the wait on a handshake's frames polls for ``SPIN_SECONDS``, then blocks.

A peer that comes later than the polling lasts is waited for (the data is right, the wait
lasted as long as the peer's delay), and a handshake behind a late rank still checks its
header: the polling changes when a rank notices the frames, never what it reads.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import comm_collectives as dist
from comm_collectives import _route
from comm_collectives._capacity import inline_limit

DELAY = 0.3  # seconds, far beyond SPIN_SECONDS


def late_peer() -> dict[str, Any]:
    """Rank 1 joins each exchange DELAY seconds late; rank 0 settles on it meanwhile."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert _route.SPIN_SECONDS < DELAY / 10
    mine = torch.full((4,), rank + 1, dtype=torch.int64)
    out = torch.empty(4 * world, dtype=torch.int64)
    if rank == 1:
        time.sleep(DELAY)
    started = time.perf_counter()
    work = _route.gather_rows(out, mine, None, async_op=True)
    assert work is not None
    _route.settle(work, "all_gather", None, torch.device("cpu"))
    waited = time.perf_counter() - started
    # a whole collective behind a late rank: the handshake checks the shape, then the data
    data = torch.full((5000,), float(rank + 1))
    if rank == 1:
        time.sleep(DELAY)
    with inline_limit(0):
        dist.reduce(data, dst=0)
    bad = torch.zeros(3 if rank == 1 else 2)
    if rank == 1:
        time.sleep(DELAY)
    try:
        dist.all_reduce(bad)
        mismatch = None
    except dist.CollectiveMismatchError as exc:
        mismatch = [row["shape"] for row in exc.rows]
    return {
        "gathered": out.tolist(),
        "waited": waited,
        "reduced": data[:3].tolist() if rank == 0 else None,
        "mismatch": mismatch,
    }


def test_a_peer_later_than_the_polling_is_waited_for(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(late_peer, world_size=2)
    assert results[0]["waited"] > DELAY * 0.8  # rank 0 waited for rank 1's frame
    for r in results:
        assert r["gathered"] == [1] * 4 + [2] * 4
        assert r["mismatch"] == [(2,), (3,)]
    assert results[0]["reduced"] == [3.0] * 3  # 1 + 2
