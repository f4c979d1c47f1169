"""CUDA paths: one process, and nccl worlds on the GPUs there are. Skipped without CUDA.

A world of N ranks needs N GPUs (nccl refuses two ranks on one device), so a one-GPU
machine runs the worlds of one: every wrapper still builds, moves the batches, shards,
scales and steps on the GPU through nccl.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from comm_core.testing import WorldPool
from comm_wrappers import AmpOptimWrapper

from . import cuda_cases

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EXACT = 1e-5  # float32 on the GPU: the same kernels, another reduction order at world 2
AMP = 2e-3  # autocast: the same half-precision ops in another order


def test_fp16_autocast_and_grad_scaler_on_cuda() -> None:
    model = torch.nn.Linear(2, 1, bias=False).cuda()
    torch.nn.init.ones_(model.weight)
    wrapper = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=1.0), loss_scale=1024.0)
    assert wrapper.cast_dtype == torch.float16  # the default on CUDA
    with wrapper.optim_context(model):
        out = model(torch.ones(1, 2, device="cuda"))
    assert out.dtype == torch.float16
    wrapper.update_params(out.float().sum())
    # The scaled gradient is unscaled before the step: weight 1 - 1 * grad 1 = 0.
    assert model.weight.tolist() == [[0.0, 0.0]]
    assert wrapper.state_dict()["loss_scaler"]["scale"] == 1024.0


CASES: list[tuple[str, dict[str, Any]]] = [
    ("ddp", {}),
    ("ddp", {"accum": 2, "clip": 0.05, "optimizer": "adamw"}),
    ("ddp", {"amp": "float16", "clip": 0.05}),
    ("ddp", {"amp": "bfloat16"}),
    ("fsdp", {}),
    ("fsdp", {"sharding_strategy": "SHARD_GRAD_OP", "accum": 2, "clip": 0.05}),
    ("fsdp", {"amp": "float16", "clip": 0.05}),
    ("fsdp", {"cpu_offload": True}),
    ("fsdp2", {}),
    ("fsdp2", {"accum": 2, "clip": 0.05, "optimizer": "adamw"}),
    ("fsdp2", {"amp": "bfloat16"}),
    ("fsdp2", {"cpu_offload": True}),
]


@pytest.mark.parametrize(("kind", "options"), CASES, ids=[f"{k}-{o}" for k, o in CASES])
def test_wrapper_on_the_gpu_equals_plain_torch_on_the_gpu(
    nccl_world: WorldPool, kind: str, options: dict[str, Any]
) -> None:
    for result in nccl_world.run(cuda_cases.cuda_equivalence, kind, **options):
        bound = AMP if "amp" in options else EXACT
        assert result["oracle"] < bound, result
        offloaded = options.get("cpu_offload", False)
        assert result["param_device"] == ("cpu" if offloaded else "cuda"), result
        if options.get("amp") == "float16":
            # the sharded scaler under FSDP1, torch's scaler under DDP; no step overflowed
            expected = "ShardedGradScaler" if kind == "fsdp" else "GradScaler"
            assert result["scaler"] == expected, result
            assert result["scale"] == 65536.0, result


def test_separate_ddp_moves_children_to_the_gpu(nccl_world: WorldPool) -> None:
    for result in nccl_world.run(cuda_cases.separate_ddp_on_the_gpu):
        assert result["devices"] == ["cuda"]
        assert result["loss"] > 0
