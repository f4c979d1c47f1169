"""`FSDPStrategy`: fully sharded data parallel, FSDP1 or FSDP2."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from torch import nn

from comm_wrappers import MMFullyShardedDataParallel, MMFullyShardedDataParallel2

from .base import Strategy

__all__ = ["FSDPStrategy"]

_VERSIONS = {1: MMFullyShardedDataParallel, 2: MMFullyShardedDataParallel2}


class FSDPStrategy(Strategy):
    """Shard parameters, gradients and optimizer state over the ranks (FSDP1 or FSDP2).

    FSDP1 wraps the model in `MMFullyShardedDataParallel` (flat parameters, the original
    parameters kept for the optimizer); FSDP2 shards it in place with ``fully_shard``
    (`MMFullyShardedDataParallel2`, per-parameter ``DTensor`` shards). The optimizer is built
    over the sharded parameters: a config dict after wrapping, a built optimizer rebuilt by
    parameter name when FSDP2 replaced its parameters (it must not have stepped yet).
    Schedulers passed in built are kept and follow the rebuilt optimizer. Clipping by norm
    in the `OptimWrapper` uses the whole model's norm, as DDP would.

    ``diff_rank_seed=True`` seeds each rank with ``seed + rank``; the model's initial values
    are still one model's: rank 0's parameters and buffers, broadcast before sharding (as
    DDP does at construction), so the sharded model is what one process seeded with
    ``seed`` builds. (A model on the meta device is initialised by each rank afterwards.)

    Args:
        fsdp_version: ``1`` (``FullyShardedDataParallel``) or ``2`` (``fully_shard``).
        model_wrapper: Options of the wrapper in MMEngine's forms, e.g.
            ``dict(auto_wrap_policy=dict(type="size_based_auto_wrap_policy",
            min_num_params=1000), mixed_precision="bfloat16")``. Not mutated.
        **kwargs: See `Strategy`.
    """

    name = "fsdp"

    def __init__(
        self,
        *,
        fsdp_version: int = 1,
        model_wrapper: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if fsdp_version not in _VERSIONS:
            message = f"fsdp_version must be 1 or 2, got {fsdp_version!r}"
            raise ValueError(message)
        self.fsdp_version = fsdp_version
        self.name = "fsdp" if fsdp_version == 1 else "fsdp2"
        self.model_wrapper = copy.deepcopy(dict(model_wrapper or {}))
        if "type" in self.model_wrapper:
            message = (
                "FSDPStrategy picks its wrapper from fsdp_version (1 or 2); remove 'type' "
                f"({self.model_wrapper['type']!r}) from model_wrapper"
            )
            raise ValueError(message)

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        self._same_initial_values(model)  # diff_rank_seed: one model's values, not a patchwork
        wrapper = _VERSIONS[self.fsdp_version]
        wrapped: nn.Module = wrapper(model, **copy.deepcopy(self.model_wrapper))
        return wrapped
