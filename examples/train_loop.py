"""A plain PyTorch training loop that runs unchanged under every comm strategy.

    python examples/train_loop.py --strategy single
    torchrun --nproc-per-node 2 examples/train_loop.py --strategy ddp   # or fsdp, fsdp2, deepspeed
    torchrun --nproc-per-node 4 examples/train_loop.py --strategy model_parallel  # dp 2 x tp 2

The strategy places and wraps the model and builds the optimizer over the wrapped
parameters; the loop only calls ``optim_wrapper.update_params(loss)``. Each rank trains on
its share of every global batch of the handwritten digits shipped with comm-strategies
(under ``model_parallel``, the ranks of one tensor-parallel group share one share: the
data-parallel coordinates pick it, not the world rank).
"""

from __future__ import annotations

import argparse

import torch

import comm_collectives as dist
from comm_strategies import build_strategy
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
    args = parser.parse_args(argv)

    options = {}
    if args.strategy == "model_parallel":  # the digits net's plan; FSDP2 over the rest
        options = {"parallelize_fn": digits_plan, "tensor_parallel_size": args.tensor_parallel}
    strategy = build_strategy(args.strategy, seed=0, **options)
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
    generator = torch.Generator().manual_seed(0)  # the same batches on every rank
    for step in range(args.steps):
        batch = torch.randint(TRAIN_SIZE, (args.batch_size,), generator=generator)[rank::world]
        with optim_wrapper.optim_context(model):  # skips the gradient sync when accumulating
            loss = model(images[batch], labels[batch], mode="loss")["loss"]
        optim_wrapper.update_params(loss)  # backward, (clip), step, zero_grad
        for scheduler in schedulers:
            scheduler.step()
        if step % 10 == 0 or step == args.steps - 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean, op="mean")  # in place
            if strategy.rank == 0:
                print(f"step {step:3d}  loss {float(mean):.4f}")
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
