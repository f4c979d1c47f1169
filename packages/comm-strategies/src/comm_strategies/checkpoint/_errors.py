"""The error every checkpoint function raises on purpose, and where its warnings point."""

from __future__ import annotations

import inspect
import os

from comm_collectives import CommError

__all__ = ["CheckpointError", "outside_package"]


class CheckpointError(CommError):
    """A checkpoint cannot be written, read or loaded into this model.

    The message names the file or folder, what was expected, what was found, the rank,
    and how to fix it. Collective functions raise it on every rank that took part. A
    `CommError` (a `RuntimeError`), so one ``except CommError`` covers every comm package.
    """


def outside_package() -> int:
    """The ``stacklevel`` of the first caller outside comm_strategies, for a warning of
    the function that calls this."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    level, frame = 1, inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # the function that warns: level 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        level += 1
        frame = frame.f_back
    return level
