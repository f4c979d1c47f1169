"""Async save: the state copied to the CPU at the call, written by a background thread.

``save_checkpoint(..., async_save=True)`` blocks only for what must happen while the
model is still: the entry handshake, the collective gathers of the format (a full save of
a sharded model gathers it to rank 0), the copy of every tensor to the CPU (`stage`: what
torch distributed checkpoint's ``BlockingAsyncStager`` does; DTensors and ShardedTensors
keep their layout; the memory of the previous async save's copy is reused when the shapes
are the same) and the user state deep-copied. It then returns a `SaveHandle`; training
goes on while a background thread writes the copy. A rank whose copy failed writes
nothing (but takes part in the DCP writes) and fails the save through the vote below:
its error is raised by ``wait()`` on every rank.

The background thread never runs a collective of the default process group: the training
thread runs those meanwhile, and two threads issuing collectives on one group interleave
differently on each rank (a hang, or tensors crossed between the calls). Instead:

- the files of the ``dcp`` format are written by torch distributed checkpoint over a
  gloo group of its own (created once, on the calling thread of every rank, at the first
  async DCP save, as torch recommends for its own ``async_save``); only one background
  save runs at a time, so nothing else uses that group meanwhile;
- the ranks' outcome is exchanged through the default group's key-value store (each rank
  posts its error, or nothing, under a key of this save, and polls for the others'
  keys with a deadline): no tensor moves, and the store serves the threads of a process
  one short request at a time (the polling never holds it in a long blocking wait);
- rank 0 then writes the manifest and renames the folder (`_publish.finish`), removes
  old checkpoints when asked (`_publish.retain`), and posts the publish's outcome; the
  other ranks wait for that key. So the manifest and the rename happen only when every
  rank's files are whole, and every rank's handle ends with the same outcome.

A second save, synchronous or not, first waits for the previous one (`wait_previous`),
which also keeps the saves' keys and the DCP group to one save at a time. A process
killed during an async save leaves its temporary folder (removed by the next save of
that name) and the previous checkpoint whole. The interpreter waits for a pending save at
exit (the thread is not a daemon); call ``wait()`` before destroying the process group.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import comm_collectives as dist

from ._consensus import where
from ._errors import CheckpointError
from ._files import save_tensor_file
from ._format_common import Attempts, quiet_torch
from ._layout import DCP_FOLDER, MODEL_FILE, OPTIM_FILE

__all__ = ["Job", "SaveHandle", "stage", "start", "wait_previous"]

# The formats written in the background; "deepspeed" (the engine's own save_checkpoint,
# collective inside) is written synchronously and its handle is returned done.
ASYNC_FORMATS = ("full", "dcp")
_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.05


class SaveHandle:
    """A checkpoint being saved in the background by ``save_checkpoint(async_save=True)``.

    Every rank gets one. ``wait()`` returns the folder once it is published (manifest
    written, renamed into place), or raises the save's `CheckpointError` on every rank
    when any rank failed; ``done()`` says whether that point is reached, without waiting.

    Examples:
        >>> import tempfile, torch
        >>> from comm_strategies.checkpoint import save_checkpoint
        >>> handle = save_checkpoint(tempfile.mkdtemp() + "/step_1", model=torch.nn.Linear(2, 1),
        ...                          strategy="single", async_save=True)
        >>> handle.wait().name  # training may run between the call and wait()
        'step_1'
        >>> handle.done()
        True
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._observed = False

    @property
    def path(self) -> Path:
        """The checkpoint folder (it exists once the save is published)."""
        return self._path

    def done(self) -> bool:
        """Whether the save has ended, published or failed (``wait()`` then returns at once)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Wait for the save to end; return the checkpoint folder.

        Args:
            timeout: Seconds to wait at most; None waits until the save ends (the ranks
                wait for each other's writes at most the larger of the save's timeout and
                an hour).

        Returns:
            The published checkpoint folder.

        Raises:
            CheckpointError: The save failed on some rank (raised on every rank, naming
                the ranks and their errors); nothing was published.
            TimeoutError: The save is still running after ``timeout`` seconds (it goes on;
                call ``wait()`` again).
        """
        if not self._finished.wait(timeout):
            message = (
                f"the async save of {self._path} is still running after {timeout:g} s on "
                f"{where()}; call wait() again"
            )
            raise TimeoutError(message)
        self._observed = True
        if self._error is not None:
            raise self._error
        return self._path

    def _end(self, error: BaseException | None) -> None:
        self._error = error
        self._finished.set()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "running"
        return f"SaveHandle({str(self._path)!r}, {state})"


def finished(path: Path) -> SaveHandle:
    """A handle of a save that already ended (a synchronous one)."""
    handle = SaveHandle(path)
    handle._end(None)
    return handle


