"""Benchmark comm_collectives against torch.distributed and mmengine.dist, in one run.

Two local gloo ranks (spawned by comm_core.testing) run every case for every
implementation; repeats are interleaved between implementations, each time is the
slowest rank's, and the table reports medians after a warm-up. Cases of a few
milliseconds time 10 back-to-back calls a sample (the time shown is per call). The raw reference is a
``torch.distributed.all_gather_into_tensor`` of the same number of bytes.

    python benchmarks/bench_collectives.py [--smoke] [--repeats N] [--out DIR]

Writes DIR/results.md (markdown tables), DIR/chart.svg (the ratios as a bar chart) and
DIR/results.json.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

import comm_collectives as comm
from comm_core.testing import launch

sys.path.insert(0, str(Path(__file__).parent))
from _chart import ratio_chart
from _common import median_interval, write_results

gather_flat = getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor


def _sizes(smoke: bool) -> dict[str, int]:
    if smoke:
        return {
            "dicts": 20,
            "array_mb": 1,
            "tensor_mb": 1,
            "scalars": 8,
            "results": 200,
            "p2p_mb": 1,
            "async_mib": 1,
            "matmul": 64,
        }
    return {
        "dicts": 2000,
        "array_mb": 32,
        "tensor_mb": 4,
        "scalars": 128,
        "results": 20000,
        "p2p_mb": 32,
        "async_mib": 64,
        "matmul": 1024,
    }


def _exchange(impl: Any, tensor: torch.Tensor, into: torch.Tensor) -> Callable[[], Any]:
    """One message from rank 0 to rank 1 with ``impl``'s send and recv."""
    rank = torch_dist.get_rank()
    return (lambda: impl.send(tensor, 1)) if rank == 0 else (lambda: impl.recv(into, 0))


def _overlapped(start: Callable[[], Any], a: torch.Tensor, b: torch.Tensor) -> Callable[[], Any]:
    """Start a collective, multiply ``a @ b`` meanwhile, then wait for the collective."""

    def run() -> None:
        work = start()
        torch.mm(a, b)
        if work is not None:
            work.wait()

    return run


