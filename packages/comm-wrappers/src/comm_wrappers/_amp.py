"""`AmpOptimWrapper`: `OptimWrapper` with autocast and, for float16, a gradient scaler.

Which scaler (every rank must agree on skipping a step when the gradients are sharded) and
where autocast runs are asked of the model's adapter (`comm_wrappers.backends`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ._dtypes import to_dtype
from ._optim_wrapper import OptimWrapper
from .backends import Backend, rank_device
from .backends._base import new_grad_scaler

__all__ = ["AmpOptimWrapper"]


class AmpOptimWrapper(OptimWrapper):
    """`OptimWrapper` with autocast in ``optim_context`` and, for float16, a gradient scaler.

    bfloat16 needs no scaler and works on CPU. float16 gets the scaler of the model's
    backend: ``torch.amp.GradScaler``, or one that every rank agrees on when the model is
    sharded (a plain scaler would let the ranks disagree on skipping a step).

    Args:
        optimizer: A torch optimizer.
        loss_scale: ``"dynamic"``, a float (a static scale), or a dict of ``GradScaler``
            keywords. Used for float16 only.
        dtype: The autocast dtype (a torch dtype or a name such as ``"bfloat16"``);
            default float16 where the model computes on CUDA (under nccl, or with CUDA and
            no process group), bfloat16 elsewhere (also under gloo on a machine with a GPU).
        use_fsdp: MMEngine's flag: start with the scaler every rank agrees on (torch's
            ``ShardedGradScaler``), before any model is seen. A model that needs it gets
            it anyway at its first ``optim_context``.
        **kwargs: `OptimWrapper` arguments.

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> wrapper = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), dtype="bfloat16")
        >>> with wrapper.optim_context(model):
        ...     out = model(torch.ones(1, 2))
        >>> out.dtype
        torch.bfloat16
    """

    def __init__(
        self,
        optimizer: Optimizer,
        loss_scale: str | float | Mapping[str, Any] = "dynamic",
        dtype: str | torch.dtype | None = None,
        use_fsdp: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizer, **kwargs)
        # float16 where the model will compute on CUDA (under nccl, or CUDA without a
        # process group); bfloat16 on the CPU, also under gloo on a machine with a GPU.
        self._device_type = rank_device().type
        default = "float16" if self._device_type == "cuda" else "bfloat16"
        self.cast_dtype = to_dtype(default if dtype is None else dtype, "dtype")
        self._static_scale: float | None = None
        self.loss_scaler: Any = None
        self._scaler_kwargs: dict[str, Any] = {}
        self._autocast_type = self._device_type
        if self.cast_dtype == torch.float16:
            if loss_scale == "dynamic":
                pass
            elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
                self._static_scale = float(loss_scale)
                self._scaler_kwargs = {"init_scale": float(loss_scale)}
            elif isinstance(loss_scale, Mapping):
                self._scaler_kwargs = dict(loss_scale)
            else:
                message = (
                    f"loss_scale must be 'dynamic', a number or a dict of GradScaler "
                    f"keywords, got {loss_scale!r}"
                )
                raise ValueError(message)
            self.loss_scaler = new_grad_scaler(
                self._scaler_device(), sharded=use_fsdp, **self._scaler_kwargs
            )

    def _scaler_device(self) -> str:
        return "cuda" if self._device_type == "cuda" else "cpu"

    def _new_backend(self, backend: Backend) -> None:
        """Ask the new model's backend where autocast runs, and for its scaler."""
        self._autocast_type = backend.compute_device().type
        if self.loss_scaler is None:
            return
        wanted = backend.grad_scaler(self._scaler_device(), **self._scaler_kwargs)
        # A scaler that agrees across ranks replaces a plain one (with its state); never
        # the other way round.
        current = type(self.loss_scaler)
        if type(wanted) is not current and isinstance(wanted, current):
            wanted.load_state_dict(self.loss_scaler.state_dict())
            self.loss_scaler = wanted

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Run backward on the scaled loss (float16) or the loss, and count the pass."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]
        self._inner_count += 1

    def step(self, **kwargs: Any) -> None:
        """Unscale, clip, step through the scaler (float16), or step as `OptimWrapper`."""
        if self.loss_scaler is None:
            super().step(**kwargs)
            return
        if self._clip_type is not None:
            self.loss_scaler.unscale_(self.optimizer)
            self._clip_grad()
        self.loss_scaler.step(self.optimizer, **kwargs)
        self.loss_scaler.update(self._static_scale)

    @contextlib.contextmanager
    def optim_context(self, model: nn.Module) -> Iterator[None]:
        """Skip the sync on micro-steps (as `OptimWrapper`) and autocast to ``cast_dtype``.

        Autocast runs where the model computes (its backend's ``compute_device``): its
        parameters' device, or this rank's accelerator when a sharded wrapper offloads
        them to the CPU.
        """
        self._backend_for(model)  # decides the autocast device of a new model
        with (
            super().optim_context(model),
            torch.autocast(self._autocast_type, dtype=self.cast_dtype),
        ):
            yield

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict, plus ``"loss_scaler"`` when a scaler is used."""
        state = dict(self.optimizer.state_dict())
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the optimizer's and the scaler's state (the argument is not mutated)."""
        state = dict(state_dict)
        scaler_state = state.pop("loss_scaler", None)
        if scaler_state is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(copy.copy(scaler_state))
        self.optimizer.load_state_dict(state)
