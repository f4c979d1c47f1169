"""Fault injection: one rank fails, every rank raises the library's error within 10 s.

For every public collective of comm_collectives (collect_results has its own file), one
rank gets a bad argument, a local failure before or after the handshake, a different
dtype, shape, op or root, or is killed with SIGKILL in the middle of the call. Every live
rank must raise RemoteRankError (naming that rank) or CollectiveMismatchError, within 10
seconds, and the next collective on the same group must work (except after a kill: the
group has lost a member).

The rank bodies below run on every rank of a real world: one rank (the victim, the last
rank) gets the fault; every rank records what the call raised, how long it took to raise,
and whether the next collective on the same group still gives the right value. The tests
compare that with what the protocol promises.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_collectives import _capacity, _compact, _faults, _modes, _route
from comm_core import CollectiveMismatchError, CommTimeoutError, RemoteRankError, process_group
from comm_core.testing import RanksFailedError, WorldPool

BOUND_S = 10.0


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, WorldPool]]:
    made: dict[int, WorldPool] = {}
    yield made
    for pool in made.values():
        pool.close()


# The process group's own timeout: a survivor that exchanges nothing with a killed rank in
# the call's algorithm (gloo's small all-reduce talks to one neighbour) only learns of the
# loss when it times out; it then names the silent rank too.
PG_TIMEOUT_S = 5.0


def _pool(pools: dict[int, WorldPool], world: int) -> WorldPool:
    if world not in pools:
        pools[world] = WorldPool(world, timeout=120.0, pg_timeout=PG_TIMEOUT_S)
    return pools[world]


# "plain": headers and data on one group; "compact": the exchange of worlds over 64 ranks;
# "side": headers on a CPU side group, data on the group itself (the nccl layout)
MODES = [(2, "plain"), (3, "plain"), (3, "compact"), (3, "side")]

# fault kinds: a bad argument, a local failure before the handshake ("local") or after it
# ("staging", on the long path), a different dtype / shape / op or root on one rank
KINDS = ("bad_arg", "local", "staging", "dtype", "shape", "op_or_root")

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
    "reduce",
    "scatter",
    "scatter_object_list",
    "all_gather_into",  # torch's all_gather(tensor_list, tensor)
    "gather_into",  # torch's gather(tensor, gather_list, dst)
    "barrier",
    "all_reduce_async",
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
    ("scatter_object_list", "dtype"),
    ("scatter_object_list", "shape"),
    ("all_gather_into", "op_or_root"),
    ("barrier", "bad_arg"),  # no argument but the group
    ("barrier", "staging"),  # no local work after the headers
    ("barrier", "dtype"),
    ("barrier", "shape"),
}


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
        elif name == "reduce":
            dist.reduce(t, dst=1 if other else 0, op="avg" if bad else "sum")
        elif name == "scatter":
            src = rank if other else 0  # one rank names itself as the source
            chunks = [torch.full((3,), float(k)) for k in range(world)] if rank == src else None
            if bad:  # a list on a rank that is not the source
                chunks = [t] * world
            dist.scatter(t, chunks, src=src)
        elif name == "scatter_object_list":
            box: Any = [] if bad else [None]  # an empty output list
            src = rank if other else 0
            parts = [{"to": k, "t": t} for k in range(world)] if rank == src else None
            dist.scatter_object_list(box, parts, src=src)
        elif name == "all_gather_into":
            outs = [torch.zeros(3, dtype=dtype) for _ in range(world - 1 if bad else world)]
            dist.all_gather(outs, t)
        elif name == "gather_into":
            dst = world if bad else rank if other else 0
            outs = [torch.zeros(3, dtype=dtype) for _ in range(world)] if rank == dst else None
            dist.gather(t, outs, dst)
        elif name == "barrier":
            if other:
                dist.all_reduce(t)
            else:
                dist.barrier()
        elif name == "all_reduce_async":
            work = dist.all_reduce(t, op="avg" if bad else "max" if other else "sum", async_op=True)
            assert work is not None
            work.wait(timeout=BOUND_S)
        elif name == "sync_random_seed":
            if other:
                dist.broadcast_object_list([0])
            else:
                dist.sync_random_seed()
        else:  # pragma: no cover - a name missing above
            raise AssertionError(name)

    return call


class InjectedError(RuntimeError):
    """The local failure the test hook raises."""


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


MISMATCH_KINDS = ("dtype", "shape", "op_or_root")


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


def fault_matrix(compact: bool = False) -> dict[str, Any]:
    """Every (collective, kind) cell: what this rank raised, in how many seconds, and
    whether the next all_reduce worked (``compact``: the exchange of large worlds)."""
    saved = _compact.COMPACT_ABOVE
    _compact.COMPACT_ABOVE = 1 if compact else saved
    try:
        return _fault_matrix()
    finally:
        _compact.COMPACT_ABOVE = saved


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


@pytest.mark.parametrize(("world", "mode"), MODES)
def test_every_fault_raises_on_every_rank_in_time(
    pools: dict[int, WorldPool], world: int, mode: str
) -> None:
    pool = _pool(pools, world)
    if mode == "side":
        results = pool.run(side_channel_matrix)
        for r in results:
            assert r.pop("side group") is True
    else:
        results = pool.run(fault_matrix, mode == "compact")
    victim = world - 1
    cells = results[0].keys()
    expected_cells = {
        f"{name}/{kind}"
        for name in COLLECTIVES
        for kind in KINDS
        if (name, kind) not in NOT_APPLICABLE
    }
    assert set(cells) == expected_cells
    for cell in cells:
        for rank, r in enumerate(results):
            got = r[cell]
            where = f"{cell} on rank {rank}: {got}"
            assert got["raised"] == got["expected"], where
            if got["raised"] == "RemoteRankError":
                assert got["ranks"] == [victim], where
            assert got["seconds"] < BOUND_S, where
            assert got["next_ok"], where


# (collective, stage, world): the victim dies before the handshake ("local"; in a world of
# 3 for three of them: the handshake's all-gather reaches every survivor) or after it,
# before the data moves ("staging", long path). After the handshake gloo's small all-reduce (the vote) may route
# a survivor's data through another survivor only; that survivor learns of the loss at the
# process group's timeout (docs/collectives.md), so those kills run in a world of 2.
KILLS = [
    (name, "local", 3 if name in ("all_reduce", "all_gather_object", "broadcast") else 2)
    for name in COLLECTIVES
    # the paths of these are killed above already (the same handshake, vote and transfer)
    if name not in ("all_gather_into", "gather_into", "all_reduce_async", "barrier")
    and name != "scatter_object_list"
] + [
    ("all_reduce", "staging", 2),
    ("all_gather_object", "staging", 2),
    ("broadcast_object_list", "staging", 2),
    ("all_reduce_async", "staging", 2),
]


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


@pytest.mark.parametrize(("name", "stage", "world"), KILLS)
def test_a_killed_rank_is_named_by_every_survivor(
    pools: dict[int, WorldPool], tmp_path: Path, name: str, stage: str, world: int
) -> None:
    pool = _pool(pools, world)
    victim = world - 1
    with pytest.raises(RanksFailedError) as info:
        pool.run(killed_rank, name, stage, str(tmp_path), timeout=60.0)
    states = {r.rank: r.state for r in info.value.reports}
    assert states == {**dict.fromkeys(range(victim), "ok"), victim: "died"}, str(info.value)
    for rank in range(victim):
        record: dict[str, Any] = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["raised"] in ("RemoteRankError", "CommTimeoutError"), record
        assert record["ranks"] == [victim], record
        assert record["lost"], record
        assert record["seconds"] < BOUND_S, record
    assert not os.path.exists(tmp_path / f"rank{victim}.json")


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


def test_debug_mode_on_some_ranks_only(pools: dict[int, WorldPool]) -> None:
    results = _pool(pools, 2).run(debug_on_some_ranks)
    for r in results:
        assert r["sum"] == 3.0
        assert r["gathered"] == [0, 1]
        assert r["box"] == [0]
        # the rank that asked for debug mode makes every rank show the call sites
        assert "call site" in r["mismatch"]
        assert "py" in r["mismatch"]
