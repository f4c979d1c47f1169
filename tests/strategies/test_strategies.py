"""Every strategy trains like the one-process oracle on 2 gloo ranks (parameters within 1e-6)."""

from __future__ import annotations

from typing import Any

import pytest

from comm_strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    SingleDeviceStrategy,
    available_strategies,
    build_strategy,
)

from . import cases

EXACT = 1e-6

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
    results = comm_run_distributed(cases.matrix, MATRIX, timeout=240)
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


def test_prepare_twice_setup_env_and_deepspeed_forms(
    comm_run_distributed: Any, tmp_path: Any
) -> None:
    twice = comm_run_distributed(cases.prepare_twice, "fsdp2", timeout=120)
    assert all("prepare was called already" in message for message in twice)
    facts = comm_run_distributed(cases.setup_env_facts, timeout=60)
    for rank, fact in enumerate(facts):
        assert fact["before"] is None
        assert fact["same_seed"]
        assert fact["same_draw"]
        assert fact["ranked"]
        assert (fact["rank"], fact["world"], fact["distributed"]) == (rank, 2, True)
        assert fact["owns_group"] is False  # the world existed: not ours to destroy
    forms = comm_run_distributed(
        cases.deepspeed_config_forms, str(tmp_path / "ds.json"), timeout=240
    )
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
    with pytest.raises(KeyError, match=r"unknown strategy 'fdsp'\. Available names: .*fsdp2"):
        build_strategy("fdsp")
    with pytest.raises(ValueError, match="fsdp_version must be 1 or 2"):
        build_strategy("fsdp", fsdp_version=3)
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        build_strategy("deepspeed", zero_stage=4)
    assert {"single", "ddp", "fsdp", "fsdp2", "deepspeed"} <= set(available_strategies())


def test_checkpoints_through_the_strategies(comm_run_distributed: Any, tmp_path: Any) -> None:
    folder = str(tmp_path)
    results = comm_run_distributed(cases.strategy_checkpoints, folder, timeout=240)
    # rank 0's save alone: its timeout= reached the entry exchange
    assert "rank(s) [1] did not reach 'enter' within 0.5 s" in results[0]["alone"]
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
