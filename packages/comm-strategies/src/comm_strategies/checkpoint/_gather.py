"""A full model state gathered to rank 0 one parameter at a time, straight into its place.

torch's full state dict of an FSDP model costs more than the model on the saving rank:
FSDP1 gathers every parameter on every rank and copies it (2x the model on a CPU device,
where its offload to rank 0 crashes), FSDP2 keeps a gathered copy of the parameter being
moved (1x the model plus its largest parameter). Here rank 0 allocates each full tensor
once and receives every rank's rows into their slice of it: the saving rank holds the
model once, the other ranks nothing beyond their shards.

Only the plain layout is handled (each parameter split along its first dimension over
one group that holds rank 0); anything else returns None and the caller takes torch's way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist

from ._models import quiet_torch, state_target

# (global rank, first row, number of rows) of each shard of one parameter.
Rows = list[tuple[int, int, int]]


def _dtensor_rows(value: Any) -> tuple[Rows, torch.Tensor] | None:
    from torch.distributed.tensor import Shard

    placements = value.placements
    mesh = value.device_mesh
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        return None
    if mesh.ndim != 1:
        return None
    ranks = [int(r) for r in mesh.mesh.tolist()]
    count = int(value.shape[0])
    size = -(-count // len(ranks)) if count else 0  # torch.chunk's split
    rows: Rows = []
    for index, rank in enumerate(ranks):
        start = min(index * size, count)
        rows.append((rank, start, min(start + size, count) - start))
    return rows, value.to_local()


def _sharded_tensor_rows(value: Any) -> tuple[Rows, torch.Tensor] | None:
    shape = list(value.size())
    rows: Rows = []
    for shard in value.metadata().shards_metadata:
        offsets, sizes = list(shard.shard_offsets), list(shard.shard_sizes)
        if any(offsets[1:]) or sizes[1:] != shape[1:]:
            return None
        rows.append((int(shard.placement.rank()), int(offsets[0]), int(sizes[0])))
    local = value.local_shards()
    if len(local) > 1:
        return None
    tensor = local[0].tensor if local else torch.empty(0, *shape[1:], dtype=value.dtype)
    return rows, tensor


def _rows_of(value: Any) -> tuple[Rows, torch.Tensor] | None:
    if hasattr(value, "placements") and hasattr(value, "to_local"):
        return _dtensor_rows(value)
    if hasattr(value, "local_shards") and hasattr(value, "metadata"):
        return _sharded_tensor_rows(value)
    return None


def full_state_to_rank0(model: Any, kind: str) -> dict[str, torch.Tensor] | None:
    """The full model state on rank 0 (``{}`` elsewhere), or None for an unusual layout."""
    from torch.distributed.checkpoint import state_dict as dsd

    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return None
    with quiet_torch():
        sharded = dsd.get_model_state_dict(state_target(model, kind))
    plans: dict[str, tuple[Rows, torch.Tensor] | None] = {}
    for name, value in sharded.items():
        if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor:
            plan = _rows_of(value)
            if plan is None or all(rank != 0 for rank, _, _ in plan[0]):
                return None
            plans[name] = plan
        else:
            plans[name] = None
    me = torch_dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    with quiet_torch():
        for name, value in sharded.items():
            plan = plans[name]
            if plan is None:  # a replicated tensor (buffers, NO_SHARD): rank 0 has it whole
                if me == 0 and isinstance(value, torch.Tensor):
                    out[name] = value.detach().cpu().clone()
                continue
            rows, local = plan
            if me == 0:
                out[name] = _receive(value, rows, local)
            else:
                _send(rows, local, me)
    return out


def _receive(value: Any, rows: Rows, local: torch.Tensor) -> torch.Tensor:
    full = torch.empty(tuple(value.shape), dtype=local.dtype, device="cpu")
    for rank, start, count in rows:
        if count == 0:
            continue
        target = full[start : start + count]
        if rank == 0:
            target.copy_(local[:count])
        elif local.device.type == "cpu":
            torch_dist.recv(target, src=rank)
        else:  # NCCL receives on the device
            buffer = torch.empty(target.shape, dtype=local.dtype, device=local.device)
            torch_dist.recv(buffer, src=rank)
            target.copy_(buffer)
    return full


def _send(rows: Rows, local: torch.Tensor, me: int) -> None:
    for rank, _, count in rows:
        if rank == me and count:
            torch_dist.send(local[:count].contiguous(), dst=0)
