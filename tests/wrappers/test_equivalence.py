"""Every wrapper trained on real gloo worlds equals the oracle: one process on the whole batch.

The oracle (``net.oracle``) is plain torch with no distributed code. DDP must equal it
(within float32 rounding of a different summation order); FSDP1 and FSDP2 must equal both
the oracle and DDP trained the same way in the same world.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import comm_collectives as dist
from comm_wrappers import (
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    MMSeparateDistributedDataParallel,
    OptimWrapper,
    OptimWrapperDict,
)
from tests.helpers import full_params, max_diff

from .net import (
    Gan,
    Net,
    batch,
    gan_batch,
    global_batch,
    make_net,
    make_optimizer,
    mmengine_model,
    oracle,
    train,
    wrap,
)

# float32 rounding: the distributed sum adds the ranks' gradients in another order.
EXACT = 1e-6
# bf16 autocast: the wrapper and the oracle run the same bf16 ops; DDP averages gradients
# in float32 where the oracle differentiates one big batch.
BF16 = 1e-3

FSDP1_STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def equivalence(
    kind: str,
    steps: int = 3,
    accum: int = 1,
    clip: float | None = None,
    optimizer: str = "sgd",
    amp: str | None = None,
    **options: Any,
) -> dict[str, float]:
    """Train a wrapped model; its difference to the oracle and to DDP trained the same way."""
    world = dist.get_world_size()
    dtype = getattr(torch, amp) if amp else None
    model = wrap(kind, **options)
    optim = train(
        model, steps, accum, clip=clip, optimizer=optimizer, amp=dtype, use_fsdp=kind != "ddp"
    )
    got = full_params(model)
    expected = oracle(steps, accum, world, clip=clip, optimizer=optimizer, dtype=dtype)
    result = {"oracle": max_diff(got, expected)}
    if kind != "ddp":
        reference = wrap("ddp")
        train(reference, steps, accum, clip=clip, optimizer=optimizer, amp=dtype)
        result["ddp"] = max_diff(got, full_params(reference))
    if clip is not None:
        result["grad_norm"] = float(optim.grad_norm)  # type: ignore[arg-type]
    return result


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_equals_one_process_on_the_concatenated_batch(
    comm_run_distributed: Any, world: int
) -> None:
    for result in comm_run_distributed(equivalence, "ddp", world_size=world):
        assert result["oracle"] < EXACT


def ddp_sync_counts(accum: int = 4) -> dict[str, Any]:
    """All-reduce calls per micro-step under accumulation, and the result against the oracle."""
    model = wrap("ddp")
    calls: list[int] = []

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def] # DDP checks the annotations
        calls.append(1)
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    model.register_comm_hook(None, counting_hook)  # type: ignore[operator]
    wrapper = OptimWrapper(make_optimizer(model.parameters(), "sgd"), accumulative_counts=accum)
    per_micro = []
    for step in range(2):
        for micro in range(accum):
            before = len(calls)
            model.train_step(batch(step, micro, dist.get_rank()), wrapper)  # type: ignore[operator]
            per_micro.append(len(calls) - before)
    # One update over the big batch: every rank's 4 micro-batches at once.
    big = make_net()
    optim = make_optimizer(big.parameters(), "sgd")
    world = dist.get_world_size()
    for step in range(2):
        parts = [global_batch(step, micro, world) for micro in range(accum)]
        inputs = torch.cat([p[0] for p in parts])
        targets = torch.cat([p[1] for p in parts])
        big(inputs, targets, mode="loss")["loss"].backward()
        optim.step()
        optim.zero_grad()
    return {"per_micro": per_micro, "diff": max_diff(full_params(model), full_params(big))}


def test_ddp_accumulation_syncs_only_on_the_last_micro_step(comm_run_distributed: Any) -> None:
    for result in comm_run_distributed(ddp_sync_counts, accum=4):
        # One bucket for this small model: one all-reduce per update, none on micro-steps.
        assert result["per_micro"] == [0, 0, 0, 1, 0, 0, 0, 1]
        # Four micro-steps of 4 samples a rank == one step on the 4 x world-sample batch.
        assert result["diff"] < EXACT


def test_ddp_accumulation_adamw_and_clipping_equal_the_oracle(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(equivalence, "ddp", accum=4, clip=0.05, optimizer="adamw")
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
        equivalence,
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
    results = comm_run_distributed(equivalence, "fsdp2", cpu_offload=offload, world_size=world)
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
    results = comm_run_distributed(equivalence, kind, clip=0.05, world_size=3, **options)
    ddp = comm_run_distributed(equivalence, "ddp", clip=0.05, world_size=3)
    for result in results:
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT
        # The whole model's norm, not a shard's: the same on every rank and as under DDP.
        assert result["grad_norm"] == pytest.approx(ddp[0]["grad_norm"], rel=1e-6)
        assert result["grad_norm"] > 0.05


@pytest.mark.parametrize("kind", ["fsdp", "fsdp2"])
def test_fsdp_accumulation_equals_the_oracle(comm_run_distributed: Any, kind: str) -> None:
    for result in comm_run_distributed(equivalence, kind, accum=3, optimizer="adamw"):
        assert result["oracle"] < EXACT
        assert result["ddp"] < EXACT


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp2"])
def test_bf16_autocast_on_cpu(comm_run_distributed: Any, kind: str) -> None:
    for result in comm_run_distributed(equivalence, kind, amp="bfloat16"):
        assert result["oracle"] < BF16
        if kind != "ddp":
            assert result["ddp"] < EXACT


def fsdp_val_test_steps(kind: str) -> float:
    """val_step and test_step through the sharded forward equal the full model's output."""
    model = wrap(kind)
    inputs, targets = batch(0, 0, dist.get_rank())
    with torch.no_grad():
        expected = make_net()(inputs)
    got_val = model.val_step((inputs, targets))  # type: ignore[operator]
    got_test = model.test_step({"inputs": inputs})  # type: ignore[operator]
    return max(float((got_val - expected).abs().max()), float((got_test - expected).abs().max()))


