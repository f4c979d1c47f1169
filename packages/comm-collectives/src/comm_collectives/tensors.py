"""Tensor collectives: all_reduce, all_gather, gather, broadcast and sync_random_seed.

Each moves the data to the communication device of the group and back, keeps the caller's
dtype and device, works in a plain process (a world of one), and starts with the handshake
of ``comm_collectives._handshake``, so a mismatch raises on every rank instead of hanging.
Data that fits the handshake frame travels inside it: one collective in all, and a small
reduction is then done locally in rank order, so every rank gets bit-identical results.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import torch
import torch.distributed as torch_dist

from comm_core import get_comm_device, get_rank, get_world_size

from ._agree import agree
from ._buffers import empty_bytes
from ._faults import transport
from ._frame import Header, Inline
from ._handshake import handshake
from ._modes import checks_enabled, local_fault
from ._reduce import (
    backend_reduce,
    check_op_dtype,
    inline_rows,
    reduce_inplace,
    reduce_op_name,
    reduce_rows,
    write_back,
)
from ._route import all_gather_flat

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
    data: torch.Tensor, op: str = "sum", group: torch_dist.ProcessGroup | None = None
) -> None:
    """Reduce ``data`` across all ranks, in place.

    Args:
        data: The tensor; every rank passes the same shape and dtype.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"`` (case-insensitive).
        group: Process group; the default group when None.

    Raises:
        ValueError: Unknown op, or an integer mean that is not an integer (data unchanged).
        CollectiveMismatchError: Ranks passed different shapes, dtypes or ops.

    Examples:
        >>> t = torch.tensor([1, 3])
        >>> all_reduce(t, op="mean")  # a world of one: unchanged
        >>> t
        tensor([1, 3])
    """
    if get_world_size(group) == 1:
        reduce_op_name(op)
        _check_tensor("all_reduce", data)
        return
    if not checks_enabled():
        write_back(data, backend_reduce([data], reduce_op_name(op), group, "all_reduce"))
        return
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
    if rows is None:
        reduce_inplace(data, name, group, "all_reduce")
    else:
        write_back(data, reduce_rows(torch.stack(rows), name, "all_reduce"))


def _gather_layout(
    operation: str,
    data: torch.Tensor,
    group: torch_dist.ProcessGroup | None,
    root: int = -1,
    error: BaseException | None = None,
    keep: bool = True,
) -> tuple[list[tuple[int, ...]], list[torch.Tensor] | None]:
    """Every rank's shape, and every rank's tensor when all came inline (else None; an
    empty list when they came inline but ``keep`` is False: a rank that returns nothing
    copies nothing)."""
    ok = error is None
    peers = handshake(
        Header(
            operation,
            error=error,
            dtype=data.dtype if ok else None,
            root=root if ok else -1,
            shape=tuple(data.shape) if ok else None,
            count=data.numel() if ok else 0,
        ),
        group,
        same=("dtype", "root"),
        hint=f"{operation} accepts different shapes but needs one dtype and one root.",
        payload=Inline.of_tensor(data) if ok else None,
    )
    shapes = [p.shape or () for p in peers]
    rows = inline_rows(peers, data.dtype)
    if rows is None:
        return shapes, None
    if not keep:
        return shapes, []
    # copies: a result must not keep the whole handshake table alive
    return shapes, [r.view(s).to(data.device, copy=True) for r, s in zip(rows, shapes)]


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
    return tensor.reshape(-1).view(torch.uint8)


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


def all_gather(
    data: torch.Tensor, group: torch_dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Gather ``data`` from every rank; shapes may differ across ranks.

    Args:
        data: This rank's tensor; dtype must be the same on every rank.
        group: Process group; the default group when None.

    Returns:
        One tensor per rank (index = rank), each with that rank's shape, on ``data``'s device.

    Examples:
        >>> all_gather(torch.arange(3))  # a world of one
        [tensor([0, 1, 2])]
    """
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def gather(
    data: torch.Tensor, dst: int = 0, group: torch_dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Gather ``data`` from every rank on ``dst``; shapes may differ across ranks.

    The tensors travel on the group's communication device (a CUDA device under nccl).

    Args:
        data: This rank's tensor; dtype must be the same on every rank.
        dst: Receiving rank (in ``group``).
        group: Process group; the default group when None.

    Returns:
        On ``dst`` one tensor per rank on ``data``'s device; an empty list elsewhere.
    """
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


def broadcast(
    data: torch.Tensor, src: int = 0, group: torch_dist.ProcessGroup | None = None
) -> None:
    """Copy ``data`` of rank ``src`` into ``data`` of every rank, in place.

    The tensor of ``src`` itself is only read (it may be read-only or an expanded view).

    Args:
        data: The tensor; every rank passes the same shape and dtype.
        src: Sending rank (in ``group``).
        group: Process group; the default group when None.

    Raises:
        CollectiveMismatchError: Ranks passed different shapes, dtypes or sources.
    """
    if get_world_size(group) == 1:
        _local_checks("broadcast", data, lambda: _check_root("broadcast", src, group, "src"))
        return
    if not checks_enabled():
        _check_root("broadcast", src, group, "src")
        work = _staged(_plain(data) if get_rank(group) == src else data, get_comm_device(group))
        with transport("broadcast", group):
            torch_dist.broadcast(_as_bytes(work), global_rank(group, src), group=group)
        if get_rank(group) != src and work is not data:
            write_back(data, work)
        return
    error = _checked("broadcast", data, lambda: _check_root("broadcast", src, group, "src"))
    me = get_rank(group)
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
        return
    device = get_comm_device(group)
    try:
        local_fault("staging", "broadcast")
        work = _staged(_plain(data) if me == src else data, device)
    except Exception as exc:
        error = exc
    agree("broadcast", error, group=group)
    with transport("broadcast", group):
        torch_dist.broadcast(_as_bytes(work), global_rank(group, src), group=group)
    if me != src and work is not data:  # the root's own tensor is never written
        write_back(data, work)


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
