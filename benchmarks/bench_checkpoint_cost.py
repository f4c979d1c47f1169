"""Benchmark the fixed cost of comm's checkpoint calls, part by part, and their time against
raw torch distributed checkpoint (DCP), at world 4.

A world of ``--world`` gloo ranks (default 4, spawned by comm_core.testing: a FileStore,
gloo on the loopback interface) holds an MLP under FSDP2 with its AdamW state, for each of
``--sizes`` (default about 4.5M and 18M parameters), and saves and loads it again and again
in the ``dcp`` format:

- Time (target: at most 1.05x): ``raw`` is ``torch.distributed.checkpoint`` ``save`` /
  ``load`` of ``get_model_state_dict`` / ``get_optimizer_state_dict`` and ``set_*``
  (bench_checkpoint.py's FSDP2 case); ``comm`` is ``save_checkpoint`` /
  ``load_checkpoint``. A sample is one save or one load, timed by the slowest rank; ``raw``
  and ``comm`` alternate which goes first; the ratio is the median over the repeats of the
  ratio of the two samples of a repeat.
- Fixed cost per part (target: at most 3 ms of CPU per rank): during those samples, the
  package's module functions are wrapped (the module attribute reassigned, as
  tests/strategies/ckpt_seams.py does) and every rank records each call's CPU time
  (``time.thread_time``: the calling thread's) and wall time. The parts comm adds over
  raw DCP are the whole call less torch's own steps (the sharded state dicts, DCP's save
  or load, and for a load ``set_state_dict`` and DCP's metadata read); each is the median
  over the repeats, per rank. Garbage collections are recorded with the part they fell in.
  comm's save replaces its previous checkpoint, whose folder rank 0 deletes in a
  background thread: that deletion is timed apart, and each sample waits for it to end
  first (untimed; ``--no-settle``: not, as bench_checkpoint.py).
- Async save (target: the loop blocked at most 0.2x a synchronous save): the time
  ``save_checkpoint(..., async_save=True)`` takes to return, against a synchronous
  ``save_checkpoint`` of the same model, alternated; the background write is waited for
  (``wait()``) before the next sample, and the parts of the blocked call recorded too.

    python benchmarks/bench_checkpoint_cost.py [--smoke] [--repeats N] [--async-repeats N]
        [--world N] [--sizes 1500x2,1500x8] [--no-settle] [--out DIR] [--dir DIR]

Writes DIR/results.md and DIR/results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from _common import ROOT, median_interval, rank_env, write_results
from bench_checkpoint import barrier, make_mlp, model_bytes, one_step, shared_folder, slowest

from comm_core.testing import launch

SAVE_TARGET_MS = 3.0  # CPU per rank of the parts comm adds
RATIO_TARGET = 1.05
ASYNC_TARGET = 0.2

Sample = dict[str, list[float]]  # part -> [CPU seconds, wall seconds], one call's sum
# torch's own steps, in comm's calls and in the raw ones (the parts a garbage collection
# that falls inside them is counted with)
TORCH_STEPS = {"sharded_state", "write_dcp", "metadata read", "dcp_load", "load_sharded_state"}
TORCH_STEPS |= {"state dicts", "dcp_save", "set state dicts"}


class Recorder:
    """Each wrapped function's CPU time (the calling thread's) and wall time, summed per
    part over one sample; calls from other threads (an async save's writer) are not
    recorded, but for the background deletion (`wrap_background`)."""

    def __init__(self) -> None:
        self.sample: Sample | None = None
        self.active: set[str] = set()
        self.thread = threading.get_ident()
        self.tag = ""  # what the background calls are recorded under
        self.background: list[tuple[str, float, float]] = []
        self._undo: list[Callable[[], None]] = []
        self._collecting: tuple[float, float] | None = None
        self.missing: list[str] = []  # functions not found (the package changed): no row
        gc.callbacks.append(self._collection)
        self._undo.append(lambda: gc.callbacks.remove(self._collection))

    def _collection(self, phase: str, _info: dict[str, Any]) -> None:
        """The garbage collections of this thread during a sample, as the part ``gc``
        (wherever in the call they fell: inside the other parts too), and as ``gc in
        torch`` or ``gc in comm`` by whether one of torch's steps was running."""
        if self.sample is None or threading.get_ident() != self.thread:
            return
        if phase == "start":
            self._collecting = (time.thread_time(), time.perf_counter())
        elif self._collecting is not None:
            cpu, wall = self._collecting
            self._collecting = None
            spent = (time.thread_time() - cpu, time.perf_counter() - wall)
            where = "gc in torch" if self.active & TORCH_STEPS else "gc in comm"
            for key in ("gc", where):
                entry = self.sample.setdefault(key, [0.0, 0.0])
                entry[0] += spent[0]
                entry[1] += spent[1]

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        sample = self.sample
        if sample is None or threading.get_ident() != self.thread:
            yield
            return
        self.active.add(name)
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            self.active.discard(name)
            entry = sample.setdefault(name, [0.0, 0.0])
            entry[0] += cpu
            entry[1] += wall

    def wrap(
        self,
        owner: Any,
        attr: str,
        name: str | Callable[..., str],
        *,
        unless: str | None = None,
    ) -> None:
        """Record the calls of ``owner.attr`` (a module's function or a class's method) as
        the part ``name`` (or ``name(*args)``); not inside the part ``unless``."""
        if not hasattr(owner, attr):
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        original = getattr(owner, attr)

        def probe(*args: Any, **kwargs: Any) -> Any:
            if unless is not None and unless in self.active:
                return original(*args, **kwargs)
            label = name(*args, **kwargs) if callable(name) else name
            with self.part(label):
                return original(*args, **kwargs)

        self._replace(owner, attr, probe)

    def wrap_background(self, owner: Any, attr: str) -> None:
        """Record every call of ``owner.attr``, in any thread, outside the samples."""
        if not hasattr(owner, attr):
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        original = getattr(owner, attr)

        def probe(*args: Any, **kwargs: Any) -> Any:
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent = (time.thread_time() - cpu, time.perf_counter() - wall)
                self.background.append((self.tag, *spent))

        self._replace(owner, attr, probe)

    def _replace(self, owner: Any, attr: str, probe: Callable[..., Any]) -> None:
        had, original = attr in vars(owner), getattr(owner, attr)
        setattr(owner, attr, probe)
        if had:
            self._undo.append(lambda: setattr(owner, attr, original))
        else:  # a method inherited: the subclass's attribute goes again
            self._undo.append(lambda: delattr(owner, attr))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def install(recorder: Recorder, backend_class: type) -> None:
    """Wrap the checkpoint package's functions at each part of a save and a load."""
    from comm_strategies.checkpoint import (
        _async,
        _consensus,
        _files,
        _format_dcp,
        _load,
        _manifest,
        _publish,
        _save,
    )

    for module in (_save, _load):
        recorder.wrap(module, "backend_of", "backend_of")
        recorder.wrap(module, "torch_optimizers", "torch_optimizers")
        recorder.wrap(module, "Call", "Call()")
    recorder.wrap(_consensus, "wait_previous", "wait_previous")
    recorder.wrap(_publish, "temporary_name", "temporary_name")
    # save: entry, the format's write, the small files, the commit
    recorder.wrap(_save, "_enter", "_enter")
    recorder.wrap(_publish, "begin", "begin")
    recorder.wrap(_publish, "_remove_stale", "_remove_stale")
    recorder.wrap(_publish, "_replaceable", "_replaceable")
    recorder.wrap(_publish, "_our_manifest", "_our_manifest")
    recorder.wrap(_publish, "not_ours", "not_ours")
    recorder.wrap(backend_class, "describe", "describe")
    recorder.wrap(_consensus.Call, "enter", "Call.enter")
    recorder.wrap(_consensus.Call, "share", lambda _call, step, *_a, **_k: f"Call.share {step}")
    recorder.wrap(_format_dcp.DcpFormat, "write", "DcpFormat.write")
    for module in (_format_dcp, _async):
        recorder.wrap(module, "sharded_state", "sharded_state")
        recorder.wrap(module, "describe_params", "describe_params")
    recorder.wrap(_format_dcp, "write_dcp", "write_dcp")
    recorder.wrap(_save, "_small_files", "_small_files")
    recorder.wrap(_files, "capture_rng", "capture")
    recorder.wrap(_files, "save_file", "save_file")
    recorder.wrap(_save, "commit", "commit")
    recorder.wrap(_publish, "publish", "publish")
    recorder.wrap(_publish, "write_manifest", "write_manifest")
    recorder.wrap(_manifest, "list_files", "list_files")
    recorder.wrap(_manifest, "write_json", "write_json")
    recorder.wrap(_publish, "finish", "finish")
    recorder.wrap_background(_publish, "_remove_entry")
    # load: find (manifest, RNG file), entry, the format's read, the RNG restored
    recorder.wrap(_load, "_find", "_find")
    recorder.wrap(_load, "read_manifest", "read_manifest")
    recorder.wrap(_load, "_read_rng", "_read_rng")
    recorder.wrap(_load, "_read", "_read")
    recorder.wrap(_format_dcp.DcpFormat, "read", "DcpFormat.read")
    recorder.wrap(_format_dcp._Reader, "__init__", "_Reader()")
    recorder.wrap(_format_dcp, "check_against", "check_against")
    recorder.wrap(_format_dcp, "_check_group_count", "_check_group_count")
    # DCP's metadata read, done for comm's checks before DCP's load (which reuses it)
    recorder.wrap(_format_dcp._Reader, "read_metadata", "metadata read", unless="dcp_load")
    recorder.wrap(_format_dcp, "_drop_unsaved_optim_state", "_drop_unsaved_optim_state")
    recorder.wrap(_format_dcp, "dcp_load", "dcp_load")
    recorder.wrap(backend_class, "load_sharded_state", "load_sharded_state")
    recorder.wrap(_load, "restore_rng", "restore")
    # async: the blocked call's copy
    recorder.wrap(_async, "start", "start")
    recorder.wrap(_async, "_stage_parts", "_stage_parts")
    recorder.wrap(_async, "stage", "stage")
    recorder.wrap(_async, "dcp_group", "dcp_group")


def settle() -> None:
    """Wait for comm's background deletions of the checkpoints its saves replaced, so that
    no sample pays for another's (their cost is recorded apart, `wrap_background`)."""
    from comm_strategies.checkpoint import _publish

    for thread in list(getattr(_publish, "_deleting", {}).values()):
        thread.join()


def probe_overhead_us(recorder: Recorder) -> float:
    """The CPU one wrapped call adds (microseconds): a no-op recorded in a sample."""

    class Owner:
        @staticmethod
        def nothing() -> None:
            return None

    recorder.wrap(Owner, "nothing", "nothing")
    recorder.sample = {}
    calls = 2000
    start = time.thread_time()
    for _ in range(calls):
        Owner.nothing()
    spent = time.thread_time() - start
    recorder.sample = None
    baseline = time.thread_time()
    for _ in range(calls):
        (lambda: None)()
    spent -= time.thread_time() - baseline
    return spent / calls * 1e6


# ---------------------------------------------------------------- one rank
def cost_rank(settings: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from comm_wrappers import MMFullyShardedDataParallel2
    from comm_wrappers.backends import backend_of

    rank = torch_dist.get_rank()
    folder = shared_folder(settings["dir"], "bench-ckpt-cost-")
    recorder = Recorder()
    out: dict[str, Any] = {"sizes": {}}
    try:
        for width, depth in settings["sizes"]:
            model = MMFullyShardedDataParallel2(make_mlp(width, depth))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            one_step(model, optimizer, width)
            if not out["sizes"]:
                install(recorder, type(backend_of(model)))
                out["probe_overhead_us"] = probe_overhead_us(recorder)
                out["missing"] = list(recorder.missing)
            tag = recorder.tag = f"{width}x{depth}"
            out["sizes"][tag] = {
                "timing": time_size(settings, recorder, model, optimizer, folder / tag),
                "async": time_async(settings, recorder, model, optimizer, folder / tag),
            }
            del model, optimizer
            barrier()
    finally:
        settle()
        recorder.undo()
    out["background"] = recorder.background
    barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def operations(recorder: Recorder, model: Any, optimizer: Any, folder: Path) -> dict[str, Any]:
    """The four operations of a repeat, as bench_checkpoint.py's FSDP2 case."""
    from torch.distributed.checkpoint import state_dict as dsd
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from comm_strategies.checkpoint import load_checkpoint, save_checkpoint

    inner = model.module
    raw_dir, ours = folder / "raw", folder / "comm"

    def sharded() -> dict[str, Any]:
        return {
            "model": dsd.get_model_state_dict(inner),
            "optim": dsd.get_optimizer_state_dict(inner, optimizer),
        }

    def raw_save() -> None:
        with recorder.part("state dicts"):
            state = sharded()
        with recorder.part("dcp_save"):
            dcp_save(state, checkpoint_id=str(raw_dir))

    def raw_load() -> None:
        with recorder.part("state dicts"):
            state = sharded()
        with recorder.part("dcp_load"):
            dcp_load(state, checkpoint_id=str(raw_dir))
        with recorder.part("set state dicts"):
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


def measured(recorder: Recorder, operation: Callable[[], Any]) -> tuple[Sample, Any]:
    """Run ``operation`` as one sample: its parts, and its ``total`` (CPU, wall)."""
    recorder.sample = {}
    cpu, wall = time.thread_time(), time.perf_counter()
    try:
        result = operation()
    finally:
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        sample, recorder.sample = recorder.sample, None
    sample["total"] = [cpu, wall]
    return sample, result


def time_size(
    settings: dict[str, Any], recorder: Recorder, model: Any, optimizer: Any, folder: Path
) -> dict[str, Any]:
    """Per operation: the slowest rank's time of each sample, and this rank's parts."""
    ops = operations(recorder, model, optimizer, folder)
    out: dict[str, Any] = {name: {"slowest": [], "parts": []} for name in ops}
    for repeat in range(settings["warmup"] + settings["repeats"]):
        for action in ("save", "load"):
            order = ["raw", "comm"] if repeat % 2 == 0 else ["comm", "raw"]
            for who in order:
                name = f"{who} {action}"
                if settings["settle"]:
                    settle()
                barrier()
                sample, _ = measured(recorder, ops[name])
                elapsed = slowest(sample["total"][1])
                if repeat >= settings["warmup"]:
                    out[name]["slowest"].append(elapsed)
                    out[name]["parts"].append(sample)
    return out


def time_async(
    settings: dict[str, Any], recorder: Recorder, model: Any, optimizer: Any, folder: Path
) -> dict[str, Any]:
    """A synchronous save against an async one (blocked, and until ``wait()`` returns)."""
    from comm_strategies.checkpoint import save_checkpoint

    out: dict[str, Any] = {"sync": [], "blocked": [], "async total": [], "parts": []}

    def save_async() -> Any:
        return save_checkpoint(
            folder / "async", model=model, optim_wrapper=optimizer, strategy="fsdp2",
            async_save=True,
        )  # fmt: skip

    for repeat in range(settings["warmup"] + settings["async_repeats"]):
        for who in ["sync", "async"] if repeat % 2 == 0 else ["async", "sync"]:
            if settings["settle"]:
                settle()
            barrier()
            if who == "sync":
                sample, _ = measured(
                    recorder,
                    lambda: save_checkpoint(
                        folder / "sync", model=model, optim_wrapper=optimizer, strategy="fsdp2"
                    ),
                )
                times = {"sync": sample["total"][1]}
            else:
                start = time.perf_counter()
                sample, handle = measured(recorder, save_async)
                handle.wait()
                times = {"blocked": sample["total"][1], "async total": time.perf_counter() - start}
                if repeat >= settings["warmup"]:
                    out["parts"].append(sample)
            for name, seconds in times.items():
                seconds = slowest(seconds)
                if repeat >= settings["warmup"]:
                    out[name].append(seconds)
    return out


# ---------------------------------------------------------------- the parts
def _get(sample: Sample, key: str) -> list[float]:
    return sample.get(key, [0.0, 0.0])


def _minus(sample: Sample, key: str, whole: str, parts: list[str]) -> None:
    """``sample[key]`` = ``whole`` less ``parts`` (CPU and wall)."""
    sample[key] = [
        _get(sample, whole)[i] - sum(_get(sample, part)[i] for part in parts) for i in (0, 1)
    ]


SAVE_TOP = ["backend_of", "torch_optimizers", "_enter", "DcpFormat.write", "_small_files"]
SAVE_TOP += ["save_file", "commit"]
SAVE_TORCH = ["sharded_state", "write_dcp"]
LOAD_TOP = ["backend_of", "torch_optimizers", "_find", "Call.enter", "_read"]
LOAD_TOP += ["Call.share loaded", "restore"]
LOAD_READ = ["sharded_state", "describe_params", "check_against", "_check_group_count"]
LOAD_READ += ["metadata read", "_drop_unsaved_optim_state", "dcp_load", "load_sharded_state"]
LOAD_TORCH = ["sharded_state", "dcp_load", "load_sharded_state", "metadata read"]
ASYNC_TOP = ["backend_of", "torch_optimizers", "_enter", "_small_files", "start"]


def derive(operation: str, sample: Sample) -> Sample:
    """A sample with its computed parts: the unwrapped rest, the glue of the format's
    step, and ``added`` (comm's parts over raw DCP: the whole call less torch's steps)."""
    sample = {key: list(value) for key, value in sample.items()}
    if operation == "comm save":
        _minus(sample, "rest", "total", SAVE_TOP)
        _minus(sample, "write glue", "DcpFormat.write", [*SAVE_TORCH, "describe_params"])
        _minus(sample, "added", "total", SAVE_TORCH)
    elif operation == "comm load":
        _minus(sample, "rest", "total", LOAD_TOP)
        _minus(sample, "read glue", "DcpFormat.read", LOAD_READ)
        _minus(sample, "_read glue", "_read", ["DcpFormat.read"])
        _minus(sample, "added", "total", LOAD_TORCH)
        sample["DCP load"] = [
            _get(sample, "dcp_load")[i] + _get(sample, "metadata read")[i] for i in (0, 1)
        ]
    elif operation == "async":
        _minus(sample, "rest", "total", ASYNC_TOP)
    return sample


def per_rank(samples_by_rank: list[list[Sample]], key: str) -> list[list[float] | None]:
    """Per rank: the median CPU and wall (ms) of ``key`` over the samples, or None where
    the part never ran on that rank."""
    out: list[list[float] | None] = []
    for samples in samples_by_rank:
        if not any(key in sample for sample in samples):
            out.append(None)
            continue
        out.append(
            [statistics.median(_get(sample, key)[i] for sample in samples) * 1e3 for i in (0, 1)]
        )
    return out


def part_table(
    samples_by_rank: list[list[Sample]], operation: str, rows: list[tuple[str, str]]
) -> dict[str, Any]:
    """Per row: each rank's median CPU and wall (ms), and the largest of the ranks'."""
    derived = [[derive(operation, sample) for sample in samples] for samples in samples_by_rank]
    table: dict[str, Any] = {}
    for _label, key in rows:
        ranks = per_rank(derived, key)
        present = [value for value in ranks if value is not None]
        table[key] = {
            "ranks": ranks,
            "cpu_max": max((value[0] for value in present), default=None),
            "wall_max": max((value[1] for value in present), default=None),
        }
    return table


SAVE_ROWS = [
    ("`backend_of` (the model's adapter)", "backend_of"),
    ("`torch_optimizers`", "torch_optimizers"),
    ("entry (`_save._enter`)", "_enter"),
    ("· rank 0: `_publish.begin` (temporary folder)", "begin"),
    ("·· `_remove_stale` (leftovers of killed saves)", "_remove_stale"),
    ("·· `_replaceable` (the folder replaced is a checkpoint)", "_replaceable"),
    ("··· `_our_manifest` (its manifest read)", "_our_manifest"),
    ("··· `not_ours` (its files walked)", "not_ours"),
    ("· rank 0: `backend.describe()`", "describe"),
    ("· the exchange (`Call.enter`)", "Call.enter"),
    ("`describe_params` (in the format's write)", "describe_params"),
    ("the format's write, less its parts (`DcpFormat.write`)", "write glue"),
    ("small files, states taken (`_small_files`)", "_small_files"),
    ("· `_files.capture_rng`", "capture"),
    ("small files written (`save_file`: RNG)", "save_file"),
    ("commit (`_save.commit`)", "commit"),
    ("· exchange `written` (`Call.share`)", "Call.share written"),
    ("· rank 0: publish (`_publish.publish`)", "publish"),
    ("·· `write_manifest`", "write_manifest"),
    ("··· `list_files`", "list_files"),
    ("··· `write_json`", "write_json"),
    ("·· `_publish.finish` (rename)", "finish"),
    ("· exchange `published` (`Call.share`)", "Call.share published"),
    ("the rest of `save_checkpoint` (unwrapped)", "rest"),
    ("· `Call()`", "Call()"),
    ("·· `wait_previous` (an async save still running)", "wait_previous"),
    ("· `_publish.temporary_name`", "temporary_name"),
    ("(of which garbage collections, in whichever part above they fell)", "gc in comm"),
    ("**comm's parts (sum: the whole less torch's)**", "added"),
    ("torch: `sharded_state` (`get_state_dict`)", "sharded_state"),
    ("torch: `write_dcp` (DCP's save)", "write_dcp"),
    ("whole `save_checkpoint`", "total"),
]
LOAD_ROWS = [
    ("`backend_of` (the model's adapter)", "backend_of"),
    ("`torch_optimizers`", "torch_optimizers"),
    ("find (`_load._find`)", "_find"),
    ("· `read_manifest`", "read_manifest"),
    ("· this rank's RNG file (`_read_rng`)", "_read_rng"),
    ("entry (`Call.enter`)", "Call.enter"),
    ("`_load._read`, less the format's read (scalers, schedulers, user state)", "_read glue"),
    ("`describe_params` (in the format's read)", "describe_params"),
    ("`check_against` (names and shapes)", "check_against"),
    ("`_check_group_count` (param groups)", "_check_group_count"),
    ("`_drop_unsaved_optim_state`", "_drop_unsaved_optim_state"),
    ("the format's read, less its parts (`DcpFormat.read`)", "read glue"),
    ("· `_Reader()` (DCP's FileSystemReader)", "_Reader()"),
    ("exchange `loaded` (`Call.share`)", "Call.share loaded"),
    ("RNG restored (`_files.restore_rng`)", "restore"),
    ("the rest of `load_checkpoint` (unwrapped)", "rest"),
    ("· `Call()`", "Call()"),
    ("·· `wait_previous` (an async save still running)", "wait_previous"),
    ("(of which garbage collections, in whichever part above they fell)", "gc in comm"),
    ("**comm's parts (sum: the whole less torch's)**", "added"),
    ("torch: `sharded_state` (`get_state_dict`)", "sharded_state"),
    ("torch: DCP's metadata read (before its load)", "metadata read"),
    ("torch: `dcp_load` (DCP's load)", "dcp_load"),
    ("torch: `load_sharded_state` (`set_state_dict`)", "load_sharded_state"),
    ("whole `load_checkpoint`", "total"),
]
ASYNC_ROWS = [
    ("entry (`_save._enter`)", "_enter"),
    ("· the exchange (`Call.enter`)", "Call.enter"),
    ("small files, copies taken (`_small_files`)", "_small_files"),
    ("`_async.start`", "start"),
    ("· `_stage_parts`", "_stage_parts"),
    ("·· `sharded_state` (`get_state_dict`)", "sharded_state"),
    ("·· `describe_params`", "describe_params"),
    ("·· `stage` (the CPU copy)", "stage"),
    ("· `dcp_group`", "dcp_group"),
    ("the rest (`backend_of`, `torch_optimizers`, unwrapped)", "rest"),
    ("(of which garbage collections, in whichever part they fell)", "gc"),
    ("whole blocked call", "total"),
]
# torch's own steps, comm's against raw's: (label, comm's part, raw's part)
TORCH_ROWS = {
    "save": [
        ("sharded state dicts", "sharded_state", "state dicts"),
        ("DCP's save", "write_dcp", "dcp_save"),
        ("garbage collections (anywhere in the call)", "gc", "gc"),
        ("whole call", "total", "total"),
    ],
    "load": [
        ("sharded state dicts", "sharded_state", "state dicts"),
        ("DCP's load (with its metadata read)", "DCP load", "dcp_load"),
        ("set state dicts", "load_sharded_state", "set state dicts"),
        ("garbage collections (anywhere in the call)", "gc", "gc"),
        ("whole call", "total", "total"),
    ],
}


def summarize(ranks: list[dict[str, Any]], tag: str) -> dict[str, Any]:
    """One size's figures from every rank's samples."""
    timing = [rank["sizes"][tag]["timing"] for rank in ranks]
    out: dict[str, Any] = {"operations": {}, "parts": {}, "torch": {}}
    for action in ("save", "load"):
        raw, ours = timing[0][f"raw {action}"]["slowest"], timing[0][f"comm {action}"]["slowest"]
        out["operations"][action] = {
            "raw_ms": statistics.median(raw) * 1e3,
            "comm_ms": statistics.median(ours) * 1e3,
            "ratio": statistics.median(o / r for o, r in zip(ours, raw)),
            "ratios": [o / r for o, r in zip(ours, raw)],
            "interval": median_interval([o / r for o, r in zip(ours, raw)]),
            # the wrapped calls of one comm call on rank 0 (their probes' CPU is in the sums)
            "probe_calls": statistics.median(
                len(sample) - 1 for sample in timing[0][f"comm {action}"]["parts"]
            ),
        }
        # the CPU of every rank's calling thread, summed, comm's over raw's in each repeat
        cpu = {
            who: [
                sum(samples)
                for samples in zip(
                    *([s["total"][0] for s in t[f"{who} {action}"]["parts"]] for t in timing)
                )
            ]
            for who in ("raw", "comm")
        }
        cpu_ratios = [o / r for o, r in zip(cpu["comm"], cpu["raw"])]
        out["operations"][action]["cpu_ratio"] = statistics.median(cpu_ratios)
        out["operations"][action]["cpu_interval"] = median_interval(cpu_ratios)
        rows = SAVE_ROWS if action == "save" else LOAD_ROWS
        comm = [t[f"comm {action}"]["parts"] for t in timing]
        out["parts"][action] = part_table(comm, f"comm {action}", rows)
        raw_samples = [t[f"raw {action}"]["parts"] for t in timing]
        raw_rows = [(label, key) for label, _, key in TORCH_ROWS[action]]
        raw_table = part_table(raw_samples, f"raw {action}", raw_rows)
        out["torch"][action] = [
            {
                "label": label,
                "comm": out["parts"][action].get(ours_key)
                or part_table(comm, f"comm {action}", [(label, ours_key)])[ours_key],
                "raw": raw_table[raw_key],
            }
            for label, ours_key, raw_key in TORCH_ROWS[action]
        ]
    asynchronous = [rank["sizes"][tag]["async"] for rank in ranks]
    values = asynchronous[0]
    out["async"] = {
        "sync_ms": statistics.median(values["sync"]) * 1e3,
        "blocked_ms": statistics.median(values["blocked"]) * 1e3,
        "total_ms": statistics.median(values["async total"]) * 1e3,
        "ratio": statistics.median(b / s for b, s in zip(values["blocked"], values["sync"])),
        "interval": median_interval([b / s for b, s in zip(values["blocked"], values["sync"])]),
        "parts": part_table([a["parts"] for a in asynchronous], "async", ASYNC_ROWS),
    }
    return out


# ---------------------------------------------------------------- report
def _ms(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _parts_lines(table: dict[str, Any], rows: list[tuple[str, str]], world: int) -> list[str]:
    head = " | ".join(f"CPU r{rank}" for rank in range(world))
    lines = [
        f"| part | {head} | CPU max | wall max |",
        "|---|" + "---:|" * (world + 2),
    ]
    for label, key in rows:
        row = table[key]
        cpu = " | ".join(_ms(None if v is None else v[0]) for v in row["ranks"])
        lines.append(f"| {label} | {cpu} | {_ms(row['cpu_max'])} | {_ms(row['wall_max'])} |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    world = settings["world"]
    lines = [
        f"FSDP2, `dcp` format, world of {world} gloo ranks (FileStore); AdamW state; median of "
        f"{settings['repeats']} interleaved repeats (async: {settings['async_repeats']}) after "
        f"{settings['warmup']} warm-up; files in {settings['dir']}; load average "
        f"{result['load_before']} before, {result['load_after']} after; "
        f"{result['seconds']} s; {result['started_at']}, commit {result['commit']}. "
        "Times: the slowest rank's; CPU: `time.thread_time()` of "
        "the calling thread, median over the repeats per rank, ms. One wrapped call adds "
        f"about {result['probe_overhead_us']:.1f} us of CPU (the probe).",
        "",
        "comm / raw: the median of the repeats' ratios of the slowest rank's time (95% "
        "interval: bootstrap of the median); CPU, all ranks: the same ratio of the CPU "
        "time of the ranks' calling threads, summed (not gloo's threads, nor the deletion "
        "below).",
        "",
        f"Targets: comm / raw at most {RATIO_TARGET}x; comm's parts at most "
        f"{SAVE_TARGET_MS:g} ms of CPU per rank; async blocked / sync at most {ASYNC_TARGET}x.",
        "",
        "| model | operation | raw (ms) | comm (ms) | comm / raw | 95% interval "
        "| CPU, all ranks: comm / raw | raw CPU/rank (ms, max) "
        "| comm CPU/rank (ms, max) | comm's parts: CPU/rank (ms, max) |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for size in result["sizes"].values():
        for action in ("save", "load"):
            op = size["operations"][action]
            torch_rows = {row["label"]: row for row in size["torch"][action]}
            whole = torch_rows["whole call"]
            lines.append(
                f"| {size['label']} | {action} | {op['raw_ms']:.1f} | {op['comm_ms']:.1f} | "
                f"{op['ratio']:.3f}x | {op['interval'][0]:.3f}-{op['interval'][1]:.3f} | "
                f"{op['cpu_ratio']:.3f}x | "
                f"{_ms(whole['raw']['cpu_max'], 1)} | "
                f"{_ms(whole['comm']['cpu_max'], 1)} | "
                f"{_ms(size['parts'][action]['added']['cpu_max'])} |"
            )
    calls = max(
        size["operations"][action]["probe_calls"]
        for size in result["sizes"].values()
        for action in ("save", "load")
    )
    lines += [
        "",
        f"comm's parts include the probes' own CPU: at most {calls:g} wrapped calls a call "
        f"on rank 0, about {calls * result['probe_overhead_us'] / 1e3:.2f} ms.",
    ]
    if result["missing"]:
        lines += [
            "",
            "Not found in the package (not wrapped; their time is in the part around them): "
            + ", ".join(f"`{name}`" for name in result["missing"])
            + ".",
        ]
    for tag, size in result["sizes"].items():
        for action, rows in (("save", SAVE_ROWS), ("load", LOAD_ROWS)):
            lines += [
                "",
                f"{size['label']} ({tag}), comm's {action}, per part (ms; `·`: inside the "
                "part above; `-`: not run on that rank):",
                "",
                *_parts_lines(size["parts"][action], rows, world),
            ]
        lines += [
            "",
            f"{size['label']}, torch's own steps inside comm's call and in the raw call (ms, "
            "the largest of the ranks' medians):",
            "",
            "| operation | step | raw CPU | comm CPU | raw wall | comm wall |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for action in ("save", "load"):
            for row in size["torch"][action]:
                lines.append(
                    f"| {action} | {row['label']} | {_ms(row['raw']['cpu_max'])} | "
                    f"{_ms(row['comm']['cpu_max'])} | {_ms(row['raw']['wall_max'])} | "
                    f"{_ms(row['comm']['wall_max'])} |"
                )
    lines += [
        "",
        f"Async save at world {world}: the time `save_checkpoint(..., async_save=True)` "
        "blocks the loop against a synchronous save, alternated.",
        "",
        "| model | sync save (ms) | async: blocked (ms) | blocked / sync | 95% interval "
        "| async: until wait() returns (ms) |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for size in result["sizes"].values():
        row = size["async"]
        lines.append(
            f"| {size['label']} | {row['sync_ms']:.1f} | {row['blocked_ms']:.1f} | "
            f"{row['ratio']:.2f}x | {row['interval'][0]:.2f}-{row['interval'][1]:.2f} | "
            f"{row['total_ms']:.1f} |"
        )
    for tag, size in result["sizes"].items():
        lines += [
            "",
            f"{size['label']} ({tag}), the blocked part of the async save, per part (ms):",
            "",
            *_parts_lines(size["async"]["parts"], ASYNC_ROWS, world),
        ]
    waited = (
        "each sample starts once the previous deletion has ended (not timed)"
        if settings["settle"]
        else "not waited for: a deletion runs during the samples that follow"
    )
    lines += [
        "",
        "Deletion of the checkpoint a save replaced (`_publish._remove_entry`, in a "
        f"background thread of rank 0; {waited}):",
        "",
        "| model | deletions | CPU (ms) | wall (ms) |",
        "|---|---:|---:|---:|",
    ]
    for size in result["sizes"].values():
        row = size["deletion"]
        lines.append(
            f"| {size['label']} | {row['count']} | {_ms(row['cpu_ms'], 1)} | "
            f"{_ms(row['wall_ms'], 1)} |"
        )
    return "\n".join(lines) + "\n"


def _commit() -> str:
    """The repository's commit, ``+`` when the packages differ from it; ``?`` without git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        changed = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "packages"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+" if changed else "")


def _load_average() -> str:
    with open("/proc/loadavg") as handle:
        return " ".join(handle.read().split()[:3])


def _size(text: str) -> tuple[int, int]:
    width, depth = text.lower().split("x")
    return int(width), int(depth)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a small model, 2 repeats (CI)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--async-repeats", type=int, default=None)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument(
        "--no-settle",
        action="store_true",
        help="do not wait for comm's background deletion of a replaced checkpoint before "
        "the next sample (as bench_checkpoint.py: it then runs during the samples after)",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="the MLPs, WIDTHxDEPTH separated by commas (Linear(WIDTH, WIDTH) x DEPTH); "
        "default 1500x2,1500x8 (4.5M and 18M parameters)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint-cost"))
    parser.add_argument(
        "--dir",
        default=None,
        help="where the checkpoints are written; default /dev/shm when writable, else the "
        "temporary folder",
    )
    args = parser.parse_args()
    default_dir = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    sizes = args.sizes or ("256x2" if args.smoke else "1500x2,1500x8")
    settings: dict[str, Any] = {
        "dir": args.dir or default_dir,
        "world": args.world,
        "repeats": args.repeats or (2 if args.smoke else 41),
        "async_repeats": args.async_repeats or (2 if args.smoke else 21),
        "warmup": 1,
        "settle": not args.no_settle,
        "sizes": [_size(text) for text in sizes.split(",")],
    }
    env = rank_env()
    from bench_checkpoint_cost import cost_rank

    load_before = _load_average()
    started_at = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    started = time.perf_counter()
    ranks = launch(cost_rank, settings, nprocs=settings["world"], timeout=1800, env=env)
    seconds = round(time.perf_counter() - started, 1)
    result: dict[str, Any] = {
        "settings": settings,
        "started_at": started_at,
        "commit": _commit(),
        "load_before": load_before,
        "load_after": _load_average(),
        "seconds": seconds,
        "probe_overhead_us": statistics.median(rank["probe_overhead_us"] for rank in ranks),
        "missing": ranks[0]["missing"],
        "versions": {"torch": torch.__version__},
        "sizes": {},
    }
    for width, depth in settings["sizes"]:
        tag = f"{width}x{depth}"
        parameters = model_bytes(make_mlp(width, depth)) // 4
        summary = summarize(ranks, tag)
        summary["parameters"] = parameters
        summary["label"] = f"{parameters / 1e6:.1f}M params"
        deletions = [entry[1:] for entry in ranks[0]["background"] if entry[0] == tag]
        summary["deletion"] = {
            "count": len(deletions),
            "cpu_ms": statistics.median(d[0] for d in deletions) * 1e3 if deletions else None,
            "wall_ms": statistics.median(d[1] for d in deletions) * 1e3 if deletions else None,
        }
        result["sizes"][tag] = summary
    write_results(Path(args.out), result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
