"""collect_results on real gloo worlds of 2 and 3 ranks: order, None, truncation, parts
that stream in chunks, and failures while pickling or unpickling on one rank.

Each rank body runs on every rank and stands above the test that asserts on it; inputs
depend on the rank, the expected values are derived by hand from them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import comm_collectives as dist
from tests.helpers import Unpicklable, caught

from .data_paths import PATHS, WORLDS, run_on_path


def _raised_on_every_rank(results: list[Any], rank: int, cause: str) -> None:
    """Every rank's ``first`` call raised the same RemoteRankError, naming ``rank`` and
    ``cause``."""
    for r in results:
        name, message = r["first"]
        assert name == "RemoteRankError"
        assert f"collect_results failed on rank(s) {rank};" in message
        assert cause in message


def collect_cases(device: str, root: str | None) -> dict[str, Any]:
    """collect_results with a DistributedSampler-like split; ``root`` is a shared folder."""
    rank, world = dist.get_dist_info()
    size = 10
    # DistributedSampler padding: ceil(10 / W) items a rank, the last ones wrap around
    per_rank = -(-size // world)
    indices = [(rank + world * i) % size for i in range(per_rank)]
    results: list[Any] = [
        None if i % 4 == 3 else {"idx": i, "t": torch.tensor([i])} for i in indices
    ]
    if rank == world - 1:
        results = results[:-1]  # uneven parts
    tmpdir = os.path.join(root, "parts") if root else None  # does not exist yet
    user_dir = os.path.join(root, "user") if root else None  # the test made it, with a file
    out = dist.collect_results(results, size, device=device, tmpdir=tmpdir)
    out_user = dist.collect_results(results, size, device=device, tmpdir=user_dir)
    dist.barrier()
    summary = None
    if out is not None:
        summary = [None if r is None else (r["idx"], r["t"].tolist()) for r in out]
    return {
        "result": summary,
        "same_with_user_dir": (out_user is None)
        or [None if r is None else r["idx"] for r in out_user]
        == [None if r is None else r["idx"] for r in out],
        "tmpdir_removed": tmpdir is None or not os.path.exists(tmpdir),
        "user_dir_kept": user_dir is None or sorted(os.listdir(user_dir)) == ["keep.txt"],
    }


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("device", "tmpdir"), [("cpu", False), ("cpu", True), ("gpu", False)])
def test_collect_results_order_none_and_truncation(
    comm_run_distributed: Any, world: int, device: str, tmpdir: bool, tmp_path: Path
) -> None:
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "keep.txt").write_text("mine")
    root = str(tmp_path) if tmpdir else None
    results = comm_run_distributed(collect_cases, device, root, world_size=world)
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


def collect_not_sampler_shaped() -> list[Any] | None:
    """Parts whose lengths a sampler would not give: rank r holds r + 1 items."""
    rank = dist.get_rank()
    return dist.collect_results([f"{rank}.{i}" for i in range(rank + 1)], 100)


def test_collect_results_parts_a_sampler_would_not_give(comm_run_distributed: Any) -> None:
    # rank r holds r + 1 items: rows of the interleave run out one rank at a time
    results = comm_run_distributed(collect_not_sampler_shaped, world_size=3)
    assert results[0] == ["0.0", "1.0", "2.0", "1.1", "2.1", "2.2"]
    assert results[1:] == [None, None]


def collect_error_case() -> tuple[str, str]:
    rank = dist.get_rank()
    results: list[Any] = [Unpicklable()] if rank == 1 else [rank]
    return caught(dist.collect_results, results, 4)


def test_collect_results_error_on_one_rank_raises_everywhere(comm_run_distributed: Any) -> None:
    for name, message in comm_run_distributed(collect_error_case, world_size=2):
        assert name == "RemoteRankError"
        assert "collect_results failed on rank(s) 1" in message


def _refuse_to_load() -> None:
    message = "this object cannot be rebuilt on the receiving rank"
    raise RuntimeError(message)


class FailsToLoad:
    """Pickles fine; unpickling it raises (a class missing on the receiver, say)."""

    def __reduce__(self) -> Any:
        return (_refuse_to_load, ())


def collect_load_failure_case(root: str | None) -> dict[str, Any]:
    """Rank 0 cannot unpickle rank 1's part while rank 2's large part is still coming
    (through messages, or through a folder under ``root`` when it is given)."""
    rank = dist.get_rank()
    tmpdir = os.path.join(root, "parts") if root else None
    parts: dict[int, list[Any]] = {0: [0], 1: [FailsToLoad()], 2: [np.full(2**20, 2.0)]}
    first = caught(dist.collect_results, parts[rank], 3, tmpdir=tmpdir)
    dist.barrier()
    left = tmpdir is not None and os.path.exists(tmpdir)
    dist.barrier()  # every rank looked before the next call creates the folder again
    # nothing of the failed call is left over: the next call gets exactly its own parts
    again = dist.collect_results([f"item {rank}"], 3, tmpdir=tmpdir)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {"first": first, "left": left, "again": again, "total": total.item()}


@pytest.mark.parametrize("tmpdir", [False, True])
def test_collect_results_part_that_fails_to_unpickle_on_rank_zero(
    comm_run_distributed: Any, tmpdir: bool, tmp_path: Path
) -> None:
    root = str(tmp_path) if tmpdir else None
    results = comm_run_distributed(collect_load_failure_case, root, world_size=3)
    # every rank raises the same error, naming rank 0 and its unpickling error
    _raised_on_every_rank(results, 0, "this object cannot be rebuilt on the receiving rank")
    # rank 2's large part was drained (or its file removed), not left for the next call
    assert [r["left"] for r in results] == [False, False, False]
    assert results[0]["again"] == ["item 0", "item 1", "item 2"]
    assert results[1]["again"] is results[2]["again"] is None
    assert [r["total"] for r in results] == [3.0, 3.0, 3.0]


LARGE_PART = 20_000  # items a rank: a pickled part spans more chunks than the window


def large_item(rank: int, i: int) -> Any:
    """Item ``i`` of ``rank``'s part; every 500th holds a tensor and an array, some are None."""
    if i % 7 == 3:
        return None
    item: dict[str, Any] = {"idx": rank + i, "label": f"r{rank}-{i:05d}", "score": i / 8}
    if i % 500 == 0:
        item["t"] = torch.full((3,), float(rank * 1000 + i))
        item["a"] = np.arange(i % 11, dtype=np.int32)
    return item


