"""MMEngine's FlexibleRunner trains, validates, saves and resumes with each comm strategy."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

pytest.importorskip("mmengine")
pytest.importorskip("cv2")  # mmengine.runner imports it

from . import runner_cases

STRATEGIES = [
    {"type": "CommDDPStrategy"},
    {"type": "CommFSDPStrategy"},
    {"type": "CommFSDPStrategy", "fsdp_version": 2},
    # DeepSpeed's own files need full unpickling: the runner's resume needs the opt-in.
    {"type": "CommDeepSpeedStrategy", "zero_stage": 2, "allow_unsafe_pickle": True},
]
CHECKPOINTS = importlib.util.find_spec("comm_strategies.checkpoint") is not None


def run_all(with_checkpoints: bool) -> list[dict[str, Any]]:
    folder = runner_cases.work_dir()
    return [
        runner_cases.train_validate(spec, f"{folder}/{index}", with_checkpoints)
        for index, spec in enumerate(STRATEGIES)
    ]


def test_flexible_runner_with_every_comm_strategy(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(run_all, CHECKPOINTS, timeout=300)
    reference = results[0][0]["params"]
    for rank_results in results:
        for spec, result in zip(STRATEGIES, rank_results):
            assert result["strategy"] == spec["type"]
            assert result["accuracy"] >= 0.75, (spec, result["accuracy"])
            # MultiStepLR from MMEngine's registry halved the lr after epoch 1.
            assert result["lr"] == pytest.approx(0.1), spec
            # The same data, seed and optimizer: every strategy ends with DDP's parameters.
            for name, value in result["params"].items():
                assert value == pytest.approx(reference[name], abs=1e-5), (spec, name)
            if CHECKPOINTS:
                assert result["saved_hooks"] == 2, spec  # before_save_checkpoint, each epoch
                assert result["loaded_hooks"] == [43], spec  # after_load_checkpoint on resume
                assert result["resumed_epoch"] == 3, spec
                assert result["resumed_lr"] == pytest.approx(0.1), spec


def test_the_adapters_are_registered_and_build_nothing_at_construction() -> None:
    import torch.distributed as torch_dist
    from mmengine.registry import STRATEGIES as REGISTRY

    from comm_strategies.integrations import mmengine as integration

    for name in ("CommSingleDeviceStrategy", "CommDDPStrategy", "CommFSDPStrategy"):
        assert REGISTRY.get(name) is getattr(integration, name)
    spec = {"type": "CommDeepSpeedStrategy", "zero_stage": 3, "train_micro_batch_size_per_gpu": 4}
    strategy = REGISTRY.build(dict(spec))
    assert strategy.config["train_micro_batch_size_per_gpu"] == 4
    assert strategy.zero_stage == 3
    assert not torch_dist.is_initialized()


def run_single(with_checkpoints: bool) -> dict[str, Any]:
    spec = {"type": "CommSingleDeviceStrategy"}
    return runner_cases.train_validate(spec, runner_cases.work_dir(), with_checkpoints)


def test_flexible_runner_with_the_single_device_strategy(comm_run_distributed: Any) -> None:
    (result,) = comm_run_distributed(run_single, CHECKPOINTS, world_size=1, timeout=180)
    assert result["strategy"] == "CommSingleDeviceStrategy"
    assert result["accuracy"] >= 0.75
    assert result["lr"] == pytest.approx(0.1)
    if CHECKPOINTS:
        assert result["saved_hooks"] == 2
        assert result["loaded_hooks"] == [43]
        assert result["resumed_epoch"] == 3
