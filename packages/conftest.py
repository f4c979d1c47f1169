"""Collection of the packages' docstring examples: ``pytest --doctest-modules packages/<dist>/src``.

Each layer's examples run in that layer's environment (``hatch run core:doctest``, ...), in
a plain process: a world of one. A module that needs an extra the environment lacks
(``comm_wrappers.deepspeed`` without DeepSpeed) is reported as skipped, with the reason,
instead of failing to import.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

# Module file (relative to its distribution's src/) -> the distribution it needs.
NEEDS = {"comm_wrappers/deepspeed.py": "deepspeed"}


class _MissingExtra(pytest.File):
    """A module whose examples cannot run here: collecting it skips with the reason."""

    def collect(self) -> NoReturn:
        relative = self.path.relative_to(self.path.parents[1]).as_posix()
        pytest.skip(f"{relative} needs {NEEDS[relative]}, which is not installed here")


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> Iterator[Any]:
    collected = yield
    relative = "/".join(file_path.parts[-2:])
    needs = NEEDS.get(relative)
    if needs is not None and importlib.util.find_spec(needs) is None:
        return [_MissingExtra.from_parent(parent, path=file_path)]
    return collected
