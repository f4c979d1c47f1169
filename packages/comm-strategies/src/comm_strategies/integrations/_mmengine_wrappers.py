"""comm's model wrappers as MMEngine's classic ``Runner`` builds them (``Comm*``).

Registered in MMEngine's ``MODEL_WRAPPERS`` by ``_mmengine_runner``. Built by a
``Runner`` (its ``wrap_model``, from ``model_wrapper_cfg``), each gives that runner a
`CommRunnerHook` unless it has one (`attach_runner_hook`).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn

import comm_collectives as dist
from comm_wrappers import (
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    MMSeparateDistributedDataParallel,
)

from ._mmengine_hook import attach_runner_hook

__all__ = [
    "CommDistributedDataParallel",
    "CommFullyShardedDataParallel",
    "CommFullyShardedDataParallel2",
    "CommSeparateDistributedDataParallel",
]


def _module_on_cpu(module: nn.Module) -> bool:
    for parameter in module.parameters():
        return parameter.device.type == "cpu"
    for buffer in module.buffers():
        return buffer.device.type == "cpu"
    return True


def _without_cpu_device_ids(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop ``device_ids`` / ``output_device`` for a module on the CPU.

    MMEngine's ``Runner`` passes ``device_ids=[LOCAL_RANK]`` to every DDP subclass it
    builds, which torch refuses for a CPU module; a CPU module takes none.
    """
    if _module_on_cpu(module):
        kwargs = dict(kwargs)
        kwargs.pop("device_ids", None)
        kwargs.pop("output_device", None)
        kwargs["device_ids"] = None
    return kwargs


def _attach_to_building_runner() -> None:
    """Give the ``Runner`` whose ``wrap_model`` is building this wrapper a `CommRunnerHook`.

    The runner is the ``self`` of the nearest ``wrap_model`` frame that is a ``Runner``'s
    (MMEngine's ``wrap_model`` builds ``model_wrapper_cfg`` through ``MODEL_WRAPPERS``); a
    wrapper built anywhere else (by hand, or by ``FlexibleRunner``'s strategies) changes
    nothing. The hook is attached once (`attach_runner_hook`).
    """
    runner_module = sys.modules.get("mmengine.runner.runner")
    if runner_module is None:  # no Runner can exist before its module is imported
        return
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "wrap_model":
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, runner_module.Runner):
                attach_runner_hook(candidate)
                return
        frame = frame.f_back


class CommDistributedDataParallel(MMDistributedDataParallel):
    """comm's `MMDistributedDataParallel` as MMEngine's ``Runner`` builds it.

    The same wrapper; ``device_ids`` (which the runner passes as ``[LOCAL_RANK]``) is
    dropped for a module on the CPU, so a config runs under gloo.

    Args:
        module: The model.
        detect_anomalous_params: See `MMDistributedDataParallel`.
        **ddp_kwargs: ``DistributedDataParallel`` keywords.
    """

    def __init__(
        self, module: nn.Module, detect_anomalous_params: bool = False, **ddp_kwargs: Any
    ) -> None:
        super().__init__(
            module,
            detect_anomalous_params=detect_anomalous_params,
            **_without_cpu_device_ids(module, ddp_kwargs),
        )
        _attach_to_building_runner()


class CommSeparateDistributedDataParallel(MMSeparateDistributedDataParallel):
    """comm's `MMSeparateDistributedDataParallel` as MMEngine's ``Runner`` builds it.

    ``device_ids`` is dropped for a module on the CPU (each child's DDP takes none there).

    Args:
        module: The model; its direct children are wrapped.
        **kwargs: The keywords of `MMSeparateDistributedDataParallel` (``broadcast_buffers``,
            ``find_unused_parameters``, other DDP keywords).
    """

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        if _module_on_cpu(module):
            kwargs = {k: v for k, v in kwargs.items() if k not in ("device_ids", "output_device")}
        super().__init__(module, **kwargs)
        _attach_to_building_runner()


def _init_before_sharding(module: nn.Module) -> None:
    """Run the model's ``init_weights`` and make rank 0's values everyone's, before sharding.

    The ``Runner`` calls ``init_weights`` after wrapping and then broadcasts each tensor of
    ``model.module.state_dict()``: on shards of different sizes per rank. `CommRunnerHook`
    skips that step for sharded wrappers; it happens here instead, on the whole model.
    """
    init = getattr(module, "init_weights", None)
    if callable(init) and not getattr(module, "is_init", False):
        init()
    for tensor in [*module.parameters(), *module.buffers()]:
        with torch.no_grad():
            dist.broadcast(tensor, src=0)


class CommFullyShardedDataParallel2(MMFullyShardedDataParallel2):
    """comm's FSDP2 wrapper (`MMFullyShardedDataParallel2`) registered for the ``Runner``.

    Built by ``dict(type="CommFullyShardedDataParallel", fsdp_version=2, ...)``. The
    model's ``init_weights`` runs before sharding, and rank 0's values are broadcast.
    """

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        _init_before_sharding(module)
        super().__init__(module, **kwargs)
        _attach_to_building_runner()


class CommFullyShardedDataParallel(MMFullyShardedDataParallel):
    """comm's FSDP for MMEngine's ``Runner``: FSDP1, or FSDP2 with ``fsdp_version=2``.

    ``fsdp_version=1`` (the default) builds this class (comm's `MMFullyShardedDataParallel`,
    torch's ``FullyShardedDataParallel``); ``fsdp_version=2`` builds a
    `CommFullyShardedDataParallel2` (``fully_shard``), with the same option forms. The
    model's ``init_weights`` runs before sharding, and rank 0's values are broadcast.
    Built by the ``Runner`` (``model_wrapper_cfg``), either version gives that runner the
    `CommRunnerHook` it needs (once; one added by hand is used instead).

    Args:
        module: The model.
        fsdp_version: 1 or 2.
        **kwargs: The chosen wrapper's options (``sharding_strategy``,
            ``auto_wrap_policy``, ``mixed_precision``, ...).

    Raises:
        ValueError: ``fsdp_version`` is neither 1 nor 2.
    """

    def __new__(cls, module: nn.Module, fsdp_version: int = 1, **kwargs: Any) -> Any:
        if fsdp_version not in (1, 2) or isinstance(fsdp_version, bool):
            message = f"fsdp_version must be 1 or 2, got {fsdp_version!r}"
            raise ValueError(message)
        if fsdp_version == 2:
            return CommFullyShardedDataParallel2(module, **kwargs)
        return super().__new__(cls)

    def __init__(self, module: nn.Module, fsdp_version: int = 1, **kwargs: Any) -> None:
        _init_before_sharding(module)
        super().__init__(module, **kwargs)
        _attach_to_building_runner()
