"""A bounded exchange of small strings through the default group's key-value store.

No tensor moves and no device is synchronised, so it works the same under gloo and nccl,
before any collective and after a peer died: each rank posts a key and waits, with a
deadline, for the keys of the others. The liveness check after a transport error and the
public [`rendezvous`][comm_collectives.rendezvous] share it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as torch_dist

from comm_core import CommTimeoutError, get_rank, get_world_size, is_distributed

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["check_timeout", "default_store", "post_and_wait", "rendezvous"]

_SOON_S = 0.05  # how long the keys are checked before the store's own wait
_POLL_S = 0.0002
# the longest interval between two checks of a polling wait: in its first second (the
# others usually end soon: a published save is seen soon after), then later on
_POLL_FIRST_S, _POLL_LATER_S = 0.01, 0.05
_LONGEST_S = 1e9  # a longer wait overflows the store's milliseconds: about 31 years is enough
_ENCODING = "utf-8"


def default_store() -> Store:
    """The key-value store of the default process group."""
    return torch_dist.distributed_c10d._get_default_store()


def post_and_wait(
    store: Store,
    keys: Sequence[str],
    mine: int,
    value: bytes,
    timeout: float,
    *,
    poll: bool = False,
) -> list[int]:
    """Post ``value`` under ``keys[mine]``, wait up to ``timeout`` seconds for the others.

    The ranks usually arrive together and a store's own wait can be coarse (torch's
    FileStore rounds its deadline up to the next whole second), so the keys are first
    checked every 0.2 ms for a few milliseconds; the store's bounded wait follows only when
    a rank is late. With ``poll`` the keys are checked instead, at growing intervals up to
    10 ms in the first second and 50 ms after it: the store's wait holds the process's
    store client for as long as it lasts, which another thread of the process (one running
    collectives) must not be kept from.

    Returns:
        The indices of the keys still missing at the deadline; empty when all arrived.

    Raises:
        Exception: Whatever the store raises when it cannot be reached.
    """
    start = time.monotonic()
    store.set(keys[mine], value)  # type: ignore[arg-type]  # the stub says str; bytes work
    soon = start + min(_SOON_S, timeout)
    while not store.check(list(keys)):
        if time.monotonic() > soon:
            break
        time.sleep(_POLL_S)
    else:
        return []
    if poll:
        return _poll(store, keys, start + timeout)
    # at least 10 ms: a wait of 0 ms is the store's own default timeout, not "no wait"
    remaining = min(_LONGEST_S, max(0.01, start + timeout - time.monotonic()))
    try:
        store.wait(list(keys), timedelta(seconds=remaining))
    except Exception:  # the store's timeout: a RuntimeError or DistStoreError, say which keys
        return [index for index, key in enumerate(keys) if not store.check([key])]
    return []


def _poll(store: Store, keys: Sequence[str], deadline: float) -> list[int]:
    """Check ``keys`` until all are there or ``deadline``; return the indices missing."""
    delay, later = 0.001, time.monotonic() + 1.0
    while not store.check(list(keys)):
        if time.monotonic() > deadline:
            return [index for index, key in enumerate(keys) if not store.check([key])]
        time.sleep(delay)
        delay = min(delay * 2, _POLL_FIRST_S if time.monotonic() < later else _POLL_LATER_S)
    return []


def rendezvous(
    key: str,
    value: str,
    *,
    timeout: float,
    group: torch_dist.ProcessGroup | None = None,
    withdraw_on_timeout: bool = False,
    poll: bool = False,
) -> list[str]:
    """Exchange one small string between the ranks of ``group``, within ``timeout`` seconds.

    Each rank posts ``value`` under ``f"{key}/{rank}"`` (its rank in ``group``) in the
    default group's key-value store and waits for the keys of the other ranks of
    ``group``. No tensor moves and no device is synchronised, so it works under gloo and
    nccl, and it is the step to start a collective operation with when a rank that calls
    it alone must get an error instead of waiting forever. Strings that are not valid
    UTF-8 (paths read from a filesystem) round-trip. Every rank of ``group`` must make the
    call with the same ``key``; a key names one exchange (the store keeps the values until
    the job ends), so a call made again needs a new key, with a counter or a step in it.

    Args:
        key: The name of this exchange, the same on every rank, new for each exchange.
        value: This rank's string.
        timeout: How long to wait for the other ranks, in seconds (positive, finite).
        group: The ranks that take part; the default group when None.
        withdraw_on_timeout: Delete this rank's key before raising the timeout, and start
            a later call with the same key afresh, so a call made by one rank alone leaves
            nothing behind that a later call could take for its partner.
        poll: Wait by checking the store at growing intervals (1 ms to 10 ms, 50 ms after
            the first second) instead of the store's own blocking wait, which holds the
            process's store client while it lasts: for a thread beside the one that runs
            collectives (a background save), whose wait must not hold up the other thread's
            store requests.

    Returns:
        Every rank's value, index = rank in ``group``; ``[value]`` without a process group
        or in a group of one.

    Raises:
        TypeError: ``key`` or ``value`` is not a string.
        ValueError: ``timeout`` is not a positive, finite number of seconds.
        CommTimeoutError: Some rank did not post within ``timeout``; its ``missing``
            attribute lists those ranks (in ``group``). Also on a rank that arrives just
            after another gave the exchange up at its timeout (the exchange's outcome is set
            once, by compare-and-set on the store): it never goes on alone.

    Examples:
        >>> import comm_collectives as dist
        >>> dist.rendezvous("checkpoint/7/folder", "/tmp/step-7", timeout=30.0)
        ['/tmp/step-7']
    """
    for name, given in (("key", key), ("value", value)):
        if not isinstance(given, str):
            message = f"rendezvous: {name} must be a str, got {type(given).__name__}"
            raise TypeError(message)
    check_timeout("rendezvous", timeout)
    world = get_world_size(group) if is_distributed() else 1
    if world == 1:
        return [value]
    me = get_rank(group)
    store = default_store()
    generation = _settle(store, f"{key}/generation", "0")
    base = key if generation == "0" else f"{key}/{generation}"
    keys = [f"{base}/{rank}" for rank in range(world)]
    # surrogateescape: a path read from the filesystem may hold bytes that are not UTF-8
    encoded = value.encode(_ENCODING, "surrogateescape")
    missing = post_and_wait(store, keys, me, encoded, timeout, poll=poll)
    # One outcome per exchange, set once (compare-and-set): "done" by the first rank that
    # saw every key, "withdrawn" by the first that gave up. A rank that arrives as another
    # gives up either finds "withdrawn" and raises, or completed the exchange first.
    outcome = _settle(store, f"{base}/outcome", "withdrawn" if missing else "done")
    if outcome == "done":
        return [bytes(v).decode(_ENCODING, "surrogateescape") for v in _get_all(store, keys)]
    if missing and withdraw_on_timeout:  # a later exchange with this key starts afresh
        _settle(store, f"{key}/generation", str(int(generation) + 1), expected=generation)
        _withdraw(store, keys[me])
    if missing:
        message = (
            f"rendezvous {key!r} on rank {me} of {world}: rank(s) "
            f"{', '.join(map(str, missing))} did not post within {timeout:g} s. Every rank of "
            "the group must call rendezvous with this key (it is collective): call it on all "
            "ranks, not under `if rank == 0`. If the other ranks are only slow, raise the "
            "timeout."
        )
    else:
        missing = [rank for rank in range(world) if rank != me]
        message = (
            f"rendezvous {key!r} on rank {me} of {world}: every rank had posted, but another "
            f"rank's timeout ran out first and it gave the exchange up; this rank arrived too "
            "late to join it. Every rank of the group must call rendezvous within the "
            "timeout: raise the timeout if the ranks are only slow."
        )
    error = CommTimeoutError(message)
    error.missing = missing  # type: ignore[attr-defined]
    raise error


def _get_all(store: Store, keys: list[str]) -> list[bytes]:
    """The values of ``keys`` in one request where the store has one (``multi_get``: one
    round trip to a TCPStore, one read of a FileStore's file), else one ``get`` a key."""
    multi_get = getattr(store, "multi_get", None)
    if multi_get is not None:
        try:
            return list(multi_get(keys))
        except (NotImplementedError, RuntimeError):
            pass  # a store without it (a custom one): one key at a time
    return [store.get(k) for k in keys]


def _settle(store: Store, key: str, desired: str, *, expected: str = "") -> str:
    """Compare-and-set ``key`` from ``expected`` ("": absent) to ``desired``; return what it
    holds afterwards (``desired`` when this call set it, else the value another rank set)."""
    return bytes(store.compare_set(key, expected, desired)).decode(_ENCODING)


def _withdraw(store: Store, key: str) -> None:
    """Delete ``key``; a store without deletion keeps it (a late rank then finds it)."""
    with contextlib.suppress(Exception):  # best effort: the timeout is what is raised
        store.delete_key(key)


def check_timeout(operation: str, timeout: float) -> None:
    """Raise a ValueError naming ``timeout`` unless it is a positive, finite number."""
    ok = isinstance(timeout, int | float) and not isinstance(timeout, bool)
    if not ok or not 0.0 < float(timeout) < math.inf:
        message = (
            f"{operation}: timeout must be a positive, finite number of seconds, got "
            f"{timeout!r}; pass a large number (86400: a day) to wait long"
        )
        raise ValueError(message)
