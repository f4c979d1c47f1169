"""Start and stop the default process group, the per-node (local) groups and the CPU twins."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as torch_dist
from torch.distributed.rendezvous import rendezvous as _torch_rendezvous

from ._attempt import attempt_store
from ._exit import _teardown_at_exit
from ._store import _loopback_store
from ._twin_naming import _check_same_group_name, _members_only_naming
from .errors import AlreadyInitializedError, LauncherError, NotInitializedError
from .launcher import LAUNCHERS, LaunchEnv, current_node_key, infer_launcher, read_launch_env

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "default_backend",
    "destroy_dist",
    "get_cpu_group",
    "init_dist",
    "init_local_group",
]

DEFAULT_TIMEOUT_S = 1800.0
"""Default collective timeout in seconds without NCCL: 30 minutes, torch's default for gloo."""

_NCCL_TIMEOUT_S = 600.0  # torch's own default for nccl: a hang there surfaces in 10 minutes

_TORCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _LocalGroup:
    """The calling rank's node group, remembered with the default group it belongs to."""

    group: ClassVar[torch_dist.ProcessGroup | None] = None
    owner: ClassVar[object | None] = None
    layout: ClassVar[tuple[tuple[int, ...], ...]] = ()


def default_backend() -> str:
    """Return the backend ``init_dist`` picks when none is given: nccl with CUDA, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_dist(
    launcher: str,
    backend: str | None = None,
    *,
    timeout: float | None = None,
    port: int | None = None,
    **kwargs: Any,
) -> None:
    """Initialise the default process group from a launcher's environment.

    Sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` the same way for every launcher, selects the CUDA device of the local
    rank when the backend uses CUDA, and creates the per-node groups so that
    [`get_local_rank`][comm_core.get_local_rank] and [`get_local_size`][comm_core.get_local_size]
    are right as soon as it returns. On any failure the process group is destroyed and the
    environment restored.

    When it creates the rendezvous store itself (no ``init_method`` or ``store`` given, and
    not under torchrun, whose agent owns the store) and every rank runs on this host (the
    launcher says so, or ``MASTER_ADDR`` is a loopback address), the store listens on
    127.0.0.1 only; otherwise it listens on every interface, as torch's does.

    Restart-safe: the ranks first agree on a fresh token for this launch attempt, and the
    group keeps all its keys (torch's own set-up, comm's collectives, checkpoints and
    liveness checks) under ``comm/attempt/<token>/`` in the store. A store that outlives a
    failed attempt (torchrun's agent store under ``--max-restarts``, a ``file://`` store, a
    requeued Slurm job) then never hands the dead attempt's keys to the next one.

    Args:
        launcher: ``"pytorch"`` (torchrun), ``"slurm"`` (srun) or ``"mpi"`` (mpirun).
        backend: ``"nccl"``, ``"gloo"``, ...; None picks nccl when CUDA is usable, else gloo.
        timeout: Timeout of collectives in seconds; None: torch's defaults, 600 (10 min)
            for nccl, else `DEFAULT_TIMEOUT_S` (30 min).
        port: Rendezvous port; wins over ``MASTER_PORT`` (and over the Slurm job's port).
        **kwargs: Passed on to ``torch.distributed.init_process_group`` (e.g. ``init_method``
            or ``store``, in which case MASTER_ADDR / MASTER_PORT are not needed).

    Raises:
        LauncherError: Unknown launcher, or its environment is missing or malformed.
        AlreadyInitializedError: A default process group already exists.

    Examples:
        >>> import comm_core as dist
        >>> dist.init_dist("pytorch")  # doctest: +SKIP
    """
    if launcher not in LAUNCHERS:
        message = (
            f"init_dist: unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}. "
            f"This process's environment looks like launcher {infer_launcher()!r}."
        )
        raise LauncherError(message)
    if torch_dist.is_available() and torch_dist.is_initialized():
        message = (
            f"init_dist({launcher!r}) was called, but a default process group already exists "
            f"(rank {torch_dist.get_rank()} of {torch_dist.get_world_size()}, backend "
            f"{torch_dist.get_backend()}). Call init_dist once per process, or destroy_dist() first."
        )
        raise AlreadyInitializedError(message)
    if timeout is None:
        timeout = _default_timeout(backend or default_backend())
    if timeout <= 0:
        message = f"init_dist: timeout must be a positive number of seconds, got {timeout!r}."
        raise ValueError(message)
    need_master = "init_method" not in kwargs and "store" not in kwargs
    launch = read_launch_env(launcher, port=port, need_master=need_master)
    backend = backend or default_backend()
    saved = {name: os.environ.get(name) for name in _TORCH_ENV}
    try:
        os.environ.update(launch.as_environ())
        if _uses_cuda(backend):
            torch.cuda.set_device(_cuda_index(launch.local_rank, torch.cuda.device_count()))
        base = _base_store(kwargs, launch, timeout, need_master=need_master)
        kwargs["store"] = attempt_store(base, launch.rank, launch.world_size, timeout)
        torch_dist.init_process_group(
            backend=backend,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timedelta(seconds=timeout),
            **kwargs,
        )
        _init_local_group_by_node(launch.node_key)
        if not _moves_cpu_tensors(backend):
            get_cpu_group()  # the CPU twin of the world, while every rank is here anyway
        os.environ["LOCAL_WORLD_SIZE"] = str(torch_dist.get_world_size(_LocalGroup.group))
        if launch.local_world_size not in (None, torch_dist.get_world_size(_LocalGroup.group)):
            message = (
                f"The launcher says {launch.local_world_size} processes run on this node, but "
                f"{torch_dist.get_world_size(_LocalGroup.group)} ranks reported node "
                f"{launch.node_key!r}. Check the launcher's node layout."
            )
            raise LauncherError(message)
    except BaseException:
        destroy_dist()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        raise
    _teardown_at_exit()


def _base_store(
    kwargs: dict[str, Any], launch: LaunchEnv, timeout: float, *, need_master: bool
) -> Store:
    """The job's rendezvous store: the caller's ``store=``, or the one its ``init_method``
    (``env://`` by default) names, as torch would build it (``kwargs`` loses both keys)."""
    if "store" in kwargs:
        store: Store = kwargs.pop("store")
        return store
    if need_master:
        loopback = _loopback_store(launch, timeout)
        if loopback is not None:
            return loopback
    url = kwargs.pop("init_method", None) or "env://"
    store, _, _ = next(
        _torch_rendezvous(
            url, rank=launch.rank, world_size=launch.world_size, timeout=timedelta(seconds=timeout)
        )
    )
    store.set_timeout(timedelta(seconds=timeout))
    return store


def _default_timeout(backend: str) -> float:
    """torch's default timeout for ``backend``: 10 minutes for nccl, else 30 minutes (also for
    combined backends such as ``"cpu:gloo,cuda:nccl"``, as torch)."""
    return _NCCL_TIMEOUT_S if backend.lower() == "nccl" else DEFAULT_TIMEOUT_S


def _cuda_index(local_rank: int, visible: int) -> int:
    """The CUDA device of a local rank: its own index, or 0 when each task sees one GPU."""
    if visible <= 1:
        return 0  # e.g. one GPU per task through CUDA_VISIBLE_DEVICES
    if local_rank >= visible:
        message = (
            f"init_dist: local rank {local_rank} needs a GPU of its own, but this process sees "
            f"{visible} GPUs; two ranks on one GPU fail later in NCCL ('Duplicate GPU'). Start "
            "at most one rank per GPU on each node."
        )
        raise LauncherError(message)
    return local_rank


def _uses_cuda(backend: str) -> bool:
    return "nccl" in backend.lower() and torch.cuda.is_available()


def destroy_dist() -> None:
    """Destroy the local groups and the default process group, if any; a no-op otherwise."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    _LocalGroup.group = None
    _LocalGroup.owner = None
    _LocalGroup.layout = ()
    _cpu_twins.clear()


def _require_default_group(caller: str) -> None:
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        message = (
            f"{caller} needs an initialised default process group and there is none. "
            "Call comm_core.init_dist(launcher) first."
        )
        raise NotInitializedError(message)


def _init_local_group_by_node(node_key: str) -> None:
    """Group ranks by node key (host plus launcher node index) and create every group."""
    _require_default_group("init_local_group")
    keys: list[object] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(keys, node_key)
    order: dict[object, list[int]] = {}
    for rank, key in enumerate(keys):
        order.setdefault(key, []).append(rank)
    _create_local_groups(list(order.values()))


def init_local_group(node_rank: int | None = None, num_gpus_per_node: int | None = None) -> None:
    """Create the per-node process groups; every rank must call it.

    Every rank creates every node group in the same order, as torch requires, so this is
    correct on any number of nodes. Without arguments the nodes are found by exchanging
    host names (and the launcher's node index); with MMEngine's arguments the ranks of node
    ``i`` are ``i * num_gpus_per_node ... (i + 1) * num_gpus_per_node - 1``.

    ``init_dist`` already calls this; call it yourself only after initialising the process
    group with ``torch.distributed`` directly. A call that finds the node groups it would
    create already made for this process group returns them as they are: MMEngine-style
    code that calls it after ``init_dist`` creates no second set of groups.

    Args:
        node_rank: Index of this node (MMEngine compatibility); needs ``num_gpus_per_node``.
        num_gpus_per_node: Ranks per node when all nodes run the same number.

    Raises:
        NotInitializedError: No default process group.
        ValueError: The arguments do not describe the world.
    """
    _require_default_group("init_local_group")
    if num_gpus_per_node is None:
        if node_rank is not None:
            message = "init_local_group: node_rank needs num_gpus_per_node as well."
            raise ValueError(message)
        _init_local_group_by_node(current_node_key())
        return
    world = torch_dist.get_world_size()
    if num_gpus_per_node < 1 or world % num_gpus_per_node:
        message = (
            f"init_local_group: num_gpus_per_node={num_gpus_per_node} does not divide the world "
            f"size {world} (rank {torch_dist.get_rank()}). Call init_local_group() without "
            "arguments to find the nodes automatically, also when they run different counts."
        )
        raise ValueError(message)
    blocks = [
        list(range(start, start + num_gpus_per_node))
        for start in range(0, world, num_gpus_per_node)
    ]
    if node_rank is not None and torch_dist.get_rank() not in blocks[node_rank]:
        message = (
            f"init_local_group: rank {torch_dist.get_rank()} is not on node {node_rank} when "
            f"each node runs {num_gpus_per_node} ranks (node {node_rank} holds {blocks[node_rank]})."
        )
        raise ValueError(message)
    _create_local_groups(blocks)


def _create_local_groups(nodes: Sequence[list[int]]) -> None:
    owner = torch_dist.distributed_c10d._get_default_group()
    # Every rank knows the whole layout, so every rank takes the same branch here.
    layout = tuple(sorted(tuple(sorted(ranks)) for ranks in nodes))
    if _LocalGroup.owner is owner and _LocalGroup.layout == layout:
        return  # made already for this process group: new groups would only leak
    rank = torch_dist.get_rank()
    world = torch_dist.get_world_size()
    mine: torch_dist.ProcessGroup | None = None
    if len(nodes) == 1 and len(nodes[0]) == world:
        mine = torch_dist.group.WORLD
    else:
        for ranks in sorted(nodes, key=min):
            group = torch_dist.new_group(ranks=ranks)
            if rank in ranks:
                mine = group
    _LocalGroup.group = mine
    _LocalGroup.owner = owner
    _LocalGroup.layout = layout


def current_local_group() -> torch_dist.ProcessGroup | None:
    """Return this rank's node group if it belongs to the current default group."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return None
    if _LocalGroup.owner is not torch_dist.distributed_c10d._get_default_group():
        return None
    return _LocalGroup.group


# The gloo twins of groups whose backend cannot move CPU tensors (nccl, ...), per default
# group and member ranks. Weak keys: a destroyed default group takes its twins' entries with
# it; and a twin is used only while torch still knows it (``_twin_alive``).
_cpu_twins: weakref.WeakKeyDictionary[
    torch_dist.ProcessGroup, dict[tuple[int, ...], torch_dist.ProcessGroup]
] = weakref.WeakKeyDictionary()
_CPU_BACKENDS = ("gloo", "mpi", "ucc")


def _moves_cpu_tensors(backend: str) -> bool:
    """Whether a backend string (``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ...) covers the CPU."""
    backend = backend.lower()
    if ":" in backend:
        parts = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
        return parts.get("cpu", "") in _CPU_BACKENDS
    return backend in _CPU_BACKENDS


def _twin_alive(twin: torch_dist.ProcessGroup) -> bool:
    return twin in torch_dist.distributed_c10d._world.pg_map


def get_cpu_group(
    group: torch_dist.ProcessGroup | None = None,
) -> torch_dist.ProcessGroup | None:
    """Return a process group over the ranks of ``group`` that moves CPU tensors.

    That is ``group`` itself (None stays None: the default group) when its backend handles
    CPU tensors (``"gloo"``, ``"mpi"``, ``"cpu:gloo"``, ``"cpu:gloo,cuda:nccl"``, ...).
    Otherwise (``"nccl"``) it is a gloo twin over the same ranks, created on the first call
    and reused afterwards:

    - the default group's twin is created by every rank, like any group; ``init_dist``
      creates it when the backend cannot move CPU tensors, so later calls only look it up;
    - the twin of a smaller group is created by the members of ``group`` only (every one
      of them calls this at the same point of its program) with local synchronisation: the
      ranks outside take no part and the numbering of the groups every rank creates stays
      the same (torch 2.14 advances its group counter on the members of such a group only,
      so every later ``new_group`` would hang; comm-core leaves the counter as it was). torch
      names such a group after its ranks and a count of the creating rank (the groups it
      knows up to torch 2.13, its group counter from 2.14 on), so the members must agree on
      it; they compare the names first and raise a ValueError when they differ, instead of
      waiting for each other. Calling ``get_cpu_group(group)`` on every member right after
      creating ``group`` is safe.

    The twins belong to the default group: after [`destroy_dist`][comm_core.destroy_dist]
    (or ``torch.distributed.destroy_process_group``) and a new ``init_dist``, fresh twins
    are created.

    Args:
        group: A process group this rank belongs to; the default group when None.

    Returns:
        The group to send CPU tensors on; None in a plain process.

    Raises:
        ValueError: This rank is not a member of ``group``, or the members know different
            numbers of groups (a twin could not form).

    Examples:
        >>> get_cpu_group() is None  # a plain process has no groups
        True
    """
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return None
    if group is not None and torch_dist.get_rank(group) < 0:
        message = (
            f"get_cpu_group: global rank {torch_dist.get_rank()} is not a member of the given "
            "group; only its members may ask for its CPU twin."
        )
        raise ValueError(message)
    if _moves_cpu_tensors(str(torch_dist.get_backend(group))):
        return group
    owner = torch_dist.distributed_c10d._get_default_group()
    whole = group is None or group is torch_dist.group.WORLD or group is owner
    if whole:
        ranks = tuple(range(torch_dist.get_world_size()))
    else:
        ranks = tuple(torch_dist.get_process_group_ranks(group))
    twins = _cpu_twins.setdefault(owner, {})
    twin = twins.get(ranks)
    if twin is None or not _twin_alive(twin):
        if whole:  # the whole world's twin is made by every rank, in order, like any group
            twin = torch_dist.new_group(ranks=list(ranks), backend="gloo")
        else:  # a smaller group's by its members only
            with _members_only_naming():
                _check_same_group_name(group, ranks)
                twin = torch_dist.new_group(
                    ranks=list(ranks), backend="gloo", use_local_synchronization=True
                )
        twins[ranks] = twin
    return twin


_teardown_at_exit()  # at import: see its docstring for why this early
