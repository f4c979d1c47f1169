"""Exit probe: init_dist, one collective, then the end of the script without destroy_dist.

Usage: exit_probe.py OUTDIR. Writes OUTDIR/rank<R>.done before exiting.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist

import comm_core as dist


def main() -> None:
    torch.set_num_threads(1)
    dist.init_dist("pytorch", timeout=60)
    total = torch.tensor([dist.get_rank() + 1.0])
    torch_dist.all_reduce(total)
    Path(sys.argv[1], f"rank{dist.get_rank()}.done").write_text(str(total.item()))
    # no destroy_dist: comm tears the group down at exit


if __name__ == "__main__":
    main()
