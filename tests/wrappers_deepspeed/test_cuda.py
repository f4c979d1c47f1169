"""DeepSpeed engines on the GPU through nccl (skipped without CUDA; one rank per GPU)."""

from __future__ import annotations

import pytest
import torch

from comm_core.testing import WorldPool

from . import cuda_cases

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_on_the_gpu_equals_plain_torch(nccl_world: WorldPool, stage: int) -> None:
    for result in nccl_world.run(cuda_cases.cuda_equivalence, stage, accum=2, clip=0.05):
        assert result["device"] == "cuda"
        assert result["global_steps"] == 3
        assert result["oracle"] < 1e-5, result


def test_bf16_engine_on_the_gpu_stays_near_plain_autocast(nccl_world: WorldPool) -> None:
    # DeepSpeed's bf16 runs the whole model in bf16 with fp32 master weights; the oracle
    # autocasts the matrix products only: near, not equal.
    for result in nccl_world.run(cuda_cases.cuda_equivalence, 2, bf16=True):
        assert result["device"] == "cuda"
        assert result["oracle"] < 5e-2, result
