"""``save_checkpoint``: one folder layout for every strategy, written atomically.

The commit protocol of `_consensus`, the same for every format, sync or async:

1. enter (`_enter`): rank 0 creates the temporary folder (`_publish.begin`) and describes
   the model; every rank enters with the same path (`Call.enter`);
2. write: every rank writes its part in the backend's format (`_formats`) and its small
   files (`_small_files`); with ``async_save`` it copies them and a thread writes them;
3. `commit`: the ranks' outcomes shared; rank 0 writes the manifest, renames the folder
   into place and applies ``keep_last`` (`_publish.publish`); that outcome shared, so
   every rank returns or raises the same failure.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch import nn

import comm_collectives as dist
from comm_wrappers.backends import Backend, backend_of

from .._build import scalers_of, torch_optimizers
from . import _async, _files, _publish
from ._async import SmallFile
from ._consensus import Attempts, Call, SaveHandle, finished, label
from ._errors import CheckpointError
from ._formats import FORMATS
from ._layout import DEFAULT_KEY, EXTRA_FILE, SCALER_FILE, SCHEDULERS_FILE
from ._publish import Publication
from ._state import refuse_unportable


@overload
def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Backend,
    optim_wrapper: Any = ...,
    schedulers: Sequence[Any] = ...,
    strategy: str,
    extra: dict[str, Any] | None = ...,
    sharded: bool | None = ...,
    timeout: float | None = ...,
    async_save: Literal[False] = ...,
    keep_last: int | None = ...,
) -> Path: ...


@overload
def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Backend,
    optim_wrapper: Any = ...,
    schedulers: Sequence[Any] = ...,
    strategy: str,
    extra: dict[str, Any] | None = ...,
    sharded: bool | None = ...,
    timeout: float | None = ...,
    async_save: Literal[True],
    keep_last: int | None = ...,
) -> SaveHandle: ...


@overload
def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Backend,
    optim_wrapper: Any = ...,
    schedulers: Sequence[Any] = ...,
    strategy: str,
    extra: dict[str, Any] | None = ...,
    sharded: bool | None = ...,
    timeout: float | None = ...,
    async_save: bool,
    keep_last: int | None = ...,
) -> Path | SaveHandle: ...


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Backend,
    optim_wrapper: Any = None,
    schedulers: Sequence[Any] = (),
    strategy: str,
    extra: dict[str, Any] | None = None,
    sharded: bool | None = None,
    timeout: float | None = None,
    async_save: bool = False,
    keep_last: int | None = None,
) -> Path | SaveHandle:
    """Save model, optimizer, schedulers, RNG, scaler and user state into a folder.

    Collective: every rank calls it with the same ``path``. The folder is written under a
    temporary name next to ``path``, its manifest last, and renamed once every rank has
    finished: a save killed half-way leaves the previous checkpoint whole, and no folder
    at ``path``. A rank that calls it alone gets `CheckpointError` after ``timeout``
    instead of waiting forever. A save first waits for an async save still running.

    Args:
        path: The checkpoint folder to create (replaced if it exists).
        model: What the strategy prepared: a module, DDP, FSDP1, FSDP2 or DeepSpeed wrapper;
            or its adapter, ``comm_wrappers.backends.backend_of(model)``, which a caller
            that saves often keeps (`Strategy` does) instead of deciding it each time.
        optim_wrapper: ``OptimWrapper``, ``AmpOptimWrapper`` (its scaler is saved too),
            ``OptimWrapperDict``, ``DeepSpeedOptimWrapper``, or a torch optimizer.
        schedulers: Objects with ``state_dict``/``load_state_dict`` (LR schedulers).
        strategy: The strategy's short name, recorded in the manifest.
        extra: User state (step, epoch, EMA, sampler position...), given back by
            `load_checkpoint`; rank 0's copy is kept.
        sharded: None for the model's natural format (sharded DCP under FSDP, DeepSpeed's
            files under DeepSpeed, full files otherwise); True for DCP, False for full
            files (under DeepSpeed: the weights only, gathered).
        timeout: Seconds the whole call may take on this rank, from the entry to the
            commit; default: the entry waits ``COMM_CHECKPOINT_TIMEOUT`` or 300 s, the
            commit the longer of that and an hour. It bounds the waits only: the steps are
            the same. A write already under way (DCP's collectives, a full state's
            gathers) is bounded by the process group's own timeout.
        async_save: Copy the state to the CPU, return a `SaveHandle` at once, and write
            and publish in a background thread while training goes on (formats ``full``
            and ``dcp``; DeepSpeed's own files are written before the call returns, and
            the handle comes back done).
        keep_last: Once the new checkpoint is published, remove the older complete
            checkpoints of this package in the same parent folder beyond the newest
            ``keep_last`` (the new one included), newest by the manifest's time as in
            `find_latest`; None keeps them all. Nothing else in the folder is touched.

    Returns:
        The checkpoint folder; with ``async_save=True`` a `SaveHandle` whose ``wait()``
        returns it.

    Raises:
        CheckpointError: On every rank when any rank failed to write its part, or when
            the ranks passed different paths (with ``async_save``: from ``wait()`` when
            the background writes failed).
        TypeError: ``keep_last`` is not an int.
        ValueError: ``keep_last`` is less than 1.

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
    _publish.check_keep_last(keep_last, "save_checkpoint")
    backend = model if isinstance(model, Backend) else backend_of(model)  # a kept adapter
    fmt = backend.format_for(sharded)
    optimizers = torch_optimizers(optim_wrapper, default_key=DEFAULT_KEY)
    if fmt == "full" and optimizers:
        refuse_unportable(backend, "save_checkpoint(sharded=False)")
    call = Call("save_checkpoint", timeout)
    final = Path(path).absolute()
    publish = Publication(
        final=final,
        temporary=_publish.temporary_name(final),
        keep_last=keep_last,
        strategy=str(strategy),
        fmt=fmt,
        optimizer_keys=list(optimizers),
        num_schedulers=len(schedulers),
        extra_keys=_keys_of(extra),
    )
    _enter(call, publish, backend)
    attempts = Attempts(publish.temporary)
    if async_save and fmt in _async.ASYNC_FORMATS:  # the same steps, written in a thread
        files = _small_files(attempts, publish, optim_wrapper, schedulers, extra, copied=True)
        return _async.start(call, publish, backend, optimizers, attempts, files, commit)
    # the format's collective parts run on every rank, even after a local failure; any
    # failure reaches the commit, which raises it on every rank
    with attempts.keep("the model and optimizer state"):
        publish.params = FORMATS[fmt].write(backend, optimizers, publish.temporary, attempts)
    for what, value, file in _small_files(attempts, publish, optim_wrapper, schedulers, extra):
        with attempts.keep(what):
            _files.save_file(value, file)
    commit(call, attempts.error, publish)
    return finished(final) if async_save else final


