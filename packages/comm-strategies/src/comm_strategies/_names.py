"""The one rule for the names wrappers add to a model's parameter names.

DDP (and MMEngine's checkpoints) put ``module.`` in front, ``torch.compile`` inserts
``_orig_mod.``, FSDP1 ``_fsdp_wrapped_module.`` and activation checkpointing
``_checkpoint_wrapped_module.``: the user's module knows none of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Segments a wrapper inserts anywhere in a name (whole segments: ``x_orig_mod.w`` keeps its).
_INSERTED = re.compile(
    r"(?:^|(?<=\.))(?:_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)\."
)
# Prefixes a wrapper (DDP, MMEngine's model wrappers) puts in front of every name.
_LEADING = re.compile(r"^(?:module\.|model\.module\.)+")


def clean_name(name: str) -> str:
    """``name`` without the segments wrappers insert (``_orig_mod.``, FSDP's...)."""
    return _INSERTED.sub("", name)


def strip_prefixes(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict's names without wrapper segments nor leading ``module.`` prefixes."""
    return {_LEADING.sub("", clean_name(key)): value for key, value in state.items()}
