"""Read what a launcher (torchrun, Slurm, MPI) tells a process about its place in the job.

Nothing here touches ``torch.distributed``: these functions turn environment variables
into a checked ``LaunchEnv``, which [`init_dist`][comm_core.init_dist] then applies.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import LauncherError

__all__ = [
    "DEFAULT_PORT",
    "LAUNCHERS",
    "LaunchEnv",
    "infer_launcher",
    "parse_slurm_nodelist",
    "read_launch_env",
    "slurm_job_port",
]

LAUNCHERS = ("pytorch", "slurm", "mpi")
"""The launchers [`init_dist`][comm_core.init_dist] accepts."""

DEFAULT_PORT = 29500
"""torch's customary rendezvous port, used when nothing else gives one."""

# Ports derived from a Slurm job id stay below Linux's ephemeral range (32768+).
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 15000
_STEP_STRIDE = 7919  # a prime: the ports of consecutive steps land far apart

# (rank, size, local rank, local size) variables of the MPI implementations. None gives a
# node index (Open MPI's OMPI_COMM_WORLD_NODE_RANK is a per-process rank), so MPI ranks are
# grouped into nodes by host name.
_MPI_VARIABLES: tuple[tuple[str, str, str, str], ...] = (
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    (
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)


@dataclass(frozen=True)
class LaunchEnv:
    """A process's place in a job, as its launcher described it.

    Attributes:
        launcher: ``"pytorch"``, ``"slurm"`` or ``"mpi"``.
        rank: Global rank.
        world_size: Number of processes in the job.
        local_rank: Rank among the processes of this node.
        local_world_size: Processes on this node, or None when the launcher does not say.
        master_addr: Host of the rendezvous store, or None with an explicit ``init_method``.
        master_port: Port of the rendezvous store, or None with an explicit ``init_method``.
        node_key: Identifies this node (host name plus the launcher's node index), so that
            two node agents on one host still form two nodes.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str | None
    master_port: int | None
    node_key: str

    def as_environ(self) -> dict[str, str]:
        """Return the torch environment variables this launch implies."""
        environ = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
        }
        if self.local_world_size is not None:
            environ["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.master_addr is not None:
            environ["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            environ["MASTER_PORT"] = str(self.master_port)
        return environ


def infer_launcher(environ: Mapping[str, str] | None = None) -> str:
    """Guess which launcher started this process from its environment.

    torchrun's variables win (torchrun may itself run under Slurm); ``mpirun``'s per-process
    variables win over Slurm's, which a batch script's ``mpirun`` inherits.

    Args:
        environ: The environment to read; ``os.environ`` when None.

    Returns:
        ``"pytorch"``, ``"mpi"``, ``"slurm"`` or ``"none"``.

    Examples:
        >>> infer_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
        'slurm'
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env):
        return "pytorch"
    if any(v[0] in env for v in _MPI_VARIABLES[:2]):
        return "mpi"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return "slurm"
    if any(v[0] in env for v in _MPI_VARIABLES[2:]):
        return "mpi"
    return "none"


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``"gpu-[01-03,7],cpu9"`` into host names.

    Supports several bracket groups per name (``"r[1-2]n[1-2]"``), zero-padded ranges and
    single values; the order of the list is kept.

    Args:
        nodelist: The compressed list, e.g. the value of ``SLURM_NODELIST``.

    Returns:
        The host names, e.g. ``["gpu-01", "gpu-02", "gpu-03", "gpu-7", "cpu9"]``.

    Raises:
        LauncherError: The list is empty, has unbalanced brackets or a bad range.

    Examples:
        >>> parse_slurm_nodelist("gpu-[01-03,7],cpu9")
        ['gpu-01', 'gpu-02', 'gpu-03', 'gpu-7', 'cpu9']
    """
    text = nodelist.strip()
    if not text:
        raise _bad_nodelist(nodelist, "it is empty")
    hosts: list[str] = []
    for item in _split_top_level(text, nodelist):
        hosts.extend(_expand_host(item, nodelist))
    return hosts


def _split_top_level(text: str, original: str) -> list[str]:
    items: list[str] = []
    depth = 0
    start = 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise _bad_nodelist(original, f"nested '[' at position {index}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _bad_nodelist(original, f"unmatched ']' at position {index}")
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth != 0:
        raise _bad_nodelist(original, "a '[' is never closed")
    items.append(text[start:])
    for item in items:
        if not item.strip():
            raise _bad_nodelist(original, "an empty host name between commas")
    return [item.strip() for item in items]


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_host(item: str, original: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        if any(c.isspace() for c in item):
            raise _bad_nodelist(original, f"white space inside host name {item!r}")
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    values: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise _bad_nodelist(original, f"{part!r} in '[{body}]' is not a number or a range")
        low_text, high_text = match.group(1), match.group(2)
        if high_text is None:
            values.append(low_text)
            continue
        low, high = int(low_text), int(high_text)
        if low > high:
            raise _bad_nodelist(original, f"range {part!r} runs backwards")
        width = len(low_text)
        values.extend(str(n).zfill(width) for n in range(low, high + 1))
    suffixes = _expand_host(rest, original) if rest else [""]
    return [prefix + value + suffix for value in values for suffix in suffixes]


def _bad_nodelist(nodelist: str, problem: str) -> LauncherError:
    message = (
        f"Cannot parse the Slurm node list {nodelist!r}: {problem}. Expected a list such as "
        "'gpu-[01-03,7],cpu9'. Set MASTER_ADDR to the first host yourself to bypass parsing."
    )
    return LauncherError(message)


def slurm_job_port(job_id: str | int, step_id: int = 0) -> int:
    """Derive a rendezvous port from a Slurm job id, so two jobs on one node differ.

    The port lies in 15000-29999, below Linux's ephemeral port range. The step id (from
    ``SLURM_STEP_ID``) separates concurrent steps of one job on one node.

    Args:
        job_id: ``SLURM_JOB_ID``.
        step_id: ``SLURM_STEP_ID``; 0 for the first step.

    Returns:
        ``15000 + (job_id + 7919 * step_id) % 15000``.

    Examples:
        >>> slurm_job_port(123456)
        18456
        >>> slurm_job_port(123456, step_id=1)
        26375
    """
    job = _parse_int("SLURM_JOB_ID", str(job_id))
    return _SLURM_PORT_BASE + (job + _STEP_STRIDE * step_id) % _SLURM_PORT_SPAN


def read_launch_env(
    launcher: str,
    *,
    port: int | None = None,
    environ: Mapping[str, str] | None = None,
    need_master: bool = True,
) -> LaunchEnv:
    """Read and check the environment a launcher set for this process.

    Args:
        launcher: ``"pytorch"``, ``"slurm"`` or ``"mpi"``.
        port: Rendezvous port chosen by the caller; wins over ``MASTER_PORT``.
        environ: The environment to read; ``os.environ`` when None.
        need_master: Whether ``MASTER_ADDR`` / ``MASTER_PORT`` are required (False when the
            caller passes its own ``init_method`` or store).

    Returns:
        The checked ``LaunchEnv``.

    Raises:
        LauncherError: Unknown launcher, or a variable is missing or malformed.
    """
    env = os.environ if environ is None else environ
    if launcher == "pytorch":
        return _read_pytorch(env, port, need_master)
    if launcher == "slurm":
        return _read_slurm(env, port)
    if launcher == "mpi":
        return _read_mpi(env, port, need_master)
    message = (
        f"Unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}. "
        f"The environment of this process looks like launcher {infer_launcher(env)!r} "
        "(see comm_core.infer_launcher())."
    )
    raise LauncherError(message)


def _parse_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        message = f"Environment variable {name} must be an integer, got {value!r}."
        raise LauncherError(message) from None


def _require(env: Mapping[str, str], name: str, launcher: str, hint: str) -> int:
    if name not in env:
        message = (
            f"Launcher {launcher!r} needs environment variable {name}, which is not set. {hint}"
        )
        raise LauncherError(message)
    return _parse_int(name, env[name])


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    return _parse_int(name, env[name]) if name in env else None


def _master(
    env: Mapping[str, str], launcher: str, port: int | None, default_port: int | None, hint: str
) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        message = f"Launcher {launcher!r} needs MASTER_ADDR (the host of rank 0), which is not set. {hint}"
        raise LauncherError(message)
    if port is None:
        port = _optional_int(env, "MASTER_PORT")
    if port is None:
        port = DEFAULT_PORT if default_port is None else default_port
    if not 0 < port < 65536:
        message = f"The rendezvous port must lie in 1-65535, got {port}."
        raise LauncherError(message)
    return addr, port


def _check_ranks(
    launcher: str, rank: int, world: int, local_rank: int, local_size: int | None
) -> None:
    problems = []
    if world < 1:
        problems.append(f"world size {world} is below 1")
    if not 0 <= rank < max(world, 1):
        problems.append(f"rank {rank} is outside 0..{world - 1}")
    if local_rank < 0:
        problems.append(f"local rank {local_rank} is negative")
    if local_size is not None and not 0 <= local_rank < local_size:
        problems.append(f"local rank {local_rank} is outside 0..{local_size - 1}")
    if local_size is not None and local_size > world:
        problems.append(f"local size {local_size} exceeds world size {world}")
    if problems:
        message = (
            f"The {launcher!r} launcher environment is inconsistent: {'; '.join(problems)}. "
            "Check how the job was started."
        )
        raise LauncherError(message)


def _read_pytorch(env: Mapping[str, str], port: int | None, need_master: bool) -> LaunchEnv:
    hint = (
        "Start the script with torchrun, or export RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
    )
    rank = _require(env, "RANK", "pytorch", hint)
    world = _require(env, "WORLD_SIZE", "pytorch", hint)
    local_rank = _optional_int(env, "LOCAL_RANK")
    local_size = _optional_int(env, "LOCAL_WORLD_SIZE")
    if local_rank is None:
        local_rank = rank if world == 1 or local_size is None else rank % local_size
    _check_ranks("pytorch", rank, world, local_rank, local_size)
    addr: str | None = None
    master_port: int | None = None
    if need_master:
        addr, master_port = _master(env, "pytorch", port, None, hint)
    node = env.get("GROUP_RANK", env.get("NODE_RANK", ""))
    return LaunchEnv(
        "pytorch", rank, world, local_rank, local_size, addr, master_port, _node_key(node)
    )


def _read_slurm(env: Mapping[str, str], port: int | None) -> LaunchEnv:
    hint = "Start the processes with srun (sbatch alone runs one task)."
    rank = _require(env, "SLURM_PROCID", "slurm", hint)
    world = _require(env, "SLURM_NTASKS", "slurm", hint)
    local_rank = _require(env, "SLURM_LOCALID", "slurm", hint)
    node_id = env.get("SLURM_NODEID", "")
    local_size = _slurm_local_size(env, node_id)
    _check_ranks("slurm", rank, world, local_rank, local_size)
    environ = dict(env)
    if not environ.get("MASTER_ADDR"):
        # the step's nodes first: a step on part of the job (srun -w, --relative) may not
        # start on the job's first node
        nodelist = (
            env.get("SLURM_STEP_NODELIST")
            or env.get("SLURM_NODELIST")
            or env.get("SLURM_JOB_NODELIST")
        )
        if not nodelist:
            message = (
                "Launcher 'slurm' needs SLURM_STEP_NODELIST, SLURM_NODELIST or "
                "SLURM_JOB_NODELIST to find the host of rank 0, and none is set. Export "
                "MASTER_ADDR yourself to bypass it."
            )
            raise LauncherError(message)
        environ["MASTER_ADDR"] = parse_slurm_nodelist(nodelist)[0]
    job_id = env.get("SLURM_JOB_ID")
    step_id = env.get("SLURM_STEP_ID", "")
    step = int(step_id) if step_id.isdigit() and int(step_id) < _SLURM_PORT_SPAN else 0
    default_port = slurm_job_port(job_id, step) if job_id else None
    addr, master_port = _master(environ, "slurm", port, default_port, hint)
    return LaunchEnv(
        "slurm", rank, world, local_rank, local_size, addr, master_port, _node_key(node_id)
    )


_TASKS_PER_NODE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _slurm_local_size(env: Mapping[str, str], node_id: str) -> int | None:
    """Tasks on this node from ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec or not node_id.isdigit():
        return None
    counts: list[int] = []
    for part in spec.split(","):
        match = _TASKS_PER_NODE.match(part.strip())
        if match is None:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    index = int(node_id)
    return counts[index] if index < len(counts) else None


