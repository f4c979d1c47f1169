"""all_reduce_dict's remembered layout signatures against keys equal across types."""

from __future__ import annotations

from typing import Any

import torch

import comm_collectives as dist
from tests.helpers import caught


def reduce_dict_equal_keys_of_other_types() -> dict[str, Any]:
    """Keys equal as Python values but of other types (True == 1 == 1.0): the layout's
    signature is derived from the keys' repr, so what a rank remembers from an earlier call
    must not stand for a later call's keys."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    # a first call where rank 0 keys by True and rank 1 by 1 (a mismatch: the signatures
    # differ) leaves each rank remembering the signature of its own keys
    first = {True if rank == 0 else 1: torch.tensor([1.0])}
    out["first"] = caught(dist.all_reduce_dict, first)[0]
    # then both ranks reduce the same dict keyed by 1
    result = {1: torch.tensor([rank + 1.0])}
    out["int_key"] = caught(dist.all_reduce_dict, result)
    out["int_value"] = {repr(k): v.tolist() for k, v in result.items()}
    return out


def test_a_remembered_signature_does_not_stand_for_keys_of_another_type(
    comm_run_distributed: Any,
) -> None:
    results = comm_run_distributed(reduce_dict_equal_keys_of_other_types, world_size=2)
    for r in results:
        assert r["first"] == "CollectiveMismatchError"
        assert r["int_key"] == ("", ""), r["int_key"]
        assert r["int_value"] == {"1": [3.0]}
