"""Writing and reading the checkpoint's files: private, atomic, safe to load."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from ._errors import CheckpointError
from ._rng import numpy_safe_globals

# The classes DeepSpeed pickles into its checkpoint files besides tensors and builtins:
# plain records, rebuilt from their fields (no code of their own runs).
_DEEPSPEED_RECORDS = (
    ("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
    ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
    ("deepspeed.utils.tensor_fragment", ("fragment_address",)),
)


def deepspeed_safe_globals() -> list[Any]:
    """DeepSpeed's record classes (and NumPy's values) for ``weights_only`` loading."""
    allowed: list[Any] = numpy_safe_globals()
    for module_name, names in _DEEPSPEED_RECORDS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        allowed += [getattr(module, name) for name in names if hasattr(module, name)]
    return allowed


def fsync_enabled() -> bool:
    """Whether files are flushed to the disk before the rename (``COMM_CHECKPOINT_FSYNC=1``).

    Off by default: the temporary name and the rename already protect a checkpoint from a
    killed process (the kernel keeps what was written); flushing protects it from a power
    cut too, at the price of waiting for the disk.
    """
    return os.environ.get("COMM_CHECKPOINT_FSYNC", "0").lower() in ("1", "true", "yes", "on")


UNSAFE_HINT = (
    "Load it only if you trust its source, with allow_unsafe_pickle=True (it runs "
    "torch.load(weights_only=False), which can execute code stored in the file)"
)


def save_tensor_file(obj: Any, path: Path) -> None:
    """``torch.save`` to a private file (0600), through a temporary name and a rename."""
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        if fsync_enabled():
            os.fsync(handle.fileno())
    os.replace(partial, path)


def write_json(obj: Any, path: Path) -> None:
    """Write JSON to a private file, through a temporary name and a rename."""
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(obj, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        if fsync_enabled():
            os.fsync(handle.fileno())
    os.replace(partial, path)


def load_tensor_file(
    path: Path, *, allow_unsafe_pickle: bool = False, mmap: bool = False, what: str = "file"
) -> Any:
    """``torch.load`` with ``weights_only=True`` unless the caller opted in; clear errors.

    Raises:
        CheckpointError: Missing, truncated or corrupt file, or one that needs full
            unpickling without the opt-in.
    """
    if not path.is_file():
        message = f"{what} {path} does not exist"
        raise CheckpointError(message)
    is_zip = zipfile.is_zipfile(path)
    foreign = None if is_zip else _not_a_torch_file(path)
    if foreign is not None:
        message = (
            f"{what} {path} is not a checkpoint: it is {foreign}. Expected a file written "
            "by torch.save (a zip archive, or a pickle from torch before 1.6) or a comm "
            "checkpoint folder"
        )
        raise CheckpointError(message)
    try:
        with torch.serialization.safe_globals(numpy_safe_globals()):
            return torch.load(
                path,
                map_location="cpu",
                weights_only=not allow_unsafe_pickle,
                mmap=mmap and is_zip,
            )
    except pickle.UnpicklingError as error:
        text = str(error)
        detail = _weights_only_detail(text)
        if allow_unsafe_pickle or not _refused_by_weights_only(text):
            last = [line.strip() for line in text.splitlines() if line.strip()]
            message = (
                f"{what} {path} is truncated or corrupt: it cannot be unpickled "
                f"({last[-1] if last else 'no detail'}; is it a torch.save file?)"
            )
            raise CheckpointError(message) from error
        message = (
            f"{what} {path} holds objects that torch.load(weights_only=True) refuses "
            f"({detail}). {UNSAFE_HINT}."
        )
        raise CheckpointError(message) from error
    # the weights-only unpickler also stops on stray bytes (a text file) with a bare
    # KeyError or IndexError
    except (
        RuntimeError,
        EOFError,
        OSError,
        ValueError,
        KeyError,
        IndexError,
        zipfile.BadZipFile,
    ) as error:
        size = path.stat().st_size
        message = (
            f"{what} {path} is truncated or corrupt ({size} bytes; torch.load says: "
            f"{_first_line(error)}). Load an earlier checkpoint (find_latest skips folders "
            "without a manifest, not damaged files inside one)."
        )
        raise CheckpointError(message) from error


# What torch's weights-only unpickler says when it refuses an object (not a damaged file,
# which it reports as an "Unsupported operand"): a class it does not allow ("Unsupported
# global"), a function of a blocked module such as os.system ("unsupported GLOBAL
# posix.system whose module posix is blocked"), or a call of an unknown function.
_REFUSALS = ("unsupported global", "is blocked", "unrecognized function", "unsupported class")


def _refused_by_weights_only(text: str) -> bool:
    lowered = text.lower()
    return any(mark in lowered for mark in _REFUSALS)


def _weights_only_detail(text: str) -> str:
    """The line of torch's weights-only error that names the refused object."""
    for line in text.splitlines():
        if _refused_by_weights_only(line) or "WeightsUnpickler error" in line:
            return line.strip()
    lines = text.strip().splitlines()
    return lines[0] if lines else "no detail"


def _not_a_torch_file(path: Path) -> str | None:
    """What a file that is neither a zip archive nor a pickle is (None: it may be torch's)."""
    with path.open("rb") as handle:
        head = handle.read(256)
    if not head:
        return "empty (0 bytes)"
    if head[:1] == b"\x80" or head[:4] == b"PK\x03\x04":
        return None  # a pickle (torch before 1.6), or a zip archive (torch's; maybe cut)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"binary data of another format (it starts with {head[:8]!r})"
    first = text.strip().splitlines()[0][:40] if text.strip() else ""
    return f"a text file (it starts with {first!r})"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
