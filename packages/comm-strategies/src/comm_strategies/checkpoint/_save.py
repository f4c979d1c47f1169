"""``save_checkpoint``: one folder layout for every strategy, written atomically."""

from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..__about__ import __version__
from . import _dist, _rng
from ._errors import CheckpointError
from ._files import fsync_enabled, save_tensor_file, write_json
from ._manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, read_manifest
from ._models import (
    deepspeed_engine,
    describe_params,
    get_model_state,
    get_optim_state,
    model_kind,
    quiet_torch,
    scalers_of,
    sharded_state,
    sharding_of,
)
from ._state import DEFAULT_KEY, _named_optimizers, _refuse_deepspeed_optimizer

MODEL_FILE = "model.pt"
OPTIM_FILE = "optim.pt"
DCP_FOLDER = "dcp"
SCHEDULERS_FILE = "schedulers.pt"
SCALER_FILE = "scaler.pt"
EXTRA_FILE = "extra.pt"
RNG_FOLDER = "rng"
# How long the ranks wait for each other to finish writing (large models write slowly).
WRITE_TIMEOUT_S = 3600.0

# A test hook: called with the stage name ("written", "manifest") on every rank, so a
# test can kill the process in the middle of a save. Not part of the public API.
_stage_hook: Callable[[str], None] | None = None


def _hook(stage: str) -> None:
    if _stage_hook is not None:
        _stage_hook(stage)


def choose_format(kind: str, sharded: bool | None) -> str:
    """``"full"``, ``"dcp"`` or ``"deepspeed"`` for a model kind and the caller's choice."""
    if kind == "deepspeed":
        return "full" if sharded is False else "deepspeed"
    if sharded is None:
        return "dcp" if kind in ("fsdp1", "fsdp2") else "full"
    return "dcp" if sharded else "full"


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__, "comm-strategies": __version__}
    import sys

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
    kind = model_kind(model)
    fmt = choose_format(kind, sharded)
    if fmt == "full" and kind == "deepspeed" and optim_wrapper is not None:
        _refuse_deepspeed_optimizer(model, "save_checkpoint(sharded=False)")
    wait = _dist.handshake_timeout(timeout, "save_checkpoint")
    exchange = _dist.Exchange("save_checkpoint")
    final = Path(path).absolute()
    me = _dist.rank()
    # Rank 0 creates the temporary folder first, so one exchange both checks that every
    # rank is here with the same path and hands them the folder.
    temporary = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    status = "ok"
    if me == 0:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale(final)
            status = _replaceable(final)
            if status == "ok":
                temporary.mkdir(mode=0o700)
        except OSError as caught:
            status = f"cannot create {temporary}: {caught}"
    try:
        # JSON: a path may hold any character but NUL, a separator among them
        entry = json.dumps([str(temporary), status, str(final)])
        entries = [json.loads(text) for text in exchange.all_gather("enter", entry, wait)]
    except CheckpointError:
        if me == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    temporary = Path(entries[0][0])
    paths = {str(fields[2]) for fields in entries}
    failed = str(entries[0][1])
    if len(paths) > 1 or failed != "ok":
        if me == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        message = (
            f"save_checkpoint: the ranks passed different paths ({sorted(paths)}); every "
            "rank must pass the same folder"
            if len(paths) > 1
            else f"save_checkpoint on {_dist.where()}: rank 0 {failed}"
        )
        raise CheckpointError(message)

    writer = _Writer(temporary)
    optimizers = _named_optimizers(optim_wrapper)
    engine = deepspeed_engine(model)
    params: dict[str, list[Any]] = {}
    # Collective parts first, every rank taking part even after a local failure (a rank
    # that left would leave the others waiting); local writes after.
    if fmt == "deepspeed":
        from ._deepspeed import param_shapes, save_native

        params = param_shapes(engine)
        writer.attempt(save_native, engine, temporary)
    elif fmt == "dcp":
        params = _save_dcp(model, kind, optimizers, temporary, writer)
    else:
        params = _save_full(model, kind, engine, optimizers, temporary, writer)
    # Everything that can fail on one rank runs inside writer.attempt: the failure is
    # reported to every rank by the check below instead of leaving them waiting in it.
    writer.attempt(
        lambda: save_tensor_file(_rng.capture(), _rng_path(temporary, me)), what="RNG state"
    )
    scalers = scalers_of(optim_wrapper)  # finding them reads attributes; state_dict() may fail
    if me == 0:
        if schedulers:
            writer.attempt(
                lambda: save_tensor_file(
                    [scheduler.state_dict() for scheduler in schedulers],
                    temporary / SCHEDULERS_FILE,
                ),
                what="the schedulers",
            )
        if scalers:
            writer.attempt(
                lambda: save_tensor_file(
                    {
                        DEFAULT_KEY if key == "" else key: scaler.state_dict()
                        for key, scaler in scalers.items()
                    },
                    temporary / SCALER_FILE,
                ),
                what="the grad scaler",
            )
        if extra:
            writer.attempt(save_tensor_file, dict(extra), temporary / EXTRA_FILE)
    _hook("written")
    exchange.check_all_ok("written", writer.error, max(wait, WRITE_TIMEOUT_S))

    error = None
    if me == 0:
        try:  # any failure here (not only the filesystem's) must reach the other ranks
            manifest = Manifest(
                format_version=FORMAT_VERSION,
                strategy=str(strategy),
                wrapper=kind,
                world_size=_dist.world_size(),
                format=fmt,
                zero_stage=None if engine is None else int(engine.zero_optimization_stage()),
                sharding=sharding_of(model, kind),
                params=params,
                has_optimizer=bool(optimizers),
                optimizer_keys=[] if list(optimizers) in ([], [DEFAULT_KEY]) else list(optimizers),
                num_schedulers=len(schedulers),
                has_scaler=bool(scalers),
                rng_ranks=list(range(_dist.world_size())),
                extra_keys=sorted(str(key) for key in (extra or {})),
                versions=_versions(),
                saved_at=time.time(),
                files=_list_files(temporary),
            )
            write_json(manifest.to_json(), temporary / MANIFEST_NAME)
            _hook("manifest")
            _publish(temporary, final)
        except Exception as caught:
            error = CheckpointError(f"cannot finish {final}: {caught}")
            error.__cause__ = caught
    exchange.check_all_ok("done", error, max(wait, WRITE_TIMEOUT_S))
    return final


