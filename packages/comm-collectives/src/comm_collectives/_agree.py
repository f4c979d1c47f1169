"""Every rank raises together: the one-word vote after local work, and the failure reports.

Work that can only fail after the handshake (allocating receive buffers for sizes the
headers gave, staging data on the communication device) is followed by a second, one-word
vote ([`agree`][comm_collectives.agree]) before any data moves, so such a failure also
raises on every rank. Once the ranks know that a call failed, each sends its own failure
(or None) and every rank raises the same [`RemoteRankError`][comm_core.RemoteRankError].
"""

from __future__ import annotations

import time
import traceback
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as torch_dist

from comm_core import (
    CommTimeoutError,
    RankFailure,
    RemoteRankError,
    get_rank,
    get_world_size,
    is_distributed,
)

from ._faults import transport
from ._route import gather_rows, header_route, settle
from ._store import check_timeout

__all__ = ["agree", "failure_of", "gather_and_raise", "raise_everywhere"]


def agree(
    operation: str,
    error: BaseException | None = None,
    *,
    group: torch_dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> None:
    """Raise on every rank of ``group`` when local work failed on any rank.

    Every rank calls this at the same point, after the work that may fail (writing its
    files, allocating receive buffers, staging data) and before the step that needs all of
    them to have succeeded. It costs one exchange of one word a rank on the CPU side of the
    group (no device sync under nccl); the failures travel only when some rank failed. The
    collectives call it on their long path before any data moves.

    Args:
        operation: The name of the step, used in the errors.
        error: This rank's failure, or None when its work succeeded.
        group: The process group of the step; the default group when None.
        timeout: How long to wait for the other ranks' vote, in seconds (positive,
            finite); None waits for the process group's own timeout. Once the ranks have
            voted, they all take part, so the failures are gathered without this bound.

    Raises:
        RemoteRankError: Some rank passed an error (raised on every rank, naming each
            failed rank with its error and traceback).
        CommTimeoutError: Some rank did not vote within ``timeout``: it died, or is stuck
            before this step. The group's collectives are out of step after it: end the job.
        ValueError: ``timeout`` is not a positive, finite number of seconds.

    Examples:
        >>> import comm_collectives as dist
        >>> dist.agree("save")  # no rank failed: it returns
        >>> try:
        ...     dist.agree("save", OSError("disk full"), timeout=60.0)
        ... except dist.RemoteRankError as exc:
        ...     print(exc.failures[0].summary())
        rank 0: builtins.OSError: disk full
    """
    if timeout is not None:
        check_timeout("agree", timeout)
    if not is_distributed():
        if error is not None:
            raise RemoteRankError(operation, [failure_of(error, None)]) from error
        return
    route, device = header_route(group)
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64).to(device)
    votes = torch.empty(get_world_size(route), dtype=torch.int64, device=device)
    started = time.monotonic()
    with transport(operation, route):
        # each rank's vote, where any 1 means a failure (an all-to-all on the CPU: cheaper
        # in front of a large transfer than gloo's all-reduce, see ``gather_rows``)
        work = gather_rows(votes, flag, route, async_op=True)
        assert work is not None
        if timeout is None:
            settle(work, operation, route, device)
        else:
            try:
                work.wait(timeout=timedelta(seconds=timeout))
            except RuntimeError as exc:
                if not _timed_out(exc):
                    raise  # a lost peer: the transport error names it
                waited = time.monotonic() - started
                raise _vote_timeout(operation, route, waited, timeout, exc) from (error or exc)
    if int(votes.max().item()):
        failure = None if error is None else failure_of(error, route)
        gather_and_raise(operation, failure, error, route)


def _timed_out(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _vote_timeout(
    operation: str,
    route: torch_dist.ProcessGroup | None,
    waited: float,
    timeout: float,
    exc: RuntimeError,
) -> CommTimeoutError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    message = (
        f"agree at step {operation!r}: rank {get_rank(route)} of {get_world_size(route)} "
        f"waited {waited:.1f} s (timeout {timeout:g} s) for the other ranks' vote ({text}). "
        "A rank probably died or is stuck before this step: check the other ranks' logs. "
        "If they are only slow, raise the timeout."
    )
    return CommTimeoutError(message)


def raise_everywhere(
    operation: str, error: BaseException | None, group: torch_dist.ProcessGroup | None
) -> NoReturn:
    """Raise one [`RemoteRankError`][comm_core.RemoteRankError] on every rank of ``group``.

    Every rank calls this at the same point, once the ranks agree that the call failed;
    ``error`` is this rank's own failure, or None when this rank only reports the others'.
    """
    route, _ = header_route(group)
    failure = None if error is None else failure_of(error, route)
    gather_and_raise(operation, failure, error, route)


def failure_of(error: BaseException, group: torch_dist.ProcessGroup | None) -> RankFailure:
    """This rank's report of ``error``: its rank in ``group``, type, message, traceback."""
    return RankFailure(
        get_rank(group),
        f"{type(error).__module__}.{type(error).__qualname__}",
        str(error),
        "".join(traceback.format_exception(type(error), error, error.__traceback__)),
    )


def gather_and_raise(
    operation: str,
    failure: RankFailure | None,
    error: BaseException | None,
    group: torch_dist.ProcessGroup | None,
) -> NoReturn:
    """Gather every rank's failure (or None) on ``group`` and raise them on every rank."""
    gathered: list[object] = [None] * get_world_size(group)
    with transport(operation, group):
        torch_dist.all_gather_object(gathered, failure, group=group)
    failures = [f for f in gathered if isinstance(f, RankFailure)]
    raise RemoteRankError(operation, failures) from error
