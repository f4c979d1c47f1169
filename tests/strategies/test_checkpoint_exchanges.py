"""How many store exchanges a checkpoint call makes, and that fewer keep every guarantee.

Without ``timeout=``, ``load_checkpoint`` reads what is at the path on every rank first
and shares the outcome in its entry: one exchange instead of two (the entry, then the
meeting before the data moves). A rank that cannot read the manifest still makes every
rank raise at once, naming it, and the calls stay in step; ranks that pass different
paths are still told so on every rank. With ``timeout=`` the meeting stays a step of its
own (a rank late in reading is named at it: test_checkpoint.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

import comm_collectives as dist
from comm_strategies.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers import caught


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


def test_a_load_without_timeout_makes_one_exchange(
    comm_run_distributed: Any, tmp_path: Path
) -> None:
    results = comm_run_distributed(load_exchanges, str(tmp_path), timeout=120)
    for result in results:
        assert result["default_exchanges"] == 1, result
        assert result["timeout_exchanges"] == 2, result  # the entry, then 'reading'
        for name in ("default", "timeout"):
            assert result[f"{name}_model"] == 0.0
            assert result[f"{name}_momentum"] == 0.0


def fails_before_the_data_moves(root: str) -> dict[str, Any]:
    """Without timeout=: rank 1 cannot read the manifest; then rank 1 passes another path
    (which does not exist); then a correct load. Each failure must reach both ranks at
    once (the default timeout is 300 s), and the last load must work (still in step)."""
    from comm_strategies.checkpoint import _load

    out: dict[str, Any] = {}
    model, optim = _model(0)
    path = save_checkpoint(f"{root}/ck", model=model, optim_wrapper=optim, strategy="ddp")
    read_manifest = _load.read_manifest
    if dist.get_rank() == 1:

        def unreadable(source: Path) -> Any:
            raise OSError("stale file handle")

        _load.read_manifest = unreadable
    start = time.monotonic()
    out["unreadable"] = caught(load_checkpoint, path, model=model, optim_wrapper=optim)
    out["unreadable_took"] = time.monotonic() - start
    _load.read_manifest = read_manifest
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
