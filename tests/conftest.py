"""Guards shared by every layer's tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as torch_dist

from comm_core.testing import WorldPool

_WATCHED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_dist_state() -> Iterator[None]:
    """Fail a test that leaves launcher variables or a process group behind in pytest."""
    before = {name: os.environ.get(name) for name in _WATCHED}
    yield
    leaked = {
        name: os.environ.get(name) for name in _WATCHED if os.environ.get(name) != before[name]
    }
    open_group = torch_dist.is_available() and torch_dist.is_initialized()
    if open_group:
        torch_dist.destroy_process_group()
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    assert not leaked, f"the test changed launcher variables: {leaked}"
    assert not open_group, "the test left a process group open in the pytest process"


# nccl takes one rank per GPU: a one-GPU machine runs the worlds of one.
CUDA_WORLDS = [1, 2] if torch.cuda.device_count() >= 2 else [1]


@pytest.fixture(scope="module", params=CUDA_WORLDS, ids=lambda w: f"world{w}")
def nccl_world(request: pytest.FixtureRequest) -> Iterator[WorldPool]:
    """A world of nccl ranks, one per GPU, for the CUDA tests (they skip without CUDA)."""
    with WorldPool(request.param, backend="nccl", timeout=300.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def cpu_gloo_world() -> Iterator[WorldPool]:
    """A world of 3 ranks on the ``"cpu:gloo"`` backend string, one per test module."""
    with WorldPool(3, backend="cpu:gloo", timeout=60) as pool:
        yield pool
