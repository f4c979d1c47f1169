"""Parameter names and shapes: a state's description, and matching it against a model."""

from __future__ import annotations

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
) -> None:
    """Compare the model's names and shapes with a checkpoint's; raise naming the mismatch."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = [
        f"{name}: checkpoint {found[name][0]}, model {expected[name][0]}"
        for name in sorted(set(expected) & set(found))
        if list(found[name][0]) != list(expected[name][0])
    ]
    problems = []
    if shapes:
        problems.append("shapes differ: " + "; ".join(shapes[:8]))
    if strict and missing:
        problems.append(f"missing from the checkpoint: {_some(missing)}")
    if strict and unexpected:
        problems.append(f"not in the model: {_some(unexpected)}")
    if problems:
        hint = " Pass strict=False to load the matching names only." if not shapes else ""
        message = (
            f"{source} does not fit this model ({'; '.join(problems)}). Is it a checkpoint "
            f"of another model?{hint}"
        )
        raise CheckpointError(message)


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")
