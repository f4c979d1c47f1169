"""`ModelParallelStrategy` on 4 gloo ranks: tensor parallel + FSDP2, HSDP, tensor parallel alone.

Every case prepares the wrappers' test net (tests.wrappers.net) with a mesh layout, trains
it with AdamW, clipping by norm and accumulation 2 on batches that depend on the rank's
data-parallel coordinates only (tensor-parallel ranks of one group see the same batch),
and compares the full parameters with one plain-torch process that sees every
data-parallel rank's batches (within 1e-5). The bad-input cases check that every rank
raises the same clear error, and the pool's ranks stay usable after it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import comm_collectives as dist
from comm_strategies import ModelParallelStrategy, build_strategy
from comm_strategies.model_parallel import mesh_shape
from comm_wrappers.backends import backend_of
from tests.helpers import full_params, max_diff
from tests.wrappers.net import batch, make_net, oracle

TOLERANCE = 1e-5
STEPS, ACCUM, CLIP = 3, 2, 0.5
ADAMW = {"type": "AdamW", "lr": 0.01, "weight_decay": 0.01}


def net_plan(model: nn.Module, mesh: Any) -> None:
    """The test net's plan: ``lin1`` split by columns, ``lin2`` by rows, ``head`` whole."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = mesh["tensor_parallel"]
    if tp.size() > 1:
        parallelize_module(model, tp, {"lin1": ColwiseParallel(), "lin2": RowwiseParallel()})


