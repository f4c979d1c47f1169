"""The work of all_gather and gather (both forms): the layout handshake, then the bytes.

Every rank's shape travels in the handshake; tensors that fit its frame come inline, else
they are padded to the widest, moved in one backend collective and cut back per rank.
The torch forms check the caller's output list against the shapes sent, on every rank.
The public dispatch (which form the arguments mean) is in ``comm_collectives.tensors``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as torch_dist

from comm_core import CollectiveMismatchError, get_comm_device, get_rank, get_world_size

from ._agree import agree
from ._buffers import empty_bytes
from ._faults import transport
from ._forms import check_outputs
from ._frame import Header, Inline, Peer, signature_of
from ._handshake import handshake
from ._modes import local_fault
from ._reduce import inline_rows
from ._route import all_gather_flat
from ._staging import (
    _as_bytes,
    _check_root,
    _check_tensor,
    _checked,
    _fill,
    _local_checks,
    _numel,
    _own,
    _padded_send,
    _plain,
    _split,
    _staged,
    global_rank,
)
from .groups import not_member
from .work import Work, completed_work


def _gather_layout(
    operation: str,
    data: torch.Tensor,
    group: torch_dist.ProcessGroup | None,
    root: int = -1,
    error: BaseException | None = None,
    keep: bool = True,
    outputs: list[torch.Tensor] | None = None,
) -> tuple[list[tuple[int, ...]], list[torch.Tensor] | None]:
    """Every rank's shape, and every rank's tensor when all came inline (else None; an
    empty list when they came inline but ``keep`` is False: a rank that returns nothing
    copies nothing).

    ``outputs`` is the torch form's list on a receiving rank (every rank for all_gather,
    ``root`` for gather): its layout travels as the header's signature, so every rank
    checks it against the shapes the ranks sent and raises the same error.
    """
    ok = error is None
    receives = root < 0 or get_rank(group) == root
    torch_form = outputs is not None
    signature = _layout(outputs) if ok and torch_form and receives and outputs is not None else 0
    peers = handshake(
        Header(
            operation,
            error=error,
            dtype=data.dtype if ok else None,
            root=root if ok else -1,
            shape=tuple(data.shape) if ok else None,
            count=data.numel() if ok else 0,
            signature=signature,
        ),
        group,
        same=("dtype", "root", "signature") if root < 0 else ("dtype", "root"),
        hint=f"{operation} accepts different shapes but needs one dtype and one root"
        + (" (and every rank's output list the same layout)." if torch_form else "."),
        payload=Inline.of_tensor(data) if ok else None,
    )
    shapes = [p.shape or () for p in peers]
    if torch_form:
        announced = peers[root].signature if root >= 0 else peers[0].signature
        if announced and announced != _layout_of(shapes, data.dtype):
            _raise_layout(operation, peers, root)
    rows = inline_rows(peers, data.dtype)
    if rows is None:
        return shapes, None
    if not keep:
        return shapes, []
    if outputs is not None:  # written straight into the caller's tensors
        return shapes, [r.view(s) for r, s in zip(rows, shapes)]
    # copies: a result must not keep the whole handshake table alive
    return shapes, [r.view(s).to(data.device, copy=True) for r, s in zip(rows, shapes)]


def _layout_of(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> int:
    return signature_of([str(dtype), *(tuple(s) for s in shapes)]) or 1


def _layout(outputs: list[torch.Tensor]) -> int:
    """The signature of an output list: its dtype and every tensor's shape (never 0)."""
    dtype = outputs[0].dtype if outputs else torch.float32
    return _layout_of([tuple(t.shape) for t in outputs], dtype)


def _raise_layout(operation: str, peers: list[Peer], root: int) -> NoReturn:
    who = f"rank {root}'s gather_list" if root >= 0 else "the tensor_list"
    problem = (
        f"{who} does not match what the ranks sent: entry i must have the shape and dtype "
        "of rank i's tensor (shown below)."
    )
    raise CollectiveMismatchError(
        operation,
        problem,
        [p.row(None) for p in peers],
        "allocate the output list from the shapes every rank sends, or use the list-"
        f"returning form {operation}(data) for shapes that differ.",
    )


def _local_peer(operation: str, tensor: torch.Tensor) -> Peer:
    return Peer(0, operation, True, str(tensor.dtype), "", -1, tuple(tensor.shape), 0, 0)


def _all_gather(data: torch.Tensor, group: torch_dist.ProcessGroup | None) -> list[torch.Tensor]:
    if not_member(group):  # torch's behaviour outside a group: nothing
        return []
    if get_world_size(group) == 1:
        _check_tensor("all_gather", data)
        return [data]
    error = _checked("all_gather", data)
    shapes, inline = _gather_layout("all_gather", data, group, error=error)
    if inline is not None:
        return inline
    device = get_comm_device(group)
    width = max(_numel(s) for s in shapes)
    if width == 0:
        return [torch.empty(s, dtype=data.dtype, device=data.device) for s in shapes]
    try:
        local_fault("staging", "all_gather")
        send = _padded_send(data, device, width)
        out = empty_bytes(len(shapes) * send.numel(), device)
    except Exception as exc:
        error = exc
    agree("all_gather", error, group=group)
    with transport("all_gather", group):
        all_gather_flat(out, send, group=group)
    return _split(out, shapes, data.dtype, data.device)


