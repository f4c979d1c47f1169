"""`OptimWrapper`: backward, gradient accumulation, clipping and the optimizer step.

What depends on the model's backend (how to skip the sync, the whole model's norm) is asked
of the model's adapter (`comm_wrappers.backends`), decided once per model.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ._param_groups import LrMomentumMixin
from .backends import Backend, backend_of

__all__ = ["OptimWrapper"]

_CLIP_TYPES = ("norm", "value")
# Clipping before any optim_context: the rules of a plain module, over the parameters given.
_NO_MODEL = Backend(nn.Module())


class OptimWrapper(LrMomentumMixin):
    """Backward, gradient accumulation, clipping and the optimizer step in one call.

    MMEngine's ``OptimWrapper`` protocol: ``train_step`` runs the forward inside
    ``optim_context(model)`` and calls ``update_params(loss)``, which divides the loss by
    the accumulation count, runs backward, and every ``accumulative_counts`` calls clips,
    steps and zeroes the gradients. On the micro-steps ``optim_context`` skips the model's
    gradient sync, so gradients are reduced only once per update.

    Clipping by norm uses the norm of the whole model, never a rank's local shard: the
    model's backend adapter computes it (sharded models reduce it across ranks). The
    model is the one last passed to ``optim_context``; its backend is decided once.

    Args:
        optimizer: A torch optimizer.
        accumulative_counts: Backward passes per optimizer step.
        clip_grad: ``dict(type="norm", max_norm=..., norm_type=2)`` or
            ``dict(type="value", clip_value=...)``; ``type`` defaults to ``"norm"``. Not
            mutated.

    Attributes:
        grad_norm: The total gradient norm measured by the last clipping by norm (a tensor),
            or None.

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.ones_(model.weight)
        >>> wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.5))
        >>> wrapper.update_params(model(torch.ones(1, 2)).sum())
        >>> model.weight
        Parameter containing:
        tensor([[0.5000, 0.5000]], requires_grad=True)
    """

    def __init__(
        self,
        optimizer: Optimizer,
        accumulative_counts: int = 1,
        clip_grad: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            message = (
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "build it over the wrapped model's parameters first"
            )
            raise TypeError(message)
        if isinstance(accumulative_counts, bool) or not isinstance(accumulative_counts, int):
            message = f"accumulative_counts must be an int >= 1, got {accumulative_counts!r}"
            raise TypeError(message)
        if accumulative_counts < 1:
            message = f"accumulative_counts must be >= 1, got {accumulative_counts}"
            raise ValueError(message)
        self.optimizer = optimizer
        self._accumulative_counts = accumulative_counts
        self._inner_count = 0
        self._max_counts = -1
        self._remainder_counts = -1
        self._divisible_counts = -1
        self._model: Any = None
        self._backend: Backend | None = None
        self.grad_norm: torch.Tensor | None = None
        self.clip_grad_kwargs: dict[str, Any] = {}
        self._clip_type: str | None = None
        if clip_grad is not None:
            self._set_clip(clip_grad)

    def _set_clip(self, clip_grad: Mapping[str, Any]) -> None:
        if not isinstance(clip_grad, Mapping):
            message = (
                "clip_grad must be a dict such as dict(type='norm', max_norm=1.0), "
                f"got {type(clip_grad).__name__}"
            )
            raise TypeError(message)
        kwargs = dict(clip_grad)
        clip_type = kwargs.pop("type", "norm")
        if clip_type not in _CLIP_TYPES:
            message = f"clip_grad type must be one of {_CLIP_TYPES}, got {clip_type!r}"
            raise ValueError(message)
        required = "max_norm" if clip_type == "norm" else "clip_value"
        if required not in kwargs:
            message = (
                f"clip_grad of type {clip_type!r} needs {required!r}, got keys {sorted(clip_grad)}"
            )
            raise ValueError(message)
        self._clip_type = clip_type
        self.clip_grad_kwargs = kwargs

    # ------------------------------------------------------------------ the step
    def update_params(
        self,
        loss: torch.Tensor,
        step_kwargs: Mapping[str, Any] | None = None,
        zero_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Scale the loss for accumulation, run backward, and step + zero when it is time."""
        loss = self.scale_loss(loss)
        self.backward(loss)
        if self.should_update():
            self.step(**(step_kwargs or {}))
            self.zero_grad(**(zero_kwargs or {}))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Divide the loss by the number of backward passes in the current update."""
        if self._max_counts == -1 or self._inner_count < self._divisible_counts:
            factor = self._accumulative_counts
        else:
            factor = self._remainder_counts
        # No division (and no node in the backward graph) without accumulation.
        return loss if factor == 1 else loss / factor

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Run ``loss.backward(**kwargs)`` and count the pass."""
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]
        self._inner_count += 1

    def step(self, **kwargs: Any) -> None:
        """Clip the gradients (if configured) and step the optimizer."""
        if self._clip_type is not None:
            self._clip_grad()
        self.optimizer.step(**kwargs)

    def zero_grad(self, **kwargs: Any) -> None:
        """Zero the optimizer's gradients."""
        self.optimizer.zero_grad(**kwargs)

    def _grad_params(self) -> list[torch.Tensor]:
        return [
            p
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    def _clip_grad(self) -> None:
        params = self._grad_params()
        if self._clip_type == "value":
            if params:
                nn.utils.clip_grad_value_(params, **self.clip_grad_kwargs)
            return
        # Without a model (no optim_context yet) the parameters are clipped as they are.
        backend = _NO_MODEL if self._backend is None else self._backend
        self.grad_norm = backend.clip_grad_norm(params, **self.clip_grad_kwargs)

    @property
    def clip_grad(self) -> dict[str, Any] | None:
        """The clipping configuration, ``{"type": "norm" | "value", **options}``, or None."""
        if self._clip_type is None:
            return None
        return {"type": self._clip_type, **self.clip_grad_kwargs}

    # ------------------------------------------------------------------ accumulation
    def _backend_for(self, model: nn.Module) -> Backend:
        """``model``'s backend, decided once per model (not every step)."""
        if model is not self._model or self._backend is None:
            self._model, self._backend = model, backend_of(model)
            self._new_backend(self._backend)
        return self._backend

    def _new_backend(self, backend: Backend) -> None:
        """Called when a new model's backend is decided (nothing to do here)."""

    @contextlib.contextmanager
    def optim_context(self, model: nn.Module) -> Iterator[None]:
        """Skip ``model``'s gradient sync on a micro-step that must not synchronise.

        Also remembers ``model`` for clipping by norm (the whole model's norm).

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ValueError: DDP with ``static_graph=True`` on a micro-step (torch cannot skip
                its sync).
        """
        backend = self._backend_for(model)
        if self.should_sync():
            yield
        else:
            with backend.no_sync():
                yield

    def should_update(self) -> bool:
        """Whether the backward pass just counted completes an update."""
        return (
            self._inner_count % self._accumulative_counts == 0
            or self._inner_count == self._max_counts
        )

    def should_sync(self) -> bool:
        """Whether the next backward pass completes an update (so gradients must sync)."""
        return (self._inner_count + 1) % self._accumulative_counts == 0 or (
            self._inner_count + 1
        ) == self._max_counts

    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int) -> None:
        """Set the pass counter (after a resume) and the total number of passes.

        With ``max_counts`` not a multiple of ``accumulative_counts``, the last, shorter
        update divides the loss by its own length instead.
        """
        self._inner_count = init_counts
        self._max_counts = max_counts
        if init_counts % self._accumulative_counts != 0:
            warnings.warn(
                f"resumed at pass {init_counts}, inside an accumulation of "
                f"{self._accumulative_counts}: the first update after the resume is partial",
                stacklevel=2,
            )
        if self._accumulative_counts > 1 and _has_batch_norm(model):
            warnings.warn(
                "gradient accumulation with BatchNorm layers: the statistics see micro-batches, "
                "so results differ from one big batch",
                stacklevel=2,
            )
        self._remainder_counts = max_counts % self._accumulative_counts
        self._divisible_counts = max_counts - self._remainder_counts

    @property
    def inner_count(self) -> int:
        """Backward passes counted so far."""
        return self._inner_count

    @property
    def accumulative_counts(self) -> int:
        """Backward passes per optimizer step."""
        return self._accumulative_counts

    # ------------------------------------------------------------------ state
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        """The optimizer's defaults."""
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        """Return the optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load an optimizer state dict (the argument is not mutated)."""
        self.optimizer.load_state_dict(dict(state_dict))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(optimizer={type(self.optimizer).__name__}, "
            f"accumulative_counts={self._accumulative_counts}, "
            f"clip_grad={self.clip_grad!r})"
        )


def _has_batch_norm(model: Any) -> bool:
    if not isinstance(model, nn.Module):
        return False
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