def bad_plan(model: nn.Module, mesh: Any) -> None:
    """Splits ``head`` (2 outputs) over 4 tensor-parallel ranks: 4 does not divide 2."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_module(model, mesh["tensor_parallel"], {"head": ColwiseParallel()})


def plan_and_shard(model: nn.Module, mesh: Any) -> None:
    """The plan, then ``fully_shard`` of the root by the function itself."""
    from torch.distributed.fsdp import fully_shard

    net_plan(model, mesh)
    fully_shard(model, mesh=mesh["data_parallel"])


def plan_failing_on_rank_2(model: nn.Module, mesh: Any) -> None:
    """Fails on rank 2 only; the others apply a plan that makes no collectives.

    (``src_data_rank=None``: every rank slices its own copy of the weights. torch's default
    scatters them from the first rank of the mesh, and there a rank that failed before the
    scatter leaves its peers waiting in it until the process group's timeout.)
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if dist.get_rank() == 2:
        message = "rank 2's plan names a layer this model lacks"
        raise KeyError(message)
    plan = {"lin1": ColwiseParallel(), "lin2": RowwiseParallel()}
    parallelize_module(model, mesh["tensor_parallel"], plan, src_data_rank=None)


def train_case(options: dict[str, Any], loop: str) -> dict[str, Any]:
    """Prepare with ``options``, train ``STEPS`` x ``ACCUM`` micro-steps; differences."""
    options = {"parallelize_fn": net_plan, **options}
    strategy = build_strategy("model_parallel", seed=0, **options)
    optim_config = {
        "type": "OptimWrapper",
        "optimizer": dict(ADAMW),
        "accumulative_counts": ACCUM,
        "clip_grad": {"type": "norm", "max_norm": CLIP},
    }
    model, optim, _ = strategy.prepare(make_net(), optim_wrapper=optim_config)
    data_rank = strategy.data_parallel_rank
    for step in range(STEPS):
        for micro in range(ACCUM):
            data = batch(step, micro, data_rank)
            if loop == "train_step":
                model.train_step(data, optim)
            else:
                with optim.optim_context(model):
                    loss = model(*data, mode="loss")["loss"]
                optim.update_params(loss)
    expected = oracle(STEPS, ACCUM, strategy.data_parallel_world_size, clip=CLIP, optimizer="adamw")
    backend = backend_of(model)
    return {
        "oracle": max_diff(full_params(model), expected),
        "kind": backend.kind,
        "sharding": backend.describe()["sharding"],
        "mesh": dict(
            zip(strategy.device_mesh.mesh_dim_names, strategy.device_mesh.mesh.shape, strict=True)
        ),
        "data": (strategy.data_parallel_rank, strategy.data_parallel_world_size),
        "grad_norm": float(optim.grad_norm),
    }


def sampler_shares() -> list[list[int]]:
    """Each rank's indices of a 16-sample dataset in epoch 0, as every rank sees them."""
    strategy = ModelParallelStrategy(
        parallelize_fn=net_plan, tensor_parallel_size=2, seed=3, timeout=60
    )
    strategy.setup_env()
    sampler = strategy.sampler(list(range(16)))
    sampler.set_epoch(0)
    gathered: list[list[int]] = dist.all_gather_object(list(sampler))
    return gathered


def seeded_draws() -> list[float]:
    """``diff_rank_seed=True``: one random draw per rank, as every rank sees them."""
    strategy = ModelParallelStrategy(
        parallelize_fn=net_plan, tensor_parallel_size=2, seed=5, diff_rank_seed=True
    )
    strategy.setup_env()
    draws: list[float] = dist.all_gather_object(float(torch.rand(1)))
    return draws


CASES: list[tuple[str, dict[str, Any], str]] = [
    ("dp2 x tp2", {"tensor_parallel_size": 2}, "train_step"),
    ("dp2 x tp2, own loop", {"tensor_parallel_size": 2}, "update_params"),
    ("hsdp 2 x 2", {"replicate_size": 2, "data_parallel_size": 2}, "train_step"),
    ("tp4", {"tensor_parallel_size": 4}, "train_step"),
    ("hsdp 2 x 1 x tp2", {"replicate_size": 2, "tensor_parallel_size": 2}, "update_params"),
    (
        "dp2 x tp2, sharded by the function",
        {"tensor_parallel_size": 2, "parallelize_fn": plan_and_shard},
        "update_params",
    ),
]


def run_cases(cases: list[tuple[str, dict[str, Any], str]]) -> list[dict[str, Any]]:
    return [train_case(options, loop) for _, options, loop in cases]


def test_layouts_equal_one_process(comm_pools: Any) -> None:
    results = comm_pools.get(4).run(run_cases, CASES, timeout=240)
    for rank, rank_results in enumerate(results):
        for (label, _, _), result in zip(CASES, rank_results, strict=True):
            assert result["oracle"] < TOLERANCE, (label, rank, result)
            assert result["kind"] == "dtensor", (label, result)
            assert result["sharding"].startswith("fully_shard:"), (label, result)
    by_label = dict(zip([c[0] for c in CASES], results[0], strict=True))
    assert by_label["dp2 x tp2"]["mesh"] == {"data_parallel": 2, "tensor_parallel": 2}
    assert by_label["hsdp 2 x 2"]["mesh"] == {
        "replicate": 2,
        "data_parallel": 2,
        "tensor_parallel": 1,
    }
    assert by_label["tp4"]["mesh"] == {"data_parallel": 1, "tensor_parallel": 4}
    # Data-parallel coordinates: ranks (0, 1) and (2, 3) are tensor-parallel pairs.
    assert [r[0]["data"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r[2]["data"] for r in results] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [r[3]["data"] for r in results] == [(0, 1)] * 4
    # The whole model's norm is the same number on every rank.
    for index in range(len(CASES)):
        norms = {r[index]["grad_norm"] for r in results}
        assert len(norms) == 1, (CASES[index][0], norms)


def test_sampler_and_seeds_follow_the_data_parallel_coordinates(comm_pools: Any) -> None:
    [shares, *_] = comm_pools.get(4).run(sampler_shares, timeout=120)
    assert shares[0] == shares[1]
    assert shares[2] == shares[3]
    assert len(shares[0]) == 8
    assert not set(shares[0]) & set(shares[2])
    assert sorted(shares[0] + shares[2]) == list(range(16))
    [draws, *_] = comm_pools.get(4).run(seeded_draws, timeout=120)
    assert draws[0] == draws[1]  # a tensor-parallel pair draws the same numbers
    assert draws[2] == draws[3]
    assert draws[0] != draws[2]  # data-parallel groups differ


def prepare_error(options: dict[str, Any]) -> tuple[str, str]:
    """Prepare with bad options; the error's type and message, or ("", "") if none."""
    strategy = ModelParallelStrategy(seed=0, **options)
    try:
        strategy.prepare(make_net(), optim_wrapper={"optimizer": dict(ADAMW)})
    except Exception as error:
        return type(error).__name__, str(error)
    return "", ""


def bad_inputs() -> list[tuple[str, str]]:
    cases: list[dict[str, Any]] = [
        {"parallelize_fn": net_plan, "tensor_parallel_size": 3},
        {"parallelize_fn": net_plan, "tensor_parallel_size": 2, "data_parallel_size": 3},
        {"parallelize_fn": bad_plan, "tensor_parallel_size": 4},
        {"parallelize_fn": plan_failing_on_rank_2, "tensor_parallel_size": 2},
    ]
    out = [prepare_error(options) for options in cases]
    dist.barrier()  # the ranks are still in step after the errors
    return out


def test_bad_input_raises_one_clear_error_on_every_rank(comm_pools: Any) -> None:
    results = comm_pools.get(4).run(bad_inputs, timeout=120)
    for rank_results in results:
        not_dividing, wrong_product, uneven_plan, one_rank = rank_results
        assert not_dividing[0] == "ValueError", not_dividing
        assert "does not divide the world size 4" in not_dividing[1]
        assert wrong_product[0] == "ValueError", wrong_product
        assert "must multiply to the world size" in wrong_product[1]
        assert uneven_plan[0] == "RemoteRankError", uneven_plan
        assert "head.weight" in uneven_plan[1]
        assert "does not divide" in uneven_plan[1]
        assert one_rank[0] == "RemoteRankError", one_rank
        assert "rank 2" in one_rank[1]
        assert "lacks" in one_rank[1]
    assert len({tuple(r) for r in results}) == 1  # the same errors on every rank


def test_constructor_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="needs a parallelize_fn"):
        ModelParallelStrategy(tensor_parallel_size=2)
    with pytest.raises(TypeError, match="replicate_size must be an int"):
        ModelParallelStrategy(replicate_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1"):
        ModelParallelStrategy(data_parallel_size=0)
    with pytest.raises(ValueError, match="remove 'mesh'"):
        ModelParallelStrategy(model_wrapper={"mesh": None})
    assert mesh_shape(8, None, 2, 2) == {"replicate": 2, "data_parallel": 2, "tensor_parallel": 2}
    assert isinstance(build_strategy("model_parallel"), ModelParallelStrategy)
    assert torch.distributed.is_available()


def test_the_train_loop_example_gives_the_single_process_losses(comm_pools: Any) -> None:
    # examples/train_loop.py under model_parallel on 4 ranks (dp 2 x tp 2) prints the same
    # rank-averaged losses as one process, to the printed digits.
    from tests.strategies.test_loop import run_loop_in_world

    [reference] = comm_pools.get(1).run(run_loop_in_world, ["single"], timeout=120)
    by_rank = comm_pools.get(4).run(run_loop_in_world, ["model_parallel"], timeout=240)
    assert len(reference["single"]) == 3
    assert by_rank[0]["model_parallel"] == pytest.approx(reference["single"], abs=2e-4)


def train_bf16() -> dict[str, Any]:
    """dp 2 x tp 2 with FSDP2's bf16 policy (float32 reduction and master weights)."""
    policy = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    options = {"tensor_parallel_size": 2, "model_wrapper": {"mixed_precision": policy}}
    return train_case(options, "train_step")


def test_mixed_precision_through_fsdp2_policy(comm_pools: Any) -> None:
    # bf16 compute moves the result away from the float32 oracle by bf16's rounding only;
    # the master weights stay float32.
    for result in comm_pools.get(4).run(train_bf16, timeout=120):
        assert 1e-6 < result["oracle"] < 2e-3, result
        assert result["kind"] == "dtensor", result
