"""The classic ``Runner`` with comm's sharded wrappers and no ``CommRunnerHook`` in its config.

Issue 32: ``model_wrapper_cfg=dict(type="CommFullyShardedDataParallel")`` without
``custom_hooks=[dict(type="CommRunnerHook")]`` aborted the process in gloo (FSDP1) or
raised (FSDP2) in the runner's ``_init_model_weights`` broadcast. The wrapper the runner
builds now gives it the hook: FSDP1 (nested units) and FSDP2 train, save, and a fresh
runner resumes (``resume=True``) and ends where a run that never stopped ends; the hook
added by hand as well (twice) changes nothing. A sharded wrapper built by hand and passed
as ``model=`` without the hook fails with one ``ValueError`` on every rank naming the fix.
The rank bodies run on every rank of a real gloo world.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mmengine")
pytest.importorskip("cv2")  # mmengine.runner imports it

from mmengine.runner import Runner

import comm_collectives as dist
from comm_strategies.integrations.mmengine import CommRunnerHook
from tests.helpers import caught, full_params
from tests.strategies.test_runner import Classifier, Points

FSDP1 = {
    "type": "CommFullyShardedDataParallel",
    # Nested FSDP1 units: the runner's rank-0 state_dict() would gather on rank 0 alone.
    "auto_wrap_policy": {"type": "size_based_auto_wrap_policy", "min_num_params": 10},
}
FSDP2 = {"type": "CommFullyShardedDataParallel", "fsdp_version": 2}
ITERS, STOP, EVERY = 12, 8, 4  # 32 samples, 4 a batch, 2 ranks: 4 iterations an epoch
TOLERANCE = 1e-5


def _runner(
    work_dir: str,
    iters: int,
    *,
    wrapper: dict[str, Any] | None,
    model: Any = None,
    hooks: list[Any] | None = None,
    resume: bool = False,
) -> Any:
    cfg: dict[str, Any] = {} if wrapper is None else {"model_wrapper_cfg": dict(wrapper)}
    return Runner(
        model=Classifier() if model is None else model,
        work_dir=work_dir,
        train_dataloader={
            "dataset": Points(),
            "sampler": {"type": "DefaultSampler", "shuffle": True},
            "batch_size": 4,
            "num_workers": 0,
        },
        optim_wrapper={
            "type": "OptimWrapper",
            "optimizer": {"type": "SGD", "lr": 0.2, "momentum": 0.9},
        },
        param_scheduler={"type": "MultiStepLR", "milestones": [6], "gamma": 0.5, "by_epoch": False},
        train_cfg={"by_epoch": False, "max_iters": iters},
        default_hooks={
            "logger": {"type": "LoggerHook", "interval": 100},
            "checkpoint": {"type": "CheckpointHook", "interval": EVERY, "by_epoch": False},
        },
        custom_hooks=hooks,
        launcher="pytorch",
        env_cfg={"dist_cfg": {"backend": "gloo"}},
        randomness={"seed": 0},
        resume=resume,
        log_level="WARNING",
        cfg=cfg,
    )


def _shared_dir() -> str:
    path = [tempfile.mkdtemp(prefix="comm-classic-nohook-")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(path, src=0)
    return str(path[0])


def _hook_count(runner: Any) -> int:
    return sum(isinstance(hook, CommRunnerHook) for hook in runner.hooks)


def _state(runner: Any) -> dict[str, Any]:
    return {
        "wrapper": type(runner.model).__name__,
        "params": {k: v.flatten().tolist() for k, v in full_params(runner.model).items()},
        "lr": runner.optim_wrapper.get_lr()["lr"][0],
        "iter": runner.iter,
        "hooks": _hook_count(runner),
    }


def stop_and_resume(wrapper: dict[str, Any], folder: str, hooks: list[Any] | None) -> Any:
    """Train STOP iterations, then a fresh runner resumes (``resume=True``) up to ITERS."""
    _runner(folder, STOP, wrapper=wrapper, hooks=hooks).train()
    dist.barrier()  # rank 0 saves alone, at the end of its last iteration
    checkpoints = sorted(p.name for p in Path(folder).glob("*.pth"))
    resumed = _runner(folder, ITERS, wrapper=wrapper, hooks=hooks, resume=True)
    resumed.train()
    return {**_state(resumed), "checkpoints": checkpoints}


def run_without_the_hook() -> dict[str, Any]:
    folder = _shared_dir()
    out: dict[str, Any] = {}
    for label, wrapper in (("fsdp1", FSDP1), ("fsdp2", FSDP2)):
        straight = _runner(f"{folder}/{label}/straight", ITERS, wrapper=wrapper)
        straight.train()
        out[label] = {
            "straight": _state(straight),
            "no_hook": stop_and_resume(wrapper, f"{folder}/{label}/no_hook", None),
            # By hand as well, twice: the runner keeps them and adds none.
            "by_hand": stop_and_resume(
                wrapper,
                f"{folder}/{label}/by_hand",
                [{"type": "CommRunnerHook"}, CommRunnerHook()],
            ),
        }
    # The unsharded wrappers bring the hook too; the runner builds no wrapper for world 1.
    out["ddp_hooks"] = _hook_count(
        _runner(f"{folder}/ddp", 1, wrapper={"type": "CommDistributedDataParallel"})
    )
    return out


def run_hand_built() -> dict[str, Any]:
    """Sharded wrappers built by hand and passed as ``model=``: no hook comes with them."""
    from comm_wrappers import MMFullyShardedDataParallel, MMFullyShardedDataParallel2

    folder = _shared_dir()
    out: dict[str, Any] = {}
    builders: list[tuple[str, Any]] = [
        ("fsdp1", MMFullyShardedDataParallel),
        ("fsdp2", MMFullyShardedDataParallel2),
    ]
    for label, build in builders:
        runner = _runner(f"{folder}/{label}", ITERS, wrapper=None, model=build(Classifier()))
        out[label] = caught(runner.train)
        out[f"{label}_hooks"] = _hook_count(runner)
    # The world is whole afterwards: a collective still answers.
    out["after"] = dist.all_gather_object(dist.get_rank())
    # With the hook by hand, a hand-built sharded wrapper trains.
    runner = _runner(
        f"{folder}/with_hook",
        EVERY,
        wrapper=None,
        model=MMFullyShardedDataParallel(Classifier()),
        hooks=[{"type": "CommRunnerHook"}],
    )
    runner.train()
    out["with_hook_iter"] = runner.iter
    return out


def _assert_same_params(got: dict[str, Any], expected: dict[str, Any], label: str) -> None:
    assert got.keys() == expected.keys(), label
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=TOLERANCE), (label, name)


def test_sharded_wrappers_from_model_wrapper_cfg_without_the_hook_resume_like_a_run_that_never_stopped(
    comm_run_distributed: Any,
) -> None:
    results = comm_run_distributed(run_without_the_hook, timeout=180)
    for rank, result in enumerate(results):
        for label in ("fsdp1", "fsdp2"):
            straight = result[label]["straight"]
            assert straight["wrapper"].startswith("CommFullyShardedDataParallel"), straight
            assert straight["iter"] == ITERS
            assert straight["lr"] == pytest.approx(0.1)
            assert straight["hooks"] == 1, (rank, label)  # attached by the wrapper
            for mode, hooks in (("no_hook", 1), ("by_hand", 2)):
                resumed = result[label][mode]
                where = f"rank {rank} {label} {mode}"
                assert resumed["checkpoints"] == ["iter_4.pth", "iter_8.pth"], where
                assert resumed["hooks"] == hooks, where  # none added beside the user's
                assert (resumed["iter"], resumed["lr"]) == (ITERS, straight["lr"]), where
                _assert_same_params(resumed["params"], straight["params"], where)
        assert result["ddp_hooks"] == 1
    # Every rank holds the same full parameters.
    for label in ("fsdp1", "fsdp2"):
        _assert_same_params(
            results[1][label]["straight"]["params"], results[0][label]["straight"]["params"], label
        )


def test_a_hand_built_sharded_wrapper_without_the_hook_fails_with_one_clear_error_on_every_rank(
    comm_run_distributed: Any,
) -> None:
    results = comm_run_distributed(run_hand_built, timeout=120)
    for rank, result in enumerate(results):
        for label, name in (
            ("fsdp1", "MMFullyShardedDataParallel"),
            ("fsdp2", "MMFullyShardedDataParallel2"),
        ):
            error_type, message = result[label]
            assert error_type == "ValueError", (rank, result[label])
            assert f"Runner.train() on rank {rank} (world_size=2)" in message, message
            assert f"sharded wrapper ({name})" in message, message
            assert "custom_hooks=[dict(type='CommRunnerHook')]" in message, message
            assert "model_wrapper_cfg=dict(type='CommFullyShardedDataParallel')" in message
            assert result[f"{label}_hooks"] == 0
        assert result["after"] == [0, 1]
        assert result["with_hook_iter"] == EVERY
