"""A persistent world of N real local ranks that runs module-level functions on request.

The ranks are fresh interpreters (``python -m comm_core.testing._worker``, so the caller's
``__main__`` is never re-imported) joined by a gloo process group whose rendezvous is a
``FileStore`` in a private temporary folder: no port is opened for the store, and on Linux
gloo is bound to the loopback interface (``GLOO_SOCKET_IFNAME=lo``, set for the ranks
even when the caller's environment names another interface). Every call is bounded by a timeout; a failed
call reports the traceback of every failed rank and the stack of every stuck one, then
restarts the world so the next call starts clean.
"""

from __future__ import annotations

import faulthandler
import multiprocessing.connection
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

__all__ = ["PoolCache", "RankReport", "RanksFailedError", "WorldPool", "launch"]

_GRACE_AFTER_FAILURE_S = 5.0
_STACK_WAIT_S = 1.0


@dataclass(frozen=True)
class RankReport:
    """How one rank ended a call that did not succeed everywhere.

    Attributes:
        rank: The rank.
        state: ``"ok"``, ``"error"`` (raised), ``"died"`` (process exited) or ``"stuck"``.
        detail: The traceback (error), exit code (died) or stack dump (stuck).
    """

    rank: int
    state: str
    detail: str


class RanksFailedError(AssertionError):
    """A function run on a [`WorldPool`][comm_core.testing.WorldPool] failed or hung on some rank.

    Attributes:
        reports: One [`RankReport`][comm_core.testing.RankReport] per rank, in rank order.
    """

    def __init__(self, function: str, world_size: int, reports: list[RankReport]) -> None:
        self.reports = reports
        # Ranks that raised or died come first: the ranks stuck waiting on them are only
        # the consequence, and a log cut short should still show the cause.
        bad = sorted(
            (r for r in reports if r.state != "ok"), key=lambda r: (r.state == "stuck", r.rank)
        )
        head = ", ".join(f"rank {r.rank} {r.state}" for r in bad)
        lines = [f"{function} failed in a world of {world_size}: {head}"]
        for report in bad:
            lines.append(f"======== rank {report.rank}: {report.state} ========")
            lines.append(report.detail.rstrip())
        super().__init__("\n".join(lines))


def _worker_main(conn: Connection) -> None:
    """Entry point of one rank: join the world, then run calls until told to stop."""
    config = conn.recv()
    rank, world_size = config["rank"], config["world_size"]
    sys.path[:] = config["sys_path"]
    os.environ.update(config["env"])
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
        }
    )
    if sys.platform.startswith("linux"):
        # the ranks are all here: gloo on the loopback interface, whatever the caller's
        # environment says (clusters often set GLOO_SOCKET_IFNAME to ib0 or eth0)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    stack_file = open(config["stack_path"], "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        import torch

        torch.set_num_threads(1)
        from comm_core.process_group import destroy_dist, init_dist

        init_dist(
            "pytorch",
            config["backend"],
            timeout=config["pg_timeout"],
            init_method=f"file://{config['store_path']}",
        )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            except Exception:  # e.g. the function cannot be imported here
                conn.send(("error", traceback.format_exc()))
                continue
            if message is None:
                return
            function, args, kwargs = message
            try:
                result = function(*args, **kwargs)
                conn.send(("ok", result))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        destroy_dist()


