"""Activation checkpointing by module class: recompute a module's activations in the backward.

Every strategy takes ``activation_checkpointing=`` a set of module classes: each submodule
of one of them keeps only its inputs in the forward and runs its forward again in the
backward (``torch.utils.checkpoint``, non-reentrant, random state preserved), trading
compute for memory. The results are those of the run without it.

The module's class is swapped for a subclass whose ``forward`` checkpoints the original
one (as ``fully_shard`` swaps classes): parameter and state-dict names do not change
(no ``_checkpoint_wrapped_module.`` level), so tensor-parallel plans, checkpoints and
optimizers see the same names, and a deep copy of the model stays independent.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "coerce_activation_checkpointing"]

_MADE: dict[type[nn.Module], type[nn.Module]] = {}


class _Checkpointed:
    """Marks the classes made here (their modules are checkpointed already)."""


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


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    made = _MADE.get(cls)
    if made is None:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            run = functools.partial(cls.forward, self)
            return checkpoint(run, *args, use_reentrant=False, **kwargs)

        made = type(
            f"Checkpointed{cls.__name__}",
            (_Checkpointed, cls),
            {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__},
        )
        _MADE[cls] = made
    return made


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
        if isinstance(module, _Checkpointed):
            continue
        module.__class__ = _checkpointed_class(type(module))
        changed += 1
    if not found:
        names = ", ".join(cls.__name__ for cls in wanted)
        message = (
            f"activation_checkpointing names {names}, but {type(model).__name__} has no "
            "module of these classes; pass the classes of the blocks to recompute"
        )
        raise ValueError(message)
    return changed
