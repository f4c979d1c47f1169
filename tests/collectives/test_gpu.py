"""Under nccl the handshake never waits for the device (needs two CUDA devices)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from comm_core.testing import WorldPool

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (nccl refuses two ranks on one device)",
)


def no_host_sync() -> dict[str, Any]:
    import torch.distributed as torch_dist

    import comm_collectives as dist
    from comm_collectives import _protocol as protocol

    rank = dist.get_rank()
    group = torch_dist.distributed_c10d._get_default_group()
    route = protocol.header_route(group)
    t = torch.full((1000,), float(rank + 1), device="cuda")
    d = {"a": torch.full((3,), float(rank), device="cuda")}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        dist.all_reduce(t)
        dist.all_reduce_dict(d, op="mean")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {
        "route_device": str(route[1]),
        "side": route[0] is not group,
        "sum": t.tolist()[:2],
        "mean": d["a"].tolist(),
    }


def test_nccl_headers_travel_on_the_cpu_and_the_data_stays_on_the_device() -> None:
    with WorldPool(2, backend="nccl", timeout=120.0) as pool:
        results = pool.run(no_host_sync)
    for r in results:
        assert r["route_device"] == "cpu"
        assert r["side"] is True
        assert r["sum"] == [3.0, 3.0]
        assert r["mean"] == [0.5] * 3