def _read_mpi(env: Mapping[str, str], port: int | None, need_master: bool) -> LaunchEnv:
    for names in _MPI_VARIABLES:
        if names[0] in env:
            break
    else:
        message = (
            "Launcher 'mpi' found none of OMPI_COMM_WORLD_RANK, MV2_COMM_WORLD_RANK, PMI_RANK "
            "or PMIX_RANK. Start the script with mpirun / mpiexec."
        )
        raise LauncherError(message)
    rank_var, size_var, local_var, local_size_var = names
    hint = f"mpirun normally sets it; check that the job was started by mpirun ({rank_var} is set)."
    rank = _require(env, rank_var, "mpi", hint)
    world = _require(env, size_var, "mpi", hint)
    local_rank = _require(env, local_var, "mpi", hint)
    local_size = _optional_int(env, local_size_var)
    _check_ranks("mpi", rank, world, local_rank, local_size)
    addr: str | None = None
    master_port: int | None = None
    if need_master:
        addr, master_port = _master(
            env,
            "mpi",
            port,
            None,
            "MPI does not tell where rank 0 runs: export MASTER_ADDR=<host of rank 0> and "
            "forward it, e.g. `mpirun -x MASTER_ADDR=node01 -x MASTER_PORT=29500 ...`.",
        )
    return LaunchEnv("mpi", rank, world, local_rank, local_size, addr, master_port, _node_key(""))


def current_node_key(environ: Mapping[str, str] | None = None) -> str:
    """Return the node key of this process as its launcher describes it (host name if none).

    Used by [`init_local_group`][comm_core.init_local_group] when it is called without
    arguments after the process group was created by ``torch.distributed`` directly.
    """
    env = os.environ if environ is None else environ
    launcher = infer_launcher(env)
    if launcher != "none":
        try:
            return read_launch_env(launcher, environ=env, need_master=False).node_key
        except LauncherError:
            pass
    return _node_key("")


def _node_key(node_index: str) -> str:
    host = socket.gethostname()
    return f"{host}#{node_index}" if node_index else host
