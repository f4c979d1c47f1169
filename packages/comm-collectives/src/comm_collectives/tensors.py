"""Tensor collectives: all_reduce, all_gather, gather, broadcast and sync_random_seed.

Each moves the data to the communication device of the group and back, keeps the caller's
dtype and device, works in a plain process (a world of one), and starts with the handshake
of ``comm_collectives.protocol``, so a mismatch raises on every rank instead of hanging.
Data that fits the handshake frame travels inside it: one collective in all, and a small
reduction is then done locally in rank order, so every rank gets bit-identical results.
"""

from __future__ import annotations

import secrets

import torch
import torch.distributed as torch_dist

from comm_core import get_comm_device, get_rank, get_world_size

from .buffers import empty_bytes
from .protocol import (
    REDUCE_OPS,
    Header,
    Inline,
    Peer,
    all_gather_flat,
    handshake,
    inline_payloads,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "gather",
    "global_rank",
    "reduce_inplace",
    "reduce_op_name",
    "sync_random_seed",
]

_TORCH_OPS = {
    "sum": torch_dist.ReduceOp.SUM,
    "mean": torch_dist.ReduceOp.SUM,
    "max": torch_dist.ReduceOp.MAX,
    "min": torch_dist.ReduceOp.MIN,
    "product": torch_dist.ReduceOp.PRODUCT,
}


def reduce_op_name(op: str) -> str:
    """Return the canonical name of a reduce op, or raise a ValueError listing the valid ones."""
    name = op.lower() if isinstance(op, str) else op
    if name not in REDUCE_OPS:
        message = f"Unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)}."
        raise ValueError(message)
    return str(name)


def global_rank(group: torch_dist.ProcessGroup | None, rank: int) -> int:
    """Translate a rank of ``group`` into the global rank torch's rooted calls expect."""
    if group is None or group is torch_dist.group.WORLD:
        return rank
    return int(torch_dist.get_global_rank(group, rank))


def _check_root(name: str, root: int, group: torch_dist.ProcessGroup | None, what: str) -> None:
    world = get_world_size(group)
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


def _check_bool_op(dtype: torch.dtype, op: str, operation: str) -> None:
    if dtype == torch.bool and op in ("sum", "mean"):
        message = (
            f"{operation}: op={op!r} is not defined for a bool tensor; use 'max' (any) or "
            "'min' (all), or convert the tensor to an integer dtype."
        )
        raise TypeError(message)


def _exact_mean(sums: torch.Tensor, world: int, dtype: torch.dtype, operation: str) -> torch.Tensor:
    """``sums / world`` for integer sums (int64), or a ValueError when one is not exact."""
    quotient = torch.div(sums, world, rounding_mode="floor")
    inexact = quotient * world != sums
    if bool(inexact.any()):
        first = int(inexact.reshape(-1).nonzero()[0])
        total = int(sums.reshape(-1)[first])
        message = (
            f"{operation}(op='mean') on a {dtype} tensor: the mean is not an integer "
            f"for {int(inexact.sum())} of {sums.numel()} elements (element {first}: sum "
            f"{total} over {world} ranks = {total / world}). The tensor is left unchanged; "
            "convert it to a floating dtype first, e.g. data = data.float()."
        )
        raise ValueError(message)
    return quotient


def reduce_rows(rows: torch.Tensor, op: str, operation: str) -> torch.Tensor:
    """Reduce ``rows`` (one row per rank, in rank order) over its first dimension.

    The local counterpart of ``reduce_inplace`` for data gathered inline: the same
    ops, the same exact integer mean, the same errors.
    """
    world, dtype = rows.shape[0], rows.dtype
    _check_bool_op(dtype, op, operation)
    work = rows.to(torch.uint8) if dtype == torch.bool else rows
    if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        return _exact_mean(work.sum(0, dtype=torch.int64), world, dtype, operation)
    if op in ("sum", "mean"):
        result = work.sum(0, dtype=work.dtype)
        return result.div_(world) if op == "mean" else result
    if op == "product":
        return work.prod(0, dtype=work.dtype)
    return work.amax(0) if op == "max" else work.amin(0)


