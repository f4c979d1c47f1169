"""The public every-rank steps: rendezvous (a bounded exchange of strings through the store)
and agree (every rank raises when any rank failed), on real gloo worlds."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from comm_collectives import _route, _store
from comm_core import CommTimeoutError, RemoteRankError, process_group
from comm_core.testing import WorldPool

# A FileStore (the test kit's store) ends its wait on a whole second: up to 1 s late.
STORE_SLACK_S = 1.5

# "/data/café-R" written in Latin-1: the byte 0xE9 is not UTF-8, as in a path read from disk
NOT_UTF8 = b"/data/caf\xe9-".decode("utf-8", "surrogateescape")


def rendezvous_values(key: str) -> dict[str, Any]:
    """Rank-dependent strings on the world, a string that is not UTF-8, and a subgroup of
    the first and the last rank (group ranks 0 and 1)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    out["plain"] = dist.rendezvous(f"{key}/plain", f"rank {rank} " * (rank + 1), timeout=3.0)
    out["bytes"] = [
        s.encode("utf-8", "surrogateescape")
        for s in dist.rendezvous(f"{key}/bytes", f"{NOT_UTF8}{rank}", timeout=3.0)
    ]
    ends = torch_dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        out["ends"] = dist.rendezvous(f"{key}/ends", f"end {rank}", timeout=3.0, group=ends)
    torch_dist.destroy_process_group(ends)
    return out


def test_rendezvous_returns_every_ranks_value_by_rank(comm_run_distributed: Any) -> None:
    key = f"test/{uuid.uuid4().hex}"
    for rank, r in enumerate(comm_run_distributed(rendezvous_values, key, world_size=3)):
        assert r["plain"] == ["rank 0 ", "rank 1 rank 1 ", "rank 2 rank 2 rank 2 "]
        assert r["bytes"] == [b"/data/caf\xe9-0", b"/data/caf\xe9-1", b"/data/caf\xe9-2"]
        if rank in (0, 2):
            assert r["ends"] == ["end 0", "end 2"]  # index = rank in the group
        else:
            assert "ends" not in r


