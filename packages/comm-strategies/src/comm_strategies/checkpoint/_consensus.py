"""The commit protocol of every checkpoint call: enter, work, commit.

1. `Call.enter`: every rank posts the operation, the path, its outcome so far and a
   payload (rank 0's temporary folder); every rank gets every payload, or every rank
   raises: a rank failed, did not come (called alone), or passed another path or call.
2. The work (the format's write or read, the small files): a local failure is kept
   (`Attempts.keep`), not raised, so the rank still takes part in the collectives after.
3. `Call.share`: every rank posts its outcome; every rank raises the same failure, naming
   each failed rank (`failure`, the one place this is built), or goes on. A save shares
   twice around rank 0's publish (`_save.commit`); a load once, after its read.

Every exchange is a bounded `comm_collectives.rendezvous` on the process group's store (no
tensor, nothing left pending in the group after a timeout). The entry waits ``timeout``
(default ``COMM_CHECKPOINT_TIMEOUT`` or 300 s), the shares what is left of it when the
caller passed one, else the longer of that and an hour (writing a large model is slow).
``timeout=`` only bounds the waits; the steps are the same.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import comm_collectives as dist

from ._errors import CheckpointError, outside_package

DEFAULT_TIMEOUT_S = 300.0
# How long the ranks wait for each other to finish writing (large models write slowly).
WRITE_TIMEOUT_S = 3600.0
_TIMEOUT_VARIABLE = "COMM_CHECKPOINT_TIMEOUT"
_calls = 0


def where() -> str:
    """``"rank R of W"`` for error messages."""
    return f"rank {dist.get_rank()} of {dist.get_world_size()}"


def handshake_timeout(timeout: float | None, operation: str) -> float:
    """The timeout of the entry: the argument, the variable, or the default."""
    source, given = "timeout", timeout
    if timeout is None:
        source, text = _TIMEOUT_VARIABLE, os.environ.get(_TIMEOUT_VARIABLE)
        if not text:
            return DEFAULT_TIMEOUT_S
        try:
            given = float(text)
        except ValueError:
            message = f"{_TIMEOUT_VARIABLE} must be a number of seconds, got {text!r}"
            raise CheckpointError(message) from None
    if isinstance(given, bool) or not isinstance(given, (int, float)):
        message = (
            f"{operation}: timeout must be a number of seconds, got {given!r} "
            f"({type(given).__name__})"
        )
        raise CheckpointError(message)
    if not (0.0 < given < math.inf):  # infinity, NaN, 0 or less bound no wait
        message = (
            f"{operation}: {source} must be a positive, finite number of seconds, got "
            f"{float(given)!r}; pass a large number (86400: a day) to wait long"
        )
        raise CheckpointError(message)
    return float(given)


def label(error: BaseException | None) -> str:
    """``"Type: message"`` of a failure, ``""`` for none: what a rank posts as its outcome."""
    return "" if error is None else f"{type(error).__name__}: {error}"


def failure(operation: str, mine: BaseException | None, outcomes: Sequence[str]) -> None:
    """Raise when any rank's outcome (index = rank, ``""``: no failure) is a failure.

    A rank that failed with a `CheckpointError` raises its own (it names the file and the
    rank); every other rank raises one error naming each failed rank with its failure,
    caused by its own failure if it had one. The one place a failure of a checkpoint call
    is told to every rank.
    """
    failures = [(rank, text) for rank, text in enumerate(outcomes) if text]
    if not failures:
        return
    if isinstance(mine, CheckpointError):
        raise mine
    details = "; ".join(f"rank {rank}: {text}" for rank, text in failures)
    raise CheckpointError(f"{operation} failed on {len(failures)} rank(s): {details}") from mine


class Attempts:
    """One rank's failure between two exchanges: kept, not raised, so that the rank still
    takes part in the collective steps after it; the next exchange reports it on every
    rank (`Call.share`)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.error: BaseException | None = None

    @contextlib.contextmanager
    def keep(self, what: str) -> Iterator[None]:
        """Run the block; keep its failure (the first one), naming ``what``."""
        try:
            yield
        except Exception as caught:
            if self.error is None:
                message = f"writing {what} into {self.folder} failed on {where()}: {caught}"
                self.error = CheckpointError(message)
                self.error.__cause__ = caught


