"""MMEngine's string and dict forms of FSDP options, turned into torch's objects.

Shared by the FSDP1 and FSDP2 wrappers. The caller's dicts are copied, never mutated; an
unknown name raises a ValueError that lists the valid ones.
"""

from __future__ import annotations

import enum
import functools
import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.fsdp import wrap as fsdp_wrap

from ._dtypes import to_dtype

__all__ = [
    "coerce_auto_wrap_policy",
    "coerce_enum",
    "coerce_modules",
    "coerce_param_init_fn",
    "register_param_init_fn",
]

E = TypeVar("E", bound=enum.Enum)

_POLICIES: dict[str, Callable[..., bool]] = {
    "size_based_auto_wrap_policy": fsdp_wrap.size_based_auto_wrap_policy,
    "transformer_auto_wrap_policy": fsdp_wrap.transformer_auto_wrap_policy,
    "lambda_auto_wrap_policy": fsdp_wrap.lambda_auto_wrap_policy,
}


def _names(options: Iterable[str]) -> str:
    return ", ".join(sorted(options))


def coerce_enum(value: Any, enum_type: type[E], option: str) -> E | None:
    """``"FULL_SHARD"`` (any case) or the enum member itself -> the member; None stays None."""
    if value is None or isinstance(value, enum_type):
        return value
    if isinstance(value, str) and value.upper() in enum_type.__members__:
        return enum_type.__members__[value.upper()]
    message = (
        f"{option} must be a {enum_type.__name__} or one of its names "
        f"({_names(enum_type.__members__)}), got {value!r}"
    )
    raise ValueError(message)


def _classes_by_name(module: nn.Module) -> dict[str, type[nn.Module]]:
    return {type(m).__name__: type(m) for m in module.modules()}


def _resolve_classes(names: Iterable[Any], module: nn.Module, option: str) -> set[type[nn.Module]]:
    known = _classes_by_name(module)
    classes: set[type[nn.Module]] = set()
    for item in names:
        if isinstance(item, type) and issubclass(item, nn.Module):
            classes.add(item)
        elif isinstance(item, str) and item in known:
            classes.add(known[item])
        else:
            message = (
                f"{option}: {item!r} is not a module class of the model; the model's classes "
                f"are {_names(known)}"
            )
            raise ValueError(message)
    return classes


def coerce_auto_wrap_policy(value: Any, module: nn.Module) -> Any:
    """Turn MMEngine's forms of ``auto_wrap_policy`` into a policy torch's FSDP accepts.

    Accepted: None; a callable or torch policy object (unchanged); a policy name
    (``"size_based_auto_wrap_policy"``...), a dotted import path
    (``"torch.distributed.fsdp.wrap.size_based_auto_wrap_policy"``, as MMEngine configs name
    torch's policies) or a name in MMEngine's ``FUNCTIONS`` registry (looked up when MMEngine
    is imported already); ``dict(type=..., **kwargs)`` with ``type`` any of those forms or
    the function itself (lazy-import configs), the kwargs bound (``transformer_layer_cls``
    and ``ModuleWrapPolicy``'s ``module_classes`` may give class names of the model; a
    policy class such as ``ModuleWrapPolicy`` is built with them);
    a module class, a class name of the model, or a list/set of them (every instance of
    those classes becomes its own FSDP unit).
    """
    if value is None or isinstance(value, fsdp_wrap._Policy):
        return value
    if callable(value) and not isinstance(value, (str, type)):
        return value
    if isinstance(value, Mapping):
        kwargs = dict(value)
        name = kwargs.pop("type", None)
        policy = _resolve_function(name, _POLICIES)
        if policy is None:
            message = (
                f"auto_wrap_policy dict needs type= {_accepted(_POLICIES, 'a policy name')}; "
                f"got {name!r}"
            )
            raise ValueError(message)
        for option in ("transformer_layer_cls", "module_classes"):  # ModuleWrapPolicy's
            if option in kwargs:
                kwargs[option] = _resolve_classes(_as_list(kwargs[option]), module, option)
        if isinstance(policy, type) and issubclass(policy, fsdp_wrap._Policy):
            return policy(**kwargs)
        return functools.partial(policy, **kwargs) if kwargs else policy
    if isinstance(value, str) and value not in _classes_by_name(module):
        policy = _resolve_function(value, _POLICIES)
        if policy is not None:
            return _bare_policy(policy, value)
    if isinstance(value, (str, type, list, tuple, set, frozenset)):
        try:
            classes = _resolve_classes(_as_list(value), module, "auto_wrap_policy")
        except ValueError as error:
            message = (
                f"{error}; auto_wrap_policy may also be {_accepted(_POLICIES, 'a policy name')}, "
                "or dict(type=that, **kwargs)"
            )
            raise ValueError(message) from None
        return fsdp_wrap.ModuleWrapPolicy(classes)
    message = (
        "auto_wrap_policy must be a callable, a policy name, dict(type=..., ...), or module "
        f"classes / class names, got {type(value).__name__}"
    )
    raise TypeError(message)


