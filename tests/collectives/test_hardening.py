"""Protocol hardening: both paths give the same bits, every dtype has a code, versions are
checked, and the smaller semantics (leaf tensors, read-only roots, conjugate views, all or
nothing parameters, picklable errors)."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from comm_collectives import _capacity, _frame, _route
from comm_core import CollectiveMismatchError, RankFailure, RemoteRankError, process_group
from tests.helpers import caught

DTYPES = [
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex64",
    "complex128",
]

OPS = ["sum", "mean", "max", "min", "product"]


def _reference(inputs: list[list[float]], op: str) -> list[float]:
    columns = list(zip(*inputs))
    if op == "sum":
        return [math.fsum(c) for c in columns]
    if op == "mean":
        return [math.fsum(c) / len(c) for c in columns]
    if op == "max":
        return [max(c) for c in columns]
    if op == "min":
        return [min(c) for c in columns]
    return [math.prod(c) for c in columns]


N = 200  # elements: the largest dtype (16 bytes) fits the first inline capacity (4 KiB)


def _input(name: str, rank: int) -> torch.Tensor:
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (N,), generator=g).bool()
    if dtype.is_complex:
        return torch.complex(torch.randn(N, generator=g), torch.randn(N, generator=g)).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(N, generator=g, dtype=torch.float64) * 3).to(dtype)
    low = 0 if name.startswith("uint") else -5
    return torch.randint(low, 6, (N,), generator=g, dtype=torch.int64).to(dtype)


def paths_agree(names: list[str], ops: list[str]) -> dict[str, Any]:
    """Each (dtype, op): the bytes of the result on the inline and the long path, how many
    collectives the inline call took, and this rank's input (as float64 where it has one)."""
    rank = dist.get_rank()
    group = torch_dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {}
    for name in names:
        x = _input(name, rank)
        for op in ops:
            results: list[Any] = []
            calls = 0
            for path in ("inline", "long"):
                t = x.clone()
                limit = _capacity.inline_limit(0) if path == "long" else contextlib.nullcontext()
                before = group._get_sequence_number_for_group()
                with limit:
                    try:
                        dist.all_reduce(t, op=op)
                        results.append(t.view(torch.uint8).tolist())
                    except RemoteRankError as exc:
                        results.append(f"RemoteRankError: {exc.failures[0].error_type}")
                    except (ValueError, TypeError) as exc:
                        results.append(type(exc).__name__)
                if path == "inline":
                    calls = group._get_sequence_number_for_group() - before
            value = t.to(torch.float64).tolist() if not (x.is_complex() or name == "bool") else []
            out[f"{name}/{op}"] = {
                "inline": results[0],
                "long": results[1],
                "calls": calls,
                "input": x.to(torch.float64).tolist()
                if not (x.is_complex() or name == "bool")
                else [],
                "result": value if isinstance(results[1], list) else [],
            }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_inline_and_long_paths_give_the_same_bits(comm_run_distributed: Any, world: int) -> None:
    results = comm_run_distributed(paths_agree, DTYPES, OPS, world_size=world, timeout=120)
    for key in results[0]:
        name, op = key.split("/")
        cells = [r[key] for r in results]
        first = cells[0]
        for cell in cells:
            assert cell["inline"] == cell["long"], key  # bit for bit, or the same error
            assert cell["inline"] == first["inline"], key  # and the same on every rank
        if isinstance(first["inline"], str):  # an op the dtype does not have
            assert (
                (name, op) in {("bool", "sum"), ("bool", "mean")}
                or (name.startswith("complex") and op in ("max", "min"))
                or op == "mean"
            ), key
            continue
        assert first["calls"] == 1, key  # the inline call really was one collective
        if name in ("float32", "float64") or name.startswith(("int", "uint")):
            expected = _reference([c["input"] for c in cells], op)
            got = first["result"]
            if name.startswith(("int", "uint")) and op in ("sum", "product"):
                bits = int(name.removeprefix("uint").removeprefix("int"))
                span = 2**bits
                low = 0 if name.startswith("uint") else -(2 ** (bits - 1))
                expected = [(int(e) - low) % span + low for e in expected]  # wraps around
            rel = 1e-5 if name == "float32" else 1e-12
            assert got == pytest.approx(expected, rel=rel, abs=1e-6), key
        elif op in ("sum", "max", "min") and not name.startswith(("complex", "bool")):
            # the 16- and 8-bit floats: the exact sum of the inputs (every input of these
            # tests adds up exactly in float32), rounded once to the dtype
            exact = _reference([c["input"] for c in cells], op)
            expected = torch.tensor(exact, dtype=torch.float64).to(getattr(torch, name))
            assert first["result"] == expected.to(torch.float64).tolist(), key


