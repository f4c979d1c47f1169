"""Reductions: the op names, the exact reduction of rank rows, and the two paths of moving them.

``reduce_rows`` reduces every rank's row in rank order (bit-identical on every rank; exact
integer means). The long path (`prepare_reduction`) moves a flat buffer
with an all-to-all and an all-gather after the handshake; `backend_reduce` is the
unchecked path, the backend's own all-reduce. The tensor, dict and parameter collectives
all reduce through here.

One rule of precision holds on every path: values are combined in ``_accumulator(dtype)``
(float32 for the 16- and 8-bit floats, int64 for the integers) and ``_settle`` divides a
mean there and rounds once, back to the dtype. The backend's own reductions therefore move
the sums, means and products of the narrow floats as float32 (``backend_dtype``): a
float16 mean of 40000 on every rank is 40000 although the float16 sum overflows, and a
result out of the dtype's range (a sum or product past 65504 in float16) rounds to inf, as
torch's cast does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as torch_dist

from comm_core import get_comm_device, get_world_size

from ._buffers import empty_bytes
from ._faults import transport
from ._frame import REDUCE_OPS, Peer, inline_payloads
from ._modes import local_fault
from ._route import gather_rows

__all__ = [
    "BackendReduction",
    "Reduction",
    "backend_dtype",
    "backend_reduce",
    "check_op_dtype",
    "inline_rows",
    "prepare_reduction",
    "reduce_op_name",
    "reduce_rows",
    "stage_backend_reduce",
    "start_backend_reduce",
    "write_back",
]


def _torch_op_name(op: object) -> str | None:
    """The name of a torch ``ReduceOp`` (``ReduceOp.SUM``, ``ReduceOp.AVG``, ...), else None."""
    red = torch_dist.ReduceOp
    for member, name in (
        (red.SUM, "sum"),
        (red.AVG, "mean"),
        (red.MAX, "max"),
        (red.MIN, "min"),
        (red.PRODUCT, "product"),
    ):
        try:
            if op == member:
                return name
        except TypeError:
            return None
    return None


def reduce_op_name(op: object) -> str:
    """Return the canonical name of a reduce op, or raise a ValueError listing the valid ones.

    Names (any case) and torch's ``ReduceOp`` values (``SUM``, ``AVG`` = mean, ``MAX``,
    ``MIN``, ``PRODUCT``) are accepted.
    """
    if not isinstance(op, str):
        torch_name = _torch_op_name(op)
        if torch_name is not None:
            return torch_name
    name = op.lower() if isinstance(op, str) else op
    if name not in REDUCE_OPS:
        message = (
            f"Unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)} (or torch's "
            "ReduceOp.SUM, AVG, MAX, MIN, PRODUCT)."
        )
        raise ValueError(message)
    return str(name)


def check_op_dtype(dtype: torch.dtype, op: str, operation: str) -> None:
    """Raise a TypeError when ``op`` is not defined for ``dtype`` (bool sums, complex max)."""
    if dtype == torch.bool and op in ("sum", "mean"):
        message = (
            f"{operation}: op={op!r} is not defined for a bool tensor; use 'max' (any) or "
            "'min' (all), or convert the tensor to an integer dtype."
        )
        raise TypeError(message)
    if dtype.is_complex and op in ("max", "min"):
        message = f"{operation}: op={op!r} is not defined for a complex tensor."
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


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` computes in: wide enough, and the same on every
    path (float32 for the 16- and 8-bit floats, int64 for every integer)."""
    if dtype == torch.bool:
        return torch.uint8
    if dtype.is_complex:
        return torch.complex128 if dtype == torch.complex128 else torch.complex64
    if dtype.is_floating_point:
        return torch.float64 if dtype == torch.float64 else torch.float32
    return torch.int64


def backend_dtype(dtype: torch.dtype, op: str) -> torch.dtype:
    """The dtype the backend's own reduction of ``dtype`` by ``op`` moves and combines in.

    The accumulator (``_accumulator``) where rounding in the dtype would give another
    result than ``reduce_rows``: the sums, means and products of the floats narrower than
    float32 (twice the bytes of float16 or bfloat16 on the wire). Integer means travel as
    int64 sums (made exact by ``_settle``), bools as uint8. Everything else keeps its dtype:
    max and min are exact in any dtype, and an integer sum or product wraps the same way in
    the dtype as in int64 cast back.
    """
    if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        return torch.int64
    if dtype == torch.bool:
        return torch.uint8
    if op in ("sum", "mean", "product") and (dtype.is_floating_point or dtype.is_complex):
        return _accumulator(dtype)
    return dtype


