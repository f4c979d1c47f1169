"""Every rank of a checkpoint call arrives, or every rank raises; outcomes are shared.

The checkpoint functions are collective. A rank that calls one alone must get an error
instead of waiting forever, so every call starts with `Call.enter`: a bounded exchange of
small strings through the process group's store (comm_collectives' `rendezvous`: no
tensor, no device sync), which also hands every rank the values it needs (the folder
name, each rank's path); `Call.enter_sharing` also posts this rank's outcome of the local
work done before it, so one exchange both enters and shares it (`Call.share` raises it).
Before a part that moves data between the ranks, `Call.together`
makes every rank wait for the others within what is left of the call's timeout (torch's
collectives inside would wait for the process group's own). After the work that may
fail on one rank, `Call.vote` shares
each rank's outcome (comm_collectives' `agree`, bounded by a timeout) and raises on every
rank when any rank failed. Both turn the layer's errors into `CheckpointError`.
"""

from __future__ import annotations

import json
import math
import os
import time

import comm_collectives as dist

from ._errors import CheckpointError

DEFAULT_TIMEOUT_S = 300.0
# How long the ranks wait for each other to finish writing (large models write slowly).
WRITE_TIMEOUT_S = 3600.0
_TIMEOUT_VARIABLE = "COMM_CHECKPOINT_TIMEOUT"
_calls = 0


def where() -> str:
    """``"rank R of W"`` for error messages."""
    return f"rank {dist.get_rank()} of {dist.get_world_size()}"


def handshake_timeout(timeout: float | None, operation: str) -> float:
    """The timeout of the entry handshake: the argument, the variable, or the default."""
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            message = (
                f"{operation}: timeout must be a number of seconds, got {timeout!r} "
                f"({type(timeout).__name__})"
            )
            raise CheckpointError(message)
        return _checked(float(timeout), "timeout", operation)
    value = os.environ.get(_TIMEOUT_VARIABLE)
    if value:
        try:
            seconds = float(value)
        except ValueError:
            message = f"{_TIMEOUT_VARIABLE} must be a number of seconds, got {value!r}"
            raise CheckpointError(message) from None
        return _checked(seconds, _TIMEOUT_VARIABLE, operation)
    return DEFAULT_TIMEOUT_S


def _checked(seconds: float, source: str, operation: str) -> float:
    """``seconds`` when it bounds a wait (infinity, NaN, 0 or less do not)."""
    if not (0.0 < seconds < math.inf):
        message = (
            f"{operation}: {source} must be a positive, finite number of seconds, got "
            f"{seconds!r}; pass a large number (86400: a day) to wait long"
        )
        raise CheckpointError(message)
    return seconds


