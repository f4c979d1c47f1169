"""Faults injected into every collective of comm_collectives, run on every rank of a real world.

One rank (the victim, the last rank) gets the fault; every rank records what the call
raised, how long it took to raise, and whether the next collective on the same group
still gives the right value. The tests compare that with what the protocol promises.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import comm_collectives as dist
from comm_collectives import _capacity, _compact, _faults, _modes, _route
from comm_core import CollectiveMismatchError, CommTimeoutError, RemoteRankError, process_group

# fault kinds: a bad argument, a local failure before the handshake ("local") or after it
# ("staging", on the long path), a different dtype / shape / op or root on one rank
KINDS = ("bad_arg", "local", "staging", "dtype", "shape", "op_or_root")


class InjectedError(RuntimeError):
    """The local failure the test hook raises."""


def _tensor_case(name: str) -> Callable[[int, int, str, bool], None]:
    """A call of tensor collective ``name`` with the fault ``kind`` applied when ``odd``."""

    def call(rank: int, world: int, kind: str, odd: bool) -> None:
        dtype = torch.float64 if odd and kind == "dtype" else torch.float32
        size = 4 if odd and kind == "shape" else 3
        t = torch.full((size,), float(rank + 1), dtype=dtype)
        bad = odd and kind == "bad_arg"
        other = odd and kind == "op_or_root"
        if name == "all_reduce":
            dist.all_reduce(t, op="avg" if bad else "max" if other else "sum")
        elif name == "all_gather":
            dist.all_gather(t.tolist() if bad else t)  # type: ignore[arg-type]
        elif name == "gather":
            dist.gather(t, dst=world if bad else 1 if other else 0)
        elif name == "broadcast":
            dist.broadcast(t, src=-1 if bad else 1 if other else 0)
        elif name == "all_reduce_dict":
            d: dict[str, Any] = {"a": t, "b": torch.ones(2)}
            if bad:
                d["b"] = 1.0
            dist.all_reduce_dict(d, op="max" if other else "sum")
        elif name == "all_reduce_params":
            params = [] if bad else [t, torch.ones(2)]  # one rank's list is empty
            dist.all_reduce_params(params, op="max" if other else "sum")
        elif name == "broadcast_object_list":
            box: Any = {"x": 1} if bad else [{"rank": rank, "t": t}]
            dist.broadcast_object_list(box, src=1 if other else 0)
        elif name == "all_gather_object":
            obj = (lambda: 0) if bad else {"rank": rank, "t": t}  # a lambda cannot be pickled
            if other:  # another collective on one rank
                dist.gather_object(obj)
            else:
                dist.all_gather_object(obj)
        elif name == "gather_object":
            dist.gather_object({"rank": rank, "t": t}, dst=world if bad else 1 if other else 0)
        elif name == "sync_random_seed":
            if other:
                dist.broadcast_object_list([0])
            else:
                dist.sync_random_seed()
        else:  # pragma: no cover - a name missing above
            raise AssertionError(name)

    return call


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "gather",
    "broadcast",
    "all_reduce_dict",
    "all_reduce_params",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "sync_random_seed",
)
# (collective, kind) pairs with no such fault: the argument or field does not exist
NOT_APPLICABLE = {
    ("all_gather", "shape"),  # shapes may differ
    ("gather", "shape"),
    ("broadcast_object_list", "dtype"),
    ("broadcast_object_list", "shape"),
    ("all_gather_object", "dtype"),
    ("all_gather_object", "shape"),
    ("gather_object", "dtype"),
    ("gather_object", "shape"),
    ("sync_random_seed", "bad_arg"),  # no argument but the group
    ("sync_random_seed", "dtype"),
    ("sync_random_seed", "shape"),
    ("sync_random_seed", "staging"),  # no local work after the handshake
    ("all_gather", "op_or_root"),  # no op, no root (all_gather_object: another collective)
}
MISMATCH_KINDS = ("dtype", "shape", "op_or_root")


@contextlib.contextmanager
def _hook(stage: str, active: bool) -> Iterator[None]:
    def fail(at: str, operation: str) -> None:
        if at == stage:
            message = f"injected failure at {at} of {operation}"
            raise InjectedError(message)

    _modes.fault_hook = fail if active else None
    try:
        yield
    finally:
        _modes.fault_hook = None


def _expected(name: str, kind: str) -> str:
    if kind in MISMATCH_KINDS:
        return "CollectiveMismatchError"
    if name == "all_reduce_params" and kind == "bad_arg":  # an empty list: another layout
        return "CollectiveMismatchError"
    return "RemoteRankError"


def _follow_up(rank: int, world: int) -> bool:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t) == world * (world + 1) / 2


def fault_matrix(compact: bool = False) -> dict[str, Any]:
    """Every (collective, kind) cell: what this rank raised, in how many seconds, and
    whether the next all_reduce worked (``compact``: the exchange of large worlds)."""
    saved = _compact.COMPACT_ABOVE
    _compact.COMPACT_ABOVE = 1 if compact else saved
    try:
        return _fault_matrix()
    finally:
        _compact.COMPACT_ABOVE = saved


def _fault_matrix() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    victim = world - 1
    out: dict[str, Any] = {}
    for name in COLLECTIVES:
        call = _tensor_case(name)
        for kind in KINDS:
            if (name, kind) in NOT_APPLICABLE:
                continue
            odd = rank == victim
            stage = kind if kind in ("local", "staging") else ""
            long_path = kind == "staging"
            raised, ranks = "", None
            start = time.monotonic()
            with _hook(stage, odd and bool(stage)):
                limit = _capacity.inline_limit(0) if long_path else contextlib.nullcontext()
                with limit:
                    try:
                        call(rank, world, kind, odd)
                    except RemoteRankError as exc:
                        raised, ranks = type(exc).__name__, list(exc.ranks)
                    except CollectiveMismatchError as exc:
                        raised = type(exc).__name__
                    except Exception as exc:
                        raised = f"unexpected {type(exc).__name__}: {exc}"
            elapsed = time.monotonic() - start
            out[f"{name}/{kind}"] = {
                "raised": raised,
                "expected": _expected(name, kind),
                "ranks": ranks,
                "seconds": round(elapsed, 3),
                "next_ok": _follow_up(rank, world),
            }
    return out


def killed_rank(name: str, stage: str, folder: str) -> str:
    """The victim kills itself inside ``name`` (at ``stage``); the others record their error
    in ``folder``, since the world ends with the victim."""
    rank, world = dist.get_rank(), dist.get_world_size()
    victim = world - 1
    # The survivors' wait for the others' liveness marks: short where the only survivor is
    # rank 0; the library's 3 s in a world of 3, where a survivor slowed by a loaded machine
    # must not be taken for a lost one.
    _faults._LIVENESS_WAIT_S = 1.0 if world == 2 else 3.0

    def die(at: str, operation: str) -> None:
        if at == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    _modes.fault_hook = die if rank == victim else None
    record: dict[str, Any] = {"raised": "", "ranks": None, "lost": False}
    start = time.monotonic()
    limit = _capacity.inline_limit(0) if stage == "staging" else contextlib.nullcontext()
    try:
        with limit:
            _tensor_case(name)(rank, world, "", False)
    except RemoteRankError as exc:
        record.update(
            raised=type(exc).__name__,
            ranks=list(exc.ranks),
            lost=all(f.error_type == "comm.RankLost" for f in exc.failures),
        )
    except CommTimeoutError as exc:  # a survivor that exchanges nothing with the victim
        record.update(
            raised=type(exc).__name__, ranks=[victim], lost=f"Rank(s) {victim} " in str(exc)
        )
    except Exception as exc:
        record["raised"] = f"unexpected {type(exc).__name__}: {exc}"
    finally:
        _modes.fault_hook = None
    record["seconds"] = round(time.monotonic() - start, 3)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    return "survived"


def debug_on_some_ranks() -> dict[str, Any]:
    """COMM_DEBUG set on the last rank only: every collective still works everywhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    previous = os.environ.get("COMM_DEBUG")
    if rank == world - 1:
        os.environ["COMM_DEBUG"] = "1"
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        gathered = dist.all_gather_object(rank)
        box = [rank]
        dist.broadcast_object_list(box, src=0)
        mismatch = ""
        try:
            dist.all_reduce(torch.ones(rank + 1))
        except CollectiveMismatchError as exc:
            mismatch = str(exc)
    finally:
        if previous is None:
            os.environ.pop("COMM_DEBUG", None)
        else:
            os.environ["COMM_DEBUG"] = previous
    return {"sum": float(t), "gathered": gathered, "box": box, "mismatch": mismatch}


def side_channel_matrix() -> dict[str, Any]:
    """The fault matrix with the headers on a CPU side group, as under nccl."""
    saved = _route.side_channel, process_group._CPU_BACKENDS
    # the nccl layout on gloo: headers on the CPU route, and gloo counted as a backend
    # without CPU support, so the route is comm-core's CPU twin of the default group
    _route.side_channel, process_group._CPU_BACKENDS = True, ()
    try:
        out = _fault_matrix()
        group = torch.distributed.distributed_c10d._get_default_group()
        side = _route.header_route(group)[0]
        out["side group"] = side is not group and side is not None
        return out
    finally:
        _route.side_channel, process_group._CPU_BACKENDS = saved
