"""The handshake every collective starts with, so that no error on one rank hangs the others.

Before moving data, each collective exchanges one fixed-size frame per rank (a single
all-gather, an all-to-all on the CPU: ``_route.gather_rows``; its layout is in ``_frame``).
The frame's header says which operation the rank is in, whether its local work (serialising, validating)
succeeded, and the shape, dtype, reduce op or root it uses. From the headers every rank
reaches the same verdict:

- a rank failed locally -> every rank raises [`RemoteRankError`][comm_core.RemoteRankError];
- ranks disagree (another operation, dtype, shape, root, dict keys) -> every rank raises
  [`CollectiveMismatchError`][comm_core.CollectiveMismatchError] with a per-rank table;
- otherwise the data moves, sized from the headers (uneven shapes need this anyway).

Small data rides in the same frame: after the header each rank may put an inline payload
of up to the group's inline capacity (``_capacity``), so a
small all_reduce, broadcast, all_gather or object collective is one collective in all,
checks included. Large worlds start with a compact vote (``_compact``); the headers
travel on the route of ``_route`` (a CPU side group under nccl).

Debug mode (``COMM_DEBUG=1`` or [`debug_mode`][comm_collectives.debug_mode]) adds an
exchange of call sites so the table also shows where each rank made the call. Each rank's
header says whether it asked for debug mode, so the call sites are exchanged when any rank
asked: ranks whose environments differ still make the same calls.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as torch_dist

from comm_core import CollectiveMismatchError, RankFailure, get_rank, get_world_size

from ._agree import agree, failure_of, gather_and_raise
from ._capacity import InlineState, capacity_state
from ._compact import compact_vote, uses_compact_vote
from ._faults import transport
from ._frame import HEADER_BYTES, MAX_DIMS, Header, Inline, Peer, check_versions, decode
from ._modes import debug_enabled
from ._route import gather_rows, header_route, settle

__all__ = [
    "PendingHandshake",
    "call_site",
    "finish_staging",
    "handshake",
    "stages_early",
    "start_handshake",
]

T = TypeVar("T")


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
    state = capacity_state(group)
    capacity = state.capacity
    world = get_world_size(group)
    group, device = header_route(group)
    if device.type == "cpu" and payload is not None and payload.device.type != "cpu":
        payload = None  # device data goes by the long path, never through the host
    header.debug = debug_enabled()
    if uses_compact_vote(world):  # every call starts with the vote: the same collective
        agreed = compact_vote(header, group, device)
        if agreed is not None and not varying:
            return PendingHandshake(header, group, state, agreed=agreed)
    row = HEADER_BYTES + capacity
    frame = torch.empty(row, dtype=torch.uint8, device=device)
    used = 0
    if payload is not None and header.error is None:
        header.inline = payload.nbytes
        if payload.nbytes <= capacity:
            try:
                payload.write(frame[HEADER_BYTES : HEADER_BYTES + payload.nbytes])
                used = payload.nbytes
            except Exception as exc:
                header.error, header.inline = exc, -1
    frame[HEADER_BYTES + used :].zero_()  # no stale process memory goes on the wire
    words = torch.tensor(header.encode(), dtype=torch.int64)
    frame[:HEADER_BYTES].copy_(words.view(torch.uint8))
    table = torch.empty(world * row, dtype=torch.uint8, device=device)
    with transport(header.operation, group):
        work = gather_rows(table, frame, group, async_op=True)
    return PendingHandshake(header, group, state, table=table, work=work)


def stages_early(payload: Inline, group: torch_dist.ProcessGroup | None) -> bool:
    """Whether ``payload`` takes the long path of a call whose headers must be equal, as far
    as this rank can tell before the handshake (it does not fit the group's inline capacity,
    or it lies on an accelerator while the headers travel on the CPU, or a large world's
    compact exchange carries no data).

    Such a call stages its data before the handshake, sends a staging failure in its header
    and sets ``Header.staged``; when every rank did, no vote follows the handshake: one
    small collective fewer in front of the transfer (on two loopback ranks about 0.9 ms in
    front of a 32 MB gloo reduce). ``finish_staging`` covers the other cases.
    """
    _, device = header_route(group)
    if uses_compact_vote(get_world_size(group)) and not debug_enabled():
        return True
    if device.type == "cpu" and payload.device.type != "cpu":
        return True
    return payload.nbytes > capacity_state(group).capacity


def finish_staging(
    peers: Sequence[Peer],
    group: torch_dist.ProcessGroup | None,
    operation: str,
    staged: T | None,
    stage: Callable[[], T],
) -> T:
    """The staged data of a call that takes the long path after ``handshake``.

    A rank that staged its data before the handshake says so in its header
    (``Header.staged``) and sent a staging failure there. When every rank did, the data is
    ready on every rank and nothing else is exchanged. Otherwise (a rank offered its data
    inline, or could not tell, and the call still took the long path) the ranks that did
    not stage do it now with ``stage``, and every rank votes
    ([`agree`][comm_collectives.agree]) before any data moves.
    """
    if all(p.staged for p in peers):
        assert staged is not None, "this rank's header said it staged"
        return staged
    error: BaseException | None = None
    if staged is None:
        try:
            staged = stage()
        except Exception as exc:
            error = exc
    agree(operation, error, group=group)
    assert staged is not None
    return staged


class PendingHandshake:
    """A handshake whose frame is sent; ``result`` waits for the others' frames."""

    def __init__(
        self,
        header: Header,
        route: torch_dist.ProcessGroup | None,
        state: InlineState,
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
        assert self._table is not None
        if self._work is not None:
            with transport(header.operation, route):
                settle(self._work, header.operation, route, self._table.device)
        return _read_table(header, route, self._state, self._capacity, self._table, same, hint)


def _read_table(
    header: Header,
    group: torch_dist.ProcessGroup | None,
    state: InlineState,
    capacity: int,
    table: torch.Tensor,
    same: Sequence[str],
    hint: str,
) -> list[Peer]:
    """Decode the gathered frames and raise on a version, operation or field mismatch."""
    world = get_world_size(group)
    row = HEADER_BYTES + capacity
    rows = table.view(world, row)
    headers = rows[:, :HEADER_BYTES].cpu().contiguous().view(torch.int64).tolist()
    peers = []
    for rank, rank_words in enumerate(headers):
        peer = decode(rank, rank_words)
        if 0 <= peer.inline <= capacity:
            inline = rows[rank, HEADER_BYTES : HEADER_BYTES + peer.inline]
            peer = dataclasses.replace(peer, payload=inline)
        peers.append(peer)
    check_versions(header.operation, peers)
    # every rank applies the same rule to the same table: the capacities stay equal
    state.update(max(p.inline for p in peers))
    sites: list[str] | None = None
    if any(p.debug for p in peers):  # one rank asking is enough: every rank sees it
        gathered: list[object] = [None] * world
        with transport(header.operation, group):
            torch_dist.all_gather_object(gathered, call_site(), group=group)
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


def _raise_remote(header: Header, group: torch_dist.ProcessGroup | None) -> None:
    failure: RankFailure | None = None
    if header.error is not None:
        failure = failure_of(header.error, group)
    elif header.shape is not None and len(header.shape) > MAX_DIMS:
        failure = RankFailure(
            get_rank(group),
            "ValueError",
            f"a tensor of {len(header.shape)} dimensions; collectives take at most {MAX_DIMS}",
        )
    gather_and_raise(header.operation, failure, header.error, group)


def call_site() -> str:
    """The first frame outside comm_collectives that led here, as ``file.py:line in name``."""
    frame = sys._getframe(1)
    package = __name__.rsplit(".", 1)[0]
    while frame is not None and frame.f_globals.get("__name__", "").startswith(package):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return (
        f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
    )
