"""Tensor collectives: all_reduce, all_gather, gather, broadcast and sync_random_seed.

Each moves the data to the communication device of the group and back, keeps the caller's
dtype and device, works in a plain process (a world of one), and starts with the handshake
of ``comm_collectives._handshake``, so a mismatch raises on every rank instead of hanging.
Data that fits the handshake frame travels inside it: one collective in all, and a small
reduction is then done locally in rank order, so every rank gets bit-identical results.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, overload

import torch
import torch.distributed as torch_dist

from comm_core import CollectiveMismatchError, get_comm_device, get_rank, get_world_size

from ._agree import agree
from ._buffers import empty_bytes
from ._faults import transport
from ._forms import ALL_GATHER_MM, ALL_GATHER_TORCH, GATHER_MM, GATHER_TORCH, bind, check_outputs
from ._frame import Header, Inline, Peer, signature_of
from ._handshake import handshake
from ._modes import checks_enabled, local_fault
from ._reduce import (
    backend_reduce,
    check_op_dtype,
    inline_rows,
    reduce_inplace,
    reduce_op_name,
    reduce_rows,
    start_backend_reduce,
    write_back,
)
from ._route import all_gather_flat
from .groups import not_member
from .work import Work, completed_work

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "gather",
    "global_rank",
    "sync_random_seed",
]


def global_rank(group: torch_dist.ProcessGroup | None, rank: int) -> int:
    """Translate a rank of ``group`` into the global rank torch's rooted calls expect."""
    if group is None or group is torch_dist.group.WORLD:
        return rank
    return int(torch_dist.get_global_rank(group, rank))


def _check_tensor(name: str, data: object) -> None:
    if not isinstance(data, torch.Tensor):
        message = f"{name}: data must be a torch.Tensor, got {type(data).__name__}."
        raise TypeError(message)


def _check_root(name: str, root: int, group: torch_dist.ProcessGroup | None, what: str) -> None:
    world = get_world_size(group)
    if not isinstance(root, int) or isinstance(root, bool):
        message = f"{name}: {what} must be an int rank of the group, got {root!r}."
        raise TypeError(message)
    if not 0 <= root < world:
        message = f"{name}: {what}={root} is not a rank of the group (0..{world - 1})."
        raise ValueError(message)


