"""Every collective on real gloo worlds of 2 and 3 ranks, checked against hand-derived values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from . import cases

WORLDS = [2, 3]
# "inline": small data rides in the handshake frame (one collective); "long": inline data
# switched off, so the same cases take the separate data transfer.
PATHS = ["inline", "long"]


def _raised_on_every_rank(results: list[Any], rank: int, cause: str) -> None:
    """Every rank's ``first`` call raised the same RemoteRankError, naming ``rank`` and
    ``cause``."""
    for r in results:
        name, message = r["first"]
        assert name == "RemoteRankError"
        assert f"collect_results failed on rank(s) {rank};" in message
        assert cause in message


def _run(comm_run_distributed: Any, path: str, case: Any, *args: Any, world_size: int) -> Any:
    if path == "inline":
        return comm_run_distributed(case, *args, world_size=world_size)
    return comm_run_distributed(cases.without_inline, case.__name__, *args, world_size=world_size)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_every_op(comm_run_distributed: Any, path: str, world: int) -> None:
    results = _run(comm_run_distributed, path, cases.all_reduce_ops, world_size=world)
    ranks = range(world)
    s1 = sum(r + 1 for r in ranks)
    p1 = 1
    for r in ranks:
        p1 *= r + 1
    for rank, r in enumerate(results):
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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_even_uneven_and_scalar(
    comm_run_distributed: Any, path: str, world: int
) -> None:
    for r in _run(comm_run_distributed, path, cases.all_gather_shapes, world_size=world):
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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_gather_uneven_to_every_root(comm_run_distributed: Any, path: str, world: int) -> None:
    for dst in range(world):
        results = _run(comm_run_distributed, path, cases.gather_to, dst, world_size=world)
        for rank, r in enumerate(results):
            if rank == dst:
                assert r["parts"] == [[10.0 * k + i for i in range(k + 1)] for k in range(world)]
                assert r["devices"] == ["cpu"]
            else:
                assert r["parts"] == []


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_and_its_errors(comm_run_distributed: Any, path: str, world: int) -> None:
    for r in _run(comm_run_distributed, path, cases.broadcast_cases, world_size=world):
        assert r["value"] == [float(world - 1)] * 3
        name, message = r["shape_mismatch"]
        assert name == "CollectiveMismatchError"
        assert "different shape" in message
        assert r["bad_src"][0] == "RemoteRankError"
        assert f"src={world} is not a rank of the group (0..{world - 1})" in r["bad_src"][1]


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
    results = _run(comm_run_distributed, path, cases.seed_cases, world_size=3)
    assert results[0]["seeds"] == results[1]["seeds"] == results[2]["seeds"]
    assert len(set(results[0]["seeds"])) == 3  # fresh each call
    assert all(0 <= s < 2**31 for s in results[0]["seeds"])
    for r in results:
        assert (r["numpy_next"], r["torch_next"], r["random_next"]) == expected


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
    results = _run(comm_run_distributed, path, cases.object_cases, world_size=world)
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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_dict_sums_means_and_key_check(
    comm_run_distributed: Any, path: str, world: int
) -> None:
    s = sum(range(1, world + 1))
    results = _run(comm_run_distributed, path, cases.reduce_dict_cases, world_size=world)
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


@pytest.mark.parametrize(("coalesce", "bucket"), [(True, -1), (True, 0.00001), (False, -1)])
def test_all_reduce_params(comm_run_distributed: Any, coalesce: bool, bucket: float) -> None:
    world = 3
    results = comm_run_distributed(cases.reduce_params_cases, coalesce, bucket, world_size=world)
    sizes = [6, 2, 2, 1]
    expected = [[float(sum(r + i for r in range(world)))] * n for i, n in enumerate(sizes)]
    expected.append([sum(range(world))] * 4)
    assert results == [expected] * world


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("device", "tmpdir"), [("cpu", False), ("cpu", True), ("gpu", False)])
def test_collect_results_order_none_and_truncation(
    comm_run_distributed: Any, world: int, device: str, tmpdir: bool, tmp_path: Path
) -> None:
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "keep.txt").write_text("mine")
    root = str(tmp_path) if tmpdir else None
    results = comm_run_distributed(cases.collect_cases, device, root, world_size=world)
    size = 10
    per_rank = -(-size // world)
    # hand-derived: the interleaved order is the dataset order, truncated to size
    expected = [None if i % 4 == 3 else (i, [i]) for i in range(size)]
    # rank W-1 dropped its last item, which lies beyond `size` only when padding was added
    if world * per_rank == size:
        dropped = (world - 1) + world * (per_rank - 1)
        expected = [e for i, e in enumerate(expected) if i != dropped]
    assert results[0]["result"] == expected
    for r in results[1:]:
        assert r["result"] is None
    for r in results:
        assert r["same_with_user_dir"] is True
        assert r["tmpdir_removed"] is True
        assert r["user_dir_kept"] is True


def test_collect_results_parts_a_sampler_would_not_give(comm_run_distributed: Any) -> None:
    # rank r holds r + 1 items: rows of the interleave run out one rank at a time
    results = comm_run_distributed(cases.collect_not_sampler_shaped, world_size=3)
    assert results[0] == ["0.0", "1.0", "2.0", "1.1", "2.1", "2.2"]
    assert results[1:] == [None, None]


def test_collect_results_error_on_one_rank_raises_everywhere(comm_run_distributed: Any) -> None:
    for name, message in comm_run_distributed(cases.collect_error_case, world_size=2):
        assert name == "RemoteRankError"
        assert "collect_results failed on rank(s) 1" in message


@pytest.mark.parametrize("tmpdir", [False, True])
def test_collect_results_part_that_fails_to_unpickle_on_rank_zero(
    comm_run_distributed: Any, tmpdir: bool, tmp_path: Path
) -> None:
    root = str(tmp_path) if tmpdir else None
    results = comm_run_distributed(cases.collect_load_failure_case, root, world_size=3)
    # every rank raises the same error, naming rank 0 and its unpickling error
    _raised_on_every_rank(results, 0, "this object cannot be rebuilt on the receiving rank")
    # rank 2's large part was drained (or its file removed), not left for the next call
    assert [r["left"] for r in results] == [False, False, False]
    assert results[0]["again"] == ["item 0", "item 1", "item 2"]
    assert results[1]["again"] is results[2]["again"] is None
    assert [r["total"] for r in results] == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_collect_results_streams_large_parts_with_tensors(
    comm_run_distributed: Any, path: str, world: int
) -> None:
    results = _run(comm_run_distributed, path, cases.collect_large_case, world_size=world)
    n = cases.LARGE_PART
    size = world * n - 1  # the last rank's part is one item short
    # hand-derived: item i comes from rank i % W, position i // W of its part
    expected = [cases.large_item(i % world, i // world) for i in range(size)]
    assert results[0]["result"] == [cases.summarise_item(item) for item in expected]
    assert results[0]["bytes"] > 4 * 128 * 1024  # more chunks than receives posted ahead
    assert [r["result"] for r in results[1:]] == [None] * (world - 1)
    assert results[0]["medium"] == [f"{i % world}:{i // world}" for i in range(world * 2000)]
    assert [r["again"] for r in results] == [list(range(world))] + [None] * (world - 1)
    assert [r["medium"] for r in results[1:]] == [None] * (world - 1)
    # rank 0 saw each shape: streamed (-1), one message (its size), inline (0); with
    # inline data switched off the small part goes as one message too
    large, medium, small = results[0]["shapes"]
    assert large == [-1] * (world - 1)
    assert len(medium) == len(small) == world - 1
    assert all(count > 0 for count in medium)
    if path == "inline":
        assert small == [0] * (world - 1)
    else:
        assert all(count > 0 for count in small)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_collect_results_pickling_fails_in_the_middle_of_a_part(
    comm_run_distributed: Any, path: str, world: int
) -> None:
    failing = world - 1  # its item 20,000 refuses to be pickled, long after the first chunk
    results = _run(
        comm_run_distributed,
        path,
        cases.collect_midstream_failure_case,
        failing,
        "pickle",
        world_size=world,
    )
    _raised_on_every_rank(results, failing, "this object refuses to be pickled")
    assert results[0]["shapes"] == [-1] * (world - 1)  # every part was streamed
    for r in results:
        assert r["total"] == float(sum(range(world)))
    assert results[0]["again"] == [f"item {i}" for i in range(world)]
    assert [r["again"] for r in results[1:]] == [None] * (world - 1)
    assert results[failing]["sent_before_failing"][0] > 0


@pytest.mark.parametrize("world", WORLDS)
def test_collect_results_pickling_fails_while_the_part_is_announced(
    comm_run_distributed: Any, world: int
) -> None:
    # the sender starts its part's handshake after the pickler's first 64 KiB frame and
    # pickles on meanwhile; item 10,000 (at ~89 KB) fails before the handshake's outcome is known
    failing = world - 1
    results = comm_run_distributed(
        cases.collect_midstream_failure_case, failing, "pickle", 10_000, world_size=world
    )
    _raised_on_every_rank(results, failing, "this object refuses to be pickled")
    assert results[0]["shapes"] == [-1] * (world - 1)
    assert results[failing]["sent_before_failing"] == [0]  # no chunk had gone yet
    for r in results:
        assert r["total"] == float(sum(range(world)))
    assert results[0]["again"] == [f"item {i}" for i in range(world)]


@pytest.mark.parametrize("path", PATHS)
def test_collect_results_unpickling_fails_in_the_middle_of_a_part(
    comm_run_distributed: Any, path: str
) -> None:
    # rank 0 cannot rebuild item 20,000 of rank 1's part; rank 2's part still comes
    results = _run(
        comm_run_distributed, path, cases.collect_midstream_failure_case, 1, "load", world_size=3
    )
    _raised_on_every_rank(results, 0, "this object cannot be rebuilt on the receiving rank")
    assert results[0]["shapes"] == [-1, -1]
    for r in results:
        assert r["total"] == 3.0
    assert results[0]["again"] == ["item 0", "item 1", "item 2"]


@pytest.mark.parametrize("path", PATHS)
def test_mismatched_calls_raise_on_every_rank(comm_run_distributed: Any, path: str) -> None:
    for r in _run(comm_run_distributed, path, cases.mismatch_cases, world_size=2):
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


@pytest.mark.parametrize("debug", [False, True])
def test_collect_results_mismatch_while_a_part_is_streamed(
    comm_run_distributed: Any, debug: bool
) -> None:
    results = comm_run_distributed(cases.collect_mismatch_case, debug, world_size=2)
    for r in results:
        name, message = r["first"]
        assert name == "CollectiveMismatchError"
        assert "collect_results" in message
        assert "all_reduce" in message
        assert ("helpers.py:" in message) is debug  # the call-site column of debug mode
        assert r["total"] == 1.0
    assert results[0]["again"] is True
    assert results[1]["again"] is None


def test_remote_rank_error_names_rank_and_cause(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(cases.remote_error_details, world_size=3):
        assert r["ranks"] == (1,)
        assert r["operation"] == "all_gather_object"
    assert (
        comm_run_distributed(cases.remote_error_details, world_size=3)[1]["cause"] == "RuntimeError"
    )


def test_mismatch_table_has_a_row_per_rank(comm_run_distributed: Any) -> None:
    rows = comm_run_distributed(cases.mismatch_rows, world_size=3)[0]
    assert [row["rank"] for row in rows] == [0, 1, 2]
    assert [row["shape"] for row in rows] == [(1,), (2,), (3,)]
    assert {row["dtype"] for row in rows} == {"float32"}
    assert {row["op"] for row in rows} == {"sum"}
