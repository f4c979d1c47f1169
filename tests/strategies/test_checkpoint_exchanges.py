"""How many store exchanges a checkpoint call makes: the commit protocol's, the same with
and without ``timeout=``, which only bounds the waits.

A load makes two: its entry, which shares what every rank read at the path (its manifest,
its RNG state): a rank that cannot read them makes every rank raise at once, naming it,
and the calls stay in step (ranks that pass different paths are told so on every rank);
then the outcome of the read, so that no rank goes on alone with a half-loaded model.

A save makes three: its entry, the ranks' outcomes of their writes, rank 0's publish. A
rank whose small files (RNG state; on rank 0 the schedulers, scaler and user state)
failed makes every rank raise, naming it, with nothing left behind (neither the
checkpoint nor its temporary folder), and the next save works.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_strategies.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers import caught
from tests.strategies.ckpt_faults import manifest_unreadable_on


class _CountExchanges:
    """Counts the store exchanges (``comm_collectives.rendezvous``) made while in use."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = dist.rendezvous

    def __enter__(self) -> _CountExchanges:
        def counted(*args: Any, **kwargs: Any) -> list[str]:
            self.calls += 1
            return self._original(*args, **kwargs)

        dist.rendezvous = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.rendezvous = self._original


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def load_exchanges(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, optim = _model(0)
    model(torch.ones(1, 4)).sum().backward()
    optim.step()  # a momentum buffer to resume
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [optim.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    path = save_checkpoint(f"{root}/ck", model=model, optim_wrapper=optim, strategy="ddp")
    for name, timeout in (("default", None), ("timeout", 30.0)):
        other, other_optim = _model(1)
        with _CountExchanges() as exchanges:
            load_checkpoint(path, model=other, optim_wrapper=other_optim, timeout=timeout)
        out[f"{name}_exchanges"] = exchanges.calls
        out[f"{name}_model"] = max(
            float((other.state_dict()[k] - v).abs().max()) for k, v in saved.items()
        )
        out[f"{name}_momentum"] = max(
            float((other_optim.state[p]["momentum_buffer"] - m).abs().max())
            for p, m in zip(other.parameters(), momentum)
        )
    return out


def test_a_load_makes_two_exchanges_with_or_without_timeout(
    comm_run_distributed: Any, tmp_path: Path
) -> None:
    results = comm_run_distributed(load_exchanges, str(tmp_path), timeout=120)
    for result in results:
        assert result["default_exchanges"] == 2, result  # the entry, the read's outcome
        assert result["timeout_exchanges"] == 2, result
        for name in ("default", "timeout"):
            assert result[f"{name}_model"] == 0.0
            assert result[f"{name}_momentum"] == 0.0


def fails_before_the_data_moves(root: str) -> dict[str, Any]:
    """Without timeout=: rank 1 cannot read the manifest; then rank 1 passes another path
    (which does not exist); then a correct load. Each failure must reach both ranks at
    once (the default timeout is 300 s), and the last load must work (still in step)."""
    out: dict[str, Any] = {}
    model, optim = _model(0)
    path = save_checkpoint(f"{root}/ck", model=model, optim_wrapper=optim, strategy="ddp")
    with manifest_unreadable_on(1):
        start = time.monotonic()
        out["unreadable"] = caught(load_checkpoint, path, model=model, optim_wrapper=optim)
        out["unreadable_took"] = time.monotonic() - start
    mine = path if dist.get_rank() == 0 else Path(f"{root}/elsewhere")
    start = time.monotonic()
    out["paths"] = caught(load_checkpoint, mine, model=model, optim_wrapper=optim)
    out["paths_took"] = time.monotonic() - start
    out["after"] = caught(load_checkpoint, path, model=model, optim_wrapper=optim)
    return out


def test_a_failure_before_the_data_moves_still_fails_every_rank_at_once(
    comm_run_distributed: Any, tmp_path: Path
) -> None:
    results = comm_run_distributed(fails_before_the_data_moves, str(tmp_path), timeout=120)
    for result in results:
        name, message = result["unreadable"]
        assert name == "CheckpointError", message
        assert "load_checkpoint failed on 1 rank(s): rank 1: OSError: stale file handle" in (
            message
        )
        assert result["unreadable_took"] < 10.0, result["unreadable_took"]
        name, message = result["paths"]
        assert name == "CheckpointError", message
        assert "the ranks passed different paths" in message, message
        assert result["paths_took"] < 10.0, result["paths_took"]
        assert result["after"] == ("", ""), result["after"]


def save_exchanges(root: str) -> dict[str, Any]:
    from tests.helpers import full_params
    from tests.strategies.ckpt_models import build, train_step

    out: dict[str, Any] = {}
    model, optim = build("fsdp2")
    train_step(model, optim, 0)
    before = {k: v.clone() for k, v in full_params(model).items()}
    for name, timeout in (("default", None), ("timeout", 60.0)):
        with _CountExchanges() as exchanges:
            path = save_checkpoint(
                f"{root}/{name}", model=model, optim_wrapper=optim, strategy="fsdp2",
                timeout=timeout,
            )  # fmt: skip
        out[f"{name}_exchanges"] = exchanges.calls
        out[f"{name}_files"] = sorted(p.name for p in path.iterdir())
    train_step(model, optim, 1)  # away from what was saved
    load_checkpoint(f"{root}/default", model=model, optim_wrapper=optim)
    out["restored"] = max(float((v - before[k]).abs().max()) for k, v in full_params(model).items())
    return out


def test_a_dcp_save_makes_three_exchanges_with_or_without_timeout(
    comm_run_distributed: Any, tmp_path: Path
) -> None:
    results = comm_run_distributed(save_exchanges, str(tmp_path), timeout=120)
    for result in results:
        # the entry, the ranks' outcomes of their writes, rank 0's publish
        assert result["default_exchanges"] == 3, result
        assert result["timeout_exchanges"] == 3, result
        assert result["default_files"] == result["timeout_files"]
        assert "rng" in result["default_files"]
        assert "manifest.json" in result["default_files"]
        assert result["restored"] == 0.0


def small_files_fail_on_one_rank(root: str, failing: int) -> dict[str, Any]:
    """Rank ``failing`` cannot capture its RNG state (a dcp save, no timeout=): every rank
    must raise at once naming it; nothing is left; then a save and a load work."""
    from comm_strategies.checkpoint import _files
    from tests.strategies.ckpt_models import build, train_step

    out: dict[str, Any] = {}
    model, optim = build("fsdp2")
    train_step(model, optim, 0)
    capture = _files.capture_rng
    if dist.get_rank() == failing:

        def broken() -> dict[str, Any]:
            raise RuntimeError("no generator here")

        _files.capture_rng = broken
    start = time.monotonic()
    out["failed"] = caught(
        save_checkpoint, f"{root}/broken", model=model, optim_wrapper=optim, strategy="fsdp2"
    )
    out["took"] = time.monotonic() - start
    _files.capture_rng = capture
    dist.barrier()  # rank 0's clean-up is done before the folder is listed
    out["left"] = sorted(p.name for p in Path(root).iterdir())
    dist.barrier()  # every rank has listed before rank 0 makes the next save's folder
    out["after"] = caught(
        save_checkpoint, f"{root}/good", model=model, optim_wrapper=optim, strategy="fsdp2"
    )
    out["load"] = caught(load_checkpoint, f"{root}/good", model=model, optim_wrapper=optim)
    return out


@pytest.mark.parametrize("failing", [0, 1])
def test_a_dcp_save_whose_small_files_fail_on_one_rank_fails_every_rank(
    comm_run_distributed: Any, tmp_path: Path, failing: int
) -> None:
    root = tmp_path / f"rank{failing}"
    root.mkdir()
    results = comm_run_distributed(small_files_fail_on_one_rank, str(root), failing, timeout=120)
    for rank, result in enumerate(results):
        name, message = result["failed"]
        assert name == "CheckpointError", message
        assert f"rank {failing}" in message, message
        assert "writing RNG state" in message, message
        assert "no generator here" in message, message
        if rank != failing:
            assert message.startswith("save_checkpoint failed on 1 rank(s)"), message
        assert result["took"] < 10.0, result["took"]  # not a timeout
        assert result["left"] == [], result["left"]  # no checkpoint, no temporary folder
        assert result["after"] == ("", ""), result["after"]
        assert result["load"] == ("", ""), result["load"]


def rng_file_unreadable_on_one_rank(root: str, how: str) -> dict[str, Any]:
    """Rank 1's RNG file is cut short (``how="cut"``), or is valid JSON with torch's state
    cut (``"bad state"``): the load must fail on every rank before anything is loaded
    (each rank's RNG state is read and checked before the entry, whose exchange shares
    the outcome), and a load of a whole checkpoint must work after it."""
    out: dict[str, Any] = {}
    model, optim = _model(0)
    damaged = save_checkpoint(f"{root}/damaged", model=model, optim_wrapper=optim, strategy="ddp")
    whole = save_checkpoint(f"{root}/whole", model=model, optim_wrapper=optim, strategy="ddp")
    dist.barrier()
    if dist.get_rank() == 1:
        rng_file = damaged / "rng" / "rank_1.json"
        data = rng_file.read_bytes()
        if how == "cut":
            rng_file.write_bytes(data[: len(data) // 2])
        else:
            state = json.loads(data)
            rng_file.write_text(json.dumps(dict(state, torch=state["torch"][:100])))
    dist.barrier()
    other, other_optim = _model(1)
    untouched = {k: v.clone() for k, v in other.state_dict().items()}
    start = time.monotonic()
    out["damaged"] = caught(load_checkpoint, damaged, model=other, optim_wrapper=other_optim)
    out["took"] = time.monotonic() - start
    out["changed"] = max(
        float((other.state_dict()[k] - v).abs().max()) for k, v in untouched.items()
    )
    out["whole"] = caught(load_checkpoint, whole, model=other, optim_wrapper=other_optim)
    out["loaded"] = max(
        float((other.state_dict()[k] - v).abs().max()) for k, v in model.state_dict().items()
    )
    return out


@pytest.mark.parametrize("how", ["cut", "bad state"])
def test_an_unreadable_rng_file_fails_every_rank_before_anything_loads(
    comm_run_distributed: Any, tmp_path: Path, how: str
) -> None:
    results = comm_run_distributed(rng_file_unreadable_on_one_rank, str(tmp_path), how, timeout=120)
    for rank, result in enumerate(results):
        name, message = result["damaged"]
        assert name == "CheckpointError", message
        assert "RNG state" in message, message
        assert "rank_1.json is truncated or corrupt" in message, message
        if rank == 0:  # rank 1 raises its own error, the others one naming it
            assert "load_checkpoint failed on 1 rank(s): rank 1: CheckpointError" in message
        assert result["took"] < 10.0, result["took"]
        assert result["changed"] == 0.0  # nothing was loaded on any rank
        assert result["whole"] == ("", ""), result["whole"]
        assert result["loaded"] == 0.0
