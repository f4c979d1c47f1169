"""Reading the checkpoint's torch files safely: ``torch.load(weights_only=True)`` unless
the caller opted in, and clear errors for a missing, truncated, foreign or legacy file."""

from __future__ import annotations

import pickle
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ._errors import CheckpointError, outside_package

UNSAFE_HINT = (
    "Load it only if you trust its source, with allow_unsafe_pickle=True (it runs "
    "torch.load(weights_only=False), which can execute code stored in the file)"
)


def numpy_safe_globals() -> list[Any]:
    """NumPy's scalar, array and dtype constructors, for ``weights_only`` loading.

    User state often holds NumPy numbers (MMEngine's runtime info, logged metrics). These
    constructors rebuild values from bytes and a dtype, and run no other code, which is why
    torch's documentation suggests allowing them.
    """
    try:
        import numpy
    except ImportError:
        return []
    core = getattr(numpy, "_core", None) or numpy.core
    allowed: list[Any] = [
        core.multiarray.scalar,
        core.multiarray._reconstruct,
        numpy.ndarray,
        numpy.dtype,
    ]
    dtypes = getattr(numpy, "dtypes", None)
    if dtypes is not None:
        allowed += [
            value
            for value in vars(dtypes).values()
            if isinstance(value, type) and issubclass(value, numpy.dtype)
        ]
    return allowed


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
    foreign = _not_a_torch_zip(path) if is_zip else _not_a_torch_file(path)
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
                path, map_location="cpu", weights_only=not allow_unsafe_pickle, mmap=mmap and is_zip
            )
    except pickle.UnpicklingError as error:
        text = str(error)
        detail = _weights_only_detail(text)
        protocol = _legacy_protocol(path)
        if not allow_unsafe_pickle and protocol is not None and protocol > 2:
            message = (
                f"{what} {path} is torch.save's legacy format (torch before 1.6, or "
                f"_use_new_zipfile_serialization=False) written with pickle protocol "
                f"{protocol}, which torch.load(weights_only=True) cannot read (it reads "
                f"protocol 2, torch's default). {UNSAFE_HINT}, or save it again with "
                "torch.save's default format."
            )
            raise CheckpointError(message) from error
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
            f"{first_line(error)}). Load an earlier checkpoint (find_latest skips folders "
            "without a manifest, not damaged files inside one)."
        )
        raise CheckpointError(message) from error


# What torch's weights-only unpickler says when it refuses an object (not a damaged file,
# which it reports as an "Unsupported operand"): a class it does not allow ("Unsupported
# global"), a function of a blocked module such as os.system ("unsupported GLOBAL
# posix.system whose module posix is blocked"), or a call of an unknown function.
_REFUSALS = ("unsupported global", "is blocked", "unrecognized function", "unsupported class")


def read_state_dict_file(
    path: Path, *, allow_unsafe_pickle: bool = False, keep_extra_state: bool = True
) -> dict[Any, Any]:
    """A plain weights file's state dict: a bare ``{name: tensor}``, MMEngine's
    ``{"state_dict": ...}`` or DeepSpeed's ``{"module": ...}`` (``mp_rank_00_model_states.pt``),
    one inside the other too (two levels at most). Entries that are not tensors are left out
    with a warning naming them, but a module's ``*_extra_state`` with ``keep_extra_state``.

    Raises:
        CheckpointError: The file cannot be read (`load_tensor_file`) or holds no tensor.
    """
    data = load_tensor_file(
        path, allow_unsafe_pickle=allow_unsafe_pickle, mmap=True, what="checkpoint"
    )
    found, where = data, ""
    for _ in range(2):  # the wrapper's, whatever sits beside it (an epoch); bounded: a cycle
        wrappers = ("state_dict", "module") if isinstance(found, Mapping) else ()
        inner = [key for key in wrappers if isinstance(found.get(key), Mapping)]
        if not inner:
            break
        found, where = found[inner[0]], f"{where}[{inner[0]!r}]"
    if not isinstance(found, Mapping) or not any(
        isinstance(v, torch.Tensor) for v in found.values()
    ):
        got = (
            f"a dict with keys {sorted(map(str, found))[:8]}"
            if isinstance(found, Mapping)
            else f"a {type(found).__name__}"
        )
        message = (
            f"{path}{where} holds no state dict: expected {{name: tensor}}, or one under "
            f"'state_dict' or 'module' (two levels deep at most), got {got}"
        )
        raise CheckpointError(message)
    state = {
        key: value
        for key, value in found.items()
        if isinstance(value, torch.Tensor)
        or (keep_extra_state and f"{key}".endswith("_extra_state"))
    }
    skipped = [str(key) for key in found if key not in state]
    if skipped:
        warnings.warn(
            f"{path}{where}: left out {len(skipped)} entr(ies) that are not tensors: "
            f"{', '.join(sorted(skipped)[:8])}",
            stacklevel=outside_package(),
        )
    return state


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


