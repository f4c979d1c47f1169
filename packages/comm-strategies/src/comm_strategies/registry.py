"""The strategy registry: `build_strategy` from a name, a class name or a config dict.

Third-party packages add strategies without this package importing them: an entry point
in the ``comm.strategies`` group names the strategy and points at its class, and it is
loaded only when that name is asked for (or when the known names are listed)::

    [project.entry-points."comm.strategies"]
    colossalai = "my_package.strategies:ColossalAIStrategy"
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from .base import Strategy
from .ddp import DDPStrategy
from .deepspeed import DeepSpeedStrategy
from .fsdp import FSDPStrategy
from .model_parallel import ModelParallelStrategy
from .single import SingleDeviceStrategy

__all__ = [
    "ENTRY_POINT_GROUP",
    "UnknownStrategyError",
    "available_strategies",
    "build_strategy",
    "register_strategy",
]

#: The entry-point group third-party strategies are registered under.
ENTRY_POINT_GROUP = "comm.strategies"


@dataclass(frozen=True)
class _Entry:
    strategy: type[Strategy]
    defaults: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, _Entry] = {}
_entry_points_loaded: set[str] = set()


def register_strategy(
    name: str, strategy: type[Strategy], *, override: bool = False, **defaults: Any
) -> type[Strategy]:
    """Register ``strategy`` under ``name``, with default constructor keywords.

    Args:
        name: The name `build_strategy` accepts (a short name or a class name).
        strategy: A subclass of `Strategy`.
        override: Replace an existing registration instead of raising.
        **defaults: Keywords passed to the constructor unless the caller gives them.

    Returns:
        ``strategy``, unchanged.

    Raises:
        TypeError: ``strategy`` is not a `Strategy` subclass.
        ValueError: ``name`` is registered already and ``override`` is false.

    Examples:
        >>> class Mine(SingleDeviceStrategy):
        ...     name = "mine"
        >>> _ = register_strategy("mine", Mine, deterministic=True)
        >>> build_strategy("mine").deterministic
        True
        >>> register_strategy("mine", Mine)
        Traceback (most recent call last):
        ...
        ValueError: strategy 'mine' is registered already (Mine); pass override=True to replace it
        >>> _ = register_strategy("mine", Mine, override=True)
    """
    if not (isinstance(strategy, type) and issubclass(strategy, Strategy)):
        message = f"register_strategy expects a subclass of Strategy, got {strategy!r}"
        raise TypeError(message)
    taken = _REGISTRY.get(name)
    if taken is not None and not override:
        message = (
            f"strategy {name!r} is registered already ({taken.strategy.__name__}); "
            "pass override=True to replace it"
        )
        raise ValueError(message)
    _REGISTRY[name] = _Entry(strategy, copy.deepcopy(defaults))
    return strategy


for _cls in (
    SingleDeviceStrategy,
    DDPStrategy,
    FSDPStrategy,
    DeepSpeedStrategy,
    ModelParallelStrategy,
):
    register_strategy(_cls.__name__, _cls)
register_strategy("single", SingleDeviceStrategy)
register_strategy("ddp", DDPStrategy)
register_strategy("fsdp", FSDPStrategy, fsdp_version=1)
register_strategy("fsdp2", FSDPStrategy, fsdp_version=2)
register_strategy("deepspeed", DeepSpeedStrategy)
register_strategy("model_parallel", ModelParallelStrategy)


def _entry_points() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=ENTRY_POINT_GROUP))


def _load_entry_point(point: metadata.EntryPoint) -> None:
    if point.name in _entry_points_loaded or point.name in _REGISTRY:
        return
    try:
        loaded = point.load()
    except Exception as error:
        message = (
            f"the {ENTRY_POINT_GROUP!r} entry point {point.name!r} ({point.value}) failed to "
            f"load: {type(error).__name__}: {error}"
        )
        raise ImportError(message) from error
    register_strategy(point.name, loaded)
    _entry_points_loaded.add(point.name)


def available_strategies() -> list[str]:
    """Every name `build_strategy` accepts: built-in, registered and from entry points.

    Entry points are listed by name and not imported.

    Examples:
        >>> [name for name in available_strategies() if name.islower()][:6]
        ['ddp', 'deepspeed', 'fsdp', 'fsdp2', 'model_parallel', 'single']
    """
    return sorted(set(_REGISTRY) | {point.name for point in _entry_points()})


class UnknownStrategyError(KeyError, ValueError):
    """A strategy name that no registration and no entry point provides.

    A `KeyError` (as before, and as a registry lookup is) and a `ValueError` (a bad
    argument value); its message prints as written, without the quotes `KeyError` adds.

    Examples:
        >>> str(UnknownStrategyError("unknown strategy 'x'"))
        "unknown strategy 'x'"
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _suggestion(name: str, names: list[str]) -> str:
    """`` Did you mean 'x'?`` for a near miss (case, spaces, a typo), else ``""``."""
    lowered = {n.lower(): n for n in names}
    key = name.strip().lower()
    close = [lowered[key]] if key in lowered else []
    close += [lowered[m] for m in difflib.get_close_matches(key, list(lowered), n=2, cutoff=0.75)]
    close = list(dict.fromkeys(close))[:2]
    return f" Did you mean {' or '.join(map(repr, close))}?" if close else ""


