"""MMEngine runner state as what ``torch.load(weights_only=True)`` reads, and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from mmengine.logging import HistoryBuffer

__all__ = ["decode_message_hub", "encode_message_hub", "plain"]


def encode_message_hub(state: Any) -> Any:
    """Turn MessageHub's HistoryBuffers into plain lists (loadable with weights_only)."""
    if not isinstance(state, Mapping) or "log_scalars" not in state:
        return state
    out = dict(state)
    out["log_scalars"] = {
        key: {
            "__history_buffer__": True,
            "log": [float(v) for v in getattr(buffer, "_log_history", [])],
            "count": [int(v) for v in getattr(buffer, "_count_history", [])],
            "max_length": int(getattr(buffer, "max_length", 1000000)),
        }
        for key, buffer in state["log_scalars"].items()
    }
    return out


def plain(value: Any) -> Any:
    """Numpy scalars and arrays (MessageHub's runtime info) as Python values and tensors.

    Our checkpoint files load with ``weights_only=True``, which refuses numpy objects.
    """
    kind = type(value).__module__
    if kind == "numpy" or kind.startswith("numpy."):
        if hasattr(value, "shape") and getattr(value, "ndim", 0) > 0:
            return torch.from_numpy(value.copy())
        if hasattr(value, "item"):
            return value.item()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(item) for item in value)
    return value


def decode_message_hub(state: Any) -> Any:
    if not isinstance(state, Mapping) or "log_scalars" not in state:
        return state
    out = dict(state)
    scalars = {}
    for key, value in state["log_scalars"].items():
        if isinstance(value, Mapping) and value.get("__history_buffer__"):
            scalars[key] = HistoryBuffer(value["log"], value["count"], value["max_length"])
        else:
            scalars[key] = value
    out["log_scalars"] = scalars
    return out