class _Writer:
    """Runs the local writes of one rank; keeps the first failure instead of raising."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.error: BaseException | None = None

    def attempt(self, function: Callable[..., Any], *args: Any, what: str = "") -> Any:
        if self.error is not None:
            return None
        try:
            return function(*args)
        except Exception as caught:
            target = what or getattr(function, "__name__", "a part")
            message = f"writing {target} into {self.folder} failed on {_dist.where()}: {caught}"
            self.error = CheckpointError(message)
            self.error.__cause__ = caught
            return None


def _rng_path(folder: Path, rank: int) -> Path:
    (folder / RNG_FOLDER).mkdir(mode=0o700, exist_ok=True)
    return folder / RNG_FOLDER / f"rank_{rank}.pt"


def _save_full(
    model: nn.Module,
    kind: str,
    engine: Any,
    optimizers: dict[str, torch.optim.Optimizer],
    folder: Path,
    writer: _Writer,
) -> dict[str, list[Any]]:
    """Full tensors gathered to rank 0 and written there as model.pt / optim.pt."""
    me = _dist.rank()
    if engine is not None:
        from ._deepspeed import full_model_state, param_shapes

        state = full_model_state(engine, rank0_only=True)
        params = param_shapes(engine)
        inner, inner_kind = engine.module, "module"
    else:
        state = None
        if kind in ("fsdp1", "fsdp2"):
            from ._gather import full_state_to_rank0

            state = full_state_to_rank0(model, kind)
        if state is None:
            state = get_model_state(model, kind, full=True, rank0_only=True)
        params = describe_params(state) if me == 0 else {}
        inner, inner_kind = model, kind
    if me == 0:
        writer.attempt(save_tensor_file, state, folder / MODEL_FILE, what=MODEL_FILE)
    del state
    if optimizers:
        states = {
            key: get_optim_state(inner, inner_kind, optimizer, full=True, rank0_only=True)
            for key, optimizer in optimizers.items()
        }
        if me == 0:
            writer.attempt(save_tensor_file, states, folder / OPTIM_FILE, what=OPTIM_FILE)
    return params


def _save_dcp(
    model: nn.Module,
    kind: str,
    optimizers: dict[str, torch.optim.Optimizer],
    folder: Path,
    writer: _Writer,
) -> dict[str, list[Any]]:
    """Each rank writes its shards with torch distributed checkpoint (collective)."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    state = sharded_state(model, kind, optimizers)
    try:
        with quiet_torch():
            dcp_save(state, checkpoint_id=str(folder / DCP_FOLDER))
    except Exception as caught:  # DCP gathers the ranks' failures and raises everywhere
        message = f"torch distributed checkpoint could not write {folder / DCP_FOLDER}: {caught}"
        raise CheckpointError(message) from caught
    return describe_params(state["model"])


