"""Streamed parts failing at other pickling positions raise the same error everywhere."""

from __future__ import annotations

from typing import Any

from . import stream_failure_cases


def test_stream_failures_at_other_positions(comm_run_distributed: Any) -> None:
    results = comm_run_distributed(
        stream_failure_cases.stream_failure_positions, world_size=3, timeout=120
    )
    for rank, r in enumerate(results):
        where = f"rank {rank}: {r}"
        for step, ranks, text in (
            ("last", [2], "this object refuses to be pickled"),
            ("late_and_travelling", [1, 2], "this object refuses to be pickled"),
            ("after_buffers", [1], "this object refuses to be pickled"),
            ("opaque", [1], "opaque failure"),
            ("opaque_early", [1], "opaque failure"),
        ):
            assert r[f"{step}_next"] is True, (step, where)
            assert r[step]["raised"] == "RemoteRankError", (step, where)
            assert r[step]["ranks"] == ranks, (step, where)
            assert text in r[step]["text"], (step, where)