class Call:
    """The steps every rank of one collective checkpoint call takes together.

    Args:
        operation: The public function, for messages (``"save_checkpoint"``).
        timeout: Seconds the whole call may take, from entering to the last outcome
            shared; None: the entry waits ``COMM_CHECKPOINT_TIMEOUT`` or 300 s and the
            outcome votes the longer of that and an hour (writing a large model is slow).
    """

    def __init__(self, operation: str, timeout: float | None) -> None:
        global _calls
        self.operation = operation
        self.timeout = handshake_timeout(timeout, operation)
        # A timeout the caller passed bounds the whole call, the outcome votes included.
        self.deadline = None if timeout is None else time.monotonic() + self.timeout
        _calls += 1
        self.number = _calls

    def enter(self, value: str) -> list[str]:
        """Post ``value`` and return every rank's (index = rank) once all have entered.

        Raises:
            CheckpointError: A rank did not enter within the timeout. This rank's entry is
                withdrawn and the call's number given back, so a call made under
                ``if rank == 0`` fails once and the collective calls after it still match.
        """
        key = f"comm_checkpoint/{self.number}/enter"
        try:
            return dist.rendezvous(key, value, timeout=self.timeout, withdraw_on_timeout=True)
        except dist.CommTimeoutError as error:
            global _calls
            if _calls == self.number:
                _calls -= 1
            missing = list(getattr(error, "missing", []))
            message = (
                f"{self.operation} on {where()}: rank(s) {missing} did not reach 'enter' "
                f"within {self.timeout:g} s. Every rank must call {self.operation} (it is "
                "collective): call it on all ranks, not under `if rank == 0`. If the other "
                f"ranks are only slow, raise the timeout ({_TIMEOUT_VARIABLE} or timeout=)."
            )
            raise CheckpointError(message) from error

    def enter_sharing(self, value: str, error: BaseException | None) -> tuple[list[str], list[str]]:
        """`enter`, with this rank's outcome of the work done before it (``error``, or
        None) posted beside ``value``: one exchange where `enter` then `together` take two.

        Returns:
            Every rank's value and every rank's outcome (``""``: it did not fail), index =
            rank; pass the outcomes to `share` once the values are checked.

        Raises:
            CheckpointError: As `enter`.
        """
        outcome = "" if error is None else _label(error)
        entries = [json.loads(text) for text in self.enter(json.dumps([value, outcome]))]
        return [str(entry[0]) for entry in entries], [str(entry[1]) for entry in entries]

    def share(self, error: BaseException | None, outcomes: list[str]) -> None:
        """Raise on every rank when any rank's outcome (from `enter_sharing`) is a failure,
        naming each failed rank, as `together` does."""
        failures = [(rank, text) for rank, text in enumerate(outcomes) if text]
        if failures:
            raise _failed(self.operation, error, failures, error)

    def together(self, step: str, error: BaseException | None = None) -> None:
        """Wait until every rank reached ``step``, before a part that moves data between
        the ranks (torch's collectives wait only for the process group's own timeout), and
        share each rank's outcome of the work before it.

        Bounded by what is left of the call's timeout when the caller passed one, else by
        the entry timeout. A store exchange, like the entry: nothing is left pending in the
        process group, so the world stays usable after a timeout. ``error`` (this rank's
        failure since entering) is raised on every rank at once, naming the rank, so a
        rank that failed early does not leave the others waiting out the timeout (and
        arrive at their next call one timeout after it).

        Raises:
            CheckpointError: A rank failed before ``step`` (on every rank, naming it); a
                rank did not reach ``step`` in time (named); or this rank reached it after
                the call's timeout had passed, when the others had given the call up.
        """
        if dist.get_world_size() == 1:
            if error is not None:
                raise _failed(self.operation, error, [(0, _label(error))], error)
            return
        bound = self.timeout
        if self.deadline is not None:
            bound = self.deadline - time.monotonic()
            if bound <= 0:
                message = (
                    f"{self.operation} on {where()}: this rank reached step {step!r} "
                    f"{-bound:.1f} s after the call's timeout ({self.timeout:g} s) had "
                    "passed; the other ranks gave the call up then. Raise timeout= if "
                    "this rank is only slow."
                )
                raise CheckpointError(message)
        key = f"comm_checkpoint/{self.number}/{step}"
        try:
            outcomes = dist.rendezvous(
                key, "" if error is None else _label(error), timeout=bound, withdraw_on_timeout=True
            )
        except dist.CommTimeoutError as timed_out:
            missing = list(getattr(timed_out, "missing", []))
            message = (
                f"{self.operation} on {where()}: rank(s) {missing} did not reach step "
                f"{step!r} within {bound:.1f} s (the call's timeout is {self.timeout:g} s); "
                "the call is given up on this rank. A rank died or is stuck: check its log; "
                "if it is only slow, raise the timeout (timeout= or "
                f"{_TIMEOUT_VARIABLE})."
            )
            raise CheckpointError(message) from (error or timed_out)
        failures = [(rank, text) for rank, text in enumerate(outcomes) if text]
        if failures:
            raise _failed(self.operation, error, failures, error)

    def vote(self, step: str, error: BaseException | None, timeout: float | None = None) -> None:
        """Share each rank's outcome of ``step``; raise on every rank if any rank failed.

        Waits at most ``timeout`` seconds; by default what is left of the call's own
        timeout when the caller passed one, else the longer of the entry timeout and an
        hour (writing is slow): a rank that died after entering makes the others raise
        then, not after the process group's own timeout.
        """
        if dist.get_world_size() == 1:
            if error is not None:
                raise _failed(self.operation, error, [(0, _label(error))], error)
            return
        if timeout is not None:
            bound = timeout
        elif self.deadline is not None:  # at least a moment: the others may be there
            bound = max(self.deadline - time.monotonic(), 0.5)
        else:
            bound = max(self.timeout, WRITE_TIMEOUT_S)
        started = time.monotonic()
        try:
            dist.agree(f"{self.operation} ({step})", error, timeout=bound)
        except dist.RemoteRankError as remote:
            failures = [
                (f.rank, f"{f.error_type.rsplit('.', 1)[-1]}: {f.message}") for f in remote.failures
            ]
            raise _failed(self.operation, error, failures, error or remote)  # noqa: B904
        except dist.CommTimeoutError as timed_out:
            waited = time.monotonic() - started
            message = (
                f"{self.operation}: rank {dist.get_rank()} waited {waited:.0f} s at step "
                f"{step!r} for the other ranks' outcome ({timed_out}); a rank died or is "
                "stuck: check the logs of the other ranks."
            )
            raise CheckpointError(message) from (error or timed_out)


def _label(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _failed(
    operation: str,
    error: BaseException | None,
    failures: list[tuple[int, str]],
    cause: BaseException | None,
) -> CheckpointError:
    """This rank's own `CheckpointError` when it alone failed, else one naming every rank."""
    if isinstance(error, CheckpointError) and len(failures) == 1:
        return error
    details = "; ".join(f"rank {rank}: {text}" for rank, text in failures)
    failed = CheckpointError(f"{operation} failed on {len(failures)} rank(s): {details}")
    failed.__cause__ = cause
    return failed
