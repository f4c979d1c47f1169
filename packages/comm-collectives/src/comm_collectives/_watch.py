"""Watched waits: no survivor stays blocked on a rank that has left the call.

When a rank dies in the middle of a call, the survivors do not all see it at once. A
survivor whose own exchange with the dead rank fails leaves the call with the transport
error (``_faults``). Another survivor may be blocked on *that* survivor, which is alive:
their connection is fine, so the backend reports nothing until the process group's
timeout. Both cases were seen in ``collect_results`` on gloo, a world of 3, a sender
killed while the handshake's frames travel (about 1 run in 7 before this module):

- the handshake's all-to-all: gloo completes a send only once the receiver has posted
  the matching receive. A survivor whose exchange with the dead rank failed first leaves
  before posting its receive from the other survivor, which then waits in that send
  (its stack: ``gloo::alltoall`` -> ``UnboundBuffer::waitSend``);
- the part's stream: rank 0's handshake completed, a sender's failed; rank 0 waits for
  the chunks of a sender that has left (``PartReader._pull``).

So a rank that leaves a call with a transport error first posts a failure notice for the
group in the store (``_faults.silent_ranks``), and the waits on transfers on the CPU whose
peer may leave are watched: they wait in slices (50 ms, then twice as long each time, up
to a third of ``_faults._LIVENESS_WAIT_S``) and look for a notice between slices, one
small store request. A rank that finds one leaves too, through the same liveness check
(``_faults.join_failure``): it marks itself alive in time to be counted so by the rank that
posted the notice, and both name the ranks that never mark themselves, the dead ones.
A wait that completes within its first slice never asks the store.

A collective's work can be waited on with a bound (``Work.wait(timeout)`` leaves it pending
when the bound passes). A point-to-point work of gloo cannot: its ``is_completed`` stays
False until ``wait`` is called, and a ``wait(timeout)`` that expires closes the rank's
connections of the whole process group (while a wait on another of its pending transfers
stays blocked: tried). Its wait therefore runs in a helper thread (``_Blocker``), kept for
the next wait, while the caller waits on the helper's lock in slices. A rank that leaves such a wait
leaves its helper blocked in the abandoned transfer until gloo ends it (the process group's
timeout, or the peer's exit); should that happen while the interpreter exits, the process
aborts there ("terminate called without an active exception", a known effect of daemon
threads in C++ calls), after the error was raised. Works on another device (nccl) are
waited on as they are: their ``wait`` does not block the host.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as torch_dist

from . import _faults

__all__ = ["wait_collective", "wait_p2p"]

_FIRST_SLICE_S = 0.05


def _slices() -> Iterator[float]:
    """How long each slice of a watched wait lasts: short at first (a peer that left is
    noticed quickly), then longer (a long wait asks the store about once a second)."""
    seconds = _FIRST_SLICE_S
    while True:
        yield seconds
        seconds = min(2 * seconds, max(_FIRST_SLICE_S, _faults._LIVENESS_WAIT_S / 3))


def wait_collective(
    work: torch_dist.Work,
    operation: str,
    group: torch_dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Wait for ``work``, a collective on ``group``; leave when another rank of it failed.

    Raises:
        RemoteRankError: Another rank left the call after a transport error (its failure
            notice), naming the ranks that did not report alive.
        RuntimeError: The backend's own error (a lost peer, its timeout).
    """
    if device.type != "cpu" or not _pending(work):  # done already (the handshake's usual case)
        work.wait()
        return
    for seconds in _slices():
        try:
            work.wait(timeout=timedelta(seconds=seconds))
            return
        except RuntimeError:
            if not _pending(work):  # it ended meanwhile, or failed: the backend's error
                work.wait()
                return
        _leave_on_notice(operation, group)


def wait_p2p(
    works: torch_dist.Work | Sequence[torch_dist.Work],
    operation: str,
    group: torch_dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Wait for ``works``, sends or receives on ``group``, in order (one hand-over to the
    helper thread for all); leave when another rank failed.

    Raises:
        RemoteRankError: Another rank left the call after a transport error (its failure
            notice), naming the ranks that did not report alive.
        RuntimeError: The backend's own error (a lost peer, its timeout).
    """
    works = [works] if isinstance(works, torch_dist.Work) else list(works)
    if device.type != "cpu":
        for work in works:
            work.wait()
        return
    blocker = _Blocker.take()
    blocker.begin(works)
    for seconds in _slices():
        if blocker.done.acquire(timeout=seconds):
            error, blocker.error = blocker.error, None
            _Blocker.idle.append(blocker)
            if error is not None:
                raise error
            return
        # the blocker stays with the abandoned transfer until the backend ends it
        _leave_on_notice(operation, group)


def _pending(work: torch_dist.Work) -> bool:
    try:
        return not work.is_completed()
    except RuntimeError:  # a failed work may raise here: its wait raises the error
        return False


def _leave_on_notice(operation: str, group: torch_dist.ProcessGroup | None) -> None:
    notice = _faults.failure_notice(group)
    if notice is not None:
        raise _faults.join_failure(operation, notice, group)


class _Blocker(threading.Thread):
    """A daemon thread that waits on point-to-point works for a caller who can only wait
    on it with a bound.

    Attributes:
        done: Released when the works handed over by ``begin`` have finished.
        error: What its wait raised, or None.
    """

    idle: ClassVar[list[_Blocker]] = []  # kept for the next wait

    def __init__(self) -> None:
        super().__init__(name="comm-wait", daemon=True)
        self._go = threading.Lock()
        self._go.acquire()
        self.done = threading.Lock()
        self.done.acquire()
        self._works: list[torch_dist.Work] = []
        self.error: BaseException | None = None
        self.start()

    @classmethod
    def take(cls) -> _Blocker:
        """An idle blocker, or a new one."""
        try:
            return cls.idle.pop()
        except IndexError:
            return cls()

    def begin(self, works: list[torch_dist.Work]) -> None:
        """Start waiting on ``works``; ``done`` is released when they have finished."""
        self._works = works
        self._go.release()

    def run(self) -> None:
        while True:
            self._go.acquire()
            works, self._works = self._works, []
            try:
                for work in works:
                    work.wait()
            except BaseException as exc:  # handed to the caller
                self.error = exc
            self.done.release()


# a forked child has none of its parent's threads: it starts its own
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Blocker.idle.clear)
