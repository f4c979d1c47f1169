"""One demo run: train `DigitsNet` under one strategy (under torchrun for the distributed ones).

``python -m comm_strategies.demo.train --strategy ddp --out result.json`` (with torchrun)
trains, evaluates on the held-out digits, optionally saves a checkpoint, and writes a JSON
summary from rank 0. ``--load DIR --epochs 0`` only evaluates a checkpoint. With
``--work-dir DIR`` it checkpoints every ``--save-every`` steps and resumes from the latest
checkpoint at start, so that a run restarted by ``torchrun --max-restarts`` goes on where
it was; ``--kill-at STEP`` makes the last rank SIGKILL itself there once (the recovery demo).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import comm_collectives as dist
from comm_strategies import build_strategy
from comm_wrappers import unwrap_model

from . import TRAIN_SIZE, DigitsNet, digits_plan, load_digits, train_flops

GLOBAL_BATCH = 64


def _options(name: str) -> dict[str, Any]:
    if name == "deepspeed":
        return {"zero_stage": 2}
    if name == "model_parallel":
        # Tensor parallel over pairs of ranks, FSDP2 across the pairs (dp 2 x tp 2 on 4).
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return {"parallelize_fn": digits_plan, "tensor_parallel_size": 2 if world % 2 == 0 else 1}
    return {}


def data_coordinates(strategy: Any) -> tuple[int, int]:
    """``(rank, ranks)`` among the ranks that see different data.

    Every rank but under ModelParallelStrategy, whose tensor-parallel ranks share a batch.
    """
    rank = getattr(strategy, "data_parallel_rank", strategy.rank)
    ranks = getattr(strategy, "data_parallel_world_size", strategy.world_size)
    return int(rank), int(ranks)


class Progress:
    """A text progress bar on stderr (a line per quarter when stderr is not a terminal)."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = sys.stderr.isatty()
        self.last_quarter = -1

    def update(self, done: int, loss: float) -> None:
        if not self.enabled or self.total == 0:
            return
        width = 30
        filled = width * done // self.total
        bar = "#" * filled + "-" * (width - filled)
        text = f"{self.label:<10} [{bar}] {done:>4}/{self.total} loss {loss:.4f}"
        if self.tty:
            end = "\n" if done == self.total else ""
            print(f"\r{text}", end=end, file=sys.stderr, flush=True)
            return
        quarter = 4 * done // self.total
        if quarter != self.last_quarter:
            self.last_quarter = quarter
            print(text, file=sys.stderr, flush=True)


def evaluate(
    model: Any, images: torch.Tensor, labels: torch.Tensor, rank: int, ranks: int
) -> float:
    """Accuracy on the held-out digits: each data rank scores its share, counts are summed.

    ``rank`` of ``ranks`` are the data-parallel coordinates (`data_coordinates`): the
    tensor-parallel ranks of one group score the same share, counted once.
    """
    mine = slice(rank, None, ranks)
    model.eval()
    with torch.no_grad():
        logits = model(images[mine], mode="predict")
    model.train()
    correct = (logits.argmax(-1) == labels[mine]).sum().float().reshape(1)
    dist.all_reduce(correct)
    copies = dist.get_world_size() // ranks
    return float(correct) / copies / len(labels)


def _layout(strategy: Any) -> str | None:
    """``"2x2"`` (the mesh's sizes, outermost first) under ModelParallelStrategy, else None."""
    mesh = getattr(strategy, "device_mesh", None)
    return None if mesh is None else "x".join(str(size) for size in mesh.mesh.shape)


