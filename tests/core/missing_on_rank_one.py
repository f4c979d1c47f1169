"""A doctor plugin whose module cannot be imported on rank 1 (a package missing on a node)."""

from __future__ import annotations

import os

from comm_core.doctor import CheckResult

if os.environ.get("RANK") == "1":
    message = "No module named 'plugin_dependency' (simulated on rank 1)"
    raise ModuleNotFoundError(message)


def check() -> list[CheckResult]:
    return [CheckResult("never run", True, "")]