def dtype_codes() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for a, b in [("float8_e4m3fn", "float8_e5m2"), ("uint16", "uint32"), ("complex32", "int32")]:
        dtype = getattr(torch, a if rank == 0 else b)
        out[f"{a}/{b}"] = caught(dist.all_gather, torch.ones(3).to(dtype))
    ok = dist.all_gather(torch.full((2,), float(rank + 1)).to(torch.float8_e5m2))
    out["float8_ok"] = [t.to(torch.float32).tolist() for t in ok]
    return out


def test_every_dtype_has_its_own_code(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(dtype_codes, world_size=2):
        for pair, (name, message) in r.items():
            if pair == "float8_ok":
                continue
            a, b = pair.split("/")
            assert name == "CollectiveMismatchError", pair
            assert a in message, message
            assert b in message, message
        assert r["float8_ok"] == [[1.0, 1.0], [2.0, 2.0]]


def version_mismatch() -> dict[str, Any]:
    rank = dist.get_rank()
    saved = _frame.VERSION
    if rank == 1:
        _frame.VERSION = saved + 7
    try:
        got = caught(dist.all_reduce, torch.ones(2))
    finally:
        _frame.VERSION = saved
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"caught": got, "next": float(t)}


def test_a_different_wire_protocol_version_is_a_clear_error(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(version_mismatch, world_size=2):
        name, message = r["caught"]
        assert name == "CollectiveMismatchError"
        assert "incompatible versions of the comm-collectives wire protocol" in message
        assert "same comm-collectives version on every node" in message
        assert r["next"] == 3.0


def minor_cases(long_path: bool) -> dict[str, Any]:
    """Leaf tensors that require grad, a read-only root in broadcast, conjugate views,
    all_reduce_params all or nothing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    limit = _capacity.inline_limit(0) if long_path else contextlib.nullcontext()
    with limit:
        leaf = torch.full((3,), float(rank + 1), requires_grad=True)
        dist.all_reduce(leaf)
        out["leaf"] = (leaf.detach().tolist(), leaf.requires_grad)
        # the root's tensor is an expanded view (not writable in place); only read
        data = torch.ones(1).expand(1000) * 0 + 5 if rank == 0 else torch.zeros(1000)
        if rank == 0:
            data = torch.full((1,), 5.0).expand(1000)
        dist.broadcast(data, src=0)
        out["broadcast"] = (float(data.min()), float(data.max()))
        z = torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)
        views = dist.all_gather(z.conj() if rank == world - 1 else z)
        out["conj"] = [[(c.real, c.imag) for c in v.tolist()] for v in views]
        neg = dist.all_gather(z.conj().imag if rank == 0 else z.imag)  # a negative-bit view
        out["neg"] = [v.tolist() for v in neg]
        objs = dist.all_gather_object({"z": z.conj()})
        out["conj_object"] = [[(c.real, c.imag) for c in o["z"].tolist()] for o in objs]
        # mean of a float buffer and an integer counter whose mean is not exact
        running = torch.full((2,), float(rank))
        counter = torch.tensor(10 + rank)
        out["params"] = caught(dist.all_reduce_params, [running, counter], op="mean")
        out["params_untouched"] = (running.tolist(), int(counter))
    return out


@pytest.mark.parametrize("long_path", [False, True])
def test_leaf_tensors_readonly_roots_conjugates_and_all_or_nothing_params(
    comm_run_distributed: Any, long_path: bool
) -> None:
    world = 2
    for rank, r in enumerate(comm_run_distributed(minor_cases, long_path, world_size=world)):
        assert r["leaf"] == ([3.0, 3.0, 3.0], True)
        assert r["broadcast"] == (5.0, 5.0)
        plain = [[(1.0 * k, 2.0 * k), (3.0 * k, -1.0 * k)] for k in (1, 2)]
        conj = [[(a, -b) for a, b in row] for row in plain]
        assert r["conj"] == [plain[0], conj[1]]
        assert r["neg"] == [[-2.0, 1.0], [4.0, -2.0]]
        assert r["conj_object"] == conj
        name, message = r["params"]
        assert name == "ValueError"
        assert "mean is not an integer" in message
        assert r["params_untouched"] == ([float(rank)] * 2, 10 + rank)  # nothing written


def mismatch_pickles() -> dict[str, Any]:
    import pickle

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    try:
        dist.all_reduce(torch.ones(rank + 1))
    except CollectiveMismatchError as exc:
        again = pickle.loads(pickle.dumps(exc))
        out["mismatch"] = (str(again) == str(exc), again.rows == exc.rows, again.operation)
    try:
        dist.all_gather_object((lambda: 0) if rank == 0 else 1)
    except RemoteRankError as exc:
        again = pickle.loads(pickle.dumps(exc))
        out["remote"] = (str(again) == str(exc), again.ranks, again.operation)
    return out


def test_errors_survive_pickling(comm_run_distributed: Any) -> None:
    local = RemoteRankError("all_reduce", [RankFailure(1, "ValueError", "bad", "tb")])
    again = pickle.loads(pickle.dumps(local))
    assert (again.operation, again.ranks, str(again)) == ("all_reduce", (1,), str(local))
    mismatch = CollectiveMismatchError("broadcast", "the ranks differ.", [{"rank": 0}], "fix")
    again_m = pickle.loads(pickle.dumps(mismatch))
    assert (again_m.rows, again_m.hint, str(again_m)) == (({"rank": 0},), "fix", str(mismatch))
    for r in comm_run_distributed(mismatch_pickles, world_size=2):
        assert r["mismatch"] == (True, True, "all_reduce")
        assert r["remote"] == (True, (0,), "all_gather_object")


def side_channel_counts() -> dict[str, Any]:
    """Collectives on the group itself and on the side group, per call, with the headers on
    the side group (the nccl layout, forced on gloo)."""
    rank = dist.get_rank()
    group = torch_dist.distributed_c10d._get_default_group()
    saved = _route.side_channel, process_group._CPU_BACKENDS
    # the nccl layout on gloo: headers on the CPU route, and gloo counted as a backend
    # without CPU support, so the route is comm-core's CPU twin of the default group
    _route.side_channel, process_group._CPU_BACKENDS = True, ()
    try:
        side = _route.header_route(group)[0]
        assert side is not None
        out: dict[str, Any] = {}
        for name, path in (("inline", False), ("long", True)):
            t = torch.full((3,), float(rank + 1))
            data0 = group._get_sequence_number_for_group()
            side0 = side._get_sequence_number_for_group()
            limit = _capacity.inline_limit(0) if path else contextlib.nullcontext()
            with limit:
                dist.all_reduce(t)
            out[name] = (
                t.tolist(),
                group._get_sequence_number_for_group() - data0,
                side._get_sequence_number_for_group() - side0,
            )
        out["mismatch"] = caught(dist.all_reduce, torch.ones(rank + 1))[0]
        out["remote"] = caught(dist.all_reduce, torch.ones(2), op="avg" if rank else "sum")[0]
        out["same_side"] = _route.header_route(group)[0] is side
        # one CPU twin of the world: the headers' route is the group collect_results uses
        out["is_cpu_twin"] = side is dist.get_cpu_group() and side is not group
        return out
    finally:
        _route.side_channel, process_group._CPU_BACKENDS = saved


def test_headers_can_travel_on_a_cpu_side_group(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(side_channel_counts, world_size=2):
        # inline: the data rides in the headers, all on the side group
        assert r["inline"] == ([3.0] * 3, 0, 1)
        # long: the handshake alone on the side group (the data was staged before it, so
        # no vote follows), the data (all-to-all, all-gather) on the group itself
        assert r["long"] == ([3.0] * 3, 2, 1)
        assert r["mismatch"] == "CollectiveMismatchError"
        assert r["remote"] == "RemoteRankError"
        assert r["same_side"] is True
        assert r["is_cpu_twin"] is True


def unchecked_cases() -> dict[str, Any]:
    """The unchecked path: the backend's own collective, one per call, right values."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = torch_dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {}
    with dist.unchecked():
        before = group._get_sequence_number_for_group()
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, op="mean")
        out["all_reduce"] = (t.tolist(), group._get_sequence_number_for_group() - before)
        ints = torch.tensor([2 * rank, 4], dtype=torch.int32)
        dist.all_reduce(ints, op="mean")
        out["int_mean"] = (ints.tolist(), str(ints.dtype))
        flags = torch.tensor([rank == 0, False])
        dist.all_reduce(flags, op="max")
        out["bool"] = flags.tolist()
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=world - 1)
        out["broadcast"] = b.tolist()
        d = {"a": torch.tensor(float(rank)), "n": torch.tensor([rank, 1])}
        before = group._get_sequence_number_for_group()
        dist.all_reduce_dict(d)
        out["dict"] = (
            float(d["a"]),
            d["n"].tolist(),
            group._get_sequence_number_for_group() - before,
        )
        params = [torch.ones(2) * rank, torch.tensor([rank], dtype=torch.int64)]
        dist.all_reduce_params(params, op="max")
        out["params"] = [p.tolist() for p in params]
        with dist.debug_mode():  # debug mode turns the checks back on
            out["debug"] = caught(dist.all_reduce, torch.ones(rank + 1))[0]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_unchecked_calls_issue_only_the_backend_collective(
    comm_run_distributed: Any, world: int
) -> None:
    total = world * (world + 1) / 2
    for r in comm_run_distributed(unchecked_cases, world_size=world):
        assert r["all_reduce"] == ([total / world] * 3, 1)
        assert r["int_mean"] == ([world - 1, 4], "torch.int32")
        assert r["bool"] == [True, False]
        assert r["broadcast"] == [float(world - 1)] * 2
        # one all-reduce per dtype: float32 and int64
        assert r["dict"] == (total - world, [total - world, world], 2)
        assert r["params"] == [[float(world - 1)] * 2, [world - 1]]
        assert r["debug"] == "CollectiveMismatchError"


