"""DeepSpeed's checkpoint folders read offline and safely: full fp32 weights and optimizer state.

Reads what ``engine.save_checkpoint`` writes under ``save_dir/tag`` (ZeRO 0, 1, 2, 3; fp32 or
bf16) and DeepSpeed's universal layout (``tag/zero/<name>/fp32.pt``...), in one process,
with ``torch.load(weights_only=True)`` and DeepSpeed's few record classes allowed: no
process group, no full unpickling. The layouts, as DeepSpeed 0.19 writes them:

- ZeRO 1/2: ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank R
  holds, per parameter group, R's piece of the flat fp32 masters
  (``single_partition_of_fp32_groups``), the base optimizer's state over the same piece
  (``base_optimizer_state``) and where each parameter's fragment lies in the piece
  (``param_slice_mappings``); the pieces of the ranks, in rank order, tile the parameters.
- ZeRO 3: the same files hold ``fp32_flat_groups`` per sub-group; each parameter takes
  ``ceil(numel / world)`` elements of every rank's flat group (the last rank padded);
  ``zero_pp_rank_R_mp_rank_00_model_states.pt`` holds ``param_shapes`` and the buffers.
- ZeRO 0: ``mp_rank_00_model_states.pt`` holds the whole module and the optimizer's own
  state dict (bf16: its fp32 masters as ``fp32_groups``).

The optimizer state comes out in the form of torch's
``get_optimizer_state_dict(..., full_state_dict=True)``: keyed by parameter names.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ._errors import CheckpointError
from ._files import UNSAFE_HINT, _first_line, _weights_only_detail, deepspeed_safe_globals

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


def load_file(path: Path, *, allow_unsafe_pickle: bool = False) -> Any:
    """One of DeepSpeed's files with ``weights_only=True`` and its record classes allowed.

    Full unpickling only with ``allow_unsafe_pickle`` and only for a file the safe
    loader refuses (one that holds objects beyond DeepSpeed's plain records).
    """
    if not path.is_file():
        message = f"DeepSpeed file {path} does not exist: the checkpoint is incomplete"
        raise CheckpointError(message)
    mmap = zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        if allow_unsafe_pickle:
            return _load_unsafe(path)
        message = (
            f"{path} holds objects beyond DeepSpeed's plain checkpoint records "
            f"({_weights_only_detail(str(error))}). {UNSAFE_HINT}."
        )
        raise CheckpointError(message) from error
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError) as error:
        message = f"{path} is truncated or corrupt (torch.load says: {_first_line(error)})"
        raise CheckpointError(message) from error


def _load_unsafe(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        message = f"{path} is truncated or corrupt: {_first_line(error)}"
        raise CheckpointError(message) from error


def is_universal(tag_dir: Path) -> bool:
    """Whether a tag folder is in DeepSpeed's universal layout (``zero/optimizer_state.pt``)."""
    return (tag_dir / UNIVERSAL_FOLDER / UNIVERSAL_OPTIM_FILE).is_file()


def read_folder(
    tag_dir: Path, *, optimizer: bool = True, allow_unsafe_pickle: bool = False
) -> DeepSpeedState:
    """Read a DeepSpeed tag folder (``save_dir/tag``) into full states, offline.

    Args:
        tag_dir: The folder that holds ``*model_states.pt`` (and the optimizer files).
        optimizer: Also rebuild the full optimizer state (else ``optim`` is None).
        allow_unsafe_pickle: Fall back to full unpickling for files that hold objects
            beyond DeepSpeed's plain records (only files you trust).

    Raises:
        CheckpointError: A missing, truncated or foreign file, or a layout that does not
            add up (the message names the file and what was expected).
    """
    unsafe = allow_unsafe_pickle
    if is_universal(tag_dir):
        return _read_universal(tag_dir, optimizer, unsafe)
    _refuse_model_parallel(tag_dir)
    optim_files = _rank_files(tag_dir, "optim_states.pt")
    if not optim_files:
        return _read_zero0(tag_dir, optimizer, unsafe)
    first = load_file(optim_files[0], allow_unsafe_pickle=unsafe)
    stage = _stage_of(first, optim_files[0])
    if stage == 3:
        return _read_zero3(tag_dir, optim_files, first, optimizer, unsafe)
    return _read_zero12(tag_dir, optim_files, first, optimizer, unsafe)


def _refuse_model_parallel(tag_dir: Path) -> None:
    """Tensor-, pipeline- or expert-parallel saves split the parameters further: refused
    by name rather than read half."""
    others = sorted(
        p.name
        for pattern in ("*mp_rank_0[1-9]*", "*mp_rank_[1-9]*", "layer_*", "*expert_*")
        for p in tag_dir.glob(pattern)
    )
    if others:
        message = (
            f"{tag_dir} holds the files of a tensor-, pipeline- or expert-parallel save "
            f"({', '.join(others[:4])}...): this reader takes data-parallel ZeRO checkpoints "
            "only; convert it with DeepSpeed's ds_to_universal.py first (comm reads the "
            "universal folder it writes)"
        )
        raise CheckpointError(message)


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


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


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


# ----------------------------------------------------------------- universal


def _read_universal(tag_dir: Path, optimizer: bool, unsafe: bool) -> DeepSpeedState:
    zero = tag_dir / UNIVERSAL_FOLDER
    common = load_file(zero / UNIVERSAL_OPTIM_FILE, allow_unsafe_pickle=unsafe)
    states_path = tag_dir / _MODEL_STATES
    if not states_path.is_file():
        states_path = tag_dir / f"zero_pp_rank_0_{_MODEL_STATES}"
    states = _model_states(states_path, unsafe)
    # DeepSpeed's converter writes ZeRO-3's tensors flat: shaped by the recorded shapes.
    shapes = {
        n: tuple(int(d) for d in v) for s in states.get("param_shapes") or [] for n, v in s.items()
    }
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, Any]] = {}
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        name = folder.name
        entry: dict[str, Any] = {}
        for file in sorted(folder.glob("*.pt")):
            value = load_file(file, allow_unsafe_pickle=unsafe)
            if isinstance(value, Mapping):
                value = value[UNIVERSAL_KEY]
            if isinstance(value, torch.Tensor) and value.dim() == 1 and name in shapes:
                value = value.reshape(shapes[name])
            if file.stem == "fp32":
                model[name] = value.float().clone()
            else:
                entry[file.stem] = _clone(value)
        if optimizer and any(k != "step" for k in entry):
            moments[name] = entry
    step = _universal_step(common)  # ZeRO-3's converter writes no step.pt: one step for all
    for entry in moments.values():
        if "step" not in entry and step is not None:
            entry["step"] = _clone(step)
    model.update({k: v for k, v in _buffers(states).items() if k not in model})
    groups = [dict(group) for group in common.get("param_groups", [])]
    optim = None
    if optimizer and groups and moments:
        optim = {"state": moments, "param_groups": _universal_groups(groups, states, model)}
    world = int(states.get("dp_world_size") or 1)
    return DeepSpeedState(
        model=_ordered(states["module"], model),
        optim=optim,
        stage=None,
        world_size=world,
        **_meta(states),
    )


