"""``fsdp`` and ``fsdp2`` with ``diff_rank_seed=True`` shard one model, not a patchwork.

The ranks build the model from a config after being seeded with ``seed + rank``, so each
holds different initial values; FSDP1 (without ``sync_module_states``) and FSDP2
(``fully_shard`` keeps each rank's values) would shard those, and the model would be
rank 0's first shard next to rank 1's second. As DDP (and ``model_parallel``) does, rank 0's
parameters and buffers are broadcast before sharding. A model built on the meta device is
materialised by FSDP1 on each rank (``param_init_fn``, or ``reset_parameters``) under that
rank's seed, after that broadcast: each materialised module is then broadcast from rank 0.
On 2 gloo ranks against plain torch.
"""

from __future__ import annotations

from typing import Any

import torch

from comm_strategies import build_strategy
from tests.helpers import full_params, max_diff
from tests.strategies.seed_helpers import one_process_adamw
from tests.wrappers.net import Net, batch

TOLERANCE = 1e-5
STEPS = 2


class NetWithBuffer(Net):
    """The test net with a random buffer (kept in the state, not used by the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("noise", torch.randn(3))


def one_process_model() -> NetWithBuffer:
    """What one process seeded with the strategy's common seed (0) builds."""
    torch.manual_seed(0)
    return NetWithBuffer()


def one_process_trained(world: int) -> dict[str, torch.Tensor]:
    """Plain torch, one process, each step on the batches of every rank."""
    return one_process_adamw(one_process_model, world, STEPS)


def buffers(model: Any) -> dict[str, torch.Tensor]:
    from comm_wrappers import unwrap_model

    return {
        name.replace("_fsdp_wrapped_module.", ""): value.detach().clone()
        for name, value in unwrap_model(model).named_buffers()
    }


def train_from_config(name: str, diff_rank_seed: bool) -> dict[str, Any]:
    import comm_collectives as dist

    strategy = build_strategy(name, seed=0, diff_rank_seed=diff_rank_seed)
    model, optim, _ = strategy.prepare(
        {"type": NetWithBuffer},
        optim_wrapper={"optimizer": {"type": "AdamW", "lr": 0.01, "weight_decay": 0.01}},
    )
    draws = dist.all_gather_object(float(torch.rand(1)))  # each rank's random numbers
    initial = full_params(model)
    reference = one_process_model()
    initial_difference = max_diff(initial, full_params(reference))
    buffer_difference = max_diff(buffers(model), dict(reference.named_buffers()))
    across_ranks = dist.all_gather_object({k: v.tolist() for k, v in initial.items()})
    for step in range(STEPS):
        model.train_step(batch(step, 0, strategy.rank), optim)
    return {
        "initial": initial_difference,
        "buffers": buffer_difference,
        "same_on_every_rank": all(other == across_ranks[0] for other in across_ranks),
        "trained": max_diff(full_params(model), one_process_trained(strategy.world_size)),
        "draws": draws,
        "wrapper": type(model).__name__,
    }


def train_all() -> dict[str, dict[str, Any]]:
    return {
        f"{name}, diff_rank_seed={seeded}": train_from_config(name, seeded)
        for name in ("fsdp", "fsdp2")
        for seeded in (True, False)
    }


def test_diff_rank_seed_shards_the_model_one_process_builds(comm_pools: Any) -> None:
    results = comm_pools.get(2).run(train_all, timeout=240)
    for rank, result in enumerate(results):
        for label, figures in result.items():
            # The model is what one process seeded with the common seed builds, on every
            # rank, and trains as one process on the global batch.
            assert figures["initial"] < TOLERANCE, (label, rank, figures)
            assert figures["buffers"] < TOLERANCE, (label, rank, figures)
            assert figures["same_on_every_rank"], (label, rank, figures)
            assert figures["trained"] < TOLERANCE, (label, rank, figures)
        assert result["fsdp, diff_rank_seed=True"]["wrapper"] == "MMFullyShardedDataParallel"
        assert result["fsdp2, diff_rank_seed=True"]["wrapper"] == "MMFullyShardedDataParallel2"
    by_label = results[0]
    for name in ("fsdp", "fsdp2"):
        # diff_rank_seed still gives each rank its own random numbers after prepare...
        draws = by_label[f"{name}, diff_rank_seed=True"]["draws"]
        assert draws[0] != draws[1], (name, draws)
        # ...and without it the ranks draw alike.
        draws = by_label[f"{name}, diff_rank_seed=False"]["draws"]
        assert draws[0] == draws[1], (name, draws)


