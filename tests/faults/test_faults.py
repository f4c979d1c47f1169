"""Fault injection: one rank fails, every rank raises the library's error within 10 s.

For every public collective of comm_collectives (collect_results has its own file), one
rank gets a bad argument, a local failure before or after the handshake, a different
dtype, shape, op or root, or is killed with SIGKILL in the middle of the call. Every live
rank must raise RemoteRankError (naming that rank) or CollectiveMismatchError, within 10
seconds, and the next collective on the same group must work (except after a kill: the
group has lost a member).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from comm_core.testing import RanksFailedError, WorldPool

from . import cases

BOUND_S = 10.0


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, WorldPool]]:
    made: dict[int, WorldPool] = {}
    yield made
    for pool in made.values():
        pool.close()


# The process group's own timeout: a survivor that exchanges nothing with a killed rank in
# the call's algorithm (gloo's small all-reduce talks to one neighbour) only learns of the
# loss when it times out; it then names the silent rank too.
PG_TIMEOUT_S = 5.0


def _pool(pools: dict[int, WorldPool], world: int) -> WorldPool:
    if world not in pools:
        pools[world] = WorldPool(world, timeout=120.0, pg_timeout=PG_TIMEOUT_S)
    return pools[world]


# "plain": headers and data on one group; "compact": the exchange of worlds over 64 ranks;
# "side": headers on a CPU side group, data on the group itself (the nccl layout)
MODES = [(2, "plain"), (3, "plain"), (3, "compact"), (3, "side")]


@pytest.mark.parametrize(("world", "mode"), MODES)
def test_every_fault_raises_on_every_rank_in_time(
    pools: dict[int, WorldPool], world: int, mode: str
) -> None:
    pool = _pool(pools, world)
    if mode == "side":
        results = pool.run(cases.side_channel_matrix)
        for r in results:
            assert r.pop("side group") is True
    else:
        results = pool.run(cases.fault_matrix, mode == "compact")
    victim = world - 1
    cells = results[0].keys()
    expected_cells = {
        f"{name}/{kind}"
        for name in cases.COLLECTIVES
        for kind in cases.KINDS
        if (name, kind) not in cases.NOT_APPLICABLE
    }
    assert set(cells) == expected_cells
    for cell in cells:
        for rank, r in enumerate(results):
            got = r[cell]
            where = f"{cell} on rank {rank}: {got}"
            assert got["raised"] == got["expected"], where
            if got["raised"] == "RemoteRankError":
                assert got["ranks"] == [victim], where
            assert got["seconds"] < BOUND_S, where
            assert got["next_ok"], where


# (collective, stage, world): the victim dies before the handshake ("local"; in a world of
# 3 for three of them: the handshake's all-gather reaches every survivor) or after it,
# before the data moves ("staging", long path). After the handshake gloo's small all-reduce (the vote) may route
# a survivor's data through another survivor only; that survivor learns of the loss at the
# process group's timeout (docs/collectives.md), so those kills run in a world of 2.
KILLS = [
    (name, "local", 3 if name in ("all_reduce", "all_gather_object", "broadcast") else 2)
    for name in cases.COLLECTIVES
] + [
    ("all_reduce", "staging", 2),
    ("all_gather_object", "staging", 2),
    ("broadcast_object_list", "staging", 2),
]


@pytest.mark.parametrize(("name", "stage", "world"), KILLS)
def test_a_killed_rank_is_named_by_every_survivor(
    pools: dict[int, WorldPool], tmp_path: Path, name: str, stage: str, world: int
) -> None:
    pool = _pool(pools, world)
    victim = world - 1
    with pytest.raises(RanksFailedError) as info:
        pool.run(cases.killed_rank, name, stage, str(tmp_path), timeout=60.0)
    states = {r.rank: r.state for r in info.value.reports}
    assert states == {**dict.fromkeys(range(victim), "ok"), victim: "died"}, str(info.value)
    for rank in range(victim):
        record: dict[str, Any] = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["raised"] in ("RemoteRankError", "CommTimeoutError"), record
        assert record["ranks"] == [victim], record
        assert record["lost"], record
        assert record["seconds"] < BOUND_S, record
    assert not os.path.exists(tmp_path / f"rank{victim}.json")


def test_debug_mode_on_some_ranks_only(pools: dict[int, WorldPool]) -> None:
    results = _pool(pools, 2).run(cases.debug_on_some_ranks)
    for r in results:
        assert r["sum"] == 3.0
        assert r["gathered"] == [0, 1]
        assert r["box"] == [0]
        # the rank that asked for debug mode makes every rank show the call sites
        assert "call site" in r["mismatch"]
        assert "cases.py" in r["mismatch"]
