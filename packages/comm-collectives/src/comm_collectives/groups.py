"""new_group: a process group and, under a backend without CPU support (nccl), its CPU twin.

Every rank of the default group calls ``new_group`` at the same point of its program, as
torch requires, so both groups get the same name on every rank. The twin is a gloo group
over the same ranks: the handshake's headers and votes of every comm call on the new group
travel on it (no device sync per call), as they do on the default group's twin.

A rank outside ``ranks`` gets torch's ``GroupMember.NON_GROUP_MEMBER``; every comm call
given it returns at once without doing anything (None, an empty list for the list-returning
forms), which is torch's behaviour for non-members.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import cast

import torch.distributed as torch_dist

from comm_core import is_distributed, process_group

from ._route import twins

__all__ = ["new_group", "not_member"]


def not_member(group: object) -> bool:
    """Whether ``group`` is torch's marker for a rank outside a group (``new_group`` gives
    it to the ranks not in ``ranks``)."""
    return group is not None and group == torch_dist.GroupMember.NON_GROUP_MEMBER


def _check_ranks(ranks: object, world: int) -> list[int] | None:
    if ranks is None:
        return None
    if not isinstance(ranks, Sequence) or isinstance(ranks, (str, bytes)):
        message = f"new_group: ranks must be a list of global ranks, got {ranks!r:.80}."
        raise TypeError(message)
    listed = list(ranks)
    bad = [r for r in listed if isinstance(r, bool) or not isinstance(r, int)]
    if bad:
        message = f"new_group: ranks must be ints, got {bad[0]!r} in {listed!r:.80}."
        raise TypeError(message)
    outside = [r for r in listed if not 0 <= r < world]
    if outside:
        message = (
            f"new_group: rank {outside[0]} is not a rank of the default group (0..{world - 1})."
        )
        raise ValueError(message)
    if len(set(listed)) != len(listed):
        message = f"new_group: ranks holds a rank twice: {listed!r:.80}."
        raise ValueError(message)
    return sorted(listed)


def _check_timeout(timeout: object) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout < math.inf
    ):
        message = (
            f"new_group: timeout must be a positive, finite number of seconds (or a "
            f"timedelta), got {timeout!r}."
        )
        raise ValueError(message)
    return timedelta(seconds=float(timeout))


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: float | timedelta | None = None,
    backend: str | None = None,
) -> torch_dist.ProcessGroup | None:
    """Create a process group over ``ranks`` that every comm call accepts.

    Every rank of the default group must call it, at the same point of its program (torch's
    rule), also the ranks outside ``ranks``. When the backend cannot move CPU tensors
    (nccl), a gloo twin over the same ranks is created too: comm's headers, votes and error
    reports on the new group travel on it.

    Args:
        ranks: Global ranks of the members; None for every rank.
        timeout: The group's timeout in seconds (or a ``timedelta``); None for torch's
            default.
        backend: ``"gloo"``, ``"nccl"``, ...; None takes the default group's backend.

    Returns:
        The group on its members; torch's ``GroupMember.NON_GROUP_MEMBER`` on the other
        ranks (comm calls given it do nothing, as torch's do); None in a plain process (the
        default "group" of a world of one, which every call accepts).

    Raises:
        TypeError: ``ranks`` is not a list of ints.
        ValueError: A rank is outside the default group or listed twice, or ``timeout``
            is not a positive number of seconds.

    Examples:
        >>> new_group() is None  # a plain process: the world of one
        True
    """
    delta = _check_timeout(timeout)
    if not is_distributed():
        _check_ranks(ranks, 1)
        return None
    members = _check_ranks(ranks, torch_dist.get_world_size())
    group = torch_dist.new_group(ranks=members, timeout=delta, backend=backend)
    name = str(backend if backend is not None else torch_dist.get_backend())
    if process_group._moves_cpu_tensors(name):
        return cast(torch_dist.ProcessGroup, group)
    # every rank creates the twin, in the same order: the same name everywhere
    twin = torch_dist.new_group(ranks=members, timeout=delta, backend="gloo")
    if not not_member(group):
        member_ranks = members if members is not None else list(range(torch_dist.get_world_size()))
        twins[group] = twin
        owner = torch_dist.distributed_c10d._get_default_group()
        # comm-core's table too (get_cpu_group): never replacing a twin it already has (the
        # default group's, for a group of every rank)
        process_group._cpu_twins.setdefault(owner, {}).setdefault(tuple(member_ranks), twin)
    return cast(torch_dist.ProcessGroup, group)
