"""MMEngine's classic ``Runner`` with comm's wrappers from ``MODEL_WRAPPERS``.

Each registered type trains, validates with MMEngine's evaluator, saves through
``CheckpointHook`` and resumes with ``resume=True``; the resumed run must end where a run
that never stopped ends, and the validation metric must be what one process computes from
the trained parameters. The rank bodies run on every rank of a real gloo world.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mmengine")
pytest.importorskip("cv2")  # mmengine.runner imports it

import torch
from mmengine.runner import Runner

import comm_collectives as dist
from comm_strategies.integrations import mmengine as integration
from tests.helpers import caught, full_params
from tests.strategies.test_runner import SAMPLES, Accuracy, Classifier, Points

WRAPPERS: list[dict[str, Any]] = [
    {"type": "CommDistributedDataParallel"},
    {"type": "CommSeparateDistributedDataParallel"},
    # Nested FSDP1 units: the runner's rank-0 state_dict() would gather on rank 0 alone.
    {
        "type": "CommFullyShardedDataParallel",
        "auto_wrap_policy": {"type": "size_based_auto_wrap_policy", "min_num_params": 10},
    },
    {"type": "CommFullyShardedDataParallel", "fsdp_version": 2},
]
EPOCHS = 3


def _loader(shuffle: bool) -> dict[str, Any]:
    return {
        "dataset": Points(),
        "sampler": {"type": "DefaultSampler", "shuffle": shuffle},
        "batch_size": 4,
        "num_workers": 0,
    }


def _runner(
    work_dir: str,
    epochs: int,
    *,
    wrapper: dict[str, Any] | None,
    resume: bool = False,
    hooks: list[Any] | None = None,
) -> Any:
    cfg: dict[str, Any] = {} if wrapper is None else {"model_wrapper_cfg": dict(wrapper)}
    return Runner(
        model=Classifier(),
        work_dir=work_dir,
        train_dataloader=_loader(True),
        val_dataloader=_loader(False),
        val_evaluator={"type": Accuracy},
        optim_wrapper={
            "type": "OptimWrapper",
            "optimizer": {"type": "SGD", "lr": 0.2, "momentum": 0.9},
        },
        param_scheduler={"type": "MultiStepLR", "milestones": [1], "gamma": 0.5, "by_epoch": True},
        train_cfg={"by_epoch": True, "max_epochs": epochs, "val_interval": 100},
        val_cfg={},
        default_hooks={
            "logger": {"type": "LoggerHook", "interval": 100},
            "checkpoint": {"type": "CheckpointHook", "interval": 1, "by_epoch": True},
        },
        custom_hooks=[{"type": "CommRunnerHook"}, *(hooks or [])],
        launcher="pytorch",
        env_cfg={"dist_cfg": {"backend": "gloo"}},
        randomness={"seed": 0},
        resume=resume,
        log_level="WARNING",
        cfg=cfg,
    )


def _shared_dir() -> str:
    path = [tempfile.mkdtemp(prefix="comm-classic-")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(path, src=0)
    return str(path[0])


def _state(runner: Any) -> dict[str, Any]:
    return {
        "wrapper": type(runner.model).__name__,
        "params": {k: v.flatten().tolist() for k, v in full_params(runner.model).items()},
        "lr": runner.optim_wrapper.get_lr()["lr"][0],
        "epoch": runner.epoch,
        "iter": runner.iter,
    }


def train_stop_resume(wrapper: dict[str, Any], folder: str) -> dict[str, Any]:
    """A run of EPOCHS epochs, and one stopped after EPOCHS - 1 and resumed."""
    straight = _runner(f"{folder}/straight", EPOCHS, wrapper=wrapper)
    straight.train()
    metrics = straight.val()
    result = {"straight": _state(straight), "accuracy": metrics["accuracy"]}
    _runner(f"{folder}/stopped", EPOCHS - 1, wrapper=wrapper).train()
    resumed = _runner(f"{folder}/stopped", EPOCHS, wrapper=wrapper, resume=True)
    if wrapper.get("fsdp_version") == 2:  # resumed before train(): the optimizer unbuilt
        resumed.load_or_resume()
    resumed.train()
    result["resumed"] = _state(resumed)
    result["checkpoints"] = sorted(p.name for p in Path(f"{folder}/stopped").glob("*.pth"))
    return result


def run_wrappers() -> list[dict[str, Any]]:
    folder = _shared_dir()
    return [
        train_stop_resume(wrapper, f"{folder}/{index}") for index, wrapper in enumerate(WRAPPERS)
    ]


def _one_process_accuracy(params: dict[str, list[float]]) -> float:
    model = Classifier()
    with torch.no_grad():
        for name, value in model.named_parameters():
            value.copy_(torch.tensor(params[name]).view_as(value))
    data = Points()
    predictions = model.body(data.inputs).argmax(-1)
    return float((predictions == data.labels).sum()) / SAMPLES


def test_classic_runner_trains_validates_saves_and_resumes_with_each_comm_wrapper(
    comm_run_distributed: Any,
) -> None:
    results = comm_run_distributed(run_wrappers, timeout=240)
    for rank_results in results:
        for wrapper, result in zip(WRAPPERS, rank_results):
            straight, resumed = result["straight"], result["resumed"]
            assert straight["wrapper"].startswith(wrapper["type"]), (wrapper, straight["wrapper"])
            assert result["checkpoints"] == ["epoch_1.pth", "epoch_2.pth", "epoch_3.pth"], wrapper
            assert (resumed["epoch"], resumed["iter"]) == (EPOCHS, straight["iter"]), wrapper
            assert resumed["lr"] == straight["lr"] == pytest.approx(0.1), wrapper
            for name, value in straight["params"].items():
                assert resumed["params"][name] == pytest.approx(value, abs=1e-6), (wrapper, name)
            expected = _one_process_accuracy(straight["params"])
            assert result["accuracy"] == pytest.approx(expected), wrapper
    # Every rank holds the same parameters.
    assert results[0] == results[1] or all(
        a["straight"]["params"] == b["straight"]["params"] for a, b in zip(*results)
    )


def run_opt_in() -> dict[str, Any]:
    """MMEngine's own wrapper names, without and with ``use_comm_wrappers``."""
    from mmengine.model import MMDistributedDataParallel as MMEngineDDP
    from mmengine.model import is_model_wrapper as mmengine_is_model_wrapper

    import comm_wrappers

    folder = _shared_dir()
    out: dict[str, Any] = {}
    # Without the opt-in, MMEngine's own default wrapper refuses a CPU module.
    out["without"] = caught(_runner, f"{folder}/without", 1, wrapper=None)
    reference = _runner(f"{folder}/reference", 1, wrapper={"type": "CommDistributedDataParallel"})
    reference.train()
    out["reference"] = _state(reference)
    integration.use_comm_wrappers()
    try:
        for label, wrapper in (
            ("named", {"type": "MMDistributedDataParallel"}),
            ("default", None),
            ("fsdp", {"type": "MMFullyShardedDataParallel"}),
        ):
            runner = _runner(f"{folder}/{label}", 1, wrapper=wrapper)
            runner.train()
            out[label] = _state(runner)
    finally:
        integration.use_comm_wrappers(False)
    # A sharded wrapper cannot resume the optimizer state DDP saved (by position).
    sharded = _runner(
        f"{folder}/reference", 2, wrapper={"type": "CommFullyShardedDataParallel"}, resume=True
    )
    out["sharded_from_ddp"] = caught(sharded.train)
    # is_model_wrapper both ways, on live wrappers.
    mmengine_ddp = MMEngineDDP(torch.nn.Linear(2, 2), device_ids=None)
    comm_ddp = comm_wrappers.MMDistributedDataParallel(torch.nn.Linear(2, 2))
    separate = comm_wrappers.MMSeparateDistributedDataParallel(Classifier())
    fsdp2 = comm_wrappers.MMFullyShardedDataParallel2(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    out["mmengine_knows"] = [
        bool(mmengine_is_model_wrapper(model))
        for model in (comm_ddp, separate, fsdp2, reference.model)
    ]
    out["comm_knows"] = bool(comm_wrappers.is_model_wrapper(mmengine_ddp))
    out["comm_unwraps"] = comm_wrappers.unwrap_model(mmengine_ddp) is mmengine_ddp.module
    return out


def test_the_opt_in_runs_a_config_naming_mmengine_wrappers_on_cpu_with_comms(
    comm_run_distributed: Any,
) -> None:
    results = comm_run_distributed(run_opt_in, timeout=120)
    for result in results:
        error_type, message = result["without"]
        assert error_type == "ValueError", result["without"]
        assert "device_ids" in message, result["without"]
        assert result["named"]["wrapper"] == "CommDistributedDataParallel"
        assert result["default"]["wrapper"] == "CommDistributedDataParallel"
        for label in ("named", "default"):
            assert result[label]["params"] == result["reference"]["params"], label
        assert result["fsdp"]["wrapper"] == "CommFullyShardedDataParallel"
        for name, value in result["fsdp"]["params"].items():
            assert value == pytest.approx(result["reference"]["params"][name], abs=1e-6), name
        error_type, message = result["sharded_from_ddp"]
        assert error_type == "ValueError", result["sharded_from_ddp"]
        assert "saved by an unsharded wrapper" in message, message
        assert result["mmengine_knows"] == [True, True, True, True]
        assert result["comm_knows"]
        assert result["comm_unwraps"]


def test_without_the_opt_in_mmengine_wrapper_names_are_mmengine_s_own() -> None:
    import mmengine.runner.runner as runner_module
    from mmengine.registry import MODEL_WRAPPERS

    names = (
        "MMDistributedDataParallel",
        "MMSeparateDistributedDataParallel",
        "MMFullyShardedDataParallel",
    )
    for name in names:
        assert MODEL_WRAPPERS.get(name).__module__.startswith("mmengine.model.wrappers."), name
    assert (
        runner_module.MMDistributedDataParallel.__module__ == "mmengine.model.wrappers.distributed"
    )
    for name in ("CommDistributedDataParallel", "CommSeparateDistributedDataParallel"):
        assert MODEL_WRAPPERS.get(name) is getattr(integration, name)
    before = dict(MODEL_WRAPPERS.module_dict)
    default = runner_module.MMDistributedDataParallel
    mmengine_init_dist = runner_module.init_dist
    integration.use_comm_wrappers()
    integration.use_comm_wrappers()  # a second call changes nothing
    try:
        assert integration.comm_wrappers_in_use()
        assert (
            MODEL_WRAPPERS.get("MMDistributedDataParallel")
            is integration.CommDistributedDataParallel
        )
        assert (
            MODEL_WRAPPERS.get("MMFullyShardedDataParallel")
            is integration.CommFullyShardedDataParallel
        )
        assert runner_module.MMDistributedDataParallel is integration.CommDistributedDataParallel
        assert runner_module.init_dist is not mmengine_init_dist
    finally:
        integration.use_comm_wrappers(False)
    assert not integration.comm_wrappers_in_use()
    assert dict(MODEL_WRAPPERS.module_dict) == before
    assert runner_module.MMDistributedDataParallel is default
    assert runner_module.init_dist is mmengine_init_dist
    assert not [k for k in MODEL_WRAPPERS.children["comm"].module_dict if k.startswith("mmengine_")]


def test_fsdp_version_must_be_1_or_2() -> None:
    with pytest.raises(ValueError, match="fsdp_version must be 1 or 2, got 3"):
        integration.CommFullyShardedDataParallel(torch.nn.Linear(1, 1), fsdp_version=3)


_STARTS_ITS_OWN_GROUP = """
import torch
from mmengine.runner import Runner
import comm_collectives as dist
from comm_strategies.integrations.mmengine import use_comm_wrappers
from tests.strategies.test_runner import Classifier, Points
use_comm_wrappers()
loader = dict(dataset=Points(), sampler=dict(type="DefaultSampler", shuffle=False),
              batch_size=4, num_workers=0)
runner = Runner(model=Classifier(), work_dir=WORK, train_dataloader=loader,
                optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1)),
                train_cfg=dict(by_epoch=True, max_epochs=1), launcher="pytorch",
                default_hooks=dict(logger=dict(type="LoggerHook", interval=100)),
                log_level="WARNING")  # MMEngine's default dist_cfg: backend nccl
runner.train()
print("RESULT", dist.get_backend(), dist.get_world_size(), type(runner.model).__name__)
"""


def test_the_opt_in_lets_the_runner_start_its_group_without_cuda(tmp_path: Path) -> None:
    """MMEngine's init_dist calls torch.cuda.set_device, which fails without CUDA; under
    the opt-in the Runner starts its group with comm's (nccl becomes gloo there)."""
    if torch.cuda.is_available():
        pytest.skip("the case is a machine without CUDA")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="1")
    script = f"WORK = {str(tmp_path)!r}\n" + _STARTS_ITS_OWN_GROUP
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT gloo 1 CommDistributedDataParallel" in done.stdout, done.stdout
