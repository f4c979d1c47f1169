"""Object collectives: all_gather_object, gather_object and broadcast_object_list.

Objects are pickled with protocol 5; tensors and numpy arrays inside them travel as raw
buffers in the same message and come back as views of the receive buffer. A small object
travels inside the handshake frame (one collective in all); a large one goes through a
reusable buffer (see ``comm_collectives._buffers``). ``broadcast_object_list`` sends a
piece of ``DIRECT_BYTES`` or more (a large tensor, array or pickle stream) straight
from its own memory: the frame's head rides in the handshake, so every rank knows the
messages that follow. A rank that cannot pickle its object makes every rank raise
[`RemoteRankError`][comm_core.RemoteRankError].
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

from comm_core import get_comm_device, get_rank, get_world_size

from ._agree import agree
from ._buffers import empty_bytes
from ._capacity import inline_capacity
from ._faults import transport
from ._frame import Header, Inline, Peer, inline_payloads
from ._handshake import handshake
from ._modes import local_fault
from ._route import all_gather_flat
from ._serialization import Encoded, decode, encode, frame_offsets, head_lengths
from .groups import not_member
from .tensors import _check_root, global_rank

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
]


def _encode(
    obj: Any, operation: str, check: Any = None
) -> tuple[Encoded | None, BaseException | None]:
    """Check the arguments (``check``), run the test hook and pickle ``obj``; a failure is
    returned, for the handshake to report on every rank."""
    try:
        if check is not None:
            check()
        local_fault("local", operation)
        return encode(obj), None
    except Exception as exc:
        return None, exc


def _inline(encoded: Encoded | None, nbytes: int | None = None) -> Inline | None:
    """Offer the first ``nbytes`` of a frame (all of it by default) to the handshake: small
    objects travel inside it."""
    if encoded is None:
        return None
    size = encoded.nbytes if nbytes is None else nbytes

    def write(out: torch.Tensor) -> None:
        host = out if out.device.type == "cpu" else torch.empty_like(out, device="cpu")
        encoded.write_into(host.numpy(), 0, size)
        if host is not out:
            out.copy_(host)

    return Inline(size, write)


def _exchange(
    operation: str,
    encoded: Encoded | None,
    error: BaseException | None,
    group: torch_dist.ProcessGroup | None,
    root: int = -1,
    payload: Inline | None = None,
) -> list[Peer]:
    """The handshake of an object collective: frame sizes announced, small frames inline
    (``payload``: what to offer instead of the whole frame)."""
    return handshake(
        Header(
            operation, error=error, root=root, count=encoded.nbytes if encoded is not None else 0
        ),
        group,
        same=("root",) if root >= 0 else (),
        payload=payload if payload is not None else _inline(encoded),
    )


def _send_tensor(encoded: Encoded | None, width: int, device: torch.device) -> torch.Tensor:
    """This rank's frame padded to ``width`` bytes, the padding zeroed: a reused buffer
    holds earlier transfers, and none of that goes on the wire."""
    send = empty_bytes(width, torch.device("cpu"))
    if encoded is None:
        send.numpy()[:] = 0
    else:
        encoded.write_into(send.numpy(), 0, width)
    return send.to(device)


def _decode_rows(out: torch.Tensor, counts: list[int], width: int) -> list[Any]:
    frames = out.cpu().numpy()
    return [decode(frames[r * width : r * width + n]) for r, n in enumerate(counts)]


def _decode_inline(payloads: list[torch.Tensor]) -> list[Any]:
    """The objects of frames that came inline, one per rank."""
    # each object gets its own copy of its bytes: results must not keep the table alive
    return [decode(p.cpu().numpy().copy()) for p in payloads]


def all_gather_object(data: Any, group: torch_dist.ProcessGroup | None = None) -> list[Any]:
    """Gather a picklable object from every rank on every rank.

    Args:
        data: Any picklable object; tensors and arrays in it are sent as raw buffers.
        group: Process group; the default group when None.

    Returns:
        One object per rank, index = rank.

    Raises:
        RemoteRankError: Some rank could not pickle its object (raised on every rank).

    Examples:
        >>> all_gather_object({"n": 1})  # a world of one
        [{'n': 1}]
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return []
    if get_world_size(group) == 1:
        return [data]
    encoded, error = _encode(data, "all_gather_object")
    peers = _exchange("all_gather_object", encoded, error, group)
    payloads = inline_payloads(peers)
    if payloads is not None:
        return _decode_inline(payloads)
    counts = [p.count for p in peers]
    width = max(counts)
    device = get_comm_device(group)
    try:
        local_fault("staging", "all_gather_object")
        send = _send_tensor(encoded, width, device)
        out = empty_bytes(len(counts) * width, device)
    except Exception as exc:
        error = exc
    agree("all_gather_object", error, group=group)
    with transport("all_gather_object", group):
        all_gather_flat(out, send, group=group)
    return _decode_rows(out, counts, width)


