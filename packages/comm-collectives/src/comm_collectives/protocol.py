"""The handshake every collective starts with, so that no error on one rank hangs the others.

Before moving data, each collective exchanges one fixed-size header per rank (a single small
``all_gather_into_tensor``). The header says which operation the rank is in, whether its
local work (serialising, validating) succeeded, and the shape, dtype, reduce op or root it
uses. From the headers every rank reaches the same verdict:

- a rank failed locally -> every rank raises :class:`~comm_core.RemoteRankError`;
- ranks disagree (another operation, dtype, shape, root, dict keys) -> every rank raises
  :class:`~comm_core.CollectiveMismatchError` with a per-rank table;
- otherwise the data moves, sized from the headers (uneven shapes need this anyway).

Debug mode (``COMM_DEBUG=1`` or :func:`debug_mode`) adds an exchange of call sites so the
table also shows where each rank made the call.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from comm_core import (
    CollectiveMismatchError,
    RankFailure,
    RemoteRankError,
    get_comm_device,
    get_rank,
    get_world_size,
)

__all__ = [
    "Header",
    "all_gather_flat",
    "debug_enabled",
    "debug_mode",
    "handshake",
    "signature_of",
]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; the packages support >= 2.4.
all_gather_flat = (
    getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor
)

MAX_DIMS = 16
_FIELDS = 8  # op, status, dtype, reduce op, root, ndim, count, signature
_WIDTH = _FIELDS + MAX_DIMS

OPERATIONS = (
    "all_reduce",
    "all_gather",
    "gather",
    "broadcast",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "all_reduce_dict",
    "all_reduce_params",
    "collect_results",
)
REDUCE_OPS = ("sum", "mean", "max", "min", "product")
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)

_debug_depth = 0


def debug_enabled() -> bool:
    """Return True inside :func:`debug_mode` or when ``COMM_DEBUG`` is set to a true value."""
    if _debug_depth > 0:
        return True
    return os.environ.get("COMM_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


@contextlib.contextmanager
def debug_mode() -> Iterator[None]:
    """Check, inside the block, that all ranks make the same collective call.

    Each collective additionally exchanges its call site, so a
    :class:`~comm_core.CollectiveMismatchError` shows where every rank called from. Every
    rank must enter the block at the same point of its program.

    Example:
        >>> with debug_mode():  # doctest: +SKIP
        ...     dist.all_reduce(loss)
    """
    global _debug_depth
    _debug_depth += 1
    try:
        yield
    finally:
        _debug_depth -= 1


def signature_of(parts: Sequence[object]) -> int:
    """Return a 63-bit digest of ``repr(parts)``, equal on every rank for equal parts."""
    digest = hashlib.blake2b(repr(list(parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Header:
    """What one rank announces before a collective.

    Attributes:
        operation: Name from :data:`OPERATIONS`.
        error: The local failure, or None when the rank is ready.
        dtype: Tensor dtype, when the collective carries one.
        reduce_op: Name from :data:`REDUCE_OPS`, for reductions.
        root: ``src`` / ``dst`` for rooted collectives, else -1.
        shape: Tensor shape, when the collective carries one.
        count: Bytes (objects) or elements (tensors) this rank contributes.
        signature: Digest of structure that must match (dict keys, parameter layout).
    """

    operation: str
    error: BaseException | None = None
    dtype: torch.dtype | None = None
    reduce_op: str | None = None
    root: int = -1
    shape: tuple[int, ...] | None = None
    count: int = 0
    signature: int = 0

    def encode(self) -> list[int]:
        shape = self.shape or ()
        ok = self.error is None and len(shape) <= MAX_DIMS
        words = [
            OPERATIONS.index(self.operation),
            0 if ok else 1,
            DTYPES.index(self.dtype) if self.dtype in DTYPES else -1,
            REDUCE_OPS.index(self.reduce_op) if self.reduce_op else -1,
            self.root,
            len(shape) if self.shape is not None else -1,
            self.count,
            self.signature,
        ]
        dims = list(shape[:MAX_DIMS]) + [0] * (MAX_DIMS - min(len(shape), MAX_DIMS))
        return words + dims


@dataclass(frozen=True)
class Peer:
    """A rank's header as decoded by every rank."""

    rank: int
    operation: str
    ok: bool
    dtype: str
    reduce_op: str
    root: int
    shape: tuple[int, ...] | None
    count: int
    signature: int

    def row(self, site: str | None) -> dict[str, object]:
        row: dict[str, object] = {"rank": self.rank, "operation": self.operation}
        if self.shape is not None:
            row["shape"] = tuple(self.shape)
        if self.dtype:
            row["dtype"] = self.dtype
        if self.reduce_op:
            row["op"] = self.reduce_op
        if self.root >= 0:
            row["root"] = self.root
        if site is not None:
            row["call site"] = site
        return row


