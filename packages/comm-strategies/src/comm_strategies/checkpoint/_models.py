"""What kind of model a strategy prepared, and its state as full or sharded dicts.

Every kind but DeepSpeed goes through ``torch.distributed.checkpoint.state_dict``: one
naming (the user's module's names, no ``module.`` or FSDP prefixes) and optimizer state
keyed by those names, whatever the wrapper. DeepSpeed has its own module in
``_deepspeed.py``.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.fsdp import FullyShardedDataParallel

from comm_wrappers import unwrap_model

from ._errors import CheckpointError

KINDS = ("module", "ddp", "fsdp1", "fsdp2", "deepspeed")
# What torch says on every FSDP1 sharded state dict and every DCP call without a group:
# facts about torch's internals, not about the user's checkpoint.
_TORCH_NOISE = (
    "Please use DTensor instead",
    "_get_pg_default_device",
    "Multiple backends are registered",
    "torch.distributed is disabled, unavailable or uninitialized",
)


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Silence torch's internal deprecation chatter during state-dict and DCP calls."""
    with warnings.catch_warnings():
        for text in _TORCH_NOISE:
            warnings.filterwarnings("ignore", message=f".*{text}")
        yield


def deepspeed_engine(model: Any) -> Any:
    """The DeepSpeed engine inside ``model`` (a wrapper or the engine itself), or None."""
    module = sys.modules.get("deepspeed.runtime.engine")
    engine_type = getattr(module, "DeepSpeedEngine", None)
    if engine_type is None:
        return None
    seen = 0
    while model is not None and seen < 8:
        if isinstance(model, engine_type):
            return model
        model = model.__dict__.get("_modules", {}).get("model")
        seen += 1
    return None


def _fsdp2_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return None
    return FSDPModule


def model_kind(model: Any) -> str:
    """``"module"``, ``"ddp"``, ``"fsdp1"``, ``"fsdp2"`` or ``"deepspeed"``."""
    if not isinstance(model, nn.Module):
        message = (
            f"model must be the nn.Module a strategy prepared (a module, DDP, FSDP or DeepSpeed "
            f"wrapper), got {type(model).__name__}"
        )
        raise TypeError(message)
    if deepspeed_engine(model) is not None:
        return "deepspeed"
    fsdp2 = _fsdp2_type()
    ddp = False
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            return "fsdp1"
        if fsdp2 is not None and isinstance(module, fsdp2):
            return "fsdp2"
        if isinstance(module, nn.parallel.DistributedDataParallel):
            ddp = True
    return "ddp" if ddp else "module"


def sharding_of(model: Any, kind: str) -> str | None:
    """FSDP1's sharding strategy name, ``"fully_shard"`` for FSDP2, else None."""
    if kind == "fsdp1":
        for module in model.modules():
            if isinstance(module, FullyShardedDataParallel):
                return str(module.sharding_strategy.name)
    if kind == "fsdp2":
        return "fully_shard"
    return None


def state_target(model: nn.Module, kind: str) -> nn.Module:
    """The module to pass to torch's state-dict functions.

    FSDP1 needs its root wrapper; every other kind its user module (DDP's ``module``,
    FSDP2's sharded module), whose names carry no wrapper prefix.
    """
    if kind == "fsdp1":
        for module in model.modules():
            if isinstance(module, FullyShardedDataParallel):
                return module
    inner: nn.Module = unwrap_model(model)
    return inner


def _on_cpu_device(model: nn.Module) -> bool:
    for parameter in model.parameters():
        return parameter.device.type == "cpu"
    return True


def full_options(model: nn.Module, kind: str, *, rank0_only: bool) -> dsd.StateDictOptions:
    """Options for a full state dict; offloaded to rank 0's CPU where torch allows it.

    FSDP1 with ``cpu_offload`` crashes (SIGSEGV) on a CPU device in torch 2.13: there the
    full tensors stay on every rank (they are on the CPU already).
    """
    offload = rank0_only and kind in ("fsdp1", "fsdp2")
    if kind == "fsdp1" and _on_cpu_device(model):
        offload = False
    return dsd.StateDictOptions(full_state_dict=True, cpu_offload=offload)


def to_cpu(state: Any) -> Any:
    """A nested state with every tensor detached on the CPU (full tensors for DTensors)."""
    if isinstance(state, torch.Tensor):
        full = getattr(state, "full_tensor", None)
        tensor = full() if callable(full) else state
        return tensor.detach().cpu()
    if isinstance(state, Mapping):
        return {key: to_cpu(value) for key, value in state.items()}
    if isinstance(state, list):
        return [to_cpu(value) for value in state]
    if isinstance(state, tuple):
        return tuple(to_cpu(value) for value in state)
    return state


def optimizers_of(optim_wrapper: Any) -> dict[str, torch.optim.Optimizer]:
    """The torch optimizers of an optim wrapper: ``{"": opt}`` or one per dict key."""
    if optim_wrapper is None:
        return {}
    if hasattr(optim_wrapper, "items") and not hasattr(optim_wrapper, "optimizer"):
        return {str(key): value.optimizer for key, value in optim_wrapper.items()}
    if isinstance(optim_wrapper, torch.optim.Optimizer):
        return {"": optim_wrapper}
    optimizer = getattr(optim_wrapper, "optimizer", None)
    if optimizer is None:
        message = (
            "optim_wrapper must be an OptimWrapper, AmpOptimWrapper, OptimWrapperDict, "
            f"DeepSpeedOptimWrapper or torch optimizer, got {type(optim_wrapper).__name__}"
        )
        raise TypeError(message)
    return {"": optimizer}


