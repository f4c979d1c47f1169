"""Name the CPU twin of a smaller group, made by its members only, alike on every member."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as torch_dist

from .device import get_comm_device

# Added to torch's group counter while a twin is made by its members only: the twin's name
# (salted with the counter from torch 2.14 on) then lies apart from the names of the groups
# every rank creates.
_TWIN_COUNT_OFFSET = 1 << 40


@contextlib.contextmanager
def _members_only_naming() -> Iterator[None]:
    """Leave torch's group counter as it was around the creation of a members-only group.

    torch names a group created with local synchronisation after its ranks and a salt: the
    number of groups the creating rank knows up to torch 2.13, the group counter from torch
    2.14 on. torch 2.14 also advances that counter for such a group, on its members only;
    the next group every rank creates (named after the counter) then gets one name on the
    members and another on the others, and ``new_group`` waits under both names until the
    timeout. The counter is restored afterwards, so making a twin leaves the numbering of
    every rank's groups as it was; the twin is named from the counter plus an offset, apart
    from every name the counter gives.
    """
    world = torch_dist.distributed_c10d._world
    count = world.group_count
    world.group_count = count + _TWIN_COUNT_OFFSET
    try:
        yield
    finally:
        world.group_count = count


def _check_same_group_name(group: torch_dist.ProcessGroup | None, ranks: tuple[int, ...]) -> None:
    """Raise on every member when the members would give the twin different names.

    The name torch gives a group created with local synchronisation comes from its ranks
    and a count of the creating rank (``_members_only_naming``); members that disagree on it
    would wait for each other under different names until the timeout. The members compare
    the names (a digest of each) before creating the twin.
    """

    c10d = torch_dist.distributed_c10d
    name = str(c10d._hash_ranks_to_str(list(ranks)))
    known = len(c10d._world.pg_names)
    made = c10d._world.group_count - _TWIN_COUNT_OFFSET
    mine = torch.tensor(
        [int(name[:15], 16), known, made], dtype=torch.int64, device=get_comm_device(group)
    )
    rows = [torch.zeros_like(mine) for _ in ranks]
    torch_dist.all_gather(rows, mine, group=group)
    table = [[int(v) for v in row.tolist()] for row in rows]
    if len({row[0] for row in table}) > 1:
        listed = ", ".join(
            f"rank {r}: {row[1]} known, group counter {row[2]}" for r, row in zip(ranks, table)
        )
        message = (
            f"get_cpu_group: the members of group {list(ranks)} know different process "
            f"groups ({listed}), so torch would give their CPU twin different names "
            "and they would wait for each other. Create the groups, and call collect_results "
            "or get_cpu_group on them, in the same order on every member; or call "
            "get_cpu_group(group) on every member right after creating the group."
        )
        raise ValueError(message)
