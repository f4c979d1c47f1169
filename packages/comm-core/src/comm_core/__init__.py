"""comm-core: process groups for PyTorch distributed, the same code in one process or many.

Examples:
    >>> import comm_core as dist
    >>> dist.get_dist_info()  # a plain process is a world of one
    (0, 1)
"""

from .__about__ import __version__
from .device import cast_data_device, get_comm_device, get_data_device, get_device
from .errors import (
    AlreadyInitializedError,
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    DeviceMismatchError,
    LauncherError,
    NotInitializedError,
    RankFailure,
    RemoteRankError,
)
from .launcher import LAUNCHERS, infer_launcher, parse_slurm_nodelist, slurm_job_port
from .process_group import (
    default_backend,
    destroy_dist,
    get_cpu_group,
    init_dist,
    init_local_group,
)
from .queries import (
    barrier,
    get_backend,
    get_default_group,
    get_dist_info,
    get_local_group,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_process,
    master_only,
)

__all__ = [
    "LAUNCHERS",
    "AlreadyInitializedError",
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "DeviceMismatchError",
    "LauncherError",
    "NotInitializedError",
    "RankFailure",
    "RemoteRankError",
    "__version__",
    "barrier",
    "cast_data_device",
    "default_backend",
    "destroy_dist",
    "get_backend",
    "get_comm_device",
    "get_cpu_group",
    "get_data_device",
    "get_default_group",
    "get_device",
    "get_dist_info",
    "get_local_group",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "infer_launcher",
    "init_dist",
    "init_local_group",
    "is_distributed",
    "is_main_process",
    "master_only",
    "parse_slurm_nodelist",
    "slurm_job_port",
]
