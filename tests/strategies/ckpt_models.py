"""The models the checkpoint tests save and load, built the same way on every rank.

A model of every kind (plain module, DDP, FSDP1, FSDP2, DeepSpeed ZeRO 0-3) is built from the
wrappers' test net (``tests.wrappers.net``) with its optim wrapper, and trained on
rank-dependent batches. Shared by tests/strategies/test_checkpoint.py, test_cli.py and the
script ckpt_train.py (run by test_checkpoint_kill.py); parameters are compared with
``tests.helpers.full_params``, independent of the code under test.
"""

from __future__ import annotations

from typing import Any

import torch

import comm_collectives as dist
from comm_wrappers import (
    AmpOptimWrapper,
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    OptimWrapper,
)
from tests.wrappers.net import BATCH, Net, batch

KINDS = ["single", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3"]

STRATEGY = {"single": "single", "ddp": "ddp", "fsdp": "fsdp", "fsdp2": "fsdp2"}


def net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def build(kind: str, seed: int = 0, *, amp: bool = False) -> tuple[Any, Any]:
    """A model of ``kind`` (fresh, initialised from ``seed``) and its optim wrapper."""
    module = net(seed)
    if kind.startswith("zero"):
        from comm_wrappers.deepspeed import initialize

        optimizer = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.01)
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "zero_optimization": {"stage": int(kind[-1])},
            "gradient_clipping": 0.0,
        }
        return initialize(module, config, optimizer)
    if kind == "ddp":
        model: Any = MMDistributedDataParallel(module)
    elif kind == "fsdp":
        model = MMFullyShardedDataParallel(module)
    elif kind == "fsdp2":
        model = MMFullyShardedDataParallel2(module)
    else:
        model = module
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    if amp:
        return model, AmpOptimWrapper(optimizer, dtype="bfloat16", use_fsdp=kind == "fsdp")
    return model, OptimWrapper(optimizer)


def torch_optimizer(optim: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside an optim wrapper (under ZeRO: the engine's base optimizer)."""
    optimizer = optim.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def strategy_of(kind: str) -> str:
    return STRATEGY.get(kind, "deepspeed")


def train_step(model: Any, optim: Any, step: int) -> None:
    """One step; a plain module (the single strategy) sees rank 0's batch on every rank."""
    if hasattr(model, "train_step"):
        model.train_step(batch(step, 0, dist.get_rank()), optim)
        return
    inputs, targets = batch(step, 0, 0)
    optim.update_params(model(inputs, targets, mode="loss")["loss"])


def train_steps(model: Any, optim: Any, steps: range) -> None:
    for step in steps:
        train_step(model, optim, step)


def keep_expected(root: str, name: str, params: dict[str, torch.Tensor]) -> None:
    """Rank 0 writes the parameters a load must reproduce (tensors stay out of the pool's pipes)."""
    if dist.get_rank() == 0:
        torch.save(params, f"{root}/expected_{name}.pt")
    dist.barrier()


def expected_of(root: str, name: str) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = torch.load(f"{root}/expected_{name}.pt")
    return params
