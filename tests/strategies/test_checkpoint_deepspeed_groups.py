"""A DeepSpeed engine whose optimizer has other param groups than the saved one.

The saved optimizer holds one group; the target ZeRO engine two (one per layer, the second
with its own learning rate). A strict load must refuse on every rank naming the counts,
before anything is loaded; ``strict=False`` loads what stays in its group and the second
group keeps its own learning rate (the engine's flat partitions have no parameter names:
the groups are told by the partitions' parameters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")

import torch

import comm_collectives as dist
from comm_strategies.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers import caught


def _engine(stage: int, groups: int) -> Any:
    from comm_wrappers.deepspeed import initialize

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    params: Any = module.parameters()
    if groups == 2:
        params = [
            {"params": list(module[0].parameters())},
            {"params": list(module[1].parameters()), "lr": 0.001},
        ]
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.0)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    return initialize(module, config, optimizer)


def _step(model: Any, optim: Any) -> None:
    torch.manual_seed(10 + dist.get_rank())
    loss = model(torch.randn(2, 4)).pow(2).mean()
    optim.update_params(loss)


def groups_differ(root: str, stage: int) -> dict[str, Any]:
    model, optim = _engine(stage, groups=1)
    _step(model, optim)
    path = save_checkpoint(
        f"{root}/zero{stage}", model=model, optim_wrapper=optim, strategy="deepspeed", sharded=False
    )
    out: dict[str, Any] = {}
    model, optim = _engine(stage, groups=2)
    out["strict"] = caught(load_checkpoint, path, model=model, optim_wrapper=optim)
    out["lrs_after_refusal"] = [g["lr"] for g in optim.optimizer.param_groups]
    load_checkpoint(path, model=model, optim_wrapper=optim, strict=False)
    out["lrs"] = [g["lr"] for g in optim.optimizer.param_groups]
    _step(model, optim)  # the optimizer still steps
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_engine_with_other_param_groups_is_refused_or_fitted(
    comm_run_distributed: Any, tmp_path: Path, stage: int
) -> None:
    results = comm_run_distributed(groups_differ, str(tmp_path), stage, world_size=2, timeout=240)
    for rank, result in enumerate(results):
        name, message = result["strict"]
        assert name == "CheckpointError", message
        assert "1 parameter group(s), this optimizer 2" in message, message
        assert f"rank {rank}" in message, message
        assert result["lrs_after_refusal"] == [0.1, 0.001]
        assert result["lrs"] == [0.1, 0.001]  # group 1 kept its own learning rate
