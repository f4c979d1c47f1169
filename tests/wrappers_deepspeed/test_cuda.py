"""DeepSpeed engines on the GPU through nccl (skipped without CUDA; one rank per GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_core.testing import WorldPool
from comm_wrappers.deepspeed import initialize
from tests.helpers import full_params, max_diff
from tests.wrappers.net import batch, make_net, make_optimizer, oracle

from .test_deepspeed import ds_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_on_the_gpu_equals_plain_torch(nccl_world: WorldPool, stage: int) -> None:
    for result in nccl_world.run(cuda_equivalence, stage, accum=2, clip=0.05):
        assert result["device"] == "cuda"
        assert result["global_steps"] == 3
        assert result["oracle"] < 1e-5, result


def test_bf16_engine_on_the_gpu_stays_near_plain_autocast(nccl_world: WorldPool) -> None:
    # DeepSpeed's bf16 runs the whole model in bf16 with fp32 master weights; the oracle
    # autocasts the matrix products only: near, not equal.
    for result in nccl_world.run(cuda_equivalence, 2, bf16=True):
        assert result["device"] == "cuda"
        assert result["oracle"] < 5e-2, result
