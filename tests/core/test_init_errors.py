"""init_dist's bad input: each a clear error that leaves no process group and no env change."""

from __future__ import annotations

import os

import pytest
import torch.distributed as torch_dist

import comm_core as dist
from comm_core import AlreadyInitializedError, LauncherError


def _assert_clean() -> None:
    assert not torch_dist.is_initialized()
    assert "RANK" not in os.environ
    assert "LOCAL_RANK" not in os.environ


def test_unknown_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(LauncherError, match=r"unknown launcher .torchrun.*pytorch, slurm, mpi"):
        dist.init_dist("torchrun")
    _assert_clean()


def test_missing_slurm_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    with pytest.raises(LauncherError, match="needs environment variable SLURM_NTASKS"):
        dist.init_dist("slurm")
    _assert_clean()


def test_malformed_mpi_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "x2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    with pytest.raises(LauncherError, match="OMPI_COMM_WORLD_SIZE must be an integer, got 'x2'"):
        dist.init_dist("mpi")
    _assert_clean()


def test_unparseable_nodelist(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NODELIST": "n[1-",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(LauncherError, match="Cannot parse the Slurm node list 'n\\[1-'"):
        dist.init_dist("slurm")
    _assert_clean()


def test_bad_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="positive number of seconds, got 0"):
        dist.init_dist("pytorch", timeout=0)
    _assert_clean()


def test_world_of_one_under_pytorch_env_then_init_twice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    store = os.path.join(tmp_path, "store")
    dist.init_dist("pytorch", "gloo", timeout=30, init_method=f"file://{store}")
    try:
        assert dist.get_dist_info() == (0, 1)
        assert dist.get_backend() == "gloo"
        assert (dist.get_local_rank(), dist.get_local_size()) == (0, 1)
        assert os.environ["LOCAL_RANK"] == "0"
        assert os.environ["LOCAL_WORLD_SIZE"] == "1"
        with pytest.raises(AlreadyInitializedError, match=r"already exists.*rank 0 of 1"):
            dist.init_dist("pytorch", "gloo", init_method=f"file://{store}2")
        assert dist.is_distributed()  # the first group survives the failed second call
    finally:
        dist.destroy_dist()
        # init_dist set these for the process; the test owns their cleanup
        os.environ.pop("LOCAL_RANK", None)
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    assert dist.get_local_group() is None


def test_default_timeout_is_torchs_for_the_backend() -> None:
    from comm_core.process_group import DEFAULT_TIMEOUT_S, _default_timeout

    assert _default_timeout("nccl") == 600.0  # a hang under nccl surfaces in 10 minutes
    assert _default_timeout("cpu:gloo,cuda:nccl") == 1800.0  # torch's rule: nccl alone
    assert _default_timeout("gloo") == DEFAULT_TIMEOUT_S == 1800.0


def test_cuda_device_of_a_local_rank() -> None:
    from comm_core.process_group import _cuda_index

    assert _cuda_index(3, 1) == 0  # one GPU per task (CUDA_VISIBLE_DEVICES)
    assert _cuda_index(3, 0) == 0
    assert _cuda_index(1, 4) == 1
    with pytest.raises(
        LauncherError, match="local rank 4 needs a GPU of its own, but this process sees 4 GPUs"
    ):
        _cuda_index(4, 4)  # was 4 % 4 = 0: two ranks on GPU 0
