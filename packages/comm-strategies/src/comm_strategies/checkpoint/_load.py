"""``load_checkpoint`` and ``find_latest``: any checkpoint of the contract into any model.

The commit protocol's first steps (`_consensus`): every rank finds what is at the path
(its manifest read) and enters with the same path and that outcome, or every rank raises
(`Call.enter`, one store exchange); then the reader of the checkpoint's format
(`_formats`) loads the model and optimizer through the model's backend adapter, and the
scalers, schedulers, RNG and user state follow. A load publishes nothing: no commit.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import comm_collectives as dist
from comm_wrappers.backends import Backend, backend_of

from .._build import scalers_of, torch_optimizers
from . import _deepspeed_records as ds_files
from . import _publish
from ._consensus import Call
from ._errors import CheckpointError, outside_package
from ._files import read_rng_file, restore_rng
from ._format_common import LoadRequest, load_full_model
from ._formats import FORMATS, load_native_folder
from ._layout import DEFAULT_KEY, EXTRA_FILE, SCALER_FILE, SCHEDULERS_FILE
from ._manifest import MANIFEST_NAME, Manifest, read_manifest
from ._reading import load_tensor_file, read_state_dict_file


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Backend,
    optim_wrapper: Any = None,
    schedulers: Sequence[Any] = (),
    strict: bool = True,
    load_optimizer: bool = True,
    load_schedulers: bool = True,
    load_rng: bool = True,
    allow_unsafe_pickle: bool = False,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Load a checkpoint into what a strategy prepared; return its user state.

    Collective. Reads any checkpoint folder of `save_checkpoint` (saved under any
    strategy; at another world size where the format allows: full files and DCP always,
    DeepSpeed's files through consolidation), a plain ``.pth`` file (a bare state dict or
    MMEngine's ``{"state_dict": ...}``, ``module.`` prefixes removed) and DeepSpeed's own
    checkpoint folders.

    Args:
        path: A checkpoint folder, a ``.pth`` file or a DeepSpeed checkpoint folder.
        model: What the strategy prepared, or its adapter (as in `save_checkpoint`).
        optim_wrapper: Receives the optimizer state (and the gradient scaler's).
        schedulers: Receive the schedulers' states, in the order they were saved.
        strict: The model's names and shapes must be the checkpoint's, and every parameter
            an optimizer trains must have a saved state; False loads what fits, with a
            warning naming the rest.
        load_optimizer: Load the optimizer (and scaler) state when the checkpoint has it.
        load_schedulers: Load the schedulers' states.
        load_rng: Restore this rank's random generators (when the checkpoint has them).
        allow_unsafe_pickle: Allow files that need full unpickling (DeepSpeed's own files,
            old pickles); only for files you trust.
        timeout: Seconds this rank waits for the others to enter (each having read the
            manifest); default ``COMM_CHECKPOINT_TIMEOUT`` or 300. A read already under way
            is bounded by the process group's own timeout.

    Returns:
        The ``extra`` user state saved with the checkpoint (``{}`` if none).

    Raises:
        CheckpointError: The path holds no checkpoint, a file is truncated or corrupt, the
            checkpoint belongs to another model (names and shapes listed), a format needs
            ``allow_unsafe_pickle``, or the optimizer state cannot move between formats.
    """
    backend = model if isinstance(model, Backend) else backend_of(model)  # a kept adapter
    # before the call takes its number: a rank that raises here takes none
    optimizers = torch_optimizers(optim_wrapper, default_key=DEFAULT_KEY) if load_optimizer else {}
    call = Call("load_checkpoint", timeout)
    source = Path(path).absolute()
    # What this rank finds at the path (its manifest, its RNG state) first; the entry
    # shares it: a rank that failed makes every rank raise, before any data moves.
    found = _find(call, source, strict, optimizers, allow_unsafe_pickle, load_rng)
    call.enter(str(source), found.error)
    extra: dict[str, Any] = {}
    error: BaseException | None = None
    fresh = [optimizer for optimizer in optimizers.values() if not optimizer.state]
    try:
        extra = _read(
            source, found, backend, optim_wrapper, schedulers, load_optimizer, load_schedulers
        )
    except Exception as caught:  # shared: no rank goes on alone with a half-loaded model
        error = caught
    try:
        call.share("loaded", error)
    except BaseException:  # torch's sharded state dict gave these zero states (a step at lr 0)
        for optimizer in fresh:
            optimizer.state.clear()  # a caller that goes on trains them as before the load
        raise
    if found.rng is not None:  # read before the entry, set once every rank loaded the rest
        restore_rng(found.rng)
    return extra


def _read(
    source: Path,
    found: _Found,
    backend: Backend,
    optim_wrapper: Any,
    schedulers: Sequence[Any],
    load_optimizer: bool,
    load_schedulers: bool,
) -> dict[str, Any]:
    """The read of what `_find` found: the model and optimizer by the format's reader, then
    the scalers, the schedulers and the user state (returned)."""
    manifest, request = found.manifest, found.request
    unsafe = request.allow_unsafe_pickle
    if found.kind == "file":
        state = read_state_dict_file(source, allow_unsafe_pickle=unsafe)
        load_full_model(backend, state, request.strict, str(source))
        return {}
    if found.kind == "deepspeed":  # natively where the model's adapter fits it, else offline
        save_dir, tag = ds_files.split_folder(source)
        layout = ds_files.native_layout(save_dir / tag)
        load_native_folder(save_dir, tag, layout, backend, request, load_optimizer=load_optimizer)
        return {}
    assert manifest is not None
    FORMATS[manifest.format].read(source, manifest, backend, request)
    if request.optimizers and manifest.has_scaler:
        _load_scalers(source, optim_wrapper, unsafe)
    if load_schedulers and schedulers:
        _load_schedulers(source, manifest, schedulers, unsafe)
    if not manifest.extra_keys:
        return {}
    return dict(
        load_tensor_file(source / EXTRA_FILE, allow_unsafe_pickle=unsafe, what="user state")
    )


