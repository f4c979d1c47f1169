"""The recovery benchmark's plain-torch job: recovery_job.py written with torch alone.

Run by ``bench_recovery.py`` under the same ``scripts/launch/torchrun.sh restart`` as the
comm job, with the same model (`DigitsNet`, the demo's data), the same global batches (64
samples, each epoch a permutation seeded with its number, rank r takes the r-th half of
each batch: ElasticSampler's order), AdamW, and the same kills and records
(``recovery_common``). What a user writes without comm:

- ``torch.distributed.init_process_group("gloo")`` from torchrun's environment (env://);
- ``DistributedDataParallel``;
- every ``--save-every`` steps ``torch.distributed.checkpoint.async_save`` of
  ``get_state_dict(model, optimizer)`` into ``WORK/step_<n>`` over a gloo group of its
  own (as torch's documentation recommends), the previous save waited for first;
- at start, the newest ``WORK/step_<n>`` whose ``.metadata`` exists (DCP writes it last)
  loaded with ``torch.distributed.checkpoint.load`` and ``set_state_dict``.

``--cost K1,K2,..``: the checkpoint-cost blocks of ``recovery_common.cost_blocks``.
"""

from __future__ import annotations

import recovery_common as common

PROCESS_START = common.process_start()

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as torch_dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import async_save  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

IMPORTED = time.time()
GLOBAL_BATCH, LR = common.GLOBAL_BATCH, common.LR
TRAIN_SIZE = 1536  # comm_strategies.demo.TRAIN_SIZE


class DigitsNet(nn.Module):
    """comm_strategies.demo.DigitsNet's layers (the same initial values under one seed)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.body(inputs)  # type: ignore[no-any-return]


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """comm_strategies.demo.load_digits, read from the package's folder without importing it."""
    import gzip
    from importlib.util import find_spec

    spec = find_spec("comm_strategies")  # finds the package; runs none of its code
    if spec is None or not spec.submodule_search_locations:
        message = "the demo's data ships with comm-strategies: install it to run this job"
        raise ImportError(message)
    folder = Path(next(iter(spec.submodule_search_locations))) / "demo"
    raw = gzip.decompress((folder / "digits.u8.gz").read_bytes())
    table = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, 65)
    table = table[torch.randperm(len(table), generator=torch.Generator().manual_seed(1998))]
    return table[:, :64].float() / 16.0, table[:, 64].long()


def latest(work: Path) -> tuple[int, Path | None]:
    """The newest complete DCP checkpoint under ``work``: (its step, its folder)."""
    done = [
        (int(folder.name.split("_")[1]), folder)
        for folder in work.glob("step_*")
        if (folder / ".metadata").exists()
    ]
    return max(done, key=lambda item: item[0]) if done else (0, None)


def main() -> None:
    args = common.parse()
    out, work = Path(args.out), Path(args.work_dir)
    torch.set_num_threads(1)
    record = common.Record(out, PROCESS_START, IMPORTED)
    record.mark("before_rendezvous")
    torch_dist.init_process_group("gloo")  # env:// from torchrun
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    checkpoint_group = torch_dist.new_group(backend="gloo")
    record.mark("ready", world=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(DigitsNet())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    images, labels = load_digits()
    images, labels = images[:TRAIN_SIZE], labels[:TRAIN_SIZE]
    steps_per_epoch = TRAIN_SIZE // GLOBAL_BATCH
    share = GLOBAL_BATCH // world
    record.mark("prepared")
    step, source = latest(work)
    if source is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        dcp_load(state, checkpoint_id=str(source))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    record.mark("resumed", resumed_from=step)
    orders: dict[int, torch.Tensor] = {}

    def one_step(number: int) -> None:
        """Optimizer step ``number`` (0-based) on this rank's half of its global batch."""
        epoch, row = divmod(number, steps_per_epoch)
        if epoch not in orders:
            orders.clear()
            orders[epoch] = torch.randperm(
                TRAIN_SIZE, generator=torch.Generator().manual_seed(epoch)
            )
        batch = orders[epoch][row * GLOBAL_BATCH : (row + 1) * GLOBAL_BATCH]
        mine = batch[rank * share : (rank + 1) * share]
        loss = torch.nn.functional.cross_entropy(model(images[mine]), labels[mine])
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()

    def save(folder: Path) -> Any:
        model_state, optim_state = get_state_dict(model, optimizer)
        return async_save(
            {"model": model_state, "optim": optim_state},
            checkpoint_id=str(folder),
            process_group=checkpoint_group,
        )

    if args.cost:
        counter = 0

        def cost_step() -> None:
            nonlocal counter
            one_step(counter)
            counter += 1

        samples = common.cost_blocks(
            intervals=[int(k) for k in args.cost.split(",")],
            block_steps=args.block_steps,
            repeats=args.repeats,
            warmup=args.warmup,
            step=cost_step,
            save=lambda every, index: save(work / f"cost_{every}_{index}"),
            wait=lambda future: future.result(),
            staged=lambda: 0.0,
        )
        if rank == 0:
            result = {"block_steps": args.block_steps, "samples": samples}
            (out / "cost.json").write_text(json.dumps(result))
        torch_dist.destroy_process_group()
        return

    kill_at = common.kill_step(
        kill_at=args.kill_step,
        kill_rank=args.kill_rank,
        kill_attempts=args.kill_attempts,
        save_every=args.save_every,
        rank=rank,
        resumed=step,
    )
    future = None
    try:
        while step < args.steps:
            one_step(step)
            step += 1
            if "first_step" not in record.values:
                record.mark("first_step")
            if step == kill_at:
                common.die(out, step, rank, int(record.values["resumed_from"]))
            if step % args.save_every == 0:
                if future is not None:
                    future.result()
                future = save(work / f"step_{step}")
    except Exception as error:  # a survivor: when did its collective raise?
        record.mark("raised", raised_what=f"{type(error).__name__}: {str(error)[:300]}")
        raise
    if future is not None:
        future.result()
    if rank == 0:
        params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save({"params": params, "step": step}, out / "final.pt")
    torch_dist.barrier()
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    import os
    import sys

    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
