"""``save_checkpoint``: one folder layout for every strategy, written atomically.

The steps, in a fixed order (the shape of torch.distributed.checkpoint's storage writers):
rank 0 creates the temporary folder (`_publish.begin`); every rank enters with the same
path or every rank raises (`Call.enter`); every rank meets the others before the data
moves (`Call.together`); every rank writes its part of the model and optimizer in the
backend's format (`_formats`), its RNG state, and rank 0 the side files; the ranks vote
on the outcome; rank 0 writes the manifest, renames the folder into place
(`_publish.finish`) and, with ``keep_last``, removes the older checkpoints beside it
(`_publish.retain`); a last vote makes that outcome every rank's.

The ``dcp`` format saves most of those exchanges: the small files are written first and
their outcome is shared before the data moves (without ``timeout=`` inside DCP's first
step, the plan: a rank whose files failed fails it and DCP hands that to every rank,
`DcpFormat.write`'s ``failed``; with ``timeout=`` by the meeting, bounded by it); DCP's
own collectives raise a failure to write a shard on every rank, so no vote follows the
write; and without ``timeout=`` rank 0 publishes inside DCP's last step
(`DcpFormat.write`'s ``publish``), whose outcome DCP hands every rank (with ``timeout=``,
the last vote, bounded by it, shares it instead). Without ``timeout=`` a ``dcp`` save
makes one store exchange, the entry.
With ``async_save`` the state is copied to the CPU instead of written, and a background
thread writes it and publishes (`_async`, whose docstring says how the ranks agree
without a collective).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch import nn

import comm_collectives as dist
from comm_wrappers.backends import Backend, backend_of

from ..__about__ import __version__
from . import _async, _publish
from ._async import SaveHandle
from ._consensus import WRITE_TIMEOUT_S, Call, where
from ._errors import CheckpointError
from ._files import write_json
from ._format_common import Attempts, quiet_torch
from ._format_dcp import DcpFormat, EarlyFailures, PublishError, sharded_state
from ._formats import FORMATS
from ._layout import DEFAULT_KEY
from ._manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from ._params import describe_params
from ._side_files import copy_now, side_files, write_side_files
from ._state import named_optimizers, refuse_unportable

# A test hook: called with the stage name ("entered", "written", "manifest"; with async_save also
# "writing", in the background thread as are "written" and "manifest") on every rank, so
# a test can kill the process in the middle of a save. Not part of the public API.
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


@overload
def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
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
    model: nn.Module,
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
    model: nn.Module,
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
    model: nn.Module,
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
        timeout: Seconds the whole call may take on this rank (entering, every rank
            reaching the write, the outcome shared); default: ``COMM_CHECKPOINT_TIMEOUT``
            or 300 for entering and reaching the write, an hour for the outcome (the
            ``dcp`` format has neither that meeting nor the vote then: its ranks meet in
            DCP's first step and rank 0 publishes inside DCP's last one, both bounded by
            the process group's own timeout). A write already under way is bounded by
            the process group's own timeout.
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
    _check_keep_last(keep_last)
    _async.wait_previous()
    backend = backend_of(model)
    fmt = backend.format_for(sharded)
    optimizers = named_optimizers(optim_wrapper)
    if fmt == "full" and optimizers:
        refuse_unportable(backend, "save_checkpoint(sharded=False)")
    call = Call("save_checkpoint", timeout)
    final = Path(path).absolute()
    temporary = _enter(call, final)
    attempts = Attempts(temporary)
    # What rank 0's manifest says, taken now (an async save publishes later); a failure
    # here reaches every rank through the vote, as a failure to write does.
    described: dict[str, Any] = {}
    if dist.get_rank() == 0:  # the only rank that writes a manifest
        described = attempts.run(_described, backend, what="the model's description") or {}
    record = _Record(
        strategy=str(strategy),
        fmt=fmt,
        optimizer_keys=list(optimizers),
        num_schedulers=len(schedulers),
        extra_keys=_keys_of(extra),
        described=described,
    )
    _hook("entered")
    background = async_save and fmt in _async.ASYNC_FORMATS
    # With DCP, whose collectives raise every rank's failure to write on every rank, the
    # small files are written first and their outcome travels with the exchange before
    # the data moves: once DCP returns, every rank's files are whole, with no vote after.
    early = fmt == "dcp" and not background
    scalers: dict[str, Any] = {}
    if early:
        scalers = write_side_files(attempts, temporary, optim_wrapper, schedulers, extra)
    # Without timeout=, DCP's first step (the plan, before any shard is written) is where
    # the ranks meet and the small files' outcome is shared: a rank whose files failed
    # fails the plan, and DCP hands that to every rank. With timeout=, a meeting bounded
    # by it comes first (DCP's collectives wait for the process group's timeout only).
    in_plan = early and call.deadline is None
    if not in_plan:
        try:  # what comes next moves data between the ranks: every rank is there first
            call.together("writing", attempts.error if early else None)
        except CheckpointError:
            if dist.get_rank() == 0:
                _publish.abandon(temporary)
            raise
    if background:
        return _start_async(
            call, final, temporary, attempts, backend, optimizers, record, keep_last,
            (optim_wrapper, schedulers, extra),
        )  # fmt: skip
    leader = dist.get_rank() == 0
    if in_plan:
        # No timeout= to bound the wait for rank 0's publish: it is DCP's last step
        # (inside the collective that ends the write), whose outcome DCP gives every rank.
        def publish(params: dict[str, list[Any]]) -> None:
            _publish_or_raise(record, params, bool(scalers), temporary, final, keep_last)

        try:
            try:
                DcpFormat().write(
                    backend, optimizers, temporary, attempts,
                    written=lambda: _hook("written"), publish=publish if leader else None,
                    failed=attempts.error,
                )  # fmt: skip
            except EarlyFailures as early_failures:  # as the meeting would raise them
                call.share(attempts.error, early_failures.outcomes)
                raise
        except CheckpointError:
            if leader:  # a failed save leaves nothing behind
                _publish.abandon(temporary)
            raise
        return final
    # Collective parts first, every rank taking part even after a local failure (a rank
    # that left would leave the others waiting); local writes after, each inside
    # attempts.run: a failure reaches every rank through the vote instead of hanging them.
    try:
        params = FORMATS[fmt].write(backend, optimizers, temporary, attempts)
        if not early:
            scalers = write_side_files(attempts, temporary, optim_wrapper, schedulers, extra)
        _hook("written")
        if not early:
            call.vote("written", attempts.error)
    except CheckpointError:  # DCP's failure (on every rank) or the vote's
        if leader:  # a failed save leaves nothing behind
            _publish.abandon(temporary)
        raise
    error = None
    if leader:
        try:  # any failure here must reach the other ranks (bounded by the call's timeout)
            _publish_or_raise(record, params, bool(scalers), temporary, final, keep_last)
        except PublishError as caught:
            error = caught
            _publish.abandon(temporary)  # gone already when the rename was done
    call.vote("done", error)
    return _async.finished(final) if async_save else final


@dataclass(frozen=True)
class _Record:
    """What the manifest says that is known when the save starts."""

    strategy: str
    fmt: str
    optimizer_keys: list[str]
    num_schedulers: int
    extra_keys: list[str]
    described: dict[str, Any]


def _keys_of(extra: Any) -> list[str]:
    """The keys of the user state rank 0 writes (``dict(extra)``); none when it is not one
    (writing it then fails on rank 0, and the vote fails the save on every rank)."""
    try:
        return sorted(str(key) for key in dict(extra or {}))
    except (TypeError, ValueError):
        return []


def _check_keep_last(keep_last: int | None) -> None:
    if keep_last is None:
        return
    if isinstance(keep_last, bool) or not isinstance(keep_last, int):
        message = (
            f"save_checkpoint: keep_last must be an int or None, got {keep_last!r} "
            f"({type(keep_last).__name__})"
        )
        raise TypeError(message)
    if keep_last < 1:
        message = (
            f"save_checkpoint: keep_last must be at least 1 (the new checkpoint is always "
            f"kept), got {keep_last}; pass None to keep every checkpoint"
        )
        raise ValueError(message)


def _publish_or_raise(
    record: _Record,
    params: dict[str, list[Any]],
    has_scaler: bool,
    temporary: Path,
    final: Path,
    keep_last: int | None,
) -> None:
    """`_publish_folder`, any failure (not only the filesystem's) a `PublishError`."""
    try:
        _publish_folder(record, params, has_scaler, temporary, final, keep_last)
    except Exception as caught:
        error = PublishError(f"cannot finish {final}: {caught}")
        raise error from caught


def _publish_folder(
    record: _Record,
    params: dict[str, list[Any]],
    has_scaler: bool,
    temporary: Path,
    final: Path,
    keep_last: int | None,
) -> None:
    """Rank 0, once every rank's files are whole: manifest, rename, retention."""
    keys = record.optimizer_keys
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        strategy=record.strategy,
        world_size=dist.get_world_size(),
        format=record.fmt,
        params=params,
        has_optimizer=bool(keys),
        optimizer_keys=[] if keys in ([], [DEFAULT_KEY]) else keys,
        num_schedulers=record.num_schedulers,
        has_scaler=has_scaler,
        rng_ranks=list(range(dist.get_world_size())),
        extra_keys=record.extra_keys,
        versions=_versions(),
        saved_at=time.time(),
        files=_publish.list_files(temporary),
        **record.described,
    )
    write_json(manifest.to_json(), temporary / MANIFEST_NAME)
    _hook("manifest")
    _publish.finish(temporary, final)
    if keep_last is not None:
        _publish.retain(final, keep_last)


