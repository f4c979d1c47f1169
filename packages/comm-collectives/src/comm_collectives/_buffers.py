"""Reusable host buffers for large transfers.

A fresh buffer of tens of megabytes costs a page fault per 4 KiB page the first time it is
written: on a 64 MiB receive buffer that is as long as the transfer itself. Large CPU
buffers therefore come from a small cache and go back to it when the last array, tensor or
view that uses them is gone (a ``weakref.finalize`` on the array every view leads back to),
so a buffer is never reused while anything can still read it.

The cache holds at most ``COMM_BUFFER_CACHE_MB`` MiB (default 256) of idle buffers;
[`empty_cache`][comm_collectives.empty_cache] gives them back to the system.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref

import numpy as np
import torch

__all__ = ["empty_bytes", "empty_cache"]

_MIN_POOLED = 1 << 20  # smaller buffers come from malloc's heap, already warm
_GRAIN = 1 << 20


_DEFAULT_MB = 256.0
_warned: set[str] = set()


def _limit() -> int:
    """The cache's size in bytes; a value that is not a number is ignored with a warning.

    Never raises: it is read where a buffer comes back, inside a ``weakref.finalize``
    callback, where an exception is only printed and the buffer would be dropped, and a
    setting that differs between ranks must not make one rank fail in a collective.
    """
    raw = os.environ.get("COMM_BUFFER_CACHE_MB", "").strip()
    if not raw:
        return int(_DEFAULT_MB * 2**20)
    try:
        value = float(raw)
        if value != value:  # nan
            raise ValueError
    except ValueError:
        if raw not in _warned:
            _warned.add(raw)
            message = (
                f"COMM_BUFFER_CACHE_MB must be a number of MiB, got {raw!r}; the default "
                f"{_DEFAULT_MB:g} MiB is used. Set it to a number (0 keeps no buffers)."
            )
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        value = _DEFAULT_MB
    return int(min(max(value, 0.0), 2.0**40) * 2**20)  # -inf: none; inf: no limit in practice


class _Pool:
    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._lock = threading.RLock()  # finalizers may run inside take() on this thread

    def take(self, nbytes: int) -> torch.Tensor:
        backing = None
        with self._lock:
            fitting = [b for b in self._free if len(b) >= nbytes]
            if fitting:
                backing = min(fitting, key=len)
                self._free.remove(backing)
        if backing is None:
            backing = bytearray((nbytes + _GRAIN - 1) // _GRAIN * _GRAIN)
        # The lease's base is the bytearray (not an ndarray), so numpy never collapses a
        # view's base past it: every view keeps the lease alive.
        lease = np.frombuffer(backing, dtype=np.uint8, count=nbytes)
        weakref.finalize(lease, self._give_back, backing)
        return torch.from_numpy(lease)

    def _give_back(self, backing: bytearray) -> None:
        limit = _limit()
        with self._lock:
            self._free.append(backing)
            while self._free and sum(len(b) for b in self._free) > limit:
                self._free.pop(0)  # the oldest goes first

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._free)


_pool = _Pool()


def empty_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` on ``device``; large CPU ones are cached."""
    if device.type != "cpu" or nbytes < _MIN_POOLED:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return _pool.take(nbytes)


def empty_cache() -> None:
    """Release the idle transfer buffers comm-collectives keeps for reuse.

    Buffers still in use (results that are views of a receive buffer) are not affected;
    they are freed when the last view goes.
    """
    _pool.clear()
