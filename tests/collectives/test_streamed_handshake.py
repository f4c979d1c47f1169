"""A streamed part's handshake travels while its sender pickles: every header route and
combined failures raise the same error on every rank, and the group stays usable."""

from __future__ import annotations

from typing import Any

import pytest

from . import streamed_cases

MODES = ["plain", "compact", "side", "debug"]


@pytest.mark.parametrize("mode", MODES)
def test_streamed_parts_under_every_route(comm_run_distributed: Any, mode: str) -> None:
    results = comm_run_distributed(streamed_cases.streamed_matrix, mode, world_size=3, timeout=120)
    assert results[0]["ok"] == {"raised": "", "ranks": None, "value": True}
    assert [r["ok"]["raised"] for r in results] == ["", "", ""]
    for rank, r in enumerate(results):
        where = f"rank {rank}: {r}"
        for step in ("ok", "announcing", "both", "mismatch"):
            assert r[f"{step}_next"] is True, where
        assert r["announcing"]["raised"] == "RemoteRankError", where
        assert r["announcing"]["ranks"] == [2], where
        assert "this object refuses to be pickled" in r["announcing"]["text"], where
        # the handshake saw rank 1's failure first: that is the error of every rank
        assert r["both"]["raised"] == "RemoteRankError", where
        assert r["both"]["ranks"] == [1], where
        assert r["mismatch"]["raised"] == "CollectiveMismatchError", where
        assert "tmpdir" in r["mismatch"]["text"], where
        if mode == "debug":
            assert "call site" in r["mismatch"]["text"], where
    # the inline capacities stay equal on every rank
    assert results[0]["ok_states"] == results[1]["ok_states"] == results[2]["ok_states"]
    assert results[0]["end_states"] == results[1]["end_states"] == results[2]["end_states"]
