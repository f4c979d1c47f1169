"""A plain PyTorch training loop that runs unchanged under every comm strategy.

    python examples/train_loop.py --strategy single
    torchrun --nproc-per-node 2 examples/train_loop.py --strategy ddp   # or fsdp, fsdp2, deepspeed
    torchrun --nproc-per-node 4 examples/train_loop.py --strategy model_parallel  # dp 2 x tp 2

The strategy places and wraps the model and builds the optimizer over the wrapped
parameters; the loop only calls ``optim_wrapper.update_params(loss)``. Each rank trains on
its share of every global batch of the handwritten digits shipped with comm-strategies
(under ``model_parallel``, the ranks of one tensor-parallel group share one share: the
data-parallel coordinates pick it, not the world rank).

With ``--work-dir DIR`` it saves a checkpoint every ``--save-every`` steps (in the
background, the newest two kept) and, at start, resumes from the latest complete one: run
it under ``torchrun --max-restarts 3 ...`` and a rank that dies costs only the steps since
the last checkpoint, at whatever world size the restart has. `ElasticSampler` keeps the
position in the data, so the restarted run sees the same global batches.
"""

from __future__ import annotations

import argparse

from torch.utils.data import DataLoader, TensorDataset

import comm_collectives as dist
from comm_strategies import ElasticSampler, build_strategy
from comm_strategies.demo import TRAIN_SIZE, DigitsNet, digits_plan, load_digits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--strategy", default="single", help="single|ddp|fsdp|fsdp2|deepspeed|model_parallel"
    )
    parser.add_argument(
        "--tensor-parallel", type=int, default=2, help="model_parallel: tensor-parallel ranks"
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--work-dir", default=None, help="checkpoints; resume from the latest")
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args(argv)

    options = {}
    if args.strategy == "model_parallel":  # the digits net's plan; FSDP2 over the rest
        options = {"parallelize_fn": digits_plan, "tensor_parallel_size": args.tensor_parallel}
    strategy = build_strategy(args.strategy, seed=0, work_dir=args.work_dir, **options)
    strategy.setup_env()  # the process group, then the seed: the model's init is seeded too
    model, optim_wrapper, schedulers = strategy.prepare(
        DigitsNet(),
        optim_wrapper={"type": "OptimWrapper", "optimizer": {"type": "AdamW", "lr": 2e-3}},
        param_scheduler={"type": "CosineAnnealingLR", "T_max": args.steps},
    )
    # The data goes where the strategy put the model (the GPU under nccl, else the CPU).
    device = next(model.parameters()).device
    images, labels = (t.to(device) for t in load_digits())
    # Which share of each global batch: the data-parallel coordinates where the strategy
    # has them (tensor-parallel ranks of one group must see the same batch), else the rank.
    rank = getattr(strategy, "data_parallel_rank", strategy.rank)
    world = getattr(strategy, "data_parallel_world_size", strategy.world_size)
    sampler = ElasticSampler(TRAIN_SIZE, args.batch_size, seed=0, rank=rank, world_size=world)
    train = TensorDataset(images[:TRAIN_SIZE], labels[:TRAIN_SIZE])
    loader = DataLoader(train, sampler=sampler, batch_size=sampler.micro_batch_size)
    step, saving = 0, None
    if args.work_dir is not None:  # after a restart: the latest checkpoint and its position
        extra = strategy.resume(missing_ok=True)
        if extra:
            step = extra["step"]
            sampler.load_state_dict(extra["sampler"])
            if strategy.rank == 0:
                print(f"resumed from step {step}")
    while step < args.steps:
        for inputs, targets in loader:  # this rank's share of the next global batch
            with optim_wrapper.optim_context(model):  # no gradient sync when accumulating
                loss = model(inputs, targets, mode="loss")["loss"]
            optim_wrapper.update_params(loss)  # backward, (clip), step, zero_grad
            for scheduler in schedulers:
                scheduler.step()
            sampler.advance()  # one global batch consumed: the position the checkpoint keeps
            if step % 10 == 0 or step == args.steps - 1:
                mean = loss.detach().clone()
                dist.all_reduce(mean, op="mean")  # in place
                if strategy.rank == 0:
                    print(f"step {step:3d}  loss {float(mean):.4f}")
            step += 1
            if args.work_dir is not None and step % args.save_every == 0:
                extra = {"step": step, "sampler": sampler.state_dict()}
                saving = strategy.save_checkpoint_async(f"step_{step}", extra=extra, keep_last=2)
            if step == args.steps:
                break
    if saving is not None:
        saving.wait()  # the last checkpoint is complete (or this raises on every rank)
    strategy.teardown()


if __name__ == "__main__":
    main()