def _decode(rank: int, words: list[int]) -> Peer:
    op, status, dtype, reduce_op, root, ndim, count, signature = words[:_FIELDS]
    return Peer(
        rank=rank,
        operation=OPERATIONS[op] if 0 <= op < len(OPERATIONS) else f"unknown({op})",
        ok=status == 0,
        dtype=str(DTYPES[dtype]).replace("torch.", "") if dtype >= 0 else "",
        reduce_op=REDUCE_OPS[reduce_op] if reduce_op >= 0 else "",
        root=root,
        shape=tuple(words[_FIELDS : _FIELDS + ndim]) if ndim >= 0 else None,
        count=count,
        signature=signature,
    )


def _call_site() -> str:
    frame = sys._getframe(1)
    package = __name__.rsplit(".", 1)[0]
    while frame is not None and frame.f_globals.get("__name__", "").startswith(package):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return (
        f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
    )


def handshake(
    header: Header,
    group: torch_dist.ProcessGroup | None,
    *,
    same: Sequence[str] = (),
    hint: str = "",
) -> list[Peer]:
    """Exchange headers and raise the same error on every rank when something is wrong.

    Args:
        header: This rank's header.
        group: The process group of the collective.
        same: Fields that must be equal on every rank besides ``operation`` (any of
            ``"dtype"``, ``"reduce_op"``, ``"root"``, ``"shape"``, ``"signature"``).
        hint: How to fix a mismatch, appended to the error.

    Returns:
        Every rank's decoded header, index = rank in ``group``.

    Raises:
        RemoteRankError: A rank's local work failed (raised on every rank).
        CollectiveMismatchError: The ranks disagree (raised on every rank).
    """
    sites: list[str] | None = None
    if debug_enabled():
        gathered: list[object] = [None] * get_world_size(group)
        torch_dist.all_gather_object(gathered, _call_site(), group=group)
        sites = [str(s) for s in gathered]
    device = get_comm_device(group)
    local = torch.tensor(header.encode(), dtype=torch.int64, device=device)
    table = torch.empty(get_world_size(group) * _WIDTH, dtype=torch.int64, device=device)
    all_gather_flat(table, local, group=group)
    peers = [_decode(r, row) for r, row in enumerate(table.view(-1, _WIDTH).cpu().tolist())]

    def rows() -> list[dict[str, object]]:
        return [p.row(sites[p.rank] if sites else None) for p in peers]

    if len({p.operation for p in peers}) > 1:
        problem = "the ranks are in different collectives."
        raise CollectiveMismatchError(
            header.operation,
            problem,
            rows(),
            "every rank must make the same sequence of collective calls; run with "
            "COMM_DEBUG=1 to see each rank's call site.",
        )
    if not all(p.ok for p in peers):
        _raise_remote(header, peers, group)
    for name in same:
        values = {getattr(p, name) for p in peers}
        if len(values) > 1:
            label = "dict keys / tensor layout" if name == "signature" else name
            problem = f"the ranks passed different {label}."
            raise CollectiveMismatchError(header.operation, problem, rows(), hint)
    return peers


def _raise_remote(header: Header, peers: list[Peer], group: torch_dist.ProcessGroup | None) -> None:
    failure: RankFailure | None = None
    if header.error is not None:
        error = header.error
        failure = RankFailure(
            get_rank(group),
            f"{type(error).__module__}.{type(error).__qualname__}",
            str(error),
            "".join(traceback.format_exception(type(error), error, error.__traceback__)),
        )
    elif header.shape is not None and len(header.shape) > MAX_DIMS:
        failure = RankFailure(
            get_rank(group),
            "ValueError",
            f"a tensor of {len(header.shape)} dimensions; collectives take at most {MAX_DIMS}",
        )
    gathered: list[object] = [None] * len(peers)
    torch_dist.all_gather_object(gathered, failure, group=group)
    failures = [f for f in gathered if isinstance(f, RankFailure)]
    error = RemoteRankError(header.operation, failures)
    raise error from header.error