class WorldPool:
    """N local ranks in a gloo process group that stay alive between calls.

    Args:
        world_size: Number of ranks.
        backend: Backend of the process group (gloo on CPU machines).
        timeout: Default bound, in seconds, on one [`run`][comm_core.testing.WorldPool.run].
        start_timeout: Bound on spawning the ranks and joining the process group.
        pg_timeout: Timeout of the process group's own collectives.
        env: Extra environment variables for the ranks.

    Examples:
        >>> import comm_core
        >>> with WorldPool(2) as pool:  # the ranks start at the first run
        ...     pool.run(comm_core.get_rank)
        ...     pool.run(comm_core.get_world_size)  # the same two ranks
        [0, 1]
        [2, 2]
    """

    def __init__(
        self,
        world_size: int = 2,
        *,
        backend: str = "gloo",
        timeout: float = 60.0,
        start_timeout: float = 120.0,
        pg_timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if world_size < 1:
            message = f"WorldPool: world_size must be at least 1, got {world_size}."
            raise ValueError(message)
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.pg_timeout = pg_timeout
        self.env = dict(env or {})
        self._processes: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._folder: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> WorldPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def started(self) -> bool:
        """Whether the ranks are running."""
        return bool(self._processes)

    def start(self) -> None:
        """Spawn the ranks and wait until all joined the process group."""
        if self.started:
            return
        self._folder = tempfile.mkdtemp(prefix="comm-world-")  # private: mode 0700
        store_path = os.path.join(self._folder, "store")
        for rank in range(self.world_size):
            parent_sock, child_sock = socket.socketpair()
            process = subprocess.Popen(
                [sys.executable, "-m", "comm_core.testing._worker", str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
            )
            child_sock.close()
            conn = Connection(parent_sock.detach())
            conn.send(
                {
                    "rank": rank,
                    "world_size": self.world_size,
                    "sys_path": list(sys.path),
                    "env": self.env,
                    "stack_path": self._stack_path(rank),
                    "store_path": store_path,
                    "backend": self.backend,
                    "pg_timeout": self.pg_timeout,
                }
            )
            self._processes.append(process)
            self._conns.append(conn)
        states, details = self._collect(self.start_timeout)
        if any(state != "ready" for state in states):
            reports = self._reports(states, details, ok_state="ready")
            self._stop(stuck=[r.rank for r in reports if r.state == "stuck"])
            raise RanksFailedError("starting the world", self.world_size, reports)

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and remove the private folder."""
        self._stop(stuck=())

    def _stop(self, stuck: Collection[int]) -> None:
        """Stop the ranks; those in ``stuck`` (blocked, they would not read a stop message)
        are killed at once instead of after the 5 s a rank gets to leave by itself."""
        for rank in stuck:
            if rank < len(self._processes) and self._processes[rank].poll() is None:
                self._processes[rank].kill()
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for process in self._processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5.0)
        for conn in self._conns:
            conn.close()
        self._processes = []
        self._conns = []
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def restart(self) -> None:
        """Stop the ranks and start a fresh world."""
        self.close()
        self.start()

    # ------------------------------------------------------------------ calls
    def run(
        self, function: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``function(*args, **kwargs)`` on every rank and return the results by rank.

        ``function`` must be importable by the ranks (defined at module level) and its
        arguments and result picklable.

        Args:
            function: The module-level function to run.
            *args: Positional arguments, the same on every rank.
            timeout: Bound on the call in seconds; the pool's default when None.
            **kwargs: Keyword arguments, the same on every rank.

        Returns:
            The return values, index = rank.

        Raises:
            RanksFailedError: A rank raised, died or did not finish in time; the world is
                restarted before the next call.
        """
        self.start()
        bound = self.timeout if timeout is None else timeout
        for conn in self._conns:
            conn.send((function, args, kwargs))
        states, details = self._collect(bound)
        if all(state == "ok" for state in states):
            return details
        reports = self._reports(states, details, ok_state="ok")
        self._stop(stuck=[r.rank for r in reports if r.state == "stuck"])
        name = getattr(function, "__qualname__", repr(function))
        raise RanksFailedError(name, self.world_size, reports)

    def _collect(self, timeout: float) -> tuple[list[str], list[Any]]:
        """Wait for one message from every rank, within ``timeout``."""
        n = self.world_size
        states = ["stuck"] * n
        details: list[Any] = [""] * n
        pending = set(range(n))
        deadline = time.monotonic() + timeout
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            waitables = [self._conns[r] for r in pending]
            ready = multiprocessing.connection.wait(waitables, timeout=deadline - now)
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn in ready or conn.poll():
                    try:
                        state, payload = conn.recv()
                    except (EOFError, OSError):
                        state, payload = "died", self._exit_text(rank)
                else:
                    continue
                states[rank], details[rank] = state, payload
                pending.discard(rank)
                if state not in ("ok", "ready"):
                    # Ranks blocked on the failed one get a short grace, then count as stuck.
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        if pending:
            self._dump_stacks(sorted(pending), details)
        return states, details

    def _exit_text(self, rank: int) -> str:
        try:
            code: int | None = self._processes[rank].wait(2.0)
        except subprocess.TimeoutExpired:
            code = None
        return f"process exited with code {code} without reporting a result"

    def _dump_stacks(self, ranks: list[int], details: list[Any]) -> None:
        for rank in ranks:
            if self._processes[rank].poll() is None:
                self._processes[rank].send_signal(signal.SIGUSR1)
        time.sleep(_STACK_WAIT_S)
        for rank in ranks:
            try:
                with open(self._stack_path(rank)) as handle:
                    stack = handle.read().strip()
            except OSError:
                stack = ""
            details[rank] = "did not finish within the timeout; its stack:\n" + (
                stack or "(no stack dumped)"
            )

    def _stack_path(self, rank: int) -> str:
        assert self._folder is not None
        return os.path.join(self._folder, f"stack-{rank}.txt")

    def _reports(self, states: list[str], details: list[Any], ok_state: str) -> list[RankReport]:
        return [
            RankReport(
                rank, "ok" if state == ok_state else state, "" if state == ok_state else str(detail)
            )
            for rank, (state, detail) in enumerate(zip(states, details))
        ]


def launch(
    function: Callable[..., Any],
    *args: Any,
    nprocs: int = 2,
    backend: str = "gloo",
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Start ``nprocs`` local ranks, run ``function`` on each, stop them, return the results.

    For notebooks, demos and scripts; tests should keep a
    [`WorldPool`][comm_core.testing.WorldPool] instead.

    Args:
        function: A module-level function; it runs inside an initialised process group.
        *args: Positional arguments for every rank.
        nprocs: Number of ranks.
        backend: Process-group backend.
        timeout: Bound on the whole call in seconds.
        env: Extra environment variables for the ranks.
        **kwargs: Keyword arguments for every rank.

    Returns:
        The return values, index = rank.

    Examples:
        >>> import comm_core
        >>> from comm_core.testing import launch
        >>> launch(comm_core.get_dist_info, nprocs=2)  # (rank, world size) of each rank
        [(0, 2), (1, 2)]
    """
    with WorldPool(nprocs, backend=backend, timeout=timeout, env=env) as pool:
        return pool.run(function, *args, **kwargs)


class PoolCache:
    """World pools keyed by world size, closed together."""

    def __init__(self) -> None:
        self._pools: dict[int, WorldPool] = {}

    def get(self, world_size: int) -> WorldPool:
        """Return the pool of ``world_size`` ranks, creating it on first use."""
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = WorldPool(world_size)
        return pool

    def close(self) -> None:
        """Stop every pool."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