def build_strategy(strategy: Any, **kwargs: Any) -> Strategy:
    """Build a strategy from a name, a class name, a config dict, a class or an instance.

    Args:
        strategy: ``"deepspeed"``, ``"DDPStrategy"``, ``dict(type="FSDPStrategy", ...)``,
            a `Strategy` subclass, or a built strategy (returned unchanged). A config dict
            is copied, never mutated.
        **kwargs: Constructor keywords; they win over the dict's and the registration's.

    Returns:
        The strategy (nothing is set up yet).

    Raises:
        UnknownStrategyError: The name is unknown, or a config dict has no ``type`` (a
            `KeyError` and a `ValueError`); the message suggests the nearest names, lists
            the known ones and says how to add one.

    Examples:
        >>> build_strategy("fsdp2").fsdp_version
        2
        >>> build_strategy(dict(type="DeepSpeedStrategy", zero_stage=3)).zero_stage
        3
        >>> build_strategy("fdsp")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        comm_strategies.registry.UnknownStrategyError: unknown strategy 'fdsp'. Did you mean 'fsdp'? Available names: DDPStrategy, ...
    """
    if isinstance(strategy, Strategy):
        if kwargs:
            message = f"build_strategy got a built strategy and keywords {sorted(kwargs)}"
            raise TypeError(message)
        return strategy
    options: dict[str, Any] = {}
    if isinstance(strategy, Mapping):
        options = copy.deepcopy(dict(strategy))
        if "type" not in options:
            message = (
                f"a strategy config needs a 'type' key naming the strategy (one of "
                f"{', '.join(available_strategies())}), got keys {sorted(strategy)}"
            )
            raise UnknownStrategyError(message)
        strategy = options.pop("type")
    options.update(kwargs)
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        return strategy(**options)
    if not isinstance(strategy, str):
        message = f"strategy must be a name, a dict, a Strategy class or instance, got {strategy!r}"
        raise TypeError(message)
    entry = _REGISTRY.get(strategy)
    if entry is None:
        for point in _entry_points():
            if point.name == strategy:
                _load_entry_point(point)
        entry = _REGISTRY.get(strategy)
    if entry is None:
        names = available_strategies()
        message = (
            f"unknown strategy {strategy!r}.{_suggestion(strategy, names)} Available names: "
            f"{', '.join(names)}. A strategy of your own: register it with "
            "register_strategy, or pass its class"
        )
        raise UnknownStrategyError(message)
    return entry.strategy(**{**copy.deepcopy(entry.defaults), **options})
