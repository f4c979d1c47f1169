"""The small files of a checkpoint: every rank's RNG state, and on rank 0 the schedulers,
the grad scalers and the user state (``extra``), taken now and written now or later.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import comm_collectives as dist

from .._build import scalers_of
from . import _rng
from ._files import save_tensor_file
from ._format_common import Attempts
from ._layout import DEFAULT_KEY, EXTRA_FILE, RNG_FOLDER, SCALER_FILE, SCHEDULERS_FILE

SideFile = tuple[str, Any, Path]  # what (for messages), the state taken, its file


def take_side_files(
    attempts: Attempts,
    folder: Path,
    optim_wrapper: Any,
    schedulers: Sequence[Any],
    extra: Mapping[str, Any] | None,
    *,
    copied: bool = False,
) -> tuple[list[SideFile], bool]:
    """This rank's small files: its RNG state; on rank 0 the schedulers, the scalers and
    the user state, each taken now inside ``attempts`` (``copied``: as a copy with tensors
    on the CPU, for a write after training went on).

    Returns:
        The files to write (`write_side_files`) and whether a gradient scaler is saved.
    """
    me = dist.get_rank()
    wanted: list[tuple[str, Callable[[], Any], str]] = [
        ("RNG state", _rng.capture, f"{RNG_FOLDER}/rank_{me}.pt")
    ]
    scalers = scalers_of(optim_wrapper)
    if me == 0 and schedulers:
        wanted.append(
            ("the schedulers", lambda: [s.state_dict() for s in schedulers], SCHEDULERS_FILE)
        )
    if me == 0 and scalers:
        wanted.append(
            (
                "the grad scaler",
                lambda: {DEFAULT_KEY if k == "" else k: s.state_dict() for k, s in scalers.items()},
                SCALER_FILE,
            )
        )
    if me == 0 and extra:
        wanted.append(("the user state (extra)", lambda: dict(extra), EXTRA_FILE))
    files: list[SideFile] = []
    for what, produce, name in wanted:
        value = attempts.run(lambda take=produce: snapshot(take()) if copied else take(), what=what)
        if attempts.error is None:
            files.append((what, value, folder / name))
    return files, bool(scalers)


def write_side_files(attempts: Attempts, files: list[SideFile]) -> None:
    """Write the files `take_side_files` took, each inside ``attempts``."""
    for what, value, path in files:
        attempts.run(_write, value, path, what=what)


def _write(value: Any, path: Path) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    save_tensor_file(value, path)


def snapshot(value: Any) -> Any:
    """A deep copy of user state (schedulers, scaler, ``extra``) with tensors on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return type(value)({key: snapshot(item) for key, item in value.items()})  # type: ignore[call-arg]
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(snapshot(item) for item in value)
    return copy.deepcopy(value)
