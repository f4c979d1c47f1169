"""DeepSpeed's own checkpoint files: native save and load, reading them safely, consolidation.

The engine's state itself (full weights in and out, ZeRO-3 gathering) is the DeepSpeed
backend adapter's (``comm_wrappers.backends``). Imported only when a DeepSpeed engine or
DeepSpeed's files are at hand: DeepSpeed is the ``deepspeed`` extra.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ._consensus import where
from ._errors import CheckpointError
from ._files import UNSAFE_HINT, _weights_only_detail, deepspeed_safe_globals
from ._layout import DS_FOLDER, DS_TAG


def safe_load(path: Any, map_location: Any = None) -> Any:
    """``torch.load(weights_only=True)`` of a DeepSpeed file, DeepSpeed's records allowed."""
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        message = (
            f"{path} holds objects beyond DeepSpeed's plain checkpoint records "
            f"({_weights_only_detail(str(error))}). {UNSAFE_HINT}."
        )
        raise CheckpointError(message) from error


@contextlib.contextmanager
def _engine_loads_safely(engine: Any, allow_unsafe_pickle: bool) -> Iterator[None]:
    """Make the engine read its files with `safe_load` (unless the caller opted out)."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if allow_unsafe_pickle or checkpoint_engine is None:
        yield
        return
    checkpoint_engine.load = safe_load
    try:
        yield
    finally:
        del checkpoint_engine.load


def _deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as error:
        message = (
            "this needs DeepSpeed: install torch first, then "
            'pip install --no-build-isolation "comm-strategies[deepspeed]"'
        )
        raise CheckpointError(message) from error
    return deepspeed


def save_native(engine: Any, folder: Path) -> None:
    """``engine.save_checkpoint`` into ``folder/deepspeed/state`` (collective)."""
    engine.save_checkpoint(str(folder / DS_FOLDER), tag=DS_TAG, client_state={}, save_latest=False)


def load_native(
    engine: Any,
    folder: Path,
    tag: str | None,
    *,
    strict: bool,
    load_optimizer: bool,
    allow_unsafe_pickle: bool = False,
) -> None:
    """``engine.load_checkpoint`` of a DeepSpeed folder (collective).

    Its files are read with ``weights_only=True`` and DeepSpeed's few record classes
    allowed, unless ``allow_unsafe_pickle``.
    """
    with _engine_loads_safely(engine, allow_unsafe_pickle):
        loaded, _ = engine.load_checkpoint(
            str(folder),
            tag=tag,
            load_module_strict=strict,
            load_optimizer_states=load_optimizer,
            load_lr_scheduler_states=False,
            load_module_only=not load_optimizer,
        )
    if loaded is None:
        message = f"DeepSpeed could not load {folder} (tag {tag!r}) on {where()}"
        raise CheckpointError(message)


def same_precision(tag_dir: Path, engine: Any) -> bool:
    """Whether a tag folder's optimizer files are of ``engine``'s precision (a bf16 engine
    writes ``bf16_zero_pp_rank_*``, another ``zero_pp_rank_*``); True without such files."""
    files = list(tag_dir.glob("*zero_pp_rank_*_optim_states.pt"))
    if not files:
        return True
    saved_bf16 = all(path.name.startswith("bf16_") for path in files)
    return saved_bf16 == bool(engine.bfloat16_enabled())


def find_tag(folder: Path) -> str:
    """The tag of a DeepSpeed checkpoint folder: its ``latest`` file, or its only tag."""
    latest = folder / "latest"
    if latest.is_file():
        return latest.read_text().strip()
    tags = sorted(p.name for p in folder.iterdir() if p.is_dir() and _has_states(p))
    if len(tags) == 1:
        return tags[0]
    message = (
        f"{folder} has no 'latest' file and {len(tags)} checkpoint tags ({tags}): pass the "
        "tag's folder itself"
    )
    raise CheckpointError(message)


def _has_states(folder: Path) -> bool:
    return any(folder.glob("*model_states.pt"))


def is_deepspeed_folder(folder: Path) -> bool:
    """Whether ``folder`` is a DeepSpeed checkpoint folder (``save_dir`` or ``save_dir/tag``)."""
    if not folder.is_dir():
        return False
    if _has_states(folder):
        return True
    return (folder / "latest").is_file() or any(
        _has_states(p) for p in folder.iterdir() if p.is_dir()
    )


def split_folder(folder: Path) -> tuple[Path, str]:
    """``(save_dir, tag)`` of a DeepSpeed folder given as ``save_dir`` or ``save_dir/tag``."""
    if _has_states(folder):
        return folder.parent, folder.name
    return folder, find_tag(folder)


def consolidate(folder: Path, *, allow_unsafe_pickle: bool) -> dict[str, torch.Tensor]:
    """One full fp32 state dict from a DeepSpeed checkpoint folder, offline (ZeRO 0-3).

    Read safely (``weights_only=True``, DeepSpeed's record classes allowed) by
    ``_deepspeed_offline``: the fp32 masters joined and cut by the recorded shapes, the
    buffers from the module state. ``allow_unsafe_pickle`` is needed only for files that
    hold objects beyond DeepSpeed's plain records.
    """
    from ._deepspeed_offline import read_folder

    save_dir, tag = split_folder(folder)
    return read_folder(
        save_dir / tag, optimizer=False, allow_unsafe_pickle=allow_unsafe_pickle
    ).model


def folder_world_size(tag_dir: Path) -> int | None:
    """How many data-parallel ranks saved a DeepSpeed tag folder (from its file names)."""
    optim = list(tag_dir.glob("*optim_states.pt"))
    if optim:
        return len(optim)
    return None


def native_layout(folder: Path) -> tuple[int | None, int | None]:
    """``(ZeRO stage, data-parallel world size)`` recorded in a DeepSpeed tag folder."""
    files = sorted(folder.glob("*model_states.pt"))
    if not files:
        return None, None
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        states = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
    config = states.get("ds_config", {}) if isinstance(states, dict) else {}
    stage = config.get("zero_optimization", {}).get("stage", 0)
    world = states.get("dp_world_size") if isinstance(states, dict) else None
    return (None if stage is None else int(stage)), (None if world is None else int(world))
