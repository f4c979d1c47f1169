"""FSDP1's full state gathered to rank 0 from the flat shards, against torch's full state dict."""

from __future__ import annotations

from typing import Any

import pytest

from . import gather_cases as cases


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp1_flat_shards_equal_torch_full_state(comm_pools: Any, world: int) -> None:
    """Bit for bit, every strategy x auto-wrap x use_orig_params (+ activation checkpointing).

    The fast path was taken each time (not torch's state dict).
    """
    results = comm_pools.get(world).run(cases.fast_path_matches_torch, timeout=240)
    assert len(results[0]) == 13
    for key, (taken, mismatches, count) in results[0].items():
        assert taken, key
        assert mismatches == [], key
        # 9 parameters, "scale" and 3 BatchNorm buffers; "scratch" is not persistent
        assert count == 13, key
    for rank_results in results[1:]:
        assert all(taken and got == {} for taken, got, _ in rank_results.values())


def test_fsdp1_layouts_it_does_not_read_return_none(comm_pools: Any) -> None:
    [*results] = comm_pools.get(2).run(cases.refused_layouts, timeout=120)
    for result in results:
        assert result == {
            "summoned": None,
            "buffers in low precision": None,
            "a state-dict hook": None,
            "a compiled submodule": None,
            "a weight tied across units": None,
            "after refusals, a layout it reads": "a state",
        }


def test_fsdp1_refused_layouts_still_save_under_torchs_names(comm_pools: Any) -> None:
    # The fallback (rows of the sharded state dict) gives torch's names and values: no
    # "_orig_mod." in a compiled submodule's names, the tied weight under both names.
    results = comm_pools.get(2).run(cases.compiled_and_tied_full_saves, timeout=120)
    assert results[0] == {"compiled": [], "tied": []}
