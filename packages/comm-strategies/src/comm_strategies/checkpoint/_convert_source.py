"""The converter's sources: any checkpoint read into full states in this process.

A comm checkpoint folder (formats full, dcp, deepspeed), DeepSpeed's own folder (ZeRO 0-3,
or its universal layout) and a plain ``.pt``/``.pth`` file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._names import strip_prefixes
from . import _deepspeed_offline as ds_offline
from . import _deepspeed_records as ds_files
from ._errors import CheckpointError
from ._format_dcp import read_dcp_full
from ._layout import DEFAULT_KEY, DS_FOLDER, DS_TAG, MODEL_FILE, OPTIM_FILE
from ._manifest import MANIFEST_NAME, Manifest, read_manifest
from ._reading import load_tensor_file, read_state_dict_file


@dataclass
class Source:
    """A checkpoint read into full states in this process.

    Attributes:
        model: The full model state (parameters and buffers) by name.
        optim: The optimizer states by key (``"default"`` for one optimizer), each in
            torch's full form keyed by parameter names; empty when the source has none.
        manifest: The source folder's manifest (a comm checkpoint), else None.
        folder: The comm source folder whose side files (schedulers, scaler, user state,
            RNG) a converted folder copies, else None.
        strategy: The strategy that saved it (``"deepspeed"`` for DeepSpeed's own folder,
            ``"convert"`` for a plain file).
        world_size: How many ranks saved it.
        deepspeed: DeepSpeed's step counter and LR scheduler state, for a DeepSpeed source.
    """

    model: dict[str, torch.Tensor]
    optim: dict[str, Any] = field(default_factory=dict)
    manifest: Manifest | None = None
    folder: Path | None = None
    strategy: str = "convert"
    world_size: int = 1
    deepspeed: ds_offline.DeepSpeedState | None = None


def _plain_file(source: Path, unsafe: bool) -> dict[str, torch.Tensor]:
    # weights only: every file convert writes loads with weights_only=True
    return strip_prefixes(
        read_state_dict_file(source, allow_unsafe_pickle=unsafe, keep_extra_state=False)
    )


def _deepspeed_source(tag_dir: Path, *, optimizer: bool, unsafe: bool) -> Source:
    state = ds_offline.read_folder(tag_dir, optimizer=optimizer, allow_unsafe_pickle=unsafe)
    return Source(
        model=state.model,
        optim={DEFAULT_KEY: state.optim} if state.optim else {},
        strategy="deepspeed",
        world_size=state.world_size,
        deepspeed=state,
    )


def read_source(
    source: Path, *, optimizer: bool = True, allow_unsafe_pickle: bool = False
) -> Source:
    """Read any checkpoint into full states in this process (no process group).

    Raises:
        CheckpointError: The path does not exist or holds no checkpoint (a folder that is
            neither a comm checkpoint nor DeepSpeed's), or a file is damaged.
    """
    unsafe = allow_unsafe_pickle
    if not source.exists():
        message = f"checkpoint {source} does not exist"
        raise CheckpointError(message)
    if source.is_file():
        return Source(model=_plain_file(source, unsafe))
    if not (source / MANIFEST_NAME).is_file():
        if not ds_files.is_deepspeed_folder(source):
            message = (
                f"{source} is not a checkpoint: it has no {MANIFEST_NAME} (a comm checkpoint "
                "folder) and no *model_states.pt (a DeepSpeed checkpoint folder, save_dir or "
                "save_dir/tag). Pass a checkpoint folder or a .pt/.pth file."
            )
            raise CheckpointError(message)
        save_dir, tag = ds_files.split_folder(source)
        return _deepspeed_source(save_dir / tag, optimizer=optimizer, unsafe=unsafe)
    manifest = read_manifest(source)
    common: dict[str, Any] = {
        "manifest": manifest,
        "folder": source,
        "strategy": manifest.strategy,
        "world_size": manifest.world_size,
    }
    want_optim = optimizer and manifest.has_optimizer
    optim: dict[str, Any] = {}
    if manifest.format == "dcp":
        full = read_dcp_full(source)
        if want_optim:
            optim = dict(full.get("optim", {}))
        return Source(model=dict(full["model"]), optim=optim, **common)
    portable = manifest.format == "full" or (source / MODEL_FILE).is_file()
    if portable:  # format full, or a DeepSpeed folder with its portable copy beside
        load = functools.partial(load_tensor_file, allow_unsafe_pickle=unsafe, mmap=True)
        model = dict(load(source / MODEL_FILE, what="model state"))
        if want_optim and (source / OPTIM_FILE).is_file():
            optim = dict(load(source / OPTIM_FILE, what="optimizer state"))
        return Source(model=model, optim=optim, **common)
    read = _deepspeed_source(source / DS_FOLDER / DS_TAG, optimizer=want_optim, unsafe=unsafe)
    return Source(model=read.model, optim=read.optim, deepspeed=read.deepspeed, **common)


def full_model_state_of(
    source: Path, *, allow_unsafe_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """The full model state dict of any checkpoint, read in this process (no group)."""
    return read_source(source, optimizer=False, allow_unsafe_pickle=allow_unsafe_pickle).model
