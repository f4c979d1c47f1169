"""The handshake every collective starts with, so that no error on one rank hangs the others.

Before moving data, each collective exchanges one fixed-size frame per rank (a single
``all_gather_into_tensor``). The frame's header says which operation the rank is in, whether
its local work (serialising, validating) succeeded, and the shape, dtype, reduce op or root
it uses. From the headers every rank reaches the same verdict:

- a rank failed locally -> every rank raises [`RemoteRankError`][comm_core.RemoteRankError];
- ranks disagree (another operation, dtype, shape, root, dict keys) -> every rank raises
  [`CollectiveMismatchError`][comm_core.CollectiveMismatchError] with a per-rank table;
- otherwise the data moves, sized from the headers (uneven shapes need this anyway).

Small data rides in the same frame: after the header each rank may put an inline payload
of up to ``inline_capacity`` bytes, so a small all_reduce, broadcast, all_gather or
object collective is one collective in all, checks included. The capacity belongs to the
group and adapts: every rank announces how many bytes it wanted to inline, and after each
exchange every rank applies the same rule to the same table (grow to the largest wish plus
an eighth, in 4 KiB steps, within a budget that shrinks with the world size; halve after a
run of calls that used a quarter of it or less). Frames therefore stay equal in size on
every rank without any extra message. The growth stays close to the data because frame
size matters: on loopback gloo a 128 KiB all-gather costs 40% more than a 70 KiB one.

Debug mode (``COMM_DEBUG=1`` or [`debug_mode`][comm_collectives.debug_mode]) adds an
exchange of call sites so the table also shows where each rank made the call. Each rank's
header says whether it asked for debug mode, so the call sites are exchanged when any rank
asked: ranks whose environments differ still make the same calls.

The first header word carries a magic number and the wire-protocol version: ranks running
incompatible versions of comm-collectives get a clear error instead of a misread frame.

Work that can only fail after the handshake (allocating receive buffers for sizes the
headers gave, staging data on the communication device) is followed by a second, one-word
vote ([`agree`][comm_collectives._protocol.agree]) before any data moves, so such a failure
also raises on every rank. A peer lost in the middle of a call (a killed process) turns
the backend's transport error into a [`RemoteRankError`][comm_core.RemoteRankError] that
names the lost rank ([`transport`][comm_collectives._protocol.transport]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as torch_dist

from comm_core import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    RankFailure,
    RemoteRankError,
    get_comm_device,
    get_cpu_group,
    get_rank,
    get_world_size,
)

__all__ = [
    "COMPACT_ABOVE",
    "VERSION",
    "Header",
    "Inline",
    "Peer",
    "PendingHandshake",
    "agree",
    "all_gather_flat",
    "checks_enabled",
    "debug_enabled",
    "debug_mode",
    "dtype_code",
    "dtype_name",
    "handshake",
    "handshake_bytes",
    "inline_capacity",
    "inline_limit",
    "inline_payloads",
    "local_fault",
    "raise_everywhere",
    "signature_of",
    "start_handshake",
    "transport",
    "unchecked",
]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; the packages support >= 2.4.
all_gather_flat = (
    getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor
)

MAX_DIMS = 16
# magic and version, op, status, dtype, reduce op, root, ndim, count, signature, inline
# bytes, debug flag
_FIELDS = 11
VERSION = 2
_MAGIC = 0x434F4D4D << 16  # "COMM"
_WIDTH = 32  # words: the fields, MAX_DIMS dims, padding to 256 bytes (payloads 64-aligned)
_HEADER_BYTES = 8 * _WIDTH

# Inline payloads: a group starts at _BASE_INLINE bytes a rank and may grow up to
# min(_MAX_INLINE, _INLINE_BUDGET // world), so a frame of a large world stays small.
_BASE_INLINE = 4096
_MAX_INLINE = 256 * 1024
_INLINE_BUDGET = 1024 * 1024
_SHRINK_AFTER = 32

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


# A test hook: called with (stage, operation) at the points where a collective does
# fallible local work, "local" before the handshake and "staging" after it; whatever it
# raises is treated like any local failure there. Used only by the fault-injection tests.
fault_hook: Callable[[str, str], None] | None = None


def local_fault(stage: str, operation: str) -> None:
    """Run the test hook [`fault_hook`][comm_collectives._protocol.fault_hook], if set."""
    if fault_hook is not None:
        fault_hook(stage, operation)


_debug_depth = 0


def debug_enabled() -> bool:
    """Return True inside [`debug_mode`][comm_collectives.debug_mode] or with ``COMM_DEBUG`` set.

    ``COMM_DEBUG`` counts as set unless it is empty, ``0``, ``false``, ``no`` or ``off`` (in
    any case).
    """
    if _debug_depth > 0:
        return True
    return os.environ.get("COMM_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


@contextlib.contextmanager
def debug_mode() -> Iterator[None]:
    """Check, inside the block, that all ranks make the same collective call.

    Each collective additionally exchanges its call site, so a
    [`CollectiveMismatchError`][comm_core.CollectiveMismatchError] shows where every rank
    called from. Every rank must enter the block at the same point of its program.

    Examples:
        >>> import torch
        >>> import comm_collectives as dist
        >>> loss = torch.tensor(0.5)
        >>> with dist.debug_mode():
        ...     dist.all_reduce(loss)  # a mismatch here names every rank's call site
        ...     print(dist.debug_enabled())
        True
    """
    global _debug_depth
    _debug_depth += 1
    try:
        yield
    finally:
        _debug_depth -= 1


_unchecked_depth = 0


def checks_enabled() -> bool:
    """Return False inside [`unchecked`][comm_collectives.unchecked] (and not in
    [`debug_mode`][comm_collectives.debug_mode]).

    ``COMM_DEBUG`` does not turn the checks back on: it is read on each rank, and a rank
    that set it alone would start a handshake while the others issue the backend's
    collective (a hang, or the two collectives' bytes mixed). ``debug_mode`` is entered by
    every rank at the same point of its program.
    """
    return _unchecked_depth == 0 or _debug_depth > 0


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Skip the handshake of the reductions and broadcasts inside the block, for hot loops.

    ``all_reduce``, ``broadcast``, ``all_reduce_dict`` and ``all_reduce_params`` then issue
    the backend's own collective and nothing else: no header, no vote, no inline data, and
    the backend's reduction order (the bits of a float sum may differ from the checked
    paths, which reduce in rank order). A mismatch or a failure on one rank is then not
    detected: the other ranks wait for the process group's timeout, as with
    torch.distributed. The collectives that need every rank's size (gathers, object
    collectives, collect_results) keep their handshake. Every rank must enter and leave
    the block at the same point of its program; ``debug_mode`` turns the checks back on
    (``COMM_DEBUG``, which a rank may set alone, does not).

    Examples:
        >>> import torch
        >>> import comm_collectives as dist
        >>> grads = [torch.ones(3)]
        >>> with dist.unchecked():
        ...     dist.all_reduce_params(grads, op="mean")  # one backend all-reduce a bucket
        >>> grads[0]
        tensor([1., 1., 1.])
    """
    global _unchecked_depth
    _unchecked_depth += 1
    try:
        yield
    finally:
        _unchecked_depth -= 1


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
            int(self.debug),
        ]
        dims = list(shape[:MAX_DIMS]) + [0] * (MAX_DIMS - min(len(shape), MAX_DIMS))
        return words + dims + [0] * (_WIDTH - _FIELDS - MAX_DIMS)


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


