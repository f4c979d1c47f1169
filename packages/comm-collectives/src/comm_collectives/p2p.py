"""Point-to-point calls under the never-hang contract: send / recv, isend / irecv, and the
object versions send_object_list / recv_object_list.

Every message is preceded by a header (the handshake's frame header, ``_frame.Header``)
that says what follows: the operation, the dtype, the shape, the device kind and the byte
count, or that the sender failed. The receiver reads it first and then always receives
exactly the bytes announced, so a mismatch between what was sent and what was posted to
receive raises a [`CollectiveMismatchError`][comm_core.CollectiveMismatchError] on the
receiver after the bytes were drained (nothing is left in the channel for the next call to
misread), and a sender's failure reaches the receiver as a
[`RemoteRankError`][comm_core.RemoteRankError]. Headers (and objects) travel on the
group's CPU route (the CPU twin under nccl); tensor data on the group itself.

The sender does not wait for the receiver's verdict (that would cost a round trip per
message and deadlock rings of sends), so it learns of a mismatch only at the receiver's
next call. Ranks are ranks of ``group``, as everywhere in comm (the global ranks for the
default group).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist

from comm_core import get_comm_device, get_rank

from ._buffers import empty_bytes
from ._frame import Header
from ._modes import local_fault
from ._p2p_wire import (
    Abandoned,
    _announce_failure,
    _check_peer,
    _device_code,
    _own_site,
    _post,
    _receive,
    _tags,
    _wait_all,
)
from ._route import header_route
from ._serialization import encode
from ._staging import _as_bytes, _check_tensor, _plain, _staged
from .groups import not_member
from .work import Work, completed_work

__all__ = ["irecv", "isend", "recv", "recv_object_list", "send", "send_object_list"]


def isend(
    tensor: torch.Tensor, dst: int, group: torch_dist.ProcessGroup | None = None, tag: int = 0
) -> Work:
    """Start sending ``tensor`` to rank ``dst``; return a [`Work`][comm_collectives.Work].

    The arguments are those of [`send`][comm_collectives.send]. The tensor must not be
    modified until the handle's ``wait()`` returned.

    Raises:
        RemoteRankError: This rank's tensor could not be sent (not a tensor, staging
            failed); the receiver raises the same error.
        ValueError: ``dst`` is not another rank of the group (raised here only).
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return completed_work("send")
    _tags(tag)
    _check_peer("send", dst, group, "dst")
    try:
        _check_tensor("send", tensor)
        local_fault("local", "send")
        work = _staged(_plain(tensor), get_comm_device(group))
    except Exception as exc:
        raise _announce_failure("send", exc, dst, group, tag) from exc
    header = Header(
        "send",
        dtype=tensor.dtype,
        root=get_rank(group),
        shape=tuple(tensor.shape),
        count=work.numel() * work.element_size(),
        signature=_device_code(tensor.device),
    )
    works = _post("send", header, _as_bytes(work), group, dst, group, tag, _own_site())
    return Work("send", group, peers=[dst], body=lambda _: _wait_all("send", works, group, dst))


