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
from typing import Any, cast, overload

import torch
import torch.distributed as torch_dist

from comm_core import get_comm_device, get_rank, get_world_size

from ._faults import transport
from ._forms import ALL_GATHER_MM, ALL_GATHER_TORCH, GATHER_MM, GATHER_TORCH, bind
from ._frame import Header, Inline
from ._gather import _all_gather, _all_gather_into, _gather, _gather_into
from ._handshake import finish_staging, handshake, stages_early
from ._modes import checks_enabled, local_fault
from ._reduce import (
    BackendReduction,
    Reduction,
    backend_reduce,
    check_op_dtype,
    inline_rows,
    prepare_reduction,
    reduce_op_name,
    reduce_rows,
    stage_backend_reduce,
    start_backend_reduce,
    write_back,
)

# re-exported: rooted, objects and results import these from here
from ._staging import _as_bytes as _as_bytes
from ._staging import _check_root as _check_root
from ._staging import _check_tensor as _check_tensor
from ._staging import _checked, _local_checks
from ._staging import _plain as _plain
from ._staging import _staged as _staged
from ._staging import global_rank as global_rank
from .groups import not_member
from .work import Work, completed_work

Staged = Reduction | BackendReduction  # the long path's buffers of an all_reduce

__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "gather",
    "global_rank",
    "sync_random_seed",
]


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
    payload = Inline.of_tensor(data) if ok else None

    # the long path's buffers: the blocking call reduces with comm's own all-to-all (exact,
    # bit-identical to the inline path), the asynchronous one with the backend's all-reduce
    def stage() -> Staged:
        if async_op:
            return stage_backend_reduce(
                [data], name, group, "all_reduce", inplace=True, checked=True
            )
        return prepare_reduction([data], name, group, "all_reduce", in_place=True)

    staged: Staged | None = None
    if payload is not None and stages_early(payload, group):
        try:
            staged = stage()
        except Exception as exc:
            error = exc
    peers = handshake(
        Header(
            "all_reduce",
            error=error,
            dtype=data.dtype if ok else None,
            reduce_op=name or None,
            shape=tuple(data.shape) if ok else None,
            staged=staged is not None,
        ),
        group,
        same=("dtype", "reduce_op", "shape"),
        hint="all_reduce needs the same shape, dtype and op on every rank.",
        payload=payload,
        varying=False,
    )
    rows = inline_rows(peers, data.dtype)
    if rows is not None:
        write_back(data, reduce_rows(torch.stack(rows), name, "all_reduce"))
        return completed_work("all_reduce") if async_op else None
    ready = cast(Staged, finish_staging(peers, group, "all_reduce", staged, stage))
    if isinstance(ready, Reduction):
        write_back(data, ready.run())
        return None
    # checked already: the backend's own all-reduce moves the data in the background
    started, finish = ready.start()
    assert started is not None
    return Work("all_reduce", group, [started], lambda: write_back(data, finish()))


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
    device = get_comm_device(group)

    def stage() -> torch.Tensor:
        local_fault("staging", "broadcast")
        return _staged(_plain(data) if me == src else data, device)

    # the root's tensor decides whether the data rides inline; every rank's tensor has its
    # size, so each can tell (``finish_staging`` mends the rare wrong guess)
    staged: torch.Tensor | None = None
    if ok and stages_early(Inline.of_tensor(data), group):
        try:
            staged = stage()
        except Exception as exc:
            error = exc
    peers = handshake(
        Header(
            "broadcast",
            error=error,
            dtype=data.dtype if ok else None,
            root=src if ok else -1,
            shape=tuple(data.shape) if ok else None,
            staged=staged is not None,
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
    work = finish_staging(peers, group, "broadcast", staged, stage)
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
