"""``load_checkpoint`` and ``find_latest``: any checkpoint of the contract into any model."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _dist, _rng
from ._errors import CheckpointError
from ._files import load_tensor_file
from ._manifest import MANIFEST_NAME, Manifest, read_manifest
from ._models import (
    check_against,
    deepspeed_engine,
    model_kind,
    quiet_torch,
    scalers_of,
    set_model_state,
    set_optim_state,
    sharded_state,
)
from ._save import (
    DCP_FOLDER,
    EXTRA_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    RNG_FOLDER,
    SCALER_FILE,
    SCHEDULERS_FILE,
)
from ._state import (
    DEFAULT_KEY,
    _expected_params,
    _named_optimizers,
    load_full_model_state_dict,
)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
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
        model: What the strategy prepared.
        optim_wrapper: Receives the optimizer state (and the gradient scaler's).
        schedulers: Receive the schedulers' states, in the order they were saved.
        strict: The model's names must equal the checkpoint's.
        load_optimizer: Load the optimizer (and scaler) state when the checkpoint has it.
        load_schedulers: Load the schedulers' states.
        load_rng: Restore this rank's random generators (when the checkpoint has them).
        allow_unsafe_pickle: Allow files that need full unpickling (DeepSpeed's own files,
            old pickles); only for files you trust.
        timeout: Seconds to wait for the other ranks to enter.

    Returns:
        The ``extra`` user state saved with the checkpoint (``{}`` if none).

    Raises:
        CheckpointError: The path holds no checkpoint, a file is truncated or corrupt, the
            checkpoint belongs to another model (names and shapes listed), a format needs
            ``allow_unsafe_pickle``, or the optimizer state cannot move between formats.
    """
    kind = model_kind(model)
    wait = _dist.handshake_timeout(timeout, "load_checkpoint")
    exchange = _dist.Exchange("load_checkpoint")
    source = Path(path).absolute()
    entries = exchange.all_gather("enter", str(source), wait)
    if len(set(entries)) > 1:
        message = (
            f"load_checkpoint: the ranks passed different paths ({sorted(set(entries))}); "
            "every rank must pass the same checkpoint"
        )
        raise CheckpointError(message)
    if source.is_file():
        _load_plain_file(source, model, strict, allow_unsafe_pickle)
        return {}
    if not source.exists():
        message = f"checkpoint {source} does not exist"
        raise CheckpointError(message)
    if not (source / MANIFEST_NAME).is_file():
        from ._deepspeed import is_deepspeed_folder

        if is_deepspeed_folder(source):
            _load_deepspeed_folder(
                source, model, kind, optim_wrapper, strict, load_optimizer, allow_unsafe_pickle
            )
            return {}
    manifest = read_manifest(source)
    _load_model_and_optimizer(
        source, manifest, model, kind, optim_wrapper, strict, load_optimizer, allow_unsafe_pickle
    )
    if load_optimizer and manifest.has_scaler and optim_wrapper is not None:
        _load_scalers(source, optim_wrapper, allow_unsafe_pickle)
    if load_schedulers and schedulers:
        _load_schedulers(source, manifest, schedulers, allow_unsafe_pickle)
    if load_rng:
        _load_rng(source, manifest, allow_unsafe_pickle)
    if not manifest.extra_keys:
        return {}
    extra = load_tensor_file(
        source / EXTRA_FILE, allow_unsafe_pickle=allow_unsafe_pickle, what="user state"
    )
    return dict(extra)


def _load_plain_file(source: Path, model: nn.Module, strict: bool, unsafe: bool) -> None:
    data = load_tensor_file(source, allow_unsafe_pickle=unsafe, mmap=True, what="checkpoint")
    if isinstance(data, Mapping) and isinstance(data.get("state_dict"), Mapping):
        data = data["state_dict"]
    elif isinstance(data, Mapping) and isinstance(data.get("module"), Mapping):
        data = data["module"]  # DeepSpeed's mp_rank_00_model_states.pt
    if not isinstance(data, Mapping) or not any(isinstance(v, torch.Tensor) for v in data.values()):
        message = (
            f"{source} holds no state dict: expected {{name: tensor}} or "
            f"{{'state_dict': {{name: tensor}}}}, got {_describe(data)}"
        )
        raise CheckpointError(message)
    load_full_model_state_dict(model, data, strict, source=str(source))


def _describe(data: Any) -> str:
    if isinstance(data, Mapping):
        return f"a dict with keys {sorted(map(str, data))[:8]}"
    return f"a {type(data).__name__}"


