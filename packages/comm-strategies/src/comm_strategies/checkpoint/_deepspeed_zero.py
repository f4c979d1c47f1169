"""DeepSpeed's ZeRO 0, 1/2 and 3 checkpoint folders, read offline into full states.

The per-stage readers behind ``_deepspeed_offline.read_folder``; the layouts are described
in that module's docstring.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ._deepspeed_records import (
    _MODEL_STATES,
    DeepSpeedState,
    _buffers,
    _clone,
    _fp32,
    _meta,
    _model_states,
    _ordered,
    _with_shared,
    load_file,
)
from ._errors import CheckpointError


def _rank_files(tag_dir: Path, suffix: str) -> list[Path]:
    """``[bf16_]zero_pp_rank_R_mp_rank_00_<suffix>`` in rank order."""
    found: dict[int, Path] = {}
    for path in tag_dir.glob(f"*zero_pp_rank_*_mp_rank_00_{suffix}"):
        middle = path.name.split("zero_pp_rank_", 1)[1].split("_", 1)[0]
        if middle.isdigit():
            found[int(middle)] = path
    ranks = sorted(found)
    if ranks != list(range(len(ranks))):
        message = (
            f"{tag_dir} holds the {suffix} files of ranks {ranks}: expected ranks 0 to "
            f"{len(ranks) - 1} (a rank's file is missing: the save did not finish)"
        )
        raise CheckpointError(message)
    return [found[rank] for rank in ranks]


def _stage_of(state: Any, path: Path) -> int:
    inner = state.get("optimizer_state_dict") if isinstance(state, Mapping) else None
    stage = inner.get("zero_stage") if isinstance(inner, Mapping) else None
    if stage is None:
        message = f"{path} has no optimizer_state_dict.zero_stage: not a DeepSpeed ZeRO file"
        raise CheckpointError(message)
    return int(stage)


# ------------------------------------------------------------------------ ZeRO 0


def _read_zero0(tag_dir: Path, optimizer: bool, unsafe: bool) -> DeepSpeedState:
    path = tag_dir / _MODEL_STATES
    states = _model_states(path, unsafe)
    module = states["module"]
    buffers = set(states.get("buffer_names") or ())
    names = [name for name in module if name not in buffers]
    saved = states.get("optimizer")
    model = {name: _fp32(value) for name, value in module.items()}
    optim = None
    if isinstance(saved, Mapping) and isinstance(saved.get("fp32_groups"), Sequence):
        # bf16: the optimizer wrapper keeps fp32 masters of every parameter, group by group
        inner = saved.get("optimizer_state_dict", {})
        masters = [t for group in saved["fp32_groups"] for t in group]
        ids = [i for group in inner.get("param_groups", []) for i in group["params"]]
        if len(masters) != len(names) or len(ids) != len(names):
            raise _unnamed(path, len(masters), names)
        model.update({name: master.float().clone() for name, master in zip(names, masters)})
        saved = inner
    elif isinstance(saved, Mapping) and isinstance(saved.get("fp32_groups_flat"), Sequence):
        # fp16's fused optimizer: one flat fp32 master per group, whose members it does not
        # record; one group is the module's parameters in order
        flats = saved["fp32_groups_flat"]
        shapes = [module[name].shape for name in names]
        if len(flats) == 1 and flats[0].numel() == sum(math.prod(s) for s in shapes):
            pieces = flats[0].float().split([math.prod(s) for s in shapes])
            model.update({n: t.reshape(s).clone() for n, t, s in zip(names, pieces, shapes)})
        if optimizer:
            message = (
                f"{path}: the optimizer state of a ZeRO-0 fp16 engine (fused, flat per "
                "group) is not read offline; convert with to='plain' (the fp32 masters), or "
                "load it into a ZeRO-0 engine of the same world size"
            )
            raise CheckpointError(message)
        saved = None
    if optimizer and isinstance(saved, Mapping) and "param_groups" in saved:
        optim = _named_torch_state(saved, names, path)
    world = int(states.get("dp_world_size") or 1)
    return DeepSpeedState(
        model=_ordered(module, model), optim=optim, stage=0, world_size=world, **_meta(states)
    )


def _unnamed(path: Path, count: int, names: Sequence[str]) -> CheckpointError:
    message = (
        f"{path}: the optimizer holds {count} parameter(s), the module {len(names)} "
        f"({', '.join(names[:6])}...): under ZeRO-0 DeepSpeed records no parameter names "
        "for its optimizer, so they are named in the module's order, which needs one "
        "optimizer entry per module parameter (no frozen parameters)"
    )
    return CheckpointError(message)


def _named_torch_state(
    saved: Mapping[str, Any], names: Sequence[str], path: Path
) -> dict[str, Any]:
    """A torch optimizer state dict (integer ids) keyed by names in the module's order."""
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    if len(ids) != len(names):
        raise _unnamed(path, len(ids), names)
    by_id = dict(zip(ids, names))
    state = {
        by_id[i]: {key: _clone(value) for key, value in entry.items()}
        for i, entry in saved.get("state", {}).items()
        if i in by_id
    }
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [by_id[i] for i in group["params"]],
        }
        for group in saved["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------- ZeRO 1/2


def _open_ranks(
    model_path: Path, files: list[Path], first: Any, tag_dir: Path, unsafe: bool, base_key: str
) -> tuple[Any, list[Any], list[Any], list[Mapping[str, Any]]]:
    """Read the model states file and every rank's optimizer file (``first`` is rank 0's,
    read already) and check them against the world; return the model states, each rank's
    ZeRO optimizer state, each rank's torch optimizer state inside it (under ``base_key``)
    and the parameter shapes of each group."""
    states = _model_states(model_path, unsafe)
    ranks = [first] + [load_file(path, allow_unsafe_pickle=unsafe) for path in files[1:]]
    inner = [rank["optimizer_state_dict"] for rank in ranks]
    _check_world(inner[0].get("partition_count"), len(files), tag_dir)
    shapes: list[Mapping[str, Any]] = states.get("param_shapes") or []
    return states, inner, [part[base_key] for part in inner], shapes


def _read_zero12(
    tag_dir: Path, files: list[Path], first: Any, optimizer: bool, unsafe: bool
) -> DeepSpeedState:
    states, inner, base, shapes = _open_ranks(
        tag_dir / _MODEL_STATES, files, first, tag_dir, unsafe, "base_optimizer_state"
    )
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, Any]] = {}
    group_names: list[list[str]] = []
    for group, group_shapes in enumerate(shapes):
        pieces: dict[str, list[torch.Tensor]] = {name: [] for name in group_shapes}
        keys = _flat_keys(base[0]["state"].get(group, {})) if optimizer else []
        moment_pieces: dict[str, dict[str, list[torch.Tensor]]] = {k: {} for k in keys}
        for rank, part in enumerate(inner):
            flat = part["single_partition_of_fp32_groups"][group]
            rank_state = base[rank]["state"].get(group, {})
            for name, address in part["param_slice_mappings"][group].items():
                start, numel = int(address.start), int(address.numel)
                pieces.setdefault(name, []).append(flat.narrow(0, start, numel))
                for key in keys:
                    moment = rank_state[key].narrow(0, start, numel)
                    moment_pieces[key].setdefault(name, []).append(moment)
        for name, shape in group_shapes.items():
            model[name] = _joined(pieces[name], shape, name, files[0])
            if keys:
                entry = {
                    k: _joined(moment_pieces[k].get(name, []), shape, name, files[0]) for k in keys
                }
                entry.update(_scalars(base[0]["state"].get(group, {})))
                moments[name] = entry
        group_names.append(list(group_shapes))
    model.update(_frozen12(states))
    _with_shared(states, model)
    model.update({k: v for k, v in _buffers(states).items() if k not in model})
    optim = _named_groups(base[0]["param_groups"], group_names, moments) if optimizer else None
    return DeepSpeedState(
        model=_ordered(states["module"], model),
        optim=optim,
        stage=int(_stage_of(first, files[0])),
        world_size=len(files),
        **_meta(states),
    )


