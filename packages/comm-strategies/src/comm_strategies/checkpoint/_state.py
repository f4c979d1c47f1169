"""Full model and optimizer state of any prepared model: the public, collective functions."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ._errors import CheckpointError
from ._models import (
    check_against,
    deepspeed_engine,
    describe_params,
    get_model_state,
    get_optim_state,
    model_kind,
    optimizers_of,
    set_model_state,
    set_optim_state,
    state_target,
)

_PREFIXES = re.compile(r"^(module\.|_orig_mod\.|_fsdp_wrapped_module\.|model\.module\.)+")
DEFAULT_KEY = "default"


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return the model's full state dict, unprefixed, on the CPU, on every rank.

    Collective: every rank must call it (FSDP and ZeRO-3 gather the shards).

    Args:
        model: A module, or what a strategy prepared (DDP, FSDP1, FSDP2, DeepSpeed).

    Returns:
        ``{name: tensor}`` with the user module's names (no ``module.`` prefix).

    Examples:
        >>> import torch
        >>> from comm_strategies.checkpoint import full_model_state_dict
        >>> sorted(full_model_state_dict(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    kind = model_kind(model)
    if kind == "deepspeed":
        from ._deepspeed import full_model_state

        return full_model_state(deepspeed_engine(model), rank0_only=False)
    state: dict[str, torch.Tensor] = get_model_state(model, kind, full=True, rank0_only=False)
    return state


def _named_optimizers(optim_wrapper: Any) -> dict[str, torch.optim.Optimizer]:
    optimizers = optimizers_of(optim_wrapper)
    return {DEFAULT_KEY if key == "" else key: value for key, value in optimizers.items()}


def _refuse_deepspeed_optimizer(model: Any, what: str) -> None:
    engine = deepspeed_engine(model)
    if engine is None:
        return
    from ._deepspeed import zero_stage

    if zero_stage(engine) > 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        message = (
            f"{what}: DeepSpeed keeps this engine's optimizer state in its own partitioned "
            f"form (ZeRO stage {zero_stage(engine)}), which has no per-parameter full form "
            "here. Save it with save_checkpoint (DeepSpeed's files), or move the weights "
            "only (load_optimizer=False / optim_wrapper=None)."
        )
        raise CheckpointError(message)


def full_optim_state_dict(model: nn.Module, optim_wrapper: Any) -> dict[str, Any]:
    """Return the optimizer state, full, keyed by parameter names, on every rank.

    Collective. An ``OptimWrapperDict`` gives ``{key: state}`` of each of its optimizers;
    one optimizer gives its state directly. DeepSpeed engines: only ZeRO-0 in fp32 (the
    client torch optimizer); ZeRO 1-3 raise `CheckpointError`.

    Examples:
        >>> import torch
        >>> from comm_strategies.checkpoint import full_optim_state_dict
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> full_optim_state_dict(model, optimizer)["param_groups"][0]["params"]
        ['weight', 'bias']
    """
    _refuse_deepspeed_optimizer(model, "full_optim_state_dict")
    kind = model_kind(model)
    optimizers = _named_optimizers(optim_wrapper)
    if kind == "deepspeed":
        model, kind = deepspeed_engine(model).module, "module"
    states = {
        key: get_optim_state(model, kind, optimizer, full=True, rank0_only=False)
        for key, optimizer in optimizers.items()
    }
    if list(states) == [DEFAULT_KEY]:
        state: dict[str, Any] = states[DEFAULT_KEY]
        return state
    return states


def strip_prefixes(state: Mapping[str, Any]) -> dict[str, Any]:
    """Drop wrapper prefixes (``module.``, ``_orig_mod.``...) from a state dict's names."""
    return {_PREFIXES.sub("", key): value for key, value in state.items()}


def load_full_model_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, *, source: str = ""
) -> None:
    """Load a full state dict (every rank passes it) into any prepared model.

    Collective. Names may carry ``module.`` / ``_orig_mod.`` prefixes (MMEngine, DDP and
    ``torch.compile`` checkpoints): they are removed. Under DeepSpeed the fp32 master
    copy is refreshed too (ZeRO 1-3), and ZeRO-3 partitions the new weights again.

    Args:
        model: What a strategy prepared.
        state_dict: ``{name: tensor}``, full.
        strict: Every name of the model must be in ``state_dict`` and no other.
        source: Where the state came from, for error messages.

    Raises:
        CheckpointError: Names or shapes do not fit the model (the message lists them).

    Examples:
        >>> import torch
        >>> from comm_strategies.checkpoint import load_full_model_state_dict
        >>> model = torch.nn.Linear(2, 1)
        >>> load_full_model_state_dict(model, {"module.weight": torch.ones(1, 2), "module.bias": torch.zeros(1)})
        >>> model.weight.tolist()
        [[1.0, 1.0]]
    """
    kind = model_kind(model)
    if kind == "deepspeed":
        from ._deepspeed import load_full_model_state, param_shapes

        engine = deepspeed_engine(model)
        expected = param_shapes(engine)
    else:
        expected = _expected_params(model, kind)
    state = _fit_names(state_dict, expected)
    found = describe_params(state)
    check_against(expected, found, source or "the state dict", strict)
    if not strict:
        state = {k: v for k, v in state.items() if k in expected}
    if kind == "deepspeed":
        load_full_model_state(engine, state, strict)
    else:
        set_model_state(model, kind, state, full=True, strict=strict)


def _fit_names(state: Mapping[str, Any], expected: Mapping[str, Any]) -> dict[str, Any]:
    """The state with wrapper prefixes removed, unless its names fit the model as they are."""
    as_is = dict(state)
    if set(as_is) <= set(expected):
        return as_is
    stripped = strip_prefixes(state)
    if len(set(stripped) & set(expected)) > len(set(as_is) & set(expected)):
        return stripped
    return as_is


def _expected_params(model: nn.Module, kind: str) -> dict[str, list[Any]]:
    """``{name: [shape, dtype]}`` of the model's full state, without gathering anything."""
    from torch.distributed.checkpoint import state_dict as dsd

    state = dsd.get_model_state_dict(state_target(model, kind))
    return describe_params(state)


def load_full_optim_state_dict(
    model: nn.Module, optim_wrapper: Any, state_dict: Mapping[str, Any]
) -> None:
    """Load a full optimizer state keyed by parameter names (from `full_optim_state_dict`).

    Collective. An ``OptimWrapperDict`` takes ``{key: state}``.

    Examples:
        >>> import torch
        >>> from comm_strategies.checkpoint import full_optim_state_dict, load_full_optim_state_dict
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = full_optim_state_dict(model, optimizer)
        >>> state["param_groups"][0]["lr"] = 0.5
        >>> load_full_optim_state_dict(model, optimizer, state)
        >>> optimizer.param_groups[0]["lr"]
        0.5
    """
    _refuse_deepspeed_optimizer(model, "load_full_optim_state_dict")
    kind = model_kind(model)
    optimizers = _named_optimizers(optim_wrapper)
    if kind == "deepspeed":
        model, kind = deepspeed_engine(model).module, "module"
    states = {DEFAULT_KEY: state_dict} if list(optimizers) == [DEFAULT_KEY] else state_dict
    if sorted(states) != sorted(optimizers):
        message = (
            f"the optimizer state holds {sorted(states)}, the optim wrapper has "
            f"{sorted(optimizers)}: they must match"
        )
        raise CheckpointError(message)
    for key, optimizer in optimizers.items():
        set_optim_state(model, kind, optimizer, states[key], full=True)
