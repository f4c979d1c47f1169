"""DeepSpeed ZeRO 0-3 on CPU/gloo equals DDP with the same torch AdamW, through the step API."""

from __future__ import annotations

from typing import Any

import pytest

from . import cases

EXACT = 1e-6
# bf16: DeepSpeed keeps fp32 master weights, but forward and backward run in bf16.
BF16 = 2e-2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_equals_ddp_with_torch_adamw(comm_run_distributed: Any, stage: int) -> None:
    for result in comm_run_distributed(cases.equivalence, stage, timeout=180):
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT
        assert result["config_untouched"]
        assert result["global_steps"] == 3
        assert result["lr"] == {"lr": [0.01]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_and_clipping_from_the_config(comm_run_distributed: Any, stage: int) -> None:
    for result in comm_run_distributed(cases.equivalence, stage, accum=2, clip=0.05, timeout=180):
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT
        assert result["global_steps"] == 3  # 6 micro-steps, 2 per update


@pytest.mark.parametrize("stage", [1, 3])
def test_config_optimizer_with_torch_adam(comm_run_distributed: Any, stage: int) -> None:
    for result in comm_run_distributed(cases.equivalence, stage, torch_adam=True, timeout=180):
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16(comm_run_distributed: Any, stage: int) -> None:
    for result in comm_run_distributed(cases.equivalence, stage, bf16=True, timeout=180):
        assert result["oracle"] < BF16
        assert result["ddp"] < BF16


def test_zero_grad_optim_context_and_val_step(comm_run_distributed: Any) -> None:
    for result in comm_run_distributed(cases.step_api, timeout=180):
        assert result["boundary_after_first"] is False
        assert result["unchanged_before_boundary"] == 0.0
        assert result["grads_cleared"]
        assert result["prediction"] < EXACT
        assert result["is_wrapper"] == (True, True)
        assert result["unwrapped"]
        assert "pass model=engine to the constructor" in result["unbound"]


def test_inputs_to_half(comm_run_distributed: Any) -> None:
    assert comm_run_distributed(cases.inputs_to_half, timeout=180) == [
        "torch.bfloat16 torch.float32 direct calls finite: True",
        "torch.bfloat16 torch.float32 direct calls finite: True",
    ]


@pytest.mark.parametrize("stage", [0, 3])
def test_real_mmengine_base_model(comm_run_distributed: Any, stage: int) -> None:
    for result in comm_run_distributed(cases.mmengine_base_model, stage, timeout=180):
        assert result["diff"] < EXACT


@pytest.mark.parametrize(("stage", "world"), [(0, 2), (1, 2), (2, 2), (3, 2), (3, 3)])
def test_optimizer_state_round_trip(comm_run_distributed: Any, stage: int, world: int) -> None:
    results = comm_run_distributed(cases.state_round_trip, stage, world_size=world, timeout=180)
    for result in results:
        assert result["restored"] == 0.0
        assert result["replayed"] < EXACT


def test_should_update_and_config_forms(comm_run_distributed: Any, tmp_path: Any) -> None:
    for result in comm_run_distributed(
        cases.boundaries_and_config_forms, str(tmp_path), timeout=180
    ):
        # Accumulation of 2: the second and fourth micro-steps update.
        assert result["updates"] == [False, True, False, True]
        assert "has no optimizer" in result["no_optimizer"]
