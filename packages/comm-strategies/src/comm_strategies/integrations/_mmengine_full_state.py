"""The full state of sharded models around the ``Runner``'s checkpoints, for `CommRunnerHook`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel


def _sharded_root(model: Any) -> nn.Module | None:
    """The module torch's state-dict API takes for a sharded wrapper; None for others."""
    if isinstance(model, FullyShardedDataParallel):
        return model
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return None
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, FSDPModule):
            return candidate  # type: ignore[return-value]
    return None


def _is_full_optimizer_state(state: Any) -> bool:
    """Whether an optimizer state names its parameters (torch's full state) instead of ids."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, list) or not groups:
        return False
    return all(isinstance(name, str) for group in groups for name in group.get("params", []))


def _add_saved_group_keys(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Give a just-built optimizer's groups the keys the saved run's schedulers added
    (``initial_lr``): torch's loader needs the same keys in both, and the schedulers
    built next keep a value already set."""
    for group, saved in zip(optimizer.param_groups, state.get("param_groups", [])):
        for key, value in saved.items():
            if key != "params":
                group.setdefault(key, value)


def _without_child_wrappers(model: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    prefixes = {
        f"{name}.module.": f"{name}."
        for name, child in model.named_children()
        if isinstance(child, DistributedDataParallel)
    }
    out: dict[str, Any] = {}
    for key, value in state.items():
        for wrapped, clean in prefixes.items():
            if key.startswith(wrapped):
                key = clean + key[len(wrapped) :]
                break
        out[key] = value
    return out


class _GatheredModel:
    """Stands for a sharded model during the runner's rank-0 save: its full state."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        """The state gathered on every rank before the save (as ``Module.state_dict``)."""
        state: Any = OrderedDict(self._state)
        state._metadata = OrderedDict()  # MMEngine's weights_to_cpu reads it
        return state  # type: ignore[no-any-return]


def _strip_module(key: str) -> str:
    return key[len("module.") :] if key.startswith("module.") else key


def _tensors_to_cpu(value: Any) -> Any:
    """Every tensor in a nested state moved to the CPU (containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {key: _tensors_to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors_to_cpu(item) for item in value)
    return value
