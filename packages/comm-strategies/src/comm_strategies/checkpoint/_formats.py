"""How a checkpoint stores the model and optimizer: one writer/reader pair per format.

``full`` (``model.pt``/``optim.pt``, full tensors written by rank 0), ``dcp`` (every rank
writes its shards with torch distributed checkpoint) and ``deepspeed`` (DeepSpeed's own
files, and the full files beside them). Writers and readers call the model's backend adapter (``comm_wrappers.backends``)
and never ask which backend it is: the adapter decides (sharded state or full, DeepSpeed's
engine or not).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import comm_collectives as dist
from comm_wrappers.backends import Backend

from . import _deepspeed_files as ds_files
from ._consensus import where
from ._errors import CheckpointError
from ._files import load_tensor_file, save_tensor_file
from ._layout import DCP_FOLDER, DS_FOLDER, DS_TAG, MODEL_FILE, OPTIM_FILE
from ._manifest import Manifest
from ._params import (
    check_against,
    describe_params,
    fit_names,
    fit_optimizer_groups,
    fit_optimizer_state,
)

Optimizers = Mapping[str, torch.optim.Optimizer]

# What torch says on DCP calls without a group or with several backends: facts about
# torch's internals, not about the user's checkpoint.
_DCP_NOISE = (
    r".*(?:_get_pg_default_device|Multiple backends are registered|Please use DTensor instead"
    r"|torch\.distributed is disabled, unavailable or uninitialized)"
)


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Silence torch's internal chatter during DCP calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DCP_NOISE)
        yield


class Attempts:
    """Runs one rank's local writes; keeps the first failure instead of raising, so that
    the rank still takes part in the collective steps after it (the vote reports it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.error: BaseException | None = None

    def run(self, function: Callable[..., Any], *args: Any, what: str = "") -> Any:
        if self.error is not None:
            return None
        try:
            return function(*args)
        except Exception as caught:
            target = what or getattr(function, "__name__", "a part")
            message = f"writing {target} into {self.folder} failed on {where()}: {caught}"
            self.error = CheckpointError(message)
            self.error.__cause__ = caught
            return None


@dataclass(frozen=True)
class LoadRequest:
    """What a load asks of a reader.

    Attributes:
        strict: The model's names must equal the checkpoint's.
        optimizers: The torch optimizers to fill, by the checkpoint's keys (empty: the
            weights only).
        allow_unsafe_pickle: Files that need full unpickling may be read.
    """

    strict: bool = True
    optimizers: Optimizers = field(default_factory=dict)
    allow_unsafe_pickle: bool = False


def load_full_model(
    backend: Backend,
    state: Mapping[str, Any],
    strict: bool,
    source: str,
    expected: Mapping[str, list[Any]] | None = None,
) -> list[str]:
    """Load a full state (every rank holds it) after matching its names with the model's.

    Names may carry wrapper prefixes (``module.``, ``_orig_mod.``...): removed when that
    fits the model better. Returns the names a ``strict=False`` load skipped (missing,
    unexpected or differently shaped: it loads the rest and warns with them).
    ``expected``: the model's `Backend.param_shapes`, when the caller has them.

    Raises:
        CheckpointError: ``strict`` and an entry is missing, unexpected or differently
            shaped (the message names them).
    """
    if expected is None:
        expected = backend.param_shapes()
    fitted = fit_names(state, expected)
    skipped = check_against(expected, describe_params(fitted), source, strict)
    if skipped:
        fitted = {k: v for k, v in fitted.items() if k in expected and k not in skipped}
    backend.load_model_state(fitted, full=True, strict=strict)
    return skipped


def _cannot_move(manifest: Manifest, source: Path, backend: Backend, why: str) -> CheckpointError:
    message = (
        f"{source} holds {manifest.format!r} optimizer state saved under "
        f"{manifest.strategy} ({manifest.wrapper}, world size {manifest.world_size}), which "
        f"cannot load into this {backend.kind} model: {why}. Pass load_optimizer=False to "
        "load the weights (and schedulers, RNG, user state) only."
    )
    return CheckpointError(message)


def _load_full(
    backend: Backend,
    model_state: Mapping[str, Any],
    optim_states: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    request: LoadRequest,
    source: str,
) -> None:
    """Load full model and optimizer states. ``optim_states`` may be a function that reads
    them: it is called after the model is loaded, once ``model_state`` is no longer held
    here (the caller passes the only reference), so a memory-mapped model file's pages can
    leave the resident set before the optimizer file's are read."""
    params = backend.param_shapes()
    skipped = load_full_model(backend, model_state, request.strict, source, params)
    del model_state
    if not request.optimizers:
        return
    states = optim_states() if callable(optim_states) else optim_states
    for key, optimizer in request.optimizers.items():
        state = fit_optimizer_state(
            states[key],
            params,
            skipped,
            f"{source} ({key})",
            groups=backend.optimizer_groups(optimizer),
            own_groups=optimizer.param_groups,
            strict=request.strict,
        )
        try:
            backend.load_optim_state(optimizer, state, full=True, strict=request.strict)
        except ValueError as caught:  # the backend's refusal: about this checkpoint
            message = f"{source} ({key}) does not fit this optimizer: {caught}"
            raise CheckpointError(message) from caught


def _check_portable(
    manifest: Manifest, source: Path, backend: Backend, request: LoadRequest
) -> None:
    why = backend.optimizer_not_portable()
    if request.optimizers and why is not None:
        raise _cannot_move(manifest, source, backend, why)


class FullFormat:
    """Full tensors gathered to rank 0 and written there as ``model.pt`` / ``optim.pt``."""

    name: ClassVar[str] = "full"

    def write(
        self, backend: Backend, optimizers: Optimizers, folder: Path, attempts: Attempts
    ) -> dict[str, list[Any]]:
        leader = dist.get_rank() == 0
        state = backend.model_state(full=True, rank0_only=True)
        # What rank 0 writes, described from the state it holds (asking the model for its
        # shapes would cost FSDP1 a sharded state dict: every unit unsharded once more).
        params = describe_params(state) if leader else {}
        if leader:
            attempts.run(save_tensor_file, state, folder / MODEL_FILE, what=MODEL_FILE)
        del state
        if optimizers:
            states = {
                key: backend.optim_state(optimizer, full=True, rank0_only=True)
                for key, optimizer in optimizers.items()
            }
            if leader:
                attempts.run(save_tensor_file, states, folder / OPTIM_FILE, what=OPTIM_FILE)
        return params

    def read(
        self, source: Path, manifest: Manifest, backend: Backend, request: LoadRequest
    ) -> None:
        _check_portable(manifest, source, backend, request)
        unsafe = request.allow_unsafe_pickle

        def optim_states() -> Any:  # read once the model is in (see _load_full)
            return load_tensor_file(
                source / OPTIM_FILE, allow_unsafe_pickle=unsafe, mmap=True, what="optimizer state"
            )

        _load_full(
            backend,
            load_tensor_file(
                source / MODEL_FILE, allow_unsafe_pickle=unsafe, mmap=True, what="model state"
            ),
            optim_states,
            request,
            str(source / MODEL_FILE),
        )


def sharded_state(backend: Backend, optimizers: Optimizers) -> dict[str, Any]:
    """``{"model": ..., "optim": {key: ...}}`` as DCP saves and loads it: every rank's own
    shards ("optim" only when there are optimizers)."""
    state: dict[str, Any] = {"model": backend.model_state(full=False)}
    if optimizers:
        state["optim"] = {
            key: backend.optim_state(optimizer, full=False) for key, optimizer in optimizers.items()
        }
    return state


class DcpFormat:
    """Every rank writes its shards with torch distributed checkpoint (collective); read
    back resharded to any layout and world size."""

    name: ClassVar[str] = "dcp"

    def write(
        self,
        backend: Backend,
        optimizers: Optimizers,
        folder: Path,
        attempts: Attempts,
        *,
        written: Callable[[], None] | None = None,
        publish: Callable[[dict[str, list[Any]]], None] | None = None,
    ) -> dict[str, list[Any]]:
        """Write every rank's shards (collective); return the model's shapes.

        ``written`` runs on every rank once its shards are written; ``publish`` (given on
        rank 0 only) runs with the shapes inside DCP's last step, once every rank's shards
        and DCP's metadata are written: DCP then hands its outcome to every rank, and a
        failure of ``publish`` raises on every rank, as a failure to write does.

        Raises:
            CheckpointError: On every rank, when any rank failed to write or ``publish``
                failed.
        """
        state = sharded_state(backend, optimizers)
        with quiet_torch():  # the shapes of the state written (global shapes of shards)
            params = describe_params(state["model"])
        finish = None if publish is None else lambda: publish(params)
        writer = _Writer(folder / DCP_FOLDER, written=written, finish=finish)
        try:
            with quiet_torch():
                dcp_save(state, storage_writer=writer)
        # DCP gathers the ranks' failures and raises everywhere, a CheckpointException
        # (a BaseException: ``except Exception`` misses it)
        except (Exception, CheckpointException) as caught:
            unpublished = _unpublished(caught)
            if unpublished is not None:  # rank 0's keeps its cause (the publish's error)
                raise unpublished from (unpublished.__cause__ or caught)
            message = (
                f"torch distributed checkpoint could not write {folder / DCP_FOLDER}: {caught}"
            )
            raise CheckpointError(message) from caught
        return params

    def read(
        self, source: Path, manifest: Manifest, backend: Backend, request: LoadRequest
    ) -> None:
        resharded = manifest.world_size != dist.get_world_size()
        if backend.format_for(True) != self.name or (  # a backend that cannot take shards
            resharded and not backend.reshards_sharded_state
        ):
            _check_portable(manifest, source, backend, request)
            state = read_dcp_full(source)
            _load_full(backend, state["model"], state.get("optim", {}), request, str(source))
            return
        state = sharded_state(backend, request.optimizers)
        skipped = check_against(
            _shapes_of(backend, state["model"]), manifest.params, str(source), request.strict
        )
        if skipped:
            state["model"] = {k: v for k, v in state["model"].items() if k not in skipped}
        folder = source / DCP_FOLDER
        reader = _Reader(folder)  # reads the metadata once, for the checks here and DCP
        if request.optimizers:
            _check_group_count(request.optimizers, reader.keys(), str(source))
        try:
            if request.optimizers:
                _drop_unsaved_optim_state(state["optim"], reader.keys())
            with quiet_torch():
                dcp_load(state, storage_reader=reader)
        except (Exception, CheckpointException) as caught:  # the latter: a BaseException
            message = (
                f"torch distributed checkpoint could not read {folder} on rank "
                f"{dist.get_rank()}: {caught}"
            )
            raise CheckpointError(message) from caught
        backend.load_model_state(state["model"], full=False, strict=request.strict)
        for key, optimizer in request.optimizers.items():
            optim_state = state["optim"][key]
            # One group saved, one here: every parameter is in its group, nothing to fit.
            alone = len(optimizer.param_groups) == 1 == len(optim_state.get("param_groups", ()))
            groups = None if alone else backend.optimizer_groups(optimizer)
            if groups is not None:  # the saved groups' names, read back: each in its group
                optim_state = fit_optimizer_groups(
                    optim_state, groups, optimizer.param_groups, f"{source} ({key})", request.strict
                )
            backend.load_optim_state(optimizer, optim_state, full=False)


def _check_group_count(optimizers: Optimizers, saved: set[str], source: str) -> None:
    """Raise when a DCP checkpoint holds another number of param groups than an optimizer
    (DCP would fail on the group it lacks, or ignore the one it holds in excess)."""
    for key, optimizer in optimizers.items():
        prefix = f"optim.{key}.param_groups."
        count = len({k[len(prefix) :].split(".", 1)[0] for k in saved if k.startswith(prefix)})
        if count and count != len(optimizer.param_groups):
            message = (
                f"{source} ({key}) does not fit this optimizer on rank {dist.get_rank()}: the "
                f"saved optimizer has {count} parameter group(s), this optimizer "
                f"{len(optimizer.param_groups)}. Build the optimizer with the same param "
                "groups as the run that saved, or pass load_optimizer=False to load the "
                "weights only."
            )
            raise CheckpointError(message)


class PublishError(CheckpointError):
    """Rank 0 could not publish a checkpoint whose files every rank wrote (its manifest,
    the rename); raised by the ``publish`` step of `DcpFormat.write`."""


class _Writer(FileSystemWriter):
    """torch's writer of a DCP folder (its defaults, as ``dcp.save(checkpoint_id=...)``
    builds it), running the save's own steps inside DCP's collectives: ``written`` on each
    rank after its shards are written, ``finish`` on the coordinator (rank 0) after DCP's
    metadata, when every rank's shards are written."""

    def __init__(
        self,
        folder: Path,
        *,
        written: Callable[[], None] | None,
        finish: Callable[[], None] | None,
    ) -> None:
        super().__init__(str(folder))
        self._written = written
        self._finish = finish

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        writes = super().write_data(plan, planner)
        if self._written is not None:
            writes.wait()  # the files are whole (torch's writer has written them already)
            self._written()
        return writes

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        if self._finish is not None:
            self._finish()


def _unpublished(caught: BaseException) -> CheckpointError | None:
    """The error to raise on this rank when DCP failed because rank 0's publish did: rank
    0's own, or one naming it (as `Call.vote` names a failed rank)."""
    failures = caught.failures if isinstance(caught, CheckpointException) else {}
    for rank, (error, _) in failures.items():
        if isinstance(error, PublishError):
            if rank == dist.get_rank():
                return error
            text = f"{type(error).__name__}: {error}"
            return CheckpointError(f"save_checkpoint failed on 1 rank(s): rank {rank}: {text}")
    return None


def _shapes_of(backend: Backend, sharded: Mapping[str, Any]) -> dict[str, list[Any]]:
    """`Backend.param_shapes`, from the sharded model state already taken when the backend
    describes its shapes as the base adapter does (the global shapes of that same state:
    asking again would cost one more state dict)."""
    if type(backend).param_shapes is Backend.param_shapes:
        with quiet_torch():
            return describe_params(sharded)
    return backend.param_shapes()


class _Reader(FileSystemReader):
    """torch's reader of a DCP folder, whose metadata file is read (unpickled) once: by
    `keys` for the checks before the load, then given to DCP's own load as it is."""

    def __init__(self, folder: Path) -> None:
        super().__init__(str(folder))
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None or args or kwargs:  # a rank's own file: not cached
            metadata = super().read_metadata(*args, **kwargs)
            if args or kwargs:
                return metadata
            self._metadata = metadata
        return self._metadata

    def keys(self) -> set[str]:
        """The flattened names of every entry the folder holds."""
        return set(self.read_metadata().state_dict_metadata)


def _drop_unsaved_optim_state(optim: dict[str, Any], saved: set[str]) -> None:
    """Leave out of the optimizers' sharded states the parameters the checkpoint holds no
    state for: the saver's optimizer had none for them (no gradient yet, as a parameter
    unused so far), so they get none here either, as in the run that saved. torch builds
    a state for every parameter before a load; DCP would refuse the missing entries."""
    for key, state in optim.items():
        entries = state.get("state") if isinstance(state, dict) else None
        if not isinstance(entries, dict):
            continue
        for name in list(entries):
            prefix = f"optim.{key}.state.{name}."
            if not any(k.startswith(prefix) for k in saved):
                del entries[name]


def read_dcp_full(source: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint's DCP folder, full, in this process (no group needed)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
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
    except (Exception, CheckpointException) as caught:  # the latter: a BaseException
        message = f"torch distributed checkpoint could not read {folder}: {caught}"
        raise CheckpointError(message) from caught
    return state


class DeepSpeedFormat:
    """DeepSpeed's own files under ``deepspeed/``, and beside them the portable full copy
    (``model.pt`` with the fp32 master weights, ``optim.pt`` keyed by parameter names).

    The native files are the fast path into an engine of the same ZeRO stage and world
    size; every other model (another stage, another world size, DDP, FSDP, one process)
    reads the portable copy, optimizer state included. Checkpoints of format version 1
    have no portable copy: their weights are consolidated from DeepSpeed's files.
    """

    name: ClassVar[str] = "deepspeed"

    def write(
        self, backend: Backend, optimizers: Optimizers, folder: Path, attempts: Attempts
    ) -> dict[str, list[Any]]:
        attempts.run(ds_files.save_native, backend.engine, folder)
        # ZeRO-0 in fp16 has no portable optimizer state: its copy holds the weights only
        portable = optimizers if backend.optimizer_not_portable() is None else {}
        return FullFormat().write(backend, portable, folder, attempts)

    def read(
        self, source: Path, manifest: Manifest, backend: Backend, request: LoadRequest
    ) -> None:
        portable = (source / MODEL_FILE).is_file()
        if not portable:  # format version 1: DeepSpeed's files are the only copy
            self._native(source, manifest, backend, request)
            return
        # The native files only where the engine matches them: stage, world size, names and
        # shapes (a strict load; a strict=False load that skips entries takes the portable
        # copy) and precision (a bf16 engine's files have other names).
        skipped = check_against(
            backend.param_shapes(), manifest.params, str(source), request.strict
        )
        if (
            skipped
            or backend.engine is None
            or manifest.zero_stage != backend.describe()["zero_stage"]
            or manifest.world_size != dist.get_world_size()
            or not ds_files.same_precision(source / DS_FOLDER / DS_TAG, backend.engine)
        ):
            FullFormat().read(source, manifest, backend, request)
            return
        error: BaseException | None = None
        try:
            self._native(source, manifest, backend, request)
        except Exception as caught:  # e.g. other parameter groups: DeepSpeed's own error
            error = caught
        try:  # every rank learns whether any rank's native load failed
            dist.agree("load_checkpoint (DeepSpeed's files)", error)
        except dist.RemoteRankError:
            FullFormat().read(source, manifest, backend, request)  # overwrites it all

    def _native(
        self, source: Path, manifest: Manifest, backend: Backend, request: LoadRequest
    ) -> None:
        load_native_folder(
            source / DS_FOLDER,
            DS_TAG,
            (manifest.zero_stage, manifest.world_size),
            backend,
            request,
            cannot_move=lambda why: _cannot_move(manifest, source, backend, why),
            load_optimizer=bool(request.optimizers),
        )


def load_native_folder(
    save_dir: Path,
    tag: str,
    layout: tuple[int | None, int | None],
    backend: Backend,
    request: LoadRequest,
    *,
    cannot_move: Callable[[str], CheckpointError],
    load_optimizer: bool,
) -> None:
    """A DeepSpeed folder saved with ``layout`` = (ZeRO stage, world size): natively into an
    engine of that layout, else read offline into full states (fp32 masters and the
    optimizer state keyed by names) and loaded as a full checkpoint.

    ``load_optimizer`` is what the engine loads natively: the engine owns its optimizer,
    so a folder of DeepSpeed's own loads it even without an optimizer wrapper passed; the
    optimizers of ``request`` are those that must move (one: DeepSpeed has one).
    """
    stage, world = layout
    same_engine = (
        backend.engine is not None
        and stage == backend.describe()["zero_stage"]
        and world == dist.get_world_size()
    )
    unsafe = request.allow_unsafe_pickle
    if same_engine:
        ds_files.load_native(
            backend.engine,
            save_dir,
            tag,
            strict=request.strict,
            load_optimizer=load_optimizer,
            allow_unsafe_pickle=unsafe,
        )
        return
    not_portable = backend.optimizer_not_portable()
    if request.optimizers and not_portable is not None:
        raise cannot_move(not_portable)
    if len(request.optimizers) > 1:
        why = (
            f"a DeepSpeed folder holds one optimizer, the optim wrapper has "
            f"{sorted(request.optimizers)}"
        )
        raise cannot_move(why)
    from ._deepspeed_offline import read_folder

    state = read_folder(
        save_dir / tag, optimizer=bool(request.optimizers), allow_unsafe_pickle=unsafe
    )
    optim_states = {key: state.optim for key in request.optimizers if state.optim is not None}
    moved = LoadRequest(
        request.strict,
        {k: v for k, v in request.optimizers.items() if k in optim_states},
        unsafe,
    )
    _load_full(backend, state.model, optim_states, moved, str(save_dir / tag))


FORMATS: dict[str, FullFormat | DcpFormat | DeepSpeedFormat] = {
    fmt.name: fmt for fmt in (FullFormat(), DcpFormat(), DeepSpeedFormat())
}
