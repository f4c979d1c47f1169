"""The test kit itself: results by rank, every failed rank's traceback, stuck ranks, restart."""

from __future__ import annotations

import time

import pytest

from comm_core.testing import RanksFailedError, WorldPool, launch

from . import kit_helpers


def test_results_come_back_by_rank_and_the_pool_is_reused() -> None:
    with WorldPool(3, timeout=30) as pool:
        assert pool.run(kit_helpers.rank_times_ten) == [0, 10, 20]
        pids = [p.pid for p in pool._processes]
        assert pool.run(kit_helpers.rank_times_ten) == [0, 10, 20]
        assert [p.pid for p in pool._processes] == pids  # same ranks, not respawned


def test_failure_reports_the_failed_rank_and_the_stuck_one_then_restarts() -> None:
    with WorldPool(2, timeout=30) as pool:
        start = time.monotonic()
        with pytest.raises(RanksFailedError) as info:
            pool.run(kit_helpers.fail_on_rank_one)
        elapsed = time.monotonic() - start
        states = {r.rank: r.state for r in info.value.reports}
        assert states == {0: "stuck", 1: "error"}
        text = str(info.value)
        # the cause comes first, so a log cut short still shows it
        assert text.splitlines()[0].endswith("rank 1 error, rank 0 stuck")
        assert text.index("rank 1: error") < text.index("rank 0: stuck")
        assert "ValueError: deliberate failure on rank 1" in text
        assert "kit_helpers.py" in text  # rank 1's traceback
        assert "in fail_on_rank_one" in text  # rank 0's stack, dumped while stuck
        assert elapsed < 20  # a grace period after the failure, not the 30 s timeout
        assert not pool.started  # poisoned world stopped ...
        assert pool.run(kit_helpers.rank_times_ten) == [0, 10]  # ... and a fresh one started


def test_a_stuck_rank_is_reported_with_its_stack_within_the_timeout() -> None:
    with WorldPool(2, timeout=30) as pool:
        pool.start()
        start = time.monotonic()
        with pytest.raises(RanksFailedError) as info:
            pool.run(kit_helpers.sleep_on_rank_zero, 60.0, timeout=3.0)
        assert time.monotonic() - start < 10
        assert [r.state for r in info.value.reports] == ["stuck", "ok"]
        assert "in sleep_on_rank_zero" in info.value.reports[0].detail


def test_launch_runs_once_for_notebooks() -> None:
    assert launch(kit_helpers.rank_times_ten, nprocs=2, timeout=60) == [0, 10]


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1, got 0"):
        WorldPool(0)


def test_run_distributed_fixture(comm_run_distributed: object) -> None:
    assert comm_run_distributed(kit_helpers.rank_times_ten, world_size=2) == [0, 10]  # type: ignore[operator]
