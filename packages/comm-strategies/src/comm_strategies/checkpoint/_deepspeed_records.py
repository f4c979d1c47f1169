"""DeepSpeed's checkpoint folders, read offline: their names and layout, the safe loaders.

Saving and loading them natively is the model's backend adapter's
(``Backend.native_checkpoint``); what is here knows the files only: a folder's tag and
layout (`find_tag`, `split_folder`, `native_layout`), the safe loaders
(`deepspeed_safe_globals`, `safe_load` for a native load), and what every
layout reader of ``_deepspeed_offline`` shares: ``DeepSpeedState`` (what a folder
holds, full), ``load_file`` (``torch.load(weights_only=True)`` with DeepSpeed's few record
classes allowed), the layout's file names, and the model states file's common fields
(module, buffers, shared parameters, bf16, step counter, LR scheduler).
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ._errors import CheckpointError
from ._reading import UNSAFE_HINT, _weights_only_detail, first_line, numpy_safe_globals

# The classes DeepSpeed pickles into its checkpoint files besides tensors and builtins:
# plain records, rebuilt from their fields (no code of their own runs).
_DEEPSPEED_RECORDS = (
    ("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
    ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
    ("deepspeed.utils.tensor_fragment", ("fragment_address",)),
)


def deepspeed_safe_globals() -> list[Any]:
    """DeepSpeed's record classes (and NumPy's values) for ``weights_only`` loading."""
    allowed: list[Any] = numpy_safe_globals()
    for module_name, names in _DEEPSPEED_RECORDS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        allowed += [getattr(module, name) for name in names if hasattr(module, name)]
    return allowed


def safe_load(path: Any, map_location: Any = None) -> Any:
    """What DeepSpeed reads its files with when the checkpoint package loads them natively
    (the ``torch_load`` of ``NativeCheckpoint.load``), unless the caller opted out:
    `load_file`, not memory-mapped."""
    return load_file(Path(path), map_location=map_location, mmap=False)


UNIVERSAL_FOLDER = "zero"
UNIVERSAL_OPTIM_FILE = "optimizer_state.pt"
# The per-parameter files of a universal checkpoint hold {"param": tensor}.
UNIVERSAL_KEY = "param"
_MODEL_STATES = "mp_rank_00_model_states.pt"


@dataclasses.dataclass
class DeepSpeedState:
    """What a DeepSpeed checkpoint folder holds, full, in this process.

    Attributes:
        model: Full fp32 parameters (from the fp32 masters) and buffers, by name.
        optim: The optimizer state keyed by parameter names (torch's full form), or None
            when the folder holds none (``optimizer=False``, or no step was taken).
        stage: The ZeRO stage (None for a universal folder).
        world_size: The data-parallel world size that saved it.
        bf16: Whether the engine trained in bf16 (the masters are fp32 regardless).
        global_steps: The engine's step counter, when recorded.
        lr_scheduler: The engine's LR scheduler state, when it had one.
    """

    model: dict[str, torch.Tensor]
    optim: dict[str, Any] | None
    stage: int | None
    world_size: int
    bf16: bool
    global_steps: int | None = None
    lr_scheduler: Any = None


def load_file(
    path: Path, *, allow_unsafe_pickle: bool = False, map_location: Any = "cpu", mmap: bool = True
) -> Any:
    """One of DeepSpeed's files with ``weights_only=True`` and its record classes allowed
    (memory-mapped with ``mmap``, when it is a zip file).

    Full unpickling only with ``allow_unsafe_pickle`` and only for a file the safe
    loader refuses (one that holds objects beyond DeepSpeed's plain records).
    """
    if not path.is_file():
        message = f"DeepSpeed file {path} does not exist: the checkpoint is incomplete"
        raise CheckpointError(message)
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        if allow_unsafe_pickle:
            return _load_unsafe(path)
        message = (
            f"{path} holds objects beyond DeepSpeed's plain checkpoint records "
            f"({_weights_only_detail(str(error))}). {UNSAFE_HINT}."
        )
        raise CheckpointError(message) from error
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError) as error:
        message = f"{path} is truncated or corrupt (torch.load says: {first_line(error)})"
        raise CheckpointError(message) from error


def _load_unsafe(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        message = f"{path} is truncated or corrupt: {first_line(error)}"
        raise CheckpointError(message) from error


def _model_states(path: Path, unsafe: bool) -> dict[str, Any]:
    states = load_file(path, allow_unsafe_pickle=unsafe)
    if not isinstance(states, Mapping) or not isinstance(states.get("module"), Mapping):
        message = f"{path} has no 'module' state dict: not a DeepSpeed model states file"
        raise CheckpointError(message)
    return dict(states)


def _buffers(states: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    names = set(states.get("buffer_names") or ())
    return {
        name: _fp32(value)
        for name, value in states["module"].items()
        if name in names and isinstance(value, torch.Tensor)
    }


def _fp32(value: torch.Tensor) -> torch.Tensor:
    return value.float() if value.is_floating_point() else value.clone()


def _is_bf16(states: Mapping[str, Any]) -> bool:
    config = states.get("ds_config")
    bf16 = config.get("bf16") if isinstance(config, Mapping) else None
    return bool(isinstance(bf16, Mapping) and bf16.get("enabled"))


def _ordered(
    module: Mapping[str, Any], values: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``values`` in the module's state-dict order (names it lacks at the end)."""
    ordered = {name: values[name] for name in module if name in values}
    ordered.update({name: value for name, value in values.items() if name not in ordered})
    return ordered


def _with_shared(states: Mapping[str, Any], model: dict[str, torch.Tensor]) -> None:
    """Tied parameters DeepSpeed saved once: ``shared_params`` maps each to its source."""
    shared = states.get("shared_params")
    if isinstance(shared, Mapping):
        for name, source in shared.items():
            if source in model:
                model[name] = model[source]


def _meta(states: Mapping[str, Any]) -> dict[str, Any]:
    steps = states.get("global_steps")
    return {
        "bf16": _is_bf16(states),
        "global_steps": None if steps is None else int(steps),
        "lr_scheduler": states.get("lr_scheduler"),
    }


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


# ---------------------------------------------------------------- a folder's tag and layout


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


def native_layout(folder: Path) -> tuple[int | None, int | None]:
    """``(ZeRO stage, data-parallel world size)`` recorded in a DeepSpeed tag folder."""
    files = sorted(folder.glob("*model_states.pt"))
    if not files:
        return None, None
    states = load_file(files[0])
    config = states.get("ds_config", {}) if isinstance(states, dict) else {}
    stage = config.get("zero_optimization", {}).get("stage", 0)
    world = states.get("dp_world_size") if isinstance(states, dict) else None
    return (None if stage is None else int(stage)), (None if world is None else int(world))
