"""An irecv whose wait(timeout) expired stays posted: later receives name it, not the peer.

On two real gloo ranks, rank 1 posts an irecv from rank 0 and gives up waiting on it; rank
0 then sends. The abandoned receive takes that message, and a later receive from rank 0
finds nothing (a timeout), or the message after it (a mismatch), or its own wait expires.
Each error must say that an earlier irecv whose wait(timeout=...) expired is still posted
or took the message, instead of saying that rank 0 did not make the matching call. The
abandoned handle still completes with the message it took.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import comm_collectives as dist
from tests.helpers import caught

_SHORT_S = 3.0  # the timeout of the pair's group: a recv that gets nothing ends in it


def abandoned_receives() -> dict[str, Any]:
    rank = dist.get_rank()
    # gloo closes a group's connection when a receive times out: one group per such case
    pair, pair_b, pair_c = (dist.new_group([0, 1], timeout=_SHORT_S) for _ in range(3))
    out: dict[str, Any] = {}

    # 1. the abandoned irecv takes the message meant for a later recv: that recv times out
    if rank == 1:
        first = dist.irecv(torch.zeros(2), 0, group=pair)
        out["expired"] = caught(first.wait, 0.3)
    dist.barrier()
    if rank == 0:
        dist.send(torch.full((2,), 7.0), 1, group=pair)
    else:
        started = time.monotonic()
        out["later_recv"] = caught(dist.recv, torch.zeros(2), 0, pair)
        out["later_recv_s"] = time.monotonic() - started
        out["first_wait"] = caught(first.wait, 10.0)
        out["first_source"] = first.source_rank()
    dist.barrier()

    # 2. it takes one message, the later recv the next one, of another shape: a mismatch
    pair = pair_b
    if rank == 1:
        second = dist.irecv(torch.zeros(2), 0, group=pair, tag=5)
        out["expired_tag5"] = caught(second.wait, 0.3)
    dist.barrier()
    if rank == 0:
        dist.send(torch.full((3,), 1.0), 1, group=pair, tag=5)  # for the later recv
        dist.send(torch.full((4,), 2.0), 1, group=pair, tag=5)
    else:
        out["mismatch"] = caught(dist.recv, torch.zeros(3), 0, pair, 5)
        out["second_wait"] = caught(second.wait, 10.0)  # it took the 3 values into a (2,)
    dist.barrier()

    # 3. a later irecv whose own wait expires: its error names the earlier one
    if rank == 1:
        third = dist.irecv(torch.zeros(2), 0, group=pair, tag=6)
        out["expired_tag6"] = caught(third.wait, 0.3)
    dist.barrier()
    if rank == 0:
        dist.send(torch.full((2,), 3.0), 1, group=pair, tag=6)
    else:
        # the third has taken the message, or is about to: either way it comes first
        fourth = dist.irecv(torch.zeros(2), 0, group=pair, tag=6)
        out["later_irecv"] = caught(fourth.wait, 0.5)
    dist.barrier()
    if rank == 0:  # rank 1's fourth irecv takes this one: the pair is clean again
        dist.send(torch.full((2,), 4.0), 1, group=pair, tag=6)
    else:
        out["fourth_wait"] = caught(fourth.wait, 10.0)

    # 4. nothing abandoned: a recv that gets nothing blames the peer, as before
    if rank == 1:
        out["plain_timeout"] = caught(dist.recv, torch.zeros(2), 0, pair_c, 9)
    dist.barrier()
    return out


def test_a_later_receive_names_the_abandoned_irecv(comm_run_distributed: Any) -> None:
    r = comm_run_distributed(abandoned_receives, world_size=2, timeout=60.0)[1]

    name, message = r["expired"]
    assert name == "CommTimeoutError", message
    assert "This receive stays posted: the next message from rank 0 with tag 0" in message

    name, message = r["later_recv"]
    assert name == "CommTimeoutError", message
    assert "did not make the matching call" not in message.split("(The backend")[0]
    assert "The peer is probably not to blame" in message
    assert "an earlier irecv from rank 0 (tag 0) whose wait(timeout=0.3 s) expired" in message
    assert "took the next message rank 0 sent" in message
    assert "wait on its handle again" in message
    assert r["later_recv_s"] < _SHORT_S + 5
    assert r["first_wait"] == ("", "")  # the abandoned handle holds the message it took
    assert r["first_source"] == 0

    name, message = r["mismatch"]
    assert name == "CollectiveMismatchError", message
    assert "differ in shape" in message
    assert "an earlier irecv from rank 0 (tag 5) whose wait(timeout=0.3 s) expired" in message
    name, message = r["second_wait"]
    assert name == "CollectiveMismatchError", message  # the (3,) it took did not fit (2,)

    name, message = r["later_irecv"]
    assert name == "CommTimeoutError", message
    assert "an earlier irecv from rank 0 (tag 6)" in message
    assert "not heard from" not in message
    assert r["fourth_wait"] == ("", "")

    name, message = r["plain_timeout"]
    assert name == "CommTimeoutError", message
    assert "did not make the matching call" in message
    assert "earlier irecv" not in message
