"""Activation checkpointing by module class: recompute a module's activations in the backward.

Every strategy takes ``activation_checkpointing=`` a set of module classes: each submodule
of one of them keeps only its inputs in the forward and runs its forward again in the
backward (``torch.utils.checkpoint``, non-reentrant, random state preserved), trading
compute for memory. The results are those of the run without it.

Each such module gets its own ``forward`` (an instance attribute: a ``functools.partial``
of a module-level function, bound to the module) that checkpoints its class's
``forward``; or, where the module had a ``forward`` of its own already (an instance
attribute, as hooks like accelerate's set), that one, which stays recoverable as
``module.forward.args[1]``. The module keeps its class (``type(m) is Block``, class names in
``auto_wrap_policy`` still match), its parameter and state-dict names (no
``_checkpoint_wrapped_module.`` level: tensor-parallel plans, checkpoints and optimizers
see the same names), its keyword arguments (all of them reach its ``forward``, including
ones named ``debug`` or ``context_fn``), and the model still pickles and deep-copies.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "apply_activation_checkpointing",
    "coerce_activation_checkpointing",
    "is_checkpointed",
]


def coerce_activation_checkpointing(value: Any) -> tuple[type[nn.Module], ...]:
    """The classes of ``activation_checkpointing=``: None, a module class, or an iterable of them.

    Raises:
        TypeError: Something in it is not a subclass of ``nn.Module``.

    Examples:
        >>> coerce_activation_checkpointing({nn.Linear})
        (<class 'torch.nn.modules.linear.Linear'>,)
        >>> coerce_activation_checkpointing(None)
        ()
    """
    if value is None:
        return ()
    items: Iterable[Any] = (value,) if isinstance(value, type) else value
    try:
        classes = tuple(items)
    except TypeError:
        classes = (value,)
    for item in classes:
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            message = (
                "activation_checkpointing must be a set of nn.Module subclasses (e.g. "
                f"{{TransformerBlock}}), got {item!r} in {value!r}"
            )
            raise TypeError(message)
    return tuple(dict.fromkeys(classes))  # unique, in the given order


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run ``module``'s class ``forward`` under ``torch.utils.checkpoint`` (non-reentrant).

    The keyword arguments are bound into the function checkpointed, so that none of them is
    taken for one of ``checkpoint``'s own (``debug``, ``context_fn``, ...).
    """
    run = functools.partial(type(module).forward, module, **kwargs)
    return checkpoint(run, *args, use_reentrant=False)


def _checkpointed_own_forward(
    module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """Run ``forward``, the ``forward`` that ``module`` had as an instance attribute before
    it was checkpointed, under ``torch.utils.checkpoint`` (as `_checkpointed_forward`)."""
    del module  # in the partial so that it names its module, as _checkpointed_forward's does
    run = functools.partial(forward, **kwargs)
    return checkpoint(run, *args, use_reentrant=False)


_CHECKPOINTED = (_checkpointed_forward, _checkpointed_own_forward)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `apply_activation_checkpointing` gave ``module`` its checkpointed forward."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func in _CHECKPOINTED


def apply_activation_checkpointing(model: nn.Module, classes: Any) -> int:
    """Checkpoint the activations of every submodule of ``model`` whose class is in ``classes``.

    Args:
        model: The model, before wrapping (the root itself is included).
        classes: See `coerce_activation_checkpointing`; empty or None does nothing.

    Returns:
        How many modules were checkpointed (those checkpointed already are not counted).

    Raises:
        TypeError: ``classes`` holds something that is not a module class.
        ValueError: No module of ``model`` is of these classes (a typo, or the wrong model).

    Examples:
        >>> import torch
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> apply_activation_checkpointing(model, {nn.Linear})
        2
        >>> model(torch.ones(3, 2)).sum().backward()  # the Linear layers run twice
        >>> sorted(name for name, _ in model.named_parameters())[:2]
        ['0.bias', '0.weight']
    """
    wanted = coerce_activation_checkpointing(classes)
    if not wanted:
        return 0
    found = changed = 0
    for module in model.modules():
        if not isinstance(module, wanted):
            continue
        found += 1
        if is_checkpointed(module):
            continue
        # An instance attribute: plain Python state, so deepcopy and pickle carry it (the
        # partial holds the module-level function and the module itself).
        # A forward set on the instance already (a hook's, a user's) is the one that runs,
        # so that is the one to checkpoint; the class's otherwise.
        own = module.__dict__.get("forward")
        if own is not None:
            module.forward = functools.partial(_checkpointed_own_forward, module, own)
        else:
            module.forward = functools.partial(_checkpointed_forward, module)
        changed += 1
    if not found:
        names = ", ".join(cls.__name__ for cls in wanted)
        message = (
            f"activation_checkpointing names {names}, but {type(model).__name__} has no "
            "module of these classes; pass the classes of the blocks to recompute"
        )
        raise ValueError(message)
    return changed
