"""``fsdp`` and ``fsdp2`` with ``diff_rank_seed=True`` shard one model, not a patchwork.

The ranks build the model from a config after being seeded with ``seed + rank``, so each
holds different initial values; FSDP1 (without ``sync_module_states``) and FSDP2
(``fully_shard`` keeps each rank's values) would shard those, and the model would be
rank 0's first shard next to rank 1's second. As DDP (and ``model_parallel``) does, rank 0's
parameters and buffers are broadcast before sharding. On 2 gloo ranks against plain torch.
"""

from __future__ import annotations

from typing import Any

import torch

from comm_strategies import build_strategy
from tests.helpers import full_params, max_diff
from tests.wrappers.net import Net, batch, global_batch

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
    model = one_process_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(STEPS):
        model(*global_batch(step, 0, world), mode="loss")["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_params(model)


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
