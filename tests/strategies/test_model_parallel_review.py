"""`ModelParallelStrategy` and activation checkpointing: the cases an outside review found.

Each test runs on 2 gloo ranks (or in-process) and compares with a plain one-process torch
run, or checks that a bad input raises one clear error on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from comm_strategies import build_strategy
from tests.helpers import full_params, max_diff
from tests.strategies.seed_helpers import one_process_adamw
from tests.wrappers.net import Net, batch, global_batch, make_net

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


# ---------------------------------------------------------------- models and plans
class OddNet(nn.Module):
    """Widths 5 and 3: FSDP's shards over 2 ranks are uneven (torch pads them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 5)
        self.lin2 = nn.Linear(5, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, inputs: torch.Tensor, targets: Any = None, mode: str = "tensor") -> Any:
        out = self.head(torch.tanh(self.lin2(torch.tanh(self.lin1(inputs)))))
        if mode == "loss":
            return {"loss": ((out - targets) ** 2).mean()}
        return out


def make_odd() -> OddNet:
    torch.manual_seed(0)
    return OddNet()


class ConstLinear(nn.Linear):
    """A linear layer whose ``reset_parameters`` needs no random numbers."""

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 0.5 / self.in_features)
        nn.init.constant_(self.bias, -0.1)


class ConstNet(OddNet):
    """`OddNet` of `ConstLinear` layers, with an ``init_weights`` for the head's bias."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin1 = ConstLinear(4, 8)
        self.lin2 = ConstLinear(8, 8)
        self.head = ConstLinear(8, 2)

    def init_weights(self) -> None:
        nn.init.constant_(self.head.bias, 0.25)


def make_const() -> ConstNet:
    net = ConstNet()
    net.init_weights()
    return net


def make_meta_const() -> ConstNet:
    with torch.device("meta"):
        return ConstNet()


def tp_plan(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(
        model, mesh["tensor_parallel"], {"lin1": ColwiseParallel(), "lin2": RowwiseParallel()}
    )


def shard_root(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["data_parallel"])


def shard_root_hsdp(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["replicate", "data_parallel"])


def shard_children(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for child in (model.lin1, model.lin2, model.head):
        fully_shard(child, mesh=mesh["data_parallel"])


def returns_a_tuple(model: nn.Module, mesh: Any) -> Any:
    return model, mesh


MODELS: dict[str, tuple[Any, Any]] = {
    "net": (make_net, make_net),
    "odd": (make_odd, make_odd),
    "meta": (make_meta_const, make_const),
    "net_config": ({"type": Net}, make_net),  # built under each rank's own seed
}


def train_against_one_process(model_kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """Prepare, train with ``train_step``; the difference to one process and what it saw."""
    import comm_collectives as dist

    make, reference = MODELS[model_kind]
    strategy = build_strategy("model_parallel", seed=0, **options)
    model, optim, _ = strategy.prepare(
        make if isinstance(make, dict) else make(),
        optim_wrapper={"optimizer": {"type": "AdamW", "lr": 0.01, "weight_decay": 0.01}},
    )
    rank, world = strategy.data_parallel_rank, strategy.data_parallel_world_size
    draws = dist.all_gather_object(float(torch.rand(1)))  # diff_rank_seed after prepare
    for step in range(STEPS):
        model.train_step(batch(step, 0, rank), optim)
    return {
        "difference": max_diff(full_params(model), one_process_adamw(reference, world, STEPS)),
        "wrapper": type(model).__name__,
        "draws": draws,
    }


TRAINED: dict[str, tuple[str, dict[str, Any]]] = {
    # 2: diff_rank_seed built a different model on each data-parallel rank
    "hsdp, diff_rank_seed, model config": (
        "net_config",
        {"replicate_size": 2, "diff_rank_seed": True},
    ),
    "dp2, diff_rank_seed, model config": ("net_config", {"diff_rank_seed": True}),
    # 3, 5: the function's fully_shard with uneven shards; the step API on its result
    "user shards the root, uneven": ("odd", {"parallelize_fn": shard_root}),
    "hsdp, user shards the root over replicate x dp": (
        "odd",
        {"replicate_size": 2, "parallelize_fn": shard_root_hsdp},
    ),
    # 11: the policy names modules the function sharded already
    "user shards children, policy overlaps": (
        "odd",
        {"parallelize_fn": shard_children, "model_wrapper": {"auto_wrap_policy": {nn.Linear}}},
    ),
    # 6: a meta model, initialised after sharding
    "meta, dp2": ("meta", {}),
    "meta, tp2": ("meta", {"parallelize_fn": tp_plan, "tensor_parallel_size": 2}),
}


def train_all(cases: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {label: train_against_one_process(*case) for label, case in cases.items()}


def test_review_layouts_equal_one_process(comm_pools: Any) -> None:
    results = comm_pools.get(2).run(train_all, TRAINED, timeout=240)
    for rank, result in enumerate(results):
        assert list(result) == list(TRAINED)
        for label, figures in result.items():
            assert figures["difference"] < TOLERANCE, (label, rank, figures)
            assert figures["wrapper"] == "MMFullyShardedDataParallel2", (label, figures)
    by_label = results[0]
    # diff_rank_seed still gives each data-parallel rank its own random numbers.
    for label in ("hsdp, diff_rank_seed, model config", "dp2, diff_rank_seed, model config"):
        draws = by_label[label]["draws"]
        assert draws[0] != draws[1], (label, draws)
    assert by_label["meta, dp2"]["draws"][0] == by_label["meta, dp2"]["draws"][1]


def prepare_error(options: dict[str, Any]) -> tuple[str, str]:
    from tests.helpers import caught

    strategy = build_strategy("model_parallel", seed=0, **options)
    return caught(
        strategy.prepare, make_odd(), optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.1}}
    )


def review_errors() -> list[tuple[str, str]]:
    import comm_collectives as dist

    cases: list[dict[str, Any]] = [
        # 4: HSDP, the function shards over data_parallel alone: replicas train apart
        {"replicate_size": 2, "parallelize_fn": shard_root},
        # 5: options only the strategy's fully_shard takes, but the function sharded the root
        {
            "parallelize_fn": shard_root,
            "model_wrapper": {"mixed_precision": {"param_dtype": "bfloat16"}},
        },
        # 12: a function returning something else than a module or None
        {"parallelize_fn": returns_a_tuple},
    ]
    out = [prepare_error(options) for options in cases]
    dist.barrier()  # still in step after the errors
    return out


def test_review_bad_functions_raise_one_clear_error_on_every_rank(comm_pools: Any) -> None:
    results = comm_pools.get(2).run(review_errors, timeout=120)
    for rank_results in results:
        hsdp_dp_only, options_unused, junk = rank_results
        assert hsdp_dp_only[0] == "RemoteRankError", hsdp_dp_only
        assert "rank(s) 0, 1" in hsdp_dp_only[1]
        assert "('data_parallel',)" in hsdp_dp_only[1]
        assert "device_mesh['replicate', 'data_parallel']" in hsdp_dp_only[1]
        assert options_unused[0] == "RemoteRankError", options_unused
        assert "['mixed_precision'] cannot apply" in options_unused[1]
        assert junk[0] == "RemoteRankError", junk
        assert "got a tuple" in junk[1]
    assert len({tuple(r) for r in results}) == 1  # the same errors on every rank