def _all_gather_into(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: torch_dist.ProcessGroup | None,
    async_op: bool,
) -> Work | None:
    if not_member(group):  # torch's behaviour outside a group: nothing
        return None
    world = get_world_size(group)

    def check() -> None:
        check_outputs("all_gather", "tensor_list", tensor_list, tensor, world)

    done = completed_work("all_gather") if async_op else None
    if world == 1:
        _local_checks("all_gather", tensor, check)
        if tuple(tensor_list[0].shape) != tuple(tensor.shape):
            _raise_layout("all_gather", [_local_peer("all_gather", tensor)], -1)
        _fill(tensor_list, [tensor])
        return done
    error = _checked("all_gather", tensor, check)
    outputs = list(tensor_list) if error is None else []
    shapes, inline = _gather_layout("all_gather", tensor, group, error=error, outputs=outputs)
    if inline is not None:
        _fill(outputs, inline)
        return done
    device = get_comm_device(group)
    direct = len(set(shapes)) == 1 and all(_own(t, device) for t in outputs)
    width = max(_numel(s) for s in shapes)
    if width == 0:
        return done
    try:
        local_fault("staging", "all_gather")
        if direct:  # equal shapes, outputs on the device: torch's own call, no copies
            send = _as_bytes(_staged(_plain(tensor), device))
            rows = [_as_bytes(t) for t in outputs]
        else:
            send = _padded_send(tensor, device, width)
            out = empty_bytes(len(shapes) * send.numel(), device)
    except Exception as exc:
        error = exc
    agree("all_gather", error, group=group)
    with transport("all_gather", group):
        if direct:
            handle = torch_dist.all_gather(rows, send, group=group, async_op=async_op)
        else:
            handle = all_gather_flat(out, send, group=group, async_op=async_op)

    def finish() -> None:
        if not direct:
            _fill(outputs, _split(out, shapes, tensor.dtype, device))

    if handle is None:
        finish()
        return None
    return Work("all_gather", group, [handle], finish)


def _gather(
    data: torch.Tensor, dst: int, group: torch_dist.ProcessGroup | None
) -> list[torch.Tensor]:
    if not_member(group):  # torch's behaviour outside a group: nothing
        return []
    if get_world_size(group) == 1:
        _local_checks("gather", data, lambda: _check_root("gather", dst, group, "dst"))
        return [data]
    error = _checked("gather", data, lambda: _check_root("gather", dst, group, "dst"))
    me = get_rank(group)
    shapes, inline = _gather_layout("gather", data, group, root=dst, error=error, keep=me == dst)
    if inline is not None:
        return inline
    device = get_comm_device(group)
    width = max(_numel(s) for s in shapes)
    if width == 0:
        return (
            [torch.empty(s, dtype=data.dtype, device=data.device) for s in shapes]
            if me == dst
            else []
        )
    out = None
    try:
        local_fault("staging", "gather")
        send = _padded_send(data, device, width)
        if me == dst:
            out = empty_bytes(len(shapes) * send.numel(), device)
    except Exception as exc:
        error = exc
    agree("gather", error, group=group)
    with transport("gather", group):
        if out is not None:
            rows = list(out.view(len(shapes), -1).unbind(0))
            torch_dist.gather(send, rows, dst=global_rank(group, dst), group=group)
            return _split(out, shapes, data.dtype, data.device)
        torch_dist.gather(send, None, dst=global_rank(group, dst), group=group)
    return []


def _gather_into(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None,
    dst: int,
    group: torch_dist.ProcessGroup | None,
    async_op: bool,
) -> Work | None:
    if not_member(group):  # torch's behaviour outside a group: nothing
        return None
    world = get_world_size(group)
    me = get_rank(group)

    def check() -> None:
        _check_root("gather", dst, group, "dst")
        if me == dst:
            check_outputs("gather", "gather_list", gather_list, tensor, world)
        elif gather_list:  # torch: only the destination passes a list
            message = (
                f"gather: gather_list must be None (or empty) on rank {me}, which is not the "
                f"destination (dst={dst}); only dst receives."
            )
            raise ValueError(message)

    done = completed_work("gather") if async_op else None
    if world == 1:
        _local_checks("gather", tensor, check)
        assert gather_list is not None
        if tuple(gather_list[0].shape) != tuple(tensor.shape):
            _raise_layout("gather", [_local_peer("gather", tensor)], 0)
        _fill(gather_list, [tensor])
        return done
    error = _checked("gather", tensor, check)
    outputs = list(gather_list or []) if error is None else []
    receiving = me == dst and error is None
    shapes, inline = _gather_layout(
        "gather", tensor, group, root=dst, error=error, keep=receiving, outputs=outputs
    )
    if inline is not None:
        _fill(outputs, inline)
        return done
    device = get_comm_device(group)
    width = max(_numel(s) for s in shapes)
    if width == 0:
        return done
    direct = len(set(shapes)) == 1 and all(_own(t, device) for t in outputs)
    rows: list[torch.Tensor] | None = None
    out = torch.empty(0)
    try:
        local_fault("staging", "gather")
        if direct:
            send = _as_bytes(_staged(_plain(tensor), device))
            rows = [_as_bytes(t) for t in outputs] if receiving else None
        else:
            send = _padded_send(tensor, device, width)
            if receiving:
                out = empty_bytes(len(shapes) * send.numel(), device)
                rows = list(out.view(len(shapes), -1).unbind(0))
    except Exception as exc:
        error = exc
    agree("gather", error, group=group)
    with transport("gather", group):
        handle = torch_dist.gather(
            send, rows, dst=global_rank(group, dst), group=group, async_op=async_op
        )

    def finish() -> None:
        if receiving and not direct:
            _fill(outputs, _split(out, shapes, tensor.dtype, device))

    if handle is None:
        finish()
        return None
    return Work("gather", group, [handle], finish)
