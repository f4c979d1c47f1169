"""Point-to-point calls: send / recv, isend / irecv, send_object_list / recv_object_list.

Each case moves rank-dependent data and compares what arrived with what torch.distributed's
own send / recv delivers for the same data, on the default group of worlds of 2 and 3 and on
an uneven group (global ranks 0 and 2 of a world of 3). The mismatch cases check that the
receiver raises a clear error, that the bytes were drained (the next message on the same
pair arrives intact), and that a sender's failure reaches the receiver.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from tests.helpers import caught

from .data_paths import WORLDS


def _pair_cases(group: Any, tag: str) -> dict[str, Any]:
    """Cases between group ranks 0 (sender) and 1 (receiver); a ring over the whole group."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out: dict[str, Any] = {}

    def glob(r: int) -> int:
        return r if group is None else torch_dist.get_global_rank(group, r)

    data = torch.arange(12, dtype=torch.float64).reshape(3, 4) * 3 + 1
    big = torch.arange(300_000, dtype=torch.int32)
    if rank == 0:
        dist.send(data, 1, group=group)
        torch_dist.send(data, glob(1), group=group)
        dist.send(big, dst=1, group=group, tag=7)
        dist.send(data.t(), 1, group=group)  # not contiguous
        dist.send(torch.tensor([5.0]), 1, group=group)
    elif rank == 1:
        ours, ref = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64)
        source = dist.recv(ours, src=None, group=group)
        torch_dist.recv(ref, glob(0), group=group)
        got_big = torch.zeros(300_000, dtype=torch.int32)
        dist.recv(got_big, 0, group=group, tag=7)
        transposed = torch.zeros(4, 3, dtype=torch.float64)
        dist.recv(transposed, 0, group=group)
        strided = torch.zeros(2)[::2]  # a view into a larger tensor
        dist.recv(strided, 0, group=group)
        out[f"{tag}tensor"] = (ours.tolist(), ref.tolist(), source)
        out[f"{tag}big"] = int(got_big.sum()) == sum(range(300_000))
        out[f"{tag}transposed"] = transposed.tolist() == data.t().tolist()
        out[f"{tag}strided"] = strided.tolist()

    # mismatches: the receiver raises, the bytes are drained, the next message is intact
    if rank == 0:
        dist.send(torch.ones(3), 1, group=group)
        dist.send(torch.ones(2, dtype=torch.int64), 1, group=group)
        dist.send(torch.full((2,), 9.0), 1, group=group)
        out[f"{tag}sender_failure"] = caught(dist.send, "not a tensor", 1, group=group)
        dist.send_object_list([1, 2, 3], 1, group=group)
        dist.send(torch.full((2,), 8.0), 1, group=group)
    elif rank == 1:
        out[f"{tag}shape"] = caught(dist.recv, torch.zeros(4), 0, group=group)
        out[f"{tag}dtype"] = caught(dist.recv, torch.zeros(2), 0, group=group)
        after = torch.zeros(2)
        dist.recv(after, 0, group=group)
        out[f"{tag}after_mismatch"] = after.tolist()
        out[f"{tag}remote_failure"] = caught(dist.recv, torch.zeros(1), 0, group=group)
        out[f"{tag}object_count"] = caught(dist.recv_object_list, [None, None], 0, group=group)
        after = torch.zeros(2)
        dist.recv(after, 0, group=group)
        out[f"{tag}after_objects"] = after.tolist()

    # debug mode: the receiver's mismatch table names both call sites (the sender's came
    # over the wire); an irecv's own site is where it was posted, not its helper thread
    with dist.debug_mode():
        if rank == 0:
            dist.send(torch.ones(3), 1, group=group)
            dist.send_object_list([1, 2], 1, group=group)
            dist.send(torch.ones(2, dtype=torch.int32), 1, group=group)
            dist.send(torch.full((2,), 4.0), 1, group=group)
        elif rank == 1:
            out[f"{tag}debug/shape"] = caught(dist.recv, torch.zeros(4), 0, group=group)
            out[f"{tag}debug/objects"] = caught(dist.recv_object_list, [None], 0, group=group)
            pending = dist.irecv(torch.zeros(2), 0, group=group)
            out[f"{tag}debug/irecv"] = caught(pending.wait, 30.0)
            after = torch.zeros(2)
            dist.recv(after, 0, group=group)
            out[f"{tag}debug/after"] = after.tolist()
    if rank == 0:  # only the receiver in debug mode: its own site still shows
        dist.send(torch.ones(3), 1, group=group)
    elif rank == 1:
        with dist.debug_mode():
            out[f"{tag}debug/receiver_only"] = caught(dist.recv, torch.zeros(5), 0, group=group)

    # objects: tensors inside travel out of band; compare with torch's own call
    objects = [{"rank": rank, "t": torch.full((100_000,), float(rank))}, "text", None]
    if rank == 0:
        dist.send_object_list(objects, 1, group=group)
        torch_dist.send_object_list(objects, glob(1), group=group)
    elif rank == 1:
        ours_o: list[Any] = [None] * 3
        ref_o: list[Any] = [None] * 3
        source = dist.recv_object_list(ours_o, None, group)
        torch_dist.recv_object_list(ref_o, glob(0), group=group)
        out[f"{tag}objects"] = (
            (ours_o[0]["rank"], float(ours_o[0]["t"].sum()), ours_o[1:]),
            (ref_o[0]["rank"], float(ref_o[0]["t"].sum()), ref_o[1:]),
            source,
        )

    # a ring of isend / irecv, the send handle waited first (it needs the receive to move)
    right, left = (rank + 1) % world, (rank - 1) % world
    box = torch.zeros(5)
    sent = dist.isend(torch.full((5,), float(rank)), right, group=group, tag=3)
    received = dist.irecv(box, left, group=group, tag=3)
    sent.wait(timeout=30.0)
    received.wait(timeout=30.0)
    out[f"{tag}ring"] = (box.tolist(), received.source_rank(), received.is_completed())
    out[f"{tag}self"] = caught(dist.send, torch.ones(1), rank, group=group)
    return out


