"""Helpers around torch's state-dict functions that every adapter shares."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["describe_params", "has_tensor_state", "quiet_torch", "to_cpu"]

# What torch says on every FSDP1 sharded state dict and every DCP call without a group:
# facts about torch's internals, not about the user's model.
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


def to_cpu(state: Any) -> Any:
    """A nested state with every tensor detached on the CPU (full tensors for DTensors).

    A tensor on the CPU already is not copied: the state may share memory with the live
    parameters and optimizer state (copying a whole model costs a save that much time);
    a caller that keeps it while training goes on copies it.
    """
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


def describe_params(state: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``{name: [shape, dtype]}`` of a (full or sharded) model state; dtype without ``torch.``."""
    out: dict[str, list[Any]] = {}
    with quiet_torch():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                out[name] = [list(value.shape), str(value.dtype).removeprefix("torch.")]
    return out


def has_tensor_state(state: Mapping[str, Any]) -> bool:
    """Whether an optimizer state holds one tensor with a dimension (a moment, a buffer).

    torch's full optimizer-state path needs one to find the device; a momentum-less SGD
    has none, and then there is nothing to shard either.
    """
    for values in dict(state.get("state", {})).values():
        for value in dict(values).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return True
    return False


@contextlib.contextmanager
def left_unstepped(
    optimizers: Iterable[Optimizer], to_load: bool
) -> Iterator[Callable[[Optimizer, Mapping[str, Any]], dict[str, Any]]]:
    """Around torch's state getters, which give an optimizer without state zero states
    at step 1 (a step at lr 0: the buffers a load reads into): unless ``to_load``, each
    such optimizer is left without state again on exit, and the function yielded gives
    its state without entries (what it holds)."""
    unstepped = set() if to_load else {id(o) for o in optimizers if not o.state}

    def taken(optimizer: Optimizer, state: Mapping[str, Any]) -> dict[str, Any]:
        return {**state, "state": {}} if id(optimizer) in unstepped else dict(state)

    try:
        yield taken
    finally:
        for optimizer in optimizers:
            if id(optimizer) in unstepped:
                optimizer.state.clear()


def stateless_names(state: Mapping[str, Any]) -> list[str]:
    """The parameters an optimizer state's groups list but that have no state entry: the
    saver's optimizer held them without a state (no gradient had reached them)."""
    entries = state.get("state", {})
    groups = state.get("param_groups", [])
    if not isinstance(entries, Mapping) or not isinstance(groups, list):
        return []
    return [
        name
        for group in groups
        if isinstance(group, Mapping)
        for name in group.get("params", [])
        if isinstance(name, str) and name not in entries
    ]
