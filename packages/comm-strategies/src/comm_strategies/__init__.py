"""comm-strategies: single, DDP, FSDP, DeepSpeed and model-parallel strategies for any loop.

Examples:
    >>> import torch
    >>> from comm_strategies import build_strategy
    >>> strategy = build_strategy("single", seed=0)
    >>> model, optim_wrapper, _ = strategy.prepare(
    ...     torch.nn.Linear(2, 1), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1))
    ... )
    >>> optim_wrapper.update_params(model(torch.ones(3, 2)).sum())
"""

from .__about__ import __version__
from ._sampler import ElasticSampler
from .base import Strategy
from .ddp import DDPStrategy
from .deepspeed import DeepSpeedStrategy
from .fsdp import FSDPStrategy
from .model_parallel import ModelParallelStrategy
from .registry import ENTRY_POINT_GROUP, available_strategies, build_strategy, register_strategy
from .single import SingleDeviceStrategy

__all__ = [
    "ENTRY_POINT_GROUP",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "ElasticSampler",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "__version__",
    "available_strategies",
    "build_strategy",
    "register_strategy",
]
