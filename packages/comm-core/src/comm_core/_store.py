"""The rendezvous store on 127.0.0.1 that ``init_dist`` creates when every rank runs here."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from torch._C._distributed_c10d import TCPStore  # torch.distributed.TCPStore (not in its stubs)

from .errors import LauncherError
from .launcher import LaunchEnv

_LOOPBACK_NAMES = ("localhost", "::1")


def _is_loopback(host: str | None) -> bool:
    return host is not None and (host.startswith("127.") or host in _LOOPBACK_NAMES)


def _loopback_store(launch: LaunchEnv, timeout: float) -> TCPStore | None:
    """The rendezvous store on 127.0.0.1, when every rank runs here; None otherwise.

    torch's own store listens on every interface. Under torchrun the agent has created the
    store already (``TORCHELASTIC_USE_AGENT_STORE``) and the ranks only connect to it.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    all_here = launch.local_world_size is not None and launch.local_world_size == launch.world_size
    if not (all_here or _is_loopback(launch.master_addr)):
        return None
    port = int(launch.master_port or 0)
    wait = timedelta(seconds=timeout)
    if launch.rank != 0:
        return TCPStore("127.0.0.1", port, launch.world_size, False, wait)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(max(128, launch.world_size))
    except OSError as exc:
        listener.close()
        message = (
            f"init_dist: rank 0 cannot listen on 127.0.0.1:{port} for the rendezvous "
            f"({exc}). Another job may use the port: set MASTER_PORT (or port=) to a free one."
        )
        raise LauncherError(message) from exc
    # the store takes the listening socket over; it closes it when it is destroyed
    return TCPStore(
        "127.0.0.1", port, launch.world_size, True, wait, master_listen_fd=listener.detach()
    )
