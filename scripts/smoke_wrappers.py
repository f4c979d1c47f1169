"""Smoke run of every comm-wrappers wrapper in two local ranks, against installed wheels.

Run it with the Python of an environment that has comm-wrappers installed (not editable):
it starts ``python -m torch.distributed.run --nproc-per-node 2`` on 127.0.0.1 with a free
port and a bounded time. Each rank calls ``comm_collectives.init_dist("pytorch")``, then
trains a tiny model for a few steps under ``MMDistributedDataParallel``,
``MMSeparateDistributedDataParallel``, ``MMFullyShardedDataParallel`` and
``MMFullyShardedDataParallel2`` (and, with ``--deepspeed``, a ZeRO-2 DeepSpeed engine), on
rank-dependent data, and checks that the parameters are the same on both ranks and moved
from the initial ones. It also checks what the environment holds: the comm packages come
from its site-packages, none is editable, and, without ``--deepspeed``, that
``comm_wrappers.deepspeed`` fails with an ImportError that says how to install the extra.

Exits non-zero on any failed check. Used by scripts/check_installs.sh.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

WORLD = 2
STEPS = 3
BATCH = 4
PACKAGES = ("comm_core", "comm_collectives", "comm_wrappers")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(args: argparse.Namespace) -> int:
    """Check the environment, then run this file under torchrun with two ranks.

    The whole process group is killed when it runs past ``--timeout``.
    """
    check_environment(Checker(), args.deepspeed)
    # Imported once here, so that a freshly installed environment compiles it once, not in
    # each of torchrun's three processes.
    import torch.distributed.run  # noqa: F401

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(WORLD),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        os.path.abspath(__file__),
        "--worker",
    ]
    if args.deepspeed:
        command.append("--deepspeed")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"FAIL: the smoke run took more than {args.timeout} s; stopping it", flush=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # torchrun and its ranks: one group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        return 124


class Checker:
    """Print ``ok: ...`` (in the launcher, or on rank 0) or exit with ``FAIL: ...``."""

    def __init__(self, rank: int | None = None) -> None:
        self.rank = rank

    def ok(self, condition: bool, what: str, detail: str = "") -> None:
        """Pass or fail a check; in the ranks, every rank evaluates it the same way."""
        if not condition:
            where = "" if self.rank is None else f" (rank {self.rank})"
            raise SystemExit(f"FAIL{where}: {what}" + (f": {detail}" if detail else ""))
        if not self.rank:
            print(f"ok: {what}" + (f" ({detail})" if detail else ""), flush=True)


def check_environment(check: Checker, deepspeed: bool) -> None:
    import importlib.metadata
    import importlib.util
    import json
    import sysconfig

    purelib = os.path.realpath(sysconfig.get_paths()["purelib"])
    for name in PACKAGES:
        module = __import__(name)
        where = os.path.realpath(module.__file__ or "")
        inside = where.startswith(purelib + os.sep)
        check.ok(
            inside,
            f"{name} {module.__version__} is imported from the environment's site-packages",
            "" if inside else f"imported from {where}",
        )
        distribution = importlib.metadata.distribution(name.replace("_", "-"))
        direct = json.loads(distribution.read_text("direct_url.json") or "{}")
        editable = bool(direct.get("dir_info", {}).get("editable"))
        check.ok(
            not editable and distribution.version == module.__version__,
            f"{name} is installed from a wheel, not editable",
        )
    check.ok(
        importlib.util.find_spec("comm_strategies") is None, "comm_strategies is not importable"
    )
    if deepspeed:
        import deepspeed as ds

        import comm_wrappers.deepspeed

        check.ok(True, f"comm_wrappers.deepspeed imports (DeepSpeed {ds.__version__})")
        return
    check.ok(importlib.util.find_spec("deepspeed") is None, "deepspeed is not installed")
    try:
        import comm_wrappers.deepspeed  # noqa: F401
    except ImportError as error:
        message = str(error)
        check.ok(
            "pip install" in message and "comm-wrappers[deepspeed]" in message,
            "import comm_wrappers.deepspeed raises ImportError naming the extra",
            message,
        )
    else:
        check.ok(False, "import comm_wrappers.deepspeed raises ImportError without DeepSpeed")


# ---------------------------------------------------------------- one rank
def worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    import comm_collectives as dist
    from comm_wrappers import (
        LossModel,
        MMDistributedDataParallel,
        MMFullyShardedDataParallel,
        MMFullyShardedDataParallel2,
        MMSeparateDistributedDataParallel,
        OptimWrapper,
        OptimWrapperDict,
        parse_losses,
        unwrap_model,
    )

    torch.set_num_threads(1)
    dist.init_dist("pytorch", timeout=120)
    rank = dist.get_rank()
    check = Checker(rank)
    check.ok(dist.get_world_size() == WORLD, f"init_dist('pytorch') made a world of {WORLD}")

    def net() -> LossModel:
        torch.manual_seed(0)  # the same initial parameters on every rank
        body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        return LossModel(body, nn.MSELoss())

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Every rank has its own data: equal parameters afterwards mean gradients were synced.
        generator = torch.Generator().manual_seed(100 * step + rank)
        inputs = torch.randn(BATCH, 4, generator=generator) + rank
        return inputs, torch.randn(BATCH, 2, generator=generator)

    def flat(params: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float().clone() for p in params])

    def full_params(model: nn.Module) -> list[torch.Tensor]:
        if isinstance(model, FullyShardedDataParallel):
            with FullyShardedDataParallel.summon_full_params(model, writeback=False):
                return [p.detach().clone() for p in model.parameters()]
        out = []
        for param in unwrap_model(model).parameters():
            full = getattr(param, "full_tensor", None)  # FSDP2: DTensor shards
            out.append((full() if callable(full) else param).detach().clone())
        return out

    def verify(
        name: str, initial: list[torch.Tensor], final: list[torch.Tensor], losses: Any
    ) -> None:
        gathered = dist.all_gather(flat(final))
        same = all(torch.equal(gathered[0], other) for other in gathered[1:])
        moved = len(initial) == len(final) and all(
            not torch.equal(a.float(), b.float()) for a, b in zip(initial, final)
        )
        finite = all(bool(torch.isfinite(torch.as_tensor(v)).all()) for v in losses)
        shown = ", ".join(f"{float(v):.4f}" for v in losses)
        check.ok(finite, f"{name}: {STEPS} train_steps, finite losses", shown)
        check.ok(same, f"{name}: parameters equal on all {WORLD} ranks")
        check.ok(moved, f"{name}: every parameter changed from its initial value")

    def run(name: str, wrap: Callable[[LossModel], Any]) -> None:
        model = net()
        initial = [p.detach().clone() for p in model.parameters()]
        wrapped = wrap(model)
        optim = OptimWrapper(torch.optim.SGD(wrapped.parameters(), lr=0.1))
        losses = [wrapped.train_step(batch(s), optim)["loss"] for s in range(STEPS)]
        verify(name, initial, full_params(wrapped), losses)

    run("MMDistributedDataParallel", MMDistributedDataParallel)
    run("MMFullyShardedDataParallel", MMFullyShardedDataParallel)
    run("MMFullyShardedDataParallel2", MMFullyShardedDataParallel2)

    class TwoParts(nn.Module):
        """Two parts, each with its own optimizer (GAN-like): what separate DDP is for."""

        def __init__(self) -> None:
            super().__init__()
            self.first = net()
            self.second = net()

        def train_step(self, data: Any, optim_wrapper: OptimWrapperDict) -> dict[str, Any]:
            log_vars: dict[str, Any] = {}
            for part in ("first", "second"):
                wrapper, module = optim_wrapper[part], getattr(self, part)
                with wrapper.optim_context(module):
                    loss, _ = parse_losses(module(*data, mode="loss"))
                wrapper.update_params(loss)
                log_vars[f"loss_{part}"] = loss.detach()
            log_vars["loss"] = sum(log_vars.values())
            return log_vars

    two = TwoParts()
    initial = [p.detach().clone() for p in two.parameters()]
    separate = MMSeparateDistributedDataParallel(two)
    check.ok(
        all(isinstance(c, DistributedDataParallel) for c in two.children()),
        "MMSeparateDistributedDataParallel wraps each part in DDP",
    )
    wrappers = OptimWrapperDict(
        first=OptimWrapper(torch.optim.SGD(two.first.parameters(), lr=0.1)),
        second=OptimWrapper(torch.optim.SGD(two.second.parameters(), lr=0.05)),
    )
    losses = [separate.train_step(batch(s), wrappers)["loss"] for s in range(STEPS)]
    final = [p.detach().clone() for p in two.parameters()]
    verify("MMSeparateDistributedDataParallel", initial, final, losses)

    if args.deepspeed:
        from comm_wrappers.deepspeed import DeepSpeedOptimWrapper, MMDeepSpeedEngineWrapper
        from comm_wrappers.deepspeed import initialize as deepspeed_initialize

        model = net()
        initial = [p.detach().clone() for p in model.parameters()]
        config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": BATCH}
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        engine, optim = deepspeed_initialize(model, config=config, optimizer=optimizer)
        check.ok(
            isinstance(engine, MMDeepSpeedEngineWrapper)
            and isinstance(optim, DeepSpeedOptimWrapper),
            "comm_wrappers.deepspeed.initialize returns the engine and optimizer wrappers",
        )
        losses = [engine.train_step(batch(s), optim)["loss"] for s in range(STEPS)]
        final = [p.detach().clone() for p in engine.model.module.parameters()]
        verify("DeepSpeed ZeRO-2 (DeepSpeedOptimWrapper)", initial, final, losses)

    dist.barrier()
    torch.distributed.destroy_process_group()
    if rank == 0:
        print("smoke run passed", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed", action="store_true", help="also a DeepSpeed ZeRO-2 engine")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for the whole run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        # torch 2.13's gloo can abort the interpreter's teardown after a finished run
        # ("terminate called without an active exception", SIGABRT), even after a barrier
        # and destroy_process_group: every check has passed, so leave without a teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
