"""Cases for a CUDA world (nccl): each wrapper on the GPU against plain torch on the GPU.

The oracle is one process of plain torch on the same device that sees every rank's
batches, with the same autocast and, for float16, the same dynamic ``GradScaler``. The
batches are made on the CPU: the wrappers' default data preprocessor moves them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import comm_collectives as dist
from comm_wrappers import (
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    MMSeparateDistributedDataParallel,
    OptimWrapper,
    unwrap_model,
)

from .cases import make_net, max_diff, oracle, params_of, train


def cuda_wrap(kind: str, **options: Any) -> nn.Module:
    """The test net under ``kind``; DDP and FSDP2 get it on the GPU, FSDP1 on the CPU."""
    net = make_net()
    if kind == "ddp":
        return MMDistributedDataParallel(net.cuda(), **options)
    if kind == "fsdp":  # FSDP1 moves the CPU module to its default device_id, the GPU
        return MMFullyShardedDataParallel(net, **options)
    if kind == "fsdp2":
        return MMFullyShardedDataParallel2(net.cuda(), **options)
    raise ValueError(kind)


def cuda_equivalence(
    kind: str,
    steps: int = 3,
    accum: int = 1,
    clip: float | None = None,
    optimizer: str = "sgd",
    amp: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Train ``kind`` on the GPU; its difference to the GPU oracle, and what it ran on."""
    dtype = getattr(torch, amp) if amp else None
    model = cuda_wrap(kind, **options)
    wrapper = train(
        model, steps, accum, clip=clip, optimizer=optimizer, amp=dtype, use_fsdp=kind != "ddp"
    )
    expected = oracle(
        steps,
        accum,
        dist.get_world_size(),
        clip=clip,
        optimizer=optimizer,
        dtype=dtype,
        device="cuda",
    )
    scaler = getattr(wrapper, "loss_scaler", None)
    compute = unwrap_model(model)
    return {
        "oracle": max_diff(params_of(model), expected),
        "param_device": next(compute.parameters()).device.type,
        "scaler": type(scaler).__name__ if scaler is not None else None,
        "scale": float(scaler.get_scale()) if scaler is not None else None,
        "cast_dtype": str(getattr(wrapper, "cast_dtype", "")),
    }


def separate_ddp_on_the_gpu() -> dict[str, Any]:
    """Separate DDP moves the children to the nccl group's device and trains there."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)

    model = MMSeparateDistributedDataParallel(Two())
    devices = sorted({p.device.type for p in model.parameters()})
    optim = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    with optim.optim_context(model.module.a):
        loss = model.module.b(model.module.a(inputs.cuda())).pow(2).mean()
    optim.update_params(loss)
    return {"devices": devices, "loss": float(loss)}
