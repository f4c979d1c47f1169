"""Backend adapters: what each backend knows, decided once per model.

`backend_of` decides which backend a model runs on (plain module, DDP, FSDP1, FSDP2 or
DeepSpeed) and returns its `Backend`: the gradient sync, whole-model clipping, gradient
scaler and compute device that optimizer wrappers need, and the state dicts, natural
checkpoint format and description that checkpoints need, with the backend's own
checkpoint files where it has them (`Backend.native_checkpoint`, a `NativeCheckpoint`).
The layers above ask it and never branch on the kind of model. `rank_device` is the one
rule for this rank's device.

Examples:
    >>> import torch
    >>> from comm_wrappers.backends import backend_of
    >>> backend = backend_of(torch.nn.Linear(2, 1))
    >>> backend.describe()
    {'wrapper': 'module', 'sharding': None, 'zero_stage': None}
"""

from ._base import Backend
from ._device import rank_device
from ._native import NativeCheckpoint
from ._select import backend_of
from ._state import describe_params, quiet_torch

__all__ = [
    "Backend",
    "NativeCheckpoint",
    "backend_of",
    "describe_params",
    "quiet_torch",
    "rank_device",
]
