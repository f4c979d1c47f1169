"""The names of a checkpoint folder's parts (one place: writers, readers and convert)."""

from __future__ import annotations

MODEL_FILE = "model.pt"
OPTIM_FILE = "optim.pt"
DCP_FOLDER = "dcp"
DS_FOLDER = "deepspeed"
DS_TAG = "state"
SCHEDULERS_FILE = "schedulers.pt"
SCALER_FILE = "scaler.pt"
EXTRA_FILE = "extra.pt"
RNG_FOLDER = "rng"
# The key of the one optimizer of a plain wrapper in optim.pt / DCP / scaler.pt.
DEFAULT_KEY = "default"
