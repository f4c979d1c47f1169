"""A byte-counting progress bar for the converter's writes, and ``torch.save`` through it."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

from ._files import write_private


class Progress:
    """A text progress bar on a stream (stderr), by bytes; silent when disabled."""

    def __init__(self, label: str, total: int, *, enabled: bool, stream: IO[str] | None = None):
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._shown = -1
        self._start = time.monotonic()

    def advance(self, amount: int) -> None:
        self.done += amount
        percent = min(100, self.done * 100 // self.total)
        if self.enabled and percent != self._shown:
            self._shown = percent
            filled = percent * 30 // 100
            bar = "#" * filled + "." * (30 - filled)
            mib = self.done / 2**20
            self.stream.write(f"\r{self.label} [{bar}] {percent:3d}% {mib:,.1f} MiB")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            seconds = time.monotonic() - self._start
            self.stream.write(f" ({seconds:.1f} s)\n")
            self.stream.flush()


class _CountingWriter:
    """A binary file that reports the bytes written to a `Progress`."""

    def __init__(self, handle: IO[bytes], progress: Progress) -> None:
        self.handle = handle
        self.progress = progress

    def write(self, data: Any) -> int:
        written = self.handle.write(data)
        self.progress.advance(len(memoryview(data).cast("B")))
        return written

    def flush(self) -> None:
        self.handle.flush()


def _nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    return 0


def save_with_progress(obj: Any, path: Path, *, progress: bool, label: str) -> None:
    """``torch.save`` to a private file through a temporary name, with a progress bar."""
    bar = Progress(label, _nbytes(obj), enabled=progress)
    try:
        write_private(path, lambda handle: torch.save(obj, _CountingWriter(handle, bar)))  # type: ignore[arg-type]
    finally:
        bar.close()
