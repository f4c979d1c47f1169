"""`broadcast_module_state`: rank 0's parameters and buffers to every rank."""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch import nn

from comm_wrappers.backends import rank_device

__all__ = ["broadcast_module_state"]


def broadcast_module_state(module: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers of ``module`` (collective).

    Tensors on the meta device (initialised later, on each rank) are skipped; a tensor on
    another device than the group communicates on goes through a copy there.
    """
    device = rank_device()
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_meta:
                continue
            if tensor.device == device:
                torch_dist.broadcast(tensor.data, src=0)
            else:
                staged = tensor.data.to(device)
                torch_dist.broadcast(staged, src=0)
                tensor.data.copy_(staged)
