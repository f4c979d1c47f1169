"""A peer lost in the middle of a call: the backend's transport error made the library's.

A killed process or a lost node makes the backend raise a bare RuntimeError on the ranks
that talk to it. [`transport`][comm_collectives._faults.transport] turns it into a
[`RemoteRankError`][comm_core.RemoteRankError] naming the ranks that did not answer a
liveness check through the rendezvous store within a few seconds, or into a
[`CommTimeoutError`][comm_core.CommTimeoutError] when the backend timed out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as torch_dist

from comm_core import (
    CommError,
    CommTimeoutError,
    RankFailure,
    RemoteRankError,
    get_rank,
    get_world_size,
)

from ._store import default_store, post_and_wait

__all__ = ["peer_transport", "silent_ranks", "transport"]

# How long a rank that saw a transport error waits for the others to report alive.
_LIVENESS_WAIT_S = 3.0


@contextlib.contextmanager
def transport(operation: str, group: torch_dist.ProcessGroup | None) -> Iterator[None]:
    """Turn a transport error of the backend inside the block into the library's error.

    A peer that died (a killed process, a lost node) makes the backend raise a bare
    RuntimeError on the ranks that talk to it. This raises instead a
    [`RemoteRankError`][comm_core.RemoteRankError] naming the ranks that did not answer a
    liveness check through the rendezvous store within a few seconds, or a
    [`CommTimeoutError`][comm_core.CommTimeoutError] when the backend timed out.
    """
    try:
        yield
    except CommError:
        raise
    except RuntimeError as exc:
        raise _transport_error(operation, exc, group) from exc


def _transport_error(
    operation: str, exc: RuntimeError, group: torch_dist.ProcessGroup | None
) -> CommError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    me = get_rank(group)
    lost = silent_ranks(group)
    if "timed out" in text.lower() or "timeout" in text.lower():
        silent = (
            f" Rank(s) {', '.join(map(str, lost))} did not report alive within "
            f"{_LIVENESS_WAIT_S:g} s (dead, or stuck elsewhere)."
            if lost
            else ""
        )
        message = (
            f"{operation} timed out on rank {me} of the group (world size "
            f"{get_world_size(group)}): {text}.{silent} Some rank did not reach this call or "
            "died in it; run with COMM_DEBUG=1 to see each rank's call site, or raise "
            "init_dist's timeout for slow steps."
        )
        return CommTimeoutError(message)
    if lost is None:
        cause = (
            "the rendezvous store does not answer either, so the rank that hosts it (rank 0 "
            "under init_dist's own store, or the launcher's agent) is probably gone"
        )
        failures = [RankFailure(me, "comm.TransportError", f"{text} ({cause})")]
    elif lost:
        failures = [
            RankFailure(
                rank,
                "comm.RankLost",
                f"the rank stopped answering in the middle of the call (seen from rank {me}: "
                f"{text}); its process probably died: check its log",
            )
            for rank in lost
        ]
    else:
        failures = [RankFailure(me, "comm.TransportError", text)]
    return RemoteRankError(operation, failures)


_transport_failures: dict[str, int] = {}


def silent_ranks(group: torch_dist.ProcessGroup | None) -> list[int] | None:
    """The ranks of ``group`` that do not show up in the store within a few seconds
    (None when the store cannot be reached)."""
    pg = group if group is not None else torch_dist.distributed_c10d._get_default_group()
    name = str(getattr(pg, "group_name", "default"))
    world, me = get_world_size(group), get_rank(group)
    # numbered: marks left by an earlier failure on this group (that every rank saw)
    # must not pass for marks of this one
    seen = _transport_failures[name] = _transport_failures.get(name, 0) + 1
    keys = [f"comm/alive/{name}/{seen}/{rank}" for rank in range(world)]
    try:
        return post_and_wait(default_store(), keys, me, b"1", _LIVENESS_WAIT_S)
    except Exception:
        return None


@contextlib.contextmanager
def peer_transport(
    operation: str, group: torch_dist.ProcessGroup | None, peers: list[int]
) -> Iterator[None]:
    """``transport`` for a point-to-point call: a transport error names the peer.

    Only two ranks take part, so the others are not asked whether they are alive: a
    closed connection makes a [`RemoteRankError`][comm_core.RemoteRankError] naming the
    peer, a backend timeout a [`CommTimeoutError`][comm_core.CommTimeoutError] naming it.
    """
    try:
        yield
    except CommError:
        raise
    except RuntimeError as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        me = get_rank(group)
        named = ", ".join(map(str, peers))
        if "timed out" in text.lower() or "timeout" in text.lower():
            message = (
                f"{operation} timed out on rank {me}: {text}. Rank(s) {named} (the peer) not "
                "heard from: it did not make the matching call, or died. Check its log."
            )
            raise CommTimeoutError(message) from exc
        failures = [
            RankFailure(
                peer,
                "comm.RankLost",
                f"the peer stopped answering in the middle of {operation} (seen from rank "
                f"{me}: {text}); its process probably died: check its log",
            )
            for peer in peers
        ]
        raise RemoteRankError(operation, failures) from exc
