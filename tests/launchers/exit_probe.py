"""Exit probe: init_dist, a collective and a DDP model kept to the end, then the end of the
script without destroy_dist.

Usage: exit_probe.py OUTDIR [torch]. Writes OUTDIR/rank<R>.done before exiting. With
``torch`` the group is made by ``torch.distributed.init_process_group`` (as MMEngine's
Runner makes it) and comm only sees it afterwards.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as torch_dist

import comm_core as dist


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[2:] == ["torch"]:
        torch_dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        dist.is_distributed()  # comm sees the group (every comm call checks for one)
    else:
        dist.init_dist("pytorch", timeout=60)
    total = torch.tensor([dist.get_rank() + 1.0])
    torch_dist.all_reduce(total)
    # a DDP model alive to the end, as a training script keeps it
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)]
    MODELS.append(torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers)))
    optimizer = torch.optim.SGD(MODELS[0].parameters(), lr=0.1)
    for _ in range(3):
        MODELS[0](torch.randn(4, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    Path(sys.argv[1], f"rank{dist.get_rank()}.done").write_text(str(total.item()))
    # no destroy_dist: comm tears the group down at exit


MODELS: list[torch.nn.Module] = []


if __name__ == "__main__":
    main()
