"""The error hierarchy shared by every comm package.

Every error a comm package raises on purpose is a [`CommError`][comm_core.CommError].
Messages say what was expected, what was received, on which rank, and how to fix it. Upper
layers subclass these classes instead of defining parallel hierarchies.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "AlreadyInitializedError",
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "DeviceMismatchError",
    "LauncherError",
    "NotInitializedError",
    "RankFailure",
    "RemoteRankError",
    "rank_context",
]


def rank_context() -> str:
    """Describe the calling process for an error message: rank, world size and backend.

    Returns:
        A short phrase such as ``"rank 1 of 4 (backend gloo)"`` or, in a process without a
        process group, ``"a non-distributed process (pid 1234)"``.
    """
    import torch.distributed as torch_dist

    if torch_dist.is_available() and torch_dist.is_initialized():
        rank = torch_dist.get_rank()
        world = torch_dist.get_world_size()
        backend = torch_dist.get_backend()
        return f"rank {rank} of {world} (backend {backend})"
    return f"a non-distributed process (pid {os.getpid()})"


class CommError(RuntimeError):
    """Base class of every error raised on purpose by a comm package."""


class NotInitializedError(CommError):
    """An operation needs a process group and none is initialised."""


class AlreadyInitializedError(CommError):
    """``init_dist`` was called while a default process group already exists."""


class LauncherError(CommError, ValueError):
    """The launcher environment is missing, malformed or inconsistent."""


class DeviceMismatchError(CommError, ValueError):
    """Tensors inside one data structure live on different devices."""


class CommTimeoutError(CommError, TimeoutError):
    """A distributed operation did not finish within its bounded time.

    comm-collectives raises it when the backend reports that a collective timed out (the
    process group's ``timeout``), in place of the backend's bare RuntimeError.
    """


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank.

    Attributes:
        rank: The rank (in the group of the call) that failed.
        error_type: The qualified name of the exception type raised there.
        message: ``str()`` of that exception.
        traceback: The formatted traceback on that rank, or an empty string.
    """

    rank: int
    error_type: str
    message: str
    traceback: str = ""

    def summary(self) -> str:
        """Return ``"rank R: Type: message"`` on one line."""
        return f"rank {self.rank}: {self.error_type}: {self.message}"


class RemoteRankError(CommError):
    """One or more ranks failed inside a collective; raised on every rank of the call.

    Attributes:
        operation: The collective that failed, e.g. ``"all_gather_object"``.
        failures: The failures, one per failed rank, ordered by rank.
    """

    def __init__(self, operation: str, failures: Sequence[RankFailure]) -> None:
        self.operation = operation
        self.failures = tuple(sorted(failures, key=lambda f: f.rank))
        ranks = ", ".join(str(f.rank) for f in self.failures)
        lines = [
            f"{operation} failed on rank(s) {ranks}; every rank of the call raises this "
            "error instead of waiting for the others.",
        ]
        lines.extend(f"  {failure.summary()}" for failure in self.failures)
        details = [f.traceback.rstrip() for f in self.failures if f.traceback]
        if details:
            lines.append("Tracebacks of the failed ranks:")
            for failure in self.failures:
                if failure.traceback:
                    lines.append(f"--- rank {failure.rank} ---")
                    lines.append(failure.traceback.rstrip())
        lines.append("Fix the cause on the named rank(s); the other ranks only report it.")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[type[RemoteRankError], tuple[str, tuple[RankFailure, ...]]]:
        # the default reduction passes the message as the only argument: it would not
        # unpickle in a process pool, concurrent.futures or Ray
        return (type(self), (self.operation, self.failures))

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that failed."""
        return tuple(f.rank for f in self.failures)


class CollectiveMismatchError(CommError, ValueError):
    """Ranks called a collective with incompatible arguments (or different collectives).

    Attributes:
        operation: The collective on which the mismatch was found.
        problem: What differs, in one sentence.
        rows: One mapping per rank (column name to value), in rank order.
        hint: How to fix it, or an empty string.
    """

    def __init__(
        self,
        operation: str,
        problem: str,
        rows: Sequence[Mapping[str, object]],
        hint: str = "",
    ) -> None:
        self.operation = operation
        self.problem = problem
        self.hint = hint
        self.rows = tuple(dict(row) for row in rows)
        table = format_table(self.rows)
        message = f"{operation}: {problem}\n{table}"
        if hint:
            message += f"\nHINT: {hint}"
        super().__init__(message)

    def __reduce__(
        self,
    ) -> tuple[
        type[CollectiveMismatchError],
        tuple[str, str, tuple[dict[str, object], ...], str],
    ]:
        return (type(self), (self.operation, self.problem, self.rows, self.hint))


def format_table(rows: Sequence[Mapping[str, object]]) -> str:
    """Format rows of equal keys as a plain-text table (used by error messages and tools).

    Args:
        rows: Mappings from column name to value; the first row's keys give the columns.

    Returns:
        The table as text, one line per row plus a header line.
    """
    if not rows:
        return "(no rows)"
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    cells = [[str(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(column), *(len(r[i]) for r in cells)) for i, column in enumerate(columns)]
    header = "  ".join(column.ljust(width) for column, width in zip(columns, widths))
    rule = "  ".join("-" * width for width in widths)
    body = ["  ".join(cell.ljust(width) for cell, width in zip(r, widths)) for r in cells]
    return "\n".join([header, rule, *body])
