"""``comm-doctor``: a per-rank health table of a distributed setup.

Run it under any launcher (``torchrun``, ``srun``, ``mpirun``) or let it spawn local ranks
with ``--nproc N``. Each rank reports what it detected (launcher, backend, ranks, host,
device) and runs live checks; rank 0 prints one table with a row per rank.

Upper layers add checks without comm-core importing them: a package declares an entry
point in the group ``comm.doctor`` whose object is a callable taking no arguments and
returning an iterable of ``CheckResult``. It runs on every rank, inside the process
group, after the built-in checks.

A plugin check that fails on some ranks only must not leave the others waiting in its
collectives, so the plugins run in two steps. First every rank loads every check any rank
knows and the ranks compare: a check that some rank cannot load (a package missing on one
node) is reported as failed on every rank and run on none. Then each check runs in a
worker thread while the main thread watches the rendezvous store: a rank whose check
raised says so there, and a rank still inside that check's collective a few seconds later
gives it up. After such a failure the ranks skip the remaining plugin checks and exchange
their reports through the store, since the process group may still hold the abandoned
collective.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist

from .device import get_comm_device, get_device
from .errors import format_table
from .launcher import infer_launcher
from .process_group import destroy_dist, init_dist
from .queries import (
    get_backend,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    is_distributed,
)

__all__ = ["ENTRY_POINT_GROUP", "CheckResult", "DoctorCheck", "RankReport", "main", "run_checks"]

_POLL_S = 0.05
_ABANDON_AFTER_S = 3.0  # a rank still in a check this long after another rank failed it
_PREFIX = "comm-doctor"
_calls = [0]  # run_checks calls in this process: store keys of one call never meet another's

ENTRY_POINT_GROUP = "comm.doctor"
"""Entry-point group through which packages add doctor checks."""


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one doctor check on one rank.

    Attributes:
        name: Column name in the table, e.g. ``"all_reduce"``.
        ok: Whether the check passed.
        detail: Short text for the table cell (a time, a value, or the error).
    """

    name: str
    ok: bool
    detail: str


DoctorCheck = Callable[[], Iterable[CheckResult]]
"""A check: runs on every rank inside the process group and returns its results."""


@dataclass
class RankReport:
    """What one rank detected and how its checks went."""

    launcher: str
    backend: str
    rank: int
    world: int
    local_rank: int
    local_size: int
    host: str
    device: str
    checks: list[CheckResult] = field(default_factory=list)
    broken: bool = False

    def row(self) -> dict[str, object]:
        """Return the report as one table row."""
        row: dict[str, object] = {
            "rank": self.rank,
            "world": self.world,
            "local": f"{self.local_rank}/{self.local_size}",
            "launcher": self.launcher,
            "backend": self.backend,
            "host": self.host,
            "device": self.device,
        }
        for check in self.checks:
            row[check.name] = ("ok " if check.ok else "FAIL ") + check.detail
        return row


