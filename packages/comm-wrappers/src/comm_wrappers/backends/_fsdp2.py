"""The adapter of models sharded with FSDP2 (``fully_shard``: DTensor parameters)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from .._registry import _fsdp2_module_type
from ._base import Backend
from ._gather import rows_to_rank0

__all__ = ["FSDP2Backend", "gradient_sync_off"]


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """Keep FSDP2's gradients unreduced (accumulated locally) for one forward/backward."""
    fsdp2 = _fsdp2_module_type()
    units: list[Any] = [m for m in model.modules() if fsdp2 is not None and isinstance(m, fsdp2)]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


class FSDP2Backend(Backend):
    """FSDP2: each parameter a DTensor split over the mesh; the norm reduced across it."""

    kind: ClassVar[str] = "fsdp2"
    _shards: ClassVar[bool] = True
    _sharding: ClassVar[str | None] = "fully_shard"  # what `describe` records

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Skip the gradient reduce-scatter of every sharded module; the next one reduces."""
        return gradient_sync_off(self.model)

    def _gather_to_rank0(self) -> dict[str, torch.Tensor] | None:
        return rows_to_rank0(self._target())
