"""Functions run on every rank of a real gloo world by the strategies' tests.

Each case prepares the same small model with a strategy, trains it on rank-dependent data
through the strategy's objects, and compares the full parameters with the one-process
oracle of tests.wrappers.cases (one process that sees every rank's batches) and with DDP.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import comm_collectives as dist
from comm_strategies import build_strategy
from comm_strategies.checkpoint import CheckpointError
from comm_wrappers import OptimWrapper, unwrap_model
from tests.wrappers.cases import batch, make_net, max_diff, oracle, params_of

SGD = {"type": "SGD", "lr": 0.1, "momentum": 0.9}


def full_params(model: Any) -> dict[str, torch.Tensor]:
    """Full parameters by name, whatever the strategy wrapped the model in."""
    engine = getattr(model, "model", None)
    if engine is not None and hasattr(engine, "zero_optimization_stage"):
        import deepspeed

        module = engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {n: p.detach().float().clone() for n, p in module.named_parameters()}
    return params_of(model)


def optim_config(accum: int, clip: float | None) -> dict[str, Any]:
    config: dict[str, Any] = {"type": "OptimWrapper", "optimizer": dict(SGD)}
    if accum != 1:
        config["accumulative_counts"] = accum
    if clip is not None:
        config["clip_grad"] = {"type": "norm", "max_norm": clip}
    return config


def train_with(
    name: str,
    *,
    steps: int = 3,
    accum: int = 1,
    clip: float | None = None,
    form: str = "config",
    loop: str = "train_step",
    **options: Any,
) -> dict[str, Any]:
    """Prepare with strategy ``name`` and train; differences to the oracle."""
    strategy = build_strategy(name, seed=0, **options)
    net = make_net()
    config = optim_config(accum, clip)
    original = repr(config)
    schedulers_in: Any = None
    if form == "config":
        optim_in: Any = config
        schedulers_in = {"type": "StepLR", "step_size": 1, "gamma": 1.0}
    elif form == "built":  # a built optimizer and scheduler, before wrapping
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        optim_in = OptimWrapper(
            optimizer,
            accumulative_counts=accum,
            clip_grad=None if clip is None else {"max_norm": clip},
        )
        schedulers_in = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=1.0)]
    else:
        raise ValueError(form)
    model, optim, schedulers = strategy.prepare(
        net, optim_wrapper=optim_in, param_scheduler=schedulers_in
    )
    # Single: every rank trains alone, on the batches the oracle of a world of one sees.
    rank = 0 if name == "single" else dist.get_rank()
    world = 1 if name == "single" else dist.get_world_size()
    device = next(model.parameters()).device  # single puts a plain module on the GPU if any
    for step in range(steps):
        for micro in range(accum):
            data = tuple(t.to(device) for t in batch(step, micro, rank))
            if loop == "train_step":
                model.train_step(data, optim)
            else:  # the user's own loop: forward in the optimizer's context, update_params
                with optim.optim_context(model):
                    loss = model(*data, mode="loss")["loss"]
                optim.update_params(loss)
        for scheduler in schedulers:
            scheduler.step()
    got = full_params(model)
    expected = oracle(steps, accum, world, clip=clip)
    result: dict[str, Any] = {
        "oracle": max_diff(got, expected),
        "config_untouched": repr(config) == original,
        "schedulers": len(schedulers),
        "scheduler_follows": all(
            s.optimizer is getattr(optim.optimizer, "optimizer", optim.optimizer)
            or s.optimizer is strategy._schedule_target(optim)
            for s in schedulers
        ),
        "lr": optim.get_lr()["lr"][0],
        "unwrapped": type(unwrap_model(model)).__name__,
    }
    return result


def matrix(cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run many `train_with` cases in one call (one spawned world for all of them)."""
    return [train_with(name, **copy.deepcopy(options)) for name, options in cases]


def prepare_twice(name: str) -> str:
    strategy = build_strategy(name, seed=0)
    strategy.prepare(make_net(), optim_wrapper={"optimizer": dict(SGD)})
    try:
        strategy.prepare(make_net())
    except RuntimeError as error:
        return str(error)
    return ""


def setup_env_facts() -> dict[str, Any]:
    """Seeding is the same on every rank; rank/world come from the live group."""
    strategy = build_strategy("ddp")
    before = strategy.seed
    strategy.setup_env()
    draw = float(torch.rand(1))
    seeds = dist.all_gather_object(strategy.seed)
    draws = dist.all_gather_object(draw)
    ranked = build_strategy("ddp", seed=7, diff_rank_seed=True)
    ranked.setup_env()
    ranked_draw = float(torch.rand(1))
    torch.manual_seed(7 + dist.get_rank())
    return {
        "before": before,
        "same_seed": len(set(seeds)) == 1,
        "same_draw": len(set(draws)) == 1,
        "ranked": ranked_draw == float(torch.rand(1)),
        "rank": strategy.rank,
        "world": strategy.world_size,
        "distributed": strategy.distributed,
        "owns_group": strategy._owns_group,
    }


