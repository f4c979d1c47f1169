"""Module-level functions the collectives tests run on every rank of a real gloo world.

Inputs depend on the rank; the tests compare the returned values with results derived by
hand from those inputs.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

import comm_collectives as dist
from comm_core import CollectiveMismatchError, RemoteRankError
from tests.helpers import caught

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
    group = torch.distributed.new_group([0, 1])
    if rank in (0, 1):
        g = torch.tensor([10.0 * (rank + 1)])
        dist.all_reduce(g, group=group)
        out["group"] = g.item()
    torch.distributed.destroy_process_group(group)
    return out


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


def gather_to(dst: int) -> dict[str, Any]:
    rank = dist.get_rank()
    parts = dist.gather(torch.arange(rank + 1, dtype=torch.float64) + 10 * rank, dst=dst)
    return {"parts": [p.tolist() for p in parts], "devices": sorted({str(p.device) for p in parts})}


def broadcast_cases() -> dict[str, Any]:
    rank = dist.get_rank()
    world = dist.get_world_size()
    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=world - 1)
    shape = caught(dist.broadcast, torch.zeros(rank + 1), src=0)
    bad_src = caught(dist.broadcast, torch.zeros(1), src=world)
    return {"value": t.tolist(), "shape_mismatch": shape, "bad_src": bad_src}


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


class Unpicklable:
    def __reduce__(self) -> Any:
        message = "this object refuses to be pickled"
        raise RuntimeError(message)


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


def collect_not_sampler_shaped() -> list[Any] | None:
    """Parts whose lengths a sampler would not give: rank r holds r + 1 items."""
    rank = dist.get_rank()
    return dist.collect_results([f"{rank}.{i}" for i in range(rank + 1)], 100)


def collect_error_case() -> tuple[str, str]:
    rank = dist.get_rank()
    results: list[Any] = [Unpicklable()] if rank == 1 else [rank]
    return caught(dist.collect_results, results, 4)


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


def mismatch_rows() -> list[dict[str, object]]:
    rank = dist.get_rank()
    try:
        dist.all_reduce(torch.ones(rank + 1))
    except CollectiveMismatchError as exc:
        return list(exc.rows)
    return []


def without_inline(case: str, *args: Any) -> Any:
    """Run ``case`` with inline data switched off: every collective takes its long path."""
    from comm_collectives._capacity import inline_limit

    with inline_limit(0):
        return globals()[case](*args)


def reduce_dict_equal_keys_of_other_types() -> dict[str, Any]:
    """Keys equal as Python values but of other types (True == 1 == 1.0): the layout's
    signature is derived from the keys' repr, so what a rank remembers from an earlier call
    must not stand for a later call's keys."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    # a first call where rank 0 keys by True and rank 1 by 1 (a mismatch: the signatures
    # differ) leaves each rank remembering the signature of its own keys
    first = {True if rank == 0 else 1: torch.tensor([1.0])}
    out["first"] = caught(dist.all_reduce_dict, first)[0]
    # then both ranks reduce the same dict keyed by 1
    result = {1: torch.tensor([rank + 1.0])}
    out["int_key"] = caught(dist.all_reduce_dict, result)
    out["int_value"] = {repr(k): v.tolist() for k, v in result.items()}
    return out