_pending: SaveHandle | None = None


def wait_previous() -> None:
    """Wait for the async save still running, if any (every save starts with this).

    Its failure was raised on no rank when nobody called its ``wait()``: it is reported
    as a warning here (on every rank alike: the ranks share the outcome) and not raised,
    so that the new save, which may succeed, still happens.
    """
    global _pending
    previous, _pending = _pending, None
    if previous is None:
        return
    previous._finished.wait()
    if previous._error is not None and not previous._observed:
        message = (
            f"the previous async save ({previous.path}) failed and nobody called its "
            f"wait(): {previous._error}"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------- staging
# The CPU copies of the last async save, by slot ("model", "optim", "dcp"), reused by the
# next one whose tensors have the same layout: copying into memory already touched costs
# half as much as into new memory (every new page faults in). Free to reuse once that
# save ended, which every save waits for first (`wait_previous`).
_copies: dict[str, tuple[Any, dict[str, Any]]] = {}


def stage(state: Mapping[str, Any], slot: str) -> dict[str, Any]:
    """A copy of a (nested) state dict with every tensor on the CPU, not shared with it.

    The tensors go into the memory of the previous copy of ``slot`` when their layout is
    the same (torch's ``_copy_state_dict``), else into new memory (torch's
    ``_create_cpu_state_dict``, pinned when CUDA is there), as torch distributed
    checkpoint's ``BlockingAsyncStager`` does with and without its cache. Other values are
    taken as they are (numbers, strings) or deep-copied.
    """
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    source = dict(state)
    layout = _layout(source)
    with quiet_torch():
        previous = _copies.get(slot)
        if previous is None or previous[0] != layout:
            _copies.pop(slot, None)  # its memory goes back before the new copy is made
            previous = (layout, _create_cpu_state_dict(source, pin_memory=_pinned()))
        copied = dict(_copy_state_dict(source, previous[1], type_check=False))
    _copies[slot] = previous
    return copied


def _pinned() -> bool:
    return torch.cuda.is_available()


def _layout(value: Any) -> Any:
    """What must match for a copy to reuse another's memory: structure, shapes, dtypes."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        return ("dtensor", tuple(local.shape), local.dtype, str(value.placements))
    if isinstance(value, ShardedTensor):
        shards = tuple((tuple(s.tensor.shape), s.tensor.dtype) for s in value.local_shards())
        return ("sharded", shards)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, Mapping):
        return ("dict", tuple((key, _layout(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_layout(item) for item in value))
    return ("value", type(value).__name__)


def snapshot(value: Any) -> Any:
    """A deep copy of user state (schedulers, scaler, ``extra``) with tensors on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return type(value)({key: snapshot(item) for key, item in value.items()})  # type: ignore[call-arg]
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(snapshot(item) for item in value)
    return copy.deepcopy(value)


_side_group: tuple[Any, Any] | None = None


def dcp_group(timeout_s: float) -> Any:
    """The gloo group the background DCP writes use (every rank creates it, same order).

    One per default group: created at the first async DCP save after ``init_dist``, on
    the calling thread of every rank (a collective of the default group's store).
    """
    global _side_group
    if not dist.is_distributed():
        return None
    default = torch_dist.distributed_c10d._get_default_group()
    if _side_group is None or _side_group[0] is not default:
        group = torch_dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        _side_group = (default, group)
    return _side_group[1]


# ---------------------------------------------------------------------- the thread
Write = tuple[str, Any, Path]  # what (for messages), the staged object, the file


@dataclass
class Job:
    """One async save, as the calling thread hands it to the background thread.

    Attributes:
        final: The checkpoint folder.
        temporary: The folder being written (created by rank 0 at entry).
        fmt: ``"full"`` or ``"dcp"``.
        staged: The model and optimizer copy: ``{"model": ..., "optim": {...}}`` (under
            ``full`` only on rank 0, None elsewhere).
        files: Small files this rank writes (RNG; on rank 0 schedulers, scaler, extra).
        publish: Rank 0's last step: the manifest, the rename, the retention.
        key: The store keys' prefix, the same on every rank and new for each save.
        timeout_s: How long a rank waits for the others' writes.
        hook: The test hook (called with ``"writing"`` when the thread starts, with
            ``"written"`` before the vote).
        error: This rank's failure while copying: no file of this rank is written, and
            the vote fails the save on every rank (the DCP writes still take part).
    """

    final: Path
    temporary: Path
    fmt: str
    staged: dict[str, Any] | None
    files: list[Write]
    publish: Callable[[], None]
    key: str
    timeout_s: float
    hook: Callable[[str], None]
    error: BaseException | None = None


def start(job: Job) -> SaveHandle:
    """Start the background writer of a staged save; return its handle."""
    global _pending
    handle = SaveHandle(job.final)
    group = dcp_group(job.timeout_s) if job.fmt == "dcp" else None
    store = torch_dist.distributed_c10d._get_default_store() if dist.is_distributed() else None
    writer = _Writer(handle, job)
    thread = threading.Thread(
        target=writer.run, args=(group, store), name="comm-checkpoint-save", daemon=False
    )
    _pending = handle
    thread.start()
    return handle


class _Writer:
    """What the background thread of one save does, in order (see the module docstring)."""

    def __init__(self, handle: SaveHandle, job: Job) -> None:
        self.handle = handle
        self.job = job
        self.temporary = job.temporary
        self.key = job.key
        self.timeout_s = job.timeout_s
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def run(self, group: Any, store: Any) -> None:
        try:
            error = self._write(group)
            self.job.staged = None  # the copy's memory goes back before the others finish
            self.handle._end(self._finish(store, error))
        except CheckpointError as error:
            self.handle._end(error)
        except BaseException as caught:  # the handle must end, whatever happened
            failed = CheckpointError(f"async save of {self.handle.path} on {where()}: {caught}")
            failed.__cause__ = caught
            self.handle._end(failed)

    def _write(self, group: Any) -> BaseException | None:
        job = self.job
        attempts = Attempts(self.temporary)
        attempts.error = job.error
        attempts.run(job.hook, "writing", what="this rank's files")
        if job.fmt == "dcp":  # collective on its own group: every rank takes part, always
            collective = Attempts(self.temporary)
            collective.run(self._write_dcp, group, what=DCP_FOLDER)
            attempts.error = attempts.error or collective.error
        elif job.staged is not None:  # "full", rank 0
            model = job.staged["model"]
            attempts.run(save_tensor_file, model, self.temporary / MODEL_FILE, what=MODEL_FILE)
            if "optim" in job.staged:
                optim = job.staged["optim"]
                attempts.run(save_tensor_file, optim, self.temporary / OPTIM_FILE, what=OPTIM_FILE)
        for what, value, path in job.files:
            attempts.run(_save_in, value, path, what=what)
        attempts.run(job.hook, "written", what="this rank's files")
        return attempts.error

    def _write_dcp(self, group: Any) -> None:
        # a rank whose copy failed takes part with nothing to write (its failure is voted)
        staged = self.job.staged if self.job.staged is not None else {}
        with quiet_torch():
            dcp_save(staged, checkpoint_id=str(self.temporary / DCP_FOLDER), process_group=group)

    def _finish(self, store: Any, error: BaseException | None) -> BaseException | None:
        """The vote through the store, rank 0's publish, the publish's outcome shared."""
        from . import _publish

        texts = [_label(error)] if store is None else self._exchange(store, _label(error))
        failures = [(rank, text) for rank, text in enumerate(texts) if text]
        if failures:
            if self.rank == 0:
                _publish.abandon(self.temporary)
            if error is not None and len(failures) == 1:
                return error
            details = "; ".join(f"rank {rank}: {text}" for rank, text in failures)
            return CheckpointError(
                f"async save_checkpoint of {self.handle.path} failed on {len(failures)} "
                f"rank(s): {details}"
            )
        outcome = ""
        if self.rank == 0:
            try:
                self.job.publish()
            except Exception as caught:
                outcome = f"cannot finish {self.handle.path}: {type(caught).__name__}: {caught}"
            if store is not None:
                store.set(f"{self.key}/published", outcome.encode())
        else:
            outcome = self._await(store, [f"{self.key}/published"])[0]
        if outcome:
            return CheckpointError(f"async save_checkpoint: rank 0 {outcome}")
        return None

    def _exchange(self, store: Any, mine: str) -> list[str]:
        """Post this rank's outcome; every rank's once all posted (index = rank)."""
        keys = [f"{self.key}/written/{rank}" for rank in range(self.world)]
        store.set(keys[self.rank], mine.encode("utf-8", "surrogateescape"))
        return self._await(store, keys)

    def _await(self, store: Any, keys: list[str]) -> list[str]:
        """Poll for ``keys`` (short checks: the store stays free for the training thread)."""
        started = time.monotonic()
        delay = _POLL_FIRST_S
        while not store.check(keys):
            if time.monotonic() - started > self.timeout_s:
                missing = [key for key in keys if not store.check([key])]
                message = (
                    f"async save_checkpoint of {self.handle.path}: {where()} waited "
                    f"{self.timeout_s:g} s for {missing} (the other ranks' outcome); a rank "
                    "died or is stuck: check the logs of the other ranks"
                )
                raise CheckpointError(message)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        return [bytes(store.get(key)).decode("utf-8", "surrogateescape") for key in keys]


def _save_in(value: Any, path: Path) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    save_tensor_file(value, path)


def _label(error: BaseException | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"
