"""The switches of the handshake: debug mode, unchecked blocks and the tests' fault hook.

Debug mode (``COMM_DEBUG=1`` or [`debug_mode`][comm_collectives.debug_mode]) adds an
exchange of call sites so a mismatch table also shows where each rank made the call.
[`unchecked`][comm_collectives.unchecked] skips the handshake of the reductions and
broadcasts. [`fault_hook`][comm_collectives._modes.fault_hook] lets the fault-injection
tests make a rank's local work fail.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

__all__ = [
    "checks_enabled",
    "debug_enabled",
    "debug_mode",
    "fault_hook",
    "local_fault",
    "unchecked",
]

# A test hook: called with (stage, operation) at the points where a collective does
# fallible local work, "local" before the handshake and "staging" after it; whatever it
# raises is treated like any local failure there. Used only by the fault-injection tests.
fault_hook: Callable[[str, str], None] | None = None


def local_fault(stage: str, operation: str) -> None:
    """Run the test hook [`fault_hook`][comm_collectives._modes.fault_hook], if set."""
    if fault_hook is not None:
        fault_hook(stage, operation)


_debug_depth = 0


def debug_enabled() -> bool:
    """Return True inside [`debug_mode`][comm_collectives.debug_mode] or with ``COMM_DEBUG`` set.

    ``COMM_DEBUG`` counts as set unless it is empty, ``0``, ``false``, ``no`` or ``off`` (in
    any case).
    """
    if _debug_depth > 0:
        return True
    return os.environ.get("COMM_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


@contextlib.contextmanager
def debug_mode() -> Iterator[None]:
    """Check, inside the block, that all ranks make the same collective call.

    Each collective additionally exchanges its call site, so a
    [`CollectiveMismatchError`][comm_core.CollectiveMismatchError] shows where every rank
    called from. Every rank must enter the block at the same point of its program.

    Examples:
        >>> import torch
        >>> import comm_collectives as dist
        >>> loss = torch.tensor(0.5)
        >>> with dist.debug_mode():
        ...     dist.all_reduce(loss)  # a mismatch here names every rank's call site
        ...     print(dist.debug_enabled())
        True
    """
    global _debug_depth
    _debug_depth += 1
    try:
        yield
    finally:
        _debug_depth -= 1


_unchecked_depth = 0


def checks_enabled() -> bool:
    """Return False inside [`unchecked`][comm_collectives.unchecked] (and not in
    [`debug_mode`][comm_collectives.debug_mode]).

    ``COMM_DEBUG`` does not turn the checks back on: it is read on each rank, and a rank
    that set it alone would start a handshake while the others issue the backend's
    collective (a hang, or the two collectives' bytes mixed). ``debug_mode`` is entered by
    every rank at the same point of its program.
    """
    return _unchecked_depth == 0 or _debug_depth > 0


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Skip the handshake of the reductions and broadcasts inside the block, for hot loops.

    ``all_reduce``, ``broadcast``, ``all_reduce_dict`` and ``all_reduce_params`` then issue
    the backend's own collective and nothing else: no header, no vote, no inline data, and
    the backend's reduction order (the bits of a float sum may differ from the checked
    paths, which reduce in rank order; float16 and bfloat16 sums, means and products
    still travel as float32 and round once, so their values are the checked paths'). A
    mismatch or a failure on one rank is then not
    detected: the other ranks wait for the process group's timeout, as with
    torch.distributed. The collectives that need every rank's size (gathers, object
    collectives, collect_results) keep their handshake. Every rank must enter and leave
    the block at the same point of its program; ``debug_mode`` turns the checks back on
    (``COMM_DEBUG``, which a rank may set alone, does not).

    Examples:
        >>> import torch
        >>> import comm_collectives as dist
        >>> grads = [torch.ones(3)]
        >>> with dist.unchecked():
        ...     dist.all_reduce_params(grads, op="mean")  # one backend all-reduce a bucket
        >>> grads[0]
        tensor([1., 1., 1.])
    """
    global _unchecked_depth
    _unchecked_depth += 1
    try:
        yield
    finally:
        _unchecked_depth -= 1
