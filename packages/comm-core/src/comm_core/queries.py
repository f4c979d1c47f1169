"""Rank, world, local and backend queries; all of them valid in a plain process."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch.distributed as torch_dist

from .errors import NotInitializedError
from .process_group import current_local_group

__all__ = [
    "barrier",
    "get_backend",
    "get_default_group",
    "get_dist_info",
    "get_local_group",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "is_main_process",
    "master_only",
]

P = ParamSpec("P")
R = TypeVar("R")


def is_distributed() -> bool:
    """Return True when a default process group is initialised."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def get_default_group() -> torch_dist.ProcessGroup | None:
    """Return the default process group, or None in a plain process."""
    if not is_distributed():
        return None
    return torch_dist.distributed_c10d._get_default_group()


def get_backend(group: torch_dist.ProcessGroup | None = None) -> str | None:
    """Return the backend of ``group`` (default group when None), or None in a plain process.

    Examples:
        >>> get_backend() is None  # no process group here
        True
    """
    if not is_distributed():
        return None
    return str(torch_dist.get_backend(group))


def get_world_size(group: torch_dist.ProcessGroup | None = None) -> int:
    """Return the number of ranks in ``group`` (default group when None); 1 in a plain process.

    Raises:
        ValueError: This process is not a member of ``group`` (torch would return -1, which
            then fails later with a less helpful message).
    """
    if not is_distributed():
        return 1
    size = int(torch_dist.get_world_size(group))
    if size < 0:
        message = (
            f"get_world_size: global rank {torch_dist.get_rank()} is not a member of the given "
            "group. Only members of a group may use it (in a collective, or to ask its size)."
        )
        raise ValueError(message)
    return size


def get_rank(group: torch_dist.ProcessGroup | None = None) -> int:
    """Return this process's rank in ``group`` (default group when None); 0 in a plain process.

    Raises:
        ValueError: This process is not a member of ``group``.
    """
    if not is_distributed():
        return 0
    rank = int(torch_dist.get_rank(group))
    if rank < 0:
        message = (
            f"get_rank: global rank {torch_dist.get_rank()} is not a member of the given group. "
            "Only members of a group may ask for their rank in it."
        )
        raise ValueError(message)
    return rank


def get_dist_info(group: torch_dist.ProcessGroup | None = None) -> tuple[int, int]:
    """Return ``(rank, world_size)`` of ``group``; ``(0, 1)`` in a plain process."""
    return get_rank(group), get_world_size(group)


def is_main_process(group: torch_dist.ProcessGroup | None = None) -> bool:
    """Return True on rank 0 of ``group`` (and in a plain process)."""
    return get_rank(group) == 0


def get_local_group() -> torch_dist.ProcessGroup | None:
    """Return this rank's node group, or None in a plain process or before it is created."""
    return current_local_group()


def _no_local_group(caller: str) -> NotInitializedError:
    message = (
        f"{caller}: the process group was initialised without comm_core.init_dist and "
        "LOCAL_RANK / LOCAL_WORLD_SIZE are not set, so the node layout is unknown. "
        "Call comm_core.init_local_group() on every rank."
    )
    return NotInitializedError(message)


def get_local_rank() -> int:
    """Return this process's rank among the ranks of its node; 0 in a plain process.

    Raises:
        NotInitializedError: The process group exists but the node layout is unknown.
    """
    if not is_distributed():
        return 0
    group = current_local_group()
    if group is not None:
        return int(torch_dist.get_rank(group))
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    raise _no_local_group("get_local_rank")


def get_local_size() -> int:
    """Return the number of ranks on this process's node; 1 in a plain process.

    Raises:
        NotInitializedError: The process group exists but the node layout is unknown.
    """
    if not is_distributed():
        return 1
    group = current_local_group()
    if group is not None:
        return int(torch_dist.get_world_size(group))
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    raise _no_local_group("get_local_size")


def master_only(func: Callable[P, R]) -> Callable[P, R | None]:
    """Run the decorated function on the main process only; other ranks get None.

    The wrapper keeps the function's name, docstring and signature.

    Examples:
        >>> @master_only
        ... def log(msg: str) -> str:
        ...     return msg
        >>> log("hi")
        'hi'
    """

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        if is_main_process():
            return func(*args, **kwargs)
        return None

    return wrapper


def barrier(group: torch_dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` reaches this call; a no-op in a plain process."""
    if is_distributed():
        torch_dist.barrier(group)
