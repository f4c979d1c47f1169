"""Dtype names as configs write them (``"bf16"``, ``"torch.float16"``) turned into torch dtypes."""

from __future__ import annotations

import torch

__all__ = ["to_dtype"]

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
}


def to_dtype(value: str | torch.dtype, name: str) -> torch.dtype:
    """Turn ``"bfloat16"``, ``"bf16"``, ``torch.bfloat16``... into a torch dtype.

    Args:
        value: A torch dtype, or one of the names above (case-insensitive, with or without
            ``"torch."``).
        name: The option's name, for the error message.

    Raises:
        ValueError: ``value`` names no dtype known here (the message lists the names).

    Examples:
        >>> to_dtype("bf16", "dtype")
        torch.bfloat16
    """
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.lower().removeprefix("torch.")]
    message = f"{name} must be a torch.dtype or one of {sorted(_DTYPES)}, got {value!r}"
    raise ValueError(message)