def _list_files(folder: Path) -> dict[str, int]:
    return {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _replaceable(final: Path) -> str:
    """ "ok" when a save may put a checkpoint at ``final``, else what is in the way.

    Only a checkpoint (a folder with a manifest), an empty folder or a symbolic link is
    replaced: a user's file, or a folder of other things (a work_dir passed by mistake),
    would be deleted with it.
    """
    if final.is_symlink() or not final.exists():
        return "ok"
    if not final.is_dir():
        return f"found a file at {final}, not a checkpoint folder; pass another path or remove it"
    if _is_checkpoint(final) or not any(final.iterdir()):
        return "ok"
    return (
        f"found a folder at {final} that is not a checkpoint (no {MANIFEST_NAME} written by "
        "comm-strategies in it); a save replaces the folder at its path, so pass another "
        "path (a new folder inside it, say) or remove the folder"
    )


def _is_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a manifest this package wrote (``manifest.json`` alone is a
    common name: a web app's or a data set's folder may hold one)."""
    try:
        manifest = read_manifest(folder)
    except CheckpointError:  # none, damaged, or another program's
        return False
    return "comm-strategies" in manifest.versions


def _publish(temporary: Path, final: Path) -> None:
    """Rename the finished folder to its name; a folder already there is replaced.

    The replaced folder is hidden by a rename, then deleted in the background: deleting a
    large checkpoint (freeing its pages, or many round trips on a network filesystem) is
    not part of writing the new one, which is complete and visible once renamed.
    """
    old = None
    if final.exists() or final.is_symlink():  # a dangling link is replaced too
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(final, old)
    os.replace(temporary, final)
    _fsync_dir(final.parent)
    if old is not None:
        _delete_later(old)


_deleting: dict[Path, threading.Thread] = {}
_EXIT_WAIT_S = 60.0


def _delete_later(folder: Path) -> None:
    """Delete ``folder`` in a background thread; the interpreter waits for it at exit."""
    for done in [path for path, thread in _deleting.items() if not thread.is_alive()]:
        del _deleting[done]
    thread = threading.Thread(
        target=_remove_entry,
        args=(folder,),
        name="comm-checkpoint-delete",
        daemon=True,
    )
    thread.start()
    _deleting[folder] = thread


@atexit.register
def _wait_for_deletions() -> None:
    """Let the background deletions finish at exit, for at most a minute in all (a stuck
    filesystem must not hold the process; what is left, like a killed process's hidden
    ``.NAME.old-*`` folder, is removed by the next save under that name)."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    for thread in list(_deleting.values()):
        thread.join(max(0.0, deadline - time.monotonic()))


def _fsync_dir(folder: Path) -> None:
    if not fsync_enabled():
        return
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _remove_stale(final: Path) -> None:
    """Remove the temporary folders that earlier, killed saves of ``final`` left behind,
    and replaced copies whose background deletion a killed process did not finish."""
    name = glob.escape(final.name)  # a name holding *, ? or [ must match only itself
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        for stale in final.parent.glob(pattern):
            thread = _deleting.get(stale)
            if thread is None or not thread.is_alive():  # not being deleted already
                _remove_entry(stale)


def _remove_entry(path: Path) -> None:
    """Remove a replaced checkpoint: a folder with what it holds, a symbolic link itself
    (never what it points to); errors are ignored, a later save of the name tries again."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass
