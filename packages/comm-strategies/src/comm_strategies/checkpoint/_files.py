"""Writing the checkpoint's files (private, atomic), and each rank's random generator
states (``rng/rank_N.json``): taken, written, read back checked, and set. Reading torch
files safely is `_reading`'s."""

from __future__ import annotations

import base64
import functools
import json
import os
import random
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ._errors import CheckpointError
from ._layout import RNG_FOLDER
from ._reading import first_line, load_tensor_file


def fsync_enabled() -> bool:
    """Whether files are flushed to the disk before the rename (``COMM_CHECKPOINT_FSYNC=1``).

    Off by default: the temporary name and the rename already protect a checkpoint from a
    killed process (the kernel keeps what was written); flushing protects it from a power
    cut too, at the price of waiting for the disk.
    """
    return os.environ.get("COMM_CHECKPOINT_FSYNC", "0").lower() in ("1", "true", "yes", "on")


def save_tensor_file(obj: Any, path: Path) -> None:
    """``torch.save`` to a private file (0600), through a temporary name and a rename (its
    folder created, private, when missing)."""
    write_private(path, lambda handle: torch.save(obj, handle))


def write_json(obj: Any, path: Path, *, compact: bool = False) -> None:
    """Write JSON as `save_tensor_file` writes; ``compact``: on one line, keys unsorted."""
    text = json.dumps(obj) if compact else json.dumps(obj, indent=1, sort_keys=True)
    write_private(path, lambda handle: handle.write(text.encode() + b"\n"))


def write_private(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write`` a private file (0600) under a unique temporary name, removed if it fails,
    then renamed to ``path`` (its folder created, private, when missing)."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial-{uuid.uuid4().hex[:8]}")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            if fsync_enabled():
                os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def save_file(obj: Any, path: Path) -> None:
    """A file of a checkpoint: JSON (compact) for a ``.json`` name, else ``torch.save``;
    private, through a temporary name and a rename."""
    if path.suffix == ".json":
        write_json(obj, path, compact=True)
    else:
        save_tensor_file(obj, path)


def rng_file(folder: Path, rank: int) -> Path:
    """Where ``rank``'s generator states are in a checkpoint folder."""
    return folder / RNG_FOLDER / f"rank_{rank}.json"


def capture_rng() -> dict[str, Any]:
    """Python's, NumPy's (if installed), torch's CPU and every CUDA device's generator
    states, as JSON values: the states' numbers as lists, torch's bytes in base64."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch": _encode(torch.get_rng_state()),
    }
    numpy = _numpy()
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [_encode(device) for device in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the generators from a `read_rng_file` result (NumPy's and CUDA's when present
    here); nothing in it can fail half-way, `read_rng_file` checked every state."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        numpy.random.set_state(state["numpy"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def read_rng_file(folder: Path, rank: int, *, allow_unsafe_pickle: bool = False) -> dict[str, Any]:
    """``rank``'s generator states in a checkpoint folder (`rng_json`), decoded and each
    taken by a spare generator of its kind first, ready for `restore_rng`.

    Raises:
        CheckpointError: The file is missing, truncated or corrupt (before any generator
            is set: a load reads it before its entry, which shares the outcome).
    """
    saved, numpy = rng_json(folder, rank, allow_unsafe_pickle=allow_unsafe_pickle), _numpy()
    try:
        python, kept = saved["python"], saved.get("numpy")
        state: dict[str, Any] = {
            "python": (python["version"], tuple(python["state"]), python.get("gauss")),
            "torch": _decode(saved["torch"]),
            "cuda": [_decode(device) for device in saved.get("cuda", [])],
        }
        _spare(random.Random).setstate(state["python"])
        torch.Generator().set_state(state["torch"])
        for device in state["cuda"] if torch.cuda.is_available() else []:
            torch.Generator("cuda").set_state(device)
        if numpy is not None and kept is not None:
            keys = numpy.asarray(kept["keys"], dtype="uint32")
            state["numpy"] = (
                kept["kind"],
                keys,
                kept["pos"],
                kept["has_gauss"],
                kept["cached_gaussian"],
            )
            _spare(numpy.random.RandomState).set_state(state["numpy"])
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError) as error:
        raise _corrupt(rng_file(folder, rank), error) from error
    return state


def rng_json(folder: Path, rank: int, *, allow_unsafe_pickle: bool = False) -> dict[str, Any]:
    """``rank``'s generator states in a checkpoint folder as `capture_rng` gives them:
    ``rng/rank_N.json``, or the torch file ``rng/rank_N.pt`` of layout version 1.

    Raises:
        CheckpointError: The file is missing or cannot be read.
    """
    path = rng_file(folder, rank)
    legacy = path.with_suffix(".pt")
    try:
        if path.is_file() or not legacy.is_file():
            state = json.loads(path.read_bytes())
            if not isinstance(state, dict):
                raise ValueError(f"a JSON {type(state).__name__}, not an object")
            return state
        old = load_tensor_file(legacy, allow_unsafe_pickle=allow_unsafe_pickle, what="RNG state")
        python, numpy = old["python"], old.get("numpy")
        state = {
            "python": {"gauss": None, **python, "state": python["state"].tolist()},
            "torch": _encode(old["torch"]),
        }
        if numpy is not None:
            state["numpy"] = {**numpy, "keys": numpy["keys"].tolist()}
        if "cuda" in old:
            state["cuda"] = [_encode(device) for device in old["cuda"]]
        return state
    except FileNotFoundError:
        message = f"RNG state {path} (or {legacy.name}, layout version 1) does not exist"
        raise CheckpointError(message) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise _corrupt(path, error) from error


@functools.cache
def _spare(kind: Any) -> Any:
    """One generator of ``kind`` kept for checking states (making one costs more)."""
    return kind(0)


def _corrupt(path: Path, error: BaseException) -> CheckpointError:
    return CheckpointError(
        f"RNG state {path} is truncated or corrupt ({first_line(error)}). Load an "
        "earlier checkpoint, or pass load_rng=False to keep this rank's generators."
    )


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(state: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(state, validate=True)), dtype=torch.uint8)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
