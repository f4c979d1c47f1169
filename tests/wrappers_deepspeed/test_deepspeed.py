"""DeepSpeed ZeRO 0-3 on CPU/gloo equals DDP with the same torch AdamW, through the step API.

Each case trains through ``comm_wrappers.deepspeed`` and compares the full parameters with
the one-process oracle and with DDP trained the same way (``tests.wrappers.net``).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_wrappers import OptimWrapper, is_model_wrapper, unwrap_model
from comm_wrappers.deepspeed import DeepSpeedOptimWrapper, initialize
from tests.helpers import full_params, max_diff
from tests.wrappers.net import (
    BATCH,
    batch,
    make_net,
    make_optimizer,
    mmengine_model,
    oracle,
    train,
    wrap,
)

EXACT = 1e-6
# bf16: DeepSpeed keeps fp32 master weights, but forward and backward run in bf16.
BF16 = 2e-2


def ds_config(
    stage: int, accum: int, clip: float | None, bf16: bool, torch_adam: bool
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": accum,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
    }
    if clip is not None:
        config["gradient_clipping"] = clip
    if torch_adam:
        # The config's optimizer, with torch's implementation: no C++ build.
        params = {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}
        config["optimizer"] = {"type": "AdamW", "params": params}
    return config


def equivalence(
    stage: int,
    steps: int = 3,
    accum: int = 1,
    clip: float | None = None,
    bf16: bool = False,
    torch_adam: bool = False,
) -> dict[str, Any]:
    """Train under ZeRO ``stage``; differences to the oracle and to DDP with torch AdamW."""
    model = make_net()
    optimizer = None if torch_adam else make_optimizer(model.parameters(), "adamw")
    config = ds_config(stage, accum, clip, bf16, torch_adam)
    original = repr(config)
    # A bf16 engine runs the model in bf16: its float inputs must be cast too.
    wrapper, optim = initialize(model, config, optimizer, inputs_to_half=[0] if bf16 else None)
    rank = dist.get_rank()
    boundaries = []
    for step in range(steps):
        for micro in range(accum):
            log_vars = wrapper.train_step(batch(step, micro, rank), optim)
            assert list(log_vars) == ["loss", "mean_out"], list(log_vars)
            boundaries.append(optim.should_update())
    got = full_params(wrapper)
    expected = oracle(steps, accum, dist.get_world_size(), clip=clip, optimizer="adamw")
    reference = wrap("ddp")
    train(reference, steps, accum, clip=clip, optimizer="adamw")
    return {
        "oracle": max_diff(got, expected),
        "ddp": max_diff(got, full_params(reference)),
        "config_untouched": repr(config) == original,
        "global_steps": wrapper.global_steps,  # looked up on the engine
        "lr": optim.get_lr(),
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_equals_ddp_with_torch_adamw(comm_run_distributed: Any, stage: int) -> None:
    for result in comm_run_distributed(equivalence, stage, timeout=180):
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT
        assert result["config_untouched"]
        assert result["global_steps"] == 3
        assert result["lr"] == {"lr": [0.01]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_and_clipping_from_the_config(comm_run_distributed: Any, stage: int) -> None:
    for result in comm_run_distributed(equivalence, stage, accum=2, clip=0.05, timeout=180):
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT
        assert result["global_steps"] == 3  # 6 micro-steps, 2 per update


@pytest.mark.parametrize("stage", [1, 3])
def test_config_optimizer_with_torch_adam(comm_run_distributed: Any, stage: int) -> None:
    for result in comm_run_distributed(equivalence, stage, torch_adam=True, timeout=180):
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16(comm_run_distributed: Any, stage: int) -> None:
    for result in comm_run_distributed(equivalence, stage, bf16=True, timeout=180):
        assert result["oracle"] < BF16
        assert result["ddp"] < BF16


def step_api() -> dict[str, Any]:
    """zero_grad, optim_context, val_step, the registry and the boundary flag on an engine."""
    model = make_net()
    optimizer = make_optimizer(model.parameters(), "adamw")
    wrapper, optim = initialize(model, ds_config(2, 2, None, False, False), optimizer)
    inputs, targets = batch(0, 0, dist.get_rank())
    with optim.optim_context(wrapper):
        loss = wrapper(inputs, targets, mode="loss")["loss"]
    optim.backward(loss)
    # Not a boundary after 1 of 2 micro-steps: the engine's step does not update yet.
    boundary_after_first = optim.should_update()
    before = full_params(wrapper)
    optim.step()
    unchanged = max_diff(before, full_params(wrapper))
    optim.zero_grad()
    grads_cleared = all(
        p.grad is None or not bool(p.grad.any()) for p in wrapper.model.module.parameters()
    )
    with torch.no_grad():
        expected = make_net()(inputs)
    predicted = wrapper.val_step((inputs, targets))
    plain = DeepSpeedOptimWrapper(optimizer)
    try:
        plain.step()
    except RuntimeError as error:
        unbound = str(error)
    else:
        unbound = ""
    return {
        "boundary_after_first": boundary_after_first,
        "unchanged_before_boundary": unchanged,
        "grads_cleared": grads_cleared,
        "prediction": float((predicted - expected).abs().max()),
        "is_wrapper": (is_model_wrapper(wrapper), is_model_wrapper(wrapper.model)),
        "unwrapped": unwrap_model(wrapper) is model,
        "unbound": unbound,
        "not_ours": isinstance(optim, OptimWrapper),
    }


def test_zero_grad_optim_context_and_val_step(comm_run_distributed: Any) -> None:
    for result in comm_run_distributed(step_api, timeout=180):
        assert result["boundary_after_first"] is False
        assert result["unchanged_before_boundary"] == 0.0
        assert result["grads_cleared"]
        assert result["prediction"] < EXACT
        assert result["is_wrapper"] == (True, True)
        assert result["unwrapped"]
        assert "pass model=engine to the constructor" in result["unbound"]


def inputs_to_half() -> str:
    """bf16 engines get the named inputs cast to bf16."""
    model = make_net()
    config = ds_config(0, 1, None, True, False)
    wrapper, _ = initialize(
        model, config, make_optimizer(model.parameters(), "adamw"), inputs_to_half=[0]
    )
    cast = wrapper._cast_inputs_half(batch(0, 0, 0))
    # A plain loop calls the wrapper itself: the same cast, by position or by keyword.
    inputs, targets = batch(0, 0, 0)
    by_position = wrapper(inputs, targets, mode="loss")["loss"]
    other = make_net()
    keyed, _ = initialize(
        other, config, make_optimizer(other.parameters(), "adamw"), inputs_to_half=["inputs"]
    )
    by_name = keyed(inputs=inputs, targets=targets, mode="loss")["loss"]
    finite = all(bool(torch.isfinite(loss)) for loss in (by_position, by_name))
    return f"{cast[0].dtype} {cast[1].dtype} direct calls finite: {finite}"


def test_inputs_to_half(comm_run_distributed: Any) -> None:
    assert comm_run_distributed(inputs_to_half, timeout=180) == [
        "torch.bfloat16 torch.float32 direct calls finite: True",
        "torch.bfloat16 torch.float32 direct calls finite: True",
    ]


def mmengine_base_model(stage: int) -> dict[str, float]:
    """A real mmengine BaseModel through the DeepSpeed wrapper, with accumulation."""
    model = mmengine_model()
    optimizer = make_optimizer(model.parameters(), "adamw")
    wrapper, optim = initialize(model, ds_config(stage, 2, None, False, False), optimizer)
    rank = dist.get_rank()
    for step in range(2):
        for micro in range(2):
            inputs, targets = batch(step, micro, rank)
            wrapper.train_step({"inputs": inputs, "data_samples": targets}, optim)
    got = {k.removeprefix("net."): v for k, v in full_params(wrapper).items()}
    expected = oracle(2, 2, dist.get_world_size(), optimizer="adamw")
    return {"diff": max_diff(got, expected)}


@pytest.mark.parametrize("stage", [0, 3])
def test_real_mmengine_base_model(comm_run_distributed: Any, stage: int) -> None:
    for result in comm_run_distributed(mmengine_base_model, stage, timeout=180):
        assert result["diff"] < EXACT


def state_round_trip(stage: int) -> dict[str, Any]:
    """Save the optimizer state after 2 steps, step once, load, step again: same parameters."""
    model = make_net()
    optimizer = make_optimizer(model.parameters(), "adamw")
    wrapper, optim = initialize(model, ds_config(stage, 1, None, False, False), optimizer)
    rank = dist.get_rank()
    for step in range(2):
        wrapper.train_step(batch(step, 0, rank), optim)
    # Through bytes, as a checkpoint file would take it.
    buffer = io.BytesIO()
    torch.save(optim.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    saved_params = full_params(wrapper)
    wrapper.train_step(batch(2, 0, rank), optim)
    first = full_params(wrapper)
    optim.load_state_dict(saved)
    if stage == 0:  # no fp32 partition in the state: restore the module's parameters
        with torch.no_grad():
            for name, param in wrapper.model.module.named_parameters():
                param.copy_(saved_params[name])
    restored = max_diff(full_params(wrapper), saved_params)
    wrapper.train_step(batch(2, 0, rank), optim)
    return {"restored": restored, "replayed": max_diff(full_params(wrapper), first)}


@pytest.mark.parametrize(("stage", "world"), [(0, 2), (1, 2), (2, 2), (3, 2), (3, 3)])
def test_optimizer_state_round_trip(comm_run_distributed: Any, stage: int, world: int) -> None:
    results = comm_run_distributed(state_round_trip, stage, world_size=world, timeout=180)
    for result in results:
        assert result["restored"] == 0.0
        assert result["replayed"] < EXACT


def boundaries_and_config_forms(tmp: str) -> dict[str, Any]:
    """should_update after each micro-step; a JSON path config; an engine without optimizer."""
    import json

    model = make_net()
    path = f"{tmp}/ds_config_{dist.get_rank()}.json"
    with open(path, "w") as file:
        json.dump(ds_config(1, 2, None, False, False), file)
    wrapper, optim = initialize(model, path, make_optimizer(model.parameters(), "adamw"))
    updates = []
    for micro in range(4):
        wrapper.train_step(batch(0, micro, dist.get_rank()), optim)
        updates.append(optim.should_update())
    _, bare_optim = initialize(make_net(), {"zero_optimization": {"stage": 0}})
    try:
        bare_optim.get_lr()
    except RuntimeError as error:
        no_optimizer = str(error)
    else:
        no_optimizer = ""
    return {"updates": updates, "no_optimizer": no_optimizer}


def test_should_update_and_config_forms(comm_run_distributed: Any, tmp_path: Any) -> None:
    for result in comm_run_distributed(boundaries_and_config_forms, str(tmp_path), timeout=180):
        # Accumulation of 2: the second and fourth micro-steps update.
        assert result["updates"] == [False, True, False, True]
        assert "has no optimizer" in result["no_optimizer"]
