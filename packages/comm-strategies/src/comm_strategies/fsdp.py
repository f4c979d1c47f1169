"""`FSDPStrategy`: fully sharded data parallel, FSDP1 or FSDP2."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from comm_wrappers import MMFullyShardedDataParallel, MMFullyShardedDataParallel2
from comm_wrappers._fsdp_options import coerce_param_init_fn
from comm_wrappers.backends import rank_device

from .base import Strategy, broadcast_module_state

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
    ``seed`` builds. A model on the meta device, which FSDP1 materialises on each rank
    (``param_init_fn``, or ``reset_parameters``) under that rank's seed, gets rank 0's
    values too: each module is broadcast from rank 0 as it is materialised (as
    ``sync_module_states=True`` does, which FSDP1 refuses for CPU modules), unless the user
    set ``sync_module_states``. FSDP2 does not materialise: the model stays on meta
    through ``prepare``, and the user's ``to_empty()`` and initialisation afterwards draw
    each rank's shard from that rank's generator on CPU ranks (DTensor's shared random
    generator only on accelerators): broadcast rank 0's values after initialising.

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
        options = copy.deepcopy(self.model_wrapper)
        if (
            self.fsdp_version == 1
            and self.diff_rank_seed
            and self.world_size > 1
            and "sync_module_states" not in options  # the user's choice stands
            and _has_meta_tensors(model)
        ):
            # The meta tensors are materialised by each rank under its own seed, after the
            # broadcast above: each materialised module gets rank 0's values, as FSDP1's
            # sync_module_states=True would give (which refuses modules on the CPU).
            options["param_init_fn"] = _synced_init(options)
        wrapper = _VERSIONS[self.fsdp_version]
        wrapped: nn.Module = wrapper(model, **options)
        return wrapped


def _has_meta_tensors(model: nn.Module) -> bool:
    return any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])


def _synced_init(options: Mapping[str, Any]) -> Callable[[nn.Module], None]:
    """FSDP1's ``param_init_fn`` (the user's, or torch's default: ``to_empty`` then
    ``reset_parameters``), followed by a broadcast of the module's values from rank 0."""
    init = coerce_param_init_fn(options.get("param_init_fn"))
    if init is None:
        device = options.get("device_id")
        if device is None:
            device = rank_device(options.get("process_group"))
        elif isinstance(device, int):
            device = torch.device(rank_device().type, device)
        reset: Any = coerce_param_init_fn("reset_parameters")  # takes a device= too
        init = functools.partial(reset, device=device)
    chosen = init

    def synced(module: nn.Module) -> None:
        chosen(module)
        broadcast_module_state(module)

    return synced
