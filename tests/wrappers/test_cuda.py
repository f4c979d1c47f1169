"""CUDA paths: one process, and nccl worlds on the GPUs there are. Skipped without CUDA.

A world of N ranks needs N GPUs (nccl refuses two ranks on one device), so a one-GPU
machine runs the worlds of one: every wrapper still builds, moves the batches, shards,
scales and steps on the GPU through nccl. The oracle is one process of plain torch on the
same device that sees every rank's batches, with the same autocast and, for float16, the
same dynamic ``GradScaler``. The batches are made on the CPU: the wrappers' default data
preprocessor moves them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import comm_collectives as dist
from comm_core.testing import WorldPool
from comm_wrappers import (
    AmpOptimWrapper,
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    MMSeparateDistributedDataParallel,
    OptimWrapper,
    unwrap_model,
)
from tests.helpers import full_params, max_diff

from .net import make_net, oracle, train

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
        "oracle": max_diff(full_params(model), expected),
        "param_device": next(compute.parameters()).device.type,
        "scaler": type(scaler).__name__ if scaler is not None else None,
        "scale": float(scaler.get_scale()) if scaler is not None else None,
        "cast_dtype": str(getattr(wrapper, "cast_dtype", "")),
    }


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
    for result in nccl_world.run(cuda_equivalence, kind, **options):
        bound = AMP if "amp" in options else EXACT
        assert result["oracle"] < bound, result
        offloaded = options.get("cpu_offload", False)
        assert result["param_device"] == ("cpu" if offloaded else "cuda"), result
        if options.get("amp") == "float16":
            # the sharded scaler under FSDP1, torch's scaler under DDP; no step overflowed
            expected = "ShardedGradScaler" if kind == "fsdp" else "GradScaler"
            assert result["scaler"] == expected, result
            assert result["scale"] == 65536.0, result


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


def test_separate_ddp_moves_children_to_the_gpu(nccl_world: WorldPool) -> None:
    for result in nccl_world.run(separate_ddp_on_the_gpu):
        assert result["devices"] == ["cuda"]
        assert result["loss"] > 0
