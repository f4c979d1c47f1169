"""``python -m comm_strategies.demo``: the digits under every strategy, then a summary table.

Each strategy runs in its own processes (torchrun with ``--nproc`` local ranks: one per GPU
under nccl on a GPU machine, else 2 CPU ranks under gloo; one process for ``single``;
``--mp-nproc`` ranks for ``model_parallel``, 4 on the CPU: data parallel 2 x tensor
parallel 2), on 127.0.0.1 only. The DeepSpeed run's checkpoint is then loaded for
evaluation by one plain process.

Throughput: samples per second from the median step time, and model FLOPs utilisation
(MFU): the model's training FLOPs per second (`train_flops`) over the peak of the ranks,
each rank's peak being a float32 matmul measured here with one thread (the ranks run one
thread each), times the number of ranks, capped at the machine's cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STRATEGIES = ("single", "ddp", "fsdp", "fsdp2", "deepspeed", "model_parallel")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _checkpoints_available() -> bool:
    return importlib.util.find_spec("comm_strategies.checkpoint") is not None


def _run(
    name: str,
    nproc: int,
    work: Path,
    epochs: int,
    extra: list[str],
    timeout: float,
    *,
    restarts: int = 0,
    label: str | None = None,
) -> Any:
    out = work / f"{label or name}.json"
    script = ["-m", "comm_strategies.demo.train", "--strategy", name, "--out", str(out)]
    script += ["--epochs", str(epochs), "--progress", *extra]
    if name == "single" or nproc == 1:
        command = [sys.executable, *script]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "--max-restarts", str(restarts), "--monitor-interval", "0.1", *script,
        ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
    wall = time.perf_counter() - start
    # The progress bar (rank 0's stderr lines starting with the strategy's name).
    for line in done.stderr.splitlines():
        if line.startswith(name):
            print(line, file=sys.stderr)
    if done.returncode != 0 or not out.exists():
        print(done.stdout[-4000:], done.stderr[-8000:], sep="\n", file=sys.stderr)
        message = f"the {name} run failed (exit status {done.returncode}); its output is above"
        raise SystemExit(message)
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


def matmul_peak(size: int = 512, repeats: int = 5) -> float:
    """The best float32 matmul FLOPs per second of one thread on this machine's CPU."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / best


def _mfu(row: dict[str, Any], peak: float | None) -> str:
    if peak is None or row.get("samples_per_s") is None:
        return "n/a"
    ranks = min(int(row["ranks"]), os.cpu_count() or 1)
    achieved = row["flops_per_step"] * row["samples_per_s"] / 64
    return f"{100 * achieved / (peak * ranks):.2f}%"


def _size(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value / 1024:.0f} KiB"


