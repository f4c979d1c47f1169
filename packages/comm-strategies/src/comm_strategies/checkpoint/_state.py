"""Full model and optimizer state of any prepared model: the public, collective functions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from comm_wrappers.backends import Backend, backend_of

from .._build import torch_optimizers
from ._errors import CheckpointError
from ._format_common import load_full_model, load_full_optimizers
from ._layout import DEFAULT_KEY


def refuse_unportable(backend: Backend, what: str) -> None:
    """Raise when the backend's optimizer state has no per-parameter full form."""
    why = backend.optimizer_not_portable()
    if why is not None:
        message = (
            f"{what}: {why}. Save it with save_checkpoint in its natural format "
            f"({backend.format_for(None)!r}), or move the weights only "
            "(load_optimizer=False / optim_wrapper=None)."
        )
        raise CheckpointError(message)


def full_model_state_dict(model: nn.Module | Backend) -> dict[str, torch.Tensor]:
    """Return the model's full state dict, unprefixed, on the CPU, on every rank.

    Collective: every rank must call it (FSDP and ZeRO-3 gather the shards).

    Args:
        model: A module, or what a strategy prepared (DDP, FSDP1, FSDP2, DeepSpeed), or
            its adapter (``comm_wrappers.backends.backend_of(model)``).

    Returns:
        ``{name: tensor}`` with the user module's names (no ``module.`` prefix).

    Examples:
        >>> import torch
        >>> from comm_strategies.checkpoint import full_model_state_dict
        >>> sorted(full_model_state_dict(torch.nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    return backend_of(model).model_state(full=True)


def full_optim_state_dict(model: nn.Module | Backend, optim_wrapper: Any) -> dict[str, Any]:
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
    backend = backend_of(model)
    refuse_unportable(backend, "full_optim_state_dict")
    states = {
        key: backend.optim_state(optimizer, full=True)
        for key, optimizer in torch_optimizers(optim_wrapper, default_key=DEFAULT_KEY).items()
    }
    return states[DEFAULT_KEY] if list(states) == [DEFAULT_KEY] else states


def load_full_model_state_dict(
    model: nn.Module | Backend,
    state_dict: Mapping[str, Any],
    strict: bool = True,
    *,
    source: str = "",
) -> None:
    """Load a full state dict (every rank passes it) into any prepared model.

    Collective. Names may carry ``module.`` / ``_orig_mod.`` prefixes (MMEngine, DDP and
    ``torch.compile`` checkpoints): they are removed. Under DeepSpeed the fp32 master
    copy is refreshed too (ZeRO 1-3), and ZeRO-3 partitions the new weights again.

    Args:
        model: What a strategy prepared, or its adapter.
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
    load_full_model(backend_of(model), state_dict, strict, source or "the state dict")


def load_full_optim_state_dict(
    model: nn.Module | Backend,
    optim_wrapper: Any,
    state_dict: Mapping[str, Any],
    strict: bool = True,
) -> None:
    """Load a full optimizer state keyed by parameter names (from `full_optim_state_dict`).

    Collective. An ``OptimWrapperDict`` takes ``{key: state}``. An entry for a name that
    is not a parameter of ``model`` raises `CheckpointError` naming it; so does, with
    ``strict``, a trainable parameter the state leaves out or a parameter in another param
    group than the optimizer's (``strict=False`` loads the rest, with a warning).

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
    backend = backend_of(model)
    refuse_unportable(backend, "load_full_optim_state_dict")
    optimizers = torch_optimizers(optim_wrapper, default_key=DEFAULT_KEY)
    states = {DEFAULT_KEY: state_dict} if list(optimizers) == [DEFAULT_KEY] else state_dict
    if sorted(states) != sorted(optimizers):
        message = (
            f"the optimizer state holds {sorted(states)}, the optim wrapper has "
            f"{sorted(optimizers)}: they must match"
        )
        raise CheckpointError(message)
    params = backend.param_shapes()
    load_full_optimizers(backend, states, optimizers, "the optimizer state", params, (), strict)