@pytest.mark.parametrize("kind", ["fsdp", "fsdp2"])
def test_val_and_test_step_run_through_the_sharded_forward(
    comm_run_distributed: Any, kind: str
) -> None:
    for diff in comm_run_distributed(fsdp_val_test_steps, kind, world_size=3):
        assert diff < EXACT


def separate_ddp_gan(accum: int = 2, steps: int = 2) -> dict[str, Any]:
    """A two-optimizer GAN under separate DDP with accumulation, against one process."""
    gan = Gan()
    model = MMSeparateDistributedDataParallel(gan)
    wrapped = {n: type(c).__name__ for n, c in gan.named_children()}
    wrappers = OptimWrapperDict(
        generator=OptimWrapper(
            torch.optim.SGD(gan.generator.parameters(), lr=0.1), accumulative_counts=accum
        ),
        discriminator=OptimWrapper(
            torch.optim.SGD(gan.discriminator.parameters(), lr=0.05), accumulative_counts=accum
        ),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        for micro in range(accum):
            with model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                model.train_step(gan_batch(step, micro, rank), wrappers)
    # The oracle: the same updates, one process, every rank's batches at once.
    ref = Gan()
    g_opt = torch.optim.SGD(ref.generator.parameters(), lr=0.1)
    d_opt = torch.optim.SGD(ref.discriminator.parameters(), lr=0.05)
    for step in range(steps):
        for micro in range(accum):
            parts = [gan_batch(step, micro, r) for r in range(world)]
            noise = torch.cat([p[0] for p in parts])
            real = torch.cat([p[1] for p in parts])
            with torch.no_grad():
                fake = ref.activation(ref.generator(noise))
            d_loss = ref.discriminator(fake).mean() - ref.discriminator(real).mean()
            (d_loss / accum).backward()
            if micro == accum - 1:
                d_opt.step()
                d_opt.zero_grad()
            ref.discriminator.requires_grad_(False)
            g_loss = -ref.discriminator(ref.activation(ref.generator(noise))).mean()
            (g_loss / accum).backward()
            ref.discriminator.requires_grad_(True)
            if micro == accum - 1:
                g_opt.step()
                g_opt.zero_grad()
    got = full_params(gan)  # generator.module.weight -> generator.weight
    expected = {n: p.detach() for n, p in ref.named_parameters()}
    model.train(False)
    modes = [m.training for m in gan.modules()]
    return {
        "wrapped": wrapped,
        "diff": max_diff(got, expected),
        "eval_propagates": not any(modes),
    }


def test_separate_ddp_gan_with_two_optimizers_and_accumulation(comm_run_distributed: Any) -> None:
    for result in comm_run_distributed(separate_ddp_gan, accum=2):
        assert result["wrapped"] == {
            "generator": "MMDistributedDataParallel",
            "discriminator": "MMDistributedDataParallel",
            "activation": "Tanh",
        }
        assert result["diff"] < EXACT
        assert result["eval_propagates"]


def separate_ddp_no_sync_skips_every_child() -> list[bool]:
    """Inside no_sync() no child all-reduces: gradients stay rank-local."""
    gan = Gan()
    model = MMSeparateDistributedDataParallel(gan)
    rank = dist.get_rank()
    with model.no_sync():
        g, d = gan.losses(*gan_batch(0, 0, rank))
        (g + d).backward()
    local = [p.grad.clone() for p in gan.parameters()]  # type: ignore[union-attr]
    gathered = dist.all_gather(torch.cat([t.flatten() for t in local]))
    return [not torch.equal(gathered[0], gathered[r]) for r in range(1, len(gathered))]


def test_separate_ddp_no_sync_skips_every_child(comm_run_distributed: Any) -> None:
    # Inside no_sync() the gradients stay rank-local: they differ across ranks.
    assert comm_run_distributed(separate_ddp_no_sync_skips_every_child) == [[True], [True]]


class Broken(nn.Module):
    """Its second child cannot be wrapped (a parameter on a device DDP refuses: meta)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.second = nn.Linear(2, 2, device="meta")


def separate_ddp_failure_leaves_module_intact() -> dict[str, Any]:
    model = Broken()
    before = {n: type(c).__name__ for n, c in model.named_children()}
    try:
        MMSeparateDistributedDataParallel(model)
    except Exception as error:  # what DDP raises for a meta module is torch's business
        raised = type(error).__name__
    else:
        raised = None
    after = {n: type(c).__name__ for n, c in model.named_children()}
    return {"raised": raised, "before": before, "after": after}


def test_separate_ddp_leaves_the_module_as_it_was_when_wrapping_fails(
    comm_run_distributed: Any,
) -> None:
    for result in comm_run_distributed(separate_ddp_failure_leaves_module_intact):
        assert result["raised"] is not None
        assert result["after"] == result["before"] == {"first": "Linear", "second": "Linear"}


def mmengine_interop(kind: str, optim_kind: str) -> dict[str, float]:
    """A real mmengine BaseModel subclass with MMEngine's OptimWrapper or ours."""
    from mmengine.optim import OptimWrapper as MMOptimWrapper

    model = mmengine_model()
    if kind == "separate":
        # BaseModel's own train_step runs; its child is a DDP of its own.
        wrapped = MMSeparateDistributedDataParallel(model)
    elif kind == "ddp":
        wrapped: nn.Module = MMDistributedDataParallel(model)
    elif kind == "fsdp":
        wrapped = MMFullyShardedDataParallel(model)
    else:
        wrapped = MMFullyShardedDataParallel2(model)
    optim = make_optimizer(wrapped.parameters(), "sgd")
    wrapper: Any = (
        MMOptimWrapper(optim, accumulative_counts=2)
        if optim_kind == "mmengine"
        else OptimWrapper(optim, accumulative_counts=2)
    )
    rank = dist.get_rank()
    for step in range(2):
        for micro in range(2):
            inputs, targets = batch(step, micro, rank)
            wrapped.train_step({"inputs": inputs, "data_samples": targets}, wrapper)  # type: ignore[operator]
    got = {k.removeprefix("net."): v for k, v in full_params(wrapped).items()}
    inputs, _ = batch(0, 0, rank)
    predicted = wrapped.val_step({"inputs": inputs})  # type: ignore[operator]
    ref = Net()
    ref.load_state_dict(oracle(2, 2, dist.get_world_size()))
    with torch.no_grad():
        expected_prediction = ref(inputs)
    return {
        "diff": max_diff(got, oracle(2, 2, dist.get_world_size())),
        "prediction": float((predicted - expected_prediction).abs().max()),
    }


@pytest.mark.parametrize("optim", ["mmengine", "ours"])
@pytest.mark.parametrize("kind", ["ddp", "separate", "fsdp", "fsdp2"])
def test_real_mmengine_base_model(comm_run_distributed: Any, kind: str, optim: str) -> None:
    for result in comm_run_distributed(mmengine_interop, kind, optim):
        assert result["diff"] < EXACT
        assert result["prediction"] < EXACT
