"""One checkpoint contract for every strategy: save under one, load under any other.

A checkpoint is a folder: ``manifest.json`` (written last: strategy, world size, format,
ZeRO stage or FSDP sharding, parameter names, shapes and dtypes, versions), the model
and optimizer state (``model.pt``/``optim.pt`` full, ``dcp/`` sharded with torch
distributed checkpoint, or ``deepspeed/`` with DeepSpeed's own files), ``schedulers.pt``,
``scaler.pt``, ``extra.pt`` (user state) and ``rng/rank_R.json``. Our torch files load
with ``torch.load(weights_only=True)``; the manifest and the RNG files are JSON.

Examples:
    >>> import tempfile, torch
    >>> from comm_strategies import checkpoint
    >>> model = torch.nn.Linear(2, 1)
    >>> path = checkpoint.save_checkpoint(tempfile.mkdtemp() + "/step_5", model=model,
    ...                                   strategy="single", extra={"step": 5})
    >>> checkpoint.read_manifest(path).strategy
    'single'
    >>> checkpoint.load_checkpoint(path, model=torch.nn.Linear(2, 1))
    {'step': 5}
"""

from ._consensus import SaveHandle
from ._convert import convert_checkpoint
from ._errors import CheckpointError
from ._load import find_latest, load_checkpoint
from ._manifest import Manifest, read_manifest
from ._save import save_checkpoint
from ._state import (
    full_model_state_dict,
    full_optim_state_dict,
    load_full_model_state_dict,
    load_full_optim_state_dict,
)

__all__ = [
    "CheckpointError",
    "Manifest",
    "SaveHandle",
    "convert_checkpoint",
    "find_latest",
    "full_model_state_dict",
    "full_optim_state_dict",
    "load_checkpoint",
    "load_full_model_state_dict",
    "load_full_optim_state_dict",
    "read_manifest",
    "save_checkpoint",
]

for _name in __all__:
    _object = globals()[_name]
    if hasattr(_object, "__module__"):
        try:
            _object.__module__ = __name__
        except (AttributeError, TypeError):
            pass
del _name, _object
