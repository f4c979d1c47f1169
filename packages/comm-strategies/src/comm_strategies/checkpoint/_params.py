"""Parameter names and shapes: a state's description, and matching it against a model."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .._names import strip_prefixes
from ._errors import CheckpointError


def describe_params(state: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``{name: [shape, dtype]}`` of a full model state (its tensors)."""
    return {
        name: [list(value.shape), str(value.dtype).removeprefix("torch.")]
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def fit_names(state: Mapping[str, Any], expected: Mapping[str, Any]) -> dict[str, Any]:
    """The state with wrapper prefixes removed, unless its names fit the model as they are."""
    as_is = dict(state)
    if set(as_is) <= set(expected):
        return as_is
    stripped = strip_prefixes(state)
    if len(set(stripped) & set(expected)) > len(set(as_is) & set(expected)):
        return stripped
    return as_is


def check_against(
    expected: Mapping[str, list[Any]], found: Mapping[str, list[Any]], source: str, strict: bool
) -> list[str]:
    """Compare the model's names and shapes with a checkpoint's.

    Returns the names a ``strict=False`` load skips (missing, unexpected or differently
    shaped), after warning once with them; under ``strict`` any of them is an error.

    Raises:
        CheckpointError: ``strict`` and a name is missing, unexpected or differently
            shaped (the message names them).
    """
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    reshaped = [
        name
        for name in sorted(set(expected) & set(found))
        if list(found[name][0]) != list(expected[name][0])
    ]
    problems = []
    if reshaped:
        shapes = [f"{n}: checkpoint {found[n][0]}, model {expected[n][0]}" for n in reshaped]
        problems.append("shapes differ: " + "; ".join(shapes[:8]))
    if missing:
        problems.append(f"missing from the checkpoint: {_some(missing)}")
    if unexpected:
        problems.append(f"not in the model: {_some(unexpected)}")
    if not problems:
        return []
    if strict:
        message = (
            f"{source} does not fit this model ({'; '.join(problems)}). Is it a checkpoint "
            "of another model? Pass strict=False to load the entries that fit and skip "
            "the others."
        )
        raise CheckpointError(message)
    warnings.warn(
        f"strict=False: {source} loaded without these entries ({'; '.join(problems)})",
        stacklevel=4,
    )
    return missing + unexpected + reshaped


def fit_optimizer_state(
    state: Mapping[str, Any], params: Mapping[str, Any], skipped: list[str], source: str
) -> dict[str, Any]:
    """An optimizer's full state (keyed by names) checked against the model's parameters.

    The entries of ``skipped`` parameters (a ``strict=False`` load) are left out.

    Raises:
        CheckpointError: The state is not keyed by parameter names, or names a parameter
            the model does not have (and that was not skipped).
    """
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), list):
        message = (
            f"{source}: the optimizer state is not a full state keyed by parameter names "
            f"(expected {{'state': ..., 'param_groups': [...]}}, got {type(state).__name__})"
        )
        raise CheckpointError(message)
    leave = set(skipped)
    named = set(state.get("state", {})) | {
        name for group in state["param_groups"] for name in group.get("params", [])
    }
    strangers = sorted(str(name) for name in named - set(params) - leave)
    if strangers:
        message = (
            f"{source}: the optimizer state holds entries for {_some(strangers)}, not "
            "parameters of this model: it belongs to another model (or another optimizer's "
            "parameters); pass load_optimizer=False to load the weights only"
        )
        raise CheckpointError(message)
    if not leave & named:
        return dict(state)
    return {
        **state,
        "state": {k: v for k, v in state.get("state", {}).items() if k not in leave},
        "param_groups": [
            {**group, "params": [n for n in group["params"] if n not in leave]}
            for group in state["param_groups"]
        ],
    }


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")