def _load_deepspeed_folder(
    source: Path,
    model: nn.Module,
    kind: str,
    optim_wrapper: Any,
    strict: bool,
    load_optimizer: bool,
    unsafe: bool,
) -> None:
    """DeepSpeed's own folder: natively into an engine of its layout, else consolidated."""
    from ._deepspeed import (
        consolidate,
        load_native,
        native_layout,
        require_unsafe,
        split_folder,
        zero_stage,
    )

    save_dir, tag = split_folder(source)
    stage, world = native_layout(save_dir / tag)
    engine = deepspeed_engine(model)
    if engine is not None and stage == zero_stage(engine) and world == _dist.world_size():
        load_native(
            engine,
            save_dir,
            tag,
            strict=strict,
            load_optimizer=load_optimizer,
            allow_unsafe_pickle=unsafe,
        )
        return
    if load_optimizer and optim_wrapper is not None:
        message = (
            f"{source} is a DeepSpeed ZeRO-{stage} checkpoint of {world} rank(s): its "
            "optimizer state loads only into a DeepSpeed engine of the same stage and world "
            f"size (this is a {kind} model"
            + (f", ZeRO-{zero_stage(engine)}" if engine is not None else "")
            + f", {_dist.world_size()} rank(s)). Pass load_optimizer=False to load the "
            "weights only."
        )
        raise CheckpointError(message)
    require_unsafe(source, unsafe)
    state = consolidate(source, allow_unsafe_pickle=unsafe)
    load_full_model_state_dict(model, state, strict, source=str(source))


def _cannot_move_optimizer(manifest: Manifest, source: Path, kind: str, why: str) -> None:
    message = (
        f"{source} holds {manifest.format!r} optimizer state saved under "
        f"{manifest.strategy} ({manifest.wrapper}, world size {manifest.world_size}), which "
        f"cannot load into this {kind} model: {why}. Pass load_optimizer=False to load the "
        "weights (and schedulers, RNG, user state) only."
    )
    raise CheckpointError(message)


def _load_model_and_optimizer(
    source: Path,
    manifest: Manifest,
    model: nn.Module,
    kind: str,
    optim_wrapper: Any,
    strict: bool,
    load_optimizer: bool,
    unsafe: bool,
) -> None:
    optimizers = _named_optimizers(optim_wrapper) if load_optimizer else {}
    if optimizers and not manifest.has_optimizer:
        optimizers = {}
    if optimizers:
        saved = manifest.optimizer_keys or [DEFAULT_KEY]
        if sorted(saved) != sorted(optimizers):
            message = (
                f"{source} holds the optimizers {saved}, the optim wrapper has "
                f"{sorted(optimizers)}: they must match (or pass load_optimizer=False)"
            )
            raise CheckpointError(message)
    engine = deepspeed_engine(model)
    if manifest.format == "deepspeed":
        _load_from_deepspeed(source, manifest, model, kind, engine, optimizers, strict, unsafe)
        return
    if kind == "deepspeed" and optimizers:
        from ._deepspeed import zero_stage

        if zero_stage(engine) > 0 or engine.bfloat16_enabled():
            why = "DeepSpeed keeps ZeRO optimizer state in its own partitioned form"
            _cannot_move_optimizer(manifest, source, kind, why)
    if manifest.format == "dcp" and kind != "deepspeed":
        _load_dcp(source, manifest, model, kind, optimizers, strict)
        return
    # Full files (or DCP into DeepSpeed): full tensors on every rank.
    if manifest.format == "dcp":
        state = read_dcp_full(source)
        model_state, optim_states = state["model"], state.get("optim", {})
    else:
        model_state = load_tensor_file(
            source / MODEL_FILE, allow_unsafe_pickle=unsafe, mmap=True, what="model state"
        )
        optim_states = {}
        if optimizers:
            optim_states = load_tensor_file(
                source / OPTIM_FILE, allow_unsafe_pickle=unsafe, mmap=True, what="optimizer state"
            )
    load_full_model_state_dict(model, model_state, strict, source=str(source / MODEL_FILE))
    if optimizers:
        inner = engine.module if engine is not None else model
        for key, optimizer in optimizers.items():
            set_optim_state(
                inner,
                "module" if engine is not None else kind,
                optimizer,
                optim_states[key],
                full=True,
            )