def _primitive_cases(
    sizes: dict[str, int],
) -> list[tuple[str, int, int, dict[str, Callable[[], Any]]]]:
    """torch.distributed's primitives: comm's checked call against torch's own."""
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    n = sizes["p2p_mb"] * 10**6 // 4
    data = torch.full((n,), float(rank + 1))
    reduced = data.clone()
    chunks = [torch.full((n,), float(k)) for k in range(world)] if rank == 0 else None
    out = torch.empty(n)
    big = torch.full((sizes["async_mib"] * 2**20 // 4,), 1.0)
    side = sizes["matmul"]
    a, b = torch.randn(side, side), torch.randn(side, side)
    return [
        (
            f"reduce: {sizes['p2p_mb']} MB float32",
            n * 4,
            1,
            {
                "comm": lambda: comm.reduce(reduced, dst=0),
                "torch": lambda: torch_dist.reduce(reduced, dst=0),
            },
        ),
        (
            f"scatter: {sizes['p2p_mb']} MB float32 a rank",
            n * 4,
            1,
            {
                "comm": lambda: comm.scatter(out, chunks, src=0),
                "torch": lambda: torch_dist.scatter(out, chunks, src=0),
            },
        ),
        (
            f"send / recv: {sizes['p2p_mb']} MB float32",
            n * 4,
            1,
            {"comm": _exchange(comm, data, out), "torch": _exchange(torch_dist, data, out)},
        ),
        (
            f"async all_reduce {sizes['async_mib']} MiB beside a {side}x{side} matmul",
            big.numel() * 4,
            1,
            {
                "comm": _overlapped(lambda: comm.all_reduce(big, async_op=True), a, b),
                "torch": _overlapped(lambda: torch_dist.all_reduce(big, async_op=True), a, b),
                "sync": _overlapped(lambda: comm.all_reduce(big), a, b),
            },
        ),
    ]


def _small_dicts(n: int, rank: int) -> list[dict[str, Any]]:
    return [
        {"idx": i * 2 + rank, "score": 0.5 + i, "label": f"class_{i % 17}", "ok": i % 3 == 0}
        for i in range(n)
    ]


def _raw(nbytes: int) -> Callable[[], Any]:
    world = torch_dist.get_world_size()
    send = torch.ones(nbytes, dtype=torch.uint8)
    out = torch.empty(nbytes * world, dtype=torch.uint8)
    return lambda: gather_flat(out, send)


def _torch_reduce_dict(data: dict[str, torch.Tensor]) -> None:
    for value in data.values():
        torch_dist.all_reduce(value)


def _torch_collect(results: list[Any], size: int) -> list[Any] | None:
    world = torch_dist.get_world_size()
    parts: list[Any] = [None] * world if torch_dist.get_rank() == 0 else None  # type: ignore[assignment]
    torch_dist.gather_object(results, parts, dst=0)
    if parts is None:
        return None
    ordered = [item for row in zip(*parts) for item in row]
    return ordered[:size]


# Calls timed together in one sample for the cases of a few milliseconds: on 2 shared cores
# a single such call after a barrier mostly measures how far apart the ranks woke up.
_SMALL_BATCH = 10


def _cases(
    sizes: dict[str, int],
) -> list[tuple[str, int, int, dict[str, Callable[[], Any]]]]:
    """(name, bytes moved a rank, calls a sample, {implementation: call})."""
    import mmengine.dist as mm

    rank = torch_dist.get_rank()
    world = torch_dist.get_world_size()
    dicts = _small_dicts(sizes["dicts"], rank)
    array = np.full(sizes["array_mb"] * 2**20 // 4, rank, dtype=np.float32)
    tensors = {f"t{i}": torch.full((sizes["tensor_mb"] * 2**20 // 4,), float(i)) for i in range(8)}
    big = {"weights": np.ones(sizes["array_mb"] * 2**20 // 4, dtype=np.float32)}
    scalars = {f"metric_{i}": torch.tensor(float(i + rank)) for i in range(sizes["scalars"])}
    n = sizes["results"]
    results = _small_dicts(n, rank)
    size = n * world

    def fresh() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in scalars.items()}

    flat = torch.ones(sizes["async_mib"] * 2**20 // 4)  # a mean of ones stays ones

    def torch_mean() -> None:
        torch_dist.all_reduce(flat)
        flat.div_(world)

    array_bytes = array.nbytes
    tensor_bytes = sum(t.numel() * 4 for t in tensors.values())
    return [
        (
            f"all_gather_object: {sizes['dicts']} small dicts",
            len(pickle.dumps(dicts)),
            _SMALL_BATCH,
            {
                "comm": lambda: comm.all_gather_object(dicts),
                "torch": lambda: torch_dist.all_gather_object([None] * world, dicts),
                "mmengine": lambda: mm.all_gather_object(dicts),
            },
        ),
        (
            f"all_gather_object: {sizes['array_mb']} MB float32 array",
            array_bytes,
            1,
            {
                "comm": lambda: comm.all_gather_object(array),
                "torch": lambda: torch_dist.all_gather_object([None] * world, array),
                "mmengine": lambda: mm.all_gather_object(array),
                "raw": _raw(array_bytes),
            },
        ),
        (
            f"all_gather_object: dict of 8 x {sizes['tensor_mb']} MB tensors",
            tensor_bytes,
            1,
            {
                "comm": lambda: comm.all_gather_object(tensors),
                "torch": lambda: torch_dist.all_gather_object([None] * world, tensors),
                "mmengine": lambda: mm.all_gather_object(tensors),
                "raw": _raw(tensor_bytes),
            },
        ),
        (
            f"broadcast_object_list: {sizes['array_mb']} MB object",
            array_bytes,
            1,
            {
                "comm": lambda: comm.broadcast_object_list([big if rank == 0 else None]),
                "torch": lambda: torch_dist.broadcast_object_list([big if rank == 0 else None]),
                "mmengine": lambda: mm.broadcast_object_list([big if rank == 0 else None]),
            },
        ),
        (
            f"all_reduce_dict: {sizes['scalars']} scalar tensors",
            sizes["scalars"] * 4,
            _SMALL_BATCH,
            {
                "comm": lambda: comm.all_reduce_dict(fresh()),
                "torch": lambda: _torch_reduce_dict(fresh()),
                "mmengine": lambda: mm.all_reduce_dict(fresh()),
            },
        ),
        (
            f"collect_results cpu: {n} small dicts a rank",
            len(pickle.dumps(results)),
            1,
            {
                "comm": lambda: comm.collect_results(results, size, device="cpu"),
                "torch": lambda: _torch_collect(results, size),
                "mmengine": lambda: mm.collect_results(results, size, device="cpu"),
            },
        ),
        (
            f"collect_results gpu: {n} small dicts a rank",
            len(pickle.dumps(results)),
            1,
            {
                "comm": lambda: comm.collect_results(results, size, device="gpu"),
                "mmengine": lambda: mm.collect_results(results, size, device="gpu"),
            },
        ),
        (
            f"all_reduce: {sizes['async_mib']} MiB float32, mean",
            flat.numel() * 4,
            1,
            {
                "comm": lambda: comm.all_reduce(flat, op="mean"),
                "torch": torch_mean,
                "mmengine": lambda: mm.all_reduce(flat, op="mean"),
            },
        ),
        *_primitive_cases(sizes),
    ]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _trim() -> None:
    """Collect garbage and hand free heap pages back to the OS, so RSS shows what is live."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then over-counts what is live
        pass


def _memory_kib(fn: Callable[[], Any]) -> tuple[int, int, Any]:
    """(peak RSS growth during ``fn``, RSS growth still held with its result alive, result).

    Linux: VmHWM is reset through /proc/self/clear_refs before the call.
    """
    _trim()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = _rss_kib("VmRSS")
    result = fn()
    peak = _rss_kib("VmHWM") - before
    _trim()
    return peak, _rss_kib("VmRSS") - before, result


def bind_to_cores(bind: bool) -> list[int]:
    """Give this rank a set of cores of its own; return the cores it may run on.

    Each rank gets ``cores // world`` cores, disjoint from the other ranks' (none when the
    machine has fewer cores than ranks), as a launcher's CPU binding does in a real job.
    Every thread already running (the process group's transport threads included) is
    moved, and threads started later inherit the set.
    """
    cores = sorted(os.sched_getaffinity(0))
    world, rank = torch_dist.get_world_size(), torch_dist.get_rank()
    share = len(cores) // world
    if not bind or share == 0:
        return cores
    mine = cores[rank * share : (rank + 1) * share]
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), mine)
        except OSError:  # a thread that ended meanwhile
            pass
    return mine


def run_rank(
    smoke: bool, repeats: int, warmup: int, workdir: str, bind: bool, only: str = ""
) -> dict[str, Any]:
    """Measure every case (those whose name contains ``only``) on this rank; return per-case
    medians (slowest rank's time)."""
    # mmengine's cpu mode needs a folder shared by the ranks: it writes .dist_test in the cwd
    os.chdir(workdir)
    cores = bind_to_cores(bind)
    sizes = _sizes(smoke)
    table: list[dict[str, Any]] = []
    for name, nbytes, batch, impls in _cases(sizes):
        if only not in name:
            continue
        samples: dict[str, list[float]] = {impl: [] for impl in impls}
        names = list(impls)
        for step in range(warmup + repeats):
            # the order rotates, so each implementation follows each other one equally often
            # (one that runs first would always pay what the last one left to clean up)
            for impl in names[step % len(names) :] + names[: step % len(names)]:
                call = impls[impl]
                torch_dist.barrier()
                start = time.perf_counter()
                for _ in range(batch):
                    call()
                elapsed = (time.perf_counter() - start) / batch
                if step >= warmup:
                    samples[impl].append(elapsed)
        medians, slowest = {}, {}
        for impl, times in samples.items():
            local = torch.tensor(times, dtype=torch.float64)
            torch_dist.all_reduce(local, torch_dist.ReduceOp.MAX)
            slowest[impl] = local.tolist()
            medians[impl] = statistics.median(slowest[impl])
        paired = {}
        for impl in slowest:
            if impl != "comm":  # comm's sample over impl's of the same repeat
                ratios = [a / b for a, b in zip(slowest["comm"], slowest[impl])]
                paired[impl] = [statistics.median(ratios), *median_interval(ratios)]
        table.append(
            {
                "case": name,
                "bytes_per_rank": nbytes,
                "calls_per_sample": batch,
                "seconds": medians,
                "paired": paired,
                "samples": slowest,
            }
        )
    return {"sizes": sizes, "cases": table, "cores_of_rank_0": cores}


_MEMORY_LABELS = ("comm cpu", "comm gpu", "mmengine cpu", "mmengine gpu")


def memory_rank(label: str, smoke: bool, workdir: str, bind: bool) -> dict[str, int] | None:
    """Rank 0's memory in one collect_results, in a fresh world.

    Peak RSS growth during the call, and the growth still held once it returned (the
    result's own objects: the returned dicts outweigh their pickle several times, and no
    implementation can return them in less). Their difference is what the call needed on
    top of its result: transfer buffers, pickled parts, copies. Each implementation gets
    its own processes: in a process that already ran other cases the allocator reuses
    freed memory and the growth reads low.
    """
    import mmengine.dist as mm

    os.chdir(workdir)
    bind_to_cores(bind)
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    n = _sizes(smoke)["results"]
    results = _small_dicts(n, rank)
    library, device = label.split()
    collect = comm.collect_results if library == "comm" else mm.collect_results
    torch_dist.barrier()
    peak, held, result = _memory_kib(lambda: collect(results, n * world, device=device))
    if rank != 0:
        return None
    return {
        "peak_kib": peak,
        "held_kib": held,
        "returned_pickled_kib": len(pickle.dumps(result)) // 1024,
    }


# Result keys of the references, and their names in the tables and the chart.
_REFERENCES = {
    "mmengine": "mmengine",
    "torch": "torch.distributed",
    "raw": "raw all_gather",
    "sync": "comm's blocking call",
}


def _ratios(case: dict[str, Any]) -> dict[str, float]:
    s = case["seconds"]
    return {name: s["comm"] / s[key] for key, name in _REFERENCES.items() if s.get(key)}


def chart(result: dict[str, Any]) -> str:
    """The ratios of every case as an SVG bar chart."""
    cases = [(case["case"], _ratios(case)) for case in result["cases"]]
    title = "comm_collectives against the references (world of 2 gloo ranks, medians)"
    return ratio_chart(title, cases, list(_REFERENCES.values()))


def _markdown(result: dict[str, Any]) -> str:
    # Two narrow tables instead of one wide one: the ratios a reader came for, then times.
    names = list(_REFERENCES.values())
    lines = [
        "| case | " + " | ".join(f"comm / {n}" for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for case in result["cases"]:
        ratios = _ratios(case)
        cells = [f"{ratios[n]:.2f}x" if n in ratios else "-" for n in names]
        lines.append(f"| {case['case']} | " + " | ".join(cells) + " |")

    lines += [
        "",
        "| case | comm / mmengine, paired by repeat (95% CI) |",
        "|---|---:|",
    ]
    for case in result["cases"]:
        if "mmengine" not in case["paired"]:  # torch's primitives: MMEngine has none
            continue
        mid, low, high = case["paired"]["mmengine"]
        lines.append(f"| {case['case']} | {mid:.3f}x ({low:.3f}-{high:.3f}) |")
    lines += ["", "| case | comm / torch.distributed, paired by repeat (95% CI) |", "|---|---:|"]
    for case in result["cases"]:
        if "mmengine" in case["paired"] or "torch" not in case["paired"]:
            continue
        mid, low, high = case["paired"]["torch"]
        lines.append(f"| {case['case']} | {mid:.3f}x ({low:.3f}-{high:.3f}) |")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{1000 * value:.2f} ms"

    lines += [
        "",
        "| case | comm | " + " | ".join(names) + " |",
        "|---|" + "---:|" * (1 + len(names)),
    ]
    for case in result["cases"]:
        s = case["seconds"]
        cells = [ms(s.get("comm")), *(ms(s.get(key)) for key in _REFERENCES)]
        lines.append(f"| {case['case']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| rank 0 in collect_results | peak RSS growth | held by the result | "
        "peak beyond the result | pickled size returned | beyond / pickled |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def mib(kib: float) -> str:
        return f"{kib / 1024:.1f} MiB"

    for label, m in result["memory"].items():
        beyond = max(m["peak_kib"] - m["held_kib"], 0)
        ratio = beyond / max(m["returned_pickled_kib"], 1)
        lines.append(
            f"| {label} | {mib(m['peak_kib'])} | {mib(m['held_kib'])} | {mib(beyond)} | "
            f"{mib(m['returned_pickled_kib'])} | {ratio:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 repeats (CI)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--no-bind", action="store_true", help="let the ranks' threads run on any core"
    )
    parser.add_argument(
        "--case",
        default="",
        help="run only the cases whose name contains this text; print their times, write nothing",
    )
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.smoke else 25)
    warmup = 1 if args.smoke else 2
    # The ranks find run_rank by name when this file is imported as a module. mmengine is
    # imported here first: on its first import on a machine yapf (imported by mmengine's
    # config module) writes a grammar cache, and two ranks doing that at the same moment
    # may read each other's half-written file.
    sys.path.insert(0, str(Path(__file__).parent))
    import mmengine.dist  # noqa: F401
    from bench_collectives import memory_rank
    from bench_collectives import run_rank as rank_fn

    env = {"OMP_NUM_THREADS": "1"}
    bind = not args.no_bind
    # mmengine's cpu mode writes every part to the working directory: on tmpfs, when there
    # is one, its files cost it the least and no disk writeback disturbs the other samples
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="comm-bench-", dir=shm) as workdir:
        result = launch(
            rank_fn,
            args.smoke,
            repeats,
            warmup,
            workdir,
            bind,
            args.case,
            nprocs=2,
            timeout=1800,
            env=env,
        )[0]
        if args.case:
            for row in result["cases"]:
                times = row["seconds"]
                ratios = ", ".join(
                    f"{impl} {t * 1e6:.1f} us ({t / times['comm']:.2f}x comm)"
                    for impl, t in times.items()
                )
                print(f"{row['case']}: {ratios}")
                paired = ", ".join(
                    f"comm / {impl} {mid:.3f}x (95% CI {low:.3f}-{high:.3f})"
                    for impl, (mid, low, high) in row["paired"].items()
                )
                print(f"    paired by repeat: {paired}")
            return 0
        result["memory"] = {
            label: launch(
                memory_rank, label, args.smoke, workdir, bind, nprocs=2, timeout=600, env=env
            )[0]
            for label in _MEMORY_LABELS
        }
    result["repeats"] = repeats
    result["bound_to_cores"] = bind
    result["torch"] = torch.__version__
    write_results(Path(args.out), result, _markdown(result), chart(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