def gather_object(
    data: Any, dst: int = 0, group: torch_dist.ProcessGroup | None = None
) -> list[Any] | None:
    """Gather a picklable object from every rank on ``dst`` only.

    Args:
        data: Any picklable object.
        dst: Receiving rank (in ``group``).
        group: Process group; the default group when None.

    Returns:
        On ``dst`` one object per rank (index = rank); None elsewhere.

    Raises:
        RemoteRankError: Some rank could not pickle its object (raised on every rank).
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return None
    if get_world_size(group) == 1:
        _check_root("gather_object", dst, group, "dst")
        return [data]
    encoded, error = _encode(
        data, "gather_object", lambda: _check_root("gather_object", dst, group, "dst")
    )
    peers = _exchange("gather_object", encoded, error, group, root=dst)
    me = get_rank(group)
    payloads = inline_payloads(peers)
    if payloads is not None:
        return _decode_inline(payloads) if me == dst else None
    counts = [p.count for p in peers]
    width = max(counts)
    device = get_comm_device(group)
    out = None
    try:
        local_fault("staging", "gather_object")
        send = _send_tensor(encoded, width, device)
        if me == dst:
            out = empty_bytes(len(counts) * width, device)
    except Exception as exc:
        error = exc
    agree("gather_object", error, group=group)
    root = global_rank(group, dst)
    with transport("gather_object", group):
        if out is None:
            torch_dist.gather(send, None, dst=root, group=group)
            return None
        torch_dist.gather(send, list(out.view(len(counts), width).unbind(0)), dst=root, group=group)
    return _decode_rows(out, counts, width)


def broadcast_object_list(
    data: list[Any], src: int = 0, group: torch_dist.ProcessGroup | None = None
) -> None:
    """Replace the items of ``data`` on every rank with those of rank ``src``, in place.

    Args:
        data: A list; on ``src`` its items are sent, elsewhere they are replaced.
        src: Sending rank (in ``group``).
        group: Process group; the default group when None.

    Raises:
        TypeError: ``data`` is not a list.
        RemoteRankError: ``src`` could not pickle the list (raised on every rank).
    """

    if not_member(group):  # torch's behaviour outside a group: nothing
        return

    def check() -> None:
        _check_root("broadcast_object_list", src, group, "src")
        if not isinstance(data, list):
            message = f"broadcast_object_list: data must be a list, got {type(data).__name__}."
            raise TypeError(message)

    if get_world_size(group) == 1:
        check()
        return
    me = get_rank(group)
    if me == src:
        encoded, error = _encode(data, "broadcast_object_list", check)
    else:
        encoded, error = None, None
        try:
            check()
            local_fault("local", "broadcast_object_list")
        except Exception as exc:
            error = exc
    payload = None  # the whole frame, when it fits
    if encoded is not None and _has_direct_piece(encoded):
        # only the head, so the receivers know the plan before the first message
        payload = _inline(encoded, min(encoded.nbytes, inline_capacity(group)))
    peers = _exchange("broadcast_object_list", encoded, error, group, root=src, payload=payload)
    inline, nbytes = peers[src].payload, peers[src].count
    if inline is not None and inline.numel() == nbytes:  # the whole frame came inline
        if me != src:
            data[:] = decode(inline.cpu().numpy().copy())
        return
    # the rest of the frame follows in the messages of a plan every rank derives alike
    head = inline.cpu().numpy() if inline is not None else np.empty(0, dtype=np.uint8)
    plan = _broadcast_plan(head_lengths(head), head.size, nbytes)
    device = get_comm_device(group)
    root = global_rank(group, src)
    messages: list[torch.Tensor] = []
    try:
        local_fault("staging", "broadcast_object_list")
        if me == src:
            assert encoded is not None  # it pickled, or the handshake raised
            messages = [
                _plan_message(encoded, first, end, piece).to(device) for first, end, piece in plan
            ]
        else:
            buffer = empty_bytes(nbytes, device)
            if inline is not None:
                buffer[: inline.numel()].copy_(inline)
            messages = [buffer[first:end] for first, end, _ in plan]
    except Exception as exc:
        error = exc
    agree("broadcast_object_list", error, group=group)
    with transport("broadcast_object_list", group):
        for message in messages:
            torch_dist.broadcast(message, root, group=group)
    if me == src:
        return
    frame: np.ndarray[Any, np.dtype[np.uint8]] = buffer.cpu().numpy()
    data[:] = decode(frame)


# A piece of a broadcast frame at least this large is sent from its own memory instead of
# being copied into a message first: one collective more, one copy (and its memory) less.
DIRECT_BYTES = 4 << 20


def _has_direct_piece(encoded: Encoded) -> bool:
    return any(piece.nbytes >= DIRECT_BYTES for piece in encoded.pieces)


def _broadcast_plan(
    lengths: list[int] | None, start: int, nbytes: int
) -> list[tuple[int, int, int]]:
    """The messages that carry bytes ``[start, nbytes)`` of a frame.

    Each is ``(first byte, end, piece)``: ``piece`` is the index of a piece of at least
    ``DIRECT_BYTES`` sent from its own memory, or -1 for a run of smaller pieces copied
    into one message. ``lengths`` are the frame's piece lengths, None when the receivers
    lack the head: then the rest goes as one copied run. The root and the receivers compute
    the same plan from the same head.
    """
    if start >= nbytes:
        return []
    if lengths is None:
        return [(start, nbytes, -1)]
    plan: list[tuple[int, int, int]] = []
    run: tuple[int, int] | None = None
    for index, (offset, length) in enumerate(zip(frame_offsets(lengths), lengths, strict=True)):
        first, end = max(offset, start), offset + length
        if end <= first:
            continue
        if length >= DIRECT_BYTES:
            if run is not None:
                plan.append((*run, -1))
                run = None
            plan.append((first, end, index))
        else:
            run = (first if run is None else run[0], end)
    if run is not None:
        plan.append((*run, -1))
    return plan


def _plan_message(encoded: Encoded, first: int, end: int, piece: int) -> torch.Tensor:
    """The root's message for bytes ``[first, end)`` of its frame (see ``_broadcast_plan``)."""
    if piece < 0 or encoded.pieces[piece].readonly:  # never hand read-only memory to torch
        message = empty_bytes(end - first, torch.device("cpu"))
        encoded.write_into(message.numpy(), first, end)
        return message
    source = encoded.pieces[piece]  # a direct message always runs to the end of its piece
    view = np.frombuffer(source, dtype=np.uint8)[source.nbytes - (end - first) :]
    return torch.from_numpy(view)


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: torch_dist.ProcessGroup | None = None,
) -> None:
    """Send object ``i`` of ``scatter_object_input_list`` on ``src`` to rank ``i``.

    Each rank receives its object as ``scatter_object_output_list[0]``, like torch's call.
    Tensors and arrays in the objects travel as raw buffers, without pickling their bytes.

    Args:
        scatter_object_output_list: A list of at least one item; its first item is
            replaced with this rank's object.
        scatter_object_input_list: On ``src``, one picklable object per rank of the group;
            ignored on the other ranks.
        src: Sending rank (in ``group``).
        group: Process group; the default group when None.

    Raises:
        RemoteRankError: ``src``'s input list has the wrong length or cannot be pickled, or
            a rank's output list is not a non-empty list (raised on every rank).
        CollectiveMismatchError: Ranks passed different ``src``.

    Examples:
        >>> out = [None]
        >>> scatter_object_list(out, [{"part": 0}], src=0)  # a world of one
        >>> out
        [{'part': 0}]
    """
    if not_member(group):  # torch's behaviour outside a group: nothing
        return
    world = get_world_size(group)
    me = get_rank(group)

    def check() -> None:
        _check_root("scatter_object_list", src, group, "src")
        output = scatter_object_output_list
        if not isinstance(output, list) or not output:
            message = (
                "scatter_object_list: scatter_object_output_list must be a list of at least "
                f"one item (its first item receives the object), got {output!r:.60}."
            )
            raise ValueError(message)
        if me != src:
            return
        given = scatter_object_input_list
        if not isinstance(given, (list, tuple)) or len(given) != world:
            got = f"{len(given)} items" if isinstance(given, (list, tuple)) else repr(given)
            message = (
                f"scatter_object_list: on the source rank {src}, scatter_object_input_list "
                f"must hold one object per rank of the group ({world}), got {got:.60}."
            )
            raise ValueError(message)

    if world == 1:
        check()
        assert scatter_object_input_list is not None
        scatter_object_output_list[0] = scatter_object_input_list[0]
        return
    frames: list[Encoded] = []
    error: BaseException | None = None
    try:
        check()
        local_fault("local", "scatter_object_list")
        if me == src:
            assert scatter_object_input_list is not None
            frames = [encode(obj) for obj in scatter_object_input_list]
    except Exception as exc:
        error = exc
    sizes = np.array([f.nbytes for f in frames], dtype=np.int64)
    payload = None
    if frames:
        whole = sizes.nbytes + int(sizes.sum())
        payload = _scatter_payload(sizes, frames if whole <= inline_capacity(group) else [])
    peers = handshake(
        Header("scatter_object_list", error=error, root=src, count=int(sizes.sum())),
        group,
        same=("root",),
        hint="scatter_object_list needs the same src on every rank.",
        payload=payload,
    )
    inline = peers[src].payload
    device = get_comm_device(group)
    if inline is None:  # inline data switched off: the sizes come in a broadcast first
        table = torch.from_numpy(sizes) if me == src else torch.empty(world, dtype=torch.int64)
        table = table.to(device)
        with transport("scatter_object_list", group):
            torch_dist.broadcast(table, global_rank(group, src), group=group)
        counts: list[int] = table.cpu().tolist()
    else:
        head = inline[: 8 * world].cpu().numpy().copy()
        counts = head.view(np.int64).tolist()
        if inline.numel() > 8 * world:  # the objects came inline too
            start = 8 * world + sum(counts[:me])
            mine = inline[start : start + counts[me]].cpu().numpy().copy()
            scatter_object_output_list[0] = decode(mine)
            return
    width = max(counts)
    rows: list[torch.Tensor] | None = None
    receive = torch.empty(0, dtype=torch.uint8)
    try:
        local_fault("staging", "scatter_object_list")
        receive = empty_bytes(width, device)
        if me == src:
            block = empty_bytes(world * width, torch.device("cpu"))
            array = block.numpy()
            for index, frame in enumerate(frames):  # each row zero-padded to ``width``
                frame.write_into(array[index * width : (index + 1) * width], 0, width)
            rows = list(block.to(device).view(world, width).unbind(0))
    except Exception as exc:
        error = exc
    agree("scatter_object_list", error, group=group)
    with transport("scatter_object_list", group):
        torch_dist.scatter(receive, rows, src=global_rank(group, src), group=group)
    scatter_object_output_list[0] = decode(receive[: counts[me]].cpu().numpy().copy())


def _scatter_payload(sizes: np.ndarray[Any, np.dtype[np.int64]], frames: list[Encoded]) -> Inline:
    """The root's inline data: every frame's size, then (when they fit) the frames."""
    nbytes = sizes.nbytes + sum(f.nbytes for f in frames)

    def write(out: torch.Tensor) -> None:
        host = out if out.device.type == "cpu" else torch.empty_like(out, device="cpu")
        array = host.numpy()
        array[: sizes.nbytes] = sizes.view(np.uint8)
        offset = sizes.nbytes
        for frame in frames:
            frame.write_into(array[offset : offset + frame.nbytes])
            offset += frame.nbytes
        if host is not out:
            out.copy_(host)

    return Inline(nbytes, write)
