"""The rendezvous store init_dist creates listens on loopback only when every rank is here."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import comm_core as dist
from comm_core import process_group
from comm_core.launcher import LaunchEnv
from comm_core.testing import launch
from tests.helpers import free_port


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as handle:
            for line in handle.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.append(address)
    return found


def _init_with_env_rendezvous(port: int) -> dict[str, Any]:
    dist.destroy_dist()  # leave the test kit's world: init_dist builds its own store here
    saved = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        dist.init_dist("pytorch", "gloo", timeout=30)
        listening = _listening(port) if dist.get_rank() == 0 else []
        total = torch.tensor([dist.get_rank() + 1])
        torch_dist.all_reduce(total)
        dist.barrier()
        return {"listening": listening, "total": total.item()}
    finally:
        dist.destroy_dist()
        for name, value in saved.items():
            if value is not None:
                os.environ[name] = value


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_a_one_host_store_listens_on_loopback_only() -> None:
    results = launch(_init_with_env_rendezvous, free_port(), nprocs=2, timeout=120)
    assert [r["total"] for r in results] == [3, 3]
    # 0100007F is 127.0.0.1; torch's own store would listen on :: (all interfaces)
    assert results[0]["listening"] == ["0100007F"]


def _launch(local_world_size: int | None, master_addr: str) -> LaunchEnv:
    return LaunchEnv("slurm", 0, 2, 0, local_world_size, master_addr, 29999, "host/0")


def test_the_store_is_left_to_torch_beyond_one_host_and_under_torchrun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # two nodes: the other node's ranks must reach the store (no socket is opened here)
    assert process_group._loopback_store(_launch(1, "node-a"), 5.0) is None
    # torchrun: its agent has created the store already
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert process_group._loopback_store(_launch(2, "127.0.0.1"), 5.0) is None