# torch.save's legacy format (torch before 1.6) is a pickle that starts with this number,
# pickled (protocol 2 by default: ``\x80\x02`` then these bytes; a later protocol frames it)
_LEGACY_MAGIC = b"\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"
_PROBE_BYTES = 256


def _legacy_protocol(path: Path) -> int | None:
    """The pickle protocol of a file in torch.save's legacy format, else None."""
    with path.open("rb") as handle:
        head = handle.read(32)
    return head[1] if head[:1] == b"\x80" and _LEGACY_MAGIC in head else None


def _not_a_torch_zip(path: Path) -> str | None:
    """What a zip archive is when torch.save did not write it (None: it may be torch's).

    torch's archives hold one top folder with a ``data.pkl`` in it.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return None  # damaged: torch.load says how
    if any(name.count("/") == 1 and name.endswith("/data.pkl") for name in names):
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"a zip archive that is not a torch checkpoint (it holds {shown or 'nothing'}; "
        "torch.save writes one folder with a data.pkl in it)"
    )


def _not_a_torch_file(path: Path) -> str | None:
    """What a file that is not a zip archive is (None: it may be torch's legacy pickle)."""
    with path.open("rb") as handle:
        head = handle.read(_PROBE_BYTES)
    if not head:
        return "empty (0 bytes)"
    if head[:4] == b"PK\x03\x04":
        return None  # a zip archive cut short (torch's, maybe): torch.load says how
    if head[:1] == b"\x80":  # a pickle: torch's legacy format starts with its number
        if _LEGACY_MAGIC in head[:32]:
            return None
        return (
            "a Python pickle that torch.save did not write (torch's pickles, from torch "
            "before 1.6, start with torch's magic number; torch.load cannot read this one, "
            "even with allow_unsafe_pickle=True). If it holds a state dict and you trust "
            "it, unpickle it yourself and pass the dict to load_full_model_state_dict"
        )
    if head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000:
        return (
            "a safetensors file, it seems (an 8-byte header length, then JSON); read it "
            "with safetensors.torch.load_file and pass the dict to load_full_model_state_dict"
        )
    text = _as_text(head, complete=len(head) < _PROBE_BYTES)
    if text is None:
        return f"binary data of another format (it starts with {head[:8]!r})"
    first = text.strip().splitlines()[0][:40] if text.strip() else ""
    return f"a text file (it starts with {first!r})" if first else "a text file (blank)"


# Control characters a text file may hold (tab, line feed, vertical tab, form feed, return)
_TEXT_CONTROLS = frozenset("\t\n\v\f\r")


def _as_text(head: bytes, complete: bool) -> str | None:
    """``head`` decoded as UTF-8 text, or None for binary data: bytes that do not decode
    (a character cut by the end of the probe is not counted, unless the file ends there)
    or control characters that text does not hold (NUL, backspace...)."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as error:
        cut = error.reason == "unexpected end of data" and error.end == len(head)
        if complete or not cut:
            return None
        text = head[: error.start].decode("utf-8")
    if any((ch < " " and ch not in _TEXT_CONTROLS) or ch == "\x7f" for ch in text):
        return None
    return text


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