def debug_env_on_one_rank_unchecked() -> dict[str, Any]:
    """COMM_DEBUG set on the last rank only, inside unchecked: every rank still issues the
    backend's one all-reduce (a handshake on one rank only waited for the timeout)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = torch_dist.distributed_c10d._get_default_group()
    previous = os.environ.get("COMM_DEBUG")
    if rank == world - 1:
        os.environ["COMM_DEBUG"] = "1"
    try:
        t = torch.full((3,), float(rank + 1))
        before = group._get_sequence_number_for_group()
        with dist.unchecked():
            dist.all_reduce(t)
        return {"sum": t.tolist(), "calls": group._get_sequence_number_for_group() - before}
    finally:
        if previous is None:
            os.environ.pop("COMM_DEBUG", None)
        else:
            os.environ["COMM_DEBUG"] = previous


def test_debug_env_on_one_rank_keeps_unchecked_calls_unchecked(
    comm_run_distributed: Any,
) -> None:
    results = comm_run_distributed(debug_env_on_one_rank_unchecked, world_size=2, timeout=30)
    for r in results:
        assert r == {"sum": [3.0] * 3, "calls": 1}


def side_channel_subgroups() -> dict[str, Any]:
    """Headers on the CPU route with subgroups that only some ranks use, then a group of
    every rank: no group creation may depend on which groups a rank made before."""
    rank = dist.get_rank()
    saved = _route.side_channel, process_group._CPU_BACKENDS
    # the nccl layout on gloo: headers on the CPU route, and gloo counted as a backend
    # without CPU support, so the route is comm-core's CPU twin of the default group
    _route.side_channel, process_group._CPU_BACKENDS = True, ()
    try:
        pair = torch_dist.new_group([0, 1])
        out: dict[str, Any] = {}
        if rank in (0, 1):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=pair)
            out["pair"] = float(t)
        everyone = torch_dist.new_group([0, 1, 2])
        out["everyone"] = dist.all_gather_object(rank * 10, group=everyone)
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        out["default"] = float(t)
        torch_dist.destroy_process_group(pair)
        torch_dist.destroy_process_group(everyone)
        return out
    finally:
        _route.side_channel, process_group._CPU_BACKENDS = saved


def test_side_channel_with_subgroups_some_ranks_use(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(side_channel_subgroups, world_size=3)
    for rank, r in enumerate(results):
        if rank < 2:
            assert r["pair"] == 3.0
        assert r["everyone"] == [0, 10, 20]
        assert r["default"] == 3.0
