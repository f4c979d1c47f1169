"""The wire of the point-to-point calls: the header, the data and the call site of a
message, the sender's failure announcement, and the receiver's side (``_receive``), which
reads the header, drains the bytes it announces and then places them or raises.

The public calls are in ``comm_collectives.p2p``.
"""

from __future__ import annotations

import pickle
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

from comm_core import (
    CollectiveMismatchError,
    CommTimeoutError,
    RankFailure,
    RemoteRankError,
    get_comm_device,
    get_rank,
    get_world_size,
)

from ._agree import failure_of
from ._buffers import empty_bytes
from ._faults import peer_transport
from ._frame import VERSION, WIDTH, Header, decode, signature_of
from ._handshake import call_site
from ._modes import debug_enabled
from ._route import header_route
from ._serialization import decode as decode_frame
from ._staging import _as_bytes, _staged, global_rank
from .work import Work


def _device_code(device: torch.device) -> int:
    """The device kind of a tensor as a header word (the same on every rank)."""
    return signature_of(["device", device.type])


# comm's backend tags start here: a raw torch.distributed send with a small tag (torch's
# own object calls use tag 0) never matches a comm header or data receive, nor the reverse
_TAG_BASE = 1 << 24


def _tags(tag: int) -> tuple[int, int]:
    """The backend tags of a call's header and its data: distinct, so a receive from any
    source never takes another message's data for a header."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < _TAG_BASE:
        message = f"tag must be an int in [0, {_TAG_BASE}), got {tag!r}."
        raise ValueError(message)
    return _TAG_BASE + 2 * tag, _TAG_BASE + 2 * tag + 1


def _check_peer(
    operation: str, peer: object, group: torch_dist.ProcessGroup | None, what: str
) -> int:
    world, me = get_world_size(group), get_rank(group)
    if isinstance(peer, bool) or not isinstance(peer, int):
        message = f"{operation}: {what} must be an int rank of the group, got {peer!r}."
        raise TypeError(message)
    if not 0 <= peer < world:
        message = f"{operation}: {what}={peer} is not a rank of the group (0..{world - 1})."
        raise ValueError(message)
    if peer == me:
        message = f"{operation}: {what}={peer} is this rank itself; send to another rank."
        raise ValueError(message)
    return peer


def _header_tensor(header: Header) -> torch.Tensor:
    return torch.tensor(header.encode(), dtype=torch.int64)


# debug mode: a sender whose header says ``debug`` sends its call site after the data, in a
# fixed-size message (so the receiver can post it without another header)
_SITE_BYTES = 256


def _site_tensor(site: str) -> torch.Tensor:
    raw = site.encode("utf-8", "replace")[:_SITE_BYTES]
    out = torch.zeros(_SITE_BYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def _site_of(buffer: torch.Tensor) -> str:
    return bytes(buffer.tolist()).rstrip(b"\0").decode("utf-8", "replace")


def _own_site() -> str | None:
    """This rank's call site in debug mode (the user's frame), else None."""
    return call_site() if debug_enabled() else None


def _post(
    operation: str,
    header: Header,
    data: torch.Tensor,
    data_group: torch_dist.ProcessGroup | None,
    dst: int,
    group: torch_dist.ProcessGroup | None,
    tag: int,
    site: str | None = None,
) -> list[torch_dist.Work]:
    """Start sending ``header`` and then ``data`` (bytes) to ``dst`` (and, in debug mode,
    the call site ``site``); return the handles."""
    route, _ = header_route(group)
    head_tag, data_tag = _tags(tag)
    peer = global_rank(group, dst)
    header.debug = site is not None
    with peer_transport(operation, group, [dst]):
        works = [torch_dist.isend(_header_tensor(header), peer, group=route, tag=head_tag)]
        if data.numel():
            works.append(torch_dist.isend(data, peer, group=data_group, tag=data_tag))
        if site is not None:
            works.append(torch_dist.isend(_site_tensor(site), peer, group=route, tag=data_tag))
    return [w for w in works if w is not None]


def _announce_failure(
    operation: str,
    error: BaseException,
    dst: int,
    group: torch_dist.ProcessGroup | None,
    tag: int,
) -> RemoteRankError:
    """Send this rank's failure to ``dst`` (so it raises too) and return the error to raise."""
    failure = failure_of(error, group)
    blob = np.frombuffer(pickle.dumps(failure), dtype=np.uint8).copy()
    header = Header(operation, error=error, count=blob.size)
    route, _ = header_route(group)
    try:
        works = _post(operation, header, torch.from_numpy(blob), route, dst, group, tag)
    except Exception:  # the peer is gone as well: the local error is what matters
        works = []
    if works:  # delivered in the background: this rank raises now
        threading.Thread(target=_drain, args=(works,), daemon=True).start()
    return RemoteRankError(operation, [failure])


