"""Every wrapper trained on real gloo worlds equals the oracle: one process on the whole batch.

The oracle (``cases.oracle``) is plain torch with no distributed code. DDP must equal it
(within float32 rounding of a different summation order); FSDP1 and FSDP2 must equal both
the oracle and DDP trained the same way in the same world.
"""

from __future__ import annotations

from typing import Any

import pytest

from . import cases

# float32 rounding: the distributed sum adds the ranks' gradients in another order.
EXACT = 1e-6
# bf16 autocast: the wrapper and the oracle run the same bf16 ops; DDP averages gradients
# in float32 where the oracle differentiates one big batch.
BF16 = 1e-3

FSDP1_STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_equals_one_process_on_the_concatenated_batch(
    comm_run_distributed: Any, world: int
) -> None:
    for result in comm_run_distributed(cases.equivalence, "ddp", world_size=world):
        assert result["oracle"] < EXACT


def test_ddp_accumulation_syncs_only_on_the_last_micro_step(comm_run_distributed: Any) -> None:
    for result in comm_run_distributed(cases.ddp_sync_counts, accum=4):
        # One bucket for this small model: one all-reduce per update, none on micro-steps.
        assert result["per_micro"] == [0, 0, 0, 1, 0, 0, 0, 1]
        # Four micro-steps of 4 samples a rank == one step on the 4 x world-sample batch.
        assert result["diff"] < EXACT


def test_ddp_accumulation_adamw_and_clipping_equal_the_oracle(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(cases.equivalence, "ddp", accum=4, clip=0.05, optimizer="adamw")
    for result in results:
        assert result["oracle"] < EXACT
        assert result["grad_norm"] > 0.05  # clipping was active
    assert len({r["grad_norm"] for r in results}) == 1


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("strategy", FSDP1_STRATEGIES)
def test_fsdp1_equals_ddp(
    comm_run_distributed: Any, strategy: str, offload: bool, world: int
) -> None:
    results = comm_run_distributed(
        cases.equivalence,
        "fsdp",
        sharding_strategy=strategy,
        cpu_offload=offload,
        world_size=world,
    )
    for result in results:
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("offload", [False, True])
def test_fsdp2_equals_ddp(comm_run_distributed: Any, offload: bool, world: int) -> None:
    results = comm_run_distributed(
        cases.equivalence, "fsdp2", cpu_offload=offload, world_size=world
    )
    for result in results:
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("fsdp", {}),
        (
            "fsdp",
            {"auto_wrap_policy": {"type": "size_based_auto_wrap_policy", "min_num_params": 20}},
        ),
        ("fsdp2", {}),
        ("fsdp2", {"auto_wrap_policy": ["Linear"]}),
    ],
)
def test_clipping_by_norm_under_fsdp_equals_ddp(
    comm_run_distributed: Any, kind: str, options: dict[str, Any]
) -> None:
    results = comm_run_distributed(cases.equivalence, kind, clip=0.05, world_size=3, **options)
    ddp = comm_run_distributed(cases.equivalence, "ddp", clip=0.05, world_size=3)
    for result in results:
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT
        # The whole model's norm, not a shard's: the same on every rank and as under DDP.
        assert result["grad_norm"] == pytest.approx(ddp[0]["grad_norm"], rel=1e-6)
        assert result["grad_norm"] > 0.05


@pytest.mark.parametrize("kind", ["fsdp", "fsdp2"])
def test_fsdp_accumulation_equals_the_oracle(comm_run_distributed: Any, kind: str) -> None:
    for result in comm_run_distributed(cases.equivalence, kind, accum=3, optimizer="adamw"):
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp2"])
def test_bf16_autocast_on_cpu(comm_run_distributed: Any, kind: str) -> None:
    for result in comm_run_distributed(cases.equivalence, kind, amp="bfloat16"):
        assert result["oracle"] < BF16
        if kind != "ddp":
            assert result["ddp"] < EXACT


@pytest.mark.parametrize("kind", ["fsdp", "fsdp2"])
def test_val_and_test_step_run_through_the_sharded_forward(
    comm_run_distributed: Any, kind: str
) -> None:
    for diff in comm_run_distributed(cases.fsdp_val_test_steps, kind, world_size=3):
        assert diff < EXACT


def test_separate_ddp_gan_with_two_optimizers_and_accumulation(comm_run_distributed: Any) -> None:
    for result in comm_run_distributed(cases.separate_ddp_gan, accum=2):
        assert result["wrapped"] == {
            "generator": "MMDistributedDataParallel",
            "discriminator": "MMDistributedDataParallel",
            "activation": "Tanh",
        }
        assert result["diff"] < EXACT
        assert result["eval_propagates"]


def test_separate_ddp_no_sync_skips_every_child(comm_run_distributed: Any) -> None:
    # Inside no_sync() the gradients stay rank-local: they differ across ranks.
    assert comm_run_distributed(cases.separate_ddp_no_sync_skips_every_child) == [[True], [True]]


def test_separate_ddp_leaves_the_module_as_it_was_when_wrapping_fails(
    comm_run_distributed: Any,
) -> None:
    for result in comm_run_distributed(cases.separate_ddp_failure_leaves_module_intact):
        assert result["raised"] is not None
        assert result["after"] == result["before"] == {"first": "Linear", "second": "Linear"}


@pytest.mark.parametrize("optim", ["mmengine", "ours"])
@pytest.mark.parametrize("kind", ["ddp", "separate", "fsdp", "fsdp2"])
def test_real_mmengine_base_model(comm_run_distributed: Any, kind: str, optim: str) -> None:
    for result in comm_run_distributed(cases.mmengine_interop, kind, optim):
        assert result["diff"] < EXACT
        assert result["prediction"] < EXACT
