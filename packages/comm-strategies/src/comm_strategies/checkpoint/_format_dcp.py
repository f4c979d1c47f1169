"""The ``dcp`` format: every rank writes its shards with torch distributed checkpoint
(collective), read back resharded to any layout and world size; and the offline reader of
such a folder into full tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.optim import Optimizer

import comm_collectives as dist
from comm_wrappers.backends import Backend, describe_params, quiet_torch

from ._consensus import Attempts
from ._errors import CheckpointError
from ._format_common import LoadRequest, Optimizers, check_portable, load_full, optimizer_source
from ._layout import DCP_FOLDER
from ._manifest import Manifest
from ._params import check_against, check_unlisted, fit_optimizer_groups


def sharded_state(backend: Backend, optimizers: Optimizers, load: bool = False) -> dict[str, Any]:
    """``{"model": ..., "optim": {key: ...}}`` as DCP saves and loads it: every rank's own
    shards ("optim" only when there are optimizers)."""
    model_state, optim_states = backend.sharded_state(optimizers, to_load=load)
    return {"model": model_state, "optim": optim_states} if optimizers else {"model": model_state}


class DcpFormat:
    """Every rank writes its shards with torch distributed checkpoint (collective); read
    back resharded to any layout and world size."""

    name: ClassVar[str] = "dcp"

    def write(
        self, backend: Backend, optimizers: Optimizers, folder: Path, attempts: Attempts
    ) -> dict[str, list[Any]]:
        """Write every rank's shards (collective); return the model's shapes. A failure
        (on every rank: DCP gathers the ranks' outcomes) is kept in ``attempts``."""
        state = sharded_state(backend, optimizers)
        params = describe_params(state["model"])  # the global shapes of the shards
        with attempts.keep(DCP_FOLDER):
            write_dcp(state, folder)
        return params

    def read(
        self, source: Path, manifest: Manifest, backend: Backend, request: LoadRequest
    ) -> None:
        resharded = manifest.world_size != dist.get_world_size()
        if backend.format_for(True) != self.name or (  # a backend that cannot take shards
            resharded and not backend.reshards_sharded_state
        ):
            check_portable(manifest, source, backend, request)
            state = read_dcp_full(source)
            load_full(backend, state["model"], state.get("optim", {}), request, str(source))
            return
        state = sharded_state(backend, request.optimizers, load=True)
        shapes = describe_params(state["model"])  # the global shapes of the shards
        skipped = check_against(shapes, manifest.params, str(source), request.strict)
        if skipped:  # their saved weights and optimizer states are not read (other shapes)
            state["model"] = {k: v for k, v in state["model"].items() if k not in skipped}
            for optim in state.get("optim", {}).values():
                optim["state"] = {k: v for k, v in optim["state"].items() if k not in skipped}
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
        fitted: dict[str, tuple[Optimizer, Mapping[str, Any]]] = {}
        for key, optimizer in request.optimizers.items():
            optim_state = state["optim"][key]
            # One group saved, one here: every parameter is in its group, nothing to fit.
            alone = len(optimizer.param_groups) == 1 == len(optim_state.get("param_groups", ()))
            groups = None if alone else backend.optimizer_groups(optimizer)
            named = optimizer_source(str(source), key, request.optimizers)
            check_unlisted(backend, optimizer, optim_state, named, skipped, request.strict)
            if groups is not None:  # the saved groups' names, read back: each in its group
                optim_state = fit_optimizer_groups(
                    optim_state, groups, optimizer.param_groups, named, request.strict
                )
            fitted[key] = (optimizer, optim_state)
        # the model, then each optimizer (one torch call for a model and one optimizer)
        backend.load_sharded_state(state["model"], fitted, strict=request.strict)


def _check_group_count(optimizers: Optimizers, saved: set[str], source: str) -> None:
    """Raise when a DCP checkpoint holds another number of param groups than an optimizer
    (DCP would fail on the group it lacks, or ignore the one it holds in excess)."""
    for key, optimizer in optimizers.items():
        prefix = f"optim.{key}.param_groups."
        count = len({k[len(prefix) :].split(".", 1)[0] for k in saved if k.startswith(prefix)})
        if count and count != len(optimizer.param_groups):
            message = (
                f"{optimizer_source(source, key, optimizers)} does not fit this optimizer on rank "
                f"{dist.get_rank()}: the saved optimizer has {count} parameter group(s), this "
                f"optimizer {len(optimizer.param_groups)}. Build the optimizer with the same "
                "param groups as the run that saved, or pass load_optimizer=False to load the "
                "weights only."
            )
            raise CheckpointError(message)


def write_dcp(state: Mapping[str, Any], folder: Path, group: Any = None) -> None:
    """``dcp.save`` of ``state`` into ``folder/dcp`` over ``group`` (the default group when
    None); collective over that group.

    Raises:
        CheckpointError: On every rank, when any rank failed to write.
    """
    target = folder / DCP_FOLDER
    try:
        with quiet_torch():
            dcp_save(dict(state), storage_writer=FileSystemWriter(str(target)), process_group=group)
    # DCP gathers the ranks' failures and raises everywhere, a CheckpointException
    # (a BaseException: ``except Exception`` misses it)
    except (Exception, CheckpointException) as caught:
        message = f"torch distributed checkpoint could not write {target}: {caught}"
        raise CheckpointError(message) from caught


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
    for optim in state.get("optim", {}).values():  # DCP dropped an empty one (no step yet)
        optim.setdefault("state", {})
    return state
