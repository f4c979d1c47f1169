"""`MMFullyShardedDataParallel`: torch's FSDP1 with MMEngine's option forms and step API."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)

from ._fsdp_options import (
    coerce_auto_wrap_policy,
    coerce_enum,
    coerce_mixed_precision,
    coerce_modules,
    coerce_param_init_fn,
)
from ._registry import register_model_wrapper
from ._step import StepMixin
from .backends import rank_device
from .ddp import require_process_group

__all__ = ["MMFullyShardedDataParallel"]

_MIXED_PRECISION_FIELDS = tuple(field.name for field in dataclasses.fields(MixedPrecision))


def _coerce_cpu_offload(value: Any) -> CPUOffload | None:
    if value is None or isinstance(value, CPUOffload):
        return value
    if isinstance(value, bool):
        return CPUOffload(offload_params=value)
    if isinstance(value, dict):
        return CPUOffload(**value)
    message = f"cpu_offload must be a bool, a dict or a CPUOffload, got {type(value).__name__}"
    raise TypeError(message)


@register_model_wrapper
class MMFullyShardedDataParallel(StepMixin, FullyShardedDataParallel):
    """FSDP1 with ``train_step`` / ``val_step`` / ``test_step`` and MMEngine's option forms.

    Options accept torch's objects or MMEngine's forms: ``sharding_strategy="FULL_SHARD"``,
    ``cpu_offload=True``, ``auto_wrap_policy=dict(type="size_based_auto_wrap_policy",
    min_num_params=...)`` or module class names, ``backward_prefetch="BACKWARD_PRE"``,
    ``mixed_precision=dict(param_dtype="bfloat16", ...)`` (or ``"bfloat16"``), and
    ``param_init_fn`` as a callable, a registered name or ``dict(type=name, ...)``. Config
    objects passed in are never mutated. ``device_id`` defaults to this rank's device
    (``comm_wrappers.backends.rank_device`` of ``process_group``): its local rank's
    accelerator, or the CPU under gloo. Validation and testing run through the sharded
    forward.

    Args:
        module: The model.
        process_group: The group to shard over; default the world.
        sharding_strategy: ``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD``, ``HYBRID_SHARD``...
        cpu_offload: Keep parameters (and gradients) on the CPU between uses. A no-op when
            FSDP runs on the CPU (the parameters are there already).
        auto_wrap_policy: Which submodules become their own FSDP unit.
        backward_prefetch: ``BACKWARD_PRE`` or ``BACKWARD_POST``.
        mixed_precision: Dtypes for parameters, gradient reduction and buffers.
        param_init_fn: Materialises a module built on the meta device.
        use_orig_params: Keep the original parameters visible to the optimizer.
        ignored_modules: Modules (or their names) not to shard.
        **kwargs: Other ``FullyShardedDataParallel`` keywords, unchanged.

    Raises:
        NotInitializedError: No process group is initialised.
        ValueError: An option name is unknown (the message lists the valid ones).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: ProcessGroup | None = None,
        sharding_strategy: str | ShardingStrategy | None = None,
        cpu_offload: bool | dict[str, Any] | CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: str | BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: dict[str, Any] | str | MixedPrecision | None = None,
        param_init_fn: Any = None,
        use_orig_params: bool = True,
        ignored_modules: Any = None,
        **kwargs: Any,
    ) -> None:
        require_process_group(type(self).__name__)
        if "device_id" not in kwargs:  # the device of the group FSDP will communicate on
            mesh = kwargs.get("device_mesh")
            group = process_group if mesh is None else mesh.get_group(0)
            kwargs["device_id"] = rank_device(group)
        offload = _coerce_cpu_offload(cpu_offload)
        if offload is not None and torch.device(kwargs["device_id"]).type == "cpu":
            # The parameters live on the CPU already, and torch's offload path pins memory,
            # which needs an accelerator: on a CPU device offloading is a no-op.
            offload = CPUOffload(offload_params=False)
        super().__init__(
            module,
            process_group=process_group,
            sharding_strategy=coerce_enum(sharding_strategy, ShardingStrategy, "sharding_strategy"),
            cpu_offload=offload,
            auto_wrap_policy=coerce_auto_wrap_policy(auto_wrap_policy, module),
            backward_prefetch=coerce_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch"),
            mixed_precision=coerce_mixed_precision(
                mixed_precision, MixedPrecision, _MIXED_PRECISION_FIELDS
            ),
            param_init_fn=coerce_param_init_fn(param_init_fn),
            use_orig_params=use_orig_params,
            ignored_modules=coerce_modules(ignored_modules, module, "ignored_modules"),
            **kwargs,
        )

    _infer_through_wrapper = True
