"""`NativeCheckpoint`: a backend's own checkpoint files, saved and loaded by the backend.

DeepSpeed engines have them (``engine.save_checkpoint`` / ``engine.load_checkpoint``: each
rank's partitions, in the engine's own layout); the other backends have none, and
`Backend.native_checkpoint` returns None for them. The checkpoint package calls this
protocol and never the engine itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

__all__ = ["NativeCheckpoint"]


class NativeCheckpoint(Protocol):
    """Save and load a backend's own checkpoint files (collective: every rank calls).

    Get one from [`Backend.native_checkpoint`][comm_wrappers.backends.Backend.native_checkpoint]
    (None for backends without files of their own). The files are the fast path into a
    model of the same layout; `fits` says whether a folder has it.
    """

    def save(self, folder: Path, tag: str) -> None:
        """Write the backend's own files under ``folder/tag`` (collective).

        Args:
            folder: The folder of the tags (DeepSpeed's ``save_dir``); created if missing.
            tag: The name of this checkpoint's subfolder. No ``latest`` file is written.
        """
        ...

    def load(
        self,
        folder: Path,
        tag: str | None,
        *,
        strict: bool,
        load_optimizer: bool,
        torch_load: Callable[..., Any] | None,
    ) -> bool:
        """Load the backend's own files of ``folder/tag`` into the model (collective).

        Args:
            folder: The folder of the tags, as given to `save`.
            tag: The tag to load; None: the one its ``latest`` file names.
            strict: Every name of the model must be in the files, and no other.
            load_optimizer: Load the optimizer's state too; else the weights only.
            torch_load: Reads each file instead of the backend's own reader, for the
                duration of the load (called as ``torch_load(path, map_location=...)``);
                None: the backend's own (DeepSpeed's: ``torch.load`` with full unpickling).

        Returns:
            Whether the backend loaded the files (DeepSpeed returns without loading when
            the tag's folder is missing).
        """
        ...

    def fits(self, zero_stage: int | None, world_size: int | None, tag_dir: Path) -> bool:
        """Whether a tag folder saved with this layout loads natively into this model now.

        Args:
            zero_stage: The ZeRO stage that saved it (None: unknown).
            world_size: The world size that saved it (None: unknown).
            tag_dir: The tag's folder, whose files tell the rest (DeepSpeed: the precision
                of its optimizer files).

        Returns:
            True when the stage and world size are this model's at the current world
            size and the files are of its precision; False otherwise (the caller then
            reads the files offline, or a portable copy).
        """
        ...
