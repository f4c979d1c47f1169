"""A training job that survives its own death: run under torchrun by test_recovery.py.

The loop a user writes: `build_strategy` with a ``work_dir``, `ElasticSampler` for the
data, ``resume(missing_ok=True)`` after ``prepare``, a checkpoint every ``--save-every``
steps (``keep_last=2``, sync or ``--async-save``). With ``--kill WHERE:STEP`` rank
``--kill-rank`` (by default rank 0 in a publish, rank 1 elsewhere) SIGKILLs itself once
in the job (the first process to get there leaves
``OUT/killed``):

- ``step:N``: right after optimizer step N;
- ``save:N``: inside the sync save of step N, when rank 0 is about to publish it (every
  rank has written its part; the folder is still temporary);
- ``async:N``: in the background thread writing the async save of step N;
- ``retention:N``: in the save of step N, once ``keep_last`` has hidden the first old
  checkpoint and before it is deleted.

Each process writes ``OUT/attempt-<token>-rank<R>.json`` (its world, the step it resumed
from, timestamps) and ``OUT/progress-rank<R>`` (the last step done); rank 0 writes the
final parameters to ``OUT/final.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

STARTED = time.time()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from comm_core._attempt import current_attempt  # noqa: E402
from comm_strategies import ElasticSampler, build_strategy  # noqa: E402
from comm_strategies.checkpoint import _async, _publish  # noqa: E402

SAMPLES = 96


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, mode: str = "loss") -> Any:
        return {"loss": nn.functional.mse_loss(self.body(inputs), targets)}


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(SAMPLES, 6, generator=generator)
    targets = torch.randn(SAMPLES, 3, generator=generator)
    return TensorDataset(inputs, targets)


def _die(out: Path, where: str) -> None:
    """Leave the mark (the kill happens once a job), note the time, SIGKILL this process."""
    try:
        with open(out / "killed", "x") as mark:
            json.dump({"where": where, "time": time.time(), "pid": os.getpid()}, mark)
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(kill: str, out: Path, rank: int, victim: int | None) -> tuple[str, int]:
    """Patch the checkpoint package's seams for a kill inside a save; return (where, step)."""
    where, _, at = kill.partition(":")
    if victim is None:  # rank 0 publishes and retains; kill another rank elsewhere
        victim = 0 if where in ("save", "retention") else 1
    if not where or rank != victim or (out / "killed").exists():
        return "", -1
    step = int(at)
    if where == "save":
        publish = _publish.finish

        def finish(temporary: Path, final: Path) -> None:
            if final.name == f"step_{step}":
                _die(out, where)
            publish(temporary, final)

        _publish.finish = finish  # type: ignore[assignment]
    elif where == "async":
        write = _async.save_file

        def writing(value: Any, file: Path) -> None:
            if any(part.startswith(f".step_{step}.tmp-") for part in file.parts):
                _die(out, where)
            write(value, file)

        _async.save_file = writing
    elif where == "retention":
        hide = _publish._delete_later

        def delete_later(folder: Path) -> None:
            _die(out, where)
            hide(folder)

        _publish._delete_later = delete_later
    return where, step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--kill", default="")
    parser.add_argument("--kill-rank", type=int, default=None, help="default: who gets there")
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    options: dict[str, Any] = {"zero_stage": 2} if args.strategy == "deepspeed" else {}
    strategy = build_strategy(args.strategy, seed=0, work_dir=args.work_dir, **options)
    strategy.setup_env()
    ready = time.time()
    rank, world = strategy.rank, strategy.world_size
    model, optim_wrapper, _ = strategy.prepare(
        Net(), optim_wrapper={"type": "OptimWrapper", "optimizer": {"type": "AdamW", "lr": 1e-2}}
    )
    sampler = ElasticSampler(SAMPLES, args.global_batch, seed=3)
    loader = DataLoader(dataset(), sampler=sampler, batch_size=sampler.micro_batch_size)
    prepared = time.time()
    extra = strategy.resume(missing_ok=True)
    step = int(extra.get("step", 0))
    if extra:
        sampler.load_state_dict(extra["sampler"])
    resumed = time.time()
    where, at = _arm(args.kill, out, rank, args.kill_rank)
    record: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "attempt": current_attempt(),
        "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        "resumed_from": step,
        "started": STARTED,
        "ready": ready,
        "prepared": prepared,
        "resumed": resumed,
    }
    handle = None
    while step < args.steps:
        for inputs, targets in loader:
            with optim_wrapper.optim_context(model):
                loss = model(inputs, targets, mode="loss")["loss"]
            optim_wrapper.update_params(loss)
            sampler.advance()
            step += 1
            if "first_step" not in record:
                record["first_step"] = time.time()
                (out / f"attempt-{current_attempt()}-rank{rank}.json").write_text(
                    json.dumps(record)
                )
            (out / f"progress-rank{rank}").write_text(str(step))
            if where == "step" and step == at:
                _die(out, where)
            if step % args.save_every == 0:
                save = (
                    strategy.save_checkpoint_async if args.async_save else strategy.save_checkpoint
                )
                handle = save(
                    f"step_{step}",
                    extra={"step": step, "sampler": sampler.state_dict()},
                    keep_last=2,
                )
            if args.step_delay:
                time.sleep(args.step_delay)
            if step == args.steps:
                break
    if handle is not None and not isinstance(handle, Path):
        handle.wait()
    state = strategy.model_state_dict()
    if rank == 0:
        torch.save({"params": state, "world": world}, out / "final.pt")
    strategy.teardown()


if __name__ == "__main__":
    main()
