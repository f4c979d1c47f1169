"""all_reduce_dict's remembered layout signatures against keys equal across types."""

from __future__ import annotations

from typing import Any

from . import cases


def test_a_remembered_signature_does_not_stand_for_keys_of_another_type(
    comm_run_distributed: Any,
) -> None:
    results = comm_run_distributed(cases.reduce_dict_equal_keys_of_other_types, world_size=2)
    for r in results:
        assert r["first"] == "CollectiveMismatchError"
        assert r["int_key"] == ("", ""), r["int_key"]
        assert r["int_value"] == {"1": [3.0]}
