"""``save_checkpoint``: one folder layout for every strategy, written atomically.

The steps, in a fixed order (the shape of torch.distributed.checkpoint's storage writers):
rank 0 creates the temporary folder (`_publish.begin`); every rank enters with the same
path or every rank raises (`Call.enter`); every rank writes its part of the model and
optimizer in the backend's format (`_formats`), its RNG state, and rank 0 the side files;
the ranks vote on the outcome; rank 0 writes the manifest and renames the folder into
place (`_publish.finish`); a last vote makes that outcome every rank's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import comm_collectives as dist
from comm_wrappers.backends import Backend, backend_of

from ..__about__ import __version__
from .._build import scalers_of
from . import _publish, _rng
from ._consensus import Call, where
from ._errors import CheckpointError
from ._files import save_tensor_file, write_json
from ._formats import FORMATS, Attempts
from ._layout import DEFAULT_KEY, EXTRA_FILE, RNG_FOLDER, SCALER_FILE, SCHEDULERS_FILE
from ._manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from ._state import named_optimizers, refuse_unportable

# A test hook: called with the stage name ("written", "manifest") on every rank, so a
# test can kill the process in the middle of a save. Not part of the public API.
_stage_hook: Callable[[str], None] | None = None


def _hook(stage: str) -> None:
    if _stage_hook is not None:
        _stage_hook(stage)


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__, "comm-strategies": __version__}
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None:
        versions["deepspeed"] = str(getattr(deepspeed, "__version__", "?"))
    return versions


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optim_wrapper: Any = None,
    schedulers: Sequence[Any] = (),
    strategy: str,
    extra: dict[str, Any] | None = None,
    sharded: bool | None = None,
    timeout: float | None = None,
) -> Path:
    """Save model, optimizer, schedulers, RNG, scaler and user state into a folder.

    Collective: every rank calls it with the same ``path``. The folder is written under a
    temporary name next to ``path``, its manifest last, and renamed once every rank has
    finished: a save killed half-way leaves the previous checkpoint whole, and no folder
    at ``path``. A rank that calls it alone gets `CheckpointError` after ``timeout``
    instead of waiting forever.

    Args:
        path: The checkpoint folder to create (replaced if it exists).
        model: What the strategy prepared: a module, DDP, FSDP1, FSDP2 or DeepSpeed wrapper.
        optim_wrapper: ``OptimWrapper``, ``AmpOptimWrapper`` (its scaler is saved too),
            ``OptimWrapperDict``, ``DeepSpeedOptimWrapper``, or a torch optimizer.
        schedulers: Objects with ``state_dict``/``load_state_dict`` (LR schedulers).
        strategy: The strategy's short name, recorded in the manifest.
        extra: User state (step, epoch, EMA, sampler position...), given back by
            `load_checkpoint`; rank 0's copy is kept.
        sharded: None for the model's natural format (sharded DCP under FSDP, DeepSpeed's
            files under DeepSpeed, full files otherwise); True for DCP, False for full
            files (under DeepSpeed: the weights only, gathered).
        timeout: Seconds to wait for the other ranks to enter; default
            ``COMM_CHECKPOINT_TIMEOUT`` or 300.

    Returns:
        The checkpoint folder.

    Raises:
        CheckpointError: On every rank when any rank failed to write its part, or when
            the ranks passed different paths.

    Examples:
        >>> import tempfile, torch
        >>> from comm_strategies.checkpoint import load_checkpoint, save_checkpoint
        >>> model = torch.nn.Linear(2, 1)
        >>> folder = save_checkpoint(tempfile.mkdtemp() + "/epoch_1", model=model,
        ...                          strategy="single", extra={"epoch": 1})
        >>> sorted(p.name for p in folder.iterdir())
        ['extra.pt', 'manifest.json', 'model.pt', 'rng']
        >>> load_checkpoint(folder, model=torch.nn.Linear(2, 1))
        {'epoch': 1}
    """
    backend = backend_of(model)
    fmt = backend.format_for(sharded)
    optimizers = named_optimizers(optim_wrapper)
    if fmt == "full" and optimizers:
        refuse_unportable(backend, "save_checkpoint(sharded=False)")
    call = Call("save_checkpoint", timeout)
    final = Path(path).absolute()
    temporary = _enter(call, final)
    attempts = Attempts(temporary)
    # Collective parts first, every rank taking part even after a local failure (a rank
    # that left would leave the others waiting); local writes after, each inside
    # attempts.run: a failure reaches every rank through the vote instead of hanging them.
    params = FORMATS[fmt].write(backend, optimizers, temporary, attempts)
    scalers = _write_side_files(temporary, attempts, optim_wrapper, schedulers, extra)
    _hook("written")
    try:
        call.vote("written", attempts.error)
    except CheckpointError:
        if dist.get_rank() == 0:  # a failed save leaves nothing behind
            _publish.abandon(temporary)
        raise
    error = None
    if dist.get_rank() == 0:
        try:  # any failure here (not only the filesystem's) must reach the other ranks
            manifest = Manifest(
                format_version=FORMAT_VERSION,
                strategy=str(strategy),
                world_size=dist.get_world_size(),
                format=fmt,
                params=params,
                has_optimizer=bool(optimizers),
                optimizer_keys=[] if list(optimizers) in ([], [DEFAULT_KEY]) else list(optimizers),
                num_schedulers=len(schedulers),
                has_scaler=bool(scalers),
                rng_ranks=list(range(dist.get_world_size())),
                extra_keys=sorted(str(key) for key in (extra or {})),
                versions=_versions(),
                saved_at=time.time(),
                files=_publish.list_files(temporary),
                **_described(backend),
            )
            write_json(manifest.to_json(), temporary / MANIFEST_NAME)
            _hook("manifest")
            _publish.finish(temporary, final)
        except Exception as caught:
            error = CheckpointError(f"cannot finish {final}: {caught}")
            error.__cause__ = caught
    call.vote("done", error)
    return final


def _described(backend: Backend) -> dict[str, Any]:
    """The manifest's fields that describe the backend (wrapper, sharding, ZeRO stage)."""
    described = backend.describe()
    return {key: described.get(key) for key in ("wrapper", "sharding", "zero_stage")}


