"""Turn objects into one flat byte frame with tensors and arrays kept out of the pickle stream.

Pickle protocol 5 hands contiguous buffers (numpy arrays, and torch tensors through
:meth:`_Pickler.reducer_override`) to a callback instead of copying them into the stream.
A frame lays them out after the stream, each 64-byte aligned:

    [n_buffers, stream_len, len_0 ... len_n-1] (int64) | pad | stream | pad | buf_0 | pad | ...

Writing a frame copies each buffer once into the send tensor; reading rebuilds the arrays
and tensors as views of the receive tensor, without a copy.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Encoded", "decode", "encode"]

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
        tensor = obj.detach()
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


class Encoded:
    """An object pickled with its buffers kept aside, ready to be written as a frame."""

    def __init__(self, obj: Any) -> None:
        self._buffers: list[memoryview] = []
        stream = io.BytesIO()
        _Pickler(stream, protocol=5, buffer_callback=self._keep).dump(obj)
        self._stream = stream.getbuffer()
        offset = _aligned(8 * (2 + len(self._buffers))) + _aligned(self._stream.nbytes)
        for buf in self._buffers:
            offset += _aligned(buf.nbytes)
        self.nbytes = offset

    def _keep(self, buffer: pickle.PickleBuffer) -> None:
        self._buffers.append(buffer.raw())

    def write_into(self, out: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        """Write the frame into the first :attr:`nbytes` bytes of ``out``."""
        lengths = [self._stream.nbytes] + [b.nbytes for b in self._buffers]
        head = np.array([len(self._buffers), *lengths], dtype=np.int64)
        out[: head.nbytes] = head.view(np.uint8)
        offset = _aligned(head.nbytes)
        for piece in [self._stream, *self._buffers]:
            out[offset : offset + piece.nbytes] = np.frombuffer(piece, dtype=np.uint8)
            offset += _aligned(piece.nbytes)

    def to_tensor(self) -> torch.Tensor:
        """Return the frame as a new uint8 tensor of :attr:`nbytes` bytes."""
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        self.write_into(out.numpy())
        return out


def encode(obj: Any) -> Encoded:
    """Pickle ``obj`` (protocol 5, tensors and arrays out of band)."""
    return Encoded(obj)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: unpickling creates many containers and none
    of them are garbage yet, so collections triggered meanwhile are pure cost (~30%)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def decode(frame: np.ndarray[Any, np.dtype[np.uint8]]) -> Any:
    """Rebuild the object of a frame; arrays and tensors become views of ``frame``."""
    n_buffers = int(frame[:8].view(np.int64)[0])
    lengths = frame[8 : 8 * (2 + n_buffers)].view(np.int64).tolist()
    offset = _aligned(8 * (2 + n_buffers))
    pieces = []
    for length in lengths:
        pieces.append(frame[offset : offset + length].data)
        offset += _aligned(length)
    with _gc_paused():
        return pickle.loads(pieces[0], buffers=pieces[1:])