def _bare_policy(policy: Callable[..., Any], name: str) -> Any:
    """A policy named by a string alone (no arguments to bind)."""
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return fsdp_wrap.ModuleWrapPolicy({policy})
    if policy in (_POLICIES["transformer_auto_wrap_policy"], _POLICIES["lambda_auto_wrap_policy"]):
        message = f"auto_wrap_policy {name!r} needs arguments: pass dict(type={name!r}, ...)"
        raise ValueError(message)
    if isinstance(policy, type) and issubclass(policy, fsdp_wrap._Policy):
        return policy()
    return policy


def _mmengine_functions() -> Any:
    """MMEngine's ``FUNCTIONS`` registry when MMEngine is imported already, else None.

    comm-wrappers never imports MMEngine itself (it is not a dependency): a program that
    registers functions there has imported it.
    """
    registry = sys.modules.get("mmengine.registry")
    return getattr(registry, "FUNCTIONS", None)


def _resolve_function(value: Any, short_names: Mapping[str, Callable[..., Any]]) -> Any:
    """A callable from a callable, a short name, a dotted path or MMEngine's ``FUNCTIONS``.

    Returns None when ``value`` names no callable.
    """
    if callable(value):
        return value
    if not isinstance(value, str) or not value:
        return None
    if value in short_names:
        return short_names[value]
    found = _import_object(value)
    if found is None:
        functions = _mmengine_functions()
        if functions is not None:
            try:
                found = functions.get(value)
            except Exception:  # a bad name is reported by the caller
                found = None
    return found if callable(found) else None


def _accepted(short_names: Iterable[str], what: str) -> str:
    """What a function option accepts, for error messages."""
    if _mmengine_functions() is not None:
        registry = "a name registered in MMEngine's FUNCTIONS registry"
    else:
        registry = "a name in MMEngine's FUNCTIONS registry (looked up once mmengine is imported)"
    return (
        f"{what} ({_names(short_names)}), the function itself, a dotted import path "
        f"'package.module.function', or {registry}"
    )


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    return [value]


def wrap_predicate(policy: Any, root: nn.Module) -> Callable[[nn.Module, int], bool] | None:
    """Turn an FSDP1 policy into ``predicate(module, unwrapped_numel) -> wrap it?`` (FSDP2).

    A module ``fully_shard`` was applied to already (by the user's code) is never chosen
    again: torch refuses a second ``fully_shard``, and the module is a unit already.
    """
    predicate = _policy_predicate(policy, root)
    if predicate is None:
        return None
    from torch.distributed.fsdp import FSDPModule

    chosen = predicate
    return lambda module, numel: not isinstance(module, FSDPModule) and chosen(module, numel)


def _policy_predicate(policy: Any, root: nn.Module) -> Callable[[nn.Module, int], bool] | None:
    if policy is None:
        return None
    if isinstance(policy, fsdp_wrap.ModuleWrapPolicy):
        classes = tuple(policy._module_classes)
        return lambda module, numel: isinstance(module, classes)
    if isinstance(policy, fsdp_wrap._Policy):  # e.g. CustomPolicy: it names the modules
        chosen = set(policy._run_policy(root, set(), {}))
        return lambda module, numel: module in chosen
    if callable(policy):
        return lambda module, numel: bool(
            policy(module=module, recurse=False, nonwrapped_numel=numel)
        )
    message = f"this auto_wrap_policy cannot drive FSDP2: {policy!r}"
    raise TypeError(message)


