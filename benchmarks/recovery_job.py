"""The recovery benchmark's comm job: the demo's model trained under torchrun restarts.

Run by ``bench_recovery.py`` under ``scripts/launch/torchrun.sh restart static|c10d``. The
loop a user writes: `build_strategy` with a ``work_dir`` (DDP, or FSDP2), `DigitsNet` on
the demo's handwritten digits, `ElasticSampler` for the data (global batch 64),
``resume(missing_ok=True)`` after ``prepare``, an async checkpoint every ``--save-every``
steps (``keep_last=2``).

A rank SIGKILLs itself right after an optimizer step (``recovery_common.kill_step``:
``--kill-step S`` on rank ``--kill-rank`` in the first attempt, or one kill in each of the
first ``--kill-attempts`` attempts); the time just before the signal goes into
``OUT/killed-<restart count>.json``.

Each process writes ``OUT/attempt-<restart count>-rank<R>.json``: its process's start
(read from /proc), the end of its imports, ``setup_env`` (the rendezvous: ``init_dist``),
``prepare`` (with the data), ``resume``, the first step's end, the step it resumed from,
and, on a survivor, the time its collective raised. Rank 0 writes the final parameters to
``OUT/final.pt``.

``--cost K1,K2,..``: no kill; blocks of ``--block-steps`` steps alternate between no
checkpoint and an async save every K steps (``recovery_common.cost_blocks``); rank 0
writes ``OUT/cost.json``.
"""

from __future__ import annotations

import recovery_common as common

PROCESS_START = common.process_start()

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from comm_strategies import ElasticSampler, build_strategy  # noqa: E402
from comm_strategies.demo import TRAIN_SIZE, DigitsNet, load_digits  # noqa: E402

IMPORTED = time.time()
GLOBAL_BATCH, LR = common.GLOBAL_BATCH, common.LR


def _timed_stage() -> dict[str, float]:
    """Time the CPU copy of each async save (the checkpoint package's `stage`)."""
    from comm_strategies.checkpoint import _async

    spent = {"stage": 0.0}
    stage = _async.stage

    def timed(state: Any) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            return stage(state)
        finally:
            spent["stage"] += time.perf_counter() - start

    _async.stage = timed
    return spent


def main() -> None:
    args = common.parse()
    out = Path(args.out)
    torch.set_num_threads(1)

    record = common.Record(out, PROCESS_START, IMPORTED)
    strategy = build_strategy(args.strategy, seed=0, work_dir=args.work_dir)
    record.mark("before_rendezvous")
    strategy.setup_env()  # init_dist: the rendezvous of this attempt's ranks
    record.mark("ready", world=strategy.world_size)
    rank = strategy.rank
    optimizer = {"type": "OptimWrapper", "optimizer": {"type": "AdamW", "lr": LR}}
    model, optim_wrapper, _ = strategy.prepare(DigitsNet(), optim_wrapper=optimizer)
    images, labels = load_digits()
    data = TensorDataset(images[:TRAIN_SIZE], labels[:TRAIN_SIZE])
    sampler = ElasticSampler(data, GLOBAL_BATCH, seed=0)
    record.mark("prepared")
    extra = strategy.resume(missing_ok=True)
    step = int(extra.get("step", 0))
    if extra:
        sampler.load_state_dict(extra["sampler"])
    record.mark("resumed", resumed_from=step)

    def one_step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        with optim_wrapper.optim_context(model):
            loss = model(inputs, targets, mode="loss")["loss"]
        optim_wrapper.update_params(loss)
        sampler.advance()

    def loader() -> Any:
        return iter(DataLoader(data, sampler=sampler, batch_size=sampler.micro_batch_size))

    if args.cost:
        batches = loader()

        def cost_step() -> None:
            nonlocal batches
            batch = next(batches, None)
            if batch is None:  # the epoch's end
                batches = loader()
                batch = next(batches)
            one_step(*batch)

        spent = _timed_stage()
        samples = common.cost_blocks(
            intervals=[int(k) for k in args.cost.split(",")],
            block_steps=args.block_steps,
            repeats=args.repeats,
            warmup=args.warmup,
            step=cost_step,
            save=lambda every, index: strategy.save_checkpoint_async(
                f"cost_{every}", extra={"step": index}, keep_last=2
            ),
            wait=lambda handle: handle.wait(),
            staged=lambda: spent["stage"],
        )
        if rank == 0:
            result = {"block_steps": args.block_steps, "samples": samples}
            (out / "cost.json").write_text(json.dumps(result))
        strategy.teardown()
        return

    kill_at = common.kill_step(
        kill_at=args.kill_step,
        kill_rank=args.kill_rank,
        kill_attempts=args.kill_attempts,
        save_every=args.save_every,
        rank=rank,
        resumed=step,
    )
    handle = None
    try:
        while step < args.steps:
            for inputs, targets in loader():
                one_step(inputs, targets)
                step += 1
                if "first_step" not in record.values:
                    record.mark("first_step")
                if step == kill_at:
                    common.die(out, step, rank, int(record.values["resumed_from"]))
                if step % args.save_every == 0:
                    handle = strategy.save_checkpoint_async(
                        f"step_{step}",
                        extra={"step": step, "sampler": sampler.state_dict()},
                        keep_last=2,
                    )
                if step == args.steps:
                    break
    except Exception as error:  # a survivor: when did its collective raise?
        record.mark("raised", raised_what=f"{type(error).__name__}: {str(error)[:300]}")
        raise
    if handle is not None:
        handle.wait()
    state = strategy.model_state_dict()
    if rank == 0:
        torch.save({"params": state, "step": step}, out / "final.pt")
    strategy.teardown()


if __name__ == "__main__":
    import os
    import sys

    main()
    # torch 2.13's gloo can abort the interpreter's teardown after a finished run
    # ("terminate called without an active exception"): leave without one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
