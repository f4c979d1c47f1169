"""The error every checkpoint function raises on purpose."""

from __future__ import annotations

from comm_collectives import CommError

__all__ = ["CheckpointError"]


class CheckpointError(CommError):
    """A checkpoint cannot be written, read or loaded into this model.

    The message names the file or folder, what was expected, what was found, the rank,
    and how to fix it. Collective functions raise it on every rank that took part. A
    `CommError` (a `RuntimeError`), so one ``except CommError`` covers every comm package.
    """
