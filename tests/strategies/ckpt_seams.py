"""Ways into a save at its steps, through the checkpoint package's own functions.

`at_step` replaces, for the length of a ``with`` block, the function a save calls at that
step by one that runs ``action`` first (to record, hold, sleep or kill the process there):

- ``"entering"``: before the entry (`_save._enter`, every rank);
- ``"entered"``: after the entry, before the write (`_save._enter`, every rank);
- ``"writing"``: in an async save's background thread, before each file it writes
  itself, after DCP's (`_async.save_file`, every rank: its RNG state at least);
- ``"written"``: once this rank's files are written, before the commit (`_save.commit`,
  every rank; in the background thread for an async save);
- ``"manifest"``: rank 0 only, the manifest written, before the rename
  (`_publish.finish`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from comm_strategies.checkpoint import _async, _publish, _save

_PLACES: dict[str, tuple[Any, str]] = {
    "entering": (_save, "_enter"),
    "entered": (_save, "_enter"),
    "writing": (_async, "save_file"),
    "written": (_save, "commit"),
    "manifest": (_publish, "finish"),
}
_AFTER = ("entered",)  # the action runs once the function returned


def patch_step(step: str, action: Callable[[], Any]) -> Callable[[], None]:
    """Run ``action`` at ``step`` of every save from now on; returns the undo."""
    module, name = _PLACES[step]
    original = getattr(module, name)

    def with_the_action(*args: Any, **kwargs: Any) -> Any:
        if step not in _AFTER:
            action()
        result = original(*args, **kwargs)
        if step in _AFTER:
            action()
        return result

    setattr(module, name, with_the_action)
    return lambda: setattr(module, name, original)


@contextlib.contextmanager
def at_step(step: str, action: Callable[[], Any]) -> Iterator[None]:
    """`patch_step` for the length of the block."""
    undo = patch_step(step, action)
    try:
        yield
    finally:
        undo()


@contextlib.contextmanager
def recording(steps: list[str]) -> Iterator[None]:
    """Append the name of each step to ``steps`` as the saves in the block reach it."""
    with contextlib.ExitStack() as stack:
        for step in ("entered", "writing", "written", "manifest"):
            stack.enter_context(at_step(step, lambda step=step: steps.append(step)))
        yield
