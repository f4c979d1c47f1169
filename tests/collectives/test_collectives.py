"""Every collective on real gloo worlds of 2 and 3 ranks, checked against hand-derived values.

Each rank body runs on every rank (along both data paths of tests/collectives/data_paths.py)
and stands above the test that asserts on it: inputs depend on the rank, and the tests
compare the returned values with results derived by hand from those inputs. collect_results
is in test_collect_results.py.
"""

from __future__ import annotations

import random
from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch

import comm_collectives as dist
from comm_core import CollectiveMismatchError, RemoteRankError
from tests.helpers import Unpicklable, caught

from .data_paths import PATHS, WORLDS, run_on_path

Point = namedtuple("Point", ["x", "y"])


def all_reduce_ops() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for op in ("sum", "mean", "max", "min", "product", "SUM"):
        t = torch.tensor([rank + 1.0, 2.0 * (rank + 1)])
        dist.all_reduce(t, op=op)
        out[op] = t.tolist()
    ints = torch.tensor([2 * rank, 4], dtype=torch.int32)
    dist.all_reduce(ints, op="mean")
    out["int_mean"] = (ints.tolist(), str(ints.dtype))
    inexact = torch.tensor([rank, 7], dtype=torch.int64)
    out["int_mean_inexact"] = caught(dist.all_reduce, inexact, op="mean")
    out["int_mean_inexact_untouched"] = inexact.tolist()
    flags = torch.tensor([rank == 0, True])
    dist.all_reduce(flags, op="max")
    out["bool_max"] = flags.tolist()
    out["bad_op"] = caught(dist.all_reduce, torch.ones(1), op="avg")
    # large tensors: cached buffers, reduced in their own memory when the size divides
    # into the ranks' chunks (300_000), copied otherwise (300_001, a strided view)
    world = dist.get_world_size()
    s1 = sum(r + 1 for r in range(world))
    for n in (300_000, 300_001):
        big = torch.arange(n, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(big)
        out[f"big_sum/{n}"] = torch.equal(big, torch.arange(n, dtype=torch.float32) * s1)
        big = torch.arange(n, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(big, op="max")
        out[f"big_max/{n}"] = torch.equal(big, torch.arange(n, dtype=torch.float32) * world)
    strided = (torch.arange(600_000, dtype=torch.float32) * (rank + 1)).view(-1, 2)[:, 0]
    dist.all_reduce(strided)
    out["big_strided"] = torch.equal(strided, torch.arange(0, 600_000, 2).float() * s1)
    group = torch.distributed.new_group([0, 1])
    if rank in (0, 1):
        g = torch.tensor([10.0 * (rank + 1)])
        dist.all_reduce(g, group=group)
        out["group"] = g.item()
    torch.distributed.destroy_process_group(group)
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_every_op(comm_run_distributed: Any, path: str, world: int) -> None:
    results = run_on_path(comm_run_distributed, path, all_reduce_ops, world_size=world)
    ranks = range(world)
    s1 = sum(r + 1 for r in ranks)
    p1 = 1
    for r in ranks:
        p1 *= r + 1
    for rank, r in enumerate(results):
        for n in (300_000, 300_001):
            assert r[f"big_sum/{n}"] is True, (rank, n)
            assert r[f"big_max/{n}"] is True, (rank, n)
        assert r["big_strided"] is True
        assert r["sum"] == [s1, 2 * s1]
        assert r["SUM"] == [s1, 2 * s1]
        assert r["mean"] == [s1 / world, 2 * s1 / world]
        assert r["max"] == [world, 2 * world]
        assert r["min"] == [1, 2]
        assert r["product"] == [p1, p1 * 2**world]
        # integer mean is exact: mean(2r) = W - 1, mean(4) = 4; dtype kept
        assert r["int_mean"] == ([world - 1, 4], "torch.int32")
        # mean of [0, 1(, 2)] is not an integer for world 2: a clear error, data untouched
        name, message = r["int_mean_inexact"]
        if world == 2:
            assert name == "ValueError"
            assert "mean is not an integer for 1 of 2 elements" in message
            assert "sum 1 over 2 ranks = 0.5" in message
            assert "data.float()" in message
            assert r["int_mean_inexact_untouched"] == [rank, 7]
        else:  # (0 + 1 + 2) / 3 = 1 and 7 * 3 / 3 = 7: exact
            assert (name, r["int_mean_inexact_untouched"]) == ("", [1, 7])
        assert r["bool_max"] == [True, True]
        assert r["bad_op"][0] == "RemoteRankError"  # on every rank, at the same call
        assert "expected one of sum, mean, max, min, product" in r["bad_op"][1]
        if rank in (0, 1):
            assert r["group"] == 30.0


def all_gather_shapes() -> dict[str, Any]:
    rank = dist.get_rank()
    even = dist.all_gather(torch.full((2, 2), float(rank)))
    uneven = dist.all_gather(torch.arange(rank * 3, dtype=torch.int16).reshape(rank, 3))
    scalar = dist.all_gather(torch.tensor(rank))
    ragged_ndim = dist.all_gather(torch.ones((1,) * (rank + 1)))
    empty = dist.all_gather(torch.empty(0))
    return {
        "even": [p.tolist() for p in even],
        "uneven": [(tuple(p.shape), p.tolist(), str(p.dtype)) for p in uneven],
        "scalar": [p.item() for p in scalar],
        "ragged_ndim": [tuple(p.shape) for p in ragged_ndim],
        "empty": [tuple(p.shape) for p in empty],
        "dtype_mismatch": caught(
            dist.all_gather, torch.ones(1, dtype=torch.float32 if rank else torch.float64)
        ),
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_even_uneven_and_scalar(
    comm_run_distributed: Any, path: str, world: int
) -> None:
    for r in run_on_path(comm_run_distributed, path, all_gather_shapes, world_size=world):
        assert r["even"] == [[[float(k)] * 2] * 2 for k in range(world)]
        expected = [
            ((k, 3), [list(range(3 * i, 3 * i + 3)) for i in range(k)], "torch.int16")
            for k in range(world)
        ]
        assert r["uneven"] == expected
        assert r["scalar"] == list(range(world))
        assert r["ragged_ndim"] == [(1,) * (k + 1) for k in range(world)]
        assert r["empty"] == [(0,)] * world
        name, message = r["dtype_mismatch"]
        assert name == "CollectiveMismatchError"
        assert "different dtype" in message
        assert "float64" in message
        assert "float32" in message


def gather_to(dst: int) -> dict[str, Any]:
    rank = dist.get_rank()
    parts = dist.gather(torch.arange(rank + 1, dtype=torch.float64) + 10 * rank, dst=dst)
    return {"parts": [p.tolist() for p in parts], "devices": sorted({str(p.device) for p in parts})}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_gather_uneven_to_every_root(comm_run_distributed: Any, path: str, world: int) -> None:
    for dst in range(world):
        results = run_on_path(comm_run_distributed, path, gather_to, dst, world_size=world)
        for rank, r in enumerate(results):
            if rank == dst:
                assert r["parts"] == [[10.0 * k + i for i in range(k + 1)] for k in range(world)]
                assert r["devices"] == ["cpu"]
            else:
                assert r["parts"] == []


def broadcast_cases() -> dict[str, Any]:
    rank = dist.get_rank()
    world = dist.get_world_size()
    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=world - 1)
    shape = caught(dist.broadcast, torch.zeros(rank + 1), src=0)
    bad_src = caught(dist.broadcast, torch.zeros(1), src=world)
    return {"value": t.tolist(), "shape_mismatch": shape, "bad_src": bad_src}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_and_its_errors(comm_run_distributed: Any, path: str, world: int) -> None:
    for r in run_on_path(comm_run_distributed, path, broadcast_cases, world_size=world):
        assert r["value"] == [float(world - 1)] * 3
        name, message = r["shape_mismatch"]
        assert name == "CollectiveMismatchError"
        assert "different shape" in message
        assert r["bad_src"][0] == "RemoteRankError"
        assert f"src={world} is not a rank of the group (0..{world - 1})" in r["bad_src"][1]


def seed_cases() -> dict[str, Any]:
    np.random.seed(1234)
    torch.manual_seed(1234)
    random.seed(1234)
    seeds = [dist.sync_random_seed() for _ in range(3)]
    return {
        "seeds": seeds,
        "numpy_next": float(np.random.rand()),
        "torch_next": float(torch.rand(1)),
        "random_next": random.random(),
    }


@pytest.mark.parametrize("path", PATHS)
def test_sync_random_seed_is_shared_and_leaves_global_rngs_alone(
    comm_run_distributed: Any, path: str
) -> None:
    import random

    import numpy as np
    import torch

    np.random.seed(1234)
    torch.manual_seed(1234)
    random.seed(1234)
    expected = (float(np.random.rand()), float(torch.rand(1)), random.random())
    results = run_on_path(comm_run_distributed, path, seed_cases, world_size=3)
    assert results[0]["seeds"] == results[1]["seeds"] == results[2]["seeds"]
    assert len(set(results[0]["seeds"])) == 3  # fresh each call
    assert all(0 <= s < 2**31 for s in results[0]["seeds"])
    for r in results:
        assert (r["numpy_next"], r["torch_next"], r["random_next"]) == expected


def object_cases() -> dict[str, Any]:
    rank = dist.get_rank()
    world = dist.get_world_size()
    payload = {
        "rank": rank,
        "text": "x" * rank,
        "tensor": torch.arange(rank + 2, dtype=torch.float32) * (rank + 1),
        "array": np.full((2, rank + 1), rank, dtype=np.int32),
        "point": Point(rank, None),
        "param": torch.nn.Parameter(torch.ones(2) * rank),
        "bf16": torch.full((2,), rank + 0.5, dtype=torch.bfloat16),
    }
    gathered = dist.all_gather_object(payload)
    to_last = dist.gather_object(payload, dst=world - 1)
    items: list[Any] = (
        [{"from": rank, "arr": np.arange(4) * rank}, None, "tail"] if rank == 1 else [0, 0, 0]
    )
    dist.broadcast_object_list(items, src=1)
    unpicklable = caught(dist.all_gather_object, Unpicklable() if rank == world - 1 else rank)
    unpicklable_src = caught(dist.broadcast_object_list, [Unpicklable()], src=0)

    def describe(o: dict[str, Any]) -> dict[str, Any]:
        return {
            "rank": o["rank"],
            "text": o["text"],
            "tensor": o["tensor"].tolist(),
            "array": o["array"].tolist(),
            "array_dtype": str(o["array"].dtype),
            "point": tuple(o["point"]),
            "point_type": type(o["point"]).__name__,
            "param": (type(o["param"]).__name__, o["param"].tolist(), o["param"].requires_grad),
            "bf16": (str(o["bf16"].dtype), o["bf16"].float().tolist()),
        }

    return {
        "gathered": [describe(o) for o in gathered],
        "gather_object": None if to_last is None else [describe(o) for o in to_last],
        "broadcast": [items[0]["from"], items[0]["arr"].tolist(), items[1], items[2]],
        "unpicklable": unpicklable,
        "unpicklable_src": unpicklable_src,
        "after_errors": dist.all_gather_object(rank),  # the world is still usable
    }


def _describe_expected(k: int) -> dict[str, Any]:
    return {
        "rank": k,
        "text": "x" * k,
        "tensor": [float(i * (k + 1)) for i in range(k + 2)],
        "array": [[k] * (k + 1)] * 2,
        "array_dtype": "int32",
        "point": (k, None),
        "point_type": "Point",
        "param": ("Parameter", [float(k)] * 2, True),
        "bf16": ("torch.bfloat16", [k + 0.5] * 2),
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_object_collectives_carry_tensors_arrays_and_errors(
    comm_run_distributed: Any, path: str, world: int
) -> None:
    results = run_on_path(comm_run_distributed, path, object_cases, world_size=world)
    expected = [_describe_expected(k) for k in range(world)]
    for rank, r in enumerate(results):
        assert r["gathered"] == expected
        assert r["gather_object"] == (expected if rank == world - 1 else None)
        assert r["broadcast"] == [1, [0, 1, 2, 3], None, "tail"]
        name, message = r["unpicklable"]
        assert name == "RemoteRankError"
        assert f"all_gather_object failed on rank(s) {world - 1}" in message
        assert "this object refuses to be pickled" in message
        name, message = r["unpicklable_src"]
        assert name == "RemoteRankError"
        assert "broadcast_object_list failed on rank(s) 0" in message
        assert r["after_errors"] == list(range(world))


def reduce_dict_cases() -> dict[str, Any]:
    rank = dist.get_rank()
    data = {
        "loss": torch.tensor(float(rank + 1)),
        "count": torch.tensor([rank + 1, 2], dtype=torch.int64),
        "acc": torch.tensor([[0.5 * rank]], dtype=torch.float64),
    }
    dist.all_reduce_dict(data, op="sum")
    summed = {k: (v.tolist(), str(v.dtype), tuple(v.shape)) for k, v in data.items()}
    mean = {"even": torch.tensor([2 * rank], dtype=torch.int32), "f": torch.tensor([1.0 * rank])}
    dist.all_reduce_dict(mean, op="mean")
    keys = {"a": torch.ones(1), f"only_{rank}": torch.ones(1)}
    key_error = caught(dist.all_reduce_dict, keys)
    not_tensor = caught(dist.all_reduce_dict, {"a": 1.0 if rank == 0 else torch.ones(1)})
    scalars = {f"m{i}": torch.tensor(float(i * (rank + 1))) for i in range(5)}
    dist.all_reduce_dict(scalars, op="max")
    # the int mean is 1 / W: not exact, so nothing is replaced, not even the float key
    atomic = {"f": torch.tensor([1.0 * rank]), "i": torch.tensor([1 if rank == 0 else 0])}
    atomic_error = caught(dist.all_reduce_dict, atomic, op="mean")
    return {
        "summed": summed,
        "mean": {k: v.tolist() for k, v in mean.items()},
        "key_error": key_error,
        "not_tensor": not_tensor,
        "scalars": {k: (v.item(), tuple(v.shape)) for k, v in scalars.items()},
        "atomic": (atomic_error[0], {k: v.tolist() for k, v in atomic.items()}),
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_dict_sums_means_and_key_check(
    comm_run_distributed: Any, path: str, world: int
) -> None:
    s = sum(range(1, world + 1))
    results = run_on_path(comm_run_distributed, path, reduce_dict_cases, world_size=world)
    for rank, r in enumerate(results):
        assert r["summed"] == {
            "loss": (float(s), "torch.float32", ()),
            "count": ([s, 2 * world], "torch.int64", (2,)),
            "acc": ([[0.5 * sum(range(world))]], "torch.float64", (1, 1)),
        }
        assert r["mean"] == {"even": [world - 1], "f": [sum(range(world)) / world]}
        name, message = r["key_error"]
        assert name == "CollectiveMismatchError"
        assert "different keys" in message
        for k in range(world):
            assert f"only_{k}" in message
        name, message = r["not_tensor"]
        assert name == "RemoteRankError"
        assert "data['a'] is a float, not a tensor" in message
        assert r["scalars"] == {f"m{i}": (float(i * world), ()) for i in range(5)}
        assert r["atomic"] == ("ValueError", {"f": [1.0 * rank], "i": [1 if rank == 0 else 0]})


def reduce_params_cases(coalesce: bool, bucket_size_mb: float) -> list[list[float]]:
    rank = dist.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(rank + i)
    extra = torch.full((4,), rank, dtype=torch.int64)
    dist.all_reduce_params(
        [*model.parameters(), extra], coalesce=coalesce, bucket_size_mb=bucket_size_mb, op="sum"
    )
    return [p.reshape(-1).tolist() for p in model.parameters()] + [extra.tolist()]


@pytest.mark.parametrize(("coalesce", "bucket"), [(True, -1), (True, 0.00001), (False, -1)])
def test_all_reduce_params(comm_run_distributed: Any, coalesce: bool, bucket: float) -> None:
    world = 3
    results = comm_run_distributed(reduce_params_cases, coalesce, bucket, world_size=world)
    sizes = [6, 2, 2, 1]
    expected = [[float(sum(r + i for r in range(world)))] * n for i, n in enumerate(sizes)]
    expected.append([sum(range(world))] * 4)
    assert results == [expected] * world


def mismatch_cases() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    if rank == 0:
        out["different_ops"] = caught(dist.all_reduce, torch.ones(2))
    else:
        out["different_ops"] = caught(dist.broadcast, torch.ones(2))
    out["shape"] = caught(dist.all_reduce, torch.ones(rank + 1))
    with dist.debug_mode():
        out["debug_enabled"] = dist.debug_enabled()
        out["debug_shape"] = caught(dist.all_reduce, torch.ones(rank + 1))
        ok = torch.ones(2)
        dist.all_reduce(ok)
        out["debug_ok"] = ok.tolist()
    out["debug_after"] = dist.debug_enabled()
    return out


@pytest.mark.parametrize("path", PATHS)
def test_mismatched_calls_raise_on_every_rank(comm_run_distributed: Any, path: str) -> None:
    for r in run_on_path(comm_run_distributed, path, mismatch_cases, world_size=2):
        name, message = r["different_ops"]
        assert name == "CollectiveMismatchError"
        assert "different collectives" in message
        assert "all_reduce" in message
        assert "broadcast" in message
        assert r["shape"][0] == "CollectiveMismatchError"
        assert r["debug_enabled"] is True
        name, message = r["debug_shape"]
        assert name == "CollectiveMismatchError"
        assert "call site" in message
        assert "helpers.py:" in message  # the line that made the call (caught)
        assert r["debug_ok"] == [2.0, 2.0]
        assert r["debug_after"] is False


def remote_error_details() -> dict[str, Any]:
    rank = dist.get_rank()
    try:
        dist.all_gather_object(Unpicklable() if rank == 1 else rank)
    except RemoteRankError as exc:
        return {
            "ranks": exc.ranks,
            "operation": exc.operation,
            "cause": type(exc.__cause__).__name__,
        }
    return {}


def test_remote_rank_error_names_rank_and_cause(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(remote_error_details, world_size=3):
        assert r["ranks"] == (1,)
        assert r["operation"] == "all_gather_object"
    assert comm_run_distributed(remote_error_details, world_size=3)[1]["cause"] == "RuntimeError"


def mismatch_rows() -> list[dict[str, object]]:
    rank = dist.get_rank()
    try:
        dist.all_reduce(torch.ones(rank + 1))
    except CollectiveMismatchError as exc:
        return list(exc.rows)
    return []


def test_mismatch_table_has_a_row_per_rank(comm_run_distributed: Any) -> None:
    rows = comm_run_distributed(mismatch_rows, world_size=3)[0]
    assert [row["rank"] for row in rows] == [0, 1, 2]
    assert [row["shape"] for row in rows] == [(1,), (2,), (3,)]
    assert {row["dtype"] for row in rows} == {"float32"}
    assert {row["op"] for row in rows} == {"sum"}
