"""Which objects are model wrappers, and how to get the user's module back out of them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["is_model_wrapper", "register_model_wrapper", "unwrap_model"]

Unwrap = Callable[[Any], Any]

# Wrapper type -> how to reach the wrapped module. Searched in registration order, by
# isinstance, so a subclass of a registered type is a wrapper too.
_UNWRAP: dict[type, Unwrap] = {}


def _inner_module(model: Any) -> Any:
    return model.module


def register_model_wrapper(
    wrapper_type: type, unwrap: Unwrap | None = None, *, override: bool = False
) -> type:
    """Register a model wrapper type, so `is_model_wrapper` and `unwrap_model` know it.

    Usable as a class decorator. Third-party packages call it when they are imported.

    Args:
        wrapper_type: The wrapper class.
        unwrap: Returns the wrapped object of an instance; default ``instance.module``.
            It may return another wrapper: `unwrap_model` unwraps until none is left.
        override: Replace an existing registration instead of raising.

    Returns:
        ``wrapper_type``, unchanged.

    Raises:
        TypeError: ``wrapper_type`` is not a class.
        ValueError: It is registered already and ``override`` is false.

    Examples:
        >>> import torch
        >>> class Holder(torch.nn.Module):
        ...     def __init__(self, inner):
        ...         super().__init__()
        ...         self.inner = inner
        >>> _ = register_model_wrapper(Holder, lambda holder: holder.inner)
        >>> unwrap_model(Holder(torch.nn.Linear(1, 1)))
        Linear(in_features=1, out_features=1, bias=True)
    """
    if not isinstance(wrapper_type, type):
        message = f"register_model_wrapper expects a class, got {type(wrapper_type).__name__}"
        raise TypeError(message)
    if wrapper_type in _UNWRAP and not override:
        message = (
            f"{wrapper_type.__qualname__} is already a registered model wrapper; "
            "pass override=True to replace its registration"
        )
        raise ValueError(message)
    _UNWRAP[wrapper_type] = unwrap or _inner_module
    return wrapper_type


def _find(model: Any) -> Unwrap | None:
    for wrapper_type, unwrap in _UNWRAP.items():
        if isinstance(model, wrapper_type):
            return unwrap
    return None


def is_model_wrapper(model: Any) -> bool:
    """Return whether ``model`` is a registered model wrapper (DDP, FSDP, DeepSpeed, ...).

    Built in: torch's ``DistributedDataParallel`` and ``DataParallel``, FSDP1 modules,
    modules sharded with ``fully_shard`` (FSDP2), ``torch.compile`` modules, DeepSpeed
    engines, and this package's wrappers.

    Examples:
        >>> import torch
        >>> is_model_wrapper(torch.nn.Linear(1, 1))
        False
        >>> is_model_wrapper(torch.nn.DataParallel(torch.nn.Linear(1, 1)))
        True
    """
    _register_builtins()
    return _find(model) is not None


def unwrap_model(model: Any) -> Any:
    """Return the user's module inside any number of wrappers; ``model`` itself otherwise.

    A module sharded in place with ``fully_shard`` is its own user module.

    Examples:
        >>> import torch
        >>> linear = torch.nn.Linear(1, 1)
        >>> unwrap_model(torch.nn.DataParallel(linear)) is linear
        True
    """
    _register_builtins()
    seen: set[int] = set()
    while (unwrap := _find(model)) is not None and id(model) not in seen:
        seen.add(id(model))
        inner = unwrap(model)
        if inner is model:
            break
        model = inner
    return model


_builtins_done = False


def _register_builtins() -> None:
    """Register torch's and DeepSpeed's wrapper types, importing only what is installed."""
    global _builtins_done
    if _builtins_done:
        _register_imported()
        return
    _builtins_done = True
    from torch.distributed.fsdp import FullyShardedDataParallel

    for wrapper_type in (
        nn.parallel.DistributedDataParallel,
        nn.DataParallel,
        FullyShardedDataParallel,
    ):
        _UNWRAP.setdefault(wrapper_type, _inner_module)
    fsdp2 = _fsdp2_module_type()
    if fsdp2 is not None:
        _UNWRAP.setdefault(fsdp2, lambda model: model)
    _register_imported()


def _fsdp2_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return None
    return FSDPModule


def _deepspeed_engine_type() -> type | None:
    # Only when DeepSpeed is imported already: importing it is slow and prints warnings,
    # and an engine cannot exist before its module is imported.
    module = sys.modules.get("deepspeed.runtime.engine")
    engine: type | None = getattr(module, "DeepSpeedEngine", None)
    return engine


def _register_imported() -> None:
    """Register the wrapper types of modules imported since: DeepSpeed, torch.compile.

    Only once imported: importing them is slow, and none of their objects can exist before.
    """
    engine = _deepspeed_engine_type()
    if engine is not None:
        _UNWRAP.setdefault(engine, _inner_module)
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if compiled is not None:  # torch.compile(model): the user's module is _orig_mod
        _UNWRAP.setdefault(compiled, lambda model: model._orig_mod)


def module_device(module: nn.Module) -> torch.device:
    """Return the device of a module's first parameter or buffer (cpu for an empty one)."""
    for parameter in module.parameters():
        return parameter.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")
