"""The inline capacity: how many payload bytes a rank may put in its handshake frame.

The capacity belongs to the group and adapts: every rank announces how many bytes it
wanted to inline, and after each exchange every rank applies the same rule to the same
table (grow to the largest wish plus an eighth, in 4 KiB steps, within a budget that
shrinks with the world size; halve after a run of calls that used a quarter of it or
less). Frames therefore stay equal in size on every rank without any extra message. The
growth stays close to the data because frame size matters: on loopback gloo a 128 KiB
all-gather costs 40% more than a 70 KiB one.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as torch_dist

from comm_core import get_world_size

__all__ = [
    "InlineState",
    "capacity_state",
    "inline_capacity",
    "inline_limit",
    "starting_capacity",
]

# Inline payloads: a group starts at _BASE_INLINE bytes a rank and may grow up to
# min(_MAX_INLINE, _INLINE_BUDGET // world), so a frame of a large world stays small.
_BASE_INLINE = 4096
_MAX_INLINE = 256 * 1024
_INLINE_BUDGET = 1024 * 1024
_SHRINK_AFTER = 32


def _maximum(world: int) -> int:
    """The largest capacity of a group of ``world`` ranks (a multiple of 64 bytes)."""
    return max(64, min(_MAX_INLINE, _INLINE_BUDGET // world) // 64 * 64)


def starting_capacity(world: int) -> int:
    """The capacity a group of ``world`` ranks starts with."""
    return min(_BASE_INLINE, _maximum(world))


@dataclass
class InlineState:
    """The inline capacity of one group; equal on every rank (see the module docstring)."""

    capacity: int
    maximum: int
    quiet: int = 0

    def update(self, wanted: int) -> None:
        """Apply the rule to the largest number of bytes a rank wanted to inline."""
        if self.capacity < wanted <= self.maximum:
            self.capacity = min(self.maximum, _round_up(wanted + wanted // 8))
            self.quiet = 0
        elif wanted * 4 <= self.capacity and self.capacity > min(_BASE_INLINE, self.maximum):
            self.quiet += 1
            if self.quiet >= _SHRINK_AFTER:
                floor = min(_BASE_INLINE, self.maximum)
                self.capacity = max(floor, min(self.capacity, _round_up(self.capacity // 2)))
                self.quiet = 0
        else:
            self.quiet = 0


def _round_up(n: int, grain: int = 4096) -> int:
    return (n + grain - 1) // grain * grain


# weak keys: a destroyed group's state goes with the group
_states: weakref.WeakKeyDictionary[torch_dist.ProcessGroup, InlineState] = (
    weakref.WeakKeyDictionary()
)


def capacity_state(group: torch_dist.ProcessGroup | None) -> InlineState:
    """The inline state of ``group`` (the default group when None), created on first use."""
    key = group
    if key is None or key is torch_dist.group.WORLD:
        key = torch_dist.distributed_c10d._get_default_group()
    state = _states.get(key)
    if state is None:
        world = get_world_size(group)
        state = _states[key] = InlineState(starting_capacity(world), _maximum(world))
    return state


def inline_capacity(group: torch_dist.ProcessGroup | None = None) -> int:
    """Bytes a rank can send inside the next handshake frame on ``group``."""
    return capacity_state(group).capacity


@contextlib.contextmanager
def inline_limit(maximum: int, group: torch_dist.ProcessGroup | None = None) -> Iterator[None]:
    """Cap the inline capacity of ``group`` inside the block (0: no data travels inline).

    The tests use it to run every collective's long path as well. Every rank of the group
    must enter and leave the block at the same point of its program, or the frames of the
    ranks differ in size.
    """
    state = capacity_state(group)
    saved = (state.capacity, state.maximum, state.quiet)
    state.maximum = max(0, maximum)
    state.capacity = min(state.capacity, state.maximum)
    try:
        yield
    finally:
        state.capacity, state.maximum, state.quiet = saved
