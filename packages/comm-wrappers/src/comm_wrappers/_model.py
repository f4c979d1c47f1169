"""The duck-typed model contract of MMEngine's ``BaseModel``, with defaults for what a model lacks.

A model may define ``data_preprocessor(data, training)``, ``forward(..., mode=...)`` with
modes ``"loss"``, ``"predict"`` and ``"tensor"``, and ``parse_losses(losses)``. Without a
``data_preprocessor`` the batch is moved to the model's device; without ``parse_losses``
MMEngine's rule applies (the loss is the sum of the values whose key contains ``"loss"``).
A plain module whose ``forward`` has no ``mode`` is adapted with `LossModel`.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence, ValuesView
from typing import Any

import torch
from torch import nn

from comm_collectives import cast_data_device

from ._registry import module_device

__all__ = ["LossModel", "parse_losses"]

MODES = ("loss", "predict", "tensor")


class LossModel(nn.Module):
    """Adapt a plain ``nn.Module`` and a loss function to the ``forward(..., mode=)`` contract.

    The batch is ``(inputs, targets)`` (a tuple or list) or ``{"inputs": ..., "targets": ...}``.
    ``mode="loss"`` returns ``{"loss": loss_fn(module(inputs), targets)}``, ``"predict"``
    and ``"tensor"`` return ``module(inputs)``.

    Args:
        module: The network.
        loss_fn: ``loss_fn(outputs, targets) -> Tensor``, e.g. ``nn.MSELoss()``.

    Examples:
        >>> import torch
        >>> model = LossModel(torch.nn.Linear(2, 1), torch.nn.MSELoss())
        >>> batch = (torch.ones(4, 2), torch.zeros(4, 1))
        >>> sorted(model(*batch, mode="loss"))
        ['loss']
        >>> model(batch[0], mode="predict").shape
        torch.Size([4, 1])
    """

    def __init__(self, module: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, inputs: Any, targets: Any = None, mode: str = "tensor") -> Any:
        """Run the network; in ``"loss"`` mode return ``{"loss": ...}``."""
        outputs = self.module(inputs)
        if mode == "loss":
            if targets is None:
                message = (
                    "LossModel in mode='loss' needs targets: pass the batch as (inputs, targets)"
                )
                raise ValueError(message)
            return {"loss": self.loss_fn(outputs, targets)}
        if mode in ("predict", "tensor"):
            return outputs
        raise ValueError(_bad_mode(mode))


def _bad_mode(mode: object) -> str:
    return f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}"


def preprocess(module: nn.Module, data: Any, training: bool) -> Any:
    """Run the model's ``data_preprocessor``, or move the batch to the model's device."""
    preprocessor = getattr(module, "data_preprocessor", None)
    if callable(preprocessor):
        return preprocessor(data, training)
    return to_device(data, module_device(module))


def to_device(data: Any, device: torch.device) -> Any:
    """``data`` with its tensors on ``device`` (as it is when they are there, or on meta)."""
    if device.type == "meta" or _flat_on(data, device):
        return data
    return cast_data_device(data, device)


def _flat_on(data: Any, device: torch.device) -> bool:
    """Whether ``data`` is a tuple, list or dict of tensors already on ``device``.

    The common batch, checked without the recursion of `cast_data_device` on every step.
    """
    values = data.values() if isinstance(data, Mapping) else data
    if not isinstance(values, (tuple, list, ValuesView)):
        return False
    return all(isinstance(v, torch.Tensor) and v.device == device for v in values)


_TAKES_MODE: dict[Any, bool] = {}


def _takes_mode(forward: Any) -> bool:
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin or C forward: let the call decide
        return True
    return "mode" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def check_mode_argument(module: nn.Module) -> None:
    """Raise a TypeError pointing at `LossModel` when ``forward`` cannot take ``mode=``."""
    # Decided once per forward function: this runs on every training step.
    forward = getattr(type(module), "forward", None)
    takes_mode = _TAKES_MODE.get(forward)
    if takes_mode is None:
        takes_mode = _TAKES_MODE[forward] = _takes_mode(module.forward)
    if takes_mode:
        return
    message = (
        f"{type(module).__qualname__}.forward takes no 'mode' argument, so train_step, "
        "val_step and test_step cannot call it as forward(..., mode='loss'|'predict'). "
        "Wrap the network with comm_wrappers.LossModel(module, loss_fn) (batches are "
        "(inputs, targets)), or add mode= to forward as MMEngine's BaseModel does."
    )
    raise TypeError(message)


def run_forward(model: Callable[..., Any], data: Any, mode: str) -> Any:
    """Call ``model`` on a batch the way MMEngine does: a dict as keywords, a list as positions."""
    if isinstance(data, Mapping):
        return model(**data, mode=mode)
    if isinstance(data, (list, tuple)):
        return model(*data, mode=mode)
    message = (
        f"a batch must be a dict (passed as keywords) or a list/tuple (passed as positions) "
        f"after the data preprocessor, got {type(data).__name__}"
    )
    raise TypeError(message)


def parse_losses(losses: Mapping[str, Any]) -> tuple[torch.Tensor, OrderedDict[str, torch.Tensor]]:
    """Reduce a dict of losses to the loss to optimise and the values to log (MMEngine's rule).

    Every value is a tensor (its mean is taken) or a list of tensors (the sum of their
    means). The loss is the sum of the values whose key contains ``"loss"``.

    Returns:
        ``(loss, log_vars)``; ``log_vars`` holds ``"loss"`` first, then every entry, detached.

    Raises:
        TypeError: A value is neither a tensor nor a list of tensors.
        ValueError: No key contains ``"loss"``.

    Examples:
        >>> import torch
        >>> loss, log_vars = parse_losses({"loss_a": torch.tensor([1.0, 3.0]), "acc": torch.tensor(0.5)})
        >>> loss
        tensor(2.)
        >>> list(log_vars)
        ['loss', 'loss_a', 'acc']
    """
    log_vars: list[tuple[str, torch.Tensor]] = []
    for name, value in losses.items():
        if isinstance(value, torch.Tensor):
            # A scalar is its own mean: no extra node in the backward graph.
            log_vars.append((name, value if value.dim() == 0 else value.mean()))
        elif (
            isinstance(value, Sequence)
            and value
            and all(isinstance(v, torch.Tensor) for v in value)
        ):
            total = value[0].mean()
            for item in value[1:]:
                total = total + item.mean()
            log_vars.append((name, total))
        else:
            message = (
                f"loss {name!r} must be a tensor or a list of tensors, got {type(value).__name__}"
            )
            raise TypeError(message)
    terms = [value for name, value in log_vars if "loss" in name]
    if not terms:
        message = (
            f"no key of the losses contains 'loss' (keys: {sorted(losses)}); name at least "
            "one entry '...loss...' or define parse_losses on the model"
        )
        raise ValueError(message)
    loss = terms[0]
    for term in terms[1:]:
        loss = loss + term
    parsed = OrderedDict([("loss", loss.detach()), *((n, v.detach()) for n, v in log_vars)])
    return loss, parsed


def model_parse_losses(
    module: nn.Module, losses: Any
) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """Use the model's own ``parse_losses`` when it has one, else `parse_losses`."""
    own = getattr(module, "parse_losses", None)
    if callable(own):
        result = own(losses)
        return result[0], result[1]
    if not isinstance(losses, Mapping):
        message = (
            f"forward(mode='loss') must return a dict of losses, got {type(losses).__name__}; "
            "return {'loss': ...} or define parse_losses on the model"
        )
        raise TypeError(message)
    return parse_losses(losses)
