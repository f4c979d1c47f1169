"""The strategies on the GPU through nccl (skipped without CUDA; one rank per GPU).

The strategies pick nccl and the local rank's GPU themselves; the batches are made on
the CPU and moved by the wrappers. Parameters are compared with the one-process oracle.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from comm_core.testing import WorldPool

from .test_strategies import MATRIX, strategy_checkpoints

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EXACT = 1e-5  # float32 on the GPU against the oracle's float32 on the CPU


def test_every_strategy_on_the_gpu_equals_the_oracle(nccl_world: WorldPool) -> None:
    # single is left out: its plain module takes the batches as the user's loop gives them
    matrix = [(name, options) for name, options in MATRIX if name != "single"]
    for rank_results in nccl_world.run(matrix, matrix):
        for (name, options), result in zip(matrix, rank_results):
            assert result["oracle"] < EXACT, (name, options, result)
            assert result["schedulers"] == 1, (name, options)


def test_checkpoints_cross_strategies_on_the_gpu(nccl_world: WorldPool, tmp_path: Path) -> None:
    folder = str(tmp_path)
    for result in nccl_world.run(strategy_checkpoints, folder):
        assert result["extra"] == {"step": 2}
        assert result["after_resume"] == 0.0
        assert result["after_step"] < EXACT
        assert result["deepspeed_weights"] == 0.0
        assert result["fsdp1_state"] == 0.0


def test_the_cuda_generators_round_trip_through_the_json_rng_file(tmp_path: Path) -> None:
    """Every CUDA device's generator state is saved (base64 in ``rng/rank_0.json``) and
    restored: the draws after a load equal the draws after the save."""
    from comm_strategies.checkpoint import load_checkpoint, save_checkpoint
    from comm_strategies.checkpoint._files import read_rng_file

    torch.cuda.manual_seed_all(11)
    torch.rand(1, device="cuda")  # CUDA initialised: its state is captured
    folder = save_checkpoint(tmp_path / "ck", model=torch.nn.Linear(2, 1), strategy="single")
    expected = torch.rand(4, device="cuda").tolist()
    assert len(read_rng_file(folder, 0)["cuda"]) == torch.cuda.device_count()
    torch.cuda.manual_seed_all(0)
    load_checkpoint(folder, model=torch.nn.Linear(2, 1))
    assert torch.rand(4, device="cuda").tolist() == expected
