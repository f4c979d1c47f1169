"""comm-doctor: the per-rank table, its JSON, and checks added from outside comm-core."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from comm_core import doctor

ROOT = Path(__file__).resolve().parents[2]


def _doctor(*args: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], list[dict]]:  # type: ignore[type-arg]
    out = tmp_path / "doctor.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "comm_core.doctor", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_doctor_spawns_ranks_and_prints_a_row_per_rank(tmp_path: Path) -> None:
    proc, reports = _doctor(
        "--nproc", "3", "--check", "tests.core.kit_helpers:custom_check", tmp_path=tmp_path
    )
    assert [r["rank"] for r in reports] == [0, 1, 2]
    for rank, report in enumerate(reports):
        assert report["world"] == 3
        assert (report["local_rank"], report["local_size"]) == (rank, 3)
        assert report["backend"] == "gloo"
        assert report["launcher"] == "local (comm-doctor --nproc)"
        checks = {c["name"]: c for c in report["checks"]}
        assert checks["barrier"]["ok"]
        assert checks["all_reduce"]["ok"]
        assert checks["custom"]["detail"] == f"rank {rank} says hello"
    assert "3 rank(s), 0 failed check(s)" in proc.stdout
    header = proc.stdout.splitlines()[0].split()
    assert header[:7] == ["rank", "world", "local", "launcher", "backend", "host", "device"]
    assert {"barrier", "all_reduce", "custom"} <= set(header)


def test_doctor_in_a_plain_process(tmp_path: Path) -> None:
    # run as a script (__main__), as under a launcher: a plugin's CheckResult still counts
    _, reports = _doctor("--check", "tests.core.kit_helpers:custom_check", tmp_path=tmp_path)
    assert len(reports) == 1
    assert (reports[0]["rank"], reports[0]["world"], reports[0]["backend"]) == (0, 1, "none")
    names = [c["name"] for c in reports[0]["checks"]]
    if importlib.metadata.entry_points(group=doctor.ENTRY_POINT_GROUP):
        # the upper layers are installed too (the newest-torch environment holds them all):
        # their checks come between comm-core's and the one named on the command line
        assert names[:2] == ["barrier", "all_reduce"]
        assert names[-1] == "custom"
        assert len(names) > 3
    else:
        assert names == ["barrier", "all_reduce", "custom"]
    assert all(c["ok"] for c in reports[0]["checks"])


def test_a_failing_plugin_check_is_reported_not_raised() -> None:
    report = doctor.run_checks(["tests.core.kit_helpers:rank_times_ten"])
    # rank_times_ten returns an int, not an iterable of CheckResult: reported as a failure
    failed = [c for c in report.checks if not c.ok]
    assert [c.name for c in failed] == ["tests.core.kit_helpers:rank_times_ten"]
    assert "TypeError" in failed[0].detail


def test_a_plugin_failing_on_one_rank_is_reported_by_every_rank_not_hung(tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable, "-m", "comm_core.doctor", "--nproc", "2", "--timeout", "60",
            "--check", "tests.core.missing_on_rank_one:check",
            "--check", "tests.core.kit_helpers:fails_on_rank_zero_before_its_collective",
            "--check", "tests.core.kit_helpers:custom_check",
            "--json", str(out),
        ],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr  # failed checks, not a hang
    reports = json.loads(out.read_text())
    assert [r["rank"] for r in reports] == [0, 1]
    for rank, report in enumerate(reports):
        checks = {c["name"]: c for c in report["checks"]}
        assert checks["barrier"]["ok"]
        assert checks["all_reduce"]["ok"]
        missing = checks["tests.core.missing_on_rank_one:check"]
        assert not missing["ok"]
        assert missing["detail"].startswith("not loaded on rank(s) 1: ModuleNotFoundError")
        failing = checks["tests.core.kit_helpers:fails_on_rank_zero_before_its_collective"]
        assert not failing["ok"]
        if rank == 0:
            assert failing["detail"] == "RuntimeError: deliberate failure before the collective"
        else:
            assert failing["detail"] == (
                "abandoned: failed on rank(s) 0 while this rank was in its collectives"
            )
        assert checks["tests.core.kit_helpers:custom_check"] == {
            "name": "tests.core.kit_helpers:custom_check",
            "ok": False,
            "detail": "skipped: tests.core.kit_helpers:fails_on_rank_zero_before_its_collective"
            " failed",
        }
    assert "2 rank(s), 6 failed check(s)" in proc.stdout
