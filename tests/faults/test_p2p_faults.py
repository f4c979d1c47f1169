"""Fault injection for point-to-point calls and work handles.

The last rank (the victim) sends to rank 0 with a fault: a bad argument, a local failure, a
tensor of another shape or dtype than rank 0 posted, a list of another length; or it dies
in the call. Rank 0 must raise the library's error within 10 s, naming the victim, and the
next message on the same pair must arrive intact. A ``wait(timeout)`` that expires raises
CommTimeoutError naming the peer, and the handle still completes afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_collectives import _modes
from comm_core import CollectiveMismatchError, CommTimeoutError, RemoteRankError
from comm_core.testing import RanksFailedError, WorldPool

BOUND_S = 10.0
PG_TIMEOUT_S = 5.0

# fault -> what the receiver (rank 0) raises; the sender raises only for its own failures
FAULTS = {
    "bad_arg": "RemoteRankError",
    "local": "RemoteRankError",
    "shape": "CollectiveMismatchError",
    "dtype": "CollectiveMismatchError",
    "count": "CollectiveMismatchError",
    "call": "CollectiveMismatchError",
}


@pytest.fixture(scope="module")
def pool() -> Iterator[WorldPool]:
    with WorldPool(2, timeout=120.0, pg_timeout=PG_TIMEOUT_S) as made:
        yield made


def _fail_local(stage: str, operation: str) -> None:
    if stage == "local":
        message = f"injected failure at {stage} of {operation}"
        raise RuntimeError(message)


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, list[int] | None]:
    try:
        fn(*args, **kwargs)
    except RemoteRankError as exc:
        return type(exc).__name__, list(exc.ranks)
    except CollectiveMismatchError as exc:
        return type(exc).__name__, None
    except Exception as exc:
        return f"unexpected {type(exc).__name__}: {exc}", None
    return "", None


def p2p_fault_matrix() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for fault in FAULTS:
        start = time.monotonic()
        if rank == 1:  # the victim sends
            if fault == "local":
                _modes.fault_hook = _fail_local
            try:
                if fault == "bad_arg":
                    raised = _outcome(dist.send, [1.0, 2.0], 0)
                elif fault == "shape":
                    raised = _outcome(dist.send, torch.ones(4), 0)
                elif fault == "dtype":
                    raised = _outcome(dist.send, torch.ones(3, dtype=torch.float64), 0)
                elif fault in ("count", "call"):
                    raised = _outcome(dist.send_object_list, [1, 2], 0)
                else:
                    raised = _outcome(dist.send, torch.ones(3), 0)
            finally:
                _modes.fault_hook = None
            dist.send(torch.full((2,), 7.0), 0)  # the follow-up message
            next_ok = True
        else:
            if fault == "count":
                raised = _outcome(dist.recv_object_list, [None], 1)
            else:
                raised = _outcome(dist.recv, torch.zeros(3), 1)
            after = torch.zeros(2)
            dist.recv(after, 1)
            next_ok = after.tolist() == [7.0, 7.0]
        out[fault] = {
            "raised": raised[0],
            "ranks": raised[1],
            "seconds": round(time.monotonic() - start, 3),
            "next_ok": next_ok,
        }
    return out


def test_every_point_to_point_fault_raises_on_the_receiver(pool: WorldPool) -> None:
    receiver, sender = pool.run(p2p_fault_matrix)
    for fault, expected in FAULTS.items():
        got = receiver[fault]
        assert got["raised"] == expected, (fault, got)
        if expected == "RemoteRankError":
            assert got["ranks"] == [1], (fault, got)
            # the sender raises its own failure too
            assert sender[fault]["raised"] == "RemoteRankError", (fault, sender[fault])
        else:  # the sender cannot know: its message was drained
            assert sender[fault]["raised"] == "", (fault, sender[fault])
        assert got["seconds"] < BOUND_S, (fault, got)
        assert got["next_ok"], (fault, got)


def wait_timeout_case() -> dict[str, Any]:
    """Rank 0 waits with a timeout for a message rank 1 sends 2 s later."""
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(2.0)
        dist.send(torch.full((3,), 4.0), 0)
        return {}
    box = torch.zeros(3)
    work = dist.irecv(box, 1)
    start = time.monotonic()
    try:
        work.wait(timeout=0.5)
        first = ("", "")
    except CommTimeoutError as exc:
        first = (type(exc).__name__, str(exc))
    waited = time.monotonic() - start
    completed_early = work.is_completed()
    work.wait(timeout=30.0)
    return {
        "first": first,
        "waited": waited,
        "completed_early": completed_early,
        "value": box.tolist(),
        "source": work.source_rank(),
    }


def test_an_expired_wait_names_the_peer_and_the_handle_completes_later(pool: WorldPool) -> None:
    r = pool.run(wait_timeout_case)[0]
    name, message = r["first"]
    assert name == "CommTimeoutError"
    assert "Rank(s) 1 (the peer) not heard from" in message
    assert "timeout 0.5 s" in message
    assert 0.4 < r["waited"] < 1.9
    assert r["completed_early"] is False
    assert r["value"] == [4.0, 4.0, 4.0]
    assert r["source"] == 1


def killed_sender(folder: str) -> str:
    """The victim kills itself inside send; rank 0, in recv, records its error."""
    rank = dist.get_rank()

    def die(stage: str, operation: str) -> None:
        if stage == "local" and operation == "send":
            os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1:
        time.sleep(0.3)  # rank 0 is in recv by now
        _modes.fault_hook = die
        dist.send(torch.ones(3), 0)
    record: dict[str, Any] = {"raised": "", "ranks": None}
    start = time.monotonic()
    try:
        dist.recv(torch.zeros(3), 1)
    except RemoteRankError as exc:
        record.update(raised=type(exc).__name__, ranks=list(exc.ranks))
    except CommTimeoutError as exc:
        record.update(raised=type(exc).__name__, ranks=[1] if "Rank(s) 1" in str(exc) else None)
    except Exception as exc:
        record["raised"] = f"unexpected {type(exc).__name__}: {exc}"
    record["seconds"] = round(time.monotonic() - start, 3)
    Path(folder, "rank0.json").write_text(json.dumps(record))
    return "survived"


def test_a_sender_killed_in_send_is_named_by_the_receiver(pool: WorldPool, tmp_path: Path) -> None:
    with pytest.raises(RanksFailedError) as info:
        pool.run(killed_sender, str(tmp_path), timeout=60.0)
    states = {r.rank: r.state for r in info.value.reports}
    assert states == {0: "ok", 1: "died"}, str(info.value)
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["raised"] in ("RemoteRankError", "CommTimeoutError"), record
    assert record["ranks"] == [1], record
    assert record["seconds"] < BOUND_S, record


def collective_wait_timeout_case() -> dict[str, Any]:
    """Rank 0 waits with a timeout on an async barrier that rank 1 joins 1.5 s later."""
    from comm_collectives import _faults

    rank = dist.get_rank()
    if rank == 1:
        time.sleep(1.5)
        dist.barrier()
        return {}
    saved = _faults._LIVENESS_WAIT_S
    _faults._LIVENESS_WAIT_S = 0.5  # how long rank 1 gets to report alive
    try:
        work = dist.barrier(async_op=True)
        assert work is not None
        try:
            work.wait(timeout=0.3)
            first = ("", "")
        except CommTimeoutError as exc:
            first = (type(exc).__name__, str(exc))
        completed_early = work.is_completed()
        return {"first": first, "early": completed_early, "later": work.wait(timeout=30.0)}
    finally:
        _faults._LIVENESS_WAIT_S = saved


def test_an_expired_wait_on_a_collective_names_the_silent_rank(pool: WorldPool) -> None:
    r = pool.run(collective_wait_timeout_case)[0]
    name, message = r["first"]
    assert name == "CommTimeoutError", message
    assert "barrier (async) on rank 0 of 2: wait timed out" in message
    assert "Rank(s) 1 did not report alive" in message
    assert r["early"] is False
    assert r["later"] is True
