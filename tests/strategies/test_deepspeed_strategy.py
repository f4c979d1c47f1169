"""`DeepSpeedStrategy.prepare` refuses what the engine would silently ignore."""

from __future__ import annotations

from typing import Any

import torch

from comm_strategies import build_strategy
from tests.helpers import caught


def prepare_with(key: str, value: Any) -> tuple[str, str]:
    """Prepare with an optim_wrapper config holding ``key``: what it raised."""
    strategy = build_strategy("deepspeed", seed=0, zero_stage=2)
    strategy.setup_env()
    return caught(
        strategy.prepare,
        torch.nn.Linear(4, 2),
        optim_wrapper={"optimizer": {"type": "AdamW", "lr": 0.01}, key: value},
        dispatch_kwargs={"train_micro_batch_size_per_gpu": 2},
    )


def test_paramwise_cfg_is_refused_not_ignored(comm_pools: Any) -> None:
    """DeepSpeed trained the bias at lr 0.01 despite bias_lr_mult=0; the other strategies
    refuse the key, so DeepSpeed does too, on every rank."""
    for key, value in (("paramwise_cfg", {"bias_lr_mult": 0.0}), ("constructor", "X")):
        for kind, message in comm_pools.get(2).run(prepare_with, key, value, timeout=300):
            assert kind == "ValueError", (key, kind, message)
            assert repr(key) in message, message
            assert "pass it as 'optimizer'" in message, message