def random_init(module: torch.nn.Module) -> None:
    """A ``param_init_fn`` that initialises randomly: a meta module's own tensors, normal."""
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor.normal_()


class MetaNetWithBuffer(Net):
    """The test net with a buffer, built on the meta device (FSDP1 materialises it)."""

    def __init__(self) -> None:
        with torch.device("meta"):
            super().__init__()
            self.register_buffer("noise", torch.randn(3))


class MetaNet(Net):
    """The test net built on the meta device, no ``param_init_fn``: ``reset_parameters``."""

    def __init__(self) -> None:
        with torch.device("meta"):
            super().__init__()


def one_process_meta_model(random: bool) -> dict[str, torch.Tensor]:
    """What one process seeded with 0 materialises: FSDP1's order, module by module."""
    torch.manual_seed(0)
    if not random:
        return full_params(Net())  # reset_parameters of lin1, lin2, head, in that order
    model = MetaNetWithBuffer()
    for module in model.modules():
        if any(t.is_meta for t in [*module.parameters(False), *module.buffers(False)]):
            random_init(module)
    return {**full_params(model), **{n: b.detach().clone() for n, b in model.named_buffers()}}


def meta_from_config(config: Any, model_wrapper: dict[str, Any]) -> dict[str, Any]:
    import comm_collectives as dist

    strategy = build_strategy("fsdp", seed=0, diff_rank_seed=True, model_wrapper=model_wrapper)
    model, _, _ = strategy.prepare({"type": config})
    state = {**full_params(model), **buffers(model)}
    random = config is MetaNetWithBuffer
    across_ranks = dist.all_gather_object({k: v.tolist() for k, v in state.items()})
    return {
        "rank 0's seed": max_diff(state, one_process_meta_model(random)),
        "same_on_every_rank": all(other == across_ranks[0] for other in across_ranks),
    }


def meta_all() -> dict[str, dict[str, Any]]:
    return {
        "random param_init_fn": meta_from_config(MetaNetWithBuffer, {"param_init_fn": random_init}),
        "random param_init_fn, by dotted path": meta_from_config(
            MetaNetWithBuffer, {"param_init_fn": f"{__name__}.random_init"}
        ),
        "no param_init_fn": meta_from_config(MetaNet, {}),
        "sync_module_states=False": meta_from_config(
            MetaNetWithBuffer, {"param_init_fn": random_init, "sync_module_states": False}
        ),
    }


def test_diff_rank_seed_materialises_a_meta_model_from_rank_0s_seed(comm_pools: Any) -> None:
    results = comm_pools.get(2).run(meta_all, timeout=240)
    for rank, result in enumerate(results):
        for label in ("random param_init_fn", "random param_init_fn, by dotted path"):
            # was: the flat parameter's first half from seed 0, its second from seed 1
            figures = result[label]
            assert figures["same_on_every_rank"], (label, rank, figures)
            assert figures["rank 0's seed"] < TOLERANCE, (label, rank, figures)
        figures = result["no param_init_fn"]
        assert figures["same_on_every_rank"], (rank, figures)
        assert figures["rank 0's seed"] < TOLERANCE, (rank, figures)
        # sync_module_states set by the user is respected: False keeps each rank's values
        assert not result["sync_module_states=False"]["same_on_every_rank"], (rank, result)
