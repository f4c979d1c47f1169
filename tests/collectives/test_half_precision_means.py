"""16-bit floats give the blocking all_reduce's result on every path that reduces tensors.

The blocking all_reduce accumulates float16 and bfloat16 in float32 and rounds once at the
end: a float16 mean of 40000 on every rank is 40000 although the sum (inf in float16)
overflows on the way. Each rank body below reduces the same rank-dependent values along
every path (blocking, asynchronous, unchecked, reduce to a root, all_reduce_dict,
all_reduce_params; the inline and the long data paths) for both 16-bit dtypes and every
op. The expected values are computed here, independently of the code under test: the
exact result of the rank values (Python floats, exact for these hand-picked values),
rounded once to the dtype. The values overflow the 16-bit sum or product (two ranks), or
make every order of 16-bit steps round differently from that one rounding (three ranks).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_collectives._capacity import inline_limit

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
OPS = ("sum", "mean", "max", "min", "product")
T = 2.0**-24  # float16's smallest subnormal

# VALUES[world][dtype][op]: one list per rank; column j of every rank is one element
VALUES: dict[int, dict[str, dict[str, list[list[float]]]]] = {
    2: {
        "float16": {
            # 40000 + 40000 and -60000 - 60000 overflow; 2048 + 3 = 2051 rounds to 2052
            "sum": [[40000, -60000, 2048, 0.1, 300, T], [40000, -60000, 3, 0.2, 300, 3 * T]],
            # each mean is in range although its float16 sum is not (but the last)
            "mean": [
                [40000, 60000, -65504, 2048, 0.1, T],
                [40000, 65504, -65504, 3, 0.2, 2 * T],
            ],
            "max": [[40000, -65504, 1.0, 0.1], [60000, 5, 1.0009765625, -0.1]],
            "min": [[40000, -65504, 1.0, 0.1], [60000, 5, 1.0009765625, -0.1]],
            # 300 * 300 and 256 * 256 overflow; 0.01 * 0.001 is a subnormal
            "product": [[300, 256, 0.01, 1.5, -3], [300, 256, 0.001, 1.5, 7]],
        },
        "bfloat16": {
            # 3e38 + 3e38 overflows (float32 too); 256 + 1 = 257 rounds to 256
            "sum": [[3e38, 1e38, 256, 0.1, -5], [3e38, 1e38, 1, 0.2, 3]],
            "mean": [[2e38, 1e38, 256, 0.1, 1.0], [1e38, 1e38, 3, 0.2, 1.0078125]],
            "max": [[3e38, -1e38, 1.0, 0.1], [2e38, 5, 1.0078125, -0.1]],
            "min": [[3e38, -1e38, 1.0, 0.1], [2e38, 5, 1.0078125, -0.1]],
            # 1e20 * 1e19 overflows; 1e-30 * 1e-10 is a subnormal
            "product": [[1e20, 1e-30, 1.5, -3], [1e19, 1e-10, 1.5, 7]],
        },
    },
    3: {
        "float16": {
            # every order of float16 steps gives 11.65625 for the last column
            "sum": [[40000, 2048, 7.6015625], [40000, 1, 1.6513671875], [-20000, 1, 2.408203125]],
            "mean": [[40000, 2048, 7.6015625], [40000, 1, 1.6513671875], [40000, 1, 2.408203125]],
            "max": [[1, -5, 7.6015625], [2, -6, 1.6513671875], [3, -7, 2.408203125]],
            "min": [[1, -5, 7.6015625], [2, -6, 1.6513671875], [3, -7, 2.408203125]],
            # every order of float16 steps gives 0.02392578125 for the last column
            "product": [[300, 2, 0.306640625], [300, 3, 0.275390625], [0.001, 4, 0.283203125]],
        },
        "bfloat16": {
            # every order of bfloat16 steps gives 12.0 for the last column
            "sum": [[3e38, 256, 7.3125], [3e38, 1, 1.7421875], [-1e38, 1, 2.90625]],
            # the sum of the last column is in float32's range (the accumulator's)
            "mean": [[256, 7.3125, 1e38], [1, 1.7421875, 1e38], [1, 2.90625, 5e37]],
            "max": [[1, -5, 7.3125], [2, -6, 1.7421875], [3, -7, 2.90625]],
            "min": [[1, -5, 7.3125], [2, -6, 1.7421875], [3, -7, 2.90625]],
            # every order of bfloat16 steps gives 0.0224609375 for the last column
            "product": [[1e20, 2, 0.263671875], [1e15, 3, 0.310546875], [1e-10, 4, 0.2734375]],
        },
    },
}

# a path returns the tensors that hold a result on this rank (each must be the expected one)
Path = Callable[[torch.Tensor, str, int], list[torch.Tensor]]


def _blocking(t: torch.Tensor, op: str, dst: int) -> list[torch.Tensor]:
    dist.all_reduce(t, op=op)
    return [t]


def _async(t: torch.Tensor, op: str, dst: int) -> list[torch.Tensor]:
    work = dist.all_reduce(t, op=op, async_op=True)
    assert work is not None
    work.wait(timeout=30.0)
    return [t]


def _reduce(t: torch.Tensor, op: str, dst: int) -> list[torch.Tensor]:
    dist.reduce(t, dst=dst, op=op)
    return [t] if dist.get_rank() == dst else []


def _reduce_async(t: torch.Tensor, op: str, dst: int) -> list[torch.Tensor]:
    work = dist.reduce(t, dst=dst, op=op, async_op=True)
    assert work is not None
    work.wait(timeout=30.0)
    return [t] if dist.get_rank() == dst else []


def _dict(t: torch.Tensor, op: str, dst: int) -> list[torch.Tensor]:
    # 0-dim values of the same dtype share the flat buffer (stacked); another dtype beside
    data = {"v": t, "w": torch.ones(2), **{f"s{i}": x.clone() for i, x in enumerate(t)}}
    dist.all_reduce_dict(data, op=op)
    return [data["v"], torch.stack([data[f"s{i}"] for i in range(len(t))])]


def _params(t: torch.Tensor, op: str, dst: int) -> list[torch.Tensor]:
    # the same values twice in one bucket: at two places of the flat buffer
    other = torch.nn.Parameter(t.clone(), requires_grad=False)
    dist.all_reduce_params([t, other], op=op)
    return [t, other.data]


def _params_apart(t: torch.Tensor, op: str, dst: int) -> list[torch.Tensor]:
    dist.all_reduce_params([t], coalesce=False, op=op)
    return [t]


PATHS: dict[str, Path] = {
    "all_reduce": _blocking,
    "all_reduce/async": _async,
    "reduce": _reduce,
    "reduce/async": _reduce_async,
    "all_reduce_dict": _dict,
    "all_reduce_params": _params,
    "all_reduce_params/apart": _params_apart,
}
MODES = ("inline", "long", "unchecked")


def _run(path: Path, mode: str, t: torch.Tensor, op: str, dst: int) -> list[torch.Tensor]:
    if mode == "unchecked":
        with dist.unchecked():
            return path(t, op, dst)
    if mode == "long":
        with inline_limit(0):
            return path(t, op, dst)
    return path(t, op, dst)


def every_path(world: int) -> dict[str, list[list[float]]]:
    """Reduce this rank's values of ``VALUES[world]`` along every path, dtype and op."""
    rank = dist.get_rank()
    dst = world - 1  # not rank 0: the root of reduce is a real argument
    out: dict[str, list[list[float]]] = {}
    for dtype_name, by_op in VALUES[world].items():
        for op, rows in by_op.items():
            for mode in MODES:
                for name, path in PATHS.items():
                    t = torch.tensor(rows[rank], dtype=DTYPES[dtype_name])
                    results = _run(path, mode, t, op, dst)
                    key = f"{dtype_name}/{op}/{name}/{mode}"
                    out[key] = [r.float().tolist() for r in results]
    return out


