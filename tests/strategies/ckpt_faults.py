"""Faults injected into one rank of a checkpoint call, for the tests of its outcomes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import comm_collectives as dist


@contextmanager
def manifest_unreadable_on(rank: int) -> Iterator[None]:
    """While in use, ``load_checkpoint`` cannot read a manifest on ``rank`` (an OSError
    "stale file handle", as a stale network filesystem gives); the other ranks read it."""
    from comm_strategies.checkpoint import _load

    original = _load.read_manifest
    if dist.get_rank() == rank:

        def unreadable(source: Path) -> Any:
            raise OSError("stale file handle")

        _load.read_manifest = unreadable
    try:
        yield
    finally:
        _load.read_manifest = original
