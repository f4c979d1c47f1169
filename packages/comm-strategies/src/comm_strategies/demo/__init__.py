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

__all__ = ["TEST_SIZE", "TRAIN_SIZE", "DigitsNet", "load_digits"]

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
