"""Every strategy trains like the one-process oracle on 2 gloo ranks (parameters within 1e-6).

Each case prepares the same small model with a strategy, trains it on rank-dependent data
through the strategy's objects, and compares the full parameters with the one-process
oracle of tests.wrappers.net (one process that sees every rank's batches) and with DDP.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    SingleDeviceStrategy,
    available_strategies,
    build_strategy,
)
from comm_strategies.checkpoint import CheckpointError
from comm_wrappers import OptimWrapper, unwrap_model
from tests.helpers import full_params, max_diff
from tests.wrappers.net import batch, make_net, oracle

EXACT = 1e-6
SGD = {"type": "SGD", "lr": 0.1, "momentum": 0.9}


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
            # DeepSpeed: the engine's client optimizer, inside the ZeRO optimizer
            or s.optimizer is getattr(getattr(model, "model", None), "basic_optimizer", None)
            for s in schedulers
        ),
        "lr": optim.get_lr()["lr"][0],
        "unwrapped": type(unwrap_model(model)).__name__,
    }
    return result


def matrix(cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run many `train_with` cases in one call (one spawned world for all of them)."""
    return [train_with(name, **copy.deepcopy(options)) for name, options in cases]


MATRIX: list[tuple[str, dict[str, Any]]] = [
    ("single", {"loop": "update_params"}),  # a plain module has no train_step
    ("ddp", {}),
    ("ddp", {"accum": 2, "clip": 0.05, "loop": "update_params"}),
    ("fsdp", {}),
    ("fsdp", {"form": "built", "accum": 2, "clip": 0.05}),
    ("fsdp2", {}),
    ("fsdp2", {"form": "built", "accum": 2, "clip": 0.05, "loop": "update_params"}),
    ("deepspeed", {"zero_stage": 0}),
    ("deepspeed", {"zero_stage": 1, "form": "built"}),
    ("deepspeed", {"zero_stage": 2, "accum": 2, "clip": 0.05}),
    ("deepspeed", {"zero_stage": 3, "accum": 2, "clip": 0.05, "loop": "update_params"}),
]


