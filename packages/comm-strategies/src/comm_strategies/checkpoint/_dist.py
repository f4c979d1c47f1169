"""Rank queries and a bounded handshake on the process group's store.

The checkpoint functions are collective. A rank that calls one alone must get an error
instead of waiting forever in a barrier, so every call starts with a handshake on the
default group's key-value store: each rank posts a key and waits, with a timeout, for the
keys of all the others. The same mechanism exchanges small strings (the folder name,
each rank's outcome), whatever the backend (gloo, NCCL): no tensor, no device sync.
"""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from ._errors import CheckpointError

DEFAULT_TIMEOUT_S = 300.0
_TIMEOUT_VARIABLE = "COMM_CHECKPOINT_TIMEOUT"
_SOON_S = 0.05  # how long the ranks' keys are checked before the store's own wait
_calls = 0


def is_distributed() -> bool:
    """Whether a default process group is initialised."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return torch_dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return torch_dist.get_world_size() if is_distributed() else 1


def where() -> str:
    """``"rank R of W"`` for error messages."""
    return f"rank {rank()} of {world_size()}"


def handshake_timeout(timeout: float | None, operation: str) -> float:
    """The timeout of the entry handshake: the argument, the variable, or the default."""
    if timeout is not None:
        return _checked(float(timeout), "timeout", operation)
    value = os.environ.get(_TIMEOUT_VARIABLE)
    if value:
        try:
            seconds = float(value)
        except ValueError:
            message = f"{_TIMEOUT_VARIABLE} must be a number of seconds, got {value!r}"
            raise CheckpointError(message) from None
        return _checked(seconds, _TIMEOUT_VARIABLE, operation)
    return DEFAULT_TIMEOUT_S


def _checked(seconds: float, source: str, operation: str) -> float:
    """``seconds`` when it bounds a wait: the store's wait takes infinity or NaN as a
    deadline already passed, and 0 (or less) as its own default timeout."""
    if not (0.0 < seconds < math.inf):
        message = (
            f"{operation}: {source} must be a positive, finite number of seconds, got "
            f"{seconds!r}; pass a large number (86400: a day) to wait long"
        )
        raise CheckpointError(message)
    return seconds


_FIRST = "enter"  # the first exchange of every call
_ENCODING = "utf-8"


class Exchange:
    """Small string exchanges between the ranks of one collective checkpoint call."""

    def __init__(self, operation: str) -> None:
        global _calls
        _calls += 1
        self.number = _calls
        self.operation = operation
        self.prefix = f"comm_checkpoint/{_calls}"
        self.store: Any = None
        if is_distributed() and world_size() > 1:
            from torch.distributed.distributed_c10d import _get_default_store

            self.store = _get_default_store()

    def all_gather(self, name: str, value: str, timeout: float) -> list[str]:
        """Post ``value`` under ``name`` and return every rank's value, index = rank.

        Raises:
            CheckpointError: A rank did not post within ``timeout`` seconds.
        """
        if self.store is None:
            return [value]
        me, world = rank(), world_size()
        keys = [f"{self.prefix}/{name}/{r}" for r in range(world)]
        # surrogateescape: a path read from the filesystem may hold bytes that are not UTF-8
        self.store.set(keys[me], value.encode(_ENCODING, "surrogateescape"))
        try:
            if not self._arrived_soon(keys):
                self.store.wait(keys, timedelta(seconds=timeout))
        except Exception as error:  # the store raises a plain RuntimeError/DistStoreError
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            if not missing:  # the last rank posted just after the deadline: it is here
                return [
                    bytes(self.store.get(key)).decode(_ENCODING, "surrogateescape") for key in keys
                ]
            if name == _FIRST:
                self._withdraw(keys[me])
            message = (
                f"{self.operation} on {where()}: rank(s) {missing} did not reach {name!r} "
                f"within {timeout:g} s. Every rank must call {self.operation} (it is "
                "collective): call it on all ranks, not under `if rank == 0`. If the other "
                f"ranks are only slow, raise the timeout ({_TIMEOUT_VARIABLE} or timeout=)."
            )
            raise CheckpointError(message) from error
        return [bytes(self.store.get(key)).decode(_ENCODING, "surrogateescape") for key in keys]

    def _withdraw(self, key: str) -> None:
        """Undo this call's entry after the others did not come (a call on rank 0 alone).

        The key is deleted and the call's number given back, so this rank's next call
        carries the number the other ranks' next call has: a save made under
        ``if rank == 0`` fails once, and the collective saves after it work. Not covered: a
        rank that reaches ``enter`` in the instant the timed-out rank withdraws may still
        see its key and go on alone; its outcome all-reduce then waits for the process
        group's timeout, or meets the other rank's next collective on the CPU group.
        """
        global _calls
        try:
            self.store.delete_key(key)
        except Exception:  # a store without deletion: the late rank then times out later
            return
        if _calls == self.number:
            _calls -= 1

    def _arrived_soon(self, keys: list[str]) -> bool:
        """Whether every key is posted within a few milliseconds, checked every 0.2 ms.

        The ranks usually arrive together. A store's own wait can be coarse (torch's
        FileStore looks every 10 ms), so the common case is checked first; the bounded
        wait of the store follows only when a rank is late.
        """
        deadline = time.monotonic() + _SOON_S
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
        return True

    def check_all_ok(self, name: str, error: BaseException | None, timeout: float) -> None:
        """Share each rank's outcome; raise on every rank if any rank failed.

        Once every rank has entered (the store handshake), every rank is known to be in
        the call and a collective answers faster than a store polled for keys: one
        all-reduce of a flag on the CPU group (gloo; gloo's twin under NCCL: no device
        sync) says whether any rank failed, and only then do the messages travel, by an
        object all-gather (a few milliseconds on gloo, paid on the failure path only).
        The flag is waited for at most ``timeout`` seconds: a rank that died after the
        handshake makes the others raise then, not after the process group's timeout.
        """
        outcome = "ok" if error is None else f"{type(error).__name__}: {error}"
        if self.store is None:
            outcomes = [outcome]
        else:
            from comm_collectives import get_cpu_group

            group = get_cpu_group()
            flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
            started = time.monotonic()
            work = torch_dist.all_reduce(flag, group=group, async_op=True)
            try:
                if work is not None:
                    work.wait(timeout=timedelta(seconds=timeout))
            except RuntimeError as exc:  # this bound, or the process group's own timeout
                waited = time.monotonic() - started
                message = (
                    f"{self.operation}: rank {rank()} waited {waited:.0f} s at step {name!r} "
                    f"for the other ranks' outcome ({exc}); a rank died or is stuck: check "
                    "the logs of the other ranks."
                )
                raise CheckpointError(message) from (error or exc)
            if not int(flag.item()):
                return
            gathered: list[Any] = [None] * world_size()
            torch_dist.all_gather_object(gathered, outcome, group=group)
            outcomes = [str(item) for item in gathered]
        failed = [(r, text) for r, text in enumerate(outcomes) if text != "ok"]
        if not failed:
            return
        if error is not None and isinstance(error, CheckpointError) and len(failed) == 1:
            raise error
        details = "; ".join(f"rank {r}: {text}" for r, text in failed)
        message = f"{self.operation} failed on {len(failed)} rank(s): {details}"
        raise CheckpointError(message) from error


def barrier() -> None:
    """The process group's barrier (nothing without one)."""
    if is_distributed() and world_size() > 1:
        torch_dist.barrier()