class SaveHandle:
    """A checkpoint being saved in the background by ``save_checkpoint(async_save=True)``.

    Every rank gets one. ``wait()`` returns the folder once it is published (manifest
    written, renamed into place), or raises the save's `CheckpointError` on every rank
    when any rank failed; ``done()`` says whether that point is reached, without waiting.

    Examples:
        >>> import tempfile, torch
        >>> from comm_strategies.checkpoint import save_checkpoint
        >>> handle = save_checkpoint(tempfile.mkdtemp() + "/step_1", model=torch.nn.Linear(2, 1),
        ...                          strategy="single", async_save=True)
        >>> handle.wait().name  # training may run between the call and wait()
        'step_1'
        >>> handle.done()
        True
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._observed = False

    @property
    def path(self) -> Path:
        """The checkpoint folder (it exists once the save is published)."""
        return self._path

    def done(self) -> bool:
        """Whether the save has ended, published or failed (``wait()`` then returns at once)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the save to end; return the checkpoint folder.

        Args:
            timeout: Seconds to wait at most; None waits until the save ends (the ranks
                wait for each other's writes at most what is left of the save's
                ``timeout=``, or without one the larger of ``COMM_CHECKPOINT_TIMEOUT``
                (300 s) and an hour).

        Returns:
            The published checkpoint folder.

        Raises:
            CheckpointError: The save failed on some rank (raised on every rank, naming
                the ranks and their errors); nothing was published.
            TimeoutError: The save is still running after ``timeout`` seconds (it goes on;
                call ``wait()`` again).
        """
        if not self._finished.wait(timeout):
            message = (
                f"the async save of {self._path} is still running after {timeout:g} s on "
                f"{where()}; call wait() again"
            )
            raise TimeoutError(message)
        self._observed = True
        if self._error is not None:
            raise self._error
        return self._path

    def _end(self, error: BaseException | None) -> None:
        self._error = error
        self._finished.set()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "running"
        return f"SaveHandle({str(self._path)!r}, {state})"


def finished(path: Path) -> SaveHandle:
    """A handle of a save that already ended (a synchronous one)."""
    handle = SaveHandle(path)
    handle._end(None)
    return handle


# the save whose files and commit a thread writes, and that thread
_background: tuple[SaveHandle, threading.Thread] | None = None


def in_background(handle: SaveHandle, thread: threading.Thread) -> None:
    """Note the async save whose files and commit ``thread`` writes (`_async.start`)."""
    global _background
    _background = (handle, thread)


def wait_previous() -> None:
    """Wait for the async save still running, if any: every `Call` starts with this (the
    calls of a rank are made one after the other, a save's commit included), but on that
    save's own thread.

    Its failure was raised on no rank when nobody called its ``wait()``: it is reported
    as a warning here, at the caller's line outside this package (on every rank alike:
    the ranks share the outcome), and not raised, so that the new save still happens.
    """
    global _background
    if _background is None or _background[1] is threading.current_thread():
        return
    previous = _background[0]
    previous._finished.wait()
    _background = None  # only now: its staged copy's memory is free for the next save
    if previous._error is not None and not previous._observed:
        message = (
            f"the previous async save ({previous.path}) failed and nobody called its "
            f"wait(): {previous._error}"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=outside_package())


class Call:
    """The exchanges of one collective checkpoint call (see the module docstring).

    Args:
        operation: The public function, for messages (``"save_checkpoint"``).
        timeout: Seconds the whole call may take, from the entry to the commit; None: the
            entry waits ``COMM_CHECKPOINT_TIMEOUT`` or 300 s and the commit the longer of
            that and an hour.
    """

    def __init__(self, operation: str, timeout: float | None) -> None:
        global _calls
        wait_previous()  # a checkpoint still being written by an async save
        self.operation = operation
        self.timeout = handshake_timeout(timeout, operation)
        self.deadline = None if timeout is None else time.monotonic() + self.timeout
        _calls += 1
        self.number = _calls

    def enter(self, path: str, error: BaseException | None = None, payload: str = "") -> list[str]:
        """Post ``path``, this rank's outcome so far and ``payload``; return every rank's
        payload (index = rank) once all have entered with the same path and none failed.

        Raises:
            CheckpointError: The ranks passed different paths, or a rank failed before the
                entry (on every rank, naming it), or did not enter within the timeout:
                this rank's entry is then withdrawn and the call's number given back, so
                a call made under ``if rank == 0`` fails once and the collective calls
                after it still match.
        """
        key = f"comm_checkpoint/{self.number}/enter"
        # JSON: a path may hold any character; the operation: a rank's late call never
        # pairs with another's next call of another kind (its number given back)
        value = json.dumps([self.operation, path, label(error), payload])
        try:
            posted = dist.rendezvous(key, value, timeout=self.timeout, withdraw_on_timeout=True)
        except dist.CommTimeoutError as timed_out:
            global _calls
            if _calls == self.number:
                _calls -= 1
            missing = list(getattr(timed_out, "missing", []))
            message = (
                f"{self.operation} on {where()}: rank(s) {missing} did not enter within "
                f"{self.timeout:g} s. Every rank must call {self.operation} (it is "
                "collective): call it on all ranks, not under `if rank == 0`. If the other "
                f"ranks are only slow, raise the timeout ({_TIMEOUT_VARIABLE} or timeout=)."
            )
            raise CheckpointError(message) from (error or timed_out)
        entries = [json.loads(text) for text in posted]
        operations = sorted({str(entry[0]) for entry in entries})
        if len(operations) > 1:
            message = (
                f"{self.operation} on {where()}: the ranks made different calls "
                f"({', '.join(f'rank {r}: {e[0]}' for r, e in enumerate(entries))}); every "
                "rank must make the same checkpoint calls in the same order"
            )
            raise CheckpointError(message)
        paths = sorted({str(entry[1]) for entry in entries})
        if len(paths) > 1:
            message = (
                f"{self.operation}: the ranks passed different paths ({paths}); every rank "
                "must pass the same path"
            )
            raise CheckpointError(message)
        failure(self.operation, error, [str(entry[2]) for entry in entries])
        return [str(entry[3]) for entry in entries]

    def share(self, step: str, error: BaseException | None, *, background: bool = False) -> None:
        """Post this rank's outcome of ``step`` (``error``, or None); raise the same failure
        on every rank when any rank failed (`failure`).

        Args:
            step: The step whose outcome this is (``"written"``, ``"published"``).
            error: This rank's failure since the last exchange, or None.
            background: Called from a thread beside the training thread (an async save):
                the wait checks the store instead of blocking its client.

        Raises:
            CheckpointError: A rank failed (on every rank, naming each failed rank), or a
                rank did not post within what is left of the timeout.
        """
        failure(self.operation, error, self._post(step, label(error), background, error))

    def outcomes(self, step: str, error: BaseException | None) -> list[str]:
        """Every rank's outcome of ``step`` (index = rank, ``""``: no failure), raising
        only on a timeout: for a step whose failure has a fallback."""
        return self._post(step, label(error), False, error)

    def _post(
        self, step: str, text: str, background: bool, error: BaseException | None
    ) -> list[str]:
        if self.deadline is None:
            bound = max(self.timeout, WRITE_TIMEOUT_S)
        elif step == "published":  # rank 0's short publish: not cut by the call's end
            bound = max(self.deadline - time.monotonic(), self.timeout)
        else:  # at least a moment: the others may be there already
            bound = max(self.deadline - time.monotonic(), 0.5)
        started = time.monotonic()
        key = f"comm_checkpoint/{self.number}/{step}"
        try:
            return dist.rendezvous(key, text, timeout=bound, poll=background)
        except dist.CommTimeoutError as timed_out:
            missing = list(getattr(timed_out, "missing", []))
            if "too late" in str(timed_out):  # the others had posted, then given it up
                message = (
                    f"{self.operation} on {where()}: reached step {step!r} after the other "
                    "ranks had given it up at their timeout; raise the timeout (timeout= or "
                    f"{_TIMEOUT_VARIABLE}) if the ranks are only slow."
                )
                raise CheckpointError(message) from (error or timed_out)
            message = (
                f"{self.operation} on {where()}: waited {time.monotonic() - started:.1f} s "
                f"at step {step!r} for rank(s) {missing}; a rank died or is stuck: check "
                "its log; if it is only slow, raise the timeout (timeout= or "
                f"{_TIMEOUT_VARIABLE})."
            )
            raise CheckpointError(message) from (error or timed_out)