def _settle(
    acc: torch.Tensor,
    op: str,
    world: int,
    dtype: torch.dtype,
    operation: str,
    *,
    exact: bool = True,
) -> torch.Tensor:
    """The end of every reduction: ``acc`` holds the values of ``world`` ranks combined in
    the accumulator (``_accumulator`` or ``backend_dtype``); divide a mean there and round
    once to ``dtype`` (out of its range: inf, as torch's cast). An integer mean is exact or
    a ValueError; with ``exact=False`` its int64 sums are returned for the caller to check.
    May divide ``acc`` in place."""
    if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        return _exact_mean(acc, world, dtype, operation).to(dtype) if exact else acc
    if op == "mean":
        acc.div_(world)
    if dtype == torch.uint64 and acc.dtype == torch.int64:
        return (acc ^ _SIGN if op in ("max", "min") else acc).view(torch.uint64)
    return acc.to(dtype)


_SIGN = -(2**63)  # flips uint64's order into int64's


def _widen(row: torch.Tensor, acc: torch.dtype, op: str) -> torch.Tensor:
    if row.dtype == torch.uint64:  # bit-exact: a view, with the order fixed for max / min
        wide = row.view(torch.int64)
        return wide ^ _SIGN if op in ("max", "min") else wide
    return row.to(acc)


def reduce_rows(rows: torch.Tensor, op: str, operation: str, *, exact: bool = True) -> torch.Tensor:
    """Reduce ``rows`` (one row per rank, in rank order) over its first dimension.

    This is the one reduction of comm-collectives: the inline path applies it to the rows
    gathered in the handshake, the long path to the chunk each rank owns, so both give the
    same bits for every dtype and op. It accumulates in rank order, element by element,
    in ``_accumulator(dtype)``, and rounds once to the dtype at the end. ``mean`` of an
    integer dtype is exact (a ValueError names an inexact element); with ``exact=False``
    it returns the int64 sums instead, for the caller to check once it holds them all.
    """
    world, dtype = rows.shape[0], rows.dtype
    check_op_dtype(dtype, op, operation)
    acc_dtype = _accumulator(dtype)
    acc = _widen(rows[0], acc_dtype, op)
    if world == 1:
        acc = _scratch_copy(acc)
    for index in range(1, world):  # the first step writes into a fresh (cached) buffer
        row = _widen(rows[index], acc_dtype, op)
        out = _empty(acc.numel(), acc.dtype, acc.device).view(acc.shape) if index == 1 else acc
        if op in ("sum", "mean"):
            acc = torch.add(acc, row, out=out)
        elif op == "product" and acc.is_complex():
            acc = _complex_product(acc, row)
        elif op == "product":
            acc = torch.mul(acc, row, out=out)
        elif op == "max":
            acc = torch.maximum(acc, row, out=out)
        else:
            acc = torch.minimum(acc, row, out=out)
    return _settle(acc, op, world, dtype, operation, exact=exact)


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised flat tensor; a large CPU one from the buffer cache (no page faults)."""
    return empty_bytes(numel * dtype.itemsize, device).view(dtype)


def _scratch_copy(row: torch.Tensor) -> torch.Tensor:
    """A copy of ``row`` to accumulate in (a cached buffer when large)."""
    return _empty(row.numel(), row.dtype, row.device).view(row.shape).copy_(row)


def _complex_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b`` in real arithmetic, one rounding per step: a vectorised complex multiply
    may round differently in the body of a loop and in its tail, and then a result would
    depend on where in a buffer an element sits."""
    ar, ai = a.real, a.imag
    br, bi = b.real, b.imag
    return torch.complex(ar * br - ai * bi, ar * bi + ai * br)