def _staged(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` itself when contiguous on ``device``, else a contiguous copy there.

    The caller copies the result back into ``tensor`` when it is a copy.
    """
    if tensor.device == device and tensor.is_contiguous():
        return tensor
    return tensor.to(device).contiguous()


def all_reduce(
    data: torch.Tensor,
    op: str | torch_dist.ReduceOp | torch_dist.ReduceOp.RedOpType = "sum",
    group: torch_dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``data`` across all ranks, in place.

    Args:
        data: The tensor; every rank passes the same shape and dtype.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"`` (case-insensitive),
            or torch's ``ReduceOp.SUM``, ``AVG`` (the mean), ``MAX``, ``MIN``, ``PRODUCT``.
        group: Process group; the default group when None.
        async_op: Return a [`Work`][comm_collectives.Work] handle at once; the result is
            in ``data`` after its ``wait()``. The checks still run at the call.

    Returns:
        None; a [`Work`][comm_collectives.Work] handle with ``async_op=True``.

    Raises:
        ValueError: Unknown op, or an integer mean that is not an integer (data unchanged;
            with ``async_op=True`` on the long path it raises at ``wait()``).
        CollectiveMismatchError: Ranks passed different shapes, dtypes or ops.

    Examples:
        >>> t = torch.tensor([1, 3])
        >>> all_reduce(t, op="mean")  # a world of one: unchanged
        >>> t
        tensor([1, 3])
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return None
    if get_world_size(group) == 1:
        reduce_op_name(op)
        _check_tensor("all_reduce", data)
        return completed_work("all_reduce") if async_op else None
    if not checks_enabled():
        name = reduce_op_name(op)
        if async_op:
            handle, finish = start_backend_reduce([data], name, group, "all_reduce", inplace=True)
            return Work("all_reduce", group, [handle], lambda: write_back(data, finish()))
        write_back(data, backend_reduce([data], name, group, "all_reduce"))
        return None
    name, error = "", None
    try:
        name = reduce_op_name(op)
        _check_tensor("all_reduce", data)
        check_op_dtype(data.dtype, name, "all_reduce")
        local_fault("local", "all_reduce")
    except Exception as exc:
        error = exc
    ok = error is None
    peers = handshake(
        Header(
            "all_reduce",
            error=error,
            dtype=data.dtype if ok else None,
            reduce_op=name or None,
            shape=tuple(data.shape) if ok else None,
        ),
        group,
        same=("dtype", "reduce_op", "shape"),
        hint="all_reduce needs the same shape, dtype and op on every rank.",
        payload=Inline.of_tensor(data) if ok else None,
        varying=False,
    )
    rows = inline_rows(peers, data.dtype)
    if rows is not None:
        write_back(data, reduce_rows(torch.stack(rows), name, "all_reduce"))
        return completed_work("all_reduce") if async_op else None
    if not async_op:
        reduce_inplace(data, name, group, "all_reduce")
        return None
    # checked already: the backend's own all-reduce moves the data in the background

    def vote(failure: BaseException | None) -> None:
        agree("all_reduce", failure, group=group)

    handle, finish = start_backend_reduce(
        [data], name, group, "all_reduce", vote=vote, inplace=True
    )
    return Work("all_reduce", group, [handle], lambda: write_back(data, finish()))


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


def _local_checks(operation: str, data: object, check: Callable[[], None] | None = None) -> None:
    """The argument checks of a tensor collective and the test hook, before the handshake."""
    _check_tensor(operation, data)
    if check is not None:
        check()
    local_fault("local", operation)


def _checked(
    operation: str, data: object, check: Callable[[], None] | None = None
) -> BaseException | None:
    try:
        _local_checks(operation, data, check)
    except Exception as exc:
        return exc
    return None


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: gloo moves bytes of any dtype."""
    flat = tensor.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:  # one element of a strided view
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def _plain(data: torch.Tensor) -> torch.Tensor:
    """``data`` without autograd and with conjugate / negative bits materialised."""
    return data.detach().resolve_conj().resolve_neg()


def _padded_send(data: torch.Tensor, device: torch.device, width: int) -> torch.Tensor:
    """The bytes of ``data`` on ``device``, zero-padded to ``width`` elements."""
    flat = _as_bytes(_plain(data).to(device).contiguous())
    nbytes = width * data.element_size()
    if flat.numel() == nbytes:
        return flat
    send = empty_bytes(nbytes, device)
    send[: flat.numel()] = flat
    send[flat.numel() :] = 0
    return send


def _split(
    out: torch.Tensor,
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Cut the gathered bytes into one tensor per rank, each with its own shape."""
    rows = out.view(len(shapes), -1).to(device)
    size = torch.empty((), dtype=dtype).element_size()
    return [row[: _numel(shape) * size].view(dtype).view(shape) for row, shape in zip(rows, shapes)]


@overload
def all_gather(
    data: torch.Tensor, group: torch_dist.ProcessGroup | None = None
) -> list[torch.Tensor]: ...


@overload
def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: torch_dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...


def all_gather(*args: Any, **kwargs: Any) -> Any:
    """Gather a tensor from every rank; shapes may differ across ranks.

    Two forms, told apart by the arguments:

    - ``all_gather(data, group=None)`` (MMEngine's): returns one tensor per rank (index =
      rank), each with that rank's shape, on ``data``'s device.
    - ``all_gather(tensor_list, tensor, group=None, async_op=False)`` (torch's): the first
      argument is a list (or ``tensor_list=`` / ``tensor=`` is passed by name); the
      tensors of the ranks are copied into ``tensor_list`` (``tensor_list[i]`` must have
      rank ``i``'s shape and the dtype); returns None, or a
      [`Work`][comm_collectives.Work] handle with ``async_op=True``.

    The arguments: ``data`` / ``tensor`` is this rank's tensor (the dtype must be the same
    on every rank); ``tensor_list`` one output tensor per rank; ``group`` the process group
    (the default group when None); ``async_op`` (torch's form only) returns a work handle,
    the list is filled after its ``wait()``.

    Raises:
        TypeError: The arguments fit neither form.
        RemoteRankError: A rank's arguments were wrong (a list of the wrong length, a
            tensor of another dtype); raised on every rank.
        CollectiveMismatchError: The dtypes differ across ranks, or ``tensor_list`` does
            not match the shapes the ranks sent (every rank).

    Examples:
        >>> all_gather(torch.arange(3))  # a world of one
        [tensor([0, 1, 2])]
        >>> out = [torch.zeros(3, dtype=torch.int64)]
        >>> all_gather(out, torch.arange(3))
        >>> out
        [tensor([0, 1, 2])]
    """
    torch_form = "tensor_list" in kwargs or "tensor" in kwargs
    torch_form = torch_form or bool(args and isinstance(args[0], (list, tuple)))
    form = ALL_GATHER_TORCH if torch_form else ALL_GATHER_MM
    bound = _bound("all_gather", form, args, kwargs)
    if not torch_form:
        return _all_gather(bound["data"], bound["group"])
    return _all_gather_into(
        bound["tensor_list"], bound["tensor"], bound["group"], bound["async_op"]
    )


def _bound(
    operation: str, form: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``bind``, and when the arguments fit neither form, the TypeError raised on every rank
    (this rank joins the call's handshake with it, so the others do not wait)."""
    try:
        return bind(operation, form, args, kwargs)
    except TypeError as exc:
        given = [kwargs.get("group"), *args]
        group = next((g for g in given if isinstance(g, torch_dist.ProcessGroup)), None)
        if get_world_size(group) > 1:
            handshake(Header(operation, error=exc), group)
        raise


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


def _fill(outputs: Sequence[torch.Tensor], parts: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for out, part in zip(outputs, parts):
            out.copy_(part)


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


def _own(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether torch can write into ``tensor`` directly: contiguous, on ``device``."""
    return tensor.device == device and tensor.is_contiguous() and not tensor.requires_grad


def _local_peer(operation: str, tensor: torch.Tensor) -> Peer:
    return Peer(0, operation, True, str(tensor.dtype), "", -1, tuple(tensor.shape), 0, 0)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@overload
def gather(
    data: torch.Tensor, dst: int = 0, group: torch_dist.ProcessGroup | None = None
) -> list[torch.Tensor]: ...


@overload
def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None,
    dst: int = 0,
    group: torch_dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...


def gather(*args: Any, **kwargs: Any) -> Any:
    """Gather a tensor from every rank on ``dst``; shapes may differ across ranks.

    The tensors travel on the group's communication device (a CUDA device under nccl).
    Two forms, told apart by the arguments:

    - ``gather(data, dst=0, group=None)`` (MMEngine's): returns, on ``dst``, one tensor
      per rank on ``data``'s device; an empty list elsewhere.
    - ``gather(tensor, gather_list, dst=0, group=None, async_op=False)`` (torch's): the
      second positional argument is a list or None (or ``gather_list=`` / ``tensor=`` /
      ``async_op=`` is passed by name). On ``dst`` the tensors are copied into
      ``gather_list`` (entry i with rank i's shape); elsewhere ``gather_list`` is None or
      empty. Returns None, or a [`Work`][comm_collectives.Work] handle with
      ``async_op=True``.

    The arguments: ``data`` / ``tensor`` is this rank's tensor (the dtype must be the same
    on every rank); ``gather_list`` on ``dst`` one output tensor per rank; ``dst`` the
    receiving rank (in ``group``); ``group`` the process group (the default group when
    None); ``async_op`` (torch's form only) returns a work handle.

    Raises:
        TypeError: The arguments fit neither form.
        RemoteRankError: A rank's arguments were wrong; raised on every rank.
        CollectiveMismatchError: Dtypes or ``dst`` differ across ranks, or ``gather_list``
            does not match the shapes sent (every rank).

    Examples:
        >>> gather(torch.tensor([1, 2]))  # a world of one
        [tensor([1, 2])]
        >>> out = [torch.zeros(2, dtype=torch.int64)]
        >>> gather(torch.tensor([1, 2]), out, dst=0)
        >>> out
        [tensor([1, 2])]
    """
    torch_form = any(k in kwargs for k in ("tensor", "gather_list", "async_op"))
    if len(args) >= 2 and (args[1] is None or isinstance(args[1], (list, tuple))):
        torch_form = True
    form = GATHER_TORCH if torch_form else GATHER_MM
    bound = _bound("gather", form, args, kwargs)
    if not torch_form:
        return _gather(bound["data"], bound["dst"], bound["group"])
    return _gather_into(
        bound["tensor"], bound["gather_list"], bound["dst"], bound["group"], bound["async_op"]
    )


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


def broadcast(
    data: torch.Tensor,
    src: int = 0,
    group: torch_dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Copy ``data`` of rank ``src`` into ``data`` of every rank, in place.

    The tensor of ``src`` itself is only read (it may be read-only or an expanded view).

    Args:
        data: The tensor; every rank passes the same shape and dtype.
        src: Sending rank (in ``group``).
        group: Process group; the default group when None.
        async_op: Return a [`Work`][comm_collectives.Work] handle at once; ``data`` holds
            the result after its ``wait()``. The checks still run at the call.

    Returns:
        None; a [`Work`][comm_collectives.Work] handle with ``async_op=True``.

    Raises:
        CollectiveMismatchError: Ranks passed different shapes, dtypes or sources.
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return None
    done = completed_work("broadcast") if async_op else None
    if get_world_size(group) == 1:
        _local_checks("broadcast", data, lambda: _check_root("broadcast", src, group, "src"))
        return done
    me = get_rank(group)
    if not checks_enabled():
        _check_root("broadcast", src, group, "src")
        work = _staged(_plain(data) if me == src else data, get_comm_device(group))
        return _send_broadcast(data, work, src, group, async_op)
    error = _checked("broadcast", data, lambda: _check_root("broadcast", src, group, "src"))
    ok = error is None
    peers = handshake(
        Header(
            "broadcast",
            error=error,
            dtype=data.dtype if ok else None,
            root=src if ok else -1,
            shape=tuple(data.shape) if ok else None,
        ),
        group,
        same=("dtype", "root", "shape"),
        hint="broadcast needs a tensor of the same shape and dtype on every rank.",
        payload=Inline.of_tensor(data) if ok and me == src else None,
        varying=False,
    )
    inline = peers[src].payload
    if inline is not None:
        if me != src:
            write_back(data, inline.view(data.dtype))
        return done
    device = get_comm_device(group)
    try:
        local_fault("staging", "broadcast")
        work = _staged(_plain(data) if me == src else data, device)
    except Exception as exc:
        error = exc
    agree("broadcast", error, group=group)
    return _send_broadcast(data, work, src, group, async_op)


def _send_broadcast(
    data: torch.Tensor,
    work: torch.Tensor,
    src: int,
    group: torch_dist.ProcessGroup | None,
    async_op: bool,
) -> Work | None:
    """Move the staged ``work`` from ``src``, then copy it into ``data`` on the others."""
    with transport("broadcast", group):
        handle = torch_dist.broadcast(
            _as_bytes(work), global_rank(group, src), group=group, async_op=async_op
        )

    def finish() -> None:
        if get_rank(group) != src and work is not data:  # the root's tensor is never written
            write_back(data, work)

    if handle is None:
        finish()
        return None
    return Work("broadcast", group, [handle], finish)


def sync_random_seed(group: torch_dist.ProcessGroup | None = None) -> int:
    """Return one random seed, the same on every rank.

    Rank 0 draws it from the operating system's entropy, so neither numpy's nor torch's
    global random state is touched.

    Returns:
        A seed in ``[0, 2**31)``.
    """
    seed = secrets.randbelow(2**31)
    if get_world_size(group) == 1:
        return seed
    mine = torch.tensor([seed], dtype=torch.int64)
    error = None
    try:
        local_fault("local", "sync_random_seed")
    except Exception as exc:
        error = exc
    peers = handshake(
        Header("sync_random_seed", error=error),
        group,
        payload=Inline.of_tensor(mine) if get_rank(group) == 0 else None,
        varying=False,
    )
    drawn = peers[0].payload
    if drawn is None:  # inline data switched off (_capacity.inline_limit(0))
        drawn = mine.to(get_comm_device(group))
        with transport("sync_random_seed", group):
            torch_dist.broadcast(drawn, global_rank(group, 0), group=group)
    return int(drawn.view(torch.int64)[0])
