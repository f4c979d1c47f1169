"""Module-level functions the test-kit and doctor tests run on ranks."""

from __future__ import annotations

import time

import torch
import torch.distributed as torch_dist

import comm_core as dist
from comm_core.doctor import CheckResult


def rank_times_ten() -> int:
    return dist.get_rank() * 10


def fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        message = "deliberate failure on rank 1"
        raise ValueError(message)
    torch_dist.all_reduce(torch.ones(1))  # rank 0 now waits for rank 1, which never comes
    return 0


def sleep_on_rank_zero(seconds: float) -> int:
    if dist.get_rank() == 0:
        time.sleep(seconds)
    return dist.get_rank()


def custom_check() -> list[CheckResult]:
    return [CheckResult("custom", True, f"rank {dist.get_rank()} says hello")]


def fails_on_rank_zero_before_its_collective() -> list[CheckResult]:
    """A plugin check that raises on rank 0 while the other ranks enter its all_reduce."""
    if dist.get_rank() == 0:
        message = "deliberate failure before the collective"
        raise RuntimeError(message)
    total = torch.ones(1)
    torch_dist.all_reduce(total)  # waits for rank 0, which never comes
    return [CheckResult("never", True, "")]
