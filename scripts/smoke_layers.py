"""Smoke run of comm-core alone or comm-collectives alone in two local ranks, from wheels.

Run it with the Python of an environment that has the layer installed from its wheel (and
nothing above it): ``smoke_layers.py core`` or ``smoke_layers.py collectives``. It checks
the environment (the comm packages come from its site-packages, none is editable, the
layers above are not importable), then starts ``python -m torch.distributed.run
--nproc-per-node 2`` on 127.0.0.1 with a free port and a bounded time, where each rank
initialises the process group with ``init_dist("pytorch")`` and checks the layer's calls on
rank-dependent values.

Exits non-zero on any failed check. Used by scripts/check_installs.sh.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile

WORLD = 2
LAYERS = ("comm_core", "comm_collectives", "comm_wrappers", "comm_strategies")


def fail(what: str) -> None:
    raise SystemExit(f"FAIL: {what}")


def check_environment(layer: str) -> None:
    purelib = os.path.realpath(sysconfig.get_paths()["purelib"])
    below = LAYERS[: LAYERS.index(layer) + 1]
    for name in below:
        module = __import__(name)
        where = os.path.realpath(module.__file__ or "")
        if not where.startswith(purelib + os.sep):
            fail(f"{name} is imported from {where}, not from the environment's site-packages")
        distribution = importlib.metadata.distribution(name.replace("_", "-"))
        direct = json.loads(distribution.read_text("direct_url.json") or "{}")
        if direct.get("dir_info", {}).get("editable"):
            fail(f"{name} is installed editable")
        print(f"ok: {name} {module.__version__} from a wheel in site-packages", flush=True)
    for name in LAYERS[len(below) :]:
        if importlib.util.find_spec(name) is not None:
            fail(f"{name} is importable, but only {', '.join(below)} should be installed")
    print(f"ok: nothing above {layer} is importable", flush=True)


def worker_core() -> None:
    import torch
    import torch.distributed as torch_dist

    import comm_core as dist

    dist.init_dist("pytorch", "gloo", timeout=60)
    rank, world = dist.get_dist_info()
    if (world, dist.get_local_rank(), dist.get_local_size()) != (WORLD, rank, WORLD):
        fail(f"rank {rank}: world/local {world, dist.get_local_rank(), dist.get_local_size()}")
    total = torch.tensor([rank + 1])
    torch_dist.all_reduce(total, group=dist.get_cpu_group())
    if total.item() != 3:
        fail(f"rank {rank}: all_reduce gave {total.item()}, expected 3")
    dist.barrier()
    if rank == 0:
        print("ok: init_dist, rank and local queries, get_cpu_group, barrier", flush=True)
    dist.destroy_dist()


def worker_collectives() -> None:
    import torch

    import comm_collectives as dist

    dist.init_dist("pytorch", "gloo", timeout=60)
    rank = dist.get_rank()
    value = torch.tensor([float(rank + 1), 10.0])
    dist.all_reduce(value, op="mean")
    gathered = dist.all_gather(torch.arange(rank + 1))
    objects = dist.all_gather_object({"rank": rank, "t": torch.full((2,), rank)})
    ok = (
        value.tolist() == [1.5, 10.0]
        and [g.tolist() for g in gathered] == [[0], [0, 1]]
        and [(o["rank"], o["t"].tolist()) for o in objects] == [(0, [0, 0]), (1, [1, 1])]
    )
    if not ok:
        fail(f"rank {rank}: {value.tolist()} {gathered} {objects}")
    folder = [tempfile.mkdtemp(prefix="comm-smoke-") if rank == 0 else None]
    dist.broadcast_object_list(folder)
    for tmpdir in (None, folder[0]):  # by messages, then through a (here shared) folder
        out = dist.collect_results([f"{rank}.{i}" for i in range(2)], 3, tmpdir=tmpdir)
        if rank == 0 and out != ["0.0", "1.0", "0.1"]:
            fail(f"collect_results(tmpdir={tmpdir}) gave {out}")
    dist.barrier()
    if rank == 0:
        os.rmdir(str(folder[0]))
        print("ok: all_reduce, uneven all_gather, object collectives, collect_results", flush=True)
    dist.destroy_dist()


def launch(layer: str, timeout: float) -> int:
    check_environment(f"comm_{layer}")
    import torch.distributed.run  # noqa: F401  (compiled once here, not in every rank)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
        "--master-addr", "127.0.0.1", "--master-port", str(port),
        os.path.abspath(__file__), layer, "--worker",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        status = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"FAIL: the smoke run took more than {timeout} s; stopping it", flush=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # torchrun and its ranks: one group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        return 124
    if status == 0:
        print(f"smoke run of comm-{layer} passed", flush=True)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layer", choices=["core", "collectives"])
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds for the run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.layer == "core":
            worker_core()
        else:
            worker_collectives()
        # torch 2.13's gloo can abort the interpreter's teardown after a finished run:
        # every check has passed, so leave without a teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return launch(args.layer, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
