"""The one device rule: which device this rank computes and communicates on."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from comm_collectives import get_comm_device, get_device, get_local_rank, is_distributed

__all__ = ["rank_device"]


def rank_device(group: Any = None) -> torch.device:
    """Return this rank's device: its local rank's accelerator, or the CPU.

    The kind of device is the one the process group communicates on: the accelerator
    under nccl, the CPU under gloo and mpi (also on a machine with a GPU: gloo has no
    reduce-scatter for CUDA tensors). Without a process group it is the machine's best
    device. The index is the local rank (modulo the devices this process sees), never the
    current device: a group made by torch directly may not have selected one.

    Args:
        group: The process group whose backend decides (or hybrid sharding's pair of
            groups: the first one); None: the default group.

    Returns:
        ``cpu``, or e.g. ``cuda:1`` for local rank 1.

    Examples:
        >>> from comm_wrappers.backends import rank_device
        >>> rank_device().type in {"cpu", "cuda", "xpu", "mps"}
        True
    """
    if is_distributed():
        if isinstance(group, (tuple, list)):
            group = group[0]
        device_type = get_comm_device(group if isinstance(group, ProcessGroup) else None).type
    else:
        device_type = get_device()
    if device_type == "cpu":
        return torch.device("cpu")
    count = getattr(getattr(torch, device_type, None), "device_count", lambda: 1)()
    return torch.device(device_type, get_local_rank() % max(int(count), 1))
