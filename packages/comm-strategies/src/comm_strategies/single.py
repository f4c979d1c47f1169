"""`SingleDeviceStrategy`: one process, one device, no wrapper."""

from __future__ import annotations

import torch
from torch import nn

import comm_collectives as dist

from .base import Strategy

__all__ = ["SingleDeviceStrategy"]


class SingleDeviceStrategy(Strategy):
    """Train in one process on its device (the CPU, or the current accelerator).

    The model is moved to the device and not wrapped; ``SyncBatchNorm`` layers are turned
    back into ``BatchNorm``. No process group is started (one that exists is left alone).

    Examples:
        >>> import torch
        >>> strategy = SingleDeviceStrategy(seed=0)
        >>> model, optim, schedulers = strategy.prepare(
        ...     torch.nn.Linear(2, 1),
        ...     optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
        ...     param_scheduler=dict(type="StepLR", step_size=1, gamma=0.5),
        ... )
        >>> loss = model(torch.ones(4, 2)).pow(2).mean()
        >>> optim.update_params(loss)
        >>> schedulers[0].step()
        >>> optim.get_lr()
        {'lr': [0.05]}
    """

    name = "single"
    needs_process_group = False

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        model = _revert_sync_batchnorm(model)
        return model.to(dist.get_device())


class _BatchNorm(nn.modules.batchnorm._BatchNorm):
    """A ``BatchNorm`` for inputs of any rank, as ``SyncBatchNorm`` accepts."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            message = f"expected an input of at least 2 dimensions, got {input.dim()}"
            raise ValueError(message)


def _revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every ``SyncBatchNorm`` by a plain batch norm with the same state."""
    if isinstance(module, nn.SyncBatchNorm):
        plain = _BatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        plain.load_state_dict(module.state_dict())
        plain.train(module.training)
        return plain
    for name, child in module.named_children():
        replaced = _revert_sync_batchnorm(child)
        if replaced is not child:
            setattr(module, name, replaced)
    return module
