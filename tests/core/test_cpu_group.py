"""get_cpu_group: the CPU twin of a group, created by its members only and dropped with the
default group it belongs to.

On this CPU machine every backend moves CPU tensors, so the twin path is exercised through
a test hook that makes comm-core treat gloo as a backend without CPU support (as nccl is):
the twins are then real gloo groups, created and used for real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

import comm_core as dist
from comm_core import process_group
from comm_core.testing import WorldPool

_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _sum_of_ranks(group: torch_dist.ProcessGroup | None) -> float:
    value = torch.tensor([float(torch_dist.get_rank())])
    torch_dist.all_reduce(value, group=group)
    return float(value.item())


def own_group_for_cpu_backends() -> dict[str, Any]:
    """Under "cpu:gloo" the group itself moves CPU tensors: no twin, no new group."""
    sub = torch_dist.new_group([1, 2])
    out: dict[str, Any] = {"backend": dist.get_backend()}
    out["default_is_itself"] = dist.get_cpu_group() is None or (
        dist.get_cpu_group() is torch_dist.group.WORLD
    )
    if dist.get_rank() in (1, 2):
        out["sub_is_itself"] = dist.get_cpu_group(sub) is sub
    everyone = torch_dist.new_group([0, 1, 2])  # would hang if the members had created one
    out["sum"] = _sum_of_ranks(everyone)
    return out


def forced_twins(store_path: str) -> dict[str, Any]:
    """Twins created by the members of a subgroup only, reused, and fresh after re-init."""
    saved = process_group._CPU_BACKENDS
    process_group._CPU_BACKENDS = ()  # the hook: gloo counts as a backend without CPU support
    try:
        rank = dist.get_rank()
        out: dict[str, Any] = {}
        sub = torch_dist.new_group([1, 2])
        if rank in (1, 2):  # rank 0 takes no part: local synchronisation
            twin = dist.get_cpu_group(sub)
            out["sub_twin_is_new"] = twin is not sub
            out["sub_twin_ranks"] = torch_dist.get_process_group_ranks(twin)
            out["sub_twin_sum"] = _sum_of_ranks(twin)
            out["sub_twin_reused"] = dist.get_cpu_group(sub) is twin
        else:
            try:
                dist.get_cpu_group(sub)
            except ValueError as exc:
                out["non_member"] = str(exc)
            try:
                dist.get_world_size(sub)  # torch says -1; that used to fail much later
            except ValueError as exc:
                out["non_member_size"] = str(exc)
        everyone = torch_dist.new_group([0, 1, 2])  # the groups of every rank still line up
        out["sum_after"] = _sum_of_ranks(everyone)
        # rank 1 made the twin of [1, 2], rank 0 did not: up to torch 2.13 they know
        # different numbers of groups and torch would name a twin of [0, 1] differently on
        # each (a hang until the timeout), so both get a clear error; from torch 2.14 on the
        # name comes from the group counter, which the twin left alone, so the twin forms
        pair = torch_dist.new_group([0, 1])
        if rank in (0, 1):
            try:
                out["pair_twin_sum"] = _sum_of_ranks(dist.get_cpu_group(pair))
            except ValueError as exc:
                out["uneven"] = str(exc)
        old = dist.get_cpu_group()
        out["default_twin_sum"] = _sum_of_ranks(old)
        # a group rank 2 makes alone with local synchronisation makes it know one group more
        # than rank 0 (and from torch 2.14 on advances its group counter): the twin of [0, 2]
        # cannot form under one name; both members raise, nobody waits
        other_pair = torch_dist.new_group([0, 2])
        if rank == 2:
            torch_dist.new_group([2], use_local_synchronization=True)
        if rank in (0, 2):
            try:
                dist.get_cpu_group(other_pair)
            except ValueError as exc:
                out["user_uneven"] = str(exc)
        dist.destroy_dist()
        dist.init_dist("pytorch", "gloo", timeout=60, init_method=f"file://{store_path}")
        new = dist.get_cpu_group()
        out["fresh_after_reinit"] = new is not old
        out["sum_after_reinit"] = _sum_of_ranks(new)
        return out
    finally:
        process_group._CPU_BACKENDS = saved


def test_a_cpu_backend_string_is_its_own_cpu_group(cpu_gloo_world: WorldPool) -> None:
    results = cpu_gloo_world.run(own_group_for_cpu_backends)
    for rank, r in enumerate(results):
        assert r["backend"] == "cpu:gloo"
        assert r["default_is_itself"]
        assert r.get("sub_is_itself", rank == 0)
        assert r["sum"] == 0 + 1 + 2


def test_twins_are_made_by_members_only_and_renewed_after_reinit(
    comm_run_distributed: Any, tmp_path: Path
) -> None:
    results = comm_run_distributed(forced_twins, str(tmp_path / "store2"), world_size=3)
    assert "global rank 0 is not a member" in results[0]["non_member"]
    assert "get_world_size: global rank 0 is not a member" in results[0]["non_member_size"]
    for rank in (1, 2):
        r = results[rank]
        assert r["sub_twin_is_new"]
        assert r["sub_twin_ranks"] == [1, 2]
        assert r["sub_twin_sum"] == 1 + 2
        assert r["sub_twin_reused"]
    for rank in (0, 1):
        if _TORCH_VERSION >= (2, 14):
            assert results[rank]["pair_twin_sum"] == 0 + 1
        else:
            message = results[rank]["uneven"]
            assert "the members of group [0, 1] know different process groups" in message
            assert "rank 0: " in message
            assert "rank 1: " in message
    for rank in (0, 2):
        message = results[rank]["user_uneven"]
        assert "the members of group [0, 2] know different process groups" in message
        assert "would wait for each other" in message
    for r in results:
        assert r["sum_after"] == 0 + 1 + 2
        assert r["default_twin_sum"] == 0 + 1 + 2
        assert r["fresh_after_reinit"]
        assert r["sum_after_reinit"] == 0 + 1 + 2


def test_get_cpu_group_in_a_plain_process() -> None:
    assert dist.get_cpu_group() is None
