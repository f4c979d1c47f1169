"""`backend_of`: the one place where the backend of a model is decided."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from .._registry import _fsdp2_module_type
from ._base import Backend
from ._ddp import DDPBackend
from ._deepspeed import DeepSpeedBackend, engine_of
from ._dtensor import DTensorBackend, is_dtensor_model
from ._fsdp1 import FSDP1Backend
from ._fsdp2 import FSDP2Backend

__all__ = ["backend_of"]


def backend_of(model: Any) -> Backend:
    """Return the adapter of ``model``'s backend, decided here once.

    In this order: a DeepSpeed engine (or a wrapper holding one, such as
    ``MMDeepSpeedEngineWrapper``), FSDP1 (a ``FullyShardedDataParallel`` in the module
    tree), DTensor parameters on an N-D mesh or on several meshes (tensor parallel, FSDP2 +
    tensor parallel, HSDP), FSDP2 (a module sharded with ``fully_shard`` in the tree), DDP (a
    ``DistributedDataParallel`` in the tree: also separate DDP's children), else a plain
    module. Nothing is cached: callers keep the adapter for the model if they like, and
    may pass it wherever a model goes (an adapter is returned as it is).

    Args:
        model: What a strategy or the user prepared: a module, or a DDP, FSDP1, FSDP2 or
            DeepSpeed wrapper; or its adapter.

    Returns:
        A `Backend` whose ``kind`` is ``"module"``, ``"ddp"``, ``"fsdp1"``, ``"fsdp2"``,
        ``"dtensor"`` or ``"deepspeed"``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Examples:
        >>> import torch
        >>> from comm_wrappers.backends import backend_of
        >>> backend_of(torch.nn.Linear(2, 1)).kind
        'module'
    """
    if isinstance(model, Backend):
        return model
    if not isinstance(model, nn.Module):
        message = (
            "model must be the nn.Module a strategy prepared, or any module to train or "
            f"checkpoint (a module, or a DDP, FSDP or DeepSpeed wrapper), got {type(model).__name__}"
        )
        raise TypeError(message)
    engine = engine_of(model)
    if engine is not None:
        return DeepSpeedBackend(model, engine)
    fsdp2 = _fsdp2_module_type()
    sharded = ddp = False
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            return FSDP1Backend(model)
        sharded = sharded or (fsdp2 is not None and isinstance(module, fsdp2))
        ddp = ddp or isinstance(module, DistributedDataParallel)
    if (sharded or not ddp) and is_dtensor_model(model):
        return DTensorBackend(model)
    if sharded:
        return FSDP2Backend(model)
    return DDPBackend(model) if ddp else Backend(model)
