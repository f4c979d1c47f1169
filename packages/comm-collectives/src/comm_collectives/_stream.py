"""Part streams: a sending rank pickles while rank 0 unpickles (used by collect_results).

A sender pickles its part into a ``PartWriter``, rank 0 unpickles it from a
``PartReader``. The sender announces its part in the call's handshake, in one of
three shapes, chosen by size:

- **inline** (``count == 0``): the whole pickle fits the group's inline capacity and rides
  in the handshake frame; no message follows.
- **one message** (``count > 0``): the pickler finished before writing its first 64 KiB
  frame; the part goes as one frame of ``count`` bytes (stream, then the out-of-band
  buffers), as in ``serialization.encode``.
- **streamed** (``count == STREAMED``): a larger part is sent while it is being pickled,
  so rank 0 rebuilds the first chunks while the sender pickles the rest. The first bytes
  ride in the handshake frame; the rest follows in messages of exactly
  ``CHUNK_BYTES``:

      int64 [kind, payload bytes, extra] | pad to 64 bytes | payload

  ``DATA`` says more follows. ``LAST`` ends the stream; its ``extra`` is the size of the
  frame of out-of-band buffers (tensors and arrays in the part), sent next as one
  message. ``FAILED`` says the sender could not pickle the rest of its part.

Rank 0 posts its receives before it needs them: on gloo, a message that finds no receive
posted waits for an exchange of notifications between the two ranks' transport threads,
which costs milliseconds on a busy machine. For a stream it keeps ``WINDOW`` receives
posted ahead of the one it reads. It cannot know where a stream ends, so after ``LAST`` or
``FAILED``, the sender sends ``WINDOW - 1`` filler messages, one for each receive still
posted: nothing is left posted to catch a later call's messages.

Every send and receive is waited on through ``_watch.wait_p2p``: a peer that left the call
after a transport error (a sender whose handshake failed, a rank 0 that left) does not
leave the other waiting for the process group's timeout.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

from ._buffers import empty_bytes
from ._serialization import decode, frame_nbytes, frame_pieces, load, write_frame
from ._watch import wait_p2p

__all__ = [
    "CHUNK_BYTES",
    "POST_AHEAD_BYTES",
    "STREAMED",
    "WINDOW",
    "ChunkBuffer",
    "PartReader",
    "PartWriter",
    "PeerFailedError",
]

CHUNK_BYTES = 128 * 1024
WINDOW = 4
STREAMED = -1
_STREAM_AT = 64 * 1024  # the C pickler writes its first frame at 64 KiB
_HEAD = 64
_PAYLOAD = CHUNK_BYTES - _HEAD
DATA, LAST, FAILED, FILLER = 0, 1, 2, 3
POST_AHEAD_BYTES = 4 * 1024 * 1024
"""A part sent as one message is received ahead (before the previous part is unpickled)
only up to this size, so rank 0 holds at most one large part buffer at a time."""
_OPERATION = "collect_results"  # the call the streams belong to, named in the errors


class PeerFailedError(Exception):
    """The sender of a stream could not pickle its part (it reports why itself)."""


class PartWriter:
    """The file a sending rank's pickler writes into.

    A streamed part's handshake starts when the pickler's first frame is there, and the
    pickler makes its second frame while the handshake's frames travel; the writer then
    waits for the handshake's outcome and sends at once what it has (not waiting for a
    full chunk), so rank 0, idle until then, starts unpickling early.

    Args:
        announce: Starts the call's handshake with the bytes to send inline and the part's
            shape (``count``, see the module docstring); the returned callable waits for
            it and raises on every rank when the ranks disagree or a rank failed.
        head_size: Bytes that may travel inline in the handshake.
        dst: Global rank of the receiver.
        group: Process group of the transfer.
        device: Device the group's messages live on.

    Attributes:
        stage: ``"pickling"`` (nothing announced yet), ``"announcing"`` (the handshake
            started, its outcome not known), ``"streaming"`` (chunks may follow) or
            ``"closed"`` (also after a failed send: what follows is the transport's error).
    """

    def __init__(
        self,
        announce: Callable[[bytearray, int], Callable[[], None]],
        head_size: int,
        dst: int,
        group: torch_dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self._announce_to = announce
        self._head_size = max(0, min(head_size, _PAYLOAD))
        self._dst = dst
        self._group = group
        self._device = device
        self._pending = bytearray()
        self._chunk = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)  # no stale memory is sent
        self._announced: Callable[[], None] | None = None
        self._sent = 0
        self.stage = "pickling"

    def write(self, data: Any) -> int:
        """Take the pickler's next frame; stream every full chunk once the part is announced."""
        self._pending += data
        if self.stage == "pickling" and len(self._pending) >= _STREAM_AT:
            head = self._pending[: self._head_size]
            del self._pending[: len(head)]
            self._start(head, STREAMED)
        elif self.stage == "announcing":
            self.confirm()
        if self.stage == "streaming":
            while len(self._pending) >= _PAYLOAD:
                self._send(DATA, _PAYLOAD)
            if not self._sent and self._pending:  # the first chunk goes at once
                self._send(DATA, len(self._pending))
        return memoryview(data).nbytes

    def confirm(self) -> None:
        """Wait for the started handshake's outcome (stage ``"announcing"``).

        Raises on every rank what the handshake raises; the stage then stays
        ``"announcing"`` and nothing more may be sent.
        """
        announced, self._announced = self._announced, None
        if announced is None:
            return
        announced()
        self.stage = "streaming"

    def finish(self, buffers: list[memoryview]) -> None:
        """Send the rest once the pickler is done; ``buffers`` are its out-of-band buffers."""
        if self.stage == "pickling":
            if not buffers and len(self._pending) <= self._head_size:
                self._announce(self._pending, 0)
                return
            frame = _frame([memoryview(self._pending), *buffers])
            self._announce(bytearray(), frame.numel())
            self._transfer(frame.to(self._device))
            return
        self.confirm()
        while len(self._pending) > _PAYLOAD:
            self._send(DATA, _PAYLOAD)
        extra = _frame([memoryview(b""), *buffers]) if buffers else None
        self.stage = "closed"  # from here on a failure is the transport's, not the part's
        self._send(LAST, len(self._pending), 0 if extra is None else extra.numel())
        self._fill()
        if extra is not None:
            self._transfer(extra.to(self._device))

    def fail(self) -> None:
        """Tell the receiver that the rest of the stream will not come (stage ``"streaming"``)."""
        self.stage = "closed"
        self._pending.clear()
        self._send(FAILED, 0)
        self._fill()

    def _start(self, head: bytearray, count: int) -> None:
        self.stage = "announcing"
        self._announced = self._announce_to(head, count)

    def _announce(self, head: bytearray, count: int) -> None:
        self._start(head, count)
        self.confirm()
        self.stage = "closed"

    def _send(self, kind: int, nbytes: int, extra: int = 0) -> None:
        out = self._chunk.numpy()
        out[:24].view(np.int64)[:] = (kind, nbytes, extra)
        if nbytes:
            out[_HEAD : _HEAD + nbytes] = np.frombuffer(self._pending, dtype=np.uint8, count=nbytes)
            del self._pending[:nbytes]
        self._transfer(self._chunk.to(self._device))
        self._sent += 1

    def _fill(self) -> None:
        self._chunk.numpy()[:24].view(np.int64)[:] = (FILLER, 0, 0)
        self._transfer(self._chunk.to(self._device), WINDOW - 1)

    def _transfer(self, message: torch.Tensor, times: int = 1) -> None:
        """Send ``message`` to the receiver ``times`` times (posted together, waited on
        together); after a failure the stage is ``"closed"``."""
        try:
            works = [torch_dist.isend(message, self._dst, group=self._group) for _ in range(times)]
            wait_p2p([w for w in works if w is not None], _OPERATION, self._group, self._device)
        except BaseException:
            self.stage = "closed"
            raise


def _frame(pieces: list[memoryview]) -> torch.Tensor:
    """A CPU tensor holding the frame of ``pieces`` (the stream, then the buffers)."""
    frame = empty_bytes(frame_nbytes(pieces), torch.device("cpu"))
    write_frame(frame.numpy(), pieces)
    return frame


class PartReader:
    """The file rank 0's unpickler reads one sender's part from.

    Args:
        head: The bytes that came inline in the handshake.
        count: The part's shape, as announced (see the module docstring).
        src: Global rank of the sender.
        group: Process group of the transfer.
        device: Device the group's messages live on.
    """

    def __init__(
        self,
        head: bytes,
        count: int,
        src: int,
        group: torch_dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self._buffer = ChunkBuffer()
        self._buffer.append(head)
        self._count = count
        self._src = src
        self._group = group
        self._device = device
        self._slots: list[torch.Tensor] = []
        self._works: list[Any] = []
        self._next = 0
        self._ended = count != STREAMED
        self._failed = False
        self._extra_nbytes = 0
        self._extra: list[memoryview] | None = None
        self._received = count == 0  # a part in one message: whether it has been received

    @property
    def count(self) -> int:
        """The part's shape as announced: 0 inline, > 0 bytes of one message, or STREAMED."""
        return self._count

    def post(self) -> None:
        """Post the receives this part needs first (once; an inline part needs none)."""
        if self._slots or self._count == 0:
            return
        if self._count > 0:
            self._slots = [empty_bytes(self._count, self._device)]
        else:
            self._slots = [
                torch.empty(CHUNK_BYTES, dtype=torch.uint8, device=self._device)
                for _ in range(WINDOW)
            ]
        self._works = [self._receive(slot) for slot in self._slots]

    def load(self) -> Any:
        """Rebuild the part; a streamed part is unpickled as its chunks arrive.

        Raises:
            PeerFailedError: The sender could not pickle the rest of its stream.
        """
        if self._count > 0:
            frame = self._receive_whole()
            return decode(frame.cpu().numpy())
        return load(self, self._extra_buffers())

    def finish(self) -> None:
        """Receive what is left of the part (all of it after a failure) and let it go."""
        if self._count > 0 and not self._received:
            self._receive_whole()
        while not self._ended:
            self._pull()
        if not self._failed and self._extra is None and self._extra_nbytes:
            self._receive_extra()
        self._buffer = ChunkBuffer()
        self._extra = None
        self._slots = []

    # the file interface of pickle.Unpickler

    def read(self, n: int) -> bytes:
        while self._buffer.size < n and not self._ended:
            self._pull()
        if self._failed:
            raise PeerFailedError
        return self._buffer.read(n)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while self._buffer.size < view.nbytes and not self._ended:
            self._pull()
        if self._failed:
            raise PeerFailedError
        return self._buffer.readinto(view)

    def readline(self) -> bytes:
        while not self._buffer.has_line() and not self._ended:
            self._pull()
        if self._failed:
            raise PeerFailedError
        return self._buffer.readline()

    def _receive_whole(self) -> torch.Tensor:
        self.post()
        self._wait(self._works[0])
        self._received = True
        frame, self._slots = self._slots[0], []
        return frame

    def _receive(self, slot: torch.Tensor) -> Any:
        return torch_dist.irecv(slot, self._src, group=self._group)

    def _wait(self, works: Any) -> None:
        wait_p2p(works, _OPERATION, self._group, self._device)

    def _pull(self) -> None:
        self.post()
        index = self._next % WINDOW
        self._wait(self._works[index])
        slot = self._slots[index]
        message = slot.cpu().numpy()
        kind, nbytes, extra = message[:24].view(np.int64).tolist()
        payload = message[_HEAD : _HEAD + nbytes].tobytes()
        self._next += 1
        if kind == DATA:
            self._works[index] = self._receive(slot)  # its payload is copied out: reuse it
        else:
            self._ended = True
            self._failed = kind == FAILED
            self._extra_nbytes = extra
            # the fillers of the receives still posted
            self._wait([self._works[(index + later) % WINDOW] for later in range(1, WINDOW)])
        self._buffer.append(payload)

    def _receive_extra(self) -> None:
        frame = empty_bytes(self._extra_nbytes, self._device)
        self._wait(self._receive(frame))
        self._extra = frame_pieces(frame.cpu().numpy())[1:]

    def _extra_buffers(self) -> Iterator[memoryview]:
        # runs on the first out-of-band buffer the stream refers to: the buffers come after
        # the stream, so the rest of the stream is received (and kept) first
        while not self._ended:
            self._pull()
        if self._failed:
            raise PeerFailedError
        if self._extra is None and self._extra_nbytes:
            self._receive_extra()
        yield from self._extra or ()


class ChunkBuffer:
    """The received, not yet unpickled bytes of a stream: a queue of chunks and an offset.

    Appending keeps the chunks as they are and reading copies each byte out once, so a part
    is rebuilt in time linear in its size however large its in-band objects are (joining
    the rest with every new chunk would copy a large object once per chunk).

    Attributes:
        size: Bytes buffered and not yet read.
        copied: Bytes copied out so far: each byte is copied out once, when it is read.
    """

    def __init__(self) -> None:
        self._chunks: deque[bytes] = deque()
        self._offset = 0  # into the first chunk
        self.size = 0
        self.copied = 0

    def append(self, chunk: bytes) -> None:
        """Queue ``chunk`` after the bytes already buffered."""
        if chunk:
            self._chunks.append(chunk)
            self.size += len(chunk)

    def read(self, n: int) -> bytes:
        """Return the next ``n`` bytes (fewer when fewer are buffered)."""
        n = max(0, min(n, self.size))
        first = self._chunks[0] if self._chunks else b""
        if self._offset + n <= len(first):  # the common case: inside one chunk
            out = first[self._offset : self._offset + n]
            self._consume(n)
        else:
            joined = bytearray(n)
            self._copy_into(memoryview(joined))
            out = bytes(joined)
        self.copied += len(out)
        return out

    def readinto(self, view: memoryview) -> int:
        """Copy the next bytes into ``view``; return how many were copied."""
        n = min(view.nbytes, self.size)
        self._copy_into(view[:n])
        self.copied += n
        return n

    def has_line(self) -> bool:
        """Whether a newline is buffered."""
        return any(
            chunk.find(b"\n", self._offset if index == 0 else 0) >= 0
            for index, chunk in enumerate(self._chunks)
        )

    def readline(self) -> bytes:
        """Return the bytes up to and including the next newline (or all that is buffered)."""
        n = 0
        for index, chunk in enumerate(self._chunks):
            start = self._offset if index == 0 else 0
            end = chunk.find(b"\n", start)
            if end >= 0:
                n += end + 1 - start
                break
            n += len(chunk) - start
        return self.read(n)

    def _copy_into(self, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            first = self._chunks[0]
            take = min(view.nbytes - done, len(first) - self._offset)
            view[done : done + take] = memoryview(first)[self._offset : self._offset + take]
            done += take
            self._consume(take)

    def _consume(self, n: int) -> None:
        self._offset += n
        self.size -= n
        while self._chunks and self._offset >= len(self._chunks[0]):
            self._offset -= len(self._chunks.popleft())