def _drain(works: list[torch_dist.Work]) -> None:
    """Wait for the sends of a failure announcement (the peer may be gone: then nothing)."""
    for work in works:
        try:
            work.wait()
        except Exception:
            return


def _wait_all(
    operation: str, works: list[torch_dist.Work], group: torch_dist.ProcessGroup | None, dst: int
) -> None:
    with peer_transport(operation, group, [dst]):
        for work in works:
            work.wait()


def _receive(
    operation: str,
    tensor: torch.Tensor | None,
    objects: list[Any] | None,
    src: int | None,
    group: torch_dist.ProcessGroup | None,
    tag: int,
    work: Work | None = None,
    site: str | None = None,
) -> int:
    """Receive a header, then the bytes it announces (and the sender's call site when it
    sent one); place them or raise; return the sender's rank. Runs in the caller's thread
    (recv) or a handle's helper thread (irecv). ``site`` is this rank's call site in debug
    mode: with the sender's, it goes into the rows of a mismatch table."""
    if src is not None:
        _check_peer(operation, src, group, "src")
    head_tag, data_tag = _tags(tag)
    route, _ = header_route(group)
    header = torch.empty(WIDTH, dtype=torch.int64)
    peers = [] if src is None else [src]
    try:
        with peer_transport(operation, group, peers):
            if src is None:
                source = torch_dist.recv(header, None, group=route, tag=head_tag)
                sender = _group_rank(group, source)
            else:
                torch_dist.recv(header, global_rank(group, src), group=route, tag=head_tag)
                sender = src
    except CommTimeoutError as exc:
        cause = abandoned_cause(group, src, tag, work)
        if cause is None:
            raise
        backend = exc.__cause__ if exc.__cause__ is not None else exc
        said = str(backend).strip().splitlines()[0] if str(backend).strip() else "timed out"
        message = f"{operation} timed out on rank {get_rank(group)}. {cause} (The backend: {said})"
        raise CommTimeoutError(message) from exc
    if work is not None:
        work._peers = [sender]
        work._source = sender  # a message was taken (read by a record of ``Abandoned``)
    got = decode(sender, header.tolist())
    expected = "send" if objects is None else "send_object_list"
    on_route = not got.ok or got.operation != "send"  # where the sender put the bytes
    device = torch.device("cpu") if on_route else get_comm_device(group)
    nbytes = max(0, got.count) if got.version == VERSION else 0
    problem = _mismatch(operation, got, expected, tensor, objects, sender, group)
    buffer = torch.empty(0, dtype=torch.uint8)
    staged: torch.Tensor | None = None
    if nbytes:
        if problem is None and tensor is not None and got.ok:
            staged = _staged(tensor, device)
            buffer = _as_bytes(staged)
        else:
            buffer = empty_bytes(nbytes, device)
        with peer_transport(operation, group, [sender]):
            torch_dist.recv(
                buffer, global_rank(group, sender), group=route if on_route else group, tag=data_tag
            )
    their_site: str | None = None
    if got.debug and got.version == VERSION:
        raw = torch.empty(_SITE_BYTES, dtype=torch.uint8)
        with peer_transport(operation, group, [sender]):
            torch_dist.recv(raw, global_rank(group, sender), group=route, tag=data_tag)
        their_site = _site_of(raw)
    if problem is not None and (their_site or site):  # the table with the call sites
        sites = (their_site, site)
        problem = _mismatch(operation, got, expected, tensor, objects, sender, group, sites)
    if not got.ok:
        failure = pickle.loads(buffer.cpu().numpy().tobytes())
        if not isinstance(failure, RankFailure):
            failure = RankFailure(sender, "comm.TransportError", "an unreadable report")
        raise RemoteRankError(operation, [failure])
    if problem is not None:
        cause = abandoned_cause(group, sender, tag, work)
        if cause is not None and isinstance(problem, CollectiveMismatchError):
            problem = CollectiveMismatchError(
                problem.operation, f"{problem.problem} {cause}", problem.rows, problem.hint
            )
        raise problem
    if tensor is not None:
        if staged is not None and staged is not tensor:
            with torch.no_grad():
                tensor.copy_(staged)
        return sender
    assert objects is not None
    objects[:] = decode_frame(buffer.numpy())
    return sender


