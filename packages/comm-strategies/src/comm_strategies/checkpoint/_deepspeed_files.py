"""DeepSpeed's own checkpoint folders: their names and layout, consolidation.

Saving and loading them natively is the model's backend adapter's
(``Backend.native_checkpoint`` in ``comm_wrappers.backends``); what is here knows the files
only. Imported only when DeepSpeed's files are at hand (or its records must be allowed):
DeepSpeed itself is the ``deepspeed`` extra, imported only to name its record classes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ._deepspeed_records import deepspeed_safe_globals
from ._errors import CheckpointError


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
