"""Build optimizer wrappers and schedulers from built objects or MMEngine-style config dicts.

Config dicts are copied, never mutated. ``type`` is a class (or any callable) or a name:
optimizer names are looked up in ``torch.optim``, scheduler names in
``torch.optim.lr_scheduler``, optimizer wrapper names among comm-wrappers' own.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from comm_wrappers import AmpOptimWrapper, OptimWrapper, OptimWrapperDict, unwrap_model

from ._names import clean_name

__all__ = [
    "build_optim_wrapper",
    "build_optimizer",
    "build_schedulers",
    "is_optim_wrapper",
    "rebuild_over",
]

_OPTIM_WRAPPER_TYPES: dict[str, type[OptimWrapper]] = {
    "OptimWrapper": OptimWrapper,
    "AmpOptimWrapper": AmpOptimWrapper,
}


def is_optim_wrapper(value: Any) -> bool:
    """Whether ``value`` follows the optimizer wrapper protocol (``update_params``)."""
    return callable(getattr(value, "update_params", None)) and hasattr(value, "optimizer")


def _resolve(kind: Any, namespace: Any, what: str) -> Any:
    if callable(kind):
        return kind
    if isinstance(kind, str):
        found = getattr(namespace, kind, None)
        if callable(found):
            return found
        known = sorted(
            name
            for name in dir(namespace)
            if not name.startswith("_") and isinstance(getattr(namespace, name), type)
        )
        message = (
            f"unknown {what} type {kind!r}; expected a class, a callable or one of: "
            f"{', '.join(known)}"
        )
        raise ValueError(message)
    message = f"{what} 'type' must be a name or a class, got {type(kind).__name__}"
    raise TypeError(message)


def _require_type(config: Mapping[str, Any], what: str) -> Any:
    if "type" not in config:
        message = f"the {what} config needs a 'type' key, got keys {sorted(config)}"
        raise ValueError(message)
    return config["type"]


def build_optimizer(config: Any, model: nn.Module) -> torch.optim.Optimizer:
    """Return ``config`` when it is an optimizer, else build it over ``model``'s parameters.

    Args:
        config: A torch optimizer, or ``dict(type="SGD" | torch.optim.SGD, lr=..., ...)``.
        model: The (wrapped) model whose trainable parameters the optimizer updates.

    Returns:
        The optimizer.
    """
    if isinstance(config, torch.optim.Optimizer):
        return config
    if not isinstance(config, Mapping):
        message = (
            "optimizer must be a torch.optim.Optimizer or a config such as "
            f"dict(type='SGD', lr=0.1), got {type(config).__name__}"
        )
        raise TypeError(message)
    options = copy.deepcopy(dict(config))
    kind = _resolve(
        options.pop("type", None) or _require_type(config, "optimizer"), torch.optim, "optimizer"
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer: torch.optim.Optimizer = kind(params, **options)
    return optimizer


def build_optim_wrapper(config: Any, model: nn.Module) -> Any:
    """Build an optimizer wrapper over the (wrapped) ``model``.

    Args:
        config: A built wrapper (returned as it is), a torch optimizer (wrapped in an
            `OptimWrapper`), or ``dict(type="OptimWrapper" | "AmpOptimWrapper" | class,
            optimizer=dict(...) | Optimizer, **wrapper_options)``; without ``type`` an
            `OptimWrapper`.
        model: The wrapped model.

    Returns:
        The optimizer wrapper.
    """
    if is_optim_wrapper(config) or isinstance(config, OptimWrapperDict):
        return config
    if isinstance(config, torch.optim.Optimizer):
        return OptimWrapper(config)
    if not isinstance(config, Mapping):
        message = (
            "optim_wrapper must be an optimizer wrapper, a torch optimizer or a config such as "
            f"dict(type='OptimWrapper', optimizer=dict(type='SGD', lr=0.1)), got "
            f"{type(config).__name__}"
        )
        raise TypeError(message)
    # Copied, never mutated; a built optimizer inside is the caller's own object, over the
    # model's parameters: a deep copy would hold copies of them.
    options: dict[str, Any] = {
        key: value if isinstance(value, torch.optim.Optimizer) else copy.deepcopy(value)
        for key, value in config.items()
    }
    kind = options.pop("type", "OptimWrapper")
    if "optimizer" not in options:
        message = (
            "the optim_wrapper config needs an 'optimizer' entry such as "
            f"dict(type='SGD', lr=0.1), got keys {sorted(config)}"
        )
        raise ValueError(message)
    for unsupported in ("constructor", "paramwise_cfg"):
        if unsupported in options:
            message = (
                f"optim_wrapper config key {unsupported!r} is not supported here: build the "
                "optimizer yourself (parameter groups included) and pass it as 'optimizer'"
            )
            raise ValueError(message)
    optimizer = build_optimizer(options.pop("optimizer"), model)
    if isinstance(kind, str):
        if kind not in _OPTIM_WRAPPER_TYPES:
            message = (
                f"unknown optim_wrapper type {kind!r}; expected one of {', '.join(_OPTIM_WRAPPER_TYPES)} "
                "or a class"
            )
            raise ValueError(message)
        kind = _OPTIM_WRAPPER_TYPES[kind]
    return kind(optimizer, **options)


def build_schedulers(config: Any, optimizer: Any) -> list[Any]:
    """Build learning rate schedulers for ``optimizer``.

    Args:
        config: None, a built scheduler, a ``dict(type="StepLR" | class, ...)``, or a list
            of those.
        optimizer: The torch optimizer they schedule (None when there is none).

    Returns:
        The schedulers (built ones unchanged), in order.
    """
    if config is None:
        return []
    items = list(config) if isinstance(config, (list, tuple)) else [config]
    built: list[Any] = []
    for item in items:
        if not isinstance(item, Mapping):
            built.append(item)
            continue
        if optimizer is None:
            message = "param_scheduler configs need an optim_wrapper to schedule"
            raise ValueError(message)
        options = copy.deepcopy(dict(item))
        kind = _resolve(
            options.pop("type", None) or _require_type(item, "param_scheduler"),
            torch.optim.lr_scheduler,
            "param_scheduler",
        )
        mmengine_only = sorted(set(options) & _MMENGINE_SCHEDULER_KEYS)
        try:
            built.append(kind(optimizer, **options))
        except TypeError as error:
            if not mmengine_only:
                raise
            message = (
                f"param_scheduler {getattr(kind, '__name__', kind)!r}: {error}. The keys "
                f"{mmengine_only} belong to MMEngine's parameter schedulers; configs here are "
                "built with torch.optim.lr_scheduler (drop them, counting in steps), or run "
                "under MMEngine's FlexibleRunner with comm_strategies.integrations.mmengine, "
                "which builds them with MMEngine's PARAM_SCHEDULERS"
            )
            raise TypeError(message) from error
    return built


_MMENGINE_SCHEDULER_KEYS = {"by_epoch", "begin", "end", "convert_to_iter_based"}


def _named_trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    module = unwrap_model(model)
    return {clean_name(n): p for n, p in module.named_parameters()}


def rebuild_over(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str],
    wrapped: nn.Module,
    schedulers: Sequence[Any] = (),
) -> torch.optim.Optimizer:
    """Rebuild ``optimizer`` over ``wrapped``'s parameters when wrapping replaced them.

    Parameter groups and their settings are kept; parameters are matched by name. Built
    schedulers of the old optimizer are moved onto the new one (their state is kept).

    Args:
        optimizer: An optimizer built over the unwrapped model, with no state yet.
        names: ``id(parameter) -> name`` of the unwrapped model, taken before wrapping.
        wrapped: The wrapped model.
        schedulers: Schedulers built over ``optimizer``.

    Returns:
        ``optimizer`` itself when every parameter is still the wrapped model's, else a new
        optimizer of the same class.
    """
    current = _named_trainable(wrapped)
    live = {id(p) for p in current.values()}
    if all(id(p) in live for group in optimizer.param_groups for p in group["params"]):
        return optimizer
    if optimizer.state:
        message = (
            f"the {type(optimizer).__name__} passed in already has state (it has stepped), "
            "but wrapping the model replaced its parameters, so it must be rebuilt; pass a "
            "fresh optimizer, or a config dict, and load optimizer state after prepare"
        )
        raise ValueError(message)
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        params = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None or name not in current:
                message = (
                    f"parameter group {index} of the optimizer holds a parameter that is not "
                    f"a parameter of the model passed to prepare (name {name!r}); build the "
                    "optimizer over model.parameters()"
                )
                raise ValueError(message)
            params.append(current[name])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    rebuilt = type(optimizer)(groups, **_constructor_defaults(optimizer))
    for key, value in optimizer.defaults.items():
        rebuilt.defaults.setdefault(key, value)  # for groups added later
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is optimizer:
            _move_scheduler(scheduler, rebuilt)
    return rebuilt


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor takes as keywords.

    Every group carries its own settings already; the defaults only fill the required
    arguments (``lr`` of a custom optimizer). Some hold keys the constructor does not take
    (torch 2.13's AdamW keeps ``decoupled_weight_decay``, which only Adam accepts).
    """
    import inspect

    try:
        parameters = inspect.signature(type(optimizer).__init__).parameters.values()
    except (TypeError, ValueError):  # no signature to read: pass them all, as before
        return dict(optimizer.defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(optimizer.defaults)
    accepted = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {key: value for key, value in optimizer.defaults.items() if key in accepted}


def _move_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point a built torch scheduler at ``optimizer`` (groups already carry its lr values)."""
    scheduler.optimizer = optimizer
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    # torch's schedulers mark the optimizer's step to warn about a wrong call order; mark
    # the new optimizer the same way so that the check keeps working.
    original = step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return original(*args, **kwargs)

    counted_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = counted_step  # type: ignore[method-assign]


def trainable_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of the unwrapped ``model``."""
    return {id(p): clean_name(n) for n, p in unwrap_model(model).named_parameters()}


def optimizers_of(optim_wrapper: Any) -> dict[str, Any]:
    """The optimizer wrappers inside ``optim_wrapper``, by key.

    ``{name: wrapper}`` for an ``OptimWrapperDict`` (anything with ``items()`` and no
    ``optimizer``), ``{"": it}`` for one wrapper or torch optimizer, ``{}`` for None.

    Raises:
        TypeError: ``optim_wrapper`` is none of these.
    """
    if optim_wrapper is None:
        return {}
    if hasattr(optim_wrapper, "items") and not hasattr(optim_wrapper, "optimizer"):
        return {str(key): value for key, value in optim_wrapper.items()}
    if isinstance(optim_wrapper, torch.optim.Optimizer) or hasattr(optim_wrapper, "optimizer"):
        return {"": optim_wrapper}
    message = (
        "optim_wrapper must be an OptimWrapper, AmpOptimWrapper, OptimWrapperDict, "
        f"DeepSpeedOptimWrapper or torch optimizer, got {type(optim_wrapper).__name__}"
    )
    raise TypeError(message)


def torch_optimizers(
    optim_wrapper: Any, *, default_key: str = ""
) -> dict[str, torch.optim.Optimizer]:
    """The torch optimizers inside ``optim_wrapper``, by the keys of `optimizers_of` (the
    one optimizer of a plain wrapper, key ``""`` there, under ``default_key``)."""
    return {
        key or default_key: each if isinstance(each, torch.optim.Optimizer) else each.optimizer
        for key, each in optimizers_of(optim_wrapper).items()
    }


def scalers_of(optim_wrapper: Any, *, default_key: str = "") -> dict[str, Any]:
    """The gradient scalers of the wrappers that have one (``AmpOptimWrapper``), by key
    (as `torch_optimizers`)."""
    return {
        key or default_key: scaler
        for key, each in optimizers_of(optim_wrapper).items()
        if (scaler := getattr(each, "loss_scaler", None)) is not None
    }