def scalers_of(optim_wrapper: Any) -> dict[str, Any]:
    """The gradient scalers of AmpOptimWrappers, by optimizer key."""
    if optim_wrapper is None:
        return {}
    if hasattr(optim_wrapper, "items") and not hasattr(optim_wrapper, "optimizer"):
        items = [(str(k), v) for k, v in optim_wrapper.items()]
    else:
        items = [("", optim_wrapper)]
    return {
        key: scaler
        for key, wrapper in items
        if (scaler := getattr(wrapper, "loss_scaler", None)) is not None
    }


def get_model_state(model: nn.Module, kind: str, *, full: bool, rank0_only: bool) -> Any:
    """The model's state: full (CPU tensors) or sharded (DTensors / ShardedTensors)."""
    target = state_target(model, kind)
    with quiet_torch():
        if not full:
            return dsd.get_model_state_dict(target)
        options = full_options(model, kind, rank0_only=rank0_only)
        return to_cpu(dsd.get_model_state_dict(target, options=options))


def get_optim_state(
    model: nn.Module, kind: str, optimizer: torch.optim.Optimizer, *, full: bool, rank0_only: bool
) -> Any:
    """One optimizer's state keyed by parameter names: full (CPU) or sharded."""
    target = state_target(model, kind)
    with quiet_torch():
        if not full:
            return dsd.get_optimizer_state_dict(target, optimizer)
        options = full_options(model, kind, rank0_only=rank0_only)
        return to_cpu(dsd.get_optimizer_state_dict(target, optimizer, options=options))


def sharded_state(
    model: nn.Module, kind: str, optimizers: Mapping[str, torch.optim.Optimizer]
) -> dict[str, Any]:
    """``{"model": ..., "optim": {key: ...}}`` as torch distributed checkpoint saves and loads
    it: every rank's own shards ("optim" only when there are optimizers)."""
    state: dict[str, Any] = {"model": get_model_state(model, kind, full=False, rank0_only=False)}
    if optimizers:
        state["optim"] = {
            key: get_optim_state(model, kind, optimizer, full=False, rank0_only=False)
            for key, optimizer in optimizers.items()
        }
    return state


def set_model_state(
    model: nn.Module, kind: str, state: Mapping[str, Any], *, full: bool, strict: bool
) -> None:
    """Load a full (every rank holds it) or sharded model state into ``model``."""
    target = state_target(model, kind)
    # Unsharded models hold full tensors: nothing to distribute.
    full = full and kind in ("fsdp1", "fsdp2")
    options = dsd.StateDictOptions(full_state_dict=full, strict=strict)
    with quiet_torch():
        dsd.set_model_state_dict(target, dict(state), options=options)


def set_optim_state(
    model: nn.Module,
    kind: str,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any],
    *,
    full: bool,
) -> None:
    """Load one optimizer's state keyed by parameter names (full or sharded)."""
    target = state_target(model, kind)
    # Unsharded models hold full tensors: nothing to distribute. torch's full path also
    # needs one tensor state to find the device (a momentum-less SGD has none): without
    # one there is nothing to shard either.
    full = full and kind in ("fsdp1", "fsdp2") and _has_tensor_state(state)
    options = dsd.StateDictOptions(full_state_dict=full)
    with quiet_torch():
        dsd.set_optimizer_state_dict(target, optimizer, dict(state), options=options)


def _has_tensor_state(state: Mapping[str, Any]) -> bool:
    for values in dict(state.get("state", {})).values():
        for value in dict(values).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return True
    return False


def describe_params(state: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``{name: [shape, dtype]}`` of a (full or sharded) model state."""
    out: dict[str, list[Any]] = {}
    with quiet_torch():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                out[name] = [list(value.shape), str(value.dtype).removeprefix("torch.")]
    return out


def check_against(
    expected: Mapping[str, list[Any]], found: Mapping[str, list[Any]], source: str, strict: bool
) -> None:
    """Compare the model's names and shapes with a checkpoint's; raise naming the mismatch."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = [
        f"{name}: checkpoint {found[name][0]}, model {expected[name][0]}"
        for name in sorted(set(expected) & set(found))
        if list(found[name][0]) != list(expected[name][0])
    ]
    problems = []
    if shapes:
        problems.append("shapes differ: " + "; ".join(shapes[:8]))
    if strict and missing:
        problems.append(f"missing from the checkpoint: {_some(missing)}")
    if strict and unexpected:
        problems.append(f"not in the model: {_some(unexpected)}")
    if problems:
        message = (
            f"{source} does not fit this model ({'; '.join(problems)}). Is it a checkpoint "
            "of another model? Pass strict=False to load the matching names only."
            if not shapes
            else f"{source} does not fit this model ({'; '.join(problems)}). Is it a "
            "checkpoint of another model?"
        )
        raise CheckpointError(message)


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")