def _universal_step(common: Mapping[str, Any]) -> Any:
    inner = common.get("optimizer_state_dict")
    state = inner.get("state") if isinstance(inner, Mapping) else None
    first = next(iter(state.values()), None) if isinstance(state, Mapping) and state else None
    return first.get("step") if isinstance(first, Mapping) else None


def _universal_groups(
    groups: list[dict[str, Any]], states: Mapping[str, Any], model: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The param groups of a universal folder, by names: as this module writes them
    (names), or as DeepSpeed's converter does (flat group indices, named through the
    model states' ``param_shapes``), or one group of every parameter."""
    recorded = [p for group in groups for p in group.get("params", [])]
    if all(isinstance(p, str) for p in recorded):
        return groups
    shapes = states.get("param_shapes") or []
    if shapes and all(int(p) < len(shapes) for p in recorded):
        named: list[dict[str, Any]] = _named_groups(groups, [list(s) for s in shapes], {})[
            "param_groups"
        ]
        return named
    if len(groups) == 1:
        buffers = _buffers(states)
        params = [name for name in _ordered(states["module"], model) if name not in buffers]
        return [{**{k: v for k, v in groups[0].items() if k != "params"}, "params": params}]
    message = (
        f"{len(groups)} parameter groups whose parameters are not named, and no param_shapes "
        "to name them: the universal folder's model states file is missing or foreign"
    )
    raise CheckpointError(message)


# ------------------------------------------------------- writing the universal layout

UNIVERSAL_TAG = "universal"
UNIVERSAL_LATEST = "latest_universal"


def _ds_version() -> str:
    """The installed DeepSpeed's version, from its metadata (importing it logs to stdout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "0.19.8"  # the layout written here is what this version reads


def universal_files(
    model: Mapping[str, torch.Tensor],
    optim: Mapping[str, Any] | None,
    *,
    world_size: int,
    global_steps: int | None = None,
    lr_scheduler: Any = None,
) -> Iterator[tuple[str, Any]]:
    """The files of a DeepSpeed universal checkpoint, as ``(path in save_dir, object)``.

    What DeepSpeed 0.19's ``engine.load_checkpoint`` reads with ``{"checkpoint":
    {"load_universal": true}}`` (ZeRO 1-3, any data-parallel world size):
    ``latest_universal`` (the tag); ``TAG/mp_rank_00_model_states.pt`` (ZeRO 1/2) and
    ``TAG/zero_pp_rank_0_mp_rank_00_model_states.pt`` (ZeRO-3): the step counters;
    ``TAG/zero/optimizer_state.pt``: the hyperparameters of each group (ZeRO 1/2 read
    ``param_groups``, ZeRO-3 ``optimizer_state_dict``); ``TAG/zero/NAME/fp32.pt`` (the
    fp32 master), ``exp_avg.pt``, ``exp_avg_sq.pt`` (``{"param": full tensor}``) and
    ``step.pt`` per parameter. ``mp_rank_00_model_states.pt`` also holds the full module
    and the optimizer's own state dict, which a ZeRO-0 engine loads natively (without
    ``load_universal``, ``tag="universal"``): the folder is about twice the size of the
    state. Plain objects only: every file loads with ``torch.load(weights_only=True)``.

    Args:
        model: Full parameters and buffers by name (floating ones written as fp32).
        optim: Torch's full optimizer state keyed by names (one optimizer), or None.
        world_size: The data-parallel world size recorded (informative: any loads it).
        global_steps: The engine's step counter to restore (default: the optimizer step).
        lr_scheduler: An engine LR scheduler state to restore (DeepSpeed's sources).
    """
    fp32 = {name: _fp32(value).contiguous() for name, value in model.items()}
    state: Mapping[str, Mapping[str, Any]] = (optim or {}).get("state", {})
    groups: list[dict[str, Any]] = [dict(g) for g in (optim or {}).get("param_groups", [])]
    params = [name for group in groups for name in group.get("params", [])]
    missing = [name for name in params if name not in fp32]
    if missing:
        message = (
            f"the optimizer state names parameters the model state lacks: {missing[:8]}; "
            "the model and optimizer states do not belong together"
        )
        raise CheckpointError(message)
    step = _first_step(state)
    steps = (
        global_steps if global_steps is not None else int(step.item()) if step is not None else 0
    )
    version = _ds_version()
    buffers = [name for name in fp32 if params and name not in params]
    model_states = {
        "module": fp32,
        "buffer_names": buffers,
        "optimizer": _torch_form(state, groups) if groups else None,
        "param_shapes": [
            {name: torch.Size(fp32[name].shape) for name in group["params"]} for group in groups
        ]
        or [{name: torch.Size(t.shape) for name, t in fp32.items()}],
        "frozen_param_shapes": None,
        "shared_params": {},
        "frozen_param_fragments": None,
        "lr_scheduler": lr_scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": steps,
        "dp_world_size": world_size,
        "mp_world_size": 1,
        "ds_version": version,
    }
    yield UNIVERSAL_LATEST, UNIVERSAL_TAG
    yield f"{UNIVERSAL_TAG}/{_MODEL_STATES}", model_states
    # ZeRO-3 engines read only the counters of theirs: no second copy of the weights.
    counters = {**model_states, "module": {}, "optimizer": None}
    yield f"{UNIVERSAL_TAG}/zero_pp_rank_0_{_MODEL_STATES}", counters
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    common = {
        "param_groups": groups,
        "optimizer_state_dict": {
            "state": {0: {"step": step if step is not None else torch.tensor(0.0)}},
            "param_groups": [{**h, "params": [i]} for i, h in enumerate(hyper)],
        },
        "ds_version": version,
    }
    zero = f"{UNIVERSAL_TAG}/{UNIVERSAL_FOLDER}"
    yield f"{zero}/{UNIVERSAL_OPTIM_FILE}", common
    for name, value in fp32.items():
        yield f"{zero}/{name}/fp32.pt", {UNIVERSAL_KEY: value}
        for key, entry in state.get(name, {}).items():
            if entry is None:  # SGD without momentum keeps momentum_buffer=None
                continue
            if isinstance(entry, torch.Tensor) and entry.dim() > 0:
                yield f"{zero}/{name}/{key}.pt", {UNIVERSAL_KEY: entry.float().contiguous()}
            else:
                yield f"{zero}/{name}/{key}.pt", _clone(entry)


def _first_step(state: Mapping[str, Mapping[str, Any]]) -> torch.Tensor | None:
    for entry in state.values():
        step = entry.get("step")
        if step is not None:
            return torch.as_tensor(step, dtype=torch.float32).clone()
    return None


def _torch_form(
    state: Mapping[str, Mapping[str, Any]], groups: list[dict[str, Any]]
) -> dict[str, Any]:
    """Torch's own optimizer state dict (integer ids in group order), for ZeRO-0."""
    ids: dict[str, int] = {}
    torch_groups = []
    for group in groups:
        numbered = []
        for name in group["params"]:
            ids[name] = len(ids)
            numbered.append(ids[name])
        torch_groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": numbered}
        )
    return {
        "state": {ids[name]: dict(entry) for name, entry in state.items() if name in ids},
        "param_groups": torch_groups,
    }