def _group_rank(group: torch_dist.ProcessGroup | None, global_rank_: int) -> int:
    if group is None or group is torch_dist.group.WORLD:
        return int(global_rank_)
    return int(torch_dist.get_group_rank(group, global_rank_))


def _mismatch(
    operation: str,
    got: Any,
    expected: str,
    tensor: torch.Tensor | None,
    objects: list[Any] | None,
    sender: int,
    group: torch_dist.ProcessGroup | None,
    sites: tuple[str | None, str | None] = (None, None),
) -> BaseException | None:
    """What the receiver raises once the bytes are drained, or None when they fit.

    ``sites`` are the call sites of the sender and of this rank (debug mode), or None."""

    def rows(theirs: dict[str, object], mine: dict[str, object]) -> list[dict[str, object]]:
        for row, where in ((theirs, sites[0]), (mine, sites[1])):
            if where is not None:
                row["call site"] = where
        return [theirs, mine]

    if got.version != VERSION:
        return CollectiveMismatchError(
            operation,
            "the sender runs an incompatible version of the comm-collectives wire protocol.",
            [{"rank": sender, "protocol version": got.version}],
            "install the same comm-collectives version on every node.",
        )
    if not got.ok:
        return None  # the sender's failure, raised from its report
    me = get_rank(group)
    if objects is None and not isinstance(tensor, torch.Tensor):
        message = f"{operation}: tensor must be a torch.Tensor, got {type(tensor).__name__}."
        return TypeError(message)
    if tensor is None and not isinstance(objects, list):
        message = f"{operation}: object_list must be a list, got {type(objects).__name__}."
        return TypeError(message)
    if got.operation != expected:
        return CollectiveMismatchError(
            operation,
            f"rank {sender} sent with {got.operation}, rank {me} received with {operation}.",
            rows(
                {"rank": sender, "operation": got.operation}, {"rank": me, "operation": operation}
            ),
            "pair send with recv (or isend / irecv) and send_object_list with "
            "recv_object_list, with the same tag.",
        )
    if tensor is not None:
        mine: dict[str, object] = {
            "rank": me,
            "operation": operation,
            "shape": tuple(tensor.shape),
            "dtype": str(tensor.dtype).replace("torch.", ""),
            "device": tensor.device.type,
        }
        theirs: dict[str, object] = {
            "rank": sender,
            "operation": "send",
            "shape": got.shape,
            "dtype": got.dtype,
            "device": mine["device"]
            if got.signature == _device_code(tensor.device)
            else "another kind",
        }
        different = [k for k in ("shape", "dtype", "device") if mine[k] != theirs[k]]
        if different:
            return CollectiveMismatchError(
                operation,
                f"the tensor sent and the tensor posted to receive differ in {', '.join(different)}.",
                rows(theirs, mine),
                "post a tensor of the sender's shape, dtype and device kind "
                "(torch.empty(shape, dtype=dtype, device=device)).",
            )
        return None
    assert objects is not None
    if got.signature != len(objects):
        return CollectiveMismatchError(
            operation,
            f"rank {sender} sent {got.signature} objects; rank {me} posted a list of "
            f"{len(objects)}.",
            rows(
                {"rank": sender, "operation": "send_object_list", "objects": got.signature},
                {"rank": me, "operation": operation, "objects": len(objects)},
            ),
            "post a list as long as the sender's, e.g. [None] * n.",
        )
    return None


# Receives whose wait(timeout) expired. Such a receive stays posted (its helper thread
# waits for a header), so it takes the next message of its peer and tag, and a later
# receive then gets the message after it, or nothing: its error names the abandoned one.
_ABANDONED: list[Abandoned] = []
_ABANDONED_LOCK = threading.Lock()
_ABANDONED_KEPT = 64


