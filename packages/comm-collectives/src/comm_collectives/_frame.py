"""The wire format of the handshake: one fixed-size frame per rank, pure code.

A frame is a header of ``WIDTH`` 64-bit words (256 bytes: the fields, up to ``MAX_DIMS``
dimensions, padding that keeps inline payloads 64-byte aligned) followed by the group's
inline capacity of payload bytes. The first header word carries a magic number and the
wire-protocol ``VERSION``: ranks running incompatible versions of comm-collectives get a
clear error instead of a misread frame. Dtypes travel as stable codes (a digest of their
name), so every torch dtype has one and an unknown code is never a match.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from comm_core import CollectiveMismatchError

__all__ = [
    "DEBUG_BIT",
    "DEBUG_WORD",
    "HEADER_BYTES",
    "MAX_DIMS",
    "OPERATIONS",
    "REDUCE_OPS",
    "SIGNIFICANT_WORDS",
    "STAGED_BIT",
    "STATUS_WORD",
    "VERSION",
    "WIDTH",
    "Header",
    "Inline",
    "Peer",
    "check_versions",
    "decode",
    "dtype_code",
    "dtype_name",
    "inline_payloads",
    "signature_of",
]

MAX_DIMS = 16
# magic and version, op, status, dtype, reduce op, root, ndim, count, signature, inline
# bytes, flags (bit 0: debug mode asked; bit 1: long-path data staged before the handshake)
_FIELDS = 11
STATUS_WORD, DEBUG_WORD = 2, 10  # indices of the failure flag and the flags word
DEBUG_BIT, STAGED_BIT = 1, 2
SIGNIFICANT_WORDS = _FIELDS + MAX_DIMS  # the words before the padding
VERSION = 3  # 3: the staged bit of the flags word
_MAGIC = 0x434F4D4D << 16  # "COMM"
WIDTH = 32  # words: the fields, MAX_DIMS dims, padding to 256 bytes (payloads 64-aligned)
HEADER_BYTES = 8 * WIDTH

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
    "sync_random_seed",
    # appended, so the codes above keep their meaning in protocol version 2
    "reduce",
    "scatter",
    "scatter_object_list",
    "barrier",
    "send",
    "send_object_list",
)
REDUCE_OPS = ("sum", "mean", "max", "min", "product")


def _all_dtypes() -> dict[str, torch.dtype]:
    found: dict[str, torch.dtype] = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            found.setdefault(str(value).replace("torch.", ""), value)
    return found


_DTYPES_BY_NAME = _all_dtypes()


def _code_of(dtype: torch.dtype) -> int:
    name = str(dtype).replace("torch.", "")
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 2) | 1


_DTYPE_CODES = {d: _code_of(d) for d in _DTYPES_BY_NAME.values()}
_DTYPE_NAMES = {code: str(d).replace("torch.", "") for d, code in _DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """A stable nonzero 62-bit code of ``dtype``: a digest of its name, the same on every
    rank and in every version (float8 variants, unsigned and complex types included)."""
    code = _DTYPE_CODES.get(dtype)
    return _code_of(dtype) if code is None else code


def dtype_name(code: int) -> str:
    """The name of the dtype of ``code`` ("" for 0: no dtype; a marked code if unknown)."""
    if code == 0:
        return ""
    return _DTYPE_NAMES.get(code, f"unknown dtype (code {code})")


def signature_of(parts: Sequence[object]) -> int:
    """Return a 63-bit digest of ``repr(parts)``, equal on every rank for equal parts."""
    digest = hashlib.blake2b(repr(list(parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Header:
    """What one rank announces before a collective.

    Attributes:
        operation: Name from ``OPERATIONS``.
        error: The local failure, or None when the rank is ready.
        dtype: Tensor dtype, when the collective carries one.
        reduce_op: Name from ``REDUCE_OPS``, for reductions.
        root: ``src`` / ``dst`` for rooted collectives, else -1.
        shape: Tensor shape, when the collective carries one.
        count: Bytes (objects) or elements (tensors) this rank contributes.
        signature: Digest of structure that must match (dict keys, parameter layout).
        inline: Bytes this rank wants to send inline (-1: none); set by ``handshake``.
        debug: Whether this rank asked for debug mode; set by ``handshake``.
        staged: Whether this rank staged its long-path data before the handshake (a
            staging failure is then its ``error``); see ``_handshake.finish_staging``.
    """

    operation: str
    error: BaseException | None = None
    dtype: torch.dtype | None = None
    reduce_op: str | None = None
    root: int = -1
    shape: tuple[int, ...] | None = None
    count: int = 0
    signature: int = 0
    inline: int = -1
    debug: bool = False
    staged: bool = False

    def encode(self) -> list[int]:
        shape = self.shape or ()
        ok = self.error is None and len(shape) <= MAX_DIMS
        words = [
            _MAGIC | VERSION,
            OPERATIONS.index(self.operation),
            0 if ok else 1,
            dtype_code(self.dtype) if self.dtype is not None else 0,
            REDUCE_OPS.index(self.reduce_op) if self.reduce_op else -1,
            self.root,
            len(shape) if self.shape is not None else -1,
            self.count,
            self.signature,
            self.inline,
            (DEBUG_BIT if self.debug else 0) | (STAGED_BIT if self.staged else 0),
        ]
        dims = list(shape[:MAX_DIMS]) + [0] * (MAX_DIMS - min(len(shape), MAX_DIMS))
        return words + dims + [0] * (WIDTH - SIGNIFICANT_WORDS)


@dataclass
class Inline:
    """Data a rank offers to send inside its handshake frame.

    Attributes:
        nbytes: Size of the data in bytes.
        write: Fills a uint8 tensor of ``nbytes`` bytes (on the device of the headers)
            with the data; called only when the data fits the group's inline capacity.
        device: Where the data lies: data on an accelerator never rides in headers that
            travel on the CPU side group (copying it to the host would wait for the device).
    """

    nbytes: int
    write: Callable[[torch.Tensor], None]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor) -> Inline:
        """The bytes of a tensor (any dtype, any device, any layout of strides)."""
        nbytes = tensor.numel() * tensor.element_size()

        def write(out: torch.Tensor) -> None:
            if nbytes:
                out.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())

        return cls(nbytes, write, tensor.device)


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
    inline: int = -1
    debug: bool = False
    staged: bool = False
    version: int = VERSION
    payload: torch.Tensor | None = field(default=None, compare=False, repr=False)

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


def inline_payloads(peers: list[Peer]) -> list[torch.Tensor] | None:
    """Every rank's inline bytes in rank order; None unless every rank's data came inline."""
    payloads = [p.payload for p in peers if p.payload is not None]
    return payloads if len(payloads) == len(peers) else None


def decode(rank: int, words: list[int]) -> Peer:
    """The header of ``rank`` from its ``WIDTH`` words (an "unknown" peer for a frame of
    another protocol version, with that version, or -1 for a frame that is not ours)."""
    magic, op, status, dtype, reduce_op, root, ndim, count, signature, inline, flags = words[
        :_FIELDS
    ]
    version = magic & 0xFFFF if magic >> 16 == _MAGIC >> 16 else -1
    if version != VERSION:
        return Peer(rank, "unknown", False, "", "", -1, None, 0, 0, version=version)
    return Peer(
        rank=rank,
        operation=OPERATIONS[op] if 0 <= op < len(OPERATIONS) else f"unknown({op})",
        ok=status == 0,
        dtype=dtype_name(dtype),
        reduce_op=REDUCE_OPS[reduce_op] if reduce_op >= 0 else "",
        root=root,
        shape=tuple(words[_FIELDS : _FIELDS + ndim]) if ndim >= 0 else None,
        count=count,
        signature=signature,
        inline=inline,
        debug=bool(flags & DEBUG_BIT),
        staged=bool(flags & STAGED_BIT),
        version=version,
    )


def check_versions(operation: str, peers: Sequence[Peer]) -> None:
    """Raise [`CollectiveMismatchError`][comm_core.CollectiveMismatchError] unless every
    peer speaks this rank's protocol ``VERSION``."""
    if any(p.version != VERSION for p in peers):
        raise CollectiveMismatchError(
            operation,
            "the ranks run incompatible versions of the comm-collectives wire protocol.",
            [{"rank": p.rank, "protocol version": p.version} for p in peers],
            f"install the same comm-collectives version on every node (this rank speaks "
            f"version {VERSION}; -1 means a frame that is not comm-collectives' at all).",
        )
