"""Launcher probe: init_dist under a real launcher, then record what each rank sees.

Usage: probe.py LAUNCHER OUTDIR. Writes OUTDIR/rank<R>.json on every rank.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as torch_dist

import comm_core as dist


def main() -> None:
    launcher, outdir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    inferred = dist.infer_launcher()
    dist.init_dist(launcher, timeout=60)
    rank, world = dist.get_dist_info()
    local_group = dist.get_local_group()
    members = [None] * dist.get_local_size()
    torch_dist.all_gather_object(members, rank, group=local_group)
    total = torch.tensor([rank + 1.0])
    torch_dist.all_reduce(total)
    record = {
        "inferred": inferred,
        "rank": rank,
        "world": world,
        "local_rank": dist.get_local_rank(),
        "local_size": dist.get_local_size(),
        "local_members": members,
        "backend": dist.get_backend(),
        "sum": total.item(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "SLURM_JOB_ID",
                "SLURM_NODELIST",
            )
        },
    }
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    dist.barrier()
    dist.destroy_dist()


if __name__ == "__main__":
    main()