def _enter(call: Call, final: Path) -> Path:
    """Rank 0 creates the temporary folder first, so that one exchange both checks that
    every rank is here with the same path and hands them the folder."""
    leader = dist.get_rank() == 0
    temporary = _publish.temporary_name(final)
    status = _publish.begin(final, temporary) if leader else "ok"
    try:
        # JSON: a path may hold any character but NUL, a separator among them
        entries = [
            json.loads(text)
            for text in call.enter(json.dumps([str(temporary), status, str(final)]))
        ]
    except CheckpointError:
        if leader:
            _publish.abandon(temporary)
        raise
    temporary = Path(entries[0][0])
    paths = {str(fields[2]) for fields in entries}
    failed = str(entries[0][1])
    if len(paths) > 1 or failed != "ok":
        if leader:
            _publish.abandon(temporary)
        message = (
            f"save_checkpoint: the ranks passed different paths ({sorted(paths)}); every "
            "rank must pass the same folder"
            if len(paths) > 1
            else f"save_checkpoint on {where()}: rank 0 {failed}"
        )
        raise CheckpointError(message)
    return temporary


def _write_side_files(
    folder: Path,
    attempts: Attempts,
    optim_wrapper: Any,
    schedulers: Sequence[Any],
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """This rank's RNG state; on rank 0 the schedulers, scalers and user state. Returns the
    scalers (found on every rank: finding them reads attributes, saving them may fail)."""
    me = dist.get_rank()
    attempts.run(lambda: save_tensor_file(_rng.capture(), _rng_path(folder, me)), what="RNG state")
    scalers = scalers_of(optim_wrapper)
    if me != 0:
        return scalers
    if schedulers:
        attempts.run(
            lambda: save_tensor_file(
                [scheduler.state_dict() for scheduler in schedulers], folder / SCHEDULERS_FILE
            ),
            what="the schedulers",
        )
    if scalers:
        attempts.run(
            lambda: save_tensor_file(
                {
                    DEFAULT_KEY if key == "" else key: scaler.state_dict()
                    for key, scaler in scalers.items()
                },
                folder / SCALER_FILE,
            ),
            what="the grad scaler",
        )
    if extra:
        attempts.run(
            lambda: save_tensor_file(dict(extra), folder / EXTRA_FILE),
            what="the user state (extra)",
        )
    return scalers


def _rng_path(folder: Path, rank: int) -> Path:
    (folder / RNG_FOLDER).mkdir(mode=0o700, exist_ok=True)
    return folder / RNG_FOLDER / f"rank_{rank}.pt"