def p2p_cases() -> dict[str, Any]:
    out = _pair_cases(None, "")
    if dist.get_world_size() == 3:
        group = torch_dist.new_group([0, 2])
        if dist.get_rank() in (0, 2):
            out.update(_pair_cases(group, "group:"))
        torch_dist.destroy_process_group(group)
    return out


def _expect(results: list[dict[str, Any]], tag: str, members: list[int]) -> None:
    n = len(members)
    receiver = results[members[1]]
    data = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * 3 + 1).tolist()
    ours, ref, source = receiver[f"{tag}tensor"]
    assert ours == ref == data
    assert source == 0
    assert receiver[f"{tag}big"] is True
    assert receiver[f"{tag}transposed"] is True
    assert receiver[f"{tag}strided"] == [5.0]

    name, message = receiver[f"{tag}shape"]
    assert name == "CollectiveMismatchError", message
    assert "differ in shape" in message
    assert "(3,)" in message
    assert "(4,)" in message
    name, message = receiver[f"{tag}dtype"]
    assert name == "CollectiveMismatchError", message
    assert "differ in dtype" in message
    assert "int64" in message
    assert receiver[f"{tag}after_mismatch"] == [9.0, 9.0]
    name, message = results[members[0]][f"{tag}sender_failure"]
    assert name == "RemoteRankError", message
    assert "data must be a torch.Tensor, got str" in message
    name, message = receiver[f"{tag}remote_failure"]
    assert name == "RemoteRankError", message
    assert "rank 0" in message
    assert "data must be a torch.Tensor, got str" in message
    name, message = receiver[f"{tag}object_count"]
    assert name == "CollectiveMismatchError", message
    assert "sent 3 objects; rank 1 posted a list of 2" in message
    assert receiver[f"{tag}after_objects"] == [8.0, 8.0]

    for case, what in (("shape", "differ in shape"), ("objects", "sent 2 objects")):
        name, message = receiver[f"{tag}debug/{case}"]
        assert name == "CollectiveMismatchError", message
        assert what in message
        assert "call site" in message
        assert "test_p2p.py:" in message  # the sender's site: _pair_cases
        assert "helpers.py:" in message  # the receiver's: caught() made the call
    name, message = receiver[f"{tag}debug/irecv"]
    assert name == "CollectiveMismatchError", message
    assert "differ in dtype" in message
    assert message.count("test_p2p.py:") == 2  # the irecv was posted in _pair_cases too
    assert receiver[f"{tag}debug/after"] == [4.0, 4.0]
    name, message = receiver[f"{tag}debug/receiver_only"]
    assert name == "CollectiveMismatchError", message
    assert message.count("call site") >= 1
    assert "helpers.py:" in message
    assert "test_p2p.py:" not in message

    ours_o, ref_o, source = receiver[f"{tag}objects"]
    assert tuple(ours_o) == tuple(ref_o) == (0, 0.0, ["text", None])
    assert source == 0

    for rank, g in enumerate(members):
        box, source, completed = results[g][f"{tag}ring"]
        left = (rank - 1) % n
        assert box == [float(left)] * 5
        assert source == left
        assert completed is True
        name, message = results[g][f"{tag}self"]
        assert name == "ValueError"
        assert "is this rank itself" in message


