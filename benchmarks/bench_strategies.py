"""Benchmark comm_strategies' training step against the raw loop on the same engine, and MMEngine.

Two local gloo ranks (spawned by comm_core.testing, each bound to a core of its own) train
one MLP under every engine, two ways each:

- ``raw``: a hand-written loop on the bare engine: torch DDP, FSDP1 (CPU,
  ``use_orig_params=True``), FSDP2 ``fully_shard``, a DeepSpeed ZeRO 2 engine
  (``engine.backward``, ``engine.step``); forward, backward, optimizer step, zero_grad.
- ``comm``: the matching comm strategy (``build_strategy(name).prepare(...)``) driven by
  the plain loop of examples/train_loop.py: forward inside ``optim_context``, then
  ``optim_wrapper.update_params(loss)``.
- ``mmengine`` (DDP only): MMEngine's own ``DDPStrategy`` (the only one that runs on a CPU:
  its FSDP strategy needs a CUDA device id, its DeepSpeed strategy cannot be built with
  DeepSpeed 0.19) against comm's ``DDPStrategy``, both running the same MMEngine
  ``BaseModel``'s ``train_step``.

A second world of four gloo ranks measures ``model_parallel`` (data parallel 2 x tensor
parallel 2: the MLP's first two layers split by columns then rows, ``fully_shard`` over the
data-parallel dimension): the step of ``ModelParallelStrategy`` against the same torch
calls by hand (``init_device_mesh``, ``parallelize_module``, ``fully_shard``, the same
plan and mesh shape), and its checkpoint save and resume (model, AdamW state) against
raw torch distributed checkpoint (``get_state_dict``, ``dcp.save``; ``dcp.load``,
``set_state_dict``). Four ranks share this machine's cores: the ratios matter more than
the times.

Every implementation trains its own copy of the same initial weights on the same batches
with AdamW. A sample times several steps back to back (the time shown is per step; each
sample is the slowest rank's wall time); the order of the implementations rotates from
one repeat to the next; the tables give medians over the repeats, and each ratio is the
median over the repeats of the ratio of the two samples taken in the same repeat.

    python benchmarks/bench_strategies.py [--smoke] [--repeats N] [--out DIR] [--no-bind]
        [--only steps|model_parallel] [--hidden WIDTH]

``--only steps`` runs the 2-rank world alone, ``--only model_parallel`` the 4-rank one.
Writes DIR/results.md and DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from bench_collectives import bind_to_cores
from torch import nn

from comm_core.testing import WorldPool

HIDDEN = 512  # the MLP's width by default; --hidden passes another to the ranks (below)
_HIDDEN_VARIABLE = "COMM_BENCH_HIDDEN"


def hidden_width() -> int:
    """The MLP's width: ``--hidden``, which main hands the ranks in the environment."""
    return int(os.environ.get(_HIDDEN_VARIABLE, HIDDEN))


BATCH = 32
Step = Callable[[tuple[torch.Tensor, torch.Tensor]], None]


