"""comm-wrappers: DDP, separate-DDP, FSDP1/FSDP2 and DeepSpeed wrappers with one step API.

MMEngine's class names, call shapes and behaviour (``train_step(data, optim_wrapper)``,
``val_step``, ``test_step``), right on CPU (gloo) as on CUDA. DeepSpeed lives in
``comm_wrappers.deepspeed`` (the ``deepspeed`` extra).

Examples:
    >>> import torch
    >>> from comm_wrappers import LossModel, OptimWrapper, unwrap_model
    >>> model = LossModel(torch.nn.Linear(2, 1), torch.nn.MSELoss())
    >>> unwrap_model(model) is model
    True
"""

from .__about__ import __version__
from ._fsdp_options import register_param_init_fn
from ._model import LossModel, parse_losses
from ._registry import is_model_wrapper, register_model_wrapper, unwrap_model
from ._step import AnomalousParameterWarning, find_unused_parameters
from .ddp import MMDistributedDataParallel
from .fsdp import MMFullyShardedDataParallel
from .fsdp2 import MMFullyShardedDataParallel2
from .optim import AmpOptimWrapper, OptimWrapper, OptimWrapperDict
from .separate_ddp import MMSeparateDistributedDataParallel

__all__ = [
    "AmpOptimWrapper",
    "AnomalousParameterWarning",
    "LossModel",
    "MMDistributedDataParallel",
    "MMFullyShardedDataParallel",
    "MMFullyShardedDataParallel2",
    "MMSeparateDistributedDataParallel",
    "OptimWrapper",
    "OptimWrapperDict",
    "__version__",
    "find_unused_parameters",
    "is_model_wrapper",
    "parse_losses",
    "register_model_wrapper",
    "register_param_init_fn",
    "unwrap_model",
]
