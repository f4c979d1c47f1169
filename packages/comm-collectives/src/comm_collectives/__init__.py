"""comm-collectives: collectives that fail on every rank together, and the comm-core API.

``import comm_collectives as dist`` replaces ``mmengine.dist``.

Examples:
    >>> import comm_collectives as dist
    >>> dist.all_gather_object({"rank": dist.get_rank()})  # a world of one
    [{'rank': 0}]
"""

from comm_core import *  # noqa: F403 - the whole comm-core API is part of this one
from comm_core import __all__ as _core_all

from .__about__ import __version__
from ._agree import agree
from ._barrier import barrier  # type: ignore[assignment]  # checked, with async_op
from ._buffers import empty_cache
from ._modes import debug_enabled, debug_mode, unchecked
from ._store import rendezvous
from .coalesced import all_reduce_dict, all_reduce_params
from .groups import new_group
from .objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from .p2p import irecv, isend, recv, recv_object_list, send, send_object_list
from .results import collect_results, collect_results_cpu, collect_results_gpu
from .rooted import reduce, scatter
from .tensors import all_gather, all_reduce, broadcast, gather, sync_random_seed
from .work import Work

Work.__module__ = __name__  # reprs and docs show the public path

__all__ = [
    *[name for name in _core_all if name not in ("__version__", "barrier")],
    "Work",
    "__version__",
    "agree",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_dict",
    "all_reduce_params",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "collect_results",
    "collect_results_cpu",
    "collect_results_gpu",
    "debug_enabled",
    "debug_mode",
    "empty_cache",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "new_group",
    "recv",
    "recv_object_list",
    "reduce",
    "rendezvous",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "sync_random_seed",
    "unchecked",
]