def _start_async(
    call: Call,
    final: Path,
    temporary: Path,
    attempts: Attempts,
    backend: Backend,
    optimizers: Mapping[str, torch.optim.Optimizer],
    record: _Record,
    keep_last: int | None,
    side: tuple[Any, Sequence[Any], Mapping[str, Any] | None],
) -> SaveHandle:
    """Copy the state to the CPU (collective where the format gathers) and hand the writes,
    the vote and the publish to a background thread."""
    staged: dict[str, Any] | None = None
    params: dict[str, list[Any]] = {}
    if record.fmt == "dcp":
        state = sharded_state(backend, optimizers)
        with quiet_torch():  # the shapes of the state written (global shapes of shards)
            params = describe_params(state["model"])
        staged = attempts.run(_async.stage, state, "dcp", what="a CPU copy of the state")
        del state
    else:  # "full": gathered to rank 0 (collective), copied there
        leader = dist.get_rank() == 0
        state = backend.model_state(full=True, rank0_only=True)
        if leader:
            params = describe_params(state)
            model = attempts.run(_async.stage, state, "model", what="a CPU copy of the model")
            staged = {"model": model}
        del state
        if optimizers:
            states = {
                key: backend.optim_state(optimizer, full=True, rank0_only=True)
                for key, optimizer in optimizers.items()
            }
            if leader and staged is not None:
                staged["optim"] = attempts.run(
                    _async.stage, states, "optim", what="a CPU copy of the optimizer state"
                )
            del states
    files, scalers = side_files(temporary, *side)
    copies: list[_async.Write] = []
    for what, produce, target in files:
        attempts.run(copy_now, copies, what, produce, target, what=what)
    # No vote here (it would block the loop): a failure to copy fails the save through
    # the background thread's vote, raised by wait() on every rank.
    return _async.start(
        _async.Job(
            final,
            temporary,
            fmt=record.fmt,
            staged=staged,
            files=copies,
            publish=lambda: _publish_folder(
                record, params, bool(scalers), temporary, final, keep_last
            ),
            key=f"comm_checkpoint/{call.number}/async",
            timeout_s=max(call.timeout, WRITE_TIMEOUT_S),
            hook=_hook,
            error=attempts.error,
        )
    )


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
