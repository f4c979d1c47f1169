"""barrier: every rank of the group reaches the call, checked like a collective.

The barrier is the handshake alone: each rank sends a header saying it is in ``barrier``,
so a rank that is in another collective makes every rank raise a
[`CollectiveMismatchError`][comm_core.CollectiveMismatchError] (with the call sites in
debug mode) instead of the two calls waiting for each other. With ``async_op=True`` the
header goes out at the call and the check happens at ``wait()``. Under nccl (the headers
on the CPU twin) the backend's own barrier follows the check, so work queued on the device
is done too, as with torch's barrier. Inside
[`unchecked`][comm_collectives.unchecked] it is the backend's own barrier.
"""

from __future__ import annotations

import torch.distributed as torch_dist

from comm_core import get_world_size, is_distributed

from ._faults import transport
from ._frame import Header
from ._handshake import start_handshake
from ._modes import checks_enabled, local_fault
from ._route import header_route
from .groups import not_member
from .work import Work, completed_work

__all__ = ["barrier"]


def barrier(group: torch_dist.ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Wait until every rank of ``group`` reaches this call; a no-op in a plain process.

    Unlike ``torch.distributed.barrier``, it is checked: a rank that is in another
    collective makes every rank raise instead of hanging.

    Args:
        group: Process group; the default group when None.
        async_op: Return a [`Work`][comm_collectives.Work] handle at once; its ``wait()``
            returns once every rank reached the barrier (and raises the mismatch there).

    Returns:
        None; a [`Work`][comm_collectives.Work] handle with ``async_op=True``.

    Raises:
        CollectiveMismatchError: Some rank is in another collective (every rank raises;
            at ``wait()`` with ``async_op=True``).

    Examples:
        >>> barrier()  # a plain process: returns at once
        >>> barrier(async_op=True).wait()
        True
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return None
    if not is_distributed() or get_world_size(group) == 1:
        return completed_work("barrier") if async_op else None
    if not checks_enabled():
        with transport("barrier", group):
            handle = torch_dist.barrier(group=group, async_op=async_op)
        return None if handle is None else Work("barrier", group, [handle])
    error = None
    try:
        local_fault("local", "barrier")
    except Exception as exc:
        error = exc
    pending = start_handshake(Header("barrier", error=error), group, varying=False)
    hint = "every rank must make the same sequence of collective calls."

    on_device = header_route(group)[0] is not group  # nccl: headers on the CPU twin

    def check() -> None:
        pending.result(hint=hint)
        if on_device:  # and the backend's barrier: the device's queued work is done too
            with transport("barrier", group):
                torch_dist.barrier(group=group)

    if not async_op:
        check()
        return None
    work = pending._work
    return Work("barrier", group, [] if work is None else [work], check)
