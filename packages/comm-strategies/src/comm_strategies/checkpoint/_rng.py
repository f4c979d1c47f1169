"""Per-rank random number generator states in forms that ``weights_only`` loading accepts."""

from __future__ import annotations

import random
from typing import Any

import torch


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def capture() -> dict[str, Any]:
    """Python's, NumPy's (if installed), torch's CPU and every CUDA device's RNG state."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64)},
        "torch": torch.get_rng_state(),
    }
    if gauss is not None:
        state["python"]["gauss"] = gauss
    numpy = _numpy()
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Set the generators from a `capture` result (NumPy's and CUDA's when present here)."""
    python = state["python"]
    internal = tuple(int(value) for value in python["state"].tolist())
    random.setstate((python["version"], internal, python.get("gauss")))
    torch.set_rng_state(state["torch"])
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        saved = state["numpy"]
        keys = saved["keys"].numpy().astype("uint32")
        numpy.random.set_state(
            (saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
        )
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)
