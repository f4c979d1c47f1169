"""Benchmark comm_wrappers' training step against hand-written loops and MMEngine, in one run.

Two local gloo ranks (spawned by comm_core.testing, each bound to a core of its own) train
two small models, an MLP and a transformer encoder layer, under every engine:

- ``raw``: a hand-written loop on the bare engine: forward, backward, optimizer step,
  zero_grad. torch DDP; FSDP1 on the CPU with ``use_orig_params=True``; FSDP2
  ``fully_shard`` on a CPU mesh; a DeepSpeed ZeRO 2 engine (``engine.backward``,
  ``engine.step``) on the existing process group.
- ``comm``: the matching comm_wrappers wrapper's ``train_step(data, optim_wrapper)`` with
  an `OptimWrapper` (``comm_wrappers.deepspeed.initialize``'s pair for DeepSpeed).
- ``comm, BaseModel`` and ``mmengine`` (DDP only): comm's wrapper and `OptimWrapper`, and
  MMEngine's own ``MMDistributedDataParallel`` and ``OptimWrapper``, both driving the same
  ``mmengine.model.BaseModel`` subclass: their ratio compares the wrappers alone.

Every implementation trains its own copy of the same initial weights on the same batches
with AdamW. A sample times several training steps back to back (the time shown is per
step), and the order of the implementations rotates from one repeat to the next. Two
clocks: wall time (each sample the slowest rank's) and the CPU time of each rank's
process, all threads (averaged over the ranks: the work a step costs, without waiting or
preemption). After a warm-up, the tables give each time's median over the repeats, and
each ratio's median over the repeats of the ratio of the two samples taken in the same
repeat (steadier than a ratio of medians on a shared machine), with a 95% confidence
interval (a bootstrap of that median). ``--runs N`` times N worlds one after the other, each
a fresh pair of processes, and pools their samples: a bias that lasts a whole run (where a
process's memory happens to put each model) then varies from run to run.

Memory is measured in a second world of its own: each rank's resident set (RSS, Linux
/proc/self/status) after garbage collection and ``malloc_trim``, with glibc's mmap
threshold fixed at 128 KiB so that large freed blocks leave the RSS; the table gives the
larger rank's. *held*: the growth from before the model is built to after its first step
(weights, gradients, optimizer state, engine buffers). *peak*: the highest RSS during
later steps over the same starting point (median of 3 rounds).

    python benchmarks/bench_wrappers.py [--smoke] [--repeats N] [--runs N] [--out DIR]
        [--no-bind]

The DeepSpeed rows need DeepSpeed (``hatch run deepspeed:python
benchmarks/bench_wrappers.py``), the MMEngine rows mmengine: without them those rows are
skipped, with the reason. Writes DIR/results.md (markdown tables), DIR/chart.svg (the
ratios as a bar chart) and DIR/results.json.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from _chart import ratio_chart
from _common import median_interval, rank_env, write_results
from bench_collectives import _rss_kib, _trim, bind_to_cores
from torch import nn

from comm_core.testing import launch
from comm_wrappers import (
    LossModel,
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    OptimWrapper,
)

ENGINES = ("DDP", "FSDP1", "FSDP2", "DeepSpeed")
IMPLEMENTATIONS = ("raw", "comm", "comm, BaseModel", "mmengine")
NUM_CLASSES = 10

Step = Callable[[], Any]
Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------- models and data
class Mlp(nn.Module):
    """128 -> 512 -> 512 -> 10 classes, GELU between the layers (334k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(128, 512),
            nn.GELU(),
            nn.Linear(512, 512),
            nn.GELU(),
            nn.Linear(512, NUM_CLASSES),
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs: torch.Tensor = self.layers(inputs)
        return outputs


class Block(nn.Module):
    """A transformer encoder layer (d_model 128, 4 heads), mean-pooled, a head: 200k params."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(
            d_model=128, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(128, NUM_CLASSES)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs: torch.Tensor = self.head(self.encoder(inputs).mean(dim=1))
        return outputs


@dataclass(frozen=True)
class Workload:
    """A network and the shape of one rank's batch of inputs."""

    name: str
    network: type[nn.Module]
    input_shape: tuple[int, ...]


WORKLOADS = (
    Workload("MLP", Mlp, (64, 128)),
    Workload("transformer", Block, (8, 32, 128)),
)


def make_network(workload: Workload) -> nn.Module:
    """The same initial weights on every rank and for every implementation."""
    torch.manual_seed(0)
    return workload.network()


def make_batches(workload: Workload, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches (inputs, class labels): different on every rank."""
    generator = torch.Generator().manual_seed(1000 + torch_dist.get_rank())
    return [
        (
            torch.randn(workload.input_shape, generator=generator),
            torch.randint(NUM_CLASSES, (workload.input_shape[0],), generator=generator),
        )
        for _ in range(count)
    ]


def loss_model(workload: Workload) -> nn.Module:
    """The network under comm's contract: ``forward(inputs, targets=None, mode=...)``."""
    return LossModel(make_network(workload), nn.CrossEntropyLoss())


def base_model(workload: Workload) -> nn.Module:
    """The network as an ``mmengine.model.BaseModel`` (batches: inputs, data_samples)."""
    from mmengine.model import BaseModel

    class Classifier(BaseModel):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = make_network(workload)
            self.loss_fn = nn.CrossEntropyLoss()

        def forward(self, inputs: Any, data_samples: Any = None, mode: str = "tensor") -> Any:
            outputs = self.net(inputs)
            if mode == "loss":
                return {"loss": self.loss_fn(outputs, data_samples)}
            return outputs

    return Classifier()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


# ---------------------------------------------------------------- implementations
# A builder takes an implementation's name, the workload and an endless iterator over this
# rank's batches; it builds the engine and returns one training step.


def raw_loop(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches) -> Step:
    """The hand-written loop every wrapper is compared with."""

    def step() -> None:
        inputs, targets = next(batches)
        loss = model(inputs, targets, mode="loss")["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def train_step(model: nn.Module, optim_wrapper: Any, batches: Iterator[Any]) -> Step:
    return lambda: model.train_step(next(batches), optim_wrapper)  # type: ignore[operator]


def as_dicts(batches: Batches) -> Iterator[dict[str, torch.Tensor]]:
    """MMEngine's batch form: ``dict(inputs=..., data_samples=...)``."""
    return ({"inputs": inputs, "data_samples": targets} for inputs, targets in batches)


def build_ddp(name: str, workload: Workload, batches: Batches) -> Step:
    from torch.nn.parallel import DistributedDataParallel

    if name == "raw":
        model: nn.Module = DistributedDataParallel(loss_model(workload), device_ids=None)
        return raw_loop(model, adamw(model), batches)
    if name == "comm":
        model = MMDistributedDataParallel(loss_model(workload))
        return train_step(model, OptimWrapper(adamw(model)), batches)
    if name == "comm, BaseModel":
        model = MMDistributedDataParallel(base_model(workload))
        return train_step(model, OptimWrapper(adamw(model)), as_dicts(batches))
    from mmengine.model import MMDistributedDataParallel as MMEngineDDP
    from mmengine.optim import OptimWrapper as MMEngineOptimWrapper

    model = MMEngineDDP(module=base_model(workload), device_ids=None)
    return train_step(model, MMEngineOptimWrapper(adamw(model)), as_dicts(batches))


def build_fsdp1(name: str, workload: Workload, batches: Batches) -> Step:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if name == "raw":
        model = FullyShardedDataParallel(
            loss_model(workload), device_id=torch.device("cpu"), use_orig_params=True
        )
        return raw_loop(model, adamw(model), batches)
    model = MMFullyShardedDataParallel(loss_model(workload))
    return train_step(model, OptimWrapper(adamw(model)), batches)


def build_fsdp2(name: str, workload: Workload, batches: Batches) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if name == "raw":
        model = loss_model(workload)
        fully_shard(model, mesh=init_device_mesh("cpu", (torch_dist.get_world_size(),)))
        return raw_loop(model, adamw(model), batches)
    wrapped = MMFullyShardedDataParallel2(loss_model(workload))
    return train_step(wrapped, OptimWrapper(adamw(wrapped)), batches)


def deepspeed_config(workload: Workload) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": workload.input_shape[0],
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**13,
    }


def build_deepspeed(name: str, workload: Workload, batches: Batches) -> Step:
    import deepspeed

    model = loss_model(workload)
    if name == "comm":
        from comm_wrappers.deepspeed import initialize

        wrapper, optim_wrapper = initialize(model, deepspeed_config(workload), adamw(model))
        return train_step(wrapper, optim_wrapper, batches)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=adamw(model),
        config=deepspeed_config(workload),
        dist_init_required=False,
    )

    def step() -> None:
        inputs, targets = next(batches)
        loss = engine(inputs, targets, mode="loss")["loss"]
        engine.backward(loss)
        engine.step()  # zeroes the gradients too

    return step


BUILDERS: dict[str, Callable[[str, Workload, Batches], Step]] = {
    "DDP": build_ddp,
    "FSDP1": build_fsdp1,
    "FSDP2": build_fsdp2,
    "DeepSpeed": build_deepspeed,
}


def implementations(engine: str, skipped: dict[str, str]) -> list[str]:
    """The implementations measured under ``engine``, leaving out what is not installed."""
    if engine == "DeepSpeed" and "deepspeed" in skipped:
        return []
    if engine == "DDP" and "mmengine" not in skipped:
        return list(IMPLEMENTATIONS)
    return ["raw", "comm"]


def import_engines(skipped: dict[str, str]) -> None:
    """Import every engine's modules up front, so no build or step pays for an import."""
    import torch.distributed.device_mesh
    import torch.distributed.fsdp  # noqa: F401

    if "mmengine" not in skipped:
        import mmengine.model
        import mmengine.optim  # noqa: F401
    if "deepspeed" not in skipped:
        import deepspeed

        import comm_wrappers.deepspeed  # noqa: F401

        deepspeed.utils.logger.setLevel(logging.WARNING)
        # DeepSpeed's ZeRO calls torch's deprecated name on every step
        warnings.filterwarnings("ignore", ".*all_gather_into_tensor", FutureWarning)


# ---------------------------------------------------------------- memory
def memory_supported() -> bool:
    """RSS and its peak come from /proc (Linux), where the peak can be reset."""
    return os.path.exists("/proc/self/clear_refs")


def settle() -> int:
    """Collect garbage, hand free heap pages to the OS, reset the peak; return the RSS (KiB)."""
    _trim()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return _rss_kib("VmRSS")


def peak_growth(step: Step, count: int, rounds: int) -> int:
    """The peak RSS (KiB) while ``count`` steps run, over the RSS before them.

    The median of a few rounds, each started from a trimmed heap: one round's peak
    depends on where the allocator happens to place the step's blocks.
    """
    peaks = []
    for _ in range(rounds):
        start = settle()
        for _ in range(count):
            step()
        peaks.append(_rss_kib("VmHWM") - start)
    return int(statistics.median(peaks))


# ---------------------------------------------------------------- one rank
def warm_up(
    engine: str, workload: Workload, names: list[str]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Build, step and throw away every implementation once; return this rank's batches.

    One-time costs (lazy imports, registries, a backend's first buffers) are then charged
    to none of the implementations measured next.
    """
    batches = make_batches(workload, 4)
    for name in names:
        BUILDERS[engine](name, workload, itertools.cycle(batches))()
    return batches


def build_case(engine: str, workload: Workload, names: list[str]) -> dict[str, Step]:
    """Build every implementation of one case (after a warm-up) and take its first step."""
    build = BUILDERS[engine]
    batches = warm_up(engine, workload, names)
    steps = {}
    for name in names:
        steps[name] = build(name, workload, itertools.cycle(batches))
        steps[name]()
    return steps


def measure_case(
    engine: str, workload: Workload, names: list[str], count: int, rounds: int
) -> dict[str, dict[str, int]]:
    """RSS growth (KiB) held by each implementation after its first step, and its peak.

    The peak is the highest RSS during ``count`` later steps (the median of ``rounds``),
    over the RSS before the implementation was built (the others built before it stay
    alive, and are not counted).
    """
    build = BUILDERS[engine]
    batches = warm_up(engine, workload, names)
    usage: dict[str, dict[str, int]] = {}
    alive = []  # so that the next implementation cannot reuse this one's memory
    for name in names:
        before = settle()
        step = build(name, workload, itertools.cycle(batches))
        step()
        held = settle() - before
        usage[name] = {"held_kib": held, "peak_kib": held + peak_growth(step, count, rounds)}
        alive.append(step)
    return usage


def time_case(
    steps: dict[str, Step], per_sample: int, repeats: int, warmup: int
) -> dict[str, dict[str, list[float]]]:
    """Seconds per step of every implementation in every repeat.

    ``"wall"``: the slowest rank's elapsed time. ``"cpu"``: the CPU time of a rank's
    process (all its threads, gloo's included), averaged over the ranks: the work a step
    costs, without the time spent waiting for the other rank or preempted by other programs.
    """
    names = list(steps)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(warmup + repeats):
        # the order rotates, so each implementation follows each other one equally often
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            step = steps[name]
            torch_dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(per_sample):
                step()
            if repeat >= warmup:
                wall[name].append((time.perf_counter() - start) / per_sample)
                cpu[name].append((time.process_time() - start_cpu) / per_sample)
    world = torch_dist.get_world_size()
    for name in names:
        slowest = torch.tensor(wall[name], dtype=torch.float64)
        torch_dist.all_reduce(slowest, torch_dist.ReduceOp.MAX)
        wall[name] = slowest.tolist()
        total = torch.tensor(cpu[name], dtype=torch.float64)
        torch_dist.all_reduce(total)
        cpu[name] = (total / world).tolist()
    return {"wall": wall, "cpu": cpu}


def summary(samples: dict[str, list[float]], runs: int = 1) -> dict[str, Any]:
    """Median seconds per step of every implementation, the two ratios of the table, and
    each ratio's 95% confidence interval (bootstrap of the median of the paired ratios;
    two-stage, runs then repeats, when ``samples`` holds ``runs`` equal runs)."""
    out: dict[str, Any] = {
        "seconds_per_step": {name: statistics.median(t) for name, t in samples.items()}
    }
    for key, num, den in (
        ("comm_over_raw", "comm", "raw"),
        ("comm_over_mmengine", "comm, BaseModel", "mmengine"),
    ):
        out[key] = paired_ratio(samples, num, den)
        pairs = paired_ratios(samples, num, den)
        out[f"{key}_interval"] = median_interval(pairs, groups=runs) if pairs else None
    return out


def paired_ratios(samples: dict[str, list[float]], num: str, den: str) -> list[float]:
    """``num``'s time over ``den``'s, repeat by repeat (empty when one is missing)."""
    if num not in samples or den not in samples:
        return []
    return [a / b for a, b in zip(samples[num], samples[den])]


def paired_ratio(samples: dict[str, list[float]], num: str, den: str) -> float | None:
    """The median over the repeats of ``num``'s time over ``den``'s in the same repeat.

    Taken repeat by repeat, the ratio does not drift with the machine's speed, which on
    a shared machine changes from one minute to the next.
    """
    if num not in samples or den not in samples:
        return None
    return statistics.median(a / b for a, b in zip(samples[num], samples[den]))


def largest_rank(usage: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Every memory figure as the larger of the ranks'."""
    out = {}
    for name, figures in usage.items():
        values = torch.tensor([figures["held_kib"], figures["peak_kib"]], dtype=torch.int64)
        torch_dist.all_reduce(values, torch_dist.ReduceOp.MAX)
        out[name] = {"held_kib": int(values[0]), "peak_kib": int(values[1])}
    return out


def _setup_rank(skipped: dict[str, str], bind: bool) -> list[int]:
    cores = bind_to_cores(bind)
    import_engines(skipped)
    # What is alive now stays to the end: frozen out of the collector's way, a full
    # collection (before every memory reading) takes milliseconds instead of 160 ms
    gc.collect()
    gc.freeze()
    return cores


def _cases(skipped: dict[str, str]) -> Iterator[tuple[Workload, str, list[str]]]:
    for workload in WORKLOADS:
        for engine in ENGINES:
            names = implementations(engine, skipped)
            if names:
                yield workload, engine, names


def time_rank(settings: dict[str, int], skipped: dict[str, str], bind: bool) -> dict[str, Any]:
    """Time every case on this rank."""
    cores = _setup_rank(skipped, bind)
    cases = []
    for workload, engine, names in _cases(skipped):
        steps = build_case(engine, workload, names)
        samples = time_case(
            steps, settings["steps_per_sample"], settings["repeats"], settings["warmup"]
        )
        del steps
        gc.collect()
        cases.append(
            {
                "model": workload.name,
                "engine": engine,
                **{clock: summary(times) for clock, times in samples.items()},
                "samples": samples,
            }
        )
    return {"cases": cases, "cores_of_rank_0": cores}


def memory_rank(settings: dict[str, int], skipped: dict[str, str], bind: bool) -> list[Any]:
    """Measure every case's memory on this rank: the larger rank's figures, case by case."""
    _setup_rank(skipped, bind)
    figures = []
    for workload, engine, names in _cases(skipped):
        usage = measure_case(
            engine, workload, names, settings["memory_steps"], settings["memory_rounds"]
        )
        figures.append(largest_rank(usage))
        gc.collect()
    return figures


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several timing worlds: each case's samples joined, run after run.

    Each world is a fresh pair of processes, so whatever one process's memory layout does
    to one implementation's speed (a lasting bias within a run) varies between runs; the
    pooled medians and intervals average over it. Each run's own ratios stay in
    ``per_run``.
    """
    result = {key: value for key, value in runs[0].items() if key != "cases"}
    cases = []
    for index, case in enumerate(runs[0]["cases"]):
        pooled: dict[str, dict[str, list[float]]] = {}
        for clock in case["samples"]:
            pooled[clock] = {
                name: [t for run in runs for t in run["cases"][index]["samples"][clock][name]]
                for name in case["samples"][clock]
            }
        cases.append(
            {
                "model": case["model"],
                "engine": case["engine"],
                **{clock: summary(times, len(runs)) for clock, times in pooled.items()},
                "per_run": [
                    {
                        clock: {
                            key: run["cases"][index][clock][key]
                            for key in ("comm_over_raw", "comm_over_mmengine")
                        }
                        for clock in pooled
                    }
                    for run in runs
                ],
                "samples": pooled,
            }
        )
    result["cases"] = cases
    return result


# ---------------------------------------------------------------- report
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.2f}"


def _ratio(value: float | None, interval: Any = None) -> str:
    if value is None:
        return "-"
    if interval is None:
        return f"{value:.3f}x"
    return f"{value:.3f}x ({interval[0]:.3f}-{interval[1]:.3f})"


def _mib(figures: dict[str, int] | None) -> str:
    if figures is None:
        return "-"
    return f"{figures['held_kib'] / 1024:.1f} / {figures['peak_kib'] / 1024:.1f}"


def _label(case: dict[str, Any]) -> str:
    return f"{case['model']}, {case['engine']}"


def markdown(result: dict[str, Any]) -> str:
    """Narrow tables: the ratios first, then the times, then the memory."""
    cases = result["cases"]
    lines = [
        "| case | comm / raw | comm / raw, CPU | comm / mmengine | comm / mmengine, CPU |",
        "|---|---:|---:|---:|---:|",
    ]
    for case in cases:
        wall, cpu = case["wall"], case["cpu"]
        cells = [
            _ratio(clock[key], clock.get(f"{key}_interval"))
            for key in ("comm_over_raw", "comm_over_mmengine")
            for clock in (wall, cpu)
        ]
        lines.append(f"| {_label(case)} | {' | '.join(cells)} |")
    if len(cases[0].get("per_run", [])) > 1:
        lines += [
            "",
            "| each run's own ratio, lowest-highest | comm / raw | comm / mmengine |",
            "|---|---:|---:|",
        ]
        for case in cases:
            cells = []
            for key in ("comm_over_raw", "comm_over_mmengine"):
                values = [run["wall"][key] for run in case["per_run"]]
                known = [v for v in values if v is not None]
                cells.append(f"{min(known):.3f}-{max(known):.3f}" if known else "-")
            lines.append(f"| {_label(case)} | {' | '.join(cells)} |")
    for clock, title in (("wall", "ms per step"), ("cpu", "CPU ms per step")):
        lines += [
            "",
            f"| {title} | raw | comm | comm, BaseModel | mmengine |",
            "|---|" + "---:|" * 4,
        ]
        for case in cases:
            seconds = case[clock]["seconds_per_step"]
            cells = [_ms(seconds.get(name)) for name in IMPLEMENTATIONS]
            lines.append(f"| {_label(case)} | {' | '.join(cells)} |")
    if result["memory"]:
        lines += [
            "",
            "| RSS per rank, MiB: held / peak | raw | comm | comm, BaseModel | mmengine |",
            "|---|" + "---:|" * 4,
        ]
        for case in cases:
            cells = [_mib(case["memory_kib"].get(name)) for name in IMPLEMENTATIONS]
            lines.append(f"| {_label(case)} | {' | '.join(cells)} |")
    for what, reason in result["skipped"].items():
        lines += ["", f"Skipped the {what} rows: {reason}"]
    settings, load = result["settings"], result["load_average"]
    versions = ", ".join(f"{name} {version}" for name, version in result["versions"].items())
    lines += [
        "",
        "Ratios: the median of the paired ratios, with its 95% confidence interval in "
        "brackets (a bootstrap of that median: with several runs two-stage, runs drawn "
        "first, then repeats within them).",
        "",
        f"Timed: {settings['runs']} run(s), each a world of its own, x "
        f"{settings['repeats']} repeats x {settings['steps_per_sample']} steps "
        f"(warm-up repeats: {settings['warmup']}); ranks bound to cores: "
        f"{result['bound_to_cores']}; "
        f"load average before / after: {load['before']} / {load['after']}; {versions}.",
    ]
    return "\n".join(lines) + "\n"


def chart(result: dict[str, Any]) -> str:
    """The wall-time ratios of every case as an SVG bar chart."""
    cases = []
    for case in result["cases"]:
        wall = case["wall"]
        ratios = {"raw": wall["comm_over_raw"], "mmengine": wall["comm_over_mmengine"]}
        cases.append((_label(case), {k: v for k, v in ratios.items() if v is not None}))
    title = "comm_wrappers' train_step against the raw loop and MMEngine (2 gloo ranks)"
    return ratio_chart(title, cases, ["raw", "mmengine"])


# ---------------------------------------------------------------- main
def missing(module: str) -> str | None:
    """Why ``module`` cannot be imported, or None when it can."""
    try:
        __import__(module)
    except Exception as error:  # a broken install counts as missing, with its error
        return f"{module} is not importable ({type(error).__name__}: {error})"
    return None


def load_average() -> float | None:
    try:
        with open("/proc/loadavg") as handle:
            return float(handle.read().split()[0])
    except OSError:
        return None


def versions(skipped: dict[str, str]) -> dict[str, str]:
    import comm_wrappers

    found = {"torch": torch.__version__, "comm_wrappers": comm_wrappers.__version__}
    for name in ("mmengine", "deepspeed"):
        if name not in skipped:
            found[name] = __import__(name).__version__
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 steps a sample, 2 repeats (CI)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="timing worlds started one after the other; their samples are pooled",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "wrappers"))
    parser.add_argument(
        "--no-bind", action="store_true", help="let the ranks' threads run on any core"
    )
    args = parser.parse_args()
    settings = {
        "runs": max(1, args.runs),
        "repeats": args.repeats or (2 if args.smoke else 50),
        "warmup": 1 if args.smoke else 3,
        "steps_per_sample": 2 if args.smoke else 5,
        "memory_steps": 2 if args.smoke else 10,
        "memory_rounds": 1 if args.smoke else 3,
    }
    env = rank_env()
    # Imported here first, once: mmengine writes yapf's grammar cache on its first import,
    # and two ranks doing that at once may read each other's half-written file.
    skipped = {}
    for what, module in (("mmengine", "mmengine.model"), ("deepspeed", "deepspeed")):
        reason = missing(module)
        if reason is not None:
            skipped[what] = reason
            print(f"skipping the {what} rows: {reason}", flush=True)
    load = load_average()
    if load is not None and load > 0.5:
        print(f"note: load average {load:.2f} before the run: timings may be noisy", flush=True)
    # The ranks import this file as a module (its folder is on their sys.path) to find
    # the functions by name.
    from bench_wrappers import memory_rank, time_rank

    bind = not args.no_bind
    started = time.perf_counter()
    runs = [
        launch(time_rank, settings, skipped, bind, nprocs=2, timeout=1800, env=env)[0]
        for _ in range(settings["runs"])
    ]
    result = pool_runs(runs)
    seconds = {"timing": round(time.perf_counter() - started, 1)}
    memory = memory_supported()
    if memory:
        # A world of its own: no timing loop's garbage, and, with a fixed threshold, every
        # block of 128 KiB or more is mapped on its own and unmapped when freed, so the
        # RSS follows what is live instead of where the heap happens to have room
        memory_env = {**env, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        figures = launch(
            memory_rank, settings, skipped, bind, nprocs=2, timeout=1800, env=memory_env
        )[0]
        for case, usage in zip(result["cases"], figures):
            case["memory_kib"] = usage
        seconds["memory"] = round(time.perf_counter() - started - seconds["timing"], 1)
    result.update(
        settings=settings,
        skipped=skipped,
        bound_to_cores=bind,
        memory=memory,
        load_average={"before": load, "after": load_average()},
        seconds=seconds,
        versions=versions(skipped),
    )
    write_results(Path(args.out), result, markdown(result), chart(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