def _check_world(count: Any, files: int, tag_dir: Path) -> None:
    counts = count if isinstance(count, list) else [count]
    expected = max(int(c) for c in counts) if counts and counts[0] is not None else files
    if expected != files:
        message = (
            f"{tag_dir} holds {files} optimizer file(s), its ZeRO partitions say {expected} "
            "ranks saved it: a rank's file is missing or a stale file is left from another save"
        )
        raise CheckpointError(message)


def _flat_keys(state: Mapping[str, Any]) -> list[str]:
    """The state entries that span the flat group (moments), not scalars (step)."""
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1]


def _scalars(state: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: _clone(v) for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.dim() == 1)
    }


def _joined(pieces: list[torch.Tensor], shape: Any, name: str, path: Path) -> torch.Tensor:
    numel = math.prod(int(d) for d in shape)
    flat = torch.cat(pieces) if pieces else torch.empty(0)
    if flat.numel() != numel:
        message = (
            f"{path.parent}: the fragments of {name} hold {flat.numel()} elements, its "
            f"recorded shape {tuple(shape)} needs {numel}: the files do not belong together"
        )
        raise CheckpointError(message)
    return flat.float().reshape(tuple(int(d) for d in shape)).clone()


def _frozen12(states: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    fragments = states.get("frozen_param_fragments") or {}
    shapes = states.get("frozen_param_shapes") or {}
    return {
        name: _fp32(fragments[name]).reshape(tuple(shape))
        for name, shape in shapes.items()
        if name in fragments
    }


def _named_groups(
    groups: Sequence[Mapping[str, Any]],
    flat_names: Sequence[Sequence[str]],
    state: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Torch's full form: each param group's hyperparameters with the names of the
    parameters of the flat groups its ``params`` list (flat group indices)."""
    named = []
    for group in groups:
        names = [name for index in group["params"] for name in flat_names[int(index)]]
        hyper = {k: v for k, v in group.items() if k != "params"}
        named.append({**hyper, "params": names})
    return {"state": state, "param_groups": named}


# ------------------------------------------------------------------------ ZeRO 3


def _read_zero3(
    tag_dir: Path, files: list[Path], first: Any, optimizer: bool, unsafe: bool
) -> DeepSpeedState:
    model_files = _rank_files(tag_dir, "model_states.pt")
    if len(model_files) != len(files):
        message = (
            f"{tag_dir} holds {len(model_files)} model states file(s) and {len(files)} "
            "optimizer file(s): a ZeRO-3 save writes one of each per rank"
        )
        raise CheckpointError(message)
    states, inner, base, shapes = _open_ranks(
        model_files[0], files, first, tag_dir, unsafe, "optimizer_state_dict"
    )
    world = len(files)
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, Any]] = {}
    group_names: list[list[str]] = []
    for group, group_shapes in enumerate(shapes):
        flats = [part["fp32_flat_groups"][group] for part in inner]
        keys = _flat_keys(base[0]["state"].get(group, {})) if optimizer else []
        offset = 0
        for name, shape in group_shapes.items():
            numel = math.prod(int(d) for d in shape)
            part = math.ceil(numel / world)

            def gather(
                tensors: list[torch.Tensor], at: int = offset, size: int = part
            ) -> list[torch.Tensor]:
                return [t.narrow(0, at, size) for t in tensors]

            model[name] = _joined_padded(gather(flats), shape, name, files[0])
            if keys:
                entry = {
                    k: _joined_padded(
                        gather([b["state"][group][k] for b in base]), shape, name, files[0]
                    )
                    for k in keys
                }
                entry.update(_scalars(base[0]["state"].get(group, {})))
                moments[name] = entry
            offset += part
        if offset != flats[0].numel():
            message = (
                f"{files[0]}: the parameters of group {group} take {offset} elements per rank, "
                f"the flat group holds {flats[0].numel()}: the files do not belong together"
            )
            raise CheckpointError(message)
        group_names.append(list(group_shapes))
    model.update(_frozen3(tag_dir, model_files, states, world, unsafe))
    _with_shared(states, model)
    model.update({k: v for k, v in _buffers(states).items() if k not in model})
    optim = _named_groups(base[0]["param_groups"], group_names, moments) if optimizer else None
    return DeepSpeedState(
        model=_ordered(states["module"], model),
        optim=optim,
        stage=3,
        world_size=world,
        **_meta(states),
    )


def _joined_padded(pieces: list[torch.Tensor], shape: Any, name: str, path: Path) -> torch.Tensor:
    numel = math.prod(int(d) for d in shape)
    flat = torch.cat(pieces)
    if flat.numel() < numel:
        message = (
            f"{path.parent}: {name} needs {numel} elements, its partitions hold {flat.numel()}"
        )
        raise CheckpointError(message)
    return flat[:numel].float().reshape(tuple(int(d) for d in shape)).clone()


def _frozen3(
    tag_dir: Path, files: list[Path], states: Mapping[str, Any], world: int, unsafe: bool
) -> dict[str, torch.Tensor]:
    shapes = states.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    every = [states] + [_model_states(path, unsafe) for path in files[1:]]
    frozen = {}
    for name, shape in shapes.items():
        pieces = [s["frozen_param_fragments"][name].reshape(-1) for s in every]
        frozen[name] = _joined_padded(pieces, shape, name, tag_dir / files[0].name)
    return frozen