def _expected(world: int, dtype_name: str, op: str) -> list[float]:
    """The exact result of the rank values (Python floats), rounded once to the dtype."""
    rows = VALUES[world][dtype_name][op]
    dtype = DTYPES[dtype_name]
    # the rank values as the ranks hold them (the dtype's nearest value)
    held = [[float(torch.tensor(v, dtype=torch.float64).to(dtype)) for v in row] for row in rows]
    exact: list[float] = []
    for column in zip(*held):
        if op == "sum":
            exact.append(math.fsum(column))
        elif op == "mean":
            exact.append(math.fsum(column) / world)
        elif op == "max":
            exact.append(max(column))
        elif op == "min":
            exact.append(min(column))
        else:
            exact.append(math.prod(column))
    return torch.tensor(exact, dtype=torch.float64).to(dtype).float().tolist()


@pytest.mark.parametrize("world", [2, 3])
def test_16_bit_reductions_give_the_blocking_result_on_every_path(
    comm_run_distributed: Any, world: int
) -> None:
    results = comm_run_distributed(every_path, world, world_size=world, timeout=120.0)
    wrong = []
    for dtype_name, by_op in VALUES[world].items():
        for op in by_op:
            expected = _expected(world, dtype_name, op)
            for mode in MODES:
                for name in PATHS:
                    key = f"{dtype_name}/{op}/{name}/{mode}"
                    holders = [world - 1] if name.startswith("reduce") else range(world)
                    for rank in range(world):
                        got = results[rank][key]
                        assert len(got) == (0 if rank not in holders else len(got) or 1)
                        wrong += [
                            f"{key} rank {rank}: {g} != {expected}" for g in got if g != expected
                        ]
    assert not wrong, "\n".join(wrong)


def _in_dtype(rows: torch.Tensor, op: str, order: tuple[int, ...]) -> list[float]:
    """The reduction done in the dtype itself, one rounding per step, in ``order``."""
    acc = rows[order[0]].clone()
    for index in order[1:]:
        acc = acc * rows[index] if op == "product" else acc + rows[index]
    return (acc / len(order) if op == "mean" else acc).float().tolist()


def test_the_hand_picked_values_overflow_or_round_a_16_bit_reduction() -> None:
    """The cases above would fail a reduction in the dtype itself, in any order of ranks.

    Two ranks: only a mean can tell (a 16-bit sum of two values rounds once, as the float32
    sum rounded back does); the float16 sum of 40000 and 40000 overflows, its mean does not.
    Three ranks: the sum, mean and product of both dtypes, whatever order the backend takes.
    """
    cases = [(2, "float16", "mean")]
    cases += [(3, d, op) for d in DTYPES for op in ("sum", "mean", "product")]
    for world, dtype_name, op in cases:
        rows = torch.tensor(VALUES[world][dtype_name][op], dtype=DTYPES[dtype_name])
        expected = _expected(world, dtype_name, op)
        for order in itertools.permutations(range(world)):
            assert _in_dtype(rows, op, order) != expected, (world, dtype_name, op, order)
    assert torch.tensor([40000.0, 40000.0], dtype=torch.float16).sum().isinf()
    assert _expected(2, "float16", "mean")[0] == 40000.0
