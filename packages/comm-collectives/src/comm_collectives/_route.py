"""Where the handshake's headers, votes and error reports travel.

A group whose communication device is not the CPU (nccl) exchanges them on a CPU side
group, so reading them never waits for the device: the data stays on the device and the
host keeps running ahead.
"""

from __future__ import annotations

import os
import time
import weakref

import torch
import torch.distributed as torch_dist

from comm_core import get_comm_device, get_cpu_group

from ._watch import wait_collective

__all__ = [
    "SPIN_SECONDS",
    "all_gather_flat",
    "gather_rows",
    "header_route",
    "settle",
    "side_channel",
    "twins",
]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; the packages support >= 2.4.
all_gather_flat = (
    getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor
)


def gather_rows(
    out: torch.Tensor,
    mine: torch.Tensor,
    group: torch_dist.ProcessGroup | None,
    *,
    async_op: bool = False,
    copies: torch.Tensor | None = None,
) -> torch_dist.Work | None:
    """Every rank's flat ``mine`` into ``out`` (world times its size), in rank order.

    On the CPU this is an all-to-all of ``mine`` repeated once per rank (in ``copies``, a
    scratch tensor of ``out``'s size and dtype, when given): gloo moves it pairwise, where
    its all-gather passes the rows along a ring. Measured on two loopback ranks bound to one
    core each: a 64 MiB all-gather about 150 ms against 35 ms, copy included; a 4 KiB
    handshake frame in front of a 32 MB reduce adds 1.6 ms as an all-gather, 0.2 ms as an
    all-to-all. Other devices all-gather (nccl's is the fast one there).
    """
    handle: torch_dist.Work | None
    if out.device.type != "cpu":
        handle = all_gather_flat(out, mine, group=group, async_op=async_op)
        return handle
    world = out.numel() // max(1, mine.numel())
    if copies is None:
        copies = torch.empty_like(out)
    copies.view(world, -1).copy_(mine.view(1, -1).expand(world, -1))
    handle = torch_dist.all_to_all_single(out, copies, group=group, async_op=async_op)
    return handle


# How long a rank polls a small exchange (a handshake, a vote) before it blocks on it.
SPIN_SECONDS = 0.002

_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


def settle(
    work: torch_dist.Work,
    operation: str,
    group: torch_dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Wait for ``work``, a small exchange on ``group`` that the data waits behind.

    The rank polls it for up to ``SPIN_SECONDS``, giving its core away between polls, then
    blocks on it as torch's ``wait`` does, watched (``_watch.wait_collective``): a rank that
    left the call after a transport error does not leave this one waiting for the process
    group's timeout. A blocked thread is woken only after the backend's thread has
    signalled it and the scheduler has run it again; polling saves that hand-over on the
    critical path, where a collective's data waits for the frames. Measured on two loopback
    gloo ranks bound to a core each: a 4 KiB all-to-all in front of a 32 MB scatter cost
    1.04-1.14x the bare scatter blocked, 0.98-1.09x polled (4 runs of 60 pairs each);
    polling without giving the core away was 1.4x, because gloo's own threads need that core.
    """
    deadline = time.perf_counter() + SPIN_SECONDS
    try:
        while not work.is_completed() and time.perf_counter() < deadline:
            _yield()
    except RuntimeError:  # the work failed: its wait raises the backend's error
        pass
    wait_collective(work, operation, group, device)


# None: automatic; True forces the CPU route, False keeps the headers on the communication
# device. The tests run the nccl layout on gloo with True and comm-core's hook that makes
# gloo count as a backend without CPU support (``comm_core.process_group._CPU_BACKENDS =
# ()``), so the side group is a real twin distinct from the group.
side_channel: bool | None = None

# The gloo twins comm_collectives.new_group made for groups of a backend without CPU
# support: the headers of every call on such a group travel on its twin.
twins: weakref.WeakKeyDictionary[torch_dist.ProcessGroup, torch_dist.ProcessGroup] = (
    weakref.WeakKeyDictionary()
)


def header_route(
    group: torch_dist.ProcessGroup | None,
) -> tuple[torch_dist.ProcessGroup | None, torch.device]:
    """The group and the device the handshake of a call on ``group`` uses."""
    device = get_comm_device(group)
    use = side_channel if side_channel is not None else device.type != "cpu"
    if not use:
        return group, device
    side = _side_group(group)
    if side is None:  # a pure nccl subgroup: no CPU group of its members
        return group, device
    return side, torch.device("cpu")


def _has_cpu_backend(pg: torch_dist.ProcessGroup) -> bool:
    try:
        pg._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False
    return True


def _side_group(group: torch_dist.ProcessGroup | None) -> torch_dist.ProcessGroup | None:
    """The CPU group that carries the headers of ``group``; None when there is none.

    For the default group that is [`get_cpu_group`][comm_core.get_cpu_group]'s twin, the
    same gloo group of every rank that ``collect_results`` moves its parts on (``init_dist``
    creates it under nccl; otherwise the first call on the default group does, on every
    rank), or the default group itself when its backend moves CPU tensors.

    A subgroup uses its own CPU backend when it has one ("cpu:gloo,cuda:nccl"). A pure nccl
    subgroup keeps its headers on the device: its twin would be made by its members only,
    with local synchronisation, and torch names such a group after the number of groups
    each member knows, which differs when ranks made different subgroups before (as
    ``get_cpu_group`` explains). ``collect_results`` may raise a clear error then, but a
    plain collective must not fail because of the groups a rank made earlier.
    """
    c10d = torch_dist.distributed_c10d
    default = c10d._get_default_group()
    pg = default if group is None or group is torch_dist.group.WORLD else group
    if pg is not default:
        twin = twins.get(pg)
        if twin is not None and twin in c10d._world.pg_map:
            return twin
        return pg if _has_cpu_backend(pg) else None
    twin = get_cpu_group(None)
    return default if twin is None else twin
