"""The one-process torch reference that the seed and model-parallel tests compare with."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.helpers import full_params
from tests.wrappers.net import global_batch


def one_process_adamw(
    build: Callable[[], torch.nn.Module], world: int, steps: int
) -> dict[str, torch.Tensor]:
    """Plain torch, one process, AdamW, each of ``steps`` steps on the batches of every rank."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(steps):
        model(*global_batch(step, 0, world), mode="loss")["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_params(model)