def inline_rows(peers: list[Peer], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Each rank's inline data as a flat tensor of ``dtype``; None unless all came inline."""
    payloads = inline_payloads(peers)
    return None if payloads is None else [p.view(dtype) for p in payloads]


class Reduction:
    """The long path of a reduction, prepared (every buffer allocated) before any data moves.

    Each rank owns one chunk of the flat data: an all-to-all hands every rank the others'
    pieces of its chunk, the rank reduces them with ``reduce_rows`` in rank order, and an
    all-gather returns the reduced chunks to every rank. The bytes moved are those of a
    ring all-reduce, and the result is bit-identical to the inline path's. ``parts`` are
    tensors of one dtype (on any devices), reduced as one flat buffer. Large buffers come
    from the cache (``_buffers``); one contiguous tensor on the communication device whose
    size divides into the chunks is sent from its own memory, and with ``in_place`` (a
    caller that writes the result back at once: no all-or-nothing across reductions) the
    result is gathered into it.
    """

    def __init__(
        self,
        parts: list[torch.Tensor],
        op: str,
        group: torch_dist.ProcessGroup | None,
        operation: str,
        in_place: bool = False,
    ) -> None:
        dtype = parts[0].dtype
        check_op_dtype(dtype, op, operation)
        self.dtype, self.op, self.group, self.operation = dtype, op, group, operation
        self.world = get_world_size(group)
        device = get_comm_device(group)
        self.numel = sum(p.numel() for p in parts)
        self.chunk = -(-self.numel // self.world)
        total = self.chunk * self.world
        first = parts[0]
        self.exact = op == "mean" and not (dtype.is_floating_point or dtype.is_complex)
        own = len(parts) == 1 and total == self.numel and _own_buffer(first, device, dtype)
        if own:  # read by the all-to-all, then the gathered result lands in it: no copies
            self.send = first.detach().view(-1)
        else:
            self.send = _empty(total, dtype, device)
            offset = 0
            with torch.no_grad():
                for part in parts:
                    n = part.numel()
                    self.send[offset : offset + n].copy_(part.detach().reshape(-1))
                    offset += n
            if total > self.numel:
                self.send[self.numel :].view(torch.uint8).zero_()
        self.recv = _empty(total, dtype, device)
        if own and in_place and not self.exact:
            self.out = self.send
        else:
            self.out = _empty(total, torch.int64 if self.exact else dtype, device)

    def run(self) -> torch.Tensor:
        """Move the data and return the reduced flat tensor (on the communication device)."""
        if self.numel:
            with transport(self.operation, self.group):
                torch_dist.all_to_all_single(
                    self.recv.view(torch.uint8), self.send.view(torch.uint8), group=self.group
                )
            rows = self.recv.view(self.world, self.chunk)
            mine = reduce_rows(rows, self.op, self.operation, exact=False).contiguous()
            with transport(self.operation, self.group):
                _gather_chunks(self.out, mine, self.group)
        result = self.out[: self.numel]
        if self.exact:
            result = _exact_mean(result, self.world, self.dtype, self.operation)
        return result


def _gather_chunks(
    out: torch.Tensor, mine: torch.Tensor, group: torch_dist.ProcessGroup | None
) -> None:
    """Every rank's reduced chunk ``mine`` into ``out``, in rank order (``gather_rows``; the
    CPU's copies of ``mine`` in a cached buffer)."""
    copies = _empty(out.numel(), out.dtype, out.device) if out.device.type == "cpu" else None
    gather_rows(
        out.view(torch.uint8),
        mine.view(torch.uint8),
        group,
        copies=None if copies is None else copies.view(torch.uint8),
    )


_TORCH_OPS = {
    "sum": torch_dist.ReduceOp.SUM,
    "mean": torch_dist.ReduceOp.SUM,
    "max": torch_dist.ReduceOp.MAX,
    "min": torch_dist.ReduceOp.MIN,
    "product": torch_dist.ReduceOp.PRODUCT,
}


def backend_reduce(
    parts: list[torch.Tensor], op: str, group: torch_dist.ProcessGroup | None, operation: str
) -> torch.Tensor:
    """Reduce ``parts`` (one dtype) as one flat buffer with the backend's own all-reduce.

    The unchecked path: no handshake, the backend's reduction order. Integer means stay
    exact (int64 sums, checked on every rank); bools reduce as uint8; the narrow floats'
    sums, means and products in float32 (``backend_dtype``), rounded once by ``_settle``.
    """
    handle, finish = start_backend_reduce(parts, op, group, operation)
    with transport(operation, group):
        handle.wait()
    return finish()


def start_backend_reduce(
    parts: list[torch.Tensor],
    op: str,
    group: torch_dist.ProcessGroup | None,
    operation: str,
    dst: int = -1,
    *,
    inplace: bool = False,
) -> tuple[torch_dist.Work, Callable[[], torch.Tensor]]:
    """Start the backend's own all-reduce of ``parts`` (or its reduce to ``dst``, a rank of
    the group's global numbering, when ``dst >= 0``); return its handle and the function
    that, once it has finished, returns the reduced flat tensor (integer means made exact,
    raising a ValueError when one is not). The unchecked path: staging and start in one.
    """
    handle, finish = stage_backend_reduce(parts, op, group, operation, inplace=inplace).start(dst)
    assert handle is not None
    return handle, finish


def stage_backend_reduce(
    parts: list[torch.Tensor],
    op: str,
    group: torch_dist.ProcessGroup | None,
    operation: str,
    *,
    inplace: bool = False,
    checked: bool = False,
) -> BackendReduction:
    """The data of the backend's own reduction of ``parts``, staged and ready to start.

    It may raise (a device move, an allocation): the checked paths (``checked``) stage
    before the handshake and send the failure in their header. With ``inplace`` a single
    part already contiguous on the communication device in its own dtype is reduced in its
    own memory (as torch does); the result is then a view of it.
    """
    if checked:
        local_fault("staging", operation)
    return BackendReduction(parts, op, group, operation, inplace)


class BackendReduction:
    """A flat buffer staged for the backend's own all-reduce or reduce (see
    ``stage_backend_reduce``); ``start`` moves the data."""

    def __init__(
        self,
        parts: list[torch.Tensor],
        op: str,
        group: torch_dist.ProcessGroup | None,
        operation: str,
        inplace: bool,
    ) -> None:
        dtype = parts[0].dtype
        check_op_dtype(dtype, op, operation)
        device = get_comm_device(group)
        self.wire = backend_dtype(dtype, op)  # the accumulator where the dtype would round
        self.dtype, self.op, self.group, self.operation = dtype, op, group, operation
        first = parts[0]
        # an integer mean is summed apart: an inexact one leaves the tensor unchanged
        exact = op == "mean" and not (dtype.is_floating_point or dtype.is_complex)
        if inplace and not exact and len(parts) == 1 and _own_buffer(first, device, self.wire):
            self.work = first.detach().view(-1)
        elif len(parts) == 1:  # a cached buffer (no page faults); copy_ converts the dtype
            flat = first.detach().reshape(-1)
            self.work = _empty(flat.numel(), self.wire, device).copy_(flat)
        else:
            self.work = torch.cat(
                [p.detach().reshape(-1).to(device=device, dtype=self.wire) for p in parts]
            )

    def start(
        self, dst: int = -1, *, async_op: bool = True
    ) -> tuple[torch_dist.Work | None, Callable[[], torch.Tensor]]:
        """Start the reduction (to ``dst``, a global rank, when ``dst >= 0``); return its
        handle and the function that returns the result once it has finished. Without
        ``async_op`` the data has moved on return and the handle is None (the backend's
        blocking call: no hand-over to Python between its start and its wait)."""
        work, group = self.work, self.group
        torch_op = _TORCH_OPS[self.op]
        with transport(self.operation, group):
            if dst >= 0:
                handle = torch_dist.reduce(work, dst, torch_op, group=group, async_op=async_op)
            else:
                handle = torch_dist.all_reduce(work, torch_op, group=group, async_op=async_op)

        def finish() -> torch.Tensor:
            return _settle(work, self.op, get_world_size(group), self.dtype, self.operation)

        return handle, finish


def _own_buffer(tensor: torch.Tensor, device: torch.device, wire: torch.dtype) -> bool:
    return tensor.device == device and tensor.dtype == wire and tensor.is_contiguous()


def prepare_reduction(
    parts: list[torch.Tensor],
    op: str,
    group: torch_dist.ProcessGroup | None,
    operation: str,
    *,
    in_place: bool = False,
) -> Reduction:
    """Allocate the long path of reducing ``parts`` as one flat buffer (see ``Reduction``).

    It may raise (a device move, an allocation): the caller sends the error in its header
    (``_handshake.stages_early``) or passes it to [`agree`][comm_collectives.agree], before
    any data moves.
    """
    local_fault("staging", operation)
    return Reduction(parts, op, group, operation, in_place)


def write_back(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy a reduced flat tensor into ``tensor`` (no autograd: a leaf may require grad);
    nothing to do when ``flat`` is ``tensor``'s own memory (an in-place reduction)."""
    if flat.data_ptr() == tensor.data_ptr() and flat.numel() == tensor.numel() > 0:
        return
    with torch.no_grad():
        tensor.copy_(flat.view(tensor.shape))