def rendezvous_without_a_rank(key: str, timeout: float, withdraw: bool) -> dict[str, Any]:
    """Every rank but the last calls; what they raised, how fast, and whether the key stays."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == world - 1:
        return {}
    start = time.monotonic()
    try:
        dist.rendezvous(key, f"v{rank}", timeout=timeout, withdraw_on_timeout=withdraw)
    except CommTimeoutError as exc:
        seconds = time.monotonic() - start
        mine_left = _store.default_store().check([f"{key}/{rank}"])
        return {
            "message": str(exc),
            "missing": exc.missing,  # type: ignore[attr-defined]
            "seconds": seconds,
            "mine_left": mine_left,
        }
    return {"message": "returned"}


@pytest.mark.parametrize("withdraw", [False, True])
def test_a_rank_that_does_not_call_rendezvous_is_named_within_the_timeout(
    comm_run_distributed: Any, withdraw: bool
) -> None:
    key = f"test/{uuid.uuid4().hex}"
    timeout = 1.0
    results = comm_run_distributed(rendezvous_without_a_rank, key, timeout, withdraw)
    r = results[0]
    assert r["missing"] == [1]
    assert timeout - 0.05 <= r["seconds"] < timeout + STORE_SLACK_S
    assert "rank(s) 1 did not post within 1 s" in r["message"]
    assert repr(key) in r["message"]
    assert "Every rank of the group must call rendezvous" in r["message"]
    assert "raise the timeout" in r["message"]
    assert r["mine_left"] is (not withdraw)
    assert results[1] == {}


def arrive_after_the_give_up(key: str) -> dict[str, Any]:
    """Rank 0 gives the exchange up after 1 s (its key stays: no withdrawal); rank 1 arrives
    at 2 s and finds every key posted. It must raise, not go on alone with rank 0 gone."""
    out: dict[str, Any] = {}
    if dist.get_rank() == 1:
        time.sleep(2.0)
    try:
        out["values"] = dist.rendezvous(
            key, f"v{dist.get_rank()}", timeout=1.0 + 4.0 * dist.get_rank()
        )
    except CommTimeoutError as exc:
        out["message"] = str(exc)
        out["missing"] = exc.missing  # type: ignore[attr-defined]
    return out


def test_a_rank_arriving_after_another_gave_up_raises_instead_of_going_on_alone(
    comm_run_distributed: Any,
) -> None:
    key = f"test/{uuid.uuid4().hex}"
    first, late = comm_run_distributed(arrive_after_the_give_up, key)
    assert first["missing"] == [1]
    assert "values" not in late, late  # before the compare-and-set it returned both values
    assert "another rank's timeout ran out first" in late["message"]
    assert late["missing"] == [0]


def alone_then_together(key: str) -> dict[str, Any]:
    """Rank 0 calls alone and withdraws at its timeout; then both ranks call with the same
    key (a call number given back): the exchange starts afresh and completes."""
    out: dict[str, Any] = {}
    if dist.get_rank() == 0:
        with pytest.raises(CommTimeoutError):
            dist.rendezvous(key, "alone", timeout=0.5, withdraw_on_timeout=True)
    dist.barrier()
    out["values"] = dist.rendezvous(key, f"v{dist.get_rank()}", timeout=5.0)
    return out


def test_a_key_withdrawn_at_a_timeout_serves_the_next_exchange(comm_run_distributed: Any) -> None:
    key = f"test/{uuid.uuid4().hex}"
    for result in comm_run_distributed(alone_then_together, key):
        assert result["values"] == ["v0", "v1"]


@pytest.mark.parametrize("timeout", [0, -1.0, math.inf, math.nan, "3"])
def test_rendezvous_and_agree_reject_a_timeout_that_bounds_nothing(timeout: Any) -> None:
    with pytest.raises(ValueError, match="rendezvous: timeout must be a positive, finite"):
        dist.rendezvous("k", "v", timeout=timeout)
    with pytest.raises(ValueError, match="agree: timeout must be a positive, finite"):
        dist.agree("step", timeout=timeout)


def test_rendezvous_and_agree_in_a_plain_process() -> None:
    assert dist.rendezvous("k", "only me", timeout=1.0) == ["only me"]
    dist.agree("step")
    with pytest.raises(dist.RemoteRankError) as info:
        dist.agree("step", KeyError("w"))
    assert info.value.ranks == (0,)
    with pytest.raises(TypeError, match="value must be a str, got bytes"):
        dist.rendezvous("k", b"v", timeout=1.0)  # type: ignore[arg-type]


def _outcome(step: str, error: BaseException | None, timeout: float | None) -> Any:
    try:
        dist.agree(step, error, timeout=timeout)
    except RemoteRankError as exc:
        return {
            "ranks": list(exc.ranks),
            "types": [f.error_type for f in exc.failures],
            "messages": [f.message for f in exc.failures],
            "text": str(exc),
        }
    return "returned"


def agree_outcomes(side: bool) -> dict[str, Any]:
    """Nobody failed, one rank failed, two ranks failed; with and without a timeout
    (``side``: the votes on a CPU side group, as under nccl)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = _route.side_channel, process_group._CPU_BACKENDS
    if side:
        _route.side_channel, process_group._CPU_BACKENDS = True, ()
    out: dict[str, Any] = {}
    try:
        for timeout in (None, 3.0):
            out[f"none/{timeout}"] = _outcome("load", None, timeout)
            one = ValueError(f"bad shard {rank}") if rank == 1 else None
            out[f"one/{timeout}"] = _outcome("load", one, timeout)
            two = OSError(f"disk full on {rank}") if rank != 1 else None
            out[f"two/{timeout}"] = _outcome("save", two, timeout)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        out["next"] = float(t) == world * (world + 1) / 2
    finally:
        _route.side_channel, process_group._CPU_BACKENDS = saved
    return out


@pytest.mark.parametrize("side", [False, True], ids=["plain", "side-group"])
def test_agree_raises_on_every_rank_naming_each_failed_rank(
    comm_run_distributed: Any, side: bool
) -> None:
    for r in comm_run_distributed(agree_outcomes, side, world_size=3):
        for timeout in (None, 3.0):
            assert r[f"none/{timeout}"] == "returned"
            one = r[f"one/{timeout}"]
            assert one["ranks"] == [1]
            assert one["types"] == ["builtins.ValueError"]
            assert one["messages"] == ["bad shard 1"]
            assert one["text"].startswith("load failed on rank(s) 1;")
            two = r[f"two/{timeout}"]
            assert two["ranks"] == [0, 2]
            assert two["types"] == ["builtins.OSError"] * 2
            assert two["messages"] == ["disk full on 0", "disk full on 2"]
        assert r["next"] is True


def agree_without_a_rank(timeout: float) -> dict[str, Any]:
    """Rank 0 votes; the other ranks never do. What rank 0 raised and how fast."""
    if dist.get_rank() != 0:
        return {}
    start = time.monotonic()
    try:
        dist.agree("write shards", timeout=timeout)
    except CommTimeoutError as exc:
        return {"message": str(exc), "seconds": time.monotonic() - start}
    return {"message": "returned"}


def test_a_rank_that_never_calls_agree_makes_the_caller_time_out() -> None:
    # its own world: the unanswered vote leaves the group's collectives out of step
    with WorldPool(2, timeout=30.0) as pool:
        results = pool.run(agree_without_a_rank, 1.0)
    r = results[0]
    assert 0.95 <= r["seconds"] < 2.5, r
    assert "agree at step 'write shards': rank 0 of 2 waited 1.0 s (timeout 1 s)" in r["message"]
    assert "probably died or is stuck" in r["message"]
    assert results[1] == {}