def deepspeed_config_forms(path: str) -> dict[str, Any]:
    """A JSON path with keyword overrides, the config's own optimizer, bf16."""
    import json

    base = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.0}
    with open(f"{path}.{dist.get_rank()}", "w") as file:
        json.dump(base, file)
    strategy = build_strategy("deepspeed", config=f"{path}.{dist.get_rank()}", zero_stage=2)
    optim_cfg = {"type": "SGD", "lr": 0.1, "momentum": 0.9}
    model, optim, _ = strategy.prepare(make_net(), optim_wrapper={"optimizer": optim_cfg})
    stage = model.model.zero_optimization_stage()
    for step in range(2):
        model.train_step(batch(step, 0, dist.get_rank()), optim)
    diff = max_diff(full_params(model), oracle(2, 1, dist.get_world_size()))
    own = build_strategy(
        "deepspeed",
        config={
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        },
        zero_stage=3,
        bf16=True,
        inputs_to_half=[0],
    )
    model2, optim2, _ = own.prepare(
        make_net(), dispatch_kwargs={"train_micro_batch_size_per_gpu": 4}
    )
    model2.train_step(batch(0, 0, dist.get_rank()), optim2)
    # A plain loop calls the wrapper itself: inputs_to_half applies there too.
    inputs, targets = batch(1, 0, dist.get_rank())
    plain_loss = model2(inputs, targets, mode="loss")["loss"]
    conflict = build_strategy("deepspeed", gradient_accumulation_steps=4)
    try:
        conflict.prepare(make_net(), optim_wrapper=optim_config(2, None))
    except ValueError as error:
        conflict_message = str(error)
    else:
        conflict_message = ""
    return {
        "stage": stage,
        "diff": diff,
        "bf16": model2.model.bfloat16_enabled(),
        "micro_batch": model2.model.train_micro_batch_size_per_gpu(),
        "bf16_params": {str(p.dtype) for p in model2.model.module.parameters()},
        "conflict": conflict_message,
        "plain_loss_finite": bool(torch.isfinite(plain_loss).item()),
    }


def strategy_checkpoints(folder: str) -> dict[str, Any]:
    """Save through one strategy, resume and load through others (the contract underneath)."""
    work = f"{folder}/work"
    first = build_strategy("fsdp2", seed=0, work_dir=work)
    model, optim, _ = first.prepare(make_net(), optim_wrapper={"optimizer": dict(SGD)})
    for step in range(2):
        model.train_step(batch(step, 0, dist.get_rank()), optim)
    saved = first.save_checkpoint("step_2", extra={"step": 2}, timeout=60)
    alone = ""
    if dist.get_rank() == 0:  # the timeout reaches the checkpoint's entry exchange
        try:
            first.save_checkpoint("alone", timeout=0.5)
        except CheckpointError as error:
            alone = str(error)
    dist.barrier()
    state = first.model_state_dict()
    optim_state = first.optim_state_dict()
    second = build_strategy("ddp", seed=1, work_dir=work)
    model2, optim2, _ = second.prepare(make_net(), optim_wrapper={"optimizer": dict(SGD)})
    extra = second.resume(timeout=60)  # the latest complete checkpoint under work_dir
    after_resume = max_diff(full_params(model2), full_params(model))
    # One more step on both: the optimizer state (momentum) came along.
    model.train_step(batch(2, 0, dist.get_rank()), optim)
    model2.train_step(batch(2, 0, dist.get_rank()), optim2)
    after_step = max_diff(full_params(model2), full_params(model))
    third = build_strategy("deepspeed", zero_stage=3, seed=2)
    model3, _, _ = third.prepare(make_net(), optim_wrapper={"optimizer": dict(SGD)})
    third.load_checkpoint(saved)  # weights only
    weights = max_diff(
        full_params(model3), {k: v for k, v in state.items() if k in full_params(model3)}
    )
    fourth = build_strategy("fsdp", seed=3)
    model4, _, _ = fourth.prepare(make_net(), optim_wrapper={"optimizer": dict(SGD)})
    fourth.load_model_state_dict(state)
    fourth.load_optim_state_dict(optim_state)
    return {
        "path": str(saved),
        "extra": extra,
        "after_resume": after_resume,
        "after_step": after_step,
        "deepspeed_weights": weights,
        "fsdp1_state": max_diff(full_params(model4), {k: state[k] for k in full_params(model4)}),
        "state_keys": sorted(state),
        "alone": alone,
    }