def test_every_strategy_equals_the_oracle(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(matrix, MATRIX, timeout=240)
    for rank_results in results:
        for (name, options), result in zip(MATRIX, rank_results):
            label = f"{name} {options}"
            assert result["oracle"] < EXACT, (label, result)
            assert result["config_untouched"], label
            # Built schedulers are kept (MMEngine's FSDP strategy drops them) and follow
            # the optimizer the strategy rebuilt over the sharded parameters.
            assert result["schedulers"] == 1, label
            assert result["scheduler_follows"], label
            assert result["lr"] == pytest.approx(0.1), label
            assert result["unwrapped"] in ("Net", "FSDPNet"), label  # FSDP2 subclasses it


def prepare_twice(name: str) -> str:
    strategy = build_strategy(name, seed=0)
    strategy.prepare(make_net(), optim_wrapper={"optimizer": dict(SGD)})
    try:
        strategy.prepare(make_net())
    except RuntimeError as error:
        return str(error)
    return ""


def test_prepare_twice_says_it_was_called_already(comm_run_distributed: Any) -> None:
    twice = comm_run_distributed(prepare_twice, "fsdp2", timeout=120)
    assert all("prepare was called already" in message for message in twice)


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


def test_setup_env_seeds_every_rank_alike_and_reads_rank_and_world_from_the_group(
    comm_run_distributed: Any,
) -> None:
    facts = comm_run_distributed(setup_env_facts, timeout=60)
    for rank, fact in enumerate(facts):
        assert fact["before"] is None
        assert fact["same_seed"]
        assert fact["same_draw"]
        assert fact["ranked"]
        assert (fact["rank"], fact["world"], fact["distributed"]) == (rank, 2, True)
        assert fact["owns_group"] is False  # the world existed: not ours to destroy


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


def test_deepspeed_config_as_a_json_path_with_overrides_its_own_optimizer_and_bf16(
    comm_run_distributed: Any, tmp_path: Any
) -> None:
    forms = comm_run_distributed(deepspeed_config_forms, str(tmp_path / "ds.json"), timeout=240)
    for form in forms:
        assert form["stage"] == 2  # the keyword wins over the file
        assert form["diff"] < EXACT
        assert form["bf16"] is True
        assert form["bf16_params"] == {"torch.bfloat16"}
        assert form["micro_batch"] == 4
        assert form["plain_loss_finite"] is True
        assert "gradient_accumulation_steps=4" in form["conflict"]
        assert "accumulative_counts is 2" in form["conflict"]


def test_construction_has_no_side_effects_and_keeps_configs(tmp_path: Any) -> None:
    import torch.distributed as torch_dist

    config = {"zero_optimization": {"stage": 1, "overlap_comm": False}, "bf16": {"enabled": False}}
    original = repr(config)
    wrapper = {"auto_wrap_policy": {"type": "size_based_auto_wrap_policy", "min_num_params": 8}}
    work = tmp_path / "work"
    strategies = [
        SingleDeviceStrategy(work_dir=work),
        DDPStrategy(work_dir=work, model_wrapper={"find_unused_parameters": True}),
        FSDPStrategy(work_dir=work, fsdp_version=2, model_wrapper=wrapper),
        DeepSpeedStrategy(work_dir=work, config=config, zero_stage=3, bf16=True),
        build_strategy({"type": "FSDPStrategy", "model_wrapper": wrapper}),
    ]
    assert not torch_dist.is_initialized()
    assert not work.exists()
    assert all(strategy.seed is None for strategy in strategies)
    assert repr(config) == original
    assert wrapper["auto_wrap_policy"]["type"] == "size_based_auto_wrap_policy"
    assert strategies[3].config["zero_optimization"] == {"stage": 3, "overlap_comm": False}
    assert strategies[3].zero_stage == 3


def test_registry_names_and_errors() -> None:
    assert isinstance(build_strategy("single"), SingleDeviceStrategy)
    assert isinstance(build_strategy("DDPStrategy"), DDPStrategy)
    assert build_strategy("fsdp").fsdp_version == 1
    assert build_strategy("fsdp2").name == "fsdp2"
    assert build_strategy("FSDPStrategy", fsdp_version=2).name == "fsdp2"
    assert build_strategy("deepspeed", zero_stage=3).zero_stage == 3
    spec = {"type": "DeepSpeedStrategy", "zero_stage": 2}
    assert build_strategy(spec).zero_stage == 2
    assert spec == {"type": "DeepSpeedStrategy", "zero_stage": 2}
    built = build_strategy("ddp")
    assert build_strategy(built) is built
    with pytest.raises(
        KeyError, match=r"unknown strategy 'fdsp'\. Did you mean 'fsdp'\? Available names: .*fsdp2"
    ):
        build_strategy("fdsp")
    with pytest.raises(ValueError) as unknown:  # a clear type, and a message without quotes
        build_strategy("nope")
    assert type(unknown.value).__name__ == "UnknownStrategyError"
    assert str(unknown.value).startswith("unknown strategy 'nope'. Available names: ")
    assert "register_strategy" in str(unknown.value)
    assert "Did you mean" not in str(unknown.value)
    for near, meant in (
        ("DDP", "'ddp'"),
        ("ddp ", "'ddp'"),
        ("FSDP", "'fsdp'"),
        ("fsdp1", "'fsdp'"),
    ):
        with pytest.raises(ValueError, match=f"Did you mean {meant}"):
            build_strategy(near)
    with pytest.raises(ValueError) as untyped:  # a config without 'type': the same clear error
        build_strategy({"zero_stage": 2})
    assert type(untyped.value).__name__ == "UnknownStrategyError"
    assert str(untyped.value).startswith("a strategy config needs a 'type' key naming")
    assert "deepspeed" in str(untyped.value)
    with pytest.raises(ValueError, match="fsdp_version must be 1 or 2"):
        build_strategy("fsdp", fsdp_version=3)
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        build_strategy("deepspeed", zero_stage=4)
    assert {"single", "ddp", "fsdp", "fsdp2", "deepspeed"} <= set(available_strategies())


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


def test_checkpoints_through_the_strategies(comm_run_distributed: Any, tmp_path: Any) -> None:
    folder = str(tmp_path)
    results = comm_run_distributed(strategy_checkpoints, folder, timeout=240)
    # rank 0's save alone: its timeout= reached the entry exchange
    assert "rank(s) [1] did not enter within 0.5 s" in results[0]["alone"]
    assert results[1]["alone"] == ""
    for result in results:
        assert result["path"] == f"{folder}/work/step_2"  # relative to work_dir
        assert result["extra"] == {"step": 2}
        assert result["after_resume"] == 0.0  # FSDP2's checkpoint resumed under DDP
        assert result["after_step"] < EXACT  # with the optimizer's momentum
        assert result["deepspeed_weights"] == 0.0  # loaded into ZeRO-3
        assert result["fsdp1_state"] == 0.0
        assert result["state_keys"] == [
            "head.bias", "head.weight", "lin1.bias", "lin1.weight", "lin2.bias", "lin2.weight",
        ]  # fmt: skip


def test_resume_latest_under_a_relative_work_dir(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.chdir(tmp_path)  # MMEngine's work dirs are relative: "work_dirs/<config>"
    strategy = build_strategy("single", work_dir="work_dirs/run", seed=0)
    model, _, _ = strategy.prepare(torch.nn.Linear(2, 1))
    saved = strategy.save_checkpoint("step_3", extra={"step": 3})
    assert saved.resolve() == (tmp_path / "work_dirs/run/step_3").resolve()
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    other = build_strategy("single", work_dir="work_dirs/run", seed=1)
    other_model, _, _ = other.prepare(torch.nn.Linear(2, 1))
    assert other.resume() == {"step": 3}  # found by find_latest, not taken twice under work_dir
    for name, value in other_model.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_config_dicts_with_built_optimizers_and_mmengine_scheduler_keys() -> None:
    import torch

    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"type": "OptimWrapper", "optimizer": sgd, "clip_grad": {"max_norm": 1.0}}
    strategy = build_strategy("single")
    prepared, optim, _ = strategy.prepare(model, optim_wrapper=config)
    assert optim.optimizer is sgd  # the caller's optimizer, over the model's parameters
    assert config["clip_grad"] == {"max_norm": 1.0}
    assert config["optimizer"] is sgd
    before = prepared.weight.detach().clone()
    optim.update_params(prepared(torch.ones(1, 2, device=prepared.weight.device)).sum())
    # The gradients (weight [1, 1], bias 1) have norm sqrt(3), clipped to 1, times lr 0.1.
    expected = before - 0.1 / 3**0.5
    assert torch.allclose(prepared.weight.detach(), expected, atol=1e-7, rtol=0)
    with pytest.raises(TypeError, match=r"by_epoch.*MMEngine's parameter schedulers"):
        build_strategy("single").prepare(
            torch.nn.Linear(2, 1),
            optim_wrapper={"optimizer": {"type": torch.optim.SGD, "lr": 0.1}},
            param_scheduler={"type": "MultiStepLR", "milestones": [2], "by_epoch": True},
        )
