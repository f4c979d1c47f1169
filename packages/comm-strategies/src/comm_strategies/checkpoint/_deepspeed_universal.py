"""DeepSpeed's universal checkpoint layout (``tag/zero/<name>/fp32.pt``...): read and written.

``_read_universal`` reads a universal folder (DeepSpeed's ``ds_to_universal.py`` output, or
this module's) into full states; ``universal_files`` lays full states out as one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ._deepspeed_records import (
    _MODEL_STATES,
    UNIVERSAL_FOLDER,
    UNIVERSAL_KEY,
    UNIVERSAL_OPTIM_FILE,
    DeepSpeedState,
    _buffers,
    _clone,
    _fp32,
    _meta,
    _model_states,
    _ordered,
    load_file,
)
from ._deepspeed_zero import _named_groups
from ._errors import CheckpointError

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
