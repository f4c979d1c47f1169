"""Turn objects into one flat byte frame with tensors and arrays kept out of the pickle stream.

Pickle protocol 5 hands contiguous buffers (numpy arrays, and torch tensors through
``_Pickler.reducer_override``) to a callback instead of copying them into the stream.
A frame lays them out after the stream, each 64-byte aligned:

    [n_buffers, stream_len, len_0 ... len_n-1] (int64) | pad | stream | pad | buf_0 | pad | ...

Writing a frame copies each buffer once into the send tensor; reading rebuilds the arrays
and tensors as views of the receive tensor, without a copy. ``dump`` and ``load``
work on file-like objects instead, for the chunked streams of ``comm_collectives.stream``.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickle
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "Encoded",
    "decode",
    "dump",
    "encode",
    "frame_nbytes",
    "frame_offsets",
    "frame_pieces",
    "head_lengths",
    "load",
    "write_frame",
]

_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _rebuild_tensor(
    buffer: Any, dtype: torch.dtype, shape: Sequence[int], requires_grad: bool, parameter: bool
) -> torch.Tensor:
    view = memoryview(buffer)
    if view.readonly:
        view = memoryview(bytearray(view))
    flat = (
        torch.frombuffer(view, dtype=torch.uint8)
        if view.nbytes
        else torch.empty(0, dtype=torch.uint8)
    )
    tensor = flat.view(dtype).reshape(tuple(shape))
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


class _Pickler(pickle.Pickler):
    """Protocol-5 pickler that sends dense tensors out of band, as raw bytes."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):  # other subclasses: as usual
            return NotImplemented
        if obj.layout != torch.strided or obj.is_quantized or obj.device.type == "meta":
            return NotImplemented
        tensor = obj.detach().resolve_conj().resolve_neg()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        raw = (
            tensor.reshape(-1).view(torch.uint8)
            if tensor.numel()
            else tensor.new_empty(0, dtype=torch.uint8)
        )
        return (
            _rebuild_tensor,
            (
                pickle.PickleBuffer(raw.numpy().data),
                tensor.dtype,
                tuple(tensor.shape),
                obj.requires_grad,
                isinstance(obj, torch.nn.Parameter),
            ),
        )


# A frame: int64 [number of buffers, length of each piece] | pieces, each 64-byte aligned.
# The first piece is the pickle stream, the others its out-of-band buffers.


def frame_offsets(lengths: Sequence[int]) -> list[int]:
    """Where each piece of a frame starts, for pieces of ``lengths`` bytes."""
    offsets = []
    offset = _aligned(8 * (1 + len(lengths)))
    for length in lengths:
        offsets.append(offset)
        offset += _aligned(length)
    return offsets


def frame_nbytes(pieces: Sequence[memoryview]) -> int:
    """Size of the frame that holds ``pieces`` (the stream, then the buffers)."""
    if not pieces:
        return _aligned(8)
    return frame_offsets([p.nbytes for p in pieces])[-1] + _aligned(pieces[-1].nbytes)


def write_frame(
    out: np.ndarray[Any, np.dtype[np.uint8]],
    pieces: Sequence[memoryview],
    start: int = 0,
    stop: int | None = None,
) -> None:
    """Write bytes ``[start, stop)`` of the frame of ``pieces`` into ``out`` (the whole frame
    by default). The padding between pieces, and any byte past the frame's end, is zeroed:
    no stale memory goes on the wire."""
    stop = frame_nbytes(pieces) if stop is None else stop
    head = np.array([len(pieces) - 1, *(p.nbytes for p in pieces)], dtype=np.int64)
    parts = [(0, memoryview(head.tobytes()))]
    parts += zip(frame_offsets([p.nbytes for p in pieces]), pieces)
    cursor = start
    for offset, piece in parts:
        first, end = max(offset, start), min(offset + piece.nbytes, stop)
        if end <= first:
            continue
        out[cursor - start : first - start] = 0
        source = np.frombuffer(piece, dtype=np.uint8)
        out[first - start : end - start] = source[first - offset : end - offset]
        cursor = end
    out[cursor - start : stop - start] = 0


def head_lengths(prefix: np.ndarray[Any, np.dtype[np.uint8]]) -> list[int] | None:
    """The piece lengths a frame's head gives, or None when ``prefix`` lacks part of the head."""
    if prefix.size < 8:
        return None
    end = 8 * (2 + int(prefix[:8].view(np.int64)[0]))
    if prefix.size < end:
        return None
    lengths: list[int] = prefix[8:end].view(np.int64).tolist()
    return lengths


def frame_pieces(frame: np.ndarray[Any, np.dtype[np.uint8]]) -> list[memoryview]:
    """The pieces of a frame (the stream, then the buffers), as views of ``frame``."""
    lengths = head_lengths(frame)
    if lengths is None:
        message = f"a frame of {frame.size} bytes is shorter than its own head"
        raise ValueError(message)
    return [
        frame[offset : offset + length].data
        for offset, length in zip(frame_offsets(lengths), lengths, strict=True)
    ]


class Encoded:
    """An object pickled with its buffers kept aside, ready to be written as a frame."""

    def __init__(self, obj: Any) -> None:
        stream = io.BytesIO()
        buffers = dump(obj, stream)
        self._pieces = [stream.getbuffer(), *buffers]
        self.nbytes = frame_nbytes(self._pieces)

    @property
    def pieces(self) -> list[memoryview]:
        """The pickle stream, then the out-of-band buffers."""
        return self._pieces

    def write_into(
        self, out: np.ndarray[Any, np.dtype[np.uint8]], start: int = 0, stop: int | None = None
    ) -> None:
        """Write bytes ``[start, stop)`` of the frame (all of it by default) into ``out``."""
        write_frame(out, self._pieces, start, stop)


def dump(obj: Any, file: Any) -> list[memoryview]:
    """Pickle ``obj`` into ``file`` (anything with ``write``); return its out-of-band buffers.

    The stream reaches ``file`` in frames of about 64 KiB as pickling goes, so a writer can
    send the first frames while the rest is still being pickled.
    """
    buffers: list[memoryview] = []

    def keep(buffer: pickle.PickleBuffer) -> None:
        buffers.append(buffer.raw())

    _Pickler(file, protocol=5, buffer_callback=keep).dump(obj)
    return buffers


def encode(obj: Any) -> Encoded:
    """Pickle ``obj`` (protocol 5, tensors and arrays out of band)."""
    return Encoded(obj)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: unpickling creates many containers and none
    of them are garbage yet, so collections triggered meanwhile are pure cost (for 20,000
    results holding lists and tuples, 10x the unpickling itself)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load(file: Any, buffers: Iterable[Any] = ()) -> Any:
    """Unpickle from ``file`` (``read``, ``readinto``, ``readline``) as it arrives.

    ``buffers`` is consumed only when the stream reaches its first out-of-band buffer, so it
    may be a generator that waits for them.
    """
    with _gc_paused():
        return pickle.Unpickler(file, buffers=buffers).load()


def decode(frame: np.ndarray[Any, np.dtype[np.uint8]]) -> Any:
    """Rebuild the object of a frame; arrays and tensors become views of ``frame``."""
    pieces = frame_pieces(frame)
    with _gc_paused():
        return pickle.loads(pieces[0], buffers=pieces[1:])
