"""MMEngine's FlexibleRunner trains, validates, saves and resumes with each comm strategy.

The rank bodies (``run_all``, ``run_single``) run on every rank of a real gloo world; the
runner they drive, its data, model, metric and hook are defined here first.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mmengine")
pytest.importorskip("cv2")  # mmengine.runner imports it

import torch
from mmengine.evaluator import BaseMetric
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.runner import FlexibleRunner
from torch.utils.data import Dataset

import comm_collectives as dist
import comm_strategies.integrations.mmengine  # noqa: F401 - registers the strategies
from tests.helpers import full_params

STRATEGIES = [
    {"type": "CommDDPStrategy"},
    {"type": "CommFSDPStrategy"},
    {"type": "CommFSDPStrategy", "fsdp_version": 2},
    {"type": "CommDeepSpeedStrategy", "zero_stage": 2},
]
CHECKPOINTS = importlib.util.find_spec("comm_strategies.checkpoint") is not None

SAMPLES = 32


class Points(Dataset):  # type: ignore[type-arg]
    """Two separable classes of 4-d points, the same on every rank (the sampler splits them)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.inputs = torch.randn(SAMPLES, 4, generator=generator)
        self.labels = (self.inputs.sum(1) > 0).long()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"inputs": self.inputs[index], "data_samples": self.labels[index]}


class Classifier(BaseModel):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)
        )

    def forward(self, inputs: Any, data_samples: Any = None, mode: str = "tensor") -> Any:
        logits = self.body(torch.stack(inputs) if isinstance(inputs, list) else inputs)
        if mode == "loss":
            return {
                "loss": torch.nn.functional.cross_entropy(
                    logits, torch.as_tensor(data_samples, device=logits.device)
                )
            }
        if mode == "predict":
            return list(
                zip(
                    logits.argmax(-1).tolist(),
                    torch.as_tensor(data_samples, device=logits.device).tolist(),
                )
            )
        return logits


class Accuracy(BaseMetric):  # type: ignore[misc]
    def process(self, data_batch: Any, data_samples: Any) -> None:
        self.results.extend(data_samples)

    def compute_metrics(self, results: list[Any]) -> dict[str, float]:
        return {"accuracy": sum(int(p == t) for p, t in results) / len(results)}


class CountingHook(Hook):  # type: ignore[misc]
    """Counts the checkpoint hooks and writes a value into the checkpoint."""

    def __init__(self) -> None:
        self.saved = 0
        self.loaded: list[Any] = []

    def before_save_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        self.saved += 1
        checkpoint["hook_value"] = 41 + self.saved

    def after_load_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        self.loaded.append(checkpoint.get("hook_value"))


def _loader(shuffle: bool) -> dict[str, Any]:
    return {
        "dataset": Points(),
        "sampler": {"type": "DefaultSampler", "shuffle": shuffle},
        "batch_size": 4,
        "num_workers": 0,
    }


def _runner(strategy: dict[str, Any], work_dir: str, epochs: int, resume: bool, save: bool) -> Any:
    hook = CountingHook()
    default_hooks: dict[str, Any] = {"logger": {"type": "LoggerHook", "interval": 100}}
    default_hooks["checkpoint"] = (
        {"type": "CheckpointHook", "interval": 1, "by_epoch": True} if save else None
    )
    runner = FlexibleRunner(
        model=Classifier(),
        work_dir=work_dir,
        strategy=strategy,
        train_dataloader=_loader(True),
        val_dataloader=_loader(False),
        val_evaluator={"type": Accuracy},
        optim_wrapper={
            "type": "OptimWrapper",
            "optimizer": {"type": "SGD", "lr": 0.2, "momentum": 0.9},
        },
        param_scheduler={"type": "MultiStepLR", "milestones": [1], "gamma": 0.5, "by_epoch": True},
        train_cfg={"by_epoch": True, "max_epochs": epochs, "val_interval": 1},
        val_cfg={},
        default_hooks=default_hooks,
        custom_hooks=[hook],
        launcher="pytorch",
        env_cfg={"dist_cfg": {"backend": "gloo"}},
        randomness={"seed": 0},
        resume=resume,
        log_level="WARNING",
    )
    return runner, hook


def train_validate(
    strategy: dict[str, Any], work_dir: str, with_checkpoints: bool
) -> dict[str, Any]:
    """Train 2 epochs (validating each), then, with checkpoints, resume a 3rd from the 2nd."""
    work = str(Path(work_dir) / "run")
    runner, hook = _runner(strategy, work, 2, False, with_checkpoints)
    runner.train()
    metrics = runner.val()
    result: dict[str, Any] = {
        "accuracy": metrics["accuracy"],
        "lr": runner.optim_wrapper.get_lr()["lr"][0],
        "strategy": type(runner.strategy).__name__,
        "saved_hooks": hook.saved,
        "params": {k: v.flatten().tolist() for k, v in full_params(runner.model).items()},
    }
    if with_checkpoints:
        resumed, hook2 = _runner(strategy, work, 3, True, True)
        resumed.train()
        result["resumed_epoch"] = resumed.epoch
        result["loaded_hooks"] = hook2.loaded
        result["resumed_lr"] = resumed.optim_wrapper.get_lr()["lr"][0]
    return result


def work_dir() -> str:
    path = [tempfile.mkdtemp(prefix="comm-runner-")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(path, src=0)
    return str(path[0])


def run_all(with_checkpoints: bool) -> list[dict[str, Any]]:
    folder = work_dir()
    return [
        train_validate(spec, f"{folder}/{index}", with_checkpoints)
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
    return train_validate(spec, work_dir(), with_checkpoints)


def test_flexible_runner_with_the_single_device_strategy(comm_run_distributed: Any) -> None:
    (result,) = comm_run_distributed(run_single, CHECKPOINTS, world_size=1, timeout=180)
    assert result["strategy"] == "CommSingleDeviceStrategy"
    assert result["accuracy"] >= 0.75
    assert result["lr"] == pytest.approx(0.1)
    if CHECKPOINTS:
        assert result["saved_hooks"] == 2
        assert result["loaded_hooks"] == [43]
        assert result["resumed_epoch"] == 3
