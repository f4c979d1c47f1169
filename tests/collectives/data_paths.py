"""The two paths every collective is tested on, and the worlds it is tested in.

"inline": small data rides in the handshake frame (one collective); "long": inline data
switched off, so the same rank body takes the separate data transfer. Shared by
test_collectives.py and test_collect_results.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WORLDS = [2, 3]
PATHS = ["inline", "long"]


def without_inline(case: Callable[..., Any], *args: Any) -> Any:
    """Run ``case`` with inline data switched off: every collective takes its long path."""
    from comm_collectives._capacity import inline_limit

    with inline_limit(0):
        return case(*args)


def run_on_path(
    comm_run_distributed: Any, path: str, case: Any, *args: Any, world_size: int
) -> Any:
    """Run the rank body ``case`` on ``world_size`` ranks along ``path``."""
    if path == "inline":
        return comm_run_distributed(case, *args, world_size=world_size)
    return comm_run_distributed(without_inline, case, *args, world_size=world_size)
