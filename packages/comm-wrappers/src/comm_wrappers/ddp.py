"""`MMDistributedDataParallel`: torch DDP with MMEngine's step API, right on CPU."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from comm_collectives import NotInitializedError, is_distributed

from ._registry import module_device, register_model_wrapper
from ._step import StepMixin

__all__ = ["MMDistributedDataParallel", "require_process_group"]


def require_process_group(wrapper: str) -> None:
    """Raise `NotInitializedError` with the fix when no default process group exists."""
    if not is_distributed():
        message = (
            f"{wrapper} needs a process group and none is initialised in this process. "
            "Call comm_collectives.init_dist('pytorch') (or 'slurm', 'mpi') first, under a "
            "launcher; for one process: torchrun --nproc-per-node 1 your_script.py."
        )
        raise NotInitializedError(message)


@register_model_wrapper
class MMDistributedDataParallel(StepMixin, DistributedDataParallel):
    """``DistributedDataParallel`` with ``train_step``, ``val_step`` and ``test_step``.

    The training forward runs through DDP, so gradients are all-reduced; validation and
    testing call the module's own ``val_step``/``test_step`` when it has them, else its
    preprocessor and ``forward(mode="predict")``, without a gradient sync.

    Args:
        module: The model (MMEngine ``BaseModel`` contract, or a `LossModel`).
        detect_anomalous_params: After each forward, warn (`AnomalousParameterWarning`)
            with the name of every parameter that requires grad and took no part in the
            loss. Slow: for debugging.
        **ddp_kwargs: Passed to ``DistributedDataParallel`` unchanged (``device_ids``,
            ``output_device``, ``broadcast_buffers``, ``find_unused_parameters``,
            ``bucket_cap_mb``, ``gradient_as_bucket_view``, ...). ``device_ids`` defaults
            to None for a module on the CPU, and to the module's device on an accelerator.

    Raises:
        NotInitializedError: No process group is initialised.
    """

    def __init__(
        self, module: nn.Module, detect_anomalous_params: bool = False, **ddp_kwargs: Any
    ) -> None:
        require_process_group(type(self).__name__)
        if "device_ids" not in ddp_kwargs:
            device = module_device(module)
            ddp_kwargs["device_ids"] = None if device.type == "cpu" else [device]
        super().__init__(module=module, **ddp_kwargs)
        self.detect_anomalous_params = detect_anomalous_params
