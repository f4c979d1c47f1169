"""DeepSpeed on a CUDA world (nccl): ZeRO 0-3 against plain torch on the GPU."""

from __future__ import annotations

from typing import Any

import torch

import comm_collectives as dist
from comm_wrappers.deepspeed import initialize
from tests.wrappers.cases import batch, make_net, make_optimizer, max_diff, oracle

from .cases import ds_config, full_params


def cuda_equivalence(
    stage: int, accum: int = 1, clip: float | None = None, bf16: bool = False
) -> dict[str, Any]:
    """Train under ZeRO ``stage`` on the GPU with torch AdamW; difference to the oracle."""
    model = make_net()
    optimizer = make_optimizer(model.parameters(), "adamw")
    config = ds_config(stage, accum, clip, bf16, torch_adam=False)
    wrapper, optim = initialize(model, config, optimizer, inputs_to_half=[0] if bf16 else None)
    rank = dist.get_rank()
    for step in range(3):
        for micro in range(accum):
            wrapper.train_step(batch(step, micro, rank), optim)  # batches moved to the GPU
    expected = oracle(
        3,
        accum,
        dist.get_world_size(),
        clip=clip,
        optimizer="adamw",
        dtype=torch.bfloat16 if bf16 else None,
        device="cuda",
    )
    return {
        "oracle": max_diff(full_params(wrapper), expected),
        "device": next(wrapper.model.module.parameters()).device.type,
        "global_steps": wrapper.global_steps,
    }
