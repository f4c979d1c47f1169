"""Exit probe: init_dist, a collective and a DDP model kept to the end, then the end of the
script without destroy_dist.

Usage: exit_probe.py OUTDIR [torch]. Writes OUTDIR/rank<R>.done before exiting and
OUTDIR/rank<R>.atexit from an exit handler of its own that uses the group. With
``torch`` the group is made by ``torch.distributed.init_process_group`` (as MMEngine's
Runner makes it) and comm only sees it afterwards.
"""

from __future__ import annotations

import atexit
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as torch_dist

import comm_core as dist


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[2:] == ["torch"]:  # comm_core is imported: its exit teardown is registered
        torch_dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    else:
        dist.init_dist("pytorch", timeout=60)
    # before any comm call: comm must not depend on being called to get its order right
    atexit.register(_last_words, Path(sys.argv[1]), torch_dist.get_rank())
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


def _last_words(folder: Path, rank: int) -> None:
    """A script's own exit handler, registered after comm's: it runs first and may still
    use the group (a final all-reduce), as atexit runs handlers in reverse order."""
    total = torch.tensor([1.0])
    torch_dist.all_reduce(total)
    Path(folder, f"rank{rank}.atexit").write_text(str(total.item()))


if __name__ == "__main__":
    main()
