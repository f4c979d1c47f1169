"""Parameter names and shapes: a state's description, and matching it against a model."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from comm_collectives import get_rank

from .._names import strip_prefixes
from ._errors import CheckpointError, outside_package


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
        stacklevel=outside_package(),
    )
    return missing + unexpected + reshaped


def fit_optimizer_state(
    state: Mapping[str, Any],
    params: Mapping[str, Any],
    skipped: Sequence[str],
    source: str,
    *,
    groups: list[list[str]] | None = None,
    own_groups: Sequence[Mapping[str, Any]] | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """An optimizer's full state (keyed by names) checked against the model's parameters.

    The entries of ``skipped`` parameters (a ``strict=False`` load) are left out. With
    ``groups`` (the target optimizer's param groups by parameter names, see
    `Backend.optimizer_groups`), the saved groups are checked against them: see
    `fit_optimizer_groups`.

    Raises:
        CheckpointError: The state is not keyed by parameter names, names a parameter
            the model does not have (and that was not skipped), or (``strict``) its param
            groups differ from the optimizer's.
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
    fitted = dict(state)
    if leave & named:
        fitted = {
            **state,
            "state": {k: v for k, v in state.get("state", {}).items() if k not in leave},
            "param_groups": [
                {**group, "params": [n for n in group["params"] if n not in leave]}
                for group in state["param_groups"]
            ],
        }
    if groups is None:
        return fitted
    return fit_optimizer_groups(fitted, groups, own_groups or [], source, strict)


def fit_optimizer_groups(
    state: Mapping[str, Any],
    groups: list[list[str]],
    own_groups: Sequence[Mapping[str, Any]],
    source: str,
    strict: bool,
) -> dict[str, Any]:
    """A full optimizer state whose param groups fit the target optimizer's ``groups``.

    A parameter saved in group ``i`` must be in group ``i`` of the target (torch's own
    ``Optimizer.load_state_dict`` refuses another number of groups; loading by names
    would mix the groups' hyperparameters up and leave a group without them). Names the
    target optimizer does not hold are left to the caller's checks.

    ``strict=False``: a parameter saved in another group than the target's is left out
    (state and group), with a warning naming it; a target group that keeps none of its
    saved group's parameters keeps its own hyperparameters (``own_groups``, the target
    optimizer's ``param_groups``), so no group is ever left without them.

    Raises:
        CheckpointError: ``strict`` and the number of groups differs, or a parameter is
            in another group (the message names the first).
    """
    saved = list(state["param_groups"])
    target_of = {name: index for index, names in enumerate(groups) for name in names}
    misplaced = [
        (str(name), index, target_of[name])
        for index, group in enumerate(saved)
        for name in group.get("params", [])
        if name in target_of and target_of[name] != index
    ]
    if len(saved) == len(groups) and not misplaced:
        return dict(state)
    problems = []
    if len(saved) != len(groups):
        problems.append(
            f"the saved optimizer has {len(saved)} parameter group(s), this optimizer {len(groups)}"
        )
    if misplaced:
        name, was, now = misplaced[0]
        more = f" (and {len(misplaced) - 1} more)" if len(misplaced) > 1 else ""
        problems.append(
            f"parameter {name} is in group {was} of the saved optimizer, in group {now} of "
            f"this one{more}"
        )
    if strict:
        message = (
            f"{source} does not fit this optimizer on rank {get_rank()}: "
            f"{'; '.join(problems)}. Build the optimizer with the same param groups as the "
            "run that saved (the same parameters in each, in the same order), or pass "
            "load_optimizer=False to load the weights only (strict=False loads the "
            "parameters that stay in their group)."
        )
        raise CheckpointError(message)
    drop = {name for name, _, _ in misplaced}
    fitted_groups: list[dict[str, Any]] = []
    kept_own: list[int] = []
    for index, names in enumerate(groups):
        was = saved[index].get("params", []) if index < len(saved) else []
        kept = [n for n in was if n not in drop]
        if kept or (index < len(saved) and not names):
            fitted_groups.append({**saved[index], "params": kept})
        else:  # nothing of this group was saved in it: it keeps its own hyperparameters
            own = own_groups[index] if index < len(own_groups) else {}
            fitted_groups.append(
                {**{k: v for k, v in own.items() if k != "params"}, "params": list(names)}
            )
            kept_own.append(index)
    skipped = _some(sorted(drop)) if drop else "no parameter"
    note = f"; group(s) {kept_own} keep this optimizer's own hyperparameters" if kept_own else ""
    warnings.warn(
        f"strict=False: {source} loaded without the optimizer state of {skipped} "
        f"({'; '.join(problems)}){note}",
        stacklevel=outside_package(),
    )
    entries = {k: v for k, v in state.get("state", {}).items() if k not in drop}
    return {**state, "state": entries, "param_groups": fitted_groups}


def check_unlisted(
    backend: Any, optimizer: Any, state: Any, source: str, skipped: Sequence[str], strict: bool
) -> None:
    """The parameters ``optimizer`` trains that ``state`` (as saved) holds nothing for, less
    the ``skipped`` weights: refused under ``strict`` (before torch's load), else named."""
    missing = [name for name in backend.unlisted_params(optimizer, state) if name not in skipped]
    if missing and strict:
        message = (
            f"{source} does not fit this optimizer on rank {get_rank()}: it holds no state for "
            f"{_some(missing)}, parameters this optimizer trains (is it another optimizer's "
            "state?). Pass strict=False to load the entries that fit and leave these "
            "parameters without optimizer state."
        )
        raise CheckpointError(message)
    if missing:
        message = (
            f"strict=False: {source} holds nothing for {_some(missing)} (rank {get_rank()}): "
            "their optimizer state is not loaded"
        )
        warnings.warn(message, stacklevel=outside_package())


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")
