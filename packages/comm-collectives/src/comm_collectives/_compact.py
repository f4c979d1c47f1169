"""The compact exchange of large worlds, and the byte model of the handshake.

Gathering every rank's frame costs each rank ``(W - 1) * (256 + capacity)`` bytes. Above
``COMPACT_ABOVE`` ranks every call therefore starts with one all-reduce (max) of the
header and its negation: when maxima and minima agree, all headers are equal and no rank
failed, and a call whose headers must be equal stops there.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as torch_dist

from comm_core import get_world_size

from ._capacity import starting_capacity
from ._faults import transport
from ._frame import (
    DEBUG_BIT,
    DEBUG_WORD,
    HEADER_BYTES,
    SIGNIFICANT_WORDS,
    STATUS_WORD,
    WIDTH,
    Header,
    Peer,
    decode,
)

__all__ = ["COMPACT_ABOVE", "compact_vote", "handshake_bytes", "uses_compact_vote"]

# Above this world size, calls whose headers must be equal use the compact exchange.
COMPACT_ABOVE = 64


def uses_compact_vote(world: int) -> bool:
    """Whether a call in a world of ``world`` ranks starts with the compact exchange."""
    return world > COMPACT_ABOVE


def compact_vote(
    header: Header, group: torch_dist.ProcessGroup | None, device: torch.device
) -> list[Peer] | None:
    """Every rank's header when all are equal and no rank failed, else None."""
    header.inline = -1
    words = header.encode()[:SIGNIFICANT_WORDS]
    vector = torch.tensor(words + [-w for w in words], dtype=torch.int64).to(device)
    with transport(header.operation, group):
        torch_dist.all_reduce(vector, torch_dist.ReduceOp.MAX, group=group)
    both = vector.tolist()
    high, low = both[: len(words)], [-w for w in both[len(words) :]]
    # a difference, a failure, debug mode
    if high != low or high[STATUS_WORD] != 0 or high[DEBUG_WORD] & DEBUG_BIT:
        return None
    peer = decode(0, high + [0] * (WIDTH - len(high)))
    return [dataclasses.replace(peer, rank=rank) for rank in range(get_world_size(group))]


def handshake_bytes(world: int, *, varying: bool = False, capacity: int | None = None) -> int:
    """Bytes one rank receives in the handshake of one call (the byte model of the docs).

    Args:
        world: World size.
        varying: Whether the call needs every rank's header (all_gather, gather, the object
            collectives, collect_results); False for all_reduce, broadcast, all_reduce_dict,
            all_reduce_params, sync_random_seed.
        capacity: The group's inline capacity; its starting value when None.

    Returns:
        Bytes received per rank. The compact exchange all-reduces the header's 27 words and
        their negations (432 bytes); the model takes the costlier of the usual algorithms
        for a buffer that small, recursive doubling: ``ceil(log2 W) * 432``. Otherwise an
        all-gather brings every other rank's frame: ``(W - 1) * (256 + capacity)``.
    """
    if world <= 1:
        return 0
    vote = 0
    if uses_compact_vote(world):
        vote = (world - 1).bit_length() * 2 * 8 * SIGNIFICANT_WORDS
        if not varying:
            return vote
    if capacity is None:
        capacity = starting_capacity(world)
    return vote + (world - 1) * (HEADER_BYTES + capacity)
