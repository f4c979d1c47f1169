"""`MMFullyShardedDataParallel2`: torch's FSDP2 (``fully_shard`` on a device mesh), same step API."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from comm_collectives import get_world_size

from ._fsdp_options import coerce_auto_wrap_policy, coerce_mixed_precision, wrap_predicate
from ._registry import register_model_wrapper
from ._step import StepMixin
from .backends import rank_device
from .backends._fsdp2 import gradient_sync_off
from .ddp import require_process_group

__all__ = ["MMFullyShardedDataParallel2"]

_MIXED_PRECISION_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")

# FSDP1 keywords a user may carry over, and what FSDP2 offers instead.
_FSDP1_ONLY = {
    "sharding_strategy": "reshard_after_forward=True is FULL_SHARD, False is SHARD_GRAD_OP; "
    "for NO_SHARD use MMDistributedDataParallel",
    "backward_prefetch": "FSDP2 prefetches by itself (set_modules_to_backward_prefetch)",
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensors)",
    "device_id": "pass mesh=init_device_mesh(device_type, (world_size,))",
    "sync_module_states": "initialise every rank the same (same seed) before sharding",
    "param_init_fn": "build on the meta device, shard, then to_empty() and initialise",
    "process_group": "pass mesh=DeviceMesh.from_group(process_group, device_type)",
}


def _coerce_offload(value: Any) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if value is None or value is False:
        return OffloadPolicy()
    if isinstance(value, OffloadPolicy):
        return value
    if value is True:
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if isinstance(value, dict):
        options = dict(value)
        # FSDP1's CPUOffload(offload_params=...) form is accepted too.
        if not options.pop("offload_params", True):
            return OffloadPolicy()
        options.setdefault("pin_memory", torch.cuda.is_available())
        return CPUOffloadPolicy(**options)
    message = f"cpu_offload must be a bool, a dict or an OffloadPolicy, got {type(value).__name__}"
    raise TypeError(message)


@register_model_wrapper
class MMFullyShardedDataParallel2(StepMixin, nn.Module):
    """FSDP2: shard ``module`` in place with ``fully_shard``; the same options and step API.

    The second choice next to `MMFullyShardedDataParallel` (FSDP1): parameters become
    ``DTensor`` shards, no flat parameters, per-parameter sharding. The same forms of
    ``auto_wrap_policy`` (each submodule it selects is sharded as its own unit, then the
    root), ``mixed_precision`` (``dict(param_dtype="bfloat16", reduce_dtype=...)`` or a
    dtype name; FSDP2 has no ``buffer_dtype``) and ``cpu_offload`` (``True`` or an
    ``OffloadPolicy``). ``no_sync()`` skips the gradient reduce-scatter on accumulation
    micro-steps. Validation and testing run through the sharded forward.

    Args:
        module: The model; sharded in place, and kept as ``self.module``.
        mesh: A 1-D ``DeviceMesh``; default one over the world on the current device
            type (``"cpu"`` without an accelerator).
        auto_wrap_policy: As for `MMFullyShardedDataParallel`.
        mixed_precision: A ``MixedPrecisionPolicy``, a dict of its fields, or a dtype name.
        cpu_offload: Offload parameters, gradients and optimizer state to the CPU.
        reshard_after_forward: Free the gathered parameters after the forward. None (torch's
            default): True for the submodules, False for the root, whose parameters the
            backward needs at once (resharding it costs one more all-gather a step).
        **kwargs: Other ``fully_shard`` keywords, unchanged.

    Raises:
        NotInitializedError: No process group is initialised.
        ValueError: An option is unknown (the message lists the valid ones).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Any = None,
        auto_wrap_policy: Any = None,
        mixed_precision: Any = None,
        cpu_offload: Any = None,
        reshard_after_forward: bool | int | None = None,
        **kwargs: Any,
    ) -> None:
        require_process_group(type(self).__name__)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        super().__init__()
        for name, instead in _FSDP1_ONLY.items():
            if name in kwargs:
                message = f"MMFullyShardedDataParallel2 (FSDP2) has no {name!r}: {instead}"
                raise TypeError(message)
        predicate = wrap_predicate(coerce_auto_wrap_policy(auto_wrap_policy, module), module)
        options: dict[str, Any] = {
            "reshard_after_forward": reshard_after_forward,
            "offload_policy": _coerce_offload(cpu_offload),
            **kwargs,
        }
        policy = coerce_mixed_precision(
            mixed_precision, MixedPrecisionPolicy, _MIXED_PRECISION_FIELDS
        )
        if policy is not None:
            options["mp_policy"] = policy
        if mesh is None:
            device = rank_device()
            if device.type != "cpu":
                getattr(torch, device.type).set_device(device)
            mesh = init_device_mesh(device.type, (get_world_size(),))
        self.mesh = mesh
        if predicate is not None:
            _shard_children(module, predicate, fully_shard, mesh, options)
        fully_shard(module, mesh=mesh, **options)
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the sharded module (its hooks gather and free the parameters)."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients locally; the next synced backward reduces them."""
        with gradient_sync_off(self.module):
            yield

    _infer_through_wrapper = True


def _shard_children(
    root: nn.Module, predicate: Any, fully_shard: Any, mesh: Any, options: dict[str, Any]
) -> int:
    """Shard, bottom-up, the submodules ``predicate`` selects, as FSDP1's auto wrap does.

    Returns the number of parameters of ``root`` left unsharded below it.
    """

    def visit(module: nn.Module) -> int:
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            remaining += visit(child)
        if module is not root and remaining and predicate(module, remaining):
            fully_shard(module, mesh=mesh, **options)
            return 0
        return remaining

    return visit(root)