@dataclass
class _Found:
    """What one rank finds at the path: the kind of checkpoint, its manifest, what to
    load, or why it cannot."""

    kind: str
    manifest: Manifest | None
    request: LoadRequest
    error: Exception | None
    rng: dict[str, Any] | None = None  # this rank's saved generator states, to restore


def _find(
    call: Call,
    source: Path,
    strict: bool,
    optimizers: dict[str, torch.optim.Optimizer],
    allow_unsafe_pickle: bool,
    load_rng: bool,
) -> _Found:
    """What this rank finds at ``source`` (no collective): a failure is returned, to be
    shared with the other ranks before the part that moves data between them.

    With ``load_rng``, this rank's RNG state is read here too (set once the rest is
    loaded): a file that cannot be read fails the call on every rank before any data
    moves, and the read overlaps the wait for the other ranks' entry."""
    found = _Found("", None, LoadRequest(call, strict, optimizers, allow_unsafe_pickle), None)
    try:
        if source.is_file():
            found.kind = "file"
        elif not source.exists():
            message = f"checkpoint {source} does not exist"
            raise CheckpointError(message)
        elif not (source / MANIFEST_NAME).is_file() and ds_files.is_deepspeed_folder(source):
            found.kind = "deepspeed"
        else:
            found.manifest = read_manifest(source)
            saved = _saved_optimizers(source, found.manifest, optimizers)
            found.request = LoadRequest(call, strict, saved, allow_unsafe_pickle)
            if load_rng:
                found.rng = _read_rng(source, found.manifest, allow_unsafe_pickle)
    except Exception as caught:
        found.error = caught
    return found


def _saved_optimizers(
    source: Path, manifest: Manifest, optimizers: dict[str, torch.optim.Optimizer]
) -> dict[str, torch.optim.Optimizer]:
    """The optimizers to load: none when the checkpoint has no optimizer state; else the
    checkpoint's keys must be the wrapper's."""
    if not optimizers or not manifest.has_optimizer:
        return {}
    saved = manifest.optimizer_keys or [DEFAULT_KEY]
    if sorted(saved) != sorted(optimizers):
        message = (
            f"{source} holds the optimizers {saved}, the optim wrapper has "
            f"{sorted(optimizers)}: they must match (or pass load_optimizer=False)"
        )
        raise CheckpointError(message)
    return optimizers


def _load_scalers(source: Path, optim_wrapper: Any, unsafe: bool) -> None:
    states = load_tensor_file(source / SCALER_FILE, allow_unsafe_pickle=unsafe, what="scaler state")
    scalers = scalers_of(optim_wrapper, default_key=DEFAULT_KEY)
    for key, scaler in scalers.items():
        if key in states:
            scaler.load_state_dict(dict(states[key]))


def _load_schedulers(
    source: Path, manifest: Manifest, schedulers: Sequence[Any], unsafe: bool
) -> None:
    if manifest.num_schedulers != len(schedulers):
        message = (
            f"{source} holds {manifest.num_schedulers} scheduler state(s), "
            f"{len(schedulers)} scheduler(s) were passed: pass the same schedulers in the "
            "same order, or load_schedulers=False"
        )
        raise CheckpointError(message)
    states = load_tensor_file(
        source / SCHEDULERS_FILE, allow_unsafe_pickle=unsafe, what="scheduler states"
    )
    for scheduler, state in zip(schedulers, states):
        scheduler.load_state_dict(state)


def _read_rng(source: Path, manifest: Manifest, unsafe: bool) -> dict[str, Any] | None:
    """This rank's saved generator states, or None when the checkpoint has none for it."""
    me = dist.get_rank()
    if not manifest.rng_ranks:  # converted offline: no generator state saved
        return None
    if me not in manifest.rng_ranks:
        warnings.warn(
            f"{source} was saved by {manifest.world_size} rank(s): rank {me} has no RNG "
            "state there and keeps its own",
            stacklevel=outside_package(),
        )
        return None
    return read_rng_file(source, me, allow_unsafe_pickle=unsafe)


def find_latest(work_dir: str | os.PathLike[str]) -> Path | None:
    """Return the newest finished checkpoint folder under ``work_dir``, or None.

    Finished means: its manifest is there and readable (the manifest is written last and
    the folder renamed into place after every rank finished, so a save killed half-way
    never counts), and every file it lists is there at its size (a checkpoint damaged by a
    machine's crash is passed over for the one before it). Temporary folders never count
    but for one case: a save killed between hiding the checkpoint it replaces and renaming
    its own finished folder into place left no folder under its name; its finished
    temporary folder is then returned (the next save in that folder puts it back). Newest by the manifest's ``saved_at``.
    No process group needed.

    Examples:
        >>> import tempfile, torch
        >>> from comm_strategies.checkpoint import find_latest, save_checkpoint
        >>> work_dir = tempfile.mkdtemp()
        >>> find_latest(work_dir) is None
        True
        >>> for epoch in (1, 2):
        ...     _ = save_checkpoint(f"{work_dir}/epoch_{epoch}", model=torch.nn.Linear(1, 1), strategy="single")
        >>> find_latest(work_dir).name
        'epoch_2'
    """
    folder = Path(work_dir)
    if not folder.is_dir():
        return None
    # the order retention (keep_last) keeps too; whole checkpoints only, and one whose
    # publish a kill cut between its two renames (loaded from its temporary name)
    found = _publish.newest_first(folder, whole=True, unpublished=True)
    return found[0] if found else None
