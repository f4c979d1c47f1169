"""DeepSpeed's own checkpoint files, saved and loaded by the engine: the `NativeCheckpoint`
that `DeepSpeedBackend.native_checkpoint` returns."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from comm_collectives import get_world_size

__all__ = ["EngineCheckpoint"]


class EngineCheckpoint:
    """`NativeCheckpoint` of a DeepSpeed engine: its ``save_checkpoint`` and
    ``load_checkpoint`` (collective), and which folders it loads natively."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def save(self, folder: Path, tag: str) -> None:
        """``engine.save_checkpoint`` into ``folder/tag``, without a ``latest`` file."""
        self._engine.save_checkpoint(str(folder), tag=tag, client_state={}, save_latest=False)

    def load(
        self,
        folder: Path,
        tag: str | None,
        *,
        strict: bool,
        load_optimizer: bool,
        torch_load: Callable[..., Any] | None,
    ) -> bool:
        """``engine.load_checkpoint`` of ``folder/tag``: the module (``strict``), and the
        optimizer's state with ``load_optimizer`` (never the LR scheduler's); each file
        read by ``torch_load`` when given. Whether DeepSpeed loaded it."""
        with _reading_with(self._engine, torch_load):
            loaded, _ = self._engine.load_checkpoint(
                str(folder),
                tag=tag,
                load_module_strict=strict,
                load_optimizer_states=load_optimizer,
                load_lr_scheduler_states=False,
                load_module_only=not load_optimizer,
            )
        return loaded is not None

    def fits(self, zero_stage: int | None, world_size: int | None, tag_dir: Path) -> bool:
        """The engine's ZeRO stage, the current world size, and optimizer files of the
        engine's precision (a bf16 engine writes ``bf16_zero_pp_rank_*``, another
        ``zero_pp_rank_*``; a folder without them fits either)."""
        stage = int(self._engine.zero_optimization_stage())
        if zero_stage != stage or world_size != get_world_size():
            return False
        files = list(tag_dir.glob("*zero_pp_rank_*_optim_states.pt"))
        if not files:
            return True
        saved_bf16 = all(path.name.startswith("bf16_") for path in files)
        return saved_bf16 == bool(self._engine.bfloat16_enabled())


@contextlib.contextmanager
def _reading_with(engine: Any, torch_load: Callable[..., Any] | None) -> Iterator[None]:
    """The engine's checkpoint engine reads its files with ``torch_load`` (None: its own)."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if torch_load is None or checkpoint_engine is None:
        yield
        return
    own = getattr(checkpoint_engine, "__dict__", {})
    previous = own.get("load")  # an instance attribute to put back, else the class's
    checkpoint_engine.load = torch_load
    try:
        yield
    finally:
        if previous is None:
            del checkpoint_engine.load
        else:
            checkpoint_engine.load = previous