@dataclass(eq=False)
class Abandoned:
    """An ``irecv`` (its group, source and tag), registered once a ``wait(timeout)`` of its
    handle expired (``expired``); its helper thread calls ``ended`` when the receive ends."""

    group: torch_dist.ProcessGroup | None
    src: int | None
    tag: int
    timeout: float = 0.0
    handle: weakref.ref[Work] | None = None
    ended_from: int | None = None  # the sender whose message it took, once ended
    is_ended: bool = False

    def expired(self, work: Work, timeout: float) -> str:
        """Register the receive (once); return the timeout error's account of the peer."""
        with _ABANDONED_LOCK:
            if self.handle is None:
                self.timeout, self.handle = timeout, weakref.ref(work)
                if len(_ABANDONED) >= _ABANDONED_KEPT:
                    del _ABANDONED[0]
                _ABANDONED.append(self)
        earlier = abandoned_cause(self.group, self.src, self.tag, work)
        peer = "any rank" if self.src is None else f"rank {self.src}"
        posted = (
            f"This receive stays posted: the next message from {peer} with tag {self.tag} "
            "goes into its tensor, not into a later recv; wait on this handle again to take "
            "it."
        )
        if earlier is not None:
            return f"{earlier} {posted}"
        who = "Rank(s) any" if self.src is None else f"Rank(s) {self.src}"
        return f"{who} (the peer) not heard from: no matching call yet, or dead. {posted}"

    def ended(self, work: Work) -> None:
        """Note, from the helper thread, that the receive ended (and what it took)."""
        self.ended_from = work._source if work._source >= 0 else None
        self.is_ended = True

    def took(self) -> int | None:
        """The sender whose message the receive took (its header came), else None."""
        if self.is_ended:
            return self.ended_from
        handle = None if self.handle is None else self.handle()
        return None if handle is None or handle._source < 0 else handle._source

    def describe(self) -> str:
        peer = "any rank" if self.src is None else f"rank {self.src}"
        start = (
            f"an earlier irecv from {peer} (tag {self.tag}) whose wait(timeout={self.timeout:g} s)"
        )
        sender = self.took()
        if sender is None:
            return f"{start} expired is still posted and takes the next message first"
        return (
            f"{start} expired stayed posted and took the next message rank {sender} sent "
            "(into that irecv's tensor)"
        )


def _same_group(a: torch_dist.ProcessGroup | None, b: torch_dist.ProcessGroup | None) -> bool:
    world = torch_dist.group.WORLD
    return (world if a is None else a) is (world if b is None else b)


def abandoned_cause(
    group: torch_dist.ProcessGroup | None, src: int | None, tag: int, work: Work | None
) -> str | None:
    """Why a receive from ``src`` (None: any rank) with ``tag`` on ``group`` got nothing
    or the wrong message, when an abandoned ``irecv`` (other than ``work`` itself) can
    explain it: it is still posted, or it took a message; else None. Records of handles
    waited to completion since are dropped, and those of ended receives once told."""
    with _ABANDONED_LOCK:
        found: list[Abandoned] = []
        for record in list(_ABANDONED):
            handle = None if record.handle is None else record.handle()
            if handle is not None and handle._done:  # the caller took its message after all
                _ABANDONED.remove(record)
                continue
            if (handle is not None and handle is work) or (
                record.is_ended and record.ended_from is None
            ):  # itself, or a receive that ended without a message (a timeout, a lost peer)
                if record.is_ended:
                    _ABANDONED.remove(record)
                continue
            theirs = record.took() if record.took() is not None else record.src
            peers_meet = theirs is None or src is None or theirs == src
            if peers_meet and record.tag == tag and _same_group(record.group, group):
                found.append(record)
                if record.is_ended:
                    _ABANDONED.remove(record)
    if not found:
        return None
    told = "; ".join(record.describe() for record in found)
    return (
        f"The peer is probably not to blame: {told}. A receive whose wait(timeout) expired "
        "stays posted until a message comes; wait on its handle again (it completes with "
        "the next message) instead of posting another receive, or give its wait a longer "
        "timeout."
    )
