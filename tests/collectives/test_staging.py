"""Staging before the handshake: the long path of all_reduce, reduce, broadcast and scatter.

A rank whose data will not ride inline stages it before the handshake and sends a staging
failure in its header, so no vote follows. These tests force the other case on one rank
(it guesses "inline" although its data takes the long path): that rank stages after the
handshake and every rank votes, so the results stay right and its failure still raises on
every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from comm_collectives import _modes, rooted, tensors
from comm_collectives._capacity import inline_limit

N = 5000  # float32 elements; the tests switch inline data off (the capacity adapts)


@contextlib.contextmanager
def _late(active: bool) -> Iterator[None]:
    """On this rank, every long-path call guesses "inline" and stages after the handshake."""
    saved = tensors.stages_early, rooted.stages_early
    if active:
        tensors.stages_early = rooted.stages_early = lambda payload, group: False  # type: ignore[assignment]
    try:
        yield
    finally:
        tensors.stages_early, rooted.stages_early = saved


@contextlib.contextmanager
def _staging_fault(active: bool) -> Iterator[None]:
    def fail(stage: str, operation: str) -> None:
        if stage == "staging":
            raise OSError(f"no memory to stage {operation}")

    _modes.fault_hook = fail if active else None
    try:
        yield
    finally:
        _modes.fault_hook = None


def _calls(rank: int, world: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Each call with its rank-dependent input, and what it must leave on this rank."""
    summed = torch.full((N,), float(rank + 1))
    rooted_sum = torch.full((N,), float(rank + 1))
    async_sum = torch.arange(N, dtype=torch.float32) * (rank + 1)
    cast = torch.full((N,), float(rank))
    out = torch.zeros(N)
    parts = [torch.full((N,), 10.0 + k) for k in range(world)] if rank == 0 else None
    total = world * (world + 1) / 2

    def async_all_reduce() -> None:
        work = dist.all_reduce(async_sum, async_op=True)
        assert work is not None
        work.wait()

    return {
        "all_reduce": (
            lambda: dist.all_reduce(summed),
            lambda: bool(torch.equal(summed, torch.full((N,), total))),
        ),
        "all_reduce async": (
            async_all_reduce,
            lambda: bool(torch.equal(async_sum, torch.arange(N, dtype=torch.float32) * total)),
        ),
        "reduce": (
            lambda: dist.reduce(rooted_sum, dst=world - 1),
            lambda: rank != world - 1 or bool(torch.equal(rooted_sum, torch.full((N,), total))),
        ),
        "broadcast": (
            lambda: dist.broadcast(cast, src=1),
            lambda: bool(torch.equal(cast, torch.ones(N))),
        ),
        "scatter": (
            lambda: dist.scatter(out, parts, src=0),
            lambda: bool(torch.equal(out, torch.full((N,), 10.0 + rank))),
        ),
    }


def late_rank_calls(late: int, fail: bool) -> dict[str, Any]:
    """Every call with rank ``late`` staging after the handshake (and failing there when
    ``fail``): what each call left, how many collectives it issued, what it raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = torch_dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {}
    for name, (call, check) in _calls(rank, world).items():
        before = group._get_sequence_number_for_group()
        raised: tuple[str, tuple[int, ...]] | None = None
        with inline_limit(0), _late(rank == late), _staging_fault(fail and rank == late):
            try:
                call()
            except dist.RemoteRankError as exc:
                raised = (str(exc), exc.ranks)
        issued = group._get_sequence_number_for_group() - before
        after = torch.ones(3)
        dist.all_reduce(after)  # the world goes on
        out[name] = {
            "right": None if raised else check(),
            "issued": issued,
            "raised": raised,
            "next": after.tolist(),
        }
    return out


# collectives a long-path call issues when every rank staged early; a late rank adds a vote
_EARLY = {"all_reduce": 3, "all_reduce async": 2, "reduce": 2, "broadcast": 2, "scatter": 2}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_staged_early_means_no_vote(comm_run_distributed: Any, world: int) -> None:
    for r in comm_run_distributed(late_rank_calls, -1, False, world_size=world):
        for name, got in r.items():
            assert got["right"] is True, name
            assert got["issued"] == _EARLY[name], name
            assert got["next"] == [float(world)] * 3


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_stages_late_makes_every_rank_vote(
    comm_run_distributed: Any, world: int
) -> None:
    for r in comm_run_distributed(late_rank_calls, world - 1, False, world_size=world):
        for name, got in r.items():
            assert got["right"] is True, name
            assert got["issued"] == _EARLY[name] + 1, name


@pytest.mark.parametrize("world", [2, 3])
def test_a_late_staging_failure_raises_on_every_rank(comm_run_distributed: Any, world: int) -> None:
    for r in comm_run_distributed(late_rank_calls, world - 1, True, world_size=world):
        for name, got in r.items():
            assert got["raised"] is not None, name
            text, ranks = got["raised"]
            assert ranks == (world - 1,), name
            assert "no memory to stage" in text, name
            assert got["next"] == [float(world)] * 3, name


def early_staging_failure() -> dict[str, Any]:
    """Rank 0 fails to stage before the handshake: the failure travels in its header."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = torch_dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {}
    for name, (call, _) in _calls(rank, world).items():
        before = group._get_sequence_number_for_group()
        with inline_limit(0), _staging_fault(rank == 0):
            try:
                call()
                out[name] = None
            except dist.RemoteRankError as exc:
                # the handshake, then the failures' exchange (torch's all_gather_object: the
                # sizes, then the bytes); no vote, no data moved
                out[name] = (exc.ranks, group._get_sequence_number_for_group() - before)
    return out


def test_an_early_staging_failure_travels_in_the_header(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(early_staging_failure, world_size=2):
        assert r == dict.fromkeys(_EARLY, ((0,), 3))


def non_tensor_on_one_rank(kind: str) -> dict[str, Any]:
    """Rank 1 passes a list (or a nested tensor, which has no shape) where the others pass
    a tensor too large for the frame."""
    rank, world = dist.get_rank(), dist.get_world_size()
    big = torch.ones(N)
    parts = [torch.ones(N)] * world if rank == 0 else None
    calls: dict[str, Callable[[Any], Any]] = {
        "all_reduce": lambda t: dist.all_reduce(t),
        "reduce": lambda t: dist.reduce(t, dst=0),
        "broadcast": lambda t: dist.broadcast(t, src=0),
        "scatter": lambda t: dist.scatter(t, parts, src=0),
    }
    out: dict[str, Any] = {}
    for name, call in calls.items():
        with inline_limit(0):
            try:
                odd = [1.0] * N if kind == "list" else torch.nested.nested_tensor([big, big])
                call(odd if rank == 1 else big)
                out[name] = None
            except dist.RemoteRankError as exc:
                out[name] = exc.ranks
    return out


@pytest.mark.parametrize("kind", ["list", "nested"])
def test_a_non_tensor_on_one_rank_raises_on_every_rank(
    comm_run_distributed: Any, kind: str
) -> None:
    for r in comm_run_distributed(non_tensor_on_one_rank, kind, world_size=2):
        assert r == {"all_reduce": (1,), "reduce": (1,), "broadcast": (1,), "scatter": (1,)}
