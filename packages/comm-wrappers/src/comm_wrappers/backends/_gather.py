"""A full model state gathered to rank 0 one parameter at a time, straight into its place.

torch's full state dict of an FSDP model costs more than the model on the saving rank:
FSDP1 gathers every parameter on every rank and copies it (2x the model on a CPU device,
where its offload to rank 0 crashes), FSDP2 keeps a gathered copy of the parameter being
moved (1x the model plus its largest parameter). Here rank 0 allocates each full tensor
once and receives every rank's part into its slice of it: the saving rank holds the
model once, the other ranks nothing beyond their shards.

FSDP2's parts come from its sharded state dict (row slices of DTensors). FSDP1's sharded
state dict would unshard each flat parameter on every rank first (one more model for a
model wrapped as one unit), so its parts are read from each unit's local FlatParameter
shard: element ranges of the original parameters, known from torch's flat layout.

Only the plain layouts are handled (FSDP2: each parameter split along its first dimension
over one group that holds rank 0; FSDP1: FULL_SHARD, SHARD_GRAD_OP or NO_SHARD over the
whole world, at rest); anything else returns None and the caller takes torch's way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.checkpoint import state_dict as dsd

from comm_collectives import all_reduce, get_cpu_group

from ._state import quiet_torch

__all__ = ["flat_to_rank0", "rows_to_rank0"]

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


def rows_to_rank0(target: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full model state on rank 0 (``{}`` elsewhere) from the row slices of its
    sharded state dict (DTensor, ShardedTensor), or None for an unusual layout.

    Args:
        target: The module torch's state-dict functions take (FSDP1's root unit, FSDP2's
            sharded module).
    """
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return None
    with quiet_torch():
        sharded = dsd.get_model_state_dict(target)
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


# FSDP1: read each unit's FlatParameter shard directly. torch's sharded state dict of a
# FlatParameter unshards the whole unit on every rank first (a second model for one unit).


@dataclass(frozen=True)
class _Piece:
    """One original parameter: its element range in its unit's unsharded flat parameter."""

    local: torch.Tensor  # this rank's flat shard (the whole flat parameter for NO_SHARD)
    start: int
    numel: int
    shape: tuple[int, ...]
    chunk: int  # elements each group rank holds (torch.chunk's split); 0 for NO_SHARD
    ranks: tuple[int, ...]  # global rank of each group rank


_Entry = tuple[str, "_Piece | torch.Tensor"]