def _load_from_deepspeed(
    source: Path,
    manifest: Manifest,
    model: nn.Module,
    kind: str,
    engine: Any,
    optimizers: dict[str, torch.optim.Optimizer],
    strict: bool,
    unsafe: bool,
) -> None:
    from ._deepspeed import DS_FOLDER, DS_TAG, consolidate, load_native, require_unsafe, zero_stage

    folder = source / DS_FOLDER
    same_engine = (
        engine is not None
        and manifest.world_size == _dist.world_size()
        and manifest.zero_stage == zero_stage(engine)
    )
    if same_engine:
        load_native(
            engine,
            folder,
            DS_TAG,
            strict=strict,
            load_optimizer=bool(optimizers),
            allow_unsafe_pickle=unsafe,
        )
        return
    if optimizers:
        why = (
            "DeepSpeed's optimizer files load only into an engine of the same ZeRO stage "
            f"(saved {manifest.zero_stage}) and world size (saved {manifest.world_size}, "
            f"now {_dist.world_size()})"
        )
        _cannot_move_optimizer(manifest, source, kind, why)
    require_unsafe(folder, unsafe)
    state = consolidate(folder / DS_TAG, allow_unsafe_pickle=unsafe)
    load_full_model_state_dict(model, state, strict, source=str(folder))


def _load_dcp(
    source: Path,
    manifest: Manifest,
    model: nn.Module,
    kind: str,
    optimizers: dict[str, torch.optim.Optimizer],
    strict: bool,
) -> None:
    """Sharded in, resharded by DCP to this model's layout (any world size)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    check_against(_expected_params(model, kind), manifest.params, str(source), strict)
    state = sharded_state(model, kind, optimizers)
    if not strict:
        state["model"] = {k: v for k, v in state["model"].items() if k in manifest.params}
    try:
        with quiet_torch():
            dcp_load(state, checkpoint_id=str(source / DCP_FOLDER))
    except Exception as caught:
        message = f"torch distributed checkpoint could not read {source / DCP_FOLDER}: {caught}"
        raise CheckpointError(message) from caught
    set_model_state(model, kind, state["model"], full=False, strict=strict)
    for key, optimizer in optimizers.items():
        set_optim_state(model, kind, optimizer, state["optim"][key], full=False)


def read_dcp_full(source: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint's DCP folder, full, in this process (no group needed)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = source / DCP_FOLDER
    if not (folder / ".metadata").is_file():
        message = f"{folder} has no .metadata: the sharded checkpoint is incomplete or damaged"
        raise CheckpointError(message)
    state: dict[str, Any] = {}
    try:
        # What torch's dcp_to_torch_save does: the planner fills the dict from the metadata.
        with quiet_torch():
            _load_state_dict(
                state,
                storage_reader=FileSystemReader(str(folder)),
                planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
                no_dist=True,
            )
    except Exception as caught:
        message = f"torch distributed checkpoint could not read {folder}: {caught}"
        raise CheckpointError(message) from caught
    return state


def _load_scalers(source: Path, optim_wrapper: Any, unsafe: bool) -> None:
    states = load_tensor_file(source / SCALER_FILE, allow_unsafe_pickle=unsafe, what="scaler state")
    scalers = {DEFAULT_KEY if k == "" else k: v for k, v in scalers_of(optim_wrapper).items()}
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


def _load_rng(source: Path, manifest: Manifest, unsafe: bool) -> None:
    me = _dist.rank()
    if not manifest.rng_ranks:  # converted offline: no generator state saved
        return
    if me not in manifest.rng_ranks:
        warnings.warn(
            f"{source} was saved by {manifest.world_size} rank(s): rank {me} has no RNG "
            "state there and keeps its own",
            stacklevel=3,
        )
        return
    state = load_tensor_file(
        source / RNG_FOLDER / f"rank_{me}.pt", allow_unsafe_pickle=unsafe, what="RNG state"
    )
    _rng.restore(state)


def find_latest(work_dir: str | os.PathLike[str]) -> Path | None:
    """Return the newest finished checkpoint folder under ``work_dir``, or None.

    Finished means: its manifest is there and readable (the manifest is written last and
    the folder renamed into place after every rank finished, so a save killed half-way
    never counts). Newest by the manifest's ``saved_at``. No process group needed.

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
    best: tuple[float, str] | None = None
    found: Path | None = None
    for candidate in folder.iterdir():
        if candidate.name.startswith(".") or not (candidate / MANIFEST_NAME).is_file():
            continue
        try:
            manifest = read_manifest(candidate)
        except CheckpointError:
            continue
        key = (manifest.saved_at, candidate.name)
        if best is None or key > best:
            best, found = key, candidate
    return found