def coerce_mixed_precision(value: Any, target: type, fields: Iterable[str]) -> Any:
    """``dict(param_dtype="bfloat16", ...)`` or a dtype name -> ``target(...)`` with dtypes."""
    if value is None or isinstance(value, target):
        return value
    allowed = set(fields)
    if isinstance(value, (str, torch.dtype)):
        dtype = to_dtype(value, "mixed_precision")
        return target(**{f: dtype for f in ("param_dtype", "reduce_dtype") if f in allowed})
    if not isinstance(value, Mapping):
        message = (
            f"mixed_precision must be a {target.__name__}, a dict of its fields or a dtype name, "
            f"got {type(value).__name__}"
        )
        raise TypeError(message)
    unknown = set(value) - allowed
    if unknown:
        message = (
            f"mixed_precision: unknown field(s) {_names(unknown)} for {target.__name__}; "
            f"valid fields: {_names(allowed)}"
        )
        raise ValueError(message)
    kwargs = {
        key: to_dtype(item, f"mixed_precision[{key!r}]")
        if key.endswith("_dtype") and item is not None
        else item
        for key, item in value.items()
    }
    return target(**kwargs)


def coerce_modules(value: Any, module: nn.Module, option: str) -> Any:
    """Module names (``"head.fc"``) in ``ignored_modules`` -> the submodules themselves."""
    if value is None:
        return None
    out = []
    items = [value] if isinstance(value, (str, nn.Module)) else list(value)
    for item in items:
        if isinstance(item, str):
            try:
                out.append(module.get_submodule(item))
            except AttributeError:
                names = [n for n, _ in module.named_modules() if n]
                message = f"{option}: the model has no submodule {item!r}; it has {_names(names)}"
                raise ValueError(message) from None
        else:
            out.append(item)
    return out


_PARAM_INIT_FNS: dict[str, Callable[..., None]] = {}


def register_param_init_fn(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register a ``param_init_fn`` under a name, for ``param_init_fn="name"`` or ``dict(type=...)``.

    Examples:
        >>> @register_param_init_fn("zeros_on_cpu")
        ... def zeros_on_cpu(module):
        ...     module.to_empty(device="cpu", recurse=False)
    """

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        _PARAM_INIT_FNS[name] = fn
        return fn

    return decorate


@register_param_init_fn("reset_parameters")
def _reset_parameters(module: nn.Module, device: str | torch.device = "cpu") -> None:
    """Materialise a meta module on ``device`` and run its own ``reset_parameters``."""
    module.to_empty(device=device, recurse=False)
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def coerce_param_init_fn(value: Any) -> Callable[[nn.Module], None] | None:
    """A callable, a registered name, a dotted path, a name in MMEngine's ``FUNCTIONS``
    registry (when MMEngine is imported), or ``dict(type=any of those, **kwargs)``."""
    if value is None or callable(value):
        return value  # type: ignore[no-any-return]
    kwargs: dict[str, Any] = {}
    if isinstance(value, Mapping):
        kwargs = dict(value)
        value = kwargs.pop("type", None)
    fn = _resolve_function(value, _PARAM_INIT_FNS)
    if fn is not None:
        return functools.partial(fn, **kwargs) if kwargs else fn
    message = (
        f"param_init_fn must be {_accepted(_PARAM_INIT_FNS, 'a registered name')}, or "
        f"dict(type=any of those, **kwargs); got {value!r}. register_param_init_fn(name) "
        "registers a function under a name"
    )
    raise ValueError(message)


def _import_object(path: str) -> Any:
    """``"package.module.attr"`` (or ``"package.module.Class.attr"``) -> the object, or None."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr, None)
            if found is None:
                return None
        return found
    return None
