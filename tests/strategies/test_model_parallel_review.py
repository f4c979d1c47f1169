"""`ModelParallelStrategy` and activation checkpointing: the cases an outside review found.

Each test runs on 2 gloo ranks (or in-process) and compares with a plain one-process torch
run, or checks that a bad input raises one clear error on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from comm_strategies import build_strategy
from tests.helpers import full_params, max_diff
from tests.wrappers.net import batch, global_batch, make_net

TOLERANCE = 1e-5
STEPS = 2

OPTIMIZERS: dict[str, Any] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.05),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def one_process(kind: str, world: int) -> dict[str, torch.Tensor]:
    """Plain torch, one process, each step on the batches of every data-parallel rank."""
    model = make_net()
    optimizer = OPTIMIZERS[kind](model.parameters())
    for step in range(STEPS):
        model(*global_batch(step, 0, world), mode="loss")["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_params(model)


def train_built_optimizer(name: str, kind: str) -> float:
    """Prepare with an optimizer built over the unwrapped model; difference to one process."""
    strategy = build_strategy(name, seed=0)
    net = make_net()
    model, optim, _ = strategy.prepare(net, optim_wrapper=OPTIMIZERS[kind](net.parameters()))
    rank = getattr(strategy, "data_parallel_rank", strategy.rank)
    world = getattr(strategy, "data_parallel_world_size", strategy.world_size)
    assert type(optim.optimizer) is type(OPTIMIZERS[kind]([torch.zeros(1)]))
    for step in range(STEPS):
        with optim.optim_context(model):
            loss = model(*batch(step, 0, rank), mode="loss")["loss"]
        optim.update_params(loss)
    return max_diff(full_params(model), one_process(kind, world))


def built_optimizers() -> dict[str, float]:
    return {
        f"{name}/{kind}": train_built_optimizer(name, kind)
        for name in ("model_parallel", "fsdp2")
        for kind in OPTIMIZERS
    }


def test_a_built_optimizer_is_rebuilt_over_the_sharded_parameters(comm_pools: Any) -> None:
    # torch 2.13's AdamW keeps decoupled_weight_decay in its defaults, which its
    # constructor refuses: the rebuild passed every default and raised a TypeError.
    for result in comm_pools.get(2).run(built_optimizers, timeout=120):
        assert set(result) == {f"{n}/{k}" for n in ("model_parallel", "fsdp2") for k in OPTIMIZERS}
        for label, difference in result.items():
            assert difference < TOLERANCE, (label, difference)