@pytest.mark.parametrize("world", WORLDS)
def test_point_to_point_matches_torch_and_raises_on_mismatch(
    comm_run_distributed: Any, world: int
) -> None:
    results = comm_run_distributed(p2p_cases, world_size=world)
    _expect(results, "", list(range(world)))
    if world == 3:
        _expect(results, "group:", [0, 2])


def test_point_to_point_in_a_plain_process() -> None:
    with pytest.raises(ValueError, match="dst=0 is this rank itself"):
        dist.send(torch.ones(1), 0)
    with pytest.raises(ValueError, match=r"src=1 is not a rank of the group \(0..0\)"):
        dist.recv(torch.ones(1), 1)
    with pytest.raises(ValueError, match="tag must be an int in"):
        dist.isend(torch.ones(1), 0, tag=-1)


def new_group_cases(twin: bool) -> dict[str, Any]:
    """new_group([0, 2]) of a world of 3: members call through it, rank 1 gets torch's marker.

    With ``twin`` gloo counts as a backend without CPU support (as nccl), so new_group also
    makes the CPU twin the headers travel on.
    """
    from comm_collectives import _route
    from comm_core import process_group

    saved = process_group._CPU_BACKENDS, _route.side_channel
    if twin:  # the nccl layout on gloo (as tests/faults does)
        process_group._CPU_BACKENDS, _route.side_channel = (), True
    try:
        rank = dist.get_rank()
        group = dist.new_group([2, 0], timeout=30.0)
        out: dict[str, Any] = {"marker": group == torch_dist.GroupMember.NON_GROUP_MEMBER}
        t = torch.full((3,), float(rank + 1))
        out["all_reduce"] = (dist.all_reduce(t, group=group), t.tolist())
        out["all_gather"] = [x.tolist() for x in dist.all_gather(torch.tensor([rank]), group)]
        out["objects"] = dist.all_gather_object({"rank": rank}, group=group)
        box = [None]
        dist.scatter_object_list(box, [10, 20] if rank == 0 else None, src=0, group=group)
        out["scatter_object_list"] = box
        if rank in (0, 2):
            peer = 1 - dist.get_rank(group)
            dist.send(torch.tensor([rank]), peer, group=group) if rank == 0 else None
            got = torch.zeros(1, dtype=torch.int64)
            out["recv"] = dist.recv(got, None, group) if rank == 2 else None
            out["recv_value"] = got.tolist()
            side = _route.header_route(group)[0]
            out["twin"] = side is not group
        else:
            out["recv"] = dist.recv(torch.zeros(1), 0, group)  # not a member: -1, as torch
            out["irecv_done"] = dist.irecv(torch.zeros(1), 0, group).is_completed()
        whole = dist.new_group()  # every rank: (with twin) beside the default group's twin
        w = torch.tensor([float(rank)])
        dist.all_reduce(w, group=whole)
        out["whole"] = w.item()
        out["bad_ranks"] = caught(dist.new_group, [0, 5])
        return out
    finally:
        process_group._CPU_BACKENDS, _route.side_channel = saved


@pytest.mark.parametrize("twin", [False, True], ids=["gloo", "twin"])
def test_new_group_members_and_non_members(comm_run_distributed: Any, twin: bool) -> None:
    results = comm_run_distributed(new_group_cases, twin, world_size=3)
    for rank in (0, 2):
        r = results[rank]
        assert r["marker"] is False
        assert r["all_reduce"] == (None, [4.0] * 3)  # ranks 0 and 2: 1 + 3
        assert r["all_gather"] == [[0], [2]]
        assert r["objects"] == [{"rank": 0}, {"rank": 2}]
        assert r["scatter_object_list"] == [10 if rank == 0 else 20]
        assert r["twin"] is twin
    assert results[2]["recv"] == 0  # the sender's rank in the group
    assert results[2]["recv_value"] == [0]
    outsider = results[1]
    assert outsider["marker"] is True
    assert outsider["all_reduce"] == (None, [2.0] * 3)  # untouched
    assert outsider["all_gather"] == []
    assert outsider["objects"] == []
    assert outsider["scatter_object_list"] == [None]
    assert outsider["recv"] == -1
    assert outsider["irecv_done"] is True
    for r in results:
        assert r["whole"] == 3.0  # 0 + 1 + 2
        assert r["bad_ranks"][0] == "ValueError"
        assert "rank 5 is not a rank of the default group (0..2)" in r["bad_ranks"][1]
