"""Async save: the state copied to the CPU at the call, written by a background thread.

``save_checkpoint(..., async_save=True)`` takes a synchronous save's steps (`_save`). On
the calling thread, while the model is still: the entry, the format's gathers, the copy
of every tensor to the CPU (torch's public ``DefaultStager``: DTensors keep their layout,
the previous copy's memory is reused) and the small files taken as copies; a `SaveHandle`
is returned. On the background thread, while training goes on: the files written (DCP
over a gloo group of its own, created on the calling thread, so the thread never runs a
collective of the default group), then the commit, whose waits poll the store
(``background=True``). A failure on any rank fails the save on every rank at ``wait()``.
The next checkpoint call waits for this one first (`Call`). A killed process
leaves its temporary folder (removed by the next save) and the previous checkpoint whole.
The interpreter waits for a pending save at exit (the thread is not a daemon); call
``wait()`` before destroying the process group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions

import comm_collectives as dist
from comm_wrappers.backends import Backend, describe_params, quiet_torch

from ._consensus import WRITE_TIMEOUT_S, Attempts, Call, SaveHandle, in_background, where
from ._errors import CheckpointError
from ._files import save_file
from ._format_common import Optimizers
from ._format_dcp import sharded_state, write_dcp
from ._layout import DCP_FOLDER, MODEL_FILE, OPTIM_FILE
from ._publish import Publication

__all__ = ["start"]

# The formats written in the background; "deepspeed" (backend.native_checkpoint().save,
# collective inside) is written synchronously and its handle is returned done.
ASYNC_FORMATS = ("full", "dcp")
Commit = Callable[..., None]  # `_save.commit`
SmallFile = tuple[str, Any, Path]  # what (for messages), the state taken, its file


_stager: DefaultStager | None = None


def stage(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a (nested) state dict with every tensor on the CPU, not shared with it.

    torch's ``DefaultStager`` (blocking; pinned memory when CUDA is there), which reuses
    the memory of the previous copy of the same tensors: free to reuse once that save
    ended, which every call waits for first (`Call`). It cannot copy FSDP1's
    ShardedTensors: a state holding one goes through ``BlockingAsyncStager`` (new memory
    each time).
    """
    global _stager
    source = dict(state)
    staged: Any
    with quiet_torch():
        if _holds_sharded_tensor(source):
            staged = BlockingAsyncStager(cache_staged_state_dict=False).stage(source)
        else:
            if _stager is None:
                options = StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
                _stager = DefaultStager(options)
            staged = _stager.stage(source)
    assert isinstance(staged, dict)  # blocking staging returns the copy itself
    return staged


def _holds_sharded_tensor(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    if isinstance(value, ShardedTensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_sharded_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_sharded_tensor(item) for item in value)
    return False


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


def start(
    call: Call,
    publish: Publication,
    backend: Backend,
    optimizers: Optimizers,
    attempts: Attempts,
    files: list[SmallFile],
    commit: Commit,
) -> SaveHandle:
    """Copy the state to the CPU (collective where the format gathers) and start the
    background thread that writes it and the small files already taken, and commits;
    return the save's handle."""
    staged: dict[str, Any] | None = None
    with attempts.keep("the model and optimizer state"):  # the commit raises it everywhere
        staged, publish.params = _stage_parts(publish.fmt, backend, optimizers, attempts)
    group = dcp_group(max(call.timeout, WRITE_TIMEOUT_S)) if publish.fmt == "dcp" else None
    handle = SaveHandle(publish.final)
    thread = threading.Thread(
        target=_run,
        args=(handle, call, publish, commit, attempts, [staged, files], group),
        name="comm-checkpoint-save",
        daemon=False,
    )
    in_background(handle, thread)
    thread.start()
    return handle


def _stage_parts(
    fmt: str, backend: Backend, optimizers: Optimizers, attempts: Attempts
) -> tuple[dict[str, Any] | None, dict[str, list[Any]]]:
    """The CPU copy of the model and optimizer (``dcp``: every rank's shards; ``full``:
    gathered to rank 0, None elsewhere) and the model's shapes."""
    staged = None
    if fmt == "dcp":
        state = sharded_state(backend, optimizers)
        params = describe_params(state["model"])  # the global shapes of the shards
        with attempts.keep("a CPU copy of the state"):
            staged = stage(state)
        return staged, params
    leader = dist.get_rank() == 0
    state = {"model": backend.model_state(full=True, rank0_only=True)}
    if optimizers:
        state["optim"] = {
            key: backend.optim_state(optimizer, full=True, rank0_only=True)
            for key, optimizer in optimizers.items()
        }
    if not leader:
        return None, {}
    with attempts.keep("a CPU copy of the state"):
        staged = stage(state)
    return staged, describe_params(state["model"])


def _run(
    handle: SaveHandle,
    call: Call,
    publish: Publication,
    commit: Commit,
    attempts: Attempts,
    parts: list[Any],
    group: Any,
) -> None:
    """The background thread: write this rank's files, then the commit; end the handle.
    ``parts``: the staged copy and the small files, emptied as they are taken (the copy's
    memory goes back once written)."""
    staged: dict[str, Any] | None = parts[0]
    files: list[SmallFile] = parts[1]
    parts.clear()
    try:
        folder = publish.temporary
        if publish.fmt == "dcp":  # collective on its own group: every rank takes part
            with attempts.keep(DCP_FOLDER):
                write_dcp(staged if staged is not None else {}, folder, group)
        elif staged is not None:  # "full", rank 0
            for key, name in (("model", MODEL_FILE), ("optim", OPTIM_FILE)):
                if key in staged:
                    with attempts.keep(name):
                        save_file(staged[key], folder / name)
        for what, value, file in files:
            with attempts.keep(what):
                save_file(value, file)
        del staged, files  # the copy's memory goes back before the commit's wait
        commit(call, attempts.error, publish, background=True)
        handle._end(None)
    except CheckpointError as error:
        handle._end(error)
    except BaseException as caught:  # the handle must end, whatever happened
        failed = CheckpointError(f"async save of {handle.path} on {where()}: {caught}")
        failed.__cause__ = caught
        handle._end(failed)
