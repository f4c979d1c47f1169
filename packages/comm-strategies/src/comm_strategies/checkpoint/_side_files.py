"""The small files of a checkpoint: every rank's RNG state, and on rank 0 the schedulers,
the grad scalers and the user state (``extra``), written now or copied for a background
write.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import comm_collectives as dist

from .._build import scalers_of
from . import _async, _rng
from ._files import save_tensor_file
from ._format_common import Attempts
from ._layout import DEFAULT_KEY, EXTRA_FILE, RNG_FOLDER, SCALER_FILE, SCHEDULERS_FILE


def side_files(
    folder: Path,
    optim_wrapper: Any,
    schedulers: Sequence[Any],
    extra: Mapping[str, Any] | None,
) -> tuple[list[SideFile], dict[str, Any]]:
    """The small files of this rank: its RNG state; on rank 0 the schedulers, scalers and
    user state, each as (what, how to take its state, its file). Also returns the scalers
    (found on every rank: finding them reads attributes, saving them may fail)."""
    me = dist.get_rank()
    files: list[SideFile] = [("RNG state", _rng.capture, lambda: rng_path(folder, me))]
    scalers = scalers_of(optim_wrapper)
    if me != 0:
        return files, scalers
    if schedulers:
        files.append(
            (
                "the schedulers",
                lambda: [scheduler.state_dict() for scheduler in schedulers],
                lambda: folder / SCHEDULERS_FILE,
            )
        )
    if scalers:
        files.append(
            (
                "the grad scaler",
                lambda: {
                    DEFAULT_KEY if key == "" else key: scaler.state_dict()
                    for key, scaler in scalers.items()
                },
                lambda: folder / SCALER_FILE,
            )
        )
    if extra:
        files.append(("the user state (extra)", lambda: dict(extra), lambda: folder / EXTRA_FILE))
    return files, scalers


SideFile = tuple[str, Callable[[], Any], Callable[[], Path]]


def write_side_files(
    attempts: Attempts,
    folder: Path,
    optim_wrapper: Any,
    schedulers: Sequence[Any],
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Write this rank's small files (`side_files`), each inside ``attempts``; return the
    scalers."""
    files, scalers = side_files(folder, optim_wrapper, schedulers, extra)
    for what, produce, target in files:
        attempts.run(_write_now, produce, target, what=what)
    return scalers


def _write_now(produce: Callable[[], Any], target: Callable[[], Path]) -> None:
    save_tensor_file(produce(), target())


def copy_now(
    copies: list[_async.Write], what: str, produce: Callable[[], Any], target: Callable[[], Path]
) -> None:
    copies.append((what, _async.snapshot(produce()), target()))


def rng_path(folder: Path, rank: int) -> Path:
    (folder / RNG_FOLDER).mkdir(mode=0o700, exist_ok=True)
    return folder / RNG_FOLDER / f"rank_{rank}.pt"
