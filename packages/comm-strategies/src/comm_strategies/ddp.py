"""`DDPStrategy`: data parallel training with `MMDistributedDataParallel`."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from torch import nn

from comm_wrappers import MMDistributedDataParallel, MMSeparateDistributedDataParallel
from comm_wrappers.backends import rank_device

from .base import Strategy

__all__ = ["DDPStrategy"]

_DDP_WRAPPER_TYPES: dict[str, type[nn.Module]] = {
    "MMDistributedDataParallel": MMDistributedDataParallel,
    "MMSeparateDistributedDataParallel": MMSeparateDistributedDataParallel,
}


class DDPStrategy(Strategy):
    """Replicate the model on every rank and all-reduce gradients (DDP).

    The model goes to the rank's device (the CPU with gloo, ``cuda:LOCAL_RANK`` with NCCL:
    the local rank comes from comm_core, never from a raw environment variable) and is
    wrapped in `MMDistributedDataParallel` (no ``device_ids`` on the CPU).

    Args:
        model_wrapper: Options of the wrapper, e.g. ``dict(find_unused_parameters=True)``,
            or ``dict(type="MMSeparateDistributedDataParallel")`` for one DDP per submodule
            (GANs). Not mutated.
        sync_bn: ``"torch"`` converts ``BatchNorm`` layers to ``SyncBatchNorm``.
        **kwargs: See `Strategy`.
    """

    name = "ddp"

    def __init__(
        self,
        *,
        model_wrapper: Mapping[str, Any] | None = None,
        sync_bn: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if sync_bn not in (None, "torch"):
            message = f"sync_bn must be None or 'torch', got {sync_bn!r}"
            raise ValueError(message)
        self.model_wrapper = copy.deepcopy(dict(model_wrapper or {}))
        kind = self.model_wrapper.get("type", "MMDistributedDataParallel")
        if isinstance(kind, str) and kind not in _DDP_WRAPPER_TYPES:
            message = f"model_wrapper type must be one of {', '.join(_DDP_WRAPPER_TYPES)} or a class, got {kind!r}"
            raise ValueError(message)
        self.sync_bn = sync_bn

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        options = copy.deepcopy(self.model_wrapper)
        kind = options.pop("type", "MMDistributedDataParallel")
        wrapper = _DDP_WRAPPER_TYPES[kind] if isinstance(kind, str) else kind
        if self.sync_bn == "torch":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
        model = model.to(rank_device())
        wrapped: nn.Module = wrapper(model, **options)
        return wrapped
