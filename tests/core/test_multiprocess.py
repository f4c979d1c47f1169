"""comm-core on real gloo worlds of 2 and 3 ranks (the comm_core.testing pool)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import comm_core as dist
from comm_core import AlreadyInitializedError, LauncherError
from comm_core.testing import launch

WORLDS = [2, 3]


def _queries() -> dict[str, Any]:
    @dist.master_only
    def on_main() -> str:
        return "main"

    dist.barrier()
    return {
        "info": dist.get_dist_info(),
        "backend": dist.get_backend(),
        "local": (dist.get_local_rank(), dist.get_local_size()),
        "main": dist.is_main_process(),
        "master_only": on_main(),
        "default_group": dist.get_default_group() is torch_dist.group.WORLD,
        "comm_device": str(dist.get_comm_device()),
        "distributed": dist.is_distributed(),
    }


@pytest.mark.parametrize("world", WORLDS)
def test_queries_on_every_rank(comm_run_distributed: Any, world: int) -> None:
    results = comm_run_distributed(_queries, world_size=world)
    for rank, r in enumerate(results):
        assert r["info"] == (rank, world)
        assert r["backend"] == "gloo"
        assert r["local"] == (rank, world)  # one host, one node
        assert r["main"] is (rank == 0)
        assert r["master_only"] == ("main" if rank == 0 else None)
        assert r["default_group"] is True
        assert r["comm_device"] == "cpu"
        assert r["distributed"] is True


def _group_queries() -> tuple[int, int, int]:
    rank = dist.get_rank()
    pair = torch_dist.new_group([0, 1])
    result = (-1, -1, -1)
    if rank in (0, 1):
        result = (dist.get_rank(pair), dist.get_world_size(pair), int(dist.is_main_process(pair)))
        # Both members finish gloo's connection set-up before either closes it: a member that
        # destroys the group at once can close a pair its peer is still connecting.
        torch_dist.barrier(group=pair)
    torch_dist.destroy_process_group(pair)
    return result


def test_queries_with_an_explicit_group(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(_group_queries, world_size=3)
    assert results == [(0, 2, 1), (1, 2, 0), (-1, -1, -1)]


def _uneven_nodes() -> dict[str, Any]:
    """Pretend ranks 0-1 run on node 0 and rank 2 on node 1 (torchrun's GROUP_RANK)."""
    rank = dist.get_rank()
    saved = os.environ.get("GROUP_RANK")
    os.environ["GROUP_RANK"] = "0" if rank < 2 else "1"
    try:
        dist.init_local_group()
        group = dist.get_local_group()
        known = len(torch_dist.distributed_c10d._world.pg_names)
        dist.init_local_group()  # the same layout again (MMEngine-style code): no new groups
        total = torch.tensor([rank + 1.0])
        torch_dist.all_reduce(total, group=dist.get_local_group())
        out = {
            "local": (dist.get_local_rank(), dist.get_local_size()),
            "sum": total.item(),
            "same_group": dist.get_local_group() is group,
            "new_groups": len(torch_dist.distributed_c10d._world.pg_names) - known,
        }
    finally:
        if saved is None:
            os.environ.pop("GROUP_RANK", None)
        else:
            os.environ["GROUP_RANK"] = saved
        dist.init_local_group()  # back to the pool's single node
    return out


def test_init_local_group_uneven_nodes_every_rank_creates_every_group(
    comm_run_distributed: Any,
) -> None:
    # Regression: MMEngine creates only the caller's group, which breaks on several nodes.
    results = comm_run_distributed(_uneven_nodes, world_size=3)
    assert [r["local"] for r in results] == [(0, 2), (1, 2), (0, 1)]
    assert [r["sum"] for r in results] == [3.0, 3.0, 3.0]  # 1+2 on node 0, 3 on node 1
    assert all(r["same_group"] and r["new_groups"] == 0 for r in results)


def _mmengine_style_blocks() -> tuple[int, int, str]:
    dist.init_local_group(node_rank=dist.get_rank(), num_gpus_per_node=1)
    local = (dist.get_local_rank(), dist.get_local_size())
    try:
        dist.init_local_group(num_gpus_per_node=2)
        message = ""
    except ValueError as exc:
        message = str(exc)
    dist.init_local_group()
    return (*local, message)


def test_init_local_group_with_mmengine_arguments(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(_mmengine_style_blocks, world_size=3)
    for rank, (local_rank, local_size, message) in enumerate(results):
        assert (local_rank, local_size) == (0, 1)
        assert f"num_gpus_per_node=2 does not divide the world size 3 (rank {rank})" in message


def _reinit_checks(folder: str) -> dict[str, Any]:
    """Run destructive init_dist checks in a throw-away world."""
    out: dict[str, Any] = {}
    try:
        dist.init_dist("pytorch", "gloo", init_method=f"file://{folder}/again")
    except AlreadyInitializedError as exc:
        out["twice"] = str(exc)
    dist.destroy_dist()
    saved = {name: os.environ[name] for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    # Wrong but self-consistent on each rank: both claim to be alone on their node, while
    # they share this host. Only the exchange after joining the group can tell.
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    try:
        dist.init_dist("pytorch", "gloo", timeout=30, init_method=f"file://{folder}/bad")
    except LauncherError as exc:
        out["layout"] = str(exc)
    out["after_failure"] = (torch_dist.is_initialized(), os.environ["LOCAL_WORLD_SIZE"])
    os.environ.update(saved)
    dist.init_dist("pytorch", "gloo", timeout=30, init_method=f"file://{folder}/good")
    total = torch.tensor([dist.get_rank() + 1])
    torch_dist.all_reduce(total)
    out["good"] = (dist.get_dist_info(), dist.get_local_size(), total.item())
    return out


def test_init_twice_and_inconsistent_layout_leave_no_half_initialised_group() -> None:
    with tempfile.TemporaryDirectory() as folder:
        results = launch(_reinit_checks, folder, nprocs=2, timeout=120)
    for rank, r in enumerate(results):
        assert "already exists (rank" in r["twice"]
        assert "destroy_dist()" in r["twice"]
        assert "says 1 processes run on this node, but 2 ranks" in r["layout"]
        assert r["after_failure"] == (False, "1")  # no group left; env as before the call
        assert r["good"] == ((rank, 2), 2, 3)
