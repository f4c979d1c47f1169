"""The error every checkpoint function raises on purpose."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read or loaded into this model.

    The message names the file or folder, what was expected, what was found, the rank,
    and how to fix it. Collective functions raise it on every rank that took part.
    """