def directory_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _die_once(work_dir: Path | None, step: int) -> None:
    """The recovery demo's failure: note the step and the time, then SIGKILL this rank (the
    first time only: the note stays in ``work_dir``, so the restarted job trains on)."""
    if work_dir is None:
        return
    note = work_dir / "killed.json"
    if note.exists():
        return
    work_dir.mkdir(parents=True, exist_ok=True)
    note.write_text(json.dumps({"step": step, "time": time.time()}))
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="JSON summary (rank 0)")
    parser.add_argument("--save", type=Path, default=None, help="checkpoint directory")
    parser.add_argument("--load", type=Path, default=None, help="checkpoint to load first")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="save a checkpoint every --save-every steps here (async, keep_last=2) and resume "
        "from the latest one at start: a run that torchrun restarts goes on where it was",
    )
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="the recovery demo: the last rank SIGKILLs itself after this step, once a job",
    )
    args = parser.parse_args(argv)
    started = time.time()
    torch.set_num_threads(1)

    strategy = build_strategy(
        args.strategy, seed=0, work_dir=args.work_dir, **_options(args.strategy)
    )
    # One global batch of 64 per step, split evenly over the ranks: every strategy computes
    # the same updates, so the accuracies agree.
    strategy.setup_env()
    rank, world = data_coordinates(strategy)
    if GLOBAL_BATCH % world:
        message = f"the demo needs a world size that divides {GLOBAL_BATCH}, got {world}"
        raise SystemExit(message)
    torch.manual_seed(0)
    optim_cfg = {"optimizer": {"type": "AdamW", "lr": 2e-3, "weight_decay": 1e-4}}
    model, optim, _ = strategy.prepare(
        DigitsNet(),
        optim_wrapper=optim_cfg,
        dispatch_kwargs={"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world},
    )
    # The data goes where the model is: the GPU of this rank under nccl, else the CPU.
    device = next(unwrap_model(model).parameters()).device
    images, labels = (t.to(device) for t in load_digits())
    train_x, train_y = images[:TRAIN_SIZE], labels[:TRAIN_SIZE]
    test_x, test_y = images[TRAIN_SIZE:], labels[TRAIN_SIZE:]
    if args.load is not None:
        strategy.load_checkpoint(args.load, allow_unsafe_pickle=True)
    # After a restart: the latest complete checkpoint (model, optimizer, RNG) and its step.
    done = int(strategy.resume(missing_ok=True).get("step", 0)) if args.work_dir else 0
    resumed_from, first_step_at = done, None

    steps_per_epoch = TRAIN_SIZE // GLOBAL_BATCH
    total = steps_per_epoch * args.epochs
    progress = Progress(args.strategy, total, args.progress and strategy.rank == 0)
    times: list[float] = []
    loss = torch.tensor(0.0)
    handle = None
    for epoch in range(done // steps_per_epoch, args.epochs):
        order = torch.randperm(TRAIN_SIZE, generator=torch.Generator().manual_seed(epoch))
        for step in range(done % steps_per_epoch, steps_per_epoch):
            chunk = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH][rank::world]
            start = time.perf_counter()
            with optim.optim_context(model):
                loss = model(train_x[chunk], train_y[chunk], mode="loss")["loss"]
            optim.update_params(loss)
            times.append(time.perf_counter() - start)
            done += 1
            first_step_at = first_step_at or time.time()
            progress.update(done, float(loss))
            if args.kill_at == done and strategy.rank == strategy.world_size - 1:
                _die_once(args.work_dir, done)
            if args.work_dir is not None and done % args.save_every == 0:
                handle = strategy.save_checkpoint_async(
                    f"step_{done}", extra={"step": done}, keep_last=2
                )
    if handle is not None:
        handle.wait()

    accuracy = evaluate(model, test_x, test_y, rank, world)
    size = None
    leader = strategy.rank == 0
    if args.save is not None:
        path = strategy.save_checkpoint(args.save)
        size = directory_size(Path(path)) if leader else None
    if leader and args.out is not None:
        step_s = statistics.median(times[5:]) if len(times) > 5 else None
        summary = {
            "strategy": args.strategy,
            "ranks": strategy.world_size,
            "layout": _layout(strategy),
            "accuracy": accuracy,
            "step_ms": None if step_s is None else 1000 * step_s,
            "samples_per_s": None if step_s is None else GLOBAL_BATCH / step_s,
            "flops_per_step": train_flops(DigitsNet(), GLOBAL_BATCH),
            "steps": len(times),
            "checkpoint_bytes": size,
            "final_loss": float(loss),
            "started": started,
            "resumed_from": resumed_from,
            "first_step_at": first_step_at,
        }
        args.out.write_text(json.dumps(summary))
    strategy.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
