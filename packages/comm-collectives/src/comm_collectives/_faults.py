"""A peer lost in the middle of a call: the backend's transport error made the library's.

A killed process or a lost node makes the backend raise a bare RuntimeError on the ranks
that talk to it. [`transport`][comm_collectives._faults.transport] turns it into a
[`RemoteRankError`][comm_core.RemoteRankError] naming the ranks that did not answer a
liveness check through the rendezvous store within a few seconds, or into a
[`CommTimeoutError`][comm_core.CommTimeoutError] when the backend timed out.

A rank that meets such an error also leaves a failure notice for the group in the store
(``comm/failed/<group>/<n>``, the n-th failure this group has seen), so that the ranks
blocked on it, which the backend tells nothing (they wait on a live peer), leave too:
``_watch`` looks for the notice while it waits
([`failure_notice`][comm_collectives._faults.failure_notice]), and a rank that finds one
joins the same liveness check ([`join_failure`][comm_collectives._faults.join_failure]).
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

__all__ = [
    "PeerLeftError",
    "failure_notice",
    "join_failure",
    "peer_transport",
    "silent_ranks",
    "transport",
]

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
    notice = text if isinstance(exc, PeerLeftError) else f"rank {me} left the call: {text}"
    lost = silent_ranks(group, notice=notice)
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


# per group name: how many transport failures this rank has handled on the group (every
# rank that leaves a call through ``_transport_error`` counts the failure once)
_transport_failures: dict[str, int] = {}


def _group_name(group: torch_dist.ProcessGroup | None) -> str:
    pg = group if group is not None else torch_dist.distributed_c10d._get_default_group()
    return str(getattr(pg, "group_name", "default"))


def _notice_key(name: str, failure: int) -> str:
    return f"comm/failed/{name}/{failure}"


def silent_ranks(
    group: torch_dist.ProcessGroup | None, *, notice: str | None = None
) -> list[int] | None:
    """The ranks of ``group`` that do not show up in the store within a few seconds
    (None when the store cannot be reached).

    With ``notice`` (the failure this rank met), the failure notice of the group is posted
    first, unless another rank posted it already: the ranks blocked in a watched wait see it
    and join this check (see ``_watch``).
    """
    name = _group_name(group)
    world, me = get_world_size(group), get_rank(group)
    # numbered: marks left by an earlier failure on this group (that every rank saw)
    # must not pass for marks of this one
    seen = _transport_failures[name] = _transport_failures.get(name, 0) + 1
    keys = [f"comm/alive/{name}/{seen}/{rank}" for rank in range(world)]
    try:
        store = default_store()
        if notice is not None:  # set once: the first rank's words stay
            store.compare_set(_notice_key(name, seen), "", notice)
        return post_and_wait(store, keys, me, b"1", _LIVENESS_WAIT_S)
    except Exception:
        return None


class PeerLeftError(RuntimeError):
    """Another rank of the group left the call after a transport error (its notice)."""


def failure_notice(group: torch_dist.ProcessGroup | None) -> str | None:
    """The failure notice another rank posted for ``group`` that this rank has not handled
    yet (what that rank met), or None: none, or the store does not answer (the wait then
    goes on, bounded by the backend's timeout)."""
    name = _group_name(group)
    key = _notice_key(name, _transport_failures.get(name, 0) + 1)
    try:
        store = default_store()
        if not store.check([key]):
            return None
        return bytes(store.get(key)).decode("utf-8", "replace")
    except Exception:
        return None


def join_failure(operation: str, notice: str, group: torch_dist.ProcessGroup | None) -> CommError:
    """The error of a rank that found another rank's failure ``notice`` while it waited.

    It takes part in the same liveness check as the rank that posted the notice, so it is
    counted alive there, and it names the same lost ranks: the ones that never mark
    themselves alive.
    """
    return _transport_error(operation, PeerLeftError(notice), group)


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
