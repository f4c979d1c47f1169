"""comm-doctor checks of this layer (entry point ``comm.doctor``: ``wrappers``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

from comm_collectives import get_comm_device, get_device, get_rank, get_world_size, is_distributed
from comm_collectives.doctor import CheckResult

from ._model import LossModel
from ._optim_wrapper import OptimWrapper
from .ddp import MMDistributedDataParallel

__all__ = ["check"]


def check() -> list[CheckResult]:
    """One DDP training step on the live world; DeepSpeed's version, accelerator and build tools."""
    return [_check_ddp_step(), _check_deepspeed()]


def _check_ddp_step() -> CheckResult:
    if not is_distributed():  # DDP needs a process group: nothing to check in a plain process
        return CheckResult("ddp train_step", True, "n/a (no process group)")
    rank, world = get_rank(), get_world_size()
    device = get_comm_device()
    net = torch.nn.Linear(2, 1, bias=False).to(device)
    torch.nn.init.ones_(net.weight)
    model = MMDistributedDataParallel(LossModel(net, lambda out, _: out.sum()))
    optim = OptimWrapper(torch.optim.SGD(model.parameters(), lr=1.0))
    inputs = torch.full((1, 2), float(rank + 1), device=device)
    start = time.perf_counter()
    model.train_step((inputs, inputs), optim)
    ms = 1000 * (time.perf_counter() - start)
    # The gradient of out.sum() is the input; DDP averages (rank + 1) over the ranks.
    expected = 1.0 - (world + 1) / 2
    got = net.weight.detach().cpu()
    ok = bool(torch.allclose(got, torch.full_like(got, expected)))
    return CheckResult("ddp train_step", ok, f"{ms:.1f} ms" if ok else f"weight {got.tolist()}")


def _check_deepspeed() -> CheckResult:
    if importlib.util.find_spec("deepspeed") is None:
        return CheckResult("deepspeed", True, f"not installed in {sys.prefix}")
    from importlib.metadata import PackageNotFoundError, version

    try:  # not imported: DeepSpeed's import logs to stdout, inside the doctor's table
        ds_version = version("deepspeed")
    except PackageNotFoundError:
        ds_version = "(version unknown)"
    # DeepSpeed's own choice: DS_ACCELERATOR, else the machine's accelerator
    accelerator = os.environ.get("DS_ACCELERATOR") or get_device()
    tools = {
        "g++": shutil.which("g++") or shutil.which("c++"),
        "ninja": shutil.which("ninja"),
        "Python.h": (Path(sysconfig.get_paths()["include"]) / "Python.h").exists() or None,
    }
    missing = [name for name, found in tools.items() if not found]
    cache = os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")
    detail = f"{ds_version} on {accelerator}"
    if missing:
        return CheckResult(
            "deepspeed", False, f"{detail}; cannot build ops: no {', '.join(missing)}"
        )
    return CheckResult("deepspeed", True, f"{detail}; ops can build (cache {cache})")
