"""Rooted tensor collectives of torch.distributed: reduce (to ``dst``) and scatter (from ``src``).

Both start with the handshake of ``comm_collectives._handshake``: every rank's shape, dtype,
op and root, and every rank's argument errors (a scatter list of the wrong length or with
tensors of another shape on the root) are known to every rank before data moves, so a
mistake on one rank raises on all of them. Small data rides in the handshake frame; larger
data moves with the backend's own ``reduce`` / ``scatter`` afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist

from comm_core import get_comm_device, get_rank, get_world_size

from ._faults import transport
from ._frame import Header, Inline
from ._handshake import finish_staging, handshake, stages_early
from ._modes import checks_enabled, local_fault
from ._reduce import (
    BackendReduction,
    check_op_dtype,
    inline_rows,
    reduce_op_name,
    reduce_rows,
    stage_backend_reduce,
    write_back,
)
from .groups import not_member
from .tensors import _as_bytes, _check_root, _check_tensor, _plain, _staged, global_rank
from .work import Work, completed_work

__all__ = ["reduce", "scatter"]


def reduce(
    tensor: torch.Tensor,
    dst: int = 0,
    op: str | torch_dist.ReduceOp | torch_dist.ReduceOp.RedOpType = "sum",
    group: torch_dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` of every rank into ``tensor`` of rank ``dst``, in place.

    As with torch, the other ranks' tensors are the backend's workspace: a tensor too large
    to travel in the handshake (more than a few KB) may hold partial results afterwards on
    a rank other than ``dst`` (clone it first if you need it). Copying it away would cost a
    pass over the data on every rank; a small tensor that rides in the handshake (in a
    world of up to 64 ranks) is left unchanged.

    Args:
        tensor: The tensor; every rank passes the same shape and dtype.
        dst: Receiving rank (in ``group``).
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"`` (case-insensitive),
            or torch's ``ReduceOp.SUM``, ``AVG``, ``MAX``, ``MIN``, ``PRODUCT``. The mean of
            an integer tensor is exact, or a ValueError.
        group: Process group; the default group when None.
        async_op: Return a [`Work`][comm_collectives.Work] handle at once; ``tensor`` of
            ``dst`` holds the result after its ``wait()``. The checks run at the call.

    Returns:
        None; a [`Work`][comm_collectives.Work] handle with ``async_op=True``.

    Raises:
        RemoteRankError: A rank passed a bad argument (unknown op, not a tensor, a ``dst``
            outside the group); raised on every rank.
        CollectiveMismatchError: Ranks passed different shapes, dtypes, ops or ``dst``.
        ValueError: On ``dst`` only (the others hold no result): an integer ``mean`` that
            is not an integer; ``tensor`` is left unchanged there. With ``async_op=True``
            on the long path, at ``wait()``.

    Examples:
        >>> t = torch.tensor([2.0, 4.0])
        >>> reduce(t, dst=0, op="mean")  # a world of one: unchanged
        >>> t
        tensor([2., 4.])
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return None
    done = completed_work("reduce") if async_op else None
    if get_world_size(group) == 1:
        name = reduce_op_name(op)
        _check_tensor("reduce", tensor)
        _check_root("reduce", dst, group, "dst")
        check_op_dtype(tensor.dtype, name, "reduce")
        return done
    me = get_rank(group)
    if not checks_enabled():
        name = reduce_op_name(op)
        _check_root("reduce", dst, group, "dst")
        unchecked = stage_backend_reduce([tensor], name, group, "reduce", inplace=True)
        return _start(tensor, unchecked, dst, group, async_op)
    name, error = "", None
    staged: BackendReduction | None = None
    try:
        name = reduce_op_name(op)
        _check_tensor("reduce", tensor)
        _check_root("reduce", dst, group, "dst")
        check_op_dtype(tensor.dtype, name, "reduce")
        local_fault("local", "reduce")
    except Exception as exc:
        error = exc
    ok = error is None
    payload = Inline.of_tensor(tensor) if ok else None
    if payload is not None and stages_early(payload, group):
        try:
            staged = _stage(tensor, name, group)
        except Exception as exc:
            error = exc
    peers = handshake(
        Header(
            "reduce",
            error=error,
            dtype=tensor.dtype if ok else None,
            reduce_op=name or None,
            root=dst if ok else -1,
            shape=tuple(tensor.shape) if ok else None,
            staged=staged is not None,
        ),
        group,
        same=("dtype", "reduce_op", "root", "shape"),
        hint="reduce needs the same shape, dtype, op and dst on every rank.",
        payload=payload,
        varying=False,
    )
    rows = inline_rows(peers, tensor.dtype)
    if rows is not None:
        if me == dst:
            write_back(tensor, reduce_rows(torch.stack(rows), name, "reduce"))
        return done
    staged = finish_staging(peers, group, "reduce", staged, lambda: _stage(tensor, name, group))
    return _start(tensor, staged, dst, group, async_op)


def _stage(
    tensor: torch.Tensor, name: str, group: torch_dist.ProcessGroup | None
) -> BackendReduction:
    """``tensor`` staged for the backend's reduce: every rank reduces in ``tensor``'s own
    memory when it can, as torch does (the other ranks' tensors are the backend's
    workspace)."""
    return stage_backend_reduce([tensor], name, group, "reduce", inplace=True, checked=True)


def _start(
    tensor: torch.Tensor,
    staged: BackendReduction,
    dst: int,
    group: torch_dist.ProcessGroup | None,
    async_op: bool,
) -> Work | None:
    """The backend's reduce to ``dst`` of the staged data; the result is written into
    ``tensor`` on ``dst`` only."""
    handle, result = staged.start(global_rank(group, dst), async_op=async_op)

    def finish() -> None:
        if get_rank(group) == dst:
            write_back(tensor, result())

    if handle is None:
        finish()
        return None
    return Work("reduce", group, [handle], finish)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: torch_dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Copy ``scatter_list[i]`` of rank ``src`` into ``tensor`` of rank ``i``.

    Args:
        tensor: This rank's output; the same shape and dtype on every rank.
        scatter_list: On ``src``, one tensor per rank of the group, each of ``tensor``'s
            shape and dtype; None (or empty) on the other ranks.
        src: Sending rank (in ``group``).
        group: Process group; the default group when None.
        async_op: Return a [`Work`][comm_collectives.Work] handle at once; ``tensor``
            holds the result after its ``wait()``. The checks run at the call.

    Returns:
        None; a [`Work`][comm_collectives.Work] handle with ``async_op=True``.

    Raises:
        RemoteRankError: ``scatter_list`` on ``src`` has the wrong length or a tensor of
            another shape or dtype, another rank passed one, or an argument is not a
            tensor; raised on every rank, naming the rank.
        CollectiveMismatchError: Ranks passed outputs of different shapes or dtypes, or
            different ``src``.

    Examples:
        >>> out = torch.zeros(2)
        >>> scatter(out, [torch.tensor([1.0, 2.0])], src=0)  # a world of one
        >>> out
        tensor([1., 2.])
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return None
    world = get_world_size(group)
    done = completed_work("scatter") if async_op else None

    def check() -> None:
        _check_tensor("scatter", tensor)
        _check_root("scatter", src, group, "src")
        _check_scatter_list(tensor, scatter_list, src, group, world)

    if world == 1:
        check()
        assert scatter_list is not None
        write_back(tensor, scatter_list[0].reshape(-1))
        return done
    me = get_rank(group)
    error = None
    try:
        check()
        local_fault("local", "scatter")
    except Exception as exc:
        error = exc
    ok = error is None
    device = get_comm_device(group)
    payload = _inline_list(scatter_list) if ok and me == src and scatter_list else None
    # the root's list (one output a rank) decides whether the data rides inline; every
    # rank guesses it from its output's size, and ``finish_staging`` mends a wrong guess
    staged: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None

    def stage() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        local_fault("staging", "scatter")
        sends = None
        if me == src:
            assert scatter_list is not None
            sends = [_as_bytes(_staged(_plain(t), device)) for t in scatter_list]
        return _staged(tensor, device), sends

    if ok and stages_early(
        Inline(tensor.numel() * tensor.element_size() * world, _no_write, tensor.device), group
    ):
        try:
            staged = stage()
        except Exception as exc:
            error = exc
    peers = handshake(
        Header(
            "scatter",
            error=error,
            dtype=tensor.dtype if ok else None,
            root=src if ok else -1,
            shape=tuple(tensor.shape) if ok else None,
            staged=staged is not None,
        ),
        group,
        same=("dtype", "root", "shape"),
        hint="scatter needs an output tensor of the same shape and dtype on every rank.",
        payload=payload,
        varying=False,
    )
    inline = peers[src].payload
    if inline is not None:
        nbytes = tensor.numel() * tensor.element_size()
        write_back(tensor, inline[me * nbytes : (me + 1) * nbytes].view(tensor.dtype))
        return done
    work, sends = finish_staging(peers, group, "scatter", staged, stage)
    with transport("scatter", group):
        handle = torch_dist.scatter(
            _as_bytes(work), sends, src=global_rank(group, src), group=group, async_op=async_op
        )

    def finish() -> None:
        if work is not tensor:
            write_back(tensor, work)

    if handle is None:
        finish()
        return None
    return Work("scatter", group, [handle], finish)


def _check_scatter_list(
    tensor: torch.Tensor,
    scatter_list: object,
    src: int,
    group: torch_dist.ProcessGroup | None,
    world: int,
) -> None:
    """The root's list: ``world`` tensors of ``tensor``'s shape and dtype; None elsewhere."""
    me = get_rank(group)
    if me != src:
        if scatter_list:
            message = (
                f"scatter: scatter_list must be None (or empty) on rank {me}, which is not the "
                f"source (src={src}); only src sends."
            )
            raise ValueError(message)
        return
    if not isinstance(scatter_list, (list, tuple)):
        message = (
            f"scatter: on the source rank {src}, scatter_list must be a list of {world} "
            f"tensors, got {type(scatter_list).__name__}."
        )
        raise TypeError(message)
    if len(scatter_list) != world:
        message = (
            f"scatter: scatter_list on the source rank {src} must hold one tensor per rank "
            f"of the group ({world}), got {len(scatter_list)}."
        )
        raise ValueError(message)
    for index, item in enumerate(scatter_list):
        if not isinstance(item, torch.Tensor):
            message = (
                f"scatter: scatter_list[{index}] must be a torch.Tensor, got {type(item).__name__}."
            )
            raise TypeError(message)
        if item.shape != tensor.shape or item.dtype != tensor.dtype:
            message = (
                f"scatter: scatter_list[{index}] has shape {tuple(item.shape)} and dtype "
                f"{item.dtype}; every entry must have the output tensor's shape "
                f"{tuple(tensor.shape)} and dtype {tensor.dtype}."
            )
            raise ValueError(message)


def _no_write(out: torch.Tensor) -> None:
    """An ``Inline`` that only tells a size (never written)."""


def _inline_list(scatter_list: list[torch.Tensor]) -> Inline:
    """The root's whole list as one inline payload (each receiver takes its slice)."""
    first = scatter_list[0]
    each = first.numel() * first.element_size()

    def write(out: torch.Tensor) -> None:
        for index, item in enumerate(scatter_list):
            if each:
                piece = out[index * each : (index + 1) * each]
                piece.view(item.dtype).view(item.shape).copy_(item.detach())

    return Inline(each * len(scatter_list), write, first.device)
