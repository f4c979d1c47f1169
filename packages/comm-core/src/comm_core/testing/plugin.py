"""pytest plugin of comm-core, registered through the ``pytest11`` entry point.

Its fixtures carry a ``comm_`` prefix, so they do not clash with a project's own fixtures;
``pytest -p no:comm_core`` keeps the plugin out of a run altogether.

Fixtures:
    comm_pools: session-wide cache of [`WorldPool`][comm_core.testing.WorldPool] objects, one per
        world size, so the ranks are spawned once per session and reused by every test.
    comm_run_distributed: ``comm_run_distributed(fn, *args, world_size=2, timeout=60,
        **kwargs)`` runs a module-level function on that many real gloo ranks and returns
        the results by rank.
    run_distributed: the former name of ``comm_run_distributed``, kept for existing test
        suites; deprecated, to be removed in 0.2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .pool import PoolCache


@pytest.fixture(scope="session")
def comm_pools() -> Iterator[PoolCache]:
    """Session-wide pools of real gloo ranks, one per world size."""
    cache = PoolCache()
    yield cache
    cache.close()


@pytest.fixture
def comm_run_distributed(comm_pools: PoolCache) -> Callable[..., list[Any]]:
    """Return a function that runs a module-level function on N real gloo ranks."""

    def run(
        function: Callable[..., Any],
        *args: Any,
        world_size: int = 2,
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> list[Any]:
        return comm_pools.get(world_size).run(function, *args, timeout=timeout, **kwargs)

    return run


@pytest.fixture
def run_distributed(comm_run_distributed: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """Deprecated name of ``comm_run_distributed`` (removed in 0.2)."""
    return comm_run_distributed