def _inline_rows(peers: list[Peer], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Each rank's inline data as a flat tensor of ``dtype``; None unless all came inline."""
    payloads = inline_payloads(peers)
    return None if payloads is None else [p.view(dtype) for p in payloads]


def reduce_inplace(
    tensor: torch.Tensor, op: str, group: torch_dist.ProcessGroup | None, operation: str
) -> None:
    """Reduce ``tensor`` across ``group`` in place, with no handshake (the caller did it).

    ``mean`` of an integer tensor is exact: the sums are reduced in int64 and the result is
    stored only when every element divides evenly; otherwise a ValueError (the same on every
    rank, since every rank holds the same sums) leaves ``tensor`` untouched.
    """
    world = get_world_size(group)
    device = get_comm_device(group)
    exact_mean = op == "mean" and not (tensor.is_floating_point() or tensor.is_complex())
    _check_bool_op(tensor.dtype, op, operation)
    if tensor.dtype == torch.bool:
        work = tensor.to(device=device, dtype=torch.uint8)
    elif exact_mean:
        work = tensor.to(device=device, dtype=torch.int64, copy=True)
    else:
        work = _staged(tensor, device)
    if world > 1:
        torch_dist.all_reduce(work, _TORCH_OPS[op], group=group)
    if exact_mean:
        work = _exact_mean(work, world, tensor.dtype, operation)
    elif op == "mean":
        work.div_(world)
    if work is not tensor:
        tensor.copy_(work)


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
    name = reduce_op_name(op)
    if get_world_size(group) == 1:
        return
    peers = handshake(
        Header("all_reduce", dtype=data.dtype, reduce_op=name, shape=tuple(data.shape)),
        group,
        same=("dtype", "reduce_op", "shape"),
        hint="all_reduce needs the same shape, dtype and op on every rank.",
        payload=Inline.of_tensor(data),
    )
    rows = _inline_rows(peers, data.dtype)
    if rows is None:
        reduce_inplace(data, name, group, "all_reduce")
    else:
        data.copy_(reduce_rows(torch.stack(rows), name, "all_reduce").view(data.shape))


def _gather_layout(
    operation: str, data: torch.Tensor, group: torch_dist.ProcessGroup | None, root: int = -1
) -> tuple[list[tuple[int, ...]], list[torch.Tensor] | None]:
    """Every rank's shape, and every rank's tensor when all came inline (else None)."""
    peers = handshake(
        Header(operation, dtype=data.dtype, root=root, shape=tuple(data.shape), count=data.numel()),
        group,
        same=("dtype", "root"),
        hint=f"{operation} accepts different shapes but needs one dtype and one root.",
        payload=Inline.of_tensor(data),
    )
    shapes = [p.shape or () for p in peers]
    rows = _inline_rows(peers, data.dtype)
    if rows is None:
        return shapes, None
    # copies: a result must not keep the whole handshake table alive
    return shapes, [r.view(s).to(data.device, copy=True) for r, s in zip(rows, shapes)]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: gloo moves bytes of any dtype."""
    return tensor.reshape(-1).view(torch.uint8)


def _padded_send(data: torch.Tensor, device: torch.device, width: int) -> torch.Tensor:
    """The bytes of ``data`` on ``device``, zero-padded to ``width`` elements."""
    flat = _as_bytes(data.detach().to(device).contiguous())
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
        return [data]
    shapes, inline = _gather_layout("all_gather", data, group)
    if inline is not None:
        return inline
    device = get_comm_device(group)
    width = max(_numel(s) for s in shapes)
    if width == 0:
        return [torch.empty(s, dtype=data.dtype, device=data.device) for s in shapes]
    send = _padded_send(data, device, width)
    out = empty_bytes(len(shapes) * send.numel(), device)
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
    _check_root("gather", dst, group, "dst")
    if get_world_size(group) == 1:
        return [data]
    shapes, inline = _gather_layout("gather", data, group, root=dst)
    me = get_rank(group)
    if inline is not None:
        return inline if me == dst else []
    device = get_comm_device(group)
    width = max(_numel(s) for s in shapes)
    if width == 0:
        return (
            [torch.empty(s, dtype=data.dtype, device=data.device) for s in shapes]
            if me == dst
            else []
        )
    send = _padded_send(data, device, width)
    if me == dst:
        out = empty_bytes(len(shapes) * send.numel(), device)
        rows = list(out.view(len(shapes), -1).unbind(0))
        torch_dist.gather(send, rows, dst=global_rank(group, dst), group=group)
        return _split(out, shapes, data.dtype, data.device)
    torch_dist.gather(send, None, dst=global_rank(group, dst), group=group)
    return []


def broadcast(
    data: torch.Tensor, src: int = 0, group: torch_dist.ProcessGroup | None = None
) -> None:
    """Copy ``data`` of rank ``src`` into ``data`` of every rank, in place.

    Args:
        data: The tensor; every rank passes the same shape and dtype.
        src: Sending rank (in ``group``).
        group: Process group; the default group when None.

    Raises:
        CollectiveMismatchError: Ranks passed different shapes, dtypes or sources.
    """
    _check_root("broadcast", src, group, "src")
    if get_world_size(group) == 1:
        return
    me = get_rank(group)
    peers = handshake(
        Header("broadcast", dtype=data.dtype, root=src, shape=tuple(data.shape)),
        group,
        same=("dtype", "root", "shape"),
        hint="broadcast needs a tensor of the same shape and dtype on every rank.",
        payload=Inline.of_tensor(data) if me == src else None,
    )
    inline = peers[src].payload
    if inline is not None:
        if me != src:
            data.copy_(inline.view(data.dtype).view(data.shape))
        return
    device = get_comm_device(group)
    work = _staged(data, device)
    torch_dist.broadcast(_as_bytes(work), global_rank(group, src), group=group)
    if work is not data:
        data.copy_(work)


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
    peers = handshake(
        Header("sync_random_seed"),
        group,
        payload=Inline.of_tensor(mine) if get_rank(group) == 0 else None,
    )
    drawn = peers[0].payload
    if drawn is None:  # inline data switched off (protocol.inline_limit(0))
        drawn = mine.to(get_comm_device(group))
        torch_dist.broadcast(drawn, global_rank(group, 0), group=group)
    return int(drawn.view(torch.int64)[0])
