"""torch.distributed's primitives in comm: reduce, scatter, scatter_object_list, the torch-style
all_gather / gather, and async_op work handles, each checked against torch.distributed's own
call on the same rank-dependent inputs.

The rank body runs every case on real gloo worlds of 2 and 3 ranks along both data paths
(inline in the handshake, and the separate transfer), on the default group and on an uneven
group (ranks [0, 2] of a world of 3, whose group ranks differ from the global ones). Every
case returns comm's result and torch's result; the tests assert they are equal and equal to
a value derived by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from tests.helpers import caught

from .data_paths import PATHS, WORLDS, run_on_path

TORCH_OPS = {
    "sum": torch_dist.ReduceOp.SUM,
    "max": torch_dist.ReduceOp.MAX,
    "min": torch_dist.ReduceOp.MIN,
    "product": torch_dist.ReduceOp.PRODUCT,
}


def _data(rank: int, n: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank-dependent values: rank r holds r + 1, r + 2, ... (never 0: products stay exact)."""
    return (torch.arange(n, dtype=torch.float64) + rank + 1).to(dtype)


def _cases(group: Any, tag: str) -> dict[str, Any]:
    """Every case on ``group`` (None: the default group); keys start with ``tag``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    root = world - 1
    out: dict[str, Any] = {}

    def torch_root(r: int) -> int:
        return r if group is None else torch_dist.get_global_rank(group, r)

    # reduce, every op, to the last rank; on the inline path the others keep their tensor
    # (on the long path, as with torch, it is the backend's workspace)
    for op, torch_op in TORCH_OPS.items():
        ours, ref = _data(rank), _data(rank)
        dist.reduce(ours, dst=root, op=op, group=group)
        torch_dist.reduce(ref, dst=torch_root(root), op=torch_op, group=group)
        out[f"{tag}reduce/{op}"] = (
            ours.tolist(),
            ref.tolist() if rank == root else _data(rank).tolist(),
        )
    ints = torch.tensor([2 * rank, 4], dtype=torch.int32)
    dist.reduce(ints, dst=0, op=torch_dist.ReduceOp.AVG, group=group)  # torch's AVG = mean
    out[f"{tag}reduce/int_mean"] = (ints.tolist(), str(ints.dtype))
    work = dist.reduce(_data(rank), dst=0, group=group, async_op=True)
    out[f"{tag}reduce/async_handle"] = type(work).__name__

    # torch-style all_gather(tensor_list, tensor): same shapes, and uneven shapes
    mine = _data(rank, 4)
    ours_list = [torch.zeros(4) for _ in range(world)]
    ref_list = [torch.zeros(4) for _ in range(world)]
    assert dist.all_gather(ours_list, mine, group=group) is None
    torch_dist.all_gather(ref_list, mine, group=group)
    out[f"{tag}all_gather/torch_form"] = (
        [t.tolist() for t in ours_list],
        [t.tolist() for t in ref_list],
    )
    uneven = [torch.zeros(k + 1, dtype=torch.int64) for k in range(world)]
    dist.all_gather(uneven, torch.arange(rank + 1) * 10, group=group)
    out[f"{tag}all_gather/uneven"] = [t.tolist() for t in uneven]
    out[f"{tag}all_gather/mmengine_form"] = [t.tolist() for t in dist.all_gather(mine, group)]
    bad = [torch.zeros(3) for _ in range(world)]  # shape 3, the ranks send 4
    out[f"{tag}all_gather/bad_list"] = caught(dist.all_gather, bad, mine, group=group)
    short = [torch.zeros(4)] * (world - 1) if rank == 0 else [torch.zeros(4)] * world
    out[f"{tag}all_gather/short_list"] = caught(dist.all_gather, short, mine, group=group)

    # torch-style gather(tensor, gather_list, dst)
    ours_g = [torch.zeros(4) for _ in range(world)] if rank == root else None
    ref_g = [torch.zeros(4) for _ in range(world)] if rank == root else None
    assert dist.gather(mine, ours_g, root, group) is None
    torch_dist.gather(mine, ref_g, dst=torch_root(root), group=group)
    out[f"{tag}gather/torch_form"] = (
        None if ours_g is None else [t.tolist() for t in ours_g],
        None if ref_g is None else [t.tolist() for t in ref_g],
    )
    out[f"{tag}gather/mmengine_form"] = [t.tolist() for t in dist.gather(mine, root, group)]
    listed = [torch.zeros(4) for _ in range(world)]  # a list on a rank that is not dst
    out[f"{tag}gather/list_off_root"] = caught(dist.gather, mine, listed, dst=0, group=group)

    # scatter from the last rank, and its root-side checks
    chunks = [_data(10 * root + k, 3) for k in range(world)] if rank == root else None
    ours_s, ref_s = torch.zeros(3), torch.zeros(3)
    dist.scatter(ours_s, chunks, src=root, group=group)
    torch_dist.scatter(ref_s, chunks, src=torch_root(root), group=group)
    out[f"{tag}scatter/values"] = (ours_s.tolist(), ref_s.tolist())
    wrong = [torch.zeros(3)] * (world + 1) if rank == 0 else None
    out[f"{tag}scatter/long_list"] = caught(dist.scatter, torch.zeros(3), wrong, 0, group)
    odd = [torch.zeros(3)] * (world - 1) + [torch.zeros(4)] if rank == 0 else None
    out[f"{tag}scatter/odd_shape"] = caught(dist.scatter, torch.zeros(3), odd, 0, group)

    # scatter_object_list: small objects, and objects holding a large tensor
    for size in (2, 300_000):
        objects = [{"to": k, "t": torch.full((size,), float(k))} for k in range(world)]
        ours_o: list[Any] = [None]
        ref_o: list[Any] = [None]
        given = objects if rank == root else None
        dist.scatter_object_list(ours_o, given, src=root, group=group)
        torch_dist.scatter_object_list(ref_o, given, src=torch_root(root), group=group)
        out[f"{tag}scatter_object_list/{size}"] = (
            (ours_o[0]["to"], ours_o[0]["t"].sum().item()),
            (ref_o[0]["to"], ref_o[0]["t"].sum().item()),
        )
    out[f"{tag}scatter_object_list/short"] = caught(
        dist.scatter_object_list, [None], [1] if rank == 0 else None, 0, group
    )

    # async_op handles: the result is in place after wait()
    t = _data(rank, 6)
    handle = dist.all_reduce(t, op="sum", group=group, async_op=True)
    assert handle is not None
    out[f"{tag}async/all_reduce"] = (handle.wait(), handle.is_completed(), t.tolist())
    ref = _data(rank, 6)
    torch_dist.all_reduce(ref, group=group)
    out[f"{tag}async/all_reduce_ref"] = ref.tolist()
    b = _data(rank, 3)
    handle = dist.broadcast(b, src=root, group=group, async_op=True)
    assert handle is not None
    handle.wait(timeout=30.0)
    out[f"{tag}async/broadcast"] = b.tolist()
    lists = [torch.zeros(4) for _ in range(world)]
    handle = dist.all_gather(lists, mine, group, True)
    assert handle is not None
    handle.wait()
    out[f"{tag}async/all_gather"] = [x.tolist() for x in lists]
    glist = [torch.zeros(4) for _ in range(world)] if rank == 0 else None
    handle = dist.gather(mine, glist, dst=0, group=group, async_op=True)
    assert handle is not None
    handle.wait()
    out[f"{tag}async/gather"] = None if glist is None else [x.tolist() for x in glist]
    red = _data(rank)
    handle = dist.reduce(red, dst=0, op="max", group=group, async_op=True)
    assert handle is not None
    handle.wait()
    out[f"{tag}async/reduce"] = red.tolist()
    out[f"{tag}barrier"] = (
        dist.barrier(group),
        dist.barrier(group=group, async_op=True).wait(timeout=30.0),  # type: ignore[union-attr]
    )
    if rank == 0:  # one rank in a barrier, the others in an all_reduce: both raise
        out[f"{tag}barrier/mismatch"] = caught(dist.barrier, group)
        pending = dist.barrier(group, async_op=True)
        out[f"{tag}barrier/mismatch_async"] = caught(pending.wait)  # type: ignore[union-attr]
    else:
        out[f"{tag}barrier/mismatch"] = caught(dist.all_reduce, torch.ones(1), group=group)
        out[f"{tag}barrier/mismatch_async"] = caught(dist.all_reduce, torch.ones(1), group=group)
    with dist.debug_mode():  # the mismatch table shows every rank's call site
        out[f"{tag}debug/reduce"] = caught(dist.reduce, torch.ones(rank + 1), 0, "sum", group)
        out[f"{tag}debug/scatter"] = caught(
            dist.scatter,
            torch.ones(rank + 1),
            [torch.ones(1)] * world if rank == 0 else None,
            0,
            group,
        )
    sc = torch.zeros(3)
    handle = dist.scatter(sc, chunks, src=root, group=group, async_op=True)
    assert handle is not None
    handle.wait()
    out[f"{tag}async/scatter"] = sc.tolist()
    return out


def torch_api_cases() -> dict[str, Any]:
    out = _cases(None, "")
    world = dist.get_world_size()
    if world == 3:  # an uneven group: global ranks 0 and 2 are group ranks 0 and 1
        group = torch_dist.new_group([0, 2])
        if dist.get_rank() in (0, 2):
            out.update(_cases(group, "group:"))
        torch_dist.destroy_process_group(group)
    return out


def _expect(
    results: list[dict[str, Any]], world: int, tag: str, members: list[int], path: str
) -> None:
    """Assert the cases of ``tag`` on the ranks ``members`` (global ranks, in group order)."""
    n = len(members)
    root = n - 1
    for rank, r in ((k, results[g]) for k, g in enumerate(members)):
        base = [float(i + rank + 1) for i in range(5)]
        for op in TORCH_OPS:
            ours, ref = r[f"{tag}reduce/{op}"]
            if rank == root:
                assert ours == ref, (tag, op, rank)
            elif path == "inline":
                assert ours == base == ref, (tag, op, rank)
        sums = [sum(float(i + k + 1) for k in range(n)) for i in range(5)]
        if rank == root:
            assert r[f"{tag}reduce/sum"][0] == sums
        ints, dtype = r[f"{tag}reduce/int_mean"]
        assert dtype == "torch.int32"
        assert ints == ([n - 1, 4] if rank == 0 else [2 * rank, 4])
        assert r[f"{tag}reduce/async_handle"] == "Work"

        gathered = [[float(i + k + 1) for i in range(4)] for k in range(n)]
        ours_l, ref_l = r[f"{tag}all_gather/torch_form"]
        assert ours_l == ref_l == gathered
        assert r[f"{tag}all_gather/uneven"] == [[10 * i for i in range(k + 1)] for k in range(n)]
        assert r[f"{tag}all_gather/mmengine_form"] == gathered
        name, message = r[f"{tag}all_gather/bad_list"]
        assert name == "CollectiveMismatchError", message
        assert "tensor_list does not match what the ranks sent" in message
        name, message = r[f"{tag}all_gather/short_list"]
        assert name == "RemoteRankError", message
        assert f"one tensor per rank of the group ({n}), got {n - 1}" in message

        ours_g, ref_g = r[f"{tag}gather/torch_form"]
        if rank == root:
            assert ours_g == ref_g == gathered
            assert r[f"{tag}gather/mmengine_form"] == gathered
        else:
            assert ours_g is None
            assert ref_g is None
            assert r[f"{tag}gather/mmengine_form"] == []
        name, message = r[f"{tag}gather/list_off_root"]
        assert name == "RemoteRankError", message
        assert "gather_list must be None (or empty)" in message

        ours_s, ref_s = r[f"{tag}scatter/values"]
        expected = [float(10 * root + rank + 1 + i) for i in range(3)]
        assert ours_s == ref_s == expected
        name, message = r[f"{tag}scatter/long_list"]
        assert name == "RemoteRankError", message
        assert f"({n}), got {n + 1}" in message
        assert "rank 0" in message
        name, message = r[f"{tag}scatter/odd_shape"]
        assert name == "RemoteRankError", message
        assert f"scatter_list[{n - 1}] has shape (4,)" in message

        for size in (2, 300_000):
            ours_o, ref_o = r[f"{tag}scatter_object_list/{size}"]
            assert tuple(ours_o) == tuple(ref_o) == (rank, float(rank * size))
        name, message = r[f"{tag}scatter_object_list/short"]
        assert name == "RemoteRankError", message
        assert f"one object per rank of the group ({n}), got 1 items" in message

        waited, completed, values = r[f"{tag}async/all_reduce"]
        assert (waited, completed) == (True, True)
        assert values == r[f"{tag}async/all_reduce_ref"]
        assert values == [sum(float(i + k + 1) for k in range(n)) for i in range(6)]
        assert r[f"{tag}async/broadcast"] == [float(root + 1 + i) for i in range(3)]
        assert r[f"{tag}async/all_gather"] == gathered
        assert r[f"{tag}async/gather"] == (gathered if rank == 0 else None)
        maxima = [float(i + n) for i in range(5)]
        if rank == 0 or path == "inline":
            assert r[f"{tag}async/reduce"] == (maxima if rank == 0 else base)
        assert r[f"{tag}async/scatter"] == expected
        assert r[f"{tag}barrier"] == (None, True)
        for case in ("debug/reduce", "debug/scatter"):
            name, message = r[f"{tag}{case}"]
            assert name in ("CollectiveMismatchError", "RemoteRankError"), (case, message)
            assert "call site" in message or name == "RemoteRankError", (case, message)
        name, message = r[f"{tag}debug/reduce"]
        assert name == "CollectiveMismatchError", message
        assert "different shape" in message
        assert "helpers.py:" in message  # the call site: where caught() made the call
        for case in ("barrier/mismatch", "barrier/mismatch_async"):
            name, message = r[f"{tag}{case}"]
            assert name == "CollectiveMismatchError", (case, message)
            assert "different collectives" in message
            assert "barrier" in message
            assert "all_reduce" in message


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_torch_primitives_match_torch_distributed(
    comm_run_distributed: Any, path: str, world: int
) -> None:
    results = run_on_path(comm_run_distributed, path, torch_api_cases, world_size=world)
    _expect(results, world, "", list(range(world)), path)
    if world == 3:
        _expect(results, world, "group:", [0, 2], path)
        assert not any(key.startswith("group:") for key in results[1])


def test_torch_primitives_in_a_world_of_one() -> None:
    t = torch.tensor([1.0, 2.0])
    dist.reduce(t, dst=0, op=torch_dist.ReduceOp.SUM)
    assert t.tolist() == [1.0, 2.0]
    assert dist.barrier() is None
    assert dist.barrier(async_op=True).wait(timeout=1.0)  # type: ignore[union-attr]
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    assert work.is_completed()
    assert work.wait(timeout=1.0)
    for handle in (
        dist.broadcast(t, async_op=True),
        dist.reduce(t, async_op=True),
        dist.all_gather([torch.zeros(2)], t, async_op=True),
        dist.gather(t, [torch.zeros(2)], async_op=True),
        dist.scatter(torch.zeros(2), [t], async_op=True),
    ):
        assert handle is not None
        assert handle.is_completed()
    out = [torch.zeros(2)]
    assert dist.all_gather(out, t) is None
    assert out[0].tolist() == [1.0, 2.0]
    assert [x.tolist() for x in dist.all_gather(t)] == [[1.0, 2.0]]
    out = [torch.zeros(2)]
    dist.gather(t, out, 0)
    assert out[0].tolist() == [1.0, 2.0]
    assert [x.tolist() for x in dist.gather(t, 0)] == [[1.0, 2.0]]
    target = torch.zeros(2)
    dist.scatter(target, [torch.tensor([5.0, 6.0])])
    assert target.tolist() == [5.0, 6.0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, [{"k": 1}])
    assert box == [{"k": 1}]
    with pytest.raises(ValueError, match=r"one object per rank of the group \(1\), got 2"):
        dist.scatter_object_list(box, [1, 2])
    with pytest.raises(ValueError, match=r"one tensor per rank of the group \(1\), got 2"):
        dist.scatter(target, [t, t])
    with pytest.raises(TypeError, match="fit neither form"):
        dist.all_gather([torch.zeros(2)])  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="positive, finite number of seconds"):
        work.wait(timeout=-1)


def unchecked_cases() -> dict[str, Any]:
    """The backend's own calls inside unchecked(): the same values, async handles too."""
    rank = dist.get_rank()
    with dist.unchecked():
        t = _data(rank, 3000)
        work = dist.all_reduce(t, async_op=True)
        assert work is not None
        work.wait()
        mean = _data(rank)
        dist.all_reduce(mean, op=torch_dist.ReduceOp.AVG, async_op=True).wait()  # type: ignore[union-attr]
        r = _data(rank)
        dist.reduce(r, dst=0, op="max")
        ints = torch.tensor([2 * rank, 4])
        dist.reduce(ints, 0, "mean")
        b = _data(rank, 3)
        dist.broadcast(b, src=1, async_op=True).wait()  # type: ignore[union-attr]
        dist.barrier(async_op=True).wait()  # type: ignore[union-attr]
    return {
        "sum": t[:3].tolist(),
        "mean": mean.tolist(),
        "reduce": r.tolist(),
        "ints": ints.tolist(),
        "broadcast": b.tolist(),
    }


def test_unchecked_calls_give_the_same_values(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(unchecked_cases, world_size=2)
    for rank, r in enumerate(results):
        assert r["sum"] == [3.0, 5.0, 7.0]  # (i + 1) + (i + 2)
        assert r["mean"] == [1.5 + i for i in range(5)]
        assert r["reduce"] == ([float(i + 2) for i in range(5)] if rank == 0 else _data(1).tolist())
        assert r["ints"] == ([1, 4] if rank == 0 else [2, 4])
        assert r["broadcast"] == [2.0, 3.0, 4.0]
