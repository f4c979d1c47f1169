"""2-D checkpoints in the one contract: save under a mesh, resume under DDP or one process, and back.

Each source trains ``BEFORE`` steps and saves model, AdamW state and an LR scheduler
through the strategy (its natural format: torch distributed checkpoint for the DTensor
model, full files for DDP and one process). Each target is a fresh model from another
seed, resumes it at its own world size and trains ``AFTER`` more steps. The result must
equal one plain-torch process that trained ``BEFORE + AFTER`` steps on the same global
batch without stopping (the batch split evenly between the data-parallel ranks, mean
loss), within 1e-5. A control that loads the weights only does not reach it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from comm_strategies import build_strategy
from comm_wrappers.backends import backend_of
from tests.helpers import full_params, max_diff
from tests.strategies.test_model_parallel import net_plan
from tests.wrappers.net import Net

GLOBAL_BATCH = 8  # split evenly over 1, 2 or 4 data-parallel ranks
BEFORE, AFTER = 2, 2
TOLERANCE = 1e-5
ADAMW = {"type": "AdamW", "lr": 0.01, "weight_decay": 0.01}
SCHEDULER = {"type": "StepLR", "step_size": 2, "gamma": 0.5}

LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dp2xtp2": ("model_parallel", {"tensor_parallel_size": 2, "parallelize_fn": net_plan}),
    "hsdp2x2": ("model_parallel", {"replicate_size": 2, "data_parallel_size": 2}),
    "tp4": ("model_parallel", {"tensor_parallel_size": 4, "parallelize_fn": net_plan}),
    "ddp": ("ddp", {}),
    "fsdp2": ("fsdp2", {}),
    "zero3": ("deepspeed", {"zero_stage": 3}),
    "single": ("single", {}),
}


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(9000 + step)
    inputs = torch.randn(GLOBAL_BATCH, 4, generator=generator)
    return inputs, torch.randn(GLOBAL_BATCH, 2, generator=generator)


def net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def oracle() -> dict[str, torch.Tensor]:
    """One process, plain torch, never stopped."""
    model = net(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(BEFORE + AFTER):
        inputs, targets = global_batch(step)
        model(inputs, targets, mode="loss")["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return full_params(model)


def prepared(layout: str, seed: int) -> tuple[Any, Any, Any, Any]:
    name, options = LAYOUTS[layout]
    strategy = build_strategy(name, seed=0, **options)
    strategy.setup_env()
    ranks = getattr(strategy, "data_parallel_world_size", strategy.world_size)
    model, optim, schedulers = strategy.prepare(
        net(seed),
        optim_wrapper={"optimizer": dict(ADAMW)},
        param_scheduler=dict(SCHEDULER),
        dispatch_kwargs={"train_micro_batch_size_per_gpu": GLOBAL_BATCH // ranks},
    )
    return strategy, model, optim, schedulers


def train(strategy: Any, model: nn.Module, optim: Any, schedulers: Any, steps: range) -> None:
    rank = getattr(strategy, "data_parallel_rank", strategy.rank)
    world = getattr(strategy, "data_parallel_world_size", strategy.world_size)
    if strategy.name == "single":
        rank, world = 0, 1
    size = GLOBAL_BATCH // world
    for step in steps:
        inputs, targets = global_batch(step)
        share = slice(rank * size, (rank + 1) * size)
        with optim.optim_context(model):
            loss = model(inputs[share], targets[share], mode="loss")["loss"]
        optim.update_params(loss)
        for scheduler in schedulers:
            scheduler.step()


def save_sources(root: str, layouts: list[str]) -> dict[str, str]:
    """Train and save each layout (``-full``: in the full format); ``{layout: backend kind}``."""
    out: dict[str, str] = {}
    for source in layouts:
        layout, _, form = source.partition("-")
        strategy, model, optim, schedulers = prepared(layout, seed=0)
        train(strategy, model, optim, schedulers, range(BEFORE))
        sharded = False if form == "full" else None
        strategy.save_checkpoint(f"{root}/{source}", extra={"step": BEFORE}, sharded=sharded)
        out[source] = backend_of(model).kind
    return out


def resume(root: str, cases: list[tuple[str, str]]) -> dict[str, float]:
    """``{"target<-source": max |diff| to the oracle}``, plus a weights-only control."""
    expected = oracle()
    out: dict[str, float] = {}
    for target, source in cases:
        strategy, model, optim, schedulers = prepared(target, seed=123)
        extra = strategy.resume(f"{root}/{source}")
        assert extra == {"step": BEFORE}, extra
        train(strategy, model, optim, schedulers, range(BEFORE, BEFORE + AFTER))
        out[f"{target}<-{source}"] = max_diff(full_params(model), expected)
    target, source = cases[0]
    strategy, model, optim, schedulers = prepared(target, seed=123)
    strategy.load_checkpoint(f"{root}/{source}")  # weights only: no moments, no schedule
    train(strategy, model, optim, schedulers, range(BEFORE, BEFORE + AFTER))
    out["control"] = max_diff(full_params(model), expected)
    return out


@pytest.fixture(scope="module")
def saved(comm_pools: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("mp_ckpt"))
    sources = ["dp2xtp2", "hsdp2x2", "dp2xtp2-full"]
    kinds = comm_pools.get(4).run(save_sources, root, sources, timeout=240)
    assert kinds[0] == dict.fromkeys(sources, "dtensor")
    comm_pools.get(2).run(save_sources, root, ["ddp", "zero3"], timeout=240)
    comm_pools.get(1).run(save_sources, root, ["single"], timeout=120)
    return root


def check(results: list[dict[str, float]]) -> None:
    for rank, result in enumerate(results):
        control = result.pop("control")
        assert control > 1e-3, (rank, control)  # the optimizer state matters
        for case, diff in result.items():
            assert diff < TOLERANCE, (case, rank, diff)


def test_2d_checkpoint_resumes_under_ddp_fsdp2_and_deepspeed_world_2(
    comm_pools: Any, saved: str
) -> None:
    cases = [
        ("ddp", "dp2xtp2"),
        ("ddp", "hsdp2x2"),
        ("ddp", "dp2xtp2-full"),
        ("fsdp2", "dp2xtp2"),
        ("zero3", "dp2xtp2"),
    ]
    check(comm_pools.get(2).run(resume, saved, cases, timeout=240))


def test_2d_checkpoint_resumes_in_one_process(comm_pools: Any, saved: str) -> None:
    check(comm_pools.get(1).run(resume, saved, [("single", "dp2xtp2")], timeout=240))


def test_other_checkpoints_resume_on_a_2d_mesh(comm_pools: Any, saved: str) -> None:
    cases = [
        ("dp2xtp2", "ddp"),
        ("dp2xtp2", "zero3"),
        ("dp2xtp2", "single"),
        ("tp4", "dp2xtp2"),
        ("hsdp2x2", "dp2xtp2"),
        ("tp4", "dp2xtp2-full"),
    ]
    check(comm_pools.get(4).run(resume, saved, cases, timeout=240))


def test_2d_manifest_describes_the_mesh(saved: str) -> None:
    import json

    manifest = json.loads((Path(saved) / "dp2xtp2" / "manifest.json").read_text())
    assert manifest["strategy"] == "model_parallel"
    assert manifest["world_size"] == 4
    assert manifest["wrapper"] == "dtensor"
    assert "tensor_parallel=2" in manifest["sharding"]
    full = json.loads((Path(saved) / "dp2xtp2-full" / "manifest.json").read_text())
    assert (manifest["format"], full["format"]) == ("dcp", "full")