def _time_ms(fn: Callable[[], None], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return 1000.0 * times[len(times) // 2]


def _check_barrier() -> CheckResult:
    if not is_distributed():
        return CheckResult("barrier", True, "n/a (no process group)")
    ms = _time_ms(lambda: torch_dist.barrier())
    return CheckResult("barrier", True, f"{ms:.2f} ms")


def _check_all_reduce() -> CheckResult:
    world, rank = get_world_size(), get_rank()
    device = get_comm_device()
    expected = world * (world + 1) / 2
    tensor = torch.zeros(1, dtype=torch.float64, device=device)

    def once() -> None:
        tensor.fill_(rank + 1)
        if is_distributed():
            torch_dist.all_reduce(tensor)

    ms = _time_ms(once)
    got = float(tensor.item())
    if got != expected:
        return CheckResult("all_reduce", False, f"sum of rank+1 is {got}, expected {expected}")
    return CheckResult("all_reduce", True, f"{ms:.2f} ms")


def _load(spec: str) -> DoctorCheck:
    module_name, _, attr = spec.partition(":")
    if not attr:
        message = f"a check is named 'module:function', got {spec!r}."
        raise ValueError(message)
    check: DoctorCheck = getattr(importlib.import_module(module_name), attr)
    return check


def _check_specs(extra: Sequence[str]) -> list[tuple[str, str]]:
    """(name, 'module:function') of the plugin checks: entry points, then ``extra``."""
    specs = [(e.name, e.value) for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    return specs + [(spec, spec) for spec in extra]


def run_checks(extra: Sequence[str] = (), launcher: str | None = None) -> RankReport:
    """Build this rank's report: detected setup, built-in checks, then plugin checks.

    Args:
        extra: Additional checks as ``"module:function"`` strings.
        launcher: The launcher to report; inferred from the environment when None.

    Returns:
        This rank's ``RankReport``. ``RankReport.broken`` is True when a plugin check
        failed on some rank in a way that may leave a collective behind: the reports must
        then be exchanged through the store (``_gather_reports`` does).
    """
    report = RankReport(
        launcher=launcher or infer_launcher(),
        backend=get_backend() or "none",
        rank=get_rank(),
        world=get_world_size(),
        local_rank=get_local_rank(),
        local_size=get_local_size(),
        host=socket.gethostname(),
        device=f"{get_device()} / comm {get_comm_device()}",
    )
    _calls[0] += 1
    report.checks.append(_check_barrier())
    report.checks.append(_check_all_reduce())
    plugins = _load_everywhere(_check_specs(extra))
    for index, (name, check, failure) in enumerate(plugins):
        if failure is not None:
            report.checks.append(CheckResult(name, False, failure))
            continue
        assert check is not None
        results, broken = _run_guarded(index, name, check)
        report.checks.extend(results)
        if broken:
            report.broken = True
            for later, _, _ in plugins[index + 1 :]:
                report.checks.append(CheckResult(later, False, f"skipped: {name} failed"))
            break
    return report


def _load_everywhere(
    specs: list[tuple[str, str]],
) -> list[tuple[str, DoctorCheck | None, str | None]]:
    """Load every check any rank knows; a check some rank cannot load runs on none.

    Returns (name, check, failure) per check, in the same order on every rank; ``failure``
    says which ranks could not load it, and why.
    """
    if is_distributed():
        everyone: list[Any] = [None] * get_world_size()
        torch_dist.all_gather_object(everyone, specs)
        specs = list(dict.fromkeys(spec for rank_specs in everyone for spec in rank_specs))
    loaded: list[DoctorCheck | None] = []
    errors: list[str | None] = []
    for _, spec in specs:
        try:
            loaded.append(_load(spec))
            errors.append(None)
        except Exception as exc:
            loaded.append(None)
            errors.append(f"{type(exc).__name__}: {exc}")
    table: list[Any] = [errors]
    if is_distributed():
        table = [None] * get_world_size()
        torch_dist.all_gather_object(table, errors)
    out: list[tuple[str, DoctorCheck | None, str | None]] = []
    for index, (name, _) in enumerate(specs):
        bad = [(rank, row[index]) for rank, row in enumerate(table) if row[index] is not None]
        if not bad:
            out.append((name, loaded[index], None))
            continue
        ranks = ", ".join(str(rank) for rank, _ in bad)
        out.append((name, None, f"not loaded on rank(s) {ranks}: {bad[0][1]}"))
    return out


def _call(name: str, check: DoctorCheck) -> list[CheckResult]:
    try:
        results = list(check())
        # by their fields, not their class: run as ``python -m comm_core.doctor`` this
        # module is __main__, and the plugins' CheckResult is comm_core.doctor's
        fields = ("name", "ok", "detail")
        if not all(all(hasattr(r, f) for f in fields) for r in results):
            message = f"{name} must return CheckResult objects, got {results!r}"
            raise TypeError(message)
        return results
    except Exception as exc:
        return [CheckResult(name, False, f"{type(exc).__name__}: {exc}")]


def _run_guarded(index: int, name: str, check: DoctorCheck) -> tuple[list[CheckResult], bool]:
    """Run one plugin check; return its results and whether the ranks must stop here."""
    if not is_distributed():
        return _call(name, check), False
    store = torch_dist.distributed_c10d._get_default_store()
    rank, world = get_rank(), get_world_size()
    outcome: list[list[CheckResult]] = []
    worker = threading.Thread(target=lambda: outcome.append(_call(name, check)), daemon=True)
    worker.start()
    keys = [f"{_PREFIX}/{_calls[0]}/{index}/{r}" for r in range(world)]
    said = False
    failed_at: float | None = None
    while True:
        if not said and not worker.is_alive():
            store.set(keys[rank], "ok" if all(r.ok for r in outcome[0]) else "failed")
            said = True
        states = {r: store.get(key).decode() for r, key in enumerate(keys) if store.check([key])}
        failed = sorted(r for r, state in states.items() if state == "failed")
        if said and len(states) == world and not failed:
            return outcome[0], False
        if failed:
            failed_at = failed_at if failed_at is not None else time.monotonic()
            if said or time.monotonic() - failed_at > _ABANDON_AFTER_S:
                break
        time.sleep(_POLL_S)
    if said:
        return outcome[0], True
    ranks = ", ".join(map(str, failed))
    detail = f"abandoned: failed on rank(s) {ranks} while this rank was in its collectives"
    return [CheckResult(name, False, detail)], True


def _gather_reports(report: RankReport) -> list[RankReport]:
    if not is_distributed():
        return [report]
    if not report.broken:
        # every rank ran every check to the end: the group is clean
        reports: list[Any] = [None] * get_world_size()
        torch_dist.all_gather_object(reports, report)
        return reports
    store = torch_dist.distributed_c10d._get_default_store()
    prefix = f"{_PREFIX}/{_calls[0]}/report"
    store.set(f"{prefix}/{report.rank}", pickle.dumps(report))  # type: ignore[arg-type]
    if report.rank != 0:
        return [report]
    keys = [f"{prefix}/{r}" for r in range(get_world_size())]
    store.wait(keys)
    return [pickle.loads(store.get(key)) for key in keys]


def _rank_main(extra: Sequence[str], launcher: str) -> list[RankReport]:
    """Run the checks on one rank of a spawned world and gather every report."""
    return _gather_reports(run_checks(extra, launcher))


def _print(reports: Sequence[RankReport], json_path: str | None) -> int:
    print(format_table([r.row() for r in reports]))
    failed = [(r.rank, c) for r in reports for c in r.checks if not c.ok]
    for rank, check in failed:
        print(f"rank {rank}: check {check.name} failed: {check.detail}", file=sys.stderr)
    print(f"{len(reports)} rank(s), {len(failed)} failed check(s)")
    if json_path:
        with open(json_path, "w") as handle:
            json.dump([asdict(r) for r in reports], handle, indent=2)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``comm-doctor``; returns the exit status (1 when a check failed)."""
    parser = argparse.ArgumentParser(
        prog="comm-doctor",
        description="Print a per-rank table of the distributed setup and live checks.",
    )
    parser.add_argument("--nproc", type=int, default=0, help="spawn N local ranks (no launcher)")
    parser.add_argument("--backend", default=None, help="process-group backend (default: auto)")
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout, s")
    parser.add_argument(
        "--check", action="append", default=[], help="extra check 'module:function' (repeatable)"
    )
    parser.add_argument("--json", dest="json_path", default=None, help="also write JSON here")
    args = parser.parse_args(argv)

    launcher = infer_launcher()
    if launcher != "none":
        if args.nproc:
            parser.error(f"--nproc spawns ranks itself, but launcher {launcher!r} already did")
        init_dist(launcher, args.backend, timeout=args.timeout)
        try:
            report = run_checks(args.check, launcher)
            reports = _gather_reports(report)
            status = _print(reports, args.json_path) if get_rank() == 0 else 0
        except BaseException:
            destroy_dist()
            raise
        if report.broken:
            # a plugin's collective may still be pending in the group: destroying it could
            # wait for that collective, so leave without a teardown
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        destroy_dist()
        return status
    if args.nproc > 0:
        from comm_core import doctor  # by name: as ``python -m``, this module is __main__
        from comm_core.testing.pool import launch

        results = launch(
            doctor._rank_main,
            args.check,
            "local (comm-doctor --nproc)",
            nprocs=args.nproc,
            backend=args.backend or "gloo",
            timeout=args.timeout,
        )
        return _print(results[0], args.json_path)
    return _print([run_checks(args.check, "none")], args.json_path)


if __name__ == "__main__":
    raise SystemExit(main())
