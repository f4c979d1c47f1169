"""Benchmark comm_strategies.checkpoint against the raw mechanisms, and its peak memory.

Two local gloo ranks (spawned by comm_core.testing) hold an MLP under three engines and
save and load a checkpoint of it, model and AdamW state, again and again:

- DDP, one full file: ``raw`` is rank 0's ``torch.save({"model": ..., "optim": ...})``
  and every rank's ``torch.load`` + ``load_state_dict``, with a barrier; ``comm`` is
  ``save_checkpoint`` / ``load_checkpoint`` (full files, manifest, RNG, atomic rename).
- FSDP2, sharded: ``raw`` is ``torch.distributed.checkpoint.save`` / ``load`` of
  ``get_model_state_dict`` / ``get_optimizer_state_dict`` and ``set_*``; ``comm`` the
  same functions (DCP format).
- DeepSpeed ZeRO 2: ``raw`` is ``engine.save_checkpoint`` / ``engine.load_checkpoint``;
  ``comm`` the same functions (DeepSpeed's files).

A sample is one save or one load, timed by the slowest rank; the order of ``raw`` and
``comm`` alternates from one repeat to the next, and each ratio is the median over the
repeats of the ratio of the two samples taken in the same repeat.

Async save, in the same world: the time the training loop is blocked by
``save_checkpoint(..., async_save=True)`` (from the call to its return: the CPU copy) over
the time of a synchronous ``save_checkpoint`` of the same model and AdamW state, for DDP
(full files) and FSDP2 (DCP); the target is at most 0.2x. The background writes are
waited for before the next sample and timed too (call to ``wait()``'s return).

Memory, in a world of its own with glibc's mmap threshold at 128 KiB (freed blocks leave
the resident set): the peak RSS growth of rank 0 while it saves a full (``sharded=False``)
checkpoint of the model alone, sharded by FSDP2 and by FSDP1, over the model's size, and
the time of that save (slowest rank, median of the rounds).

Resharding, in worlds of their own: a DeepSpeed ZeRO-2 checkpoint saved at world 2 loaded
into FSDP2 at world 3, against the same checkpoint loaded back at world 2 (target: at most
1.5x), and rank 0's peak RSS growth during the world-3 load against the model's full fp32
state, parameters and AdamW's moments (target: at most 1.2x).

    python benchmarks/bench_checkpoint.py [--smoke] [--repeats N] [--out DIR]

Writes DIR/results.md and DIR/results.json. The DeepSpeed rows need DeepSpeed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from _common import rank_env, write_results
from bench_collectives import _rss_kib, _trim
from torch import nn

from comm_core.testing import launch

Op = Callable[[], Any]


def make_mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def one_step(model: nn.Module, optimizer: Any, width: int) -> None:
    """One AdamW step, so that the optimizer has state to save."""
    inputs = torch.randn(4, width)
    loss = model(inputs).square().mean()
    if hasattr(optimizer, "backward"):  # DeepSpeed's optim wrapper
        optimizer.backward(loss)
        optimizer.step()
        return
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def shared_folder(directory: str, prefix: str) -> Path:
    """A fresh folder under ``directory`` made by rank 0, its name given to every rank."""
    folder = (
        Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
        if torch_dist.get_rank() == 0
        else Path()
    )
    names = [str(folder)]
    torch_dist.broadcast_object_list(names, src=0)
    return Path(names[0])


def barrier() -> None:
    torch_dist.barrier()


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MAX)
    return float(value.item())


# ---------------------------------------------------------------- the engines
def case_ddp(width: int, depth: int, folder: Path) -> dict[str, Op]:
    from comm_strategies.checkpoint import load_checkpoint, save_checkpoint
    from comm_wrappers import MMDistributedDataParallel

    model = MMDistributedDataParallel(make_mlp(width, depth))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    one_step(model, optimizer, width)
    raw_file, ours = folder / "raw.pt", folder / "comm"
    rank = torch_dist.get_rank()

    def raw_save() -> None:
        if rank == 0:
            state = {"model": model.module.state_dict(), "optim": optimizer.state_dict()}
            torch.save(state, raw_file)
        barrier()

    def raw_load() -> None:
        state = torch.load(raw_file, map_location="cpu", weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        barrier()

    return {
        "raw save": raw_save,
        "comm save": lambda: save_checkpoint(
            ours, model=model, optim_wrapper=optimizer, strategy="ddp"
        ),
        "raw load": raw_load,
        "comm load": lambda: load_checkpoint(ours, model=model, optim_wrapper=optimizer),
    }


def case_fsdp2(width: int, depth: int, folder: Path) -> dict[str, Op]:
    from torch.distributed.checkpoint import state_dict as dsd
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from comm_strategies.checkpoint import load_checkpoint, save_checkpoint
    from comm_wrappers import MMFullyShardedDataParallel2

    model = MMFullyShardedDataParallel2(make_mlp(width, depth))
    inner = model.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    one_step(model, optimizer, width)
    raw_dir, ours = folder / "raw", folder / "comm"

    def sharded() -> dict[str, Any]:
        return {
            "model": dsd.get_model_state_dict(inner),
            "optim": dsd.get_optimizer_state_dict(inner, optimizer),
        }

    def raw_save() -> None:
        dcp_save(sharded(), checkpoint_id=str(raw_dir))

    def raw_load() -> None:
        state = sharded()
        dcp_load(state, checkpoint_id=str(raw_dir))
        dsd.set_model_state_dict(inner, state["model"])
        dsd.set_optimizer_state_dict(inner, optimizer, state["optim"])

    return {
        "raw save": raw_save,
        "comm save": lambda: save_checkpoint(
            ours, model=model, optim_wrapper=optimizer, strategy="fsdp2"
        ),
        "raw load": raw_load,
        "comm load": lambda: load_checkpoint(ours, model=model, optim_wrapper=optimizer),
    }


def case_deepspeed(width: int, depth: int, folder: Path) -> dict[str, Op]:
    from comm_strategies.checkpoint import load_checkpoint, save_checkpoint
    from comm_wrappers.deepspeed import initialize

    module = make_mlp(width, depth)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    wrapper, optim = initialize(module, config, optimizer)
    one_step(wrapper, optim, width)
    engine = wrapper.model
    raw_dir, ours = folder / "raw", folder / "comm"

    def raw_load() -> None:
        engine.load_checkpoint(str(raw_dir), tag="state", load_lr_scheduler_states=False)

    return {
        "raw save": lambda: engine.save_checkpoint(
            str(raw_dir), tag="state", client_state={}, save_latest=False
        ),
        "comm save": lambda: save_checkpoint(
            ours, model=wrapper, optim_wrapper=optim, strategy="deepspeed"
        ),
        "raw load": raw_load,
        "comm load": lambda: load_checkpoint(ours, model=wrapper, optim_wrapper=optim),
    }


CASES = {"DDP (full file)": case_ddp, "FSDP2 (DCP)": case_fsdp2, "DeepSpeed ZeRO 2": case_deepspeed}


def async_cases(width: int, depth: int) -> dict[str, tuple[Any, Any, str]]:
    """The models of the async rows: (model, optimizer, strategy name), one step taken."""
    from comm_wrappers import MMDistributedDataParallel, MMFullyShardedDataParallel2

    cases: dict[str, tuple[Any, Any, str]] = {}
    for name, wrapper, strategy in (
        ("DDP (full file)", MMDistributedDataParallel, "ddp"),
        ("FSDP2 (DCP)", MMFullyShardedDataParallel2, "fsdp2"),
    ):
        model = wrapper(make_mlp(width, depth))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        one_step(model, optimizer, width)
        cases[name] = (model, optimizer, strategy)
    return cases


def time_async(settings: dict[str, Any], folder: Path) -> dict[str, dict[str, list[float]]]:
    """Per case: the synchronous save, the time an async save blocks, and its whole time."""
    from comm_strategies.checkpoint import save_checkpoint

    out: dict[str, dict[str, list[float]]] = {}
    for case, (model, optimizer, strategy) in async_cases(
        settings["async_width"], settings["async_depth"]
    ).items():
        samples: dict[str, list[float]] = {"sync": [], "blocked": [], "async total": []}
        for repeat in range(settings["warmup"] + settings["repeats"]):
            for who in ["sync", "async"] if repeat % 2 == 0 else ["async", "sync"]:
                barrier()
                start = time.perf_counter()
                if who == "sync":
                    save_checkpoint(
                        folder / "sync", model=model, optim_wrapper=optimizer, strategy=strategy
                    )
                    times = {"sync": time.perf_counter() - start}
                else:
                    handle = save_checkpoint(
                        folder / "async", model=model, optim_wrapper=optimizer,
                        strategy=strategy, async_save=True,
                    )  # fmt: skip
                    blocked = time.perf_counter() - start
                    handle.wait()
                    times = {"blocked": blocked, "async total": time.perf_counter() - start}
                for name, seconds in times.items():
                    seconds = slowest(seconds)
                    if repeat >= settings["warmup"]:
                        samples[name].append(seconds)
        out[case] = samples
        del model, optimizer
        barrier()
    return out


# ---------------------------------------------------------------- one rank
def time_rank(settings: dict[str, Any], skipped: dict[str, str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rank = torch_dist.get_rank()
    folder = shared_folder(settings["dir"], "bench-ckpt-")
    out: dict[str, Any] = {}
    for case, build in CASES.items():
        if case.startswith("DeepSpeed") and "deepspeed" in skipped:
            continue
        ops = build(settings["width"], settings["depth"], folder)
        samples: dict[str, list[float]] = {name: [] for name in ops}
        for repeat in range(settings["warmup"] + settings["repeats"]):
            for action in ("save", "load"):
                order = ["raw", "comm"] if repeat % 2 == 0 else ["comm", "raw"]
                for who in order:
                    op = ops[f"{who} {action}"]
                    barrier()
                    start = time.perf_counter()
                    op()
                    elapsed = slowest(time.perf_counter() - start)
                    if repeat >= settings["warmup"]:
                        samples[f"{who} {action}"].append(elapsed)
        out[case] = samples
        barrier()
    barrier()
    out["async"] = time_async(settings, folder)
    barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def memory_rank(settings: dict[str, Any]) -> dict[str, Any]:
    """Peak RSS growth of each rank while it saves a full checkpoint of an FSDP model."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from comm_strategies.checkpoint import save_checkpoint
    from comm_wrappers import MMFullyShardedDataParallel, MMFullyShardedDataParallel2

    rank = torch_dist.get_rank()
    folder = shared_folder(settings["dir"], "bench-ckpt-mem-")
    out: dict[str, Any] = {}
    for name, wrapper in (
        ("FSDP2", MMFullyShardedDataParallel2),
        ("FSDP1", MMFullyShardedDataParallel),
    ):
        module = make_mlp(settings["width"], settings["depth"])
        size = model_bytes(module)
        model = wrapper(module)
        del module
        peaks, seconds = [], []
        for round_ in range(settings["memory_rounds"]):
            _trim()
            barrier()
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            before = _rss_kib("VmRSS")
            start = time.perf_counter()
            save_checkpoint(
                folder / f"{name}-{round_}", model=model, strategy="fsdp", sharded=False
            )
            seconds.append(slowest(time.perf_counter() - start))
            peaks.append((_rss_kib("VmHWM") - before) * 1024)
            barrier()
        out[name] = {
            "model_bytes": size,
            "peak_bytes": int(statistics.median(peaks)),
            "save_ms": statistics.median(seconds) * 1e3,
        }
        del model
        barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def reshard_source(settings: dict[str, Any], folder: str) -> list[float]:
    """World 2: a DeepSpeed ZeRO-2 checkpoint (model and AdamW state) saved into ``folder``,
    then loaded back into the same engine again and again: the same-topology loads (s)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from comm_strategies.checkpoint import load_checkpoint, save_checkpoint
    from comm_wrappers.deepspeed import initialize

    width, depth = settings["width"], settings["depth"]
    module = make_mlp(width, depth)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    wrapper, optim = initialize(module, config, torch.optim.AdamW(module.parameters(), lr=1e-3))
    one_step(wrapper, optim, width)
    path = Path(folder) / "zero2-world2"
    save_checkpoint(path, model=wrapper, optim_wrapper=optim, strategy="deepspeed")
    seconds = []
    for _ in range(settings["warmup"] + settings["repeats"]):
        barrier()
        start = time.perf_counter()
        load_checkpoint(path, model=wrapper, optim_wrapper=optim)
        seconds.append(slowest(time.perf_counter() - start))
    return seconds[settings["warmup"] :]


def reshard_target(settings: dict[str, Any], folder: str) -> dict[str, Any]:
    """World 3: the world-2 DeepSpeed checkpoint into FSDP2 with AdamW, again and again:
    each load's time (slowest rank), and rank 0's peak RSS growth during one load."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from comm_strategies.checkpoint import load_checkpoint
    from comm_wrappers import MMFullyShardedDataParallel2

    model = MMFullyShardedDataParallel2(make_mlp(settings["width"], settings["depth"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = Path(folder) / "zero2-world2"
    seconds, peaks = [], []
    for _ in range(settings["warmup"] + settings["repeats"]):
        _trim()
        barrier()
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        before = _rss_kib("VmRSS")
        start = time.perf_counter()
        load_checkpoint(path, model=model, optim_wrapper=optimizer)
        seconds.append(slowest(time.perf_counter() - start))
        peaks.append((_rss_kib("VmHWM") - before) * 1024)
    return {"seconds": seconds[settings["warmup"] :], "peak_bytes": int(min(peaks))}


# ---------------------------------------------------------------- report
def summary(samples: dict[str, list[float]], action: str) -> dict[str, float]:
    raw, ours = samples[f"raw {action}"], samples[f"comm {action}"]
    return {
        "raw_ms": statistics.median(raw) * 1e3,
        "comm_ms": statistics.median(ours) * 1e3,
        "ratio": statistics.median(o / r for o, r in zip(ours, raw)),
    }


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    mib = result["model_bytes"] / 2**20
    lines = [
        f"Model: MLP {settings['depth']} x Linear({settings['width']}, {settings['width']}), "
        f"{mib:.1f} MiB of fp32 parameters (+ AdamW state: about 3x that on disk); world "
        f"of 2 gloo ranks; median of {settings['repeats']} interleaved repeats; files in "
        f"{settings['dir']}.",
        "",
        "| engine | operation | raw (ms) | comm (ms) | comm / raw |",
        "|---|---|---:|---:|---:|",
    ]
    for case, figures in result["timing"].items():
        for action in ("save", "load"):
            row = figures[action]
            lines.append(
                f"| {case} | {action} | {row['raw_ms']:.1f} | {row['comm_ms']:.1f} | "
                f"{row['ratio']:.2f}x |"
            )
    for what, reason in result["skipped"].items():
        lines.append(f"| {what} | skipped: {reason} | | | |")
    asynchronous = result.get("async", {})
    if asynchronous:
        mib_async = result["async_model_bytes"] / 2**20
        lines += [
            "",
            f"Async save of a {mib_async:.1f} MiB model (+ AdamW state): the time the loop is "
            "blocked by `save_checkpoint(..., async_save=True)` vs a synchronous save "
            "(target: at most 0.2x).",
            "",
            "| engine | sync save (ms) | async: blocked (ms) | blocked / sync "
            "| async: until wait() returns (ms) |",
            "|---|---:|---:|---:|---:|",
        ]
        for case, row in asynchronous.items():
            lines.append(
                f"| {case} | {row['sync_ms']:.1f} | {row['blocked_ms']:.1f} | "
                f"{row['ratio']:.2f}x | {row['total_ms']:.1f} |"
            )
    reshard = result.get("reshard")
    if reshard:
        lines += [
            "",
            "Resharding load: the world-2 DeepSpeed ZeRO-2 checkpoint (model and AdamW state) "
            "into FSDP2 at world 3, against the same checkpoint loaded back into its own "
            "engine at world 2 (target: at most 1.5x); rank 0's peak RSS growth during the "
            "world-3 load against the model's full fp32 state, parameters and AdamW's two "
            "moments (target: at most 1.2x).",
            "",
            "| load | same topology (ms) | resharding (ms) | ratio | rank 0 peak growth (MiB) "
            "| full fp32 state (MiB) | peak / state |",
            "|---|---:|---:|---:|---:|---:|---:|",
            f"| ZeRO-2 world 2 -> FSDP2 world 3 | {reshard['same_ms']:.1f} | "
            f"{reshard['reshard_ms']:.1f} | {reshard['ratio']:.2f}x | "
            f"{reshard['peak_bytes'] / 2**20:.1f} | {reshard['state_bytes'] / 2**20:.1f} | "
            f"{reshard['peak_bytes'] / reshard['state_bytes']:.2f}x |",
        ]
    lines += [
        "",
        "| full save of an FSDP model (rank 0) | model size (MiB) | peak RSS growth (MiB) "
        "| growth / model size | save (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, figures in result.get("memory", {}).items():
        size, peak = figures["model_bytes"], figures["peak_bytes"]
        lines.append(
            f"| {name} | {size / 2**20:.1f} | {peak / 2**20:.1f} | {peak / size:.2f}x "
            f"| {figures['save_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a small model, 2 repeats (CI)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint"))
    parser.add_argument(
        "--dir",
        default=None,
        help="where the checkpoints are written; default /dev/shm (memory: the software's "
        "cost without the disk's noise) when it exists, else the temporary folder",
    )
    args = parser.parse_args()
    default_dir = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    settings: dict[str, Any] = {
        "dir": args.dir or default_dir,
        "repeats": args.repeats or (2 if args.smoke else 15),
        "warmup": 1,
        "width": 256 if args.smoke else 2048,
        "depth": 2 if args.smoke else 4,
        "memory_rounds": 1 if args.smoke else 3,
        # 4 x Linear(2048, 2048): 64 MiB of fp32 parameters
        "async_width": 256 if args.smoke else 2048,
        "async_depth": 2 if args.smoke else 4,
    }
    env = rank_env()
    skipped = {}
    try:
        import deepspeed  # noqa: F401
    except ImportError as error:
        skipped["deepspeed"] = f"not installed ({error})"
    from bench_checkpoint import memory_rank, time_rank

    started = time.perf_counter()
    samples = launch(time_rank, settings, skipped, nprocs=2, timeout=1800, env=env)[0]
    async_samples = samples.pop("async")
    timing = {
        case: {action: summary(values, action) for action in ("save", "load")}
        for case, values in samples.items()
    }
    result: dict[str, Any] = {
        "settings": settings,
        "skipped": skipped,
        "timing": timing,
        "model_bytes": model_bytes(make_mlp(settings["width"], settings["depth"])),
        "async": {
            case: {
                "sync_ms": statistics.median(values["sync"]) * 1e3,
                "blocked_ms": statistics.median(values["blocked"]) * 1e3,
                "total_ms": statistics.median(values["async total"]) * 1e3,
                "ratio": statistics.median(
                    b / s for b, s in zip(values["blocked"], values["sync"])
                ),
            }
            for case, values in async_samples.items()
        },
        "async_model_bytes": model_bytes(
            make_mlp(settings["async_width"], settings["async_depth"])
        ),
        "versions": {"torch": torch.__version__},
    }
    if os.path.exists("/proc/self/clear_refs"):
        memory_env = {**env, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        result["memory"] = launch(memory_rank, settings, nprocs=2, timeout=1800, env=memory_env)[0]
        if "deepspeed" not in skipped:
            result["reshard"] = resharding(settings, memory_env)
    result["seconds"] = round(time.perf_counter() - started, 1)
    write_results(Path(args.out), result, markdown(result))
    return 0


def resharding(settings: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """The resharding row: a DeepSpeed checkpoint of world 2 loaded into FSDP2 at world 3."""
    from bench_checkpoint import reshard_source, reshard_target

    folder = tempfile.mkdtemp(prefix="bench-ckpt-reshard-", dir=settings["dir"])
    try:
        same = launch(reshard_source, settings, folder, nprocs=2, timeout=1800, env=env)[0]
        target = launch(reshard_target, settings, folder, nprocs=3, timeout=1800, env=env)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    state_bytes = 3 * model_bytes(make_mlp(settings["width"], settings["depth"]))
    return {
        "same_ms": statistics.median(same) * 1e3,
        "reshard_ms": statistics.median(target["seconds"]) * 1e3,
        "ratio": statistics.median(target["seconds"]) / statistics.median(same),
        "peak_bytes": target["peak_bytes"],
        "state_bytes": state_bytes,
    }


if __name__ == "__main__":
    raise SystemExit(main())
