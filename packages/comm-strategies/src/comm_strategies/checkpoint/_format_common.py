"""What the checkpoint formats share: the load request, and loading full model and
optimizer states through the backend adapter."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from comm_collectives import CommError
from comm_wrappers.backends import Backend, describe_params

from ._consensus import Call, where
from ._errors import CheckpointError
from ._layout import DEFAULT_KEY
from ._manifest import Manifest
from ._params import check_against, check_unlisted, fit_names, fit_optimizer_state

Optimizers = Mapping[str, torch.optim.Optimizer]


@dataclass(frozen=True)
class LoadRequest:
    """What a load asks of a reader.

    Attributes:
        call: The load's exchanges (a reader whose fast path may fail on some rank shares
            that outcome through it before its fallback).
        strict: The model's names must equal the checkpoint's.
        optimizers: The torch optimizers to fill, by the checkpoint's keys (empty: the
            weights only).
        allow_unsafe_pickle: Files that need full unpickling may be read.
    """

    call: Call
    strict: bool = True
    optimizers: Optimizers = field(default_factory=dict)
    allow_unsafe_pickle: bool = False


def load_full_model(
    backend: Backend,
    state: Mapping[str, Any],
    strict: bool,
    source: str,
    expected: Mapping[str, list[Any]] | None = None,
) -> list[str]:
    """Load a full state (every rank holds it) after matching its names with the model's.

    Names may carry wrapper prefixes (``module.``, ``_orig_mod.``...): removed when that
    fits the model better. Returns the names a ``strict=False`` load skipped (missing,
    unexpected or differently shaped: it loads the rest and warns with them).
    ``expected``: the model's `Backend.param_shapes`, when the caller has them.

    Raises:
        CheckpointError: ``strict`` and an entry is missing, unexpected or differently
            shaped (the message names them).
    """
    if expected is None:
        expected = backend.param_shapes()
    fitted = fit_names(state, expected)
    skipped = check_against(expected, describe_params(fitted), source, strict)
    if skipped:
        fitted = {k: v for k, v in fitted.items() if k in expected and k not in skipped}
    backend.load_model_state(fitted, full=True, strict=strict)
    return skipped


def load_full(
    backend: Backend,
    model_state: Mapping[str, Any],
    optim_states: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    request: LoadRequest,
    source: str,
) -> None:
    """Load full model and optimizer states. ``optim_states`` may be a function that reads
    them: it is called after the model is loaded, once ``model_state`` is no longer held
    here (the caller passes the only reference), so a memory-mapped model file's pages can
    leave the resident set before the optimizer file's are read."""
    params = backend.param_shapes()
    skipped = load_full_model(backend, model_state, request.strict, source, params)
    del model_state
    if not request.optimizers:
        return
    states = optim_states() if callable(optim_states) else optim_states
    load_full_optimizers(
        backend, states, request.optimizers, source, params, skipped, request.strict
    )


def load_full_optimizers(
    backend: Backend,
    states: Mapping[str, Any],
    optimizers: Optimizers,
    source: str,
    params: Mapping[str, list[Any]],
    skipped: Sequence[str] = (),
    strict: bool = True,
) -> None:
    """Load each optimizer's full state (``states``, by the optimizers' keys) once its
    names and param groups are checked against the model's ``params`` (its
    `Backend.param_shapes`; ``skipped``: left out of a ``strict=False`` load)."""
    for key, optimizer in optimizers.items():
        named = optimizer_source(source, key, optimizers)
        state = fit_optimizer_state(
            states[key],
            params,
            skipped,
            named,
            groups=backend.optimizer_groups(optimizer),
            own_groups=optimizer.param_groups,
            strict=strict,
        )
        check_unlisted(backend, optimizer, states[key], named, skipped, strict)
        try:
            backend.load_optim_state(optimizer, state, full=True, strict=strict)
        except (CommError, torch.OutOfMemoryError):  # not about this state
            raise
        except (ValueError, RuntimeError) as caught:  # the backend's or torch's refusal
            message = f"{named} does not fit this optimizer on {where()}: {caught}"
            raise CheckpointError(message) from caught


def optimizer_source(source: str, key: str, optimizers: Optimizers) -> str:
    """``source`` in a message about one optimizer's state: with its key if there are several."""
    return source if list(optimizers) == [DEFAULT_KEY] else f"{source} ({key})"


def check_portable(
    manifest: Manifest, source: Path, backend: Backend, request: LoadRequest
) -> None:
    """Raise when the optimizer state to load has no per-parameter full form here."""
    why = backend.optimizer_not_portable()
    if request.optimizers and why is not None:
        message = (
            f"{source} holds {manifest.format!r} optimizer state saved under "
            f"{manifest.strategy} ({manifest.wrapper}, world size {manifest.world_size}), "
            f"which cannot load into this {backend.kind} model: {why}. Pass "
            "load_optimizer=False to load the weights (and schedulers, RNG, user state) only."
        )
        raise CheckpointError(message)