def make_net() -> nn.Module:
    torch.manual_seed(0)
    width = hidden_width()
    return nn.Sequential(
        nn.Linear(128, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
        nn.Linear(width, 16),
    )  # fmt: skip


class Model(nn.Module):
    """The MLP with the ``forward(inputs, targets, mode=)`` contract."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, inputs: torch.Tensor, targets: Any = None, mode: str = "tensor") -> Any:
        out = self.net(inputs)
        if mode == "loss":
            return {"loss": nn.functional.mse_loss(out, targets)}
        return out


def mm_model() -> nn.Module:
    from mmengine.model import BaseModel

    class MMModel(BaseModel):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def forward(self, inputs: Any, data_samples: Any = None, mode: str = "tensor") -> Any:
            out = self.net(inputs)
            if mode == "loss":
                return {"loss": nn.functional.mse_loss(out, data_samples)}
            return out

    return MMModel()


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def ds_config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**13,
    }


def raw(kind: str) -> Step:
    """A hand-written loop on the bare engine."""
    net = make_net()
    if kind == "deepspeed":
        import deepspeed

        os.environ.setdefault("LOCAL_RANK", str(torch_dist.get_rank()))
        engine, _, _, _ = deepspeed.initialize(
            model=net, optimizer=adamw(net.parameters()), config=ds_config(),
            dist_init_required=False,
        )  # fmt: skip

        def ds_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            loss = nn.functional.mse_loss(engine(batch[0]), batch[1])
            engine.backward(loss)
            engine.step()

        return ds_step
    model: nn.Module
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(net)
    elif kind == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(net, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(net)
    optimizer = adamw(model.parameters())

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def comm(kind: str) -> Step:
    """The comm strategy, driven by the plain loop."""
    from comm_strategies import build_strategy

    options = {"zero_stage": 2} if kind == "deepspeed" else {}
    strategy = build_strategy(kind, seed=0, **options)
    model, optim, _ = strategy.prepare(
        Model(),
        optim_wrapper={"optimizer": {"type": "AdamW", "lr": 1e-3}},
        dispatch_kwargs={"train_micro_batch_size_per_gpu": BATCH},
    )

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        with optim.optim_context(model):
            loss = model(batch[0], batch[1], mode="loss")["loss"]
        optim.update_params(loss)

    return step


def comm_basemodel() -> Step:
    from comm_strategies import DDPStrategy

    strategy = DDPStrategy(seed=0)
    model, optim, _ = strategy.prepare(
        mm_model(), optim_wrapper={"optimizer": {"type": "AdamW", "lr": 1e-3}}
    )

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        model.train_step({"inputs": batch[0], "data_samples": batch[1]}, optim)

    return step


def mmengine_ddp(workdir: str) -> Step:
    from mmengine._strategy import DDPStrategy

    strategy = DDPStrategy(
        work_dir=workdir,
        model_wrapper={"type": "MMDistributedDataParallel", "device_ids": None},
        env_kwargs={"dist_cfg": {"backend": "gloo"}},
    )
    model, optim = strategy.prepare(  # MMEngine returns no schedulers when none are given
        mm_model(),
        optim_wrapper={"type": "OptimWrapper", "optimizer": {"type": "AdamW", "lr": 1e-3}},
    )

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        model.train_step({"inputs": batch[0], "data_samples": batch[1]}, optim)

    return step


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(torch_dist.get_rank())
    return [
        (torch.randn(BATCH, 128, generator=generator), torch.randn(BATCH, 16, generator=generator))
        for _ in range(count)
    ]


def _sample(step: Step, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    torch_dist.barrier()
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    elapsed = torch.tensor([(time.perf_counter() - start) / len(batches)])
    torch_dist.all_reduce(elapsed, op=torch_dist.ReduceOp.MAX)
    return float(elapsed)


def run_rank(smoke: bool, repeats: int, steps: int, bind: bool) -> dict[str, Any]:
    """Build every implementation, then time them interleaved; medians of the slowest rank."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    bind_to_cores(bind)
    pairs: dict[str, dict[str, Step]] = {}
    skipped: dict[str, str] = {}
    for kind in ("ddp", "fsdp", "fsdp2", "deepspeed"):
        try:
            pairs[kind] = {"raw": raw(kind), "comm": comm(kind)}
        except ImportError as error:
            skipped[kind] = f"{type(error).__name__}: {error}"
    try:
        folder = tempfile.mkdtemp(prefix="comm-bench-mm-")
        pairs["ddp, BaseModel"] = {"mmengine": mmengine_ddp(folder), "comm": comm_basemodel()}
    except ImportError as error:
        skipped["ddp, BaseModel"] = f"{type(error).__name__}: {error}"
    batches = _batches(steps)
    samples: dict[str, dict[str, list[float]]] = {
        name: {impl: [] for impl in impls} for name, impls in pairs.items()
    }
    for repeat in range(-1 if smoke else -2, repeats):  # negative repeats: warm-up
        for name, impls in pairs.items():
            order = list(impls)
            order = order[repeat % len(order) :] + order[: repeat % len(order)]
            for impl in order:
                value = _sample(impls[impl], batches)
                if repeat >= 0:
                    samples[name][impl].append(value)
    rows = {}
    for name, values in samples.items():
        base = "mmengine" if "mmengine" in values else "raw"
        ratios = [c / b for c, b in zip(values["comm"], values[base])]
        rows[name] = {
            "base": base,
            "base_ms": 1000 * statistics.median(values[base]),
            "comm_ms": 1000 * statistics.median(values["comm"]),
            "ratio": statistics.median(ratios),
        }
    return {"rows": rows, "skipped": skipped}


MP_PLAN_RAW = {"0": "colwise", "2": "rowwise"}  # make_net's Sequential: layers 0 and 2


def _mp_plan(prefix: str) -> Callable[[nn.Module, Any], None]:
    def plan(model: nn.Module, mesh: Any) -> None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        layers = {prefix + name: styles[style]() for name, style in MP_PLAN_RAW.items()}
        parallelize_module(model, mesh["tensor_parallel"], layers)

    return plan


def mp_raw() -> tuple[Step, nn.Module, torch.optim.Optimizer]:
    """The same torch calls by hand: mesh, tensor-parallel plan, fully_shard, AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    net = make_net()
    _mp_plan("")(net, mesh)
    fully_shard(net, mesh=mesh["data_parallel"])
    optimizer = adamw(net.parameters())

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        loss = nn.functional.mse_loss(net(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, net, optimizer


def mp_comm() -> tuple[Step, Any]:
    from comm_strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        parallelize_fn=_mp_plan("net."), tensor_parallel_size=2, seed=0
    )
    model, optim, _ = strategy.prepare(
        Model(), optim_wrapper={"optimizer": {"type": "AdamW", "lr": 1e-3}}
    )

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        with optim.optim_context(model):
            loss = model(batch[0], batch[1], mode="loss")["loss"]
        optim.update_params(loss)

    return step, strategy


def _mp_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tensor-parallel pairs (ranks 0-1, 2-3) share their batches."""
    generator = torch.Generator().manual_seed(torch_dist.get_rank() // 2)
    return [
        (torch.randn(BATCH, 128, generator=generator), torch.randn(BATCH, 16, generator=generator))
        for _ in range(count)
    ]


def _timed(action: Callable[[], Any]) -> float:
    torch_dist.barrier()
    start = time.perf_counter()
    action()
    elapsed = torch.tensor([time.perf_counter() - start])
    torch_dist.all_reduce(elapsed, op=torch_dist.ReduceOp.MAX)
    return float(elapsed)


def run_mp_rank(smoke: bool, repeats: int, steps: int, bind: bool, root: str) -> dict[str, Any]:
    """model_parallel on 4 ranks: the step, then checkpoint save and load, comm vs raw."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    bind_to_cores(bind)
    raw_step, raw_net, raw_optim = mp_raw()
    comm_step, strategy = mp_comm()
    batches = _mp_batches(steps)
    steps_of: dict[str, list[float]] = {"raw": [], "comm": []}
    saves: dict[str, list[float]] = {"raw": [], "comm": []}
    loads: dict[str, list[float]] = {"raw": [], "comm": []}

    def raw_save(path: str) -> None:
        model_state, optim_state = get_state_dict(raw_net, raw_optim)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)

    def raw_load(path: str) -> None:
        model_state, optim_state = get_state_dict(raw_net, raw_optim)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            raw_net, raw_optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    impls: dict[str, tuple[Step, Callable[[str], Any], Callable[[str], Any]]] = {
        "raw": (raw_step, raw_save, raw_load),
        "comm": (comm_step, lambda path: strategy.save_checkpoint(path), strategy.resume),
    }
    # The smoke run checks the script: one timed repeat after the first (untimed) one.
    for repeat in range(-1 if smoke else -2, 1 if smoke else repeats):
        order = list(impls)
        order = order[repeat % 2 :] + order[: repeat % 2]
        for impl in order:
            step, save, load = impls[impl]
            value = _sample(step, batches)
            path = f"{root}/{impl}-{repeat + 2}"
            saved = _timed(lambda save=save, path=path: save(path))  # type: ignore[misc]
            loaded = _timed(lambda load=load, path=path: load(path))  # type: ignore[misc]
            if repeat >= 0:
                steps_of[impl].append(value)
                saves[impl].append(saved)
                loads[impl].append(loaded)
    rows = {}
    for name, values in (
        ("step", steps_of),
        ("checkpoint save", saves),
        ("checkpoint load", loads),
    ):
        ratios = [c / b for c, b in zip(values["comm"], values["raw"])]
        rows[f"model_parallel 2x2, {name}"] = {
            "base": "raw (by hand)" if name == "step" else "raw DCP",
            "base_ms": 1000 * statistics.median(values["raw"]),
            "comm_ms": 1000 * statistics.median(values["comm"]),
            "ratio": statistics.median(ratios),
            # every repeat's pair, for pooling runs (results.json)
            "samples_ms": [[1000 * b, 1000 * c] for b, c in zip(values["raw"], values["comm"])],
        }
    return {"rows": rows, "skipped": {}}


def to_markdown(result: dict[str, Any], repeats: int, steps: int) -> str:
    lines: list[str] = []
    width = result.get("hidden", HIDDEN)
    if result["rows"] or result["skipped"]:  # not with --only model_parallel
        lines += [
            f"World of 2 gloo ranks, MLP 128-{width}-{width}-16, batch {BATCH} per rank, "
            f"AdamW; {repeats} interleaved repeats of {steps} steps, medians.",
            "",
            "| engine | baseline | baseline ms/step | comm ms/step | comm / baseline |",
            "|---|---|---:|---:|---:|",
        ]
    for name, row in result["rows"].items():
        lines.append(
            f"| {name} | {row['base']} | {row['base_ms']:.2f} | {row['comm_ms']:.2f} | "
            f"{row['ratio']:.3f}x |"
        )
    for name, reason in result["skipped"].items():
        lines.append(f"| {name} | skipped: {reason} | | | |")
    mp = result.get("model_parallel")
    if mp:
        lines += [
            "",
            f"World of 4 gloo ranks (data parallel 2 x tensor parallel 2), MLP "
            f"128-{width}-{width}-16, "
            f"batch {BATCH} per data-parallel rank, AdamW; {repeats} interleaved repeats "
            f"(steps: {steps} per sample; checkpoints: model and AdamW state, ms per save or "
            "load), medians.",
            "",
            "| case | baseline | baseline ms | comm ms | comm / baseline |",
            "|---|---|---:|---:|---:|",
        ]
        for name, row in mp["rows"].items():
            lines.append(
                f"| {name} | {row['base']} | {row['base_ms']:.2f} | {row['comm_ms']:.2f} | "
                f"{row['ratio']:.3f}x |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a quick run that checks the script")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="steps per sample")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-bind", action="store_true", help="do not bind ranks to cores")
    parser.add_argument(
        "--hidden",
        type=int,
        default=HIDDEN,
        help=f"the MLP's hidden width (default {HIDDEN}); a wider model shows what is fixed "
        "per call",
    )
    parser.add_argument(
        "--only",
        choices=("steps", "model_parallel"),
        default=None,
        help="run one world only: the 2-rank steps, or the 4-rank model_parallel rows",
    )
    args = parser.parse_args()
    if args.hidden < 2 or args.hidden % 2:
        # the tensor-parallel plan splits the hidden layers between 2 ranks
        parser.error(f"--hidden must be a positive even width, got {args.hidden}")
    repeats, steps = (2, 2) if args.smoke else (args.repeats, args.steps)
    env = {
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        _HIDDEN_VARIABLE: str(args.hidden),
    }
    os.environ.update(env)
    # Imported here first, once: mmengine writes yapf's grammar cache on its first import,
    # and two ranks doing that at once may read each other's half-written file.
    for module in ("mmengine.model", "deepspeed"):
        try:
            __import__(module)
        except ImportError:
            pass
    # The ranks import this file as a module (its folder is on their sys.path) to find
    # the function by name.
    from bench_strategies import run_mp_rank, run_rank

    result: dict[str, Any] = {"rows": {}, "skipped": {}}
    if args.only != "model_parallel":
        with WorldPool(2, timeout=900, env=env) as pool:
            bind = not args.no_bind
            result = pool.run(run_rank, args.smoke, repeats, steps, bind, timeout=900)[0]
    if args.only != "steps":
        with (
            tempfile.TemporaryDirectory(prefix="comm-bench-mp-") as root,
            WorldPool(4, timeout=900, env=env) as pool,
        ):
            result["model_parallel"] = pool.run(
                run_mp_rank, args.smoke, repeats, steps, not args.no_bind, root, timeout=900
            )[0]
    result["hidden"] = args.hidden  # in results.json too
    text = to_markdown(result, repeats, steps)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text)
        (args.out / "results.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