def summarise_item(item: Any) -> Any:
    """A comparable form of :func:`large_item`'s items (tensors and arrays as lists)."""
    if item is None:
        return None
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in item.items()}


@contextlib.contextmanager
def _shapes_seen() -> Iterator[list[int]]:
    """Record the shape (``count``: 0 inline, > 0 one message, -1 streamed) of every part
    rank 0 starts to receive inside the block."""
    from comm_collectives import results

    seen: list[int] = []
    original = results.PartReader

    class Recording(original):  # type: ignore[misc, valid-type]
        def __init__(self, head: bytes, count: int, *args: Any) -> None:
            seen.append(count)
            super().__init__(head, count, *args)

    results.PartReader = Recording  # type: ignore[misc]
    try:
        yield seen
    finally:
        results.PartReader = original  # type: ignore[misc]


def collect_large_case() -> dict[str, Any]:
    """collect_results of parts of several chunks each, the last rank's one item short;
    then a medium part (one message, after the pickler is done) and a small one (inline)."""
    import pickle

    rank, world = dist.get_dist_info()
    part = [large_item(rank, i) for i in range(LARGE_PART)]
    if rank == world - 1:
        part = part[:-1]
    shapes = []
    with _shapes_seen() as seen:
        out = dist.collect_results(part, world * LARGE_PART - 1)
        shapes.append(list(seen))
        seen.clear()
        medium = dist.collect_results([f"{rank}:{i}" for i in range(2000)], world * 2000)
        shapes.append(list(seen))
        seen.clear()
        again = dist.collect_results([rank], world)
        shapes.append(list(seen))
    return {
        "result": None if out is None else [summarise_item(item) for item in out],
        "bytes": len(pickle.dumps(part)),
        "medium": medium,
        "again": again,
        "shapes": shapes,
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_collect_results_streams_large_parts_with_tensors(
    comm_run_distributed: Any, path: str, world: int
) -> None:
    results = run_on_path(comm_run_distributed, path, collect_large_case, world_size=world)
    n = LARGE_PART
    size = world * n - 1  # the last rank's part is one item short
    # hand-derived: item i comes from rank i % W, position i // W of its part
    expected = [large_item(i % world, i // world) for i in range(size)]
    assert results[0]["result"] == [summarise_item(item) for item in expected]
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


def collect_midstream_failure_case(bad_rank: int, bad: str, at: int = 20_000) -> dict[str, Any]:
    """Item ``at`` of ``bad_rank``'s streamed part cannot be pickled (``bad="pickle"``) or
    cannot be rebuilt on rank 0 (``bad="load"``). At 20,000 its first chunks are already
    sent; at 10,000 (in the pickler's second 64 KiB frame) the part's handshake has started
    and no chunk is sent yet. ``sent_before_failing``: the chunks a failing sender sent."""
    from comm_collectives import results as results_module

    rank, world = dist.get_dist_info()
    part: list[Any] = [f"{rank}-{i}" for i in range(30_000)]
    if rank == bad_rank:
        part[at] = Unpicklable() if bad == "pickle" else FailsToLoad()
    sent: list[int] = []
    original = results_module.PartWriter

    class Recording(original):  # type: ignore[misc, valid-type]
        def fail(self) -> None:
            sent.append(self._sent)
            super().fail()

    results_module.PartWriter = Recording  # type: ignore[misc]
    try:
        with _shapes_seen() as shapes:
            first = caught(dist.collect_results, part, world * len(part))
    finally:
        results_module.PartWriter = original  # type: ignore[misc]
    again = dist.collect_results([f"item {rank}"], world)  # nothing of the failed call is left
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {
        "first": first,
        "shapes": shapes,
        "again": again,
        "total": total.item(),
        "sent_before_failing": sent,
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
def test_collect_results_pickling_fails_in_the_middle_of_a_part(
    comm_run_distributed: Any, path: str, world: int
) -> None:
    failing = world - 1  # its item 20,000 refuses to be pickled, long after the first chunk
    results = run_on_path(
        comm_run_distributed,
        path,
        collect_midstream_failure_case,
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
        collect_midstream_failure_case, failing, "pickle", 10_000, world_size=world
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
    results = run_on_path(
        comm_run_distributed, path, collect_midstream_failure_case, 1, "load", world_size=3
    )
    _raised_on_every_rank(results, 0, "this object cannot be rebuilt on the receiving rank")
    assert results[0]["shapes"] == [-1, -1]
    for r in results:
        assert r["total"] == 3.0
    assert results[0]["again"] == ["item 0", "item 1", "item 2"]


def collect_mismatch_case(debug: bool) -> dict[str, Any]:
    """Rank 1 streams a large part into collect_results while rank 0 is in all_reduce."""
    rank = dist.get_rank()
    part = [f"{rank}-{i}" for i in range(30_000)]  # streamed: the handshake comes mid-pickle
    context = dist.debug_mode() if debug else contextlib.nullcontext()
    with context:
        if rank == 0:
            first = caught(dist.all_reduce, torch.ones(2))
        else:
            first = caught(dist.collect_results, part, 2 * len(part))
    # nothing of either call is left in the channel
    again = dist.collect_results(part, 2 * len(part))
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {
        "first": first,
        "again": None if again is None else again == [f"{i % 2}-{i // 2}" for i in range(60_000)],
        "total": total.item(),
    }


@pytest.mark.parametrize("debug", [False, True])
def test_collect_results_mismatch_while_a_part_is_streamed(
    comm_run_distributed: Any, debug: bool
) -> None:
    results = comm_run_distributed(collect_mismatch_case, debug, world_size=2)
    for r in results:
        name, message = r["first"]
        assert name == "CollectiveMismatchError"
        assert "collect_results" in message
        assert "all_reduce" in message
        assert ("helpers.py:" in message) is debug  # the call-site column of debug mode
        assert r["total"] == 1.0
    assert results[0]["again"] is True
    assert results[1]["again"] is None
