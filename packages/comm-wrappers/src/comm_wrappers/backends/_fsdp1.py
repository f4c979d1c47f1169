"""The adapter of models wrapped in torch's FSDP1 (``FullyShardedDataParallel``)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from ._base import Backend, new_grad_scaler
from ._gather import flat_to_rank0, rows_to_rank0

__all__ = ["FSDP1Backend"]


class FSDP1Backend(Backend):
    """FSDP1: flat parameters sharded across ranks; the root unit knows the whole model.

    The root is the outermost unit (FSDP decides it at the first forward): clipping, the
    gradient sync and the state dicts go through it.
    """

    kind: ClassVar[str] = "fsdp1"
    _shards: ClassVar[bool] = True
    # torch's DCP load planner (2.13) cannot fit FSDP1's sharded optimizer state saved at
    # another world size ("Missing key in checkpoint state_dict: optim...param_groups",
    # saved at 2, loaded at 3): such a load goes through the full state instead.
    reshards_sharded_state: ClassVar[bool] = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
        self._decided_root: FullyShardedDataParallel | None = None

    def _root(self) -> FullyShardedDataParallel:
        """The root unit of the model.

        Raises:
            RuntimeError: The model holds FSDP units but not their root (e.g. the user's
                module inside the wrapper): the whole model is out of reach.
        """
        if self._decided_root is not None:
            return self._decided_root
        # _is_root is None before the first forward, when only the outermost unit can be
        # root; once FSDP has decided, the answer is kept (no walk on every step).
        for unit in self._units:
            decided = getattr(unit, "_is_root", None)
            if decided in (True, None):
                if decided:
                    self._decided_root = unit
                return unit
        message = (
            f"{type(self.model).__name__} holds FSDP units but not their root; pass the FSDP "
            "wrapper itself (MMFullyShardedDataParallel) to optim_context and the checkpoint "
            "functions, so clipping and state dicts use the whole model"
        )
        raise RuntimeError(message)

    def _target(self) -> nn.Module:
        return self._root()

    def no_sync(self) -> AbstractContextManager[None]:
        """The root's ``no_sync()``: gradients accumulate unsharded until the next sync."""
        context: AbstractContextManager[None] = self._root().no_sync()
        return context

    def _clip(self, params: list[torch.Tensor], options: dict[str, Any]) -> torch.Tensor:
        # The root all-reduces the shards' norms; it clips every parameter itself (it takes
        # no error_if_nonfinite: the norm is checked after, by clip_grad_norm).
        norm: torch.Tensor = self._root().clip_grad_norm_(options["max_norm"], options["norm_type"])
        return norm

    def grad_scaler(self, device_type: str, **kwargs: Any) -> torch.amp.GradScaler:
        """FSDP's ``ShardedGradScaler``: every rank skips a step when any rank's shard
        overflowed (a plain scaler would let the ranks disagree)."""
        return new_grad_scaler(device_type, sharded=True, **kwargs)

    def describe(self) -> dict[str, Any]:
        """``{"wrapper": "fsdp1", "sharding": the strategy's name, "zero_stage": None}``."""
        sharding = str(self._root().sharding_strategy.name)
        return {"wrapper": self.kind, "sharding": sharding, "zero_stage": None}

    def _offload_works(self) -> bool:
        # FSDP1 with cpu_offload crashes (SIGSEGV) on a CPU device in torch 2.13: there the
        # full tensors stay on every rank (they are on the CPU already).
        for parameter in self.model.parameters():
            return parameter.device.type != "cpu"
        return False

    def _gather_to_rank0(self) -> dict[str, torch.Tensor] | None:
        root = self._root()
        flat = flat_to_rank0(root)
        return flat if flat is not None else rows_to_rank0(root)
