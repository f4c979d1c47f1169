"""Work handles: what a call with ``async_op=True`` (and ``isend`` / ``irecv``) returns.

The checks of an asynchronous call run at the call: its handshake (every rank's shape,
dtype, op and root, every rank's local failure) is exchanged before it returns, so a bad
argument or a mismatch raises on every rank there, as for the blocking call. Only the data
moves in the background. [`Work.wait`][comm_collectives.Work.wait] waits for it, puts the
result in place (the copy back into the caller's tensor, the split of an uneven gather)
and turns a lost peer or an expired ``timeout`` into the library's errors.

A point-to-point handle (``isend`` / ``irecv``) runs its call in a helper thread: a receive
must read the sender's header before it can post the receive of the data, and the thread
does that while the caller goes on, so a ring of ``isend`` / ``irecv`` completes whatever
order its handles are waited in. ``wait(timeout)`` then only joins the thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as torch_dist

from comm_core import CommError, CommTimeoutError, get_rank, get_world_size

from . import _faults
from ._faults import peer_transport, silent_ranks, transport

__all__ = ["Work", "completed_work"]

_POLL_S = 0.0002


def _as_seconds(timeout: float | timedelta | None) -> float | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not 0 < seconds < float("inf")
    ):
        message = (
            f"Work.wait: timeout must be a positive, finite number of seconds (or a "
            f"timedelta), got {timeout!r}."
        )
        raise ValueError(message)
    return float(seconds)


class Work:
    """The handle of an asynchronous call: ``wait()`` for its result.

    Returned by the collectives called with ``async_op=True`` and by
    [`isend`][comm_collectives.isend] / [`irecv`][comm_collectives.irecv]. In a plain
    process (no process group), and when the data travelled inside the handshake, the
    handle is already complete.

    Examples:
        >>> import torch
        >>> import comm_collectives as dist
        >>> t = torch.ones(2)
        >>> work = dist.all_reduce(t, async_op=True)  # a world of one: already complete
        >>> work.is_completed(), work.wait(), t
        (True, True, tensor([1., 1.]))
    """

    def __init__(
        self,
        operation: str,
        group: torch_dist.ProcessGroup | None,
        works: Sequence[torch_dist.Work] = (),
        finish: Callable[[], None] | None = None,
        *,
        peers: Sequence[int] | None = None,
        body: Callable[[Work], None] | None = None,
        expired: Callable[[Work, float], str] | None = None,
    ) -> None:
        self._operation = operation
        # called when a wait(timeout) of a handle with a body expires; returns the timeout
        # error's account of the ranks not heard from ("" for the default one)
        self._expired = expired
        self._group = group
        self._works = list(works)
        self._finish = finish
        self._peers = None if peers is None else list(peers)
        self._source = -1
        self._error: BaseException | None = None
        self._done = not self._works and finish is None and body is None
        self._thread: threading.Thread | None = None
        if body is not None:
            self._thread = threading.Thread(
                target=self._run, args=(body,), name=f"comm-{operation}", daemon=True
            )
            self._thread.start()

    def _run(self, body: Callable[[Work], None]) -> None:
        try:
            body(self)
        except BaseException as exc:  # handed to the caller of wait()
            self._error = exc

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<comm_collectives.Work {self._operation} {state}>"

    def source_rank(self) -> int:
        """The rank (in the group) that sent the data of a receive; -1 for other calls.

        Waits for the receive first.
        """
        self.wait()
        return self._source

    def is_completed(self) -> bool:
        """Return True once the call has finished and its result is in place (never blocks).

        Raises:
            RemoteRankError: The call failed (a lost peer, a sender's failure).
            CollectiveMismatchError: A receive found that the sender sent something else.
        """
        if self._done:
            return True
        if self._thread is not None:
            if self._thread.is_alive():
                return False
        else:
            with self._guard():
                if not all(w.is_completed() for w in self._works):
                    return False
        self.wait()
        return True

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Wait until the call has finished and its result is in place.

        Args:
            timeout: At most this many seconds (or a ``timedelta``); None waits up to the
                process group's own timeout.

        Returns:
            True, like torch's ``Work.wait``.

        Raises:
            CommTimeoutError: ``timeout`` passed first; the message names the ranks not heard
                from (the peer of a point-to-point call; else the ranks that did not report
                alive within a few seconds: dead, or busy elsewhere). The handle stays
                pending: a later ``wait`` may still complete it. An ``irecv`` stays posted:
                it takes the next message from its peer (with its tag) before any later
                receive does.
            RemoteRankError: A peer died in the transfer (named), or the sender of a
                receive failed (its error).
            CollectiveMismatchError: A receive found that the sender sent another shape,
                dtype, device kind or object count (raised on the receiver).
            ValueError: ``timeout`` is not a positive, finite number of seconds; or, with
                ``async_op=True`` on the long path, an integer mean that is not an integer.
        """
        seconds = _as_seconds(timeout)
        if self._done:
            return True
        deadline = None if seconds is None else time.monotonic() + seconds
        started = time.monotonic()
        try:
            if self._thread is not None:
                self._thread.join(seconds)
                if self._thread.is_alive():
                    note = "" if self._expired is None else self._expired(self, seconds or 0.0)
                    raise _Expired("no answer", note)
            else:
                for work in self._works:
                    self._wait_one(work, deadline)
        except _Expired as expired:
            waited = time.monotonic() - started
            raise self._timeout_error(waited, seconds, expired.text, expired.note) from None
        if self._error is not None:
            raise self._error
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                finish()
            except BaseException as exc:
                self._error = exc
                raise
        self._done = True
        self._works = []
        return True

    def _guard(self) -> contextlib.AbstractContextManager[None]:
        """Turn the backend's transport errors into the library's (naming the peer of a
        point-to-point call, or the ranks a liveness check misses)."""
        if self._peers is not None:
            return peer_transport(self._operation, self._group, self._peers)
        return transport(self._operation, self._group)

    def _wait_one(self, work: torch_dist.Work, deadline: float | None) -> None:
        try:
            with self._guard():
                if deadline is None:
                    work.wait()
                    return
                remaining = max(0.001, deadline - time.monotonic())
                try:
                    work.wait(timeout=timedelta(seconds=remaining))
                except RuntimeError as exc:
                    if "timed out" in str(exc).lower() and time.monotonic() >= deadline - 0.01:
                        raise _Expired(str(exc).strip().splitlines()[0]) from None
                    raise
        except CommError as exc:
            self._error = exc
            raise

    def _timeout_error(
        self, waited: float, timeout: float | None, text: str, note: str = ""
    ) -> CommTimeoutError:
        me, world = get_rank(self._group), get_world_size(self._group)
        if note:  # the hook's account of who was not heard from, and why
            who = note
        elif self._peers is not None:
            named = ", ".join(map(str, self._peers)) if self._peers else "any"
            who = f"Rank(s) {named} (the peer) not heard from: no matching call yet, or dead."
        else:
            silent = silent_ranks(self._group)
            who = (
                f"Rank(s) {', '.join(map(str, silent))} did not report alive within "
                f"{_faults._LIVENESS_WAIT_S:g} s (dead, or busy elsewhere)."
                if silent
                else "Every rank reported alive: the transfer is slow, not lost."
            )
        message = (
            f"{self._operation} (async) on rank {me} of {world}: wait timed out after "
            f"{waited:.1f} s (timeout {timeout:g} s; {text}). {who} The handle stays pending: "
            "wait again to complete it, or end the job if a rank is gone."
        )
        return CommTimeoutError(message)


class _Expired(Exception):
    def __init__(self, text: str, note: str = "") -> None:
        super().__init__(text)
        self.text = text
        self.note = note


def completed_work(operation: str = "") -> Work:
    """A handle whose call has already finished (a world of one, data sent inline)."""
    return Work(operation, None)
