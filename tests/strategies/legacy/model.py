"""The model, data and optimizer-state reader shared by the legacy fixtures and their test.

Only torch, DeepSpeed and the public constructors of comm-wrappers are used here, so the
generator (``make_fixtures.py``, run with the code of the commit it keeps) and the test
(run with the current code) build the same models and read their state the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from comm_wrappers import (
    AmpOptimWrapper,
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    OptimWrapper,
)

BATCH = 4
SEED = 0
LR = 0.01
STEPS = 2
EXTRA = {"step": STEPS}
# The layouts kept, each with the world size that saved it.
WORLD = {
    "single": 1,
    "amp_fp16": 1,
    "ddp": 2,
    "fsdp": 2,
    "fsdp2": 2,
    "fsdp2_full": 2,
    "zero0": 2,
    "zero2": 2,
}
STRATEGY = {"ddp": "ddp", "fsdp": "fsdp", "fsdp2": "fsdp2", "fsdp2_full": "fsdp2"}


class TinyNet(nn.Module):
    """Linear(4, 3), ReLU, Linear(3, 2) under MMEngine's ``forward(..., mode=)`` contract."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2)

    def forward(self, inputs: torch.Tensor, targets: Any = None, mode: str = "tensor") -> Any:
        out = self.fc2(torch.relu(self.fc1(inputs)))
        if mode == "loss":
            return {"loss": ((out.float() - targets) ** 2).mean()}
        return out


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank: every layout then trains as one process would."""
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 2, generator=generator)


def build(kind: str, seed: int = SEED) -> tuple[Any, Any, Any]:
    """A fresh model of ``kind`` initialised from ``seed``, its optim wrapper and a StepLR."""
    torch.manual_seed(seed)
    module = TinyNet()
    if kind.startswith("zero"):
        from comm_wrappers.deepspeed import initialize

        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "zero_optimization": {"stage": int(kind[-1])},
            "gradient_clipping": 0.0,
        }
        model, optim = initialize(module, config, torch.optim.AdamW(module.parameters(), lr=LR))
    else:
        model = {
            "ddp": MMDistributedDataParallel,
            "fsdp": MMFullyShardedDataParallel,
            "fsdp2": MMFullyShardedDataParallel2,
            "fsdp2_full": MMFullyShardedDataParallel2,
        }.get(kind, lambda m: m)(module)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        if kind == "amp_fp16":
            optim = AmpOptimWrapper(optimizer, dtype="float16")
        else:
            optim = OptimWrapper(optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(torch_optimizer(optim), step_size=1, gamma=0.5)
    return model, optim, scheduler


def torch_optimizer(optim: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside an optim wrapper (under ZeRO: the engine's base optimizer)."""
    optimizer = optim.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def train_step(model: Any, optim: Any, scheduler: Any, step: int) -> None:
    """One update on ``batch(step)`` (through the wrapper's train_step when it has one)."""
    data = batch(step)
    if hasattr(model, "train_step"):
        model.train_step(data, optim)
    else:
        with optim.optim_context(model):
            loss = model(*data, mode="loss")["loss"]
        optim.update_params(loss)
    scheduler.step()


def _engine(model: Any) -> Any:
    engine = getattr(model, "model", None)
    return engine if hasattr(engine, "zero_optimization_stage") else None


def moments(model: Any, optim: Any) -> dict[str, dict[str, torch.Tensor]] | None:
    """AdamW's ``step``, ``exp_avg`` and ``exp_avg_sq`` by parameter name, read with torch's
    ``get_optimizer_state_dict`` (full tensors); None under ZeRO 1-3 (flat partitions)."""
    engine = _engine(model)
    optimizer = torch_optimizer(optim)
    if engine is not None:
        if engine.zero_optimization_stage() != 0:
            return None
        module: nn.Module = engine.module
    else:
        module = model
    options = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(module, optimizer, options=options)["state"]
    return {
        name.replace("module.", ""): {
            key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for key, value in entry.items()
        }
        for name, entry in state.items()
    }


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    state: dict[str, Any] = scheduler.state_dict()
    return state