def _show_recovery(run: dict[str, Any], rows: list[dict[str, Any]], name: str) -> bool:
    """Print what the recovery run went through; False when it did not end where the run
    that never stopped did."""
    killed = run["killed"]
    lost = killed["step"] - run["resumed_from"]
    seconds = run["first_step_at"] - killed["time"]
    print(
        f"\nRecovery ({name}, {run['ranks']} ranks, a checkpoint every 20 steps, async): the "
        f"last rank was killed (SIGKILL) after step {killed['step']}; torchrun restarted the "
        f"job, which resumed from the checkpoint of step {run['resumed_from']} ({lost} steps "
        f"lost) and trained again {seconds:.1f} s after the kill."
    )
    same = [r for r in rows if r["strategy"] == name and r["ranks"] == run["ranks"]]
    if not same:
        print(f"accuracy {100 * run['accuracy']:.2f}%")
        return True
    equal = bool(abs(same[0]["accuracy"] - run["accuracy"]) < 1e-9)
    print(
        f"accuracy {100 * run['accuracy']:.2f}% ("
        f"{'the same as' if equal else 'DIFFERENT from'} the {name} run that never stopped)"
    )
    return equal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks (default: one per GPU, else 2 CPU ranks)",
    )
    parser.add_argument(
        "--mp-nproc",
        type=int,
        default=None,
        help="ranks of model_parallel (default: one per GPU, else 4 CPU ranks: dp 2 x tp 2)",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument(
        "--recovery",
        default="ddp",
        choices=[*STRATEGIES[1:5], "none"],
        help="after the table: train this strategy again, kill a rank half-way and show the "
        "restart and the resume ('none': skip)",
    )
    args = parser.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()  # nccl takes one rank per GPU; gloo ranks share the CPU
    where = "GPU" if gpus else "CPU"
    if args.nproc is None:
        args.nproc = gpus or 2
    if args.mp_nproc is None:
        args.mp_nproc = gpus or 4
    peak = None if gpus else matmul_peak()
    checkpoints = _checkpoints_available()
    from . import TRAIN_SIZE

    steps_per_epoch = TRAIN_SIZE // 64  # the global batch of demo.train
    began = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="comm-demo-") as folder:
        work = Path(folder)
        for name in args.strategies:
            extra = ["--save", str(work / f"ckpt-{name}")] if checkpoints else []
            nproc = args.mp_nproc if name == "model_parallel" else args.nproc
            rows.append(_run(name, nproc, work, args.epochs, extra, args.timeout))
        recovery = None
        if checkpoints and args.recovery != "none" and args.nproc > 1 and args.epochs > 0:
            half = args.epochs * steps_per_epoch // 2
            extra = ["--work-dir", str(work / "recovery"), "--kill-at", str(half + 7)]
            recovery = _run(
                args.recovery, args.nproc, work, args.epochs, extra, args.timeout,
                restarts=1, label="recovery",
            )  # fmt: skip
            recovery["killed"] = json.loads((work / "recovery" / "killed.json").read_text())
        reload = None
        if checkpoints and "deepspeed" in args.strategies:
            reload = _run(
                "single", 1, work, 0, ["--load", str(work / "ckpt-deepspeed")], args.timeout
            )
    print()
    print(f"digits ({args.epochs} epochs, global batch 64, AdamW), {where} ranks:")
    header = (
        f"| {'strategy':<18} | {'ranks':>5} | {'accuracy':>8} | {'time/step':>9} | "
        f"{'samples/s':>9} | {'MFU':>6} | {'checkpoint':>10} | {'wall':>6} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for row in rows:
        step = f"{row['step_ms']:.2f} ms" if row["step_ms"] is not None else "n/a"
        rate = f"{row['samples_per_s']:.0f}" if row.get("samples_per_s") else "n/a"
        label = row["strategy"] + (f" {row['layout']}" if row.get("layout") else "")
        print(
            f"| {label:<18} | {row['ranks']:>5} | {100 * row['accuracy']:>7.2f}% | "
            f"{step:>9} | {rate:>9} | {_mfu(row, peak):>6} | "
            f"{_size(row['checkpoint_bytes']):>10} | {row['wall_s']:>5.1f}s |"
        )
    if peak is not None:
        print(f"\nMFU against a measured float32 matmul peak of {peak / 1e9:.1f} GFLOP/s per rank")
    if recovery is not None and not _show_recovery(recovery, rows, args.recovery):
        return 1
    if reload is not None:
        deepspeed_row = next(r for r in rows if r["strategy"] == "deepspeed")
        same = abs(reload["accuracy"] - deepspeed_row["accuracy"]) < 1e-9
        print(
            f"\nDeepSpeed checkpoint loaded by one plain process: accuracy "
            f"{100 * reload['accuracy']:.2f}% ({'the same as' if same else 'DIFFERENT from'} "
            "the DeepSpeed run)"
        )
        if not same:
            return 1
    elif not checkpoints:
        print("\ncheckpoints: comm_strategies.checkpoint is not installed; no checkpoint step")
    print(f"\ntotal {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
