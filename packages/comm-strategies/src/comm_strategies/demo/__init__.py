"""The demo: a small real model on a small real data set, under every strategy.

``python -m comm_strategies.demo`` trains `DigitsNet` on the handwritten digits shipped in
this folder (1,797 8x8 images of the UCI "Optical Recognition of Handwritten Digits" test
set, E. Alpaydin and C. Kaynak, 1998; CC BY 4.0; see ``NOTICE``) under each strategy in
turn on local ranks (CPU ranks, or one per GPU), and prints accuracy, time per step and
checkpoint size.
"""

from __future__ import annotations

import gzip
import hashlib
from importlib import resources
from typing import Any

import torch
from torch import nn

__all__ = ["TEST_SIZE", "TRAIN_SIZE", "DigitsNet", "digits_plan", "load_digits", "train_flops"]

_SHA256 = "68aea062d35a127749050fa0e52dca09d6569ac08092c925610e0954e172dde2"
_ROWS, _COLUMNS = 1797, 65
#: Examples used for training (24 batches of 64) and held out for the accuracy.
TRAIN_SIZE = 1536
TEST_SIZE = _ROWS - TRAIN_SIZE


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(images, labels)``: ``(1797, 64)`` floats in ``[0, 1]`` and ``(1797,)`` classes.

    The rows come in a fixed shuffled order, so ``[:TRAIN_SIZE]`` and ``[TRAIN_SIZE:]`` are
    the same train and test split everywhere.

    Examples:
        >>> images, labels = load_digits()
        >>> tuple(images.shape), tuple(labels.shape), int(labels.max())
        ((1797, 64), (1797,), 9)
    """
    raw = gzip.decompress(resources.files(__name__).joinpath("digits.u8.gz").read_bytes())
    if hashlib.sha256(raw).hexdigest() != _SHA256 or len(raw) != _ROWS * _COLUMNS:
        message = "the digits data file shipped with comm_strategies.demo is damaged"
        raise RuntimeError(message)
    table = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(_ROWS, _COLUMNS)
    order = torch.randperm(_ROWS, generator=torch.Generator().manual_seed(1998))
    table = table[order]
    return table[:, :64].float() / 16.0, table[:, 64].long()


class DigitsNet(nn.Module):
    """A small MLP (64 -> 128 -> 64 -> 10) with MMEngine's ``forward(..., mode=)`` contract.

    Examples:
        >>> net = DigitsNet()
        >>> net(torch.zeros(2, 64), mode="predict").shape
        torch.Size([2, 10])
    """

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, inputs: torch.Tensor, labels: Any = None, mode: str = "tensor") -> Any:
        """Logits, or ``{"loss": cross entropy}`` in ``"loss"`` mode."""
        logits = self.body(inputs)
        if mode == "loss":
            return {"loss": nn.functional.cross_entropy(logits.float(), labels)}
        return logits


def digits_plan(model: nn.Module, device_mesh: Any) -> None:
    """The tensor-parallel plan of `DigitsNet`, a ``parallelize_fn`` of ModelParallelStrategy.

    The first layer (64 -> 128) is split by output columns and the second (128 -> 64) by
    input rows, so the hidden activations of width 128 stay split between the
    tensor-parallel ranks and one all-reduce per forward joins the second layer's output;
    the small head (64 -> 10) is left whole. Nothing happens on a mesh whose
    ``"tensor_parallel"`` dimension has one rank.

    Examples:
        >>> from comm_strategies import ModelParallelStrategy
        >>> strategy = ModelParallelStrategy(parallelize_fn=digits_plan, seed=0)
        >>> model, _, _ = strategy.prepare(DigitsNet())  # a world of one: a 1 x 1 mesh
        >>> model(torch.zeros(2, 64)).shape
        torch.Size([2, 10])
        >>> strategy.teardown()
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tensor_parallel = device_mesh["tensor_parallel"]
    if tensor_parallel.size() == 1:
        return
    plan = {"body.0": ColwiseParallel(), "body.2": RowwiseParallel()}
    parallelize_module(model, tensor_parallel, plan)


def train_flops(model: nn.Module, samples: int) -> int:
    """The model FLOPs of training on ``samples`` examples: 6 per weight of each linear layer.

    A multiply-add is 2 FLOPs; the backward costs twice the forward (gradients of the
    inputs and of the weights). Biases, activations and the loss are left out, as usual.

    Examples:
        >>> train_flops(DigitsNet(), 1)  # 6 x (64*128 + 128*64 + 64*10)
        102144
    """
    weights = sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear)
    )
    return 6 * weights * samples
