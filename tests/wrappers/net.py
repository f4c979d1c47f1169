"""The wrappers' test net, its rank-dependent batches, the one-process oracle and the loop.

Shared by the tests of the wrappers and of the layers above (DeepSpeed, strategies,
checkpoints): the oracle is plain torch with no distributed code, one process that sees
the batches of every rank concatenated (which is what DDP must compute).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import comm_collectives as dist
from comm_wrappers import (
    AmpOptimWrapper,
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    OptimWrapper,
    OptimWrapperDict,
    unwrap_model,
)
from tests.helpers import full_params

BATCH = 4


class Net(nn.Module):
    """A small MLP that follows MMEngine's BaseModel contract (``forward(..., mode=)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.lin2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, inputs: torch.Tensor, targets: Any = None, mode: str = "tensor") -> Any:
        out = self.head(torch.tanh(self.lin2(torch.tanh(self.lin1(inputs)))))
        if mode == "loss":
            return {"loss": ((out.float() - targets) ** 2).mean(), "mean_out": out.detach().mean()}
        return out


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dependent data: every (step, micro-step, rank) has its own batch."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    inputs = torch.randn(BATCH, 4, generator=generator) + rank
    targets = torch.randn(BATCH, 2, generator=generator)
    return inputs, targets


def global_batch(step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(step, micro, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def make_optimizer(params: Any, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def oracle(
    steps: int,
    accum: int,
    world: int,
    *,
    clip: float | None = None,
    optimizer: str = "sgd",
    dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """One process, plain torch: each update sees every rank's micro-batches.

    On ``device``, with autocast to ``dtype`` and, for float16, a dynamic ``GradScaler``
    (clipping after unscaling), as a hand-written mixed-precision loop does.
    """
    model = make_net().to(device)
    optim = make_optimizer(model.parameters(), optimizer)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    for step in range(steps):
        for micro in range(accum):
            inputs, targets = (t.to(device) for t in global_batch(step, micro, world))
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                loss = model(inputs, targets, mode="loss")["loss"]
            scaler.scale(loss / accum).backward()
        if clip is not None:
            scaler.unscale_(optim)
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
    return full_params(model)


def wrap(kind: str, **options: Any) -> nn.Module:
    net = make_net()
    if kind == "ddp":
        return MMDistributedDataParallel(net, **options)
    if kind == "fsdp":
        return MMFullyShardedDataParallel(net, **options)
    if kind == "fsdp2":
        return MMFullyShardedDataParallel2(net, **options)
    raise ValueError(kind)


def train(
    model: nn.Module,
    steps: int,
    accum: int,
    *,
    clip: float | None = None,
    optimizer: str = "sgd",
    amp: torch.dtype | None = None,
    use_fsdp: bool = False,
) -> OptimWrapper:
    clip_grad = None if clip is None else {"type": "norm", "max_norm": clip}
    optim = make_optimizer(model.parameters(), optimizer)
    if amp is not None:
        wrapper: OptimWrapper = AmpOptimWrapper(
            optim, dtype=amp, accumulative_counts=accum, clip_grad=clip_grad, use_fsdp=use_fsdp
        )
    else:
        wrapper = OptimWrapper(optim, accumulative_counts=accum, clip_grad=clip_grad)
    rank = dist.get_rank()
    for step in range(steps):
        for micro in range(accum):
            log_vars = model.train_step(batch(step, micro, rank), wrapper)  # type: ignore[operator]
            assert list(log_vars) == ["loss", "mean_out"], list(log_vars)
    return wrapper


# ---------------------------------------------------------------- a GAN, an MMEngine model
class Gan(nn.Module):
    """A toy GAN: two optimizers, each over its own child, and a parameter-free child."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.generator = nn.Linear(3, 4)
        self.discriminator = nn.Linear(4, 1)
        self.activation = nn.Tanh()  # no parameters: moved, not wrapped

    def losses(self, noise: torch.Tensor, real: torch.Tensor) -> tuple[Any, Any]:
        fake = self.activation(self.generator(noise))
        g_loss = -self.discriminator(fake).mean()
        d_loss = self.discriminator(fake.detach()).mean() - self.discriminator(real).mean()
        return g_loss, d_loss

    def train_step(self, data: Any, optim_wrapper: OptimWrapperDict) -> dict[str, torch.Tensor]:
        noise, real = data
        g_wrapper, d_wrapper = optim_wrapper["generator"], optim_wrapper["discriminator"]
        with torch.no_grad():
            fake = self.activation(self.generator(noise))
        with d_wrapper.optim_context(self.discriminator):
            d_loss = self.discriminator(fake).mean() - self.discriminator(real).mean()
        d_wrapper.update_params(d_loss)
        # The generator's step must not leave gradients on the discriminator.
        discriminator = unwrap_model(self.discriminator)
        discriminator.requires_grad_(False)
        with g_wrapper.optim_context(self.generator):
            g_loss = -discriminator(self.activation(self.generator(noise))).mean()
        g_wrapper.update_params(g_loss)
        discriminator.requires_grad_(True)
        return {"g_loss": g_loss.detach(), "d_loss": d_loss.detach()}


def gan_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + 100 * step + 10 * micro + rank)
    return torch.randn(BATCH, 3, generator=generator), torch.randn(BATCH, 4, generator=generator)


def mmengine_model() -> nn.Module:
    """A real ``mmengine.model.BaseModel`` subclass around `Net`."""
    from mmengine.model import BaseModel

    class MMNet(BaseModel):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()

        def forward(self, inputs: Any, data_samples: Any = None, mode: str = "tensor") -> Any:
            if mode == "loss":
                return {"loss": self.net(inputs, data_samples, mode="loss")["loss"]}
            return self.net(inputs)

    return MMNet()
