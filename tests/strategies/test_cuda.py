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