def commit(
    call: Call, error: BaseException | None, publish: Publication, *, background: bool = False
) -> None:
    """The commit: every rank's outcome shared; rank 0 publishes when none failed, and its
    outcome is shared too. A failed save leaves nothing behind.

    Raises:
        CheckpointError: On every rank, when any rank failed or rank 0 could not publish.
    """
    leader = dist.get_rank() == 0
    try:
        call.share("written", error, background=background)
        outcome: CheckpointError | None = None
        if leader:
            try:
                _publish.publish(publish)
            except Exception as caught:
                outcome = CheckpointError(f"cannot publish {publish.final}: {label(caught)}")
                outcome.__cause__ = caught
        call.share("published", outcome, background=background)
    except CheckpointError:
        if leader:  # gone already when the rename was done
            _publish.abandon(publish.temporary)
        raise


def _small_files(
    attempts: Attempts,
    publish: Publication,
    optim_wrapper: Any,
    schedulers: Sequence[Any],
    extra: Mapping[str, Any] | None,
    *,
    copied: bool = False,
) -> list[SmallFile]:
    """This rank's small files, their states taken now (``copied``: copies with tensors on
    the CPU, for a write after training went on): its RNG state; on rank 0 the schedulers,
    the grad scalers and the user state. Notes in ``publish`` whether a scaler is saved."""
    me, folder = dist.get_rank(), publish.temporary
    files: list[SmallFile] = []
    with attempts.keep("RNG state"):  # new JSON values: nothing to copy
        files.append(("RNG state", _files.capture_rng(), _files.rng_file(folder, me)))
    wanted: list[tuple[str, Callable[[], Any], Path]] = []
    scalers: dict[str, Any] = {}
    with attempts.keep("the grad scalers"):
        scalers = scalers_of(optim_wrapper, default_key=DEFAULT_KEY)
    publish.has_scaler = bool(scalers)
    if me == 0 and schedulers:
        wanted.append(
            (
                "the schedulers",
                lambda: [s.state_dict() for s in schedulers],
                folder / SCHEDULERS_FILE,
            )
        )
    if me == 0 and scalers:
        wanted.append(
            (
                "the grad scaler",
                lambda: {key: scaler.state_dict() for key, scaler in scalers.items()},
                folder / SCALER_FILE,
            )
        )
    if me == 0 and extra:
        wanted.append(("the user state (extra)", lambda: dict(extra), folder / EXTRA_FILE))
    for what, produce, name in wanted:
        with attempts.keep(what):
            state = produce()
            files.append((what, _snapshot(state) if copied else state, name))
    return files


def _snapshot(value: Any) -> Any:
    """A deep copy of user state (schedulers, scaler, ``extra``) with tensors on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return type(value)({key: _snapshot(item) for key, item in value.items()})  # type: ignore[call-arg]
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_snapshot(item) for item in value)
    return copy.deepcopy(value)


def _enter(call: Call, publish: Publication, backend: Backend) -> None:
    """The entry: rank 0 creates the temporary folder and describes the model first, so
    that one exchange checks that every rank is here with the same path, shares rank 0's
    outcome and hands every rank rank 0's temporary folder (its name is drawn by each
    rank; rank 0's counts).

    Raises:
        CheckpointError: On every rank, when rank 0 failed, a rank did not enter, or the
            ranks passed different paths.
    """
    leader = dist.get_rank() == 0
    error: BaseException | None = None
    if leader:
        try:
            status = _publish.begin(publish.final, publish.temporary)
            if status != "ok":
                raise CheckpointError(f"save_checkpoint: rank 0 {status}")
            described = backend.describe()
            publish.described = {k: described.get(k) for k in ("wrapper", "sharding", "zero_stage")}
        except Exception as caught:
            error = caught
    try:
        payloads = call.enter(str(publish.final), error, payload=str(publish.temporary))
    except CheckpointError:
        if leader:
            _publish.abandon(publish.temporary)
        raise
    publish.temporary = Path(payloads[0])


def _keys_of(extra: Any) -> list[str]:
    """The keys of the user state rank 0 writes (``dict(extra)``); none when it is not one
    (writing it then fails on rank 0, and the commit fails the save on every rank)."""
    try:
        return sorted(str(key) for key in dict(extra or {}))
    except (TypeError, ValueError):
        return []
