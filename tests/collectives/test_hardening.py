"""Protocol hardening: both paths give the same bits, every dtype has a code, versions are
checked, and the smaller semantics (leaf tensors, read-only roots, conjugate views, all or
nothing parameters, picklable errors)."""

from __future__ import annotations

import math
import pickle
from typing import Any

import pytest
import torch

from comm_core import CollectiveMismatchError, RankFailure, RemoteRankError

from . import hardening_cases

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


@pytest.mark.parametrize("world", [2, 3])
def test_inline_and_long_paths_give_the_same_bits(comm_run_distributed: Any, world: int) -> None:
    results = comm_run_distributed(
        hardening_cases.paths_agree, DTYPES, OPS, world_size=world, timeout=120
    )
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


def test_every_dtype_has_its_own_code(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(hardening_cases.dtype_codes, world_size=2):
        for pair, (name, message) in r.items():
            if pair == "float8_ok":
                continue
            a, b = pair.split("/")
            assert name == "CollectiveMismatchError", pair
            assert a in message, message
            assert b in message, message
        assert r["float8_ok"] == [[1.0, 1.0], [2.0, 2.0]]


def test_a_different_wire_protocol_version_is_a_clear_error(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(hardening_cases.version_mismatch, world_size=2):
        name, message = r["caught"]
        assert name == "CollectiveMismatchError"
        assert "incompatible versions of the comm-collectives wire protocol" in message
        assert "same comm-collectives version on every node" in message
        assert r["next"] == 3.0


@pytest.mark.parametrize("long_path", [False, True])
def test_leaf_tensors_readonly_roots_conjugates_and_all_or_nothing_params(
    comm_run_distributed: Any, long_path: bool
) -> None:
    world = 2
    for rank, r in enumerate(
        comm_run_distributed(hardening_cases.minor_cases, long_path, world_size=world)
    ):
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


def test_errors_survive_pickling(comm_run_distributed: Any) -> None:
    local = RemoteRankError("all_reduce", [RankFailure(1, "ValueError", "bad", "tb")])
    again = pickle.loads(pickle.dumps(local))
    assert (again.operation, again.ranks, str(again)) == ("all_reduce", (1,), str(local))
    mismatch = CollectiveMismatchError("broadcast", "the ranks differ.", [{"rank": 0}], "fix")
    again_m = pickle.loads(pickle.dumps(mismatch))
    assert (again_m.rows, again_m.hint, str(again_m)) == (({"rank": 0},), "fix", str(mismatch))
    for r in comm_run_distributed(hardening_cases.mismatch_pickles, world_size=2):
        assert r["mismatch"] == (True, True, "all_reduce")
        assert r["remote"] == (True, (0,), "all_gather_object")


def test_headers_can_travel_on_a_cpu_side_group(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(hardening_cases.side_channel_counts, world_size=2):
        # inline: the data rides in the headers, all on the side group
        assert r["inline"] == ([3.0] * 3, 0, 1)
        # long: handshake and vote on the side group, the data (all-to-all, all-gather)
        # on the group itself
        assert r["long"] == ([3.0] * 3, 2, 2)
        assert r["mismatch"] == "CollectiveMismatchError"
        assert r["remote"] == "RemoteRankError"
        assert r["same_side"] is True
        assert r["is_cpu_twin"] is True


@pytest.mark.parametrize("world", [2, 3])
def test_unchecked_calls_issue_only_the_backend_collective(
    comm_run_distributed: Any, world: int
) -> None:
    total = world * (world + 1) / 2
    for r in comm_run_distributed(hardening_cases.unchecked_cases, world_size=world):
        assert r["all_reduce"] == ([total / world] * 3, 1)
        assert r["int_mean"] == ([world - 1, 4], "torch.int32")
        assert r["bool"] == [True, False]
        assert r["broadcast"] == [float(world - 1)] * 2
        # one all-reduce per dtype: float32 and int64
        assert r["dict"] == (total - world, [total - world, world], 2)
        assert r["params"] == [[float(world - 1)] * 2, [world - 1]]
        assert r["debug"] == "CollectiveMismatchError"


def test_debug_env_on_one_rank_keeps_unchecked_calls_unchecked(
    comm_run_distributed: Any,
) -> None:
    results = comm_run_distributed(
        hardening_cases.debug_env_on_one_rank_unchecked, world_size=2, timeout=30
    )
    for r in results:
        assert r == {"sum": [3.0] * 3, "calls": 1}


def test_side_channel_with_subgroups_some_ranks_use(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(hardening_cases.side_channel_subgroups, world_size=3)
    for rank, r in enumerate(results):
        if rank < 2:
            assert r["pair"] == 3.0
        assert r["everyone"] == [0, 10, 20]
        assert r["default"] == 3.0
