"""Under nccl the handshake never waits for the device (skipped without CUDA).

A world of N ranks needs N GPUs (nccl refuses two ranks on one device): a one-GPU
machine runs the world of one, where the checks still run through the side group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from comm_core.testing import WorldPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def no_host_sync() -> dict[str, Any]:
    import torch.distributed as torch_dist

    import comm_collectives as dist
    from comm_collectives import _route

    rank = dist.get_rank()
    group = torch_dist.distributed_c10d._get_default_group()
    route = _route.header_route(group)
    t = torch.full((1000,), float(rank + 1), device="cuda")
    d = {"a": torch.full((3,), float(rank), device="cuda")}
    b = torch.full((4,), float(rank + 10), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        dist.all_reduce(t)
        dist.all_reduce_dict(d, op="mean")
        dist.broadcast(b, src=0)
        gathered = dist.all_gather(t[:2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    results = dist.collect_results(
        [rank * 10 + i for i in range(3)], 3 * dist.get_world_size(), device="gpu"
    )
    return {
        "route_device": str(route[1]),
        "side": route[0] is not group,
        "sum": t.tolist()[:2],
        "mean": d["a"].tolist(),
        "broadcast": b.tolist(),
        "gathered": [g.tolist() for g in gathered],
        "gathered_device": sorted({g.device.type for g in gathered}),
        "results": results,
    }


def test_nccl_headers_travel_on_the_cpu_and_the_data_stays_on_the_device(
    nccl_world: WorldPool,
) -> None:
    world = nccl_world.world_size
    total = float(sum(r + 1 for r in range(world)))
    for rank, r in enumerate(nccl_world.run(no_host_sync)):
        assert r["route_device"] == "cpu"
        assert r["side"] is True
        assert r["sum"] == [total, total]
        assert r["mean"] == [(world - 1) / 2] * 3
        assert r["broadcast"] == [10.0] * 4
        assert r["gathered"] == [[total, total]] * world
        assert r["gathered_device"] == ["cuda"]
        if rank == 0:  # collect_results interleaves the ranks' parts
            assert r["results"] == [q * 10 + i for i in range(3) for q in range(world)]


def torch_primitives_on_cuda() -> dict[str, Any]:
    import torch.distributed as torch_dist

    import comm_collectives as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.reduce(t, dst=0)
    out["reduce"] = t.tolist()
    lists = [torch.zeros(2, device="cuda") for _ in range(world)]
    dist.all_gather(lists, torch.full((2,), float(rank), device="cuda"))
    out["all_gather"] = [x.tolist() for x in lists]
    glist = [torch.zeros(2, device="cuda") for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank), device="cuda"), glist, 0)
    out["gather"] = None if glist is None else [x.tolist() for x in glist]
    chunk = torch.zeros(3, device="cuda")
    parts = [torch.full((3,), float(k), device="cuda") for k in range(world)]
    dist.scatter(chunk, parts if rank == 0 else None, src=0)
    out["scatter"] = chunk.tolist()
    big = torch.full((1 << 20,), float(rank + 1), device="cuda")
    work = dist.all_reduce(big, async_op=True)
    assert work is not None
    work.wait(timeout=60.0)
    out["async"] = big[:2].tolist()
    if world > 1:
        box = torch.zeros(3, device="cuda")
        if rank == 0:
            dist.send(torch.full((3,), 5.0, device="cuda"), 1)
        elif rank == 1:
            out["source"] = dist.recv(box, None)
        out["recv"] = box.tolist()
    dist.barrier()
    out["device"] = str(torch_dist.get_backend())
    return out


def test_torch_primitives_on_cuda(nccl_world: WorldPool) -> None:
    world = nccl_world.world_size
    total = float(sum(r + 1 for r in range(world)))
    for rank, r in enumerate(nccl_world.run(torch_primitives_on_cuda)):
        assert r["reduce"] == ([total] * 4 if rank == 0 else [float(rank + 1)] * 4)
        assert r["all_gather"] == [[float(k)] * 2 for k in range(world)]
        assert r["gather"] == ([[float(k)] * 2 for k in range(world)] if rank == 0 else None)
        assert r["scatter"] == [float(rank)] * 3
        assert r["async"] == [total, total]
        if world > 1 and rank == 1:
            assert r["recv"] == [5.0] * 3
            assert r["source"] == 0
