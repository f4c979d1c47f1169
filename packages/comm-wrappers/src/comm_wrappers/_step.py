"""The step API every wrapper shares: ``train_step``, ``val_step``, ``test_step``."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ._model import check_mode_argument, model_parse_losses, preprocess, run_forward

__all__ = ["AnomalousParameterWarning", "StepMixin", "find_unused_parameters"]


class OptimWrapperLike(Protocol):
    """What ``train_step`` needs of an optimizer wrapper (ours, or MMEngine's)."""

    def optim_context(self, model: nn.Module) -> Any: ...

    def update_params(self, loss: torch.Tensor) -> Any: ...


class AnomalousParameterWarning(UserWarning):
    """Parameters that require a gradient took no part in the loss (``detect_anomalous_params``)."""


def find_unused_parameters(loss: torch.Tensor, model: nn.Module) -> list[str]:
    """Return the names of the parameters that require grad and are not in ``loss``'s graph.

    Examples:
        >>> import torch
        >>> model = torch.nn.ModuleDict({"used": torch.nn.Linear(1, 1), "unused": torch.nn.Linear(1, 1)})
        >>> find_unused_parameters(model["used"](torch.ones(1, 1)).sum(), model)
        ['unused.weight', 'unused.bias']
    """
    reached: set[int] = set()
    seen: set[int] = set()
    stack: list[Any] = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return [
        name
        for name, parameter in model.named_parameters()
        if parameter.requires_grad and id(parameter) not in reached
    ]


class StepMixin:
    """``train_step`` / ``val_step`` / ``test_step`` for a wrapper whose forward syncs.

    The training forward runs through the wrapper itself (so DDP and FSDP hooks fire); the
    user's module supplies the data preprocessor and ``parse_losses``.
    """

    detect_anomalous_params: bool = False

    def _user_module(self) -> nn.Module:
        # Found once: the wrapped module does not change after construction.
        cached: nn.Module | None = self.__dict__.get("_comm_user_module")
        if cached is None:
            from ._registry import unwrap_model

            cached = unwrap_model(self)
            self.__dict__["_comm_user_module"] = cached
        return cached

    def train_step(self, data: Any, optim_wrapper: OptimWrapperLike) -> Mapping[str, torch.Tensor]:
        """Preprocess, forward in ``"loss"`` mode through the wrapper, update the parameters.

        Args:
            data: A batch: a dict (passed as keywords) or a tuple/list (passed as positions).
            optim_wrapper: An `OptimWrapper` (or MMEngine's); its ``optim_context`` skips the
                gradient sync on accumulation micro-steps.

        Returns:
            The log values of ``parse_losses`` (``"loss"`` first), detached.
        """
        module = self._user_module()
        with optim_wrapper.optim_context(self):  # type: ignore[arg-type]
            batch = preprocess(module, data, True)
            check_mode_argument(module)
            losses = run_forward(self, batch, "loss")  # type: ignore[arg-type]
        loss, log_vars = model_parse_losses(module, losses)
        if self.detect_anomalous_params:
            unused = find_unused_parameters(loss, module)
            if unused:
                message = (
                    f"{len(unused)} parameter(s) require grad but took no part in the loss: "
                    f"{', '.join(unused)}. Under DDP set find_unused_parameters=True or freeze them."
                )
                warnings.warn(message, AnomalousParameterWarning, stacklevel=2)
        optim_wrapper.update_params(loss)
        return log_vars

    # True where the parameters are shards, which only the wrapper's forward gathers: then
    # inference runs through the wrapper, never through the module's own val_step/test_step.
    _infer_through_wrapper: bool = False

    def _inference(self, name: str, data: Any) -> Any:
        module = self._user_module()
        own = getattr(module, name, None)
        if callable(own) and not self._infer_through_wrapper:
            return own(data)
        batch = preprocess(module, data, False)
        check_mode_argument(module)
        forward = self if self._infer_through_wrapper else module
        return run_forward(forward, batch, "predict")  # type: ignore[arg-type]

    def val_step(self, data: Any) -> Any:
        """Preprocess (``training=False``) and forward in ``"predict"`` mode; no gradient sync."""
        return self._inference("val_step", data)

    def test_step(self, data: Any) -> Any:
        """Like `val_step`, for testing."""
        return self._inference("test_step", data)