def _fsdp1_unit_pieces(unit: Any) -> list[_Piece] | None:
    """The pieces of one FSDP1 unit at rest, or None for a layout not read directly."""
    from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState

    handle = unit._handle
    if handle is None:
        return []
    flat = handle.flat_param
    strategy = handle._sharding_strategy.name
    if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        return None  # hybrid: a shard group without rank 0's peers
    if unit.training_state != TrainingState.IDLE:
        return None  # inside forward/backward or summon_full_params
    if handle._training_state != HandleTrainingState.IDLE or flat._shared_param_infos:
        return None
    if unit._mixed_precision_enabled_for_buffers():
        return None  # torch casts the buffers back to their own dtype on saving
    ranks = tuple(torch_dist.get_process_group_ranks(unit.process_group))
    if sorted(ranks) != list(range(torch_dist.get_world_size())):
        return None
    if unit.cpu_offload.offload_params and torch_dist.get_backend() != "gloo":
        return None
    total = sum(flat._numels_with_padding)
    sharded = strategy != "NO_SHARD"
    chunk = -(-total // len(ranks)) if sharded else 0
    if sharded:  # the local shard, resharded, no writeback pending
        shard = getattr(flat, "_local_shard", flat)  # set by the first forward's lazy init
        if not handle.is_sharded(flat) or flat.data_ptr() != shard.data_ptr():
            return None
        if flat.numel() != chunk:
            return None
    elif flat.numel() != total:
        return None
    if handle._use_orig_params and not _views_current(handle):
        return None
    pieces: list[_Piece] = []
    start = 0
    for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
        if not padding:
            shape = tuple(flat._shapes[len(pieces)])
            pieces.append(_Piece(flat.detach(), start, numel, shape, chunk, ranks))
        start += numel
    return pieces if len(pieces) == len(flat._fqns) else None


def _views_current(handle: Any) -> bool:
    """Whether each original parameter still views the flat parameter (nothing to write back)."""
    flat = handle.flat_param
    storage = flat.untyped_storage().data_ptr()
    if handle._sharding_strategy.name == "NO_SHARD":
        return all(p.untyped_storage().data_ptr() == storage for p in flat._params)
    for param, info in zip(flat._params, flat._shard_param_infos, strict=True):
        if info.in_shard and param.untyped_storage().data_ptr() != storage:
            return False
    return True


def _fsdp1_entries(root: Any) -> list[_Entry] | None:
    """Every state entry of an FSDP1 model in torch's order and names, or None."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._common_utils import clean_tensor_name
    from torch.distributed.fsdp._flat_param import FlatParameter

    wrappers = (FullyShardedDataParallel, ActivationWrapper)  # their hooks only drop prefixes

    owned: dict[int, list[tuple[str, _Piece]]] = {}
    managed: set[int] = set()
    count = 0
    for unit in root.modules():
        if not isinstance(unit, FullyShardedDataParallel):
            continue
        if unit._ignored_params:
            return None
        pieces = _fsdp1_unit_pieces(unit)
        if pieces is None:
            return None
        if not pieces:
            continue
        handle: Any = unit._handle
        flat = handle.flat_param
        managed.add(id(flat))
        managed.update(id(p) for p in flat._params or ())
        for info, piece in zip(flat._param_infos, pieces, strict=True):
            owned.setdefault(id(info.module), []).append((info.param_name, piece))
        count += len(pieces)
    entries: list[_Entry] = []
    for prefix, module in root.named_modules(remove_duplicate=False):
        if "_orig_mod" in module._modules:
            return None  # torch.compile's wrapper: torch's names drop "_orig_mod."
        own = {name for name, _ in owned.get(id(module), [])}
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in managed:
                return None  # a parameter FSDP does not manage
            if name not in own and not isinstance(param, FlatParameter):
                return None  # tied to another unit's parameter: torch names it here too
        if type(module).get_extra_state is not torch.nn.Module.get_extra_state:
            return None
        hooked = module._state_dict_hooks or module._state_dict_pre_hooks
        if hooked and not isinstance(module, wrappers):
            return None  # a hook that may rename or add entries
        dotted = f"{prefix}." if prefix else ""
        for name, piece in owned.get(id(module), []):
            entries.append((clean_tensor_name(dotted + name), piece))
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                entries.append((clean_tensor_name(dotted + name), buffer))
    names = [name for name, _ in entries]
    pieces_seen = sum(isinstance(value, _Piece) for _, value in entries)
    if len(set(names)) != len(names) or pieces_seen != count:
        return None
    return entries


def _agreed(ok: bool) -> bool:
    """Whether every rank can read its shards directly (one small all-reduce on the CPU
    group, as the checkpoint's other flags: no device sync under NCCL)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    all_reduce(flag, op="min", group=get_cpu_group())
    return bool(flag.item())


def flat_to_rank0(root: nn.Module) -> dict[str, torch.Tensor] | None:
    """FSDP1's full state on rank 0 (``{}`` elsewhere) from the units' flat shards, or
    None (agreed by every rank) for a layout not read directly."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return None
    me = torch_dist.get_rank()
    entries = _fsdp1_entries(root)
    if not _agreed(entries is not None) or entries is None:
        return None
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, value in entries:
            if isinstance(value, torch.Tensor):  # a buffer: rank 0 has it whole
                if me == 0:
                    out[name] = value.detach().cpu().clone()
            elif value.chunk == 0:  # NO_SHARD: rank 0 holds the whole flat parameter
                if me == 0:
                    span = value.local[value.start : value.start + value.numel]
                    out[name] = span.to("cpu", copy=True).view(value.shape)
            elif me == 0:
                out[name] = _receive_piece(value)
            else:
                _send_piece(value, me)
    return out


def _held(piece: _Piece, index: int) -> tuple[int, int]:
    """(offset in the parameter, element count) of the piece that group rank ``index`` holds."""
    low = max(piece.start, index * piece.chunk)
    high = min(piece.start + piece.numel, (index + 1) * piece.chunk)
    return low - piece.start, max(high - low, 0)


def _receive_piece(piece: _Piece) -> torch.Tensor:
    full = torch.empty(piece.numel, dtype=piece.local.dtype, device="cpu")
    for index, rank in enumerate(piece.ranks):
        offset, count = _held(piece, index)
        if count == 0:
            continue
        target = full[offset : offset + count]
        if rank == 0:
            begin = piece.start + offset - index * piece.chunk
            target.copy_(piece.local[begin : begin + count])
        elif piece.local.device.type == "cpu":
            torch_dist.recv(target, src=rank)
        else:  # NCCL receives on the device
            buffer = torch.empty(count, dtype=piece.local.dtype, device=piece.local.device)
            torch_dist.recv(buffer, src=rank)
            target.copy_(buffer)
    return full.view(piece.shape)


def _send_piece(piece: _Piece, me: int) -> None:
    index = piece.ranks.index(me)
    offset, count = _held(piece, index)
    if count:
        begin = piece.start + offset - index * piece.chunk
        torch_dist.send(piece.local[begin : begin + count], dst=0)