@dataclass
class _InlineState:
    """The inline capacity of one group; equal on every rank (see the module docstring)."""

    capacity: int
    maximum: int
    quiet: int = 0

    def update(self, wanted: int) -> None:
        if self.capacity < wanted <= self.maximum:
            self.capacity = min(self.maximum, _round_up(wanted + wanted // 8))
            self.quiet = 0
        elif wanted * 4 <= self.capacity and self.capacity > min(_BASE_INLINE, self.maximum):
            self.quiet += 1
            if self.quiet >= _SHRINK_AFTER:
                floor = min(_BASE_INLINE, self.maximum)
                self.capacity = max(floor, min(self.capacity, _round_up(self.capacity // 2)))
                self.quiet = 0
        else:
            self.quiet = 0


def _round_up(n: int, grain: int = 4096) -> int:
    return (n + grain - 1) // grain * grain


# weak keys: a destroyed group's state goes with the group
_states: weakref.WeakKeyDictionary[torch_dist.ProcessGroup, _InlineState] = (
    weakref.WeakKeyDictionary()
)


def _state(group: torch_dist.ProcessGroup | None) -> _InlineState:
    key = group
    if key is None or key is torch_dist.group.WORLD:
        key = torch_dist.distributed_c10d._get_default_group()
    state = _states.get(key)
    if state is None:
        world = get_world_size(group)
        maximum = max(64, min(_MAX_INLINE, _INLINE_BUDGET // world) // 64 * 64)
        state = _states[key] = _InlineState(min(_BASE_INLINE, maximum), maximum)
    return state


# Where the headers travel. A group whose communication device is not the CPU (nccl)
# exchanges them on a CPU side group, so reading them never waits for the device: the
# data stays on the device and the host keeps running ahead. None: automatic; True forces
# the CPU route, False keeps the headers on the communication device. The tests run the
# nccl layout on gloo with True and comm-core's hook that makes gloo count as a backend
# without CPU support (``comm_core.process_group._CPU_BACKENDS = ()``), so the side group
# is a real twin distinct from the group.
side_channel: bool | None = None


def header_route(
    group: torch_dist.ProcessGroup | None,
) -> tuple[torch_dist.ProcessGroup | None, torch.device]:
    """The group and the device the handshake of a call on ``group`` uses."""
    device = get_comm_device(group)
    use = side_channel if side_channel is not None else device.type != "cpu"
    if not use:
        return group, device
    side = _side_group(group)
    if side is None:  # a pure nccl subgroup: no CPU group of its members
        return group, device
    return side, torch.device("cpu")


def _has_cpu_backend(pg: torch_dist.ProcessGroup) -> bool:
    try:
        pg._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False
    return True


def _side_group(group: torch_dist.ProcessGroup | None) -> torch_dist.ProcessGroup | None:
    """The CPU group that carries the headers of ``group``; None when there is none.

    For the default group that is [`get_cpu_group`][comm_core.get_cpu_group]'s twin, the
    same gloo group of every rank that ``collect_results`` moves its parts on (``init_dist``
    creates it under nccl; otherwise the first call on the default group does, on every
    rank), or the default group itself when its backend moves CPU tensors.

    A subgroup uses its own CPU backend when it has one ("cpu:gloo,cuda:nccl"). A pure nccl
    subgroup keeps its headers on the device: its twin would be made by its members only,
    with local synchronisation, and torch names such a group after the number of groups
    each member knows, which differs when ranks made different subgroups before (as
    ``get_cpu_group`` explains). ``collect_results`` may raise a clear error then, but a
    plain collective must not fail because of the groups a rank made earlier.
    """
    c10d = torch_dist.distributed_c10d
    default = c10d._get_default_group()
    pg = default if group is None or group is torch_dist.group.WORLD else group
    if pg is not default:
        return pg if _has_cpu_backend(pg) else None
    twin = get_cpu_group(None)
    return default if twin is None else twin


def inline_capacity(group: torch_dist.ProcessGroup | None = None) -> int:
    """Bytes a rank can send inside the next handshake frame on ``group``."""
    return _state(group).capacity


@contextlib.contextmanager
def inline_limit(maximum: int, group: torch_dist.ProcessGroup | None = None) -> Iterator[None]:
    """Cap the inline capacity of ``group`` inside the block (0: no data travels inline).

    The tests use it to run every collective's long path as well. Every rank of the group
    must enter and leave the block at the same point of its program, or the frames of the
    ranks differ in size.
    """
    state = _state(group)
    saved = (state.capacity, state.maximum, state.quiet)
    state.maximum = max(0, maximum)
    state.capacity = min(state.capacity, state.maximum)
    try:
        yield
    finally:
        state.capacity, state.maximum, state.quiet = saved


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


def _decode(rank: int, words: list[int]) -> Peer:
    magic, op, status, dtype, reduce_op, root, ndim, count, signature, inline, debug = words[
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
        debug=bool(debug),
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
    payload: Inline | None = None,
    varying: bool = True,
) -> list[Peer]:
    """Exchange headers and raise the same error on every rank when something is wrong.

    In a world larger than ``COMPACT_ABOVE`` every call starts with one all-reduce (max)
    of the header and its negation, which tells every rank whether all headers are equal
    and no rank failed. A call whose headers must be equal (``varying=False``) stops
    there when they are; otherwise (a difference, a failure, debug mode, or a call that
    needs each rank's header) the frames are gathered as in a small world. A small call's
    handshake then costs ``ceil(log2 W) * 432`` bytes a rank (see ``handshake_bytes``)
    and its data moves in a second collective.

    Args:
        header: This rank's header.
        group: The process group of the collective.
        same: Fields that must be equal on every rank besides ``operation`` (any of
            ``"dtype"``, ``"reduce_op"``, ``"root"``, ``"shape"``, ``"signature"``).
        hint: How to fix a mismatch, appended to the error.
        payload: Data to send inside the frame when it fits ``inline_capacity``. Its
            size is announced either way, so the group's capacity can grow to fit it.
        varying: Whether the caller needs each rank's own header (shapes or sizes that may
            differ, inline data); False allows the compact exchange in large worlds.

    Returns:
        Every rank's decoded header, index = rank in ``group``. ``Peer.payload`` holds the
        rank's inline bytes (a uint8 view on the communication device) or None.

    Raises:
        RemoteRankError: A rank's local work failed (raised on every rank).
        CollectiveMismatchError: The ranks disagree (raised on every rank).
    """
    return start_handshake(header, group, payload=payload, varying=varying).result(
        same=same, hint=hint
    )


def start_handshake(
    header: Header,
    group: torch_dist.ProcessGroup | None,
    *,
    payload: Inline | None = None,
    varying: bool = True,
) -> PendingHandshake:
    """Send this rank's frame of a handshake and return at once (see ``handshake``).

    The caller may do local work while the frames travel, then calls
    ``PendingHandshake.result``, which waits and makes the checks. Every rank must call
    ``result`` of every handshake it starts, in the same order as the other ranks.
    """
    state = _state(group)
    capacity = state.capacity
    world = get_world_size(group)
    group, device = header_route(group)
    if device.type == "cpu" and payload is not None and payload.device.type != "cpu":
        payload = None  # device data goes by the long path, never through the host
    header.debug = debug_enabled()
    if world > COMPACT_ABOVE:  # every call starts with the vote: the same collective
        agreed = _compact_vote(header, group, device)
        if agreed is not None and not varying:
            return PendingHandshake(header, group, state, agreed=agreed)
    row = _HEADER_BYTES + capacity
    frame = torch.empty(row, dtype=torch.uint8, device=device)
    used = 0
    if payload is not None and header.error is None:
        header.inline = payload.nbytes
        if payload.nbytes <= capacity:
            try:
                payload.write(frame[_HEADER_BYTES : _HEADER_BYTES + payload.nbytes])
                used = payload.nbytes
            except Exception as exc:
                header.error, header.inline = exc, -1
    frame[_HEADER_BYTES + used :].zero_()  # no stale process memory goes on the wire
    words = torch.tensor(header.encode(), dtype=torch.int64)
    frame[:_HEADER_BYTES].copy_(words.view(torch.uint8))
    table = torch.empty(world * row, dtype=torch.uint8, device=device)
    with transport(header.operation, group):
        work = all_gather_flat(table, frame, group=group, async_op=True)
    return PendingHandshake(header, group, state, table=table, work=work)


class PendingHandshake:
    """A handshake whose frame is sent; ``result`` waits for the others' frames."""

    def __init__(
        self,
        header: Header,
        route: torch_dist.ProcessGroup | None,
        state: _InlineState,
        *,
        agreed: list[Peer] | None = None,
        table: torch.Tensor | None = None,
        work: torch_dist.Work | None = None,
    ) -> None:
        self._header = header
        self._route = route  # the group the frames travel on
        self._state = state  # of the collective's group, read when the frame was built
        self._capacity = state.capacity
        self._agreed = agreed
        self._table = table
        self._work = work

    def result(self, *, same: Sequence[str] = (), hint: str = "") -> list[Peer]:
        """Every rank's header; raises the same error on every rank when one is wrong.

        Args:
            same: As for ``handshake``.
            hint: As for ``handshake``.
        """
        if self._agreed is not None:
            return self._agreed
        header, route = self._header, self._route
        if self._work is not None:
            with transport(header.operation, route):
                self._work.wait()
        assert self._table is not None
        return _read_table(header, route, self._state, self._capacity, self._table, same, hint)


def _read_table(
    header: Header,
    group: torch_dist.ProcessGroup | None,
    state: _InlineState,
    capacity: int,
    table: torch.Tensor,
    same: Sequence[str],
    hint: str,
) -> list[Peer]:
    """Decode the gathered frames and raise on a version, operation or field mismatch."""
    world = get_world_size(group)
    row = _HEADER_BYTES + capacity
    rows = table.view(world, row)
    headers = rows[:, :_HEADER_BYTES].cpu().contiguous().view(torch.int64).tolist()
    peers = []
    for rank, rank_words in enumerate(headers):
        peer = _decode(rank, rank_words)
        if 0 <= peer.inline <= capacity:
            inline = rows[rank, _HEADER_BYTES : _HEADER_BYTES + peer.inline]
            peer = dataclasses.replace(peer, payload=inline)
        peers.append(peer)
    if any(p.version != VERSION for p in peers):
        raise CollectiveMismatchError(
            header.operation,
            "the ranks run incompatible versions of the comm-collectives wire protocol.",
            [{"rank": p.rank, "protocol version": p.version} for p in peers],
            f"install the same comm-collectives version on every node (this rank speaks "
            f"version {VERSION}; -1 means a frame that is not comm-collectives' at all).",
        )
    # every rank applies the same rule to the same table: the capacities stay equal
    state.update(max(p.inline for p in peers))
    sites: list[str] | None = None
    if any(p.debug for p in peers):  # one rank asking is enough: every rank sees it
        gathered: list[object] = [None] * world
        with transport(header.operation, group):
            torch_dist.all_gather_object(gathered, _call_site(), group=group)
        sites = [str(s) for s in gathered]

    def table_rows() -> list[dict[str, object]]:
        return [p.row(sites[p.rank] if sites else None) for p in peers]

    if len({p.operation for p in peers}) > 1:
        problem = "the ranks are in different collectives."
        raise CollectiveMismatchError(
            header.operation,
            problem,
            table_rows(),
            "every rank must make the same sequence of collective calls; run with "
            "COMM_DEBUG=1 to see each rank's call site.",
        )
    if not all(p.ok for p in peers):
        _raise_remote(header, group)
    for name in same:
        values = {getattr(p, name) for p in peers}
        if len(values) > 1:
            label = "dict keys / tensor layout" if name == "signature" else name
            problem = f"the ranks passed different {label}."
            raise CollectiveMismatchError(header.operation, problem, table_rows(), hint)
    return peers


# Above this world size, calls whose headers must be equal use the compact exchange.
COMPACT_ABOVE = 64
_INLINE_WORD = 9  # index of the inline-bytes word, the one word that may differ


def _compact_vote(
    header: Header, group: torch_dist.ProcessGroup | None, device: torch.device
) -> list[Peer] | None:
    """Every rank's header when all are equal and no rank failed, else None."""
    header.inline = -1
    words = header.encode()[: _FIELDS + MAX_DIMS]
    vector = torch.tensor(words + [-w for w in words], dtype=torch.int64).to(device)
    with transport(header.operation, group):
        torch_dist.all_reduce(vector, torch_dist.ReduceOp.MAX, group=group)
    both = vector.tolist()
    high, low = both[: len(words)], [-w for w in both[len(words) :]]
    if high != low or high[2] != 0 or high[10] != 0:  # a difference, a failure, debug mode
        return None
    peer = _decode(0, high + [0] * (_WIDTH - len(high)))
    return [dataclasses.replace(peer, rank=rank) for rank in range(get_world_size(group))]


def handshake_bytes(world: int, *, varying: bool = False, capacity: int | None = None) -> int:
    """Bytes one rank receives in the handshake of one call (the byte model of the docs).

    Args:
        world: World size.
        varying: Whether the call needs every rank's header (all_gather, gather, the object
            collectives, collect_results); False for all_reduce, broadcast, all_reduce_dict,
            all_reduce_params, sync_random_seed.
        capacity: The group's inline capacity; its starting value when None.

    Returns:
        Bytes received per rank. The compact exchange all-reduces the header's 27 words and
        their negations (432 bytes); the model takes the costlier of the usual algorithms
        for a buffer that small, recursive doubling: ``ceil(log2 W) * 432``. Otherwise an
        all-gather brings every other rank's frame: ``(W - 1) * (256 + capacity)``.
    """
    if world <= 1:
        return 0
    vote = 0
    if world > COMPACT_ABOVE:
        vote = (world - 1).bit_length() * 2 * 8 * (_FIELDS + MAX_DIMS)
        if not varying:
            return vote
    if capacity is None:
        maximum = max(64, min(_MAX_INLINE, _INLINE_BUDGET // world) // 64 * 64)
        capacity = min(_BASE_INLINE, maximum)
    return vote + (world - 1) * (_HEADER_BYTES + capacity)


def agree(
    operation: str, error: BaseException | None, group: torch_dist.ProcessGroup | None
) -> None:
    """The second vote: raise on every rank when local work after the handshake failed.

    Every rank calls this at the same point, after the work that may fail (allocating
    receive buffers, staging data on the communication device) and before the data moves.
    It costs one all-reduce of one word, so collectives call it only on their long path.

    Args:
        operation: The collective.
        error: This rank's failure, or None.
        group: The process group of the collective.

    Raises:
        RemoteRankError: Some rank passed an error (raised on every rank).
    """
    route, device = header_route(group)
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64).to(device)
    with transport(operation, route):
        torch_dist.all_reduce(flag, torch_dist.ReduceOp.MAX, group=route)
    if int(flag.item()):
        failure = None if error is None else _failure_of(error, route)
        _gather_and_raise(operation, failure, error, route)


# How long a rank that saw a transport error waits for the others to report alive.
_LIVENESS_WAIT_S = 3.0


@contextlib.contextmanager
def transport(operation: str, group: torch_dist.ProcessGroup | None) -> Iterator[None]:
    """Turn a transport error of the backend inside the block into the library's error.

    A peer that died (a killed process, a lost node) makes the backend raise a bare
    RuntimeError on the ranks that talk to it. This raises instead a
    [`RemoteRankError`][comm_core.RemoteRankError] naming the ranks that did not answer a
    liveness check through the rendezvous store within a few seconds, or a
    [`CommTimeoutError`][comm_core.CommTimeoutError] when the backend timed out.
    """
    try:
        yield
    except CommError:
        raise
    except RuntimeError as exc:
        raise _transport_error(operation, exc, group) from exc


def _transport_error(
    operation: str, exc: RuntimeError, group: torch_dist.ProcessGroup | None
) -> CommError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    me = get_rank(group)
    lost = _silent_ranks(group)
    if "timed out" in text.lower() or "timeout" in text.lower():
        silent = (
            f" Rank(s) {', '.join(map(str, lost))} did not report alive within "
            f"{_LIVENESS_WAIT_S:g} s (dead, or stuck elsewhere)."
            if lost
            else ""
        )
        message = (
            f"{operation} timed out on rank {me} of the group (world size "
            f"{get_world_size(group)}): {text}.{silent} Some rank did not reach this call or "
            "died in it; run with COMM_DEBUG=1 to see each rank's call site, or raise "
            "init_dist's timeout for slow steps."
        )
        return CommTimeoutError(message)
    if lost is None:
        cause = (
            "the rendezvous store does not answer either, so the rank that hosts it (rank 0 "
            "under init_dist's own store, or the launcher's agent) is probably gone"
        )
        failures = [RankFailure(me, "comm.TransportError", f"{text} ({cause})")]
    elif lost:
        failures = [
            RankFailure(
                rank,
                "comm.RankLost",
                f"the rank stopped answering in the middle of the call (seen from rank {me}: "
                f"{text}); its process probably died: check its log",
            )
            for rank in lost
        ]
    else:
        failures = [RankFailure(me, "comm.TransportError", text)]
    return RemoteRankError(operation, failures)


_transport_failures: dict[str, int] = {}


def _silent_ranks(group: torch_dist.ProcessGroup | None) -> list[int] | None:
    """The ranks of ``group`` that do not show up in the store within a few seconds
    (None when the store cannot be reached)."""
    pg = group if group is not None else torch_dist.distributed_c10d._get_default_group()
    name = str(getattr(pg, "group_name", "default"))
    world, me = get_world_size(group), get_rank(group)
    # numbered: marks left by an earlier failure on this group (that every rank saw)
    # must not pass for marks of this one
    seen = _transport_failures[name] = _transport_failures.get(name, 0) + 1
    prefix = f"comm/alive/{name}/{seen}/"
    try:
        store = torch_dist.distributed_c10d._get_default_store()
        store.set(f"{prefix}{me}", "1")
        missing = set(range(world)) - {me}
        deadline = time.monotonic() + _LIVENESS_WAIT_S
        while missing and time.monotonic() < deadline:
            missing = {r for r in missing if not store.check([f"{prefix}{r}"])}
            if missing:
                time.sleep(0.05)
    except Exception:
        return None
    return sorted(missing)


def _raise_remote(header: Header, group: torch_dist.ProcessGroup | None) -> None:
    failure: RankFailure | None = None
    if header.error is not None:
        failure = _failure_of(header.error, group)
    elif header.shape is not None and len(header.shape) > MAX_DIMS:
        failure = RankFailure(
            get_rank(group),
            "ValueError",
            f"a tensor of {len(header.shape)} dimensions; collectives take at most {MAX_DIMS}",
        )
    _gather_and_raise(header.operation, failure, header.error, group)


def raise_everywhere(
    operation: str, error: BaseException | None, group: torch_dist.ProcessGroup | None
) -> NoReturn:
    """Raise one [`RemoteRankError`][comm_core.RemoteRankError] on every rank of ``group``.

    Every rank calls this at the same point, once the ranks agree that the call failed;
    ``error`` is this rank's own failure, or None when this rank only reports the others'.
    """
    route, _ = header_route(group)
    failure = None if error is None else _failure_of(error, route)
    _gather_and_raise(operation, failure, error, route)


def _failure_of(error: BaseException, group: torch_dist.ProcessGroup | None) -> RankFailure:
    return RankFailure(
        get_rank(group),
        f"{type(error).__module__}.{type(error).__qualname__}",
        str(error),
        "".join(traceback.format_exception(type(error), error, error.__traceback__)),
    )


def _gather_and_raise(
    operation: str,
    failure: RankFailure | None,
    error: BaseException | None,
    group: torch_dist.ProcessGroup | None,
) -> NoReturn:
    gathered: list[object] = [None] * get_world_size(group)
    with transport(operation, group):
        torch_dist.all_gather_object(gathered, failure, group=group)
    failures = [f for f in gathered if isinstance(f, RankFailure)]
    raise RemoteRankError(operation, failures) from error