def send(
    tensor: torch.Tensor, dst: int, group: torch_dist.ProcessGroup | None = None, tag: int = 0
) -> None:
    """Send ``tensor`` to rank ``dst``; returns once it was received.

    Args:
        tensor: The data; the receiver must post a tensor of the same shape, dtype and
            device kind.
        dst: Receiving rank (in ``group``).
        group: Process group; the default group when None.
        tag: Matches this send with the receive of the same tag.

    Raises:
        RemoteRankError: This rank's tensor could not be sent (the receiver raises the
            same error), or the receiver died (named).
        CommTimeoutError: The receiver did not receive within the group's timeout.
        ValueError: ``dst`` is not another rank of the group (raised here only).
    """
    isend(tensor, dst, group, tag).wait()  # the helper thread only waits: cheap


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: torch_dist.ProcessGroup | None = None,
    tag: int = 0,
) -> Work:
    """Start receiving into ``tensor``; return a [`Work`][comm_collectives.Work].

    The arguments are those of [`recv`][comm_collectives.recv]. After ``wait()``, ``tensor``
    holds the data and ``source_rank()`` names the sender.

    A receive whose ``wait(timeout=...)`` expired stays posted: it takes the next message
    from ``src`` with ``tag`` (into ``tensor``) before any later receive does, so wait on
    the same handle again rather than posting another receive. A later receive that then
    gets nothing, or the message after, says so in its error.

    Raises:
        ValueError: ``src`` is not another rank of the group (raised here).
        CollectiveMismatchError: At ``wait()``: the sender sent another shape, dtype,
            device kind or call (the bytes are drained first; ``tensor`` is unchanged).
        RemoteRankError: At ``wait()``: the sender failed (its error), or died (named).
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return completed_work("recv")
    if src is not None:
        _check_peer("recv", src, group, "src")
    _tags(tag)
    site = _own_site()  # taken here: the body runs in the handle's helper thread
    # registered if a wait(timeout) expires: the receive stays posted and takes the next
    # message, so a later receive's error can name it as the cause
    record = Abandoned(group, src, tag)

    def body(work: Work) -> None:
        try:
            work._source = _receive("recv", tensor, None, src, group, tag, work, site)
        finally:
            record.ended(work)

    peers = [] if src is None else [src]
    return Work("recv", group, peers=peers, body=body, expired=record.expired)


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: torch_dist.ProcessGroup | None = None,
    tag: int = 0,
) -> int:
    """Receive into ``tensor``; return the sender's rank (in ``group``).

    Args:
        tensor: Where the data lands; its shape, dtype and device kind must be those of the
            tensor sent.
        src: Sending rank (in ``group``); None receives from any rank.
        group: Process group; the default group when None.
        tag: Matches this receive with the send of the same tag.

    Returns:
        The rank that sent the data.

    Raises:
        CollectiveMismatchError: The sender sent another shape, dtype, device kind or call
            (the bytes are drained first; ``tensor`` is unchanged).
        RemoteRankError: The sender failed (its error), or died (named).
        CommTimeoutError: Nothing arrived within the group's timeout (the peer named).
        ValueError: ``src`` is not another rank of the group.
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return -1
    return _receive("recv", tensor, None, src, group, tag, None, _own_site())


def send_object_list(
    object_list: list[Any], dst: int, group: torch_dist.ProcessGroup | None = None
) -> None:
    """Send the picklable objects of ``object_list`` to rank ``dst``.

    Tensors and arrays inside travel as raw buffers, without pickling their bytes.

    Args:
        object_list: The objects; the receiver posts a list of the same length.
        dst: Receiving rank (in ``group``).
        group: Process group; the default group when None.

    Raises:
        RemoteRankError: The list could not be pickled (the receiver raises the same
            error), or the receiver died (named).
        ValueError: ``dst`` is not another rank of the group (raised here only).
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return
    _check_peer("send_object_list", dst, group, "dst")
    try:
        if not isinstance(object_list, list):
            message = (
                f"send_object_list: object_list must be a list, got {type(object_list).__name__}."
            )
            raise TypeError(message)
        local_fault("local", "send_object_list")
        encoded = encode(list(object_list))
        frame = empty_bytes(encoded.nbytes, torch.device("cpu"))
        encoded.write_into(frame.numpy())
    except Exception as exc:
        raise _announce_failure("send_object_list", exc, dst, group, 0) from exc
    header = Header(
        "send_object_list",
        root=get_rank(group),
        count=encoded.nbytes,
        signature=len(object_list),
    )
    route, _ = header_route(group)
    works = _post("send_object_list", header, frame, route, dst, group, 0, _own_site())
    _wait_all("send_object_list", works, group, dst)


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: torch_dist.ProcessGroup | None = None,
) -> int:
    """Receive the objects a ``send_object_list`` sent into ``object_list``, in place.

    Args:
        object_list: A list as long as the sender's; its items are replaced.
        src: Sending rank (in ``group``); None receives from any rank.
        group: Process group; the default group when None.

    Returns:
        The rank that sent the objects.

    Raises:
        CollectiveMismatchError: The sender sent a list of another length, or a tensor.
        RemoteRankError: The sender failed (its error), or died (named).
        TypeError: ``object_list`` is not a list (after the message was drained).
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return -1
    return _receive("recv_object_list", None, object_list, src, group, 0, None, _own_site())
