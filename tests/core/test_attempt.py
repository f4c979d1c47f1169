"""The ranks of a launch attempt agree on a fresh token; nothing of an earlier attempt pairs.

The exchange runs here on a real in-process store (torch's HashStore) with one thread a
rank, so the stale keys of a dead attempt can be laid out exactly; tests/launchers runs it
under torchrun's real restarts.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as torch_dist

from comm_core import CommTimeoutError
from comm_core._attempt import (
    _ANSWER,
    _ANSWERED,
    _QUEUE,
    _REQUEST,
    attempt_prefix,
    attempt_store,
    current_attempt,
)


def _prefixed_tokens(store: Any, world: int, timeout: float = 10.0) -> list[Any]:
    """Each thread's token, read back through the prefix store it got (its ``mine`` key)."""
    tokens: list[Any] = [None] * world

    def rank(r: int) -> None:
        try:
            prefixed = attempt_store(store, r, world, timeout)
            prefixed.set(f"mine/{r}", str(r))
            tokens[r] = prefixed
        except Exception as exc:
            tokens[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    return tokens


def _token_of(store: Any, world: int) -> str:
    """The one token all ``world`` ranks agreed on: the prefix under which all wrote."""
    results = _prefixed_tokens(store, world)
    assert not [r for r in results if isinstance(r, BaseException)], results
    # every rank's key is visible through rank 0's prefixed store: they share one prefix
    assert results[0].check([f"mine/{r}" for r in range(world)])
    for r in range(1, world):
        assert results[r].get("mine/0") == b"0"
    token = current_attempt()
    assert token is not None
    assert store.get(f"{attempt_prefix(token)}/mine/{world - 1}") == str(world - 1).encode()
    return token


def test_the_ranks_agree_and_each_attempt_gets_a_fresh_token(tmp_path: Path) -> None:
    store = torch_dist.FileStore(str(tmp_path / "store"), -1)
    first = _token_of(store, 3)
    second = _token_of(store, 3)  # the same store, the next attempt
    assert first != second
    assert store.get(f"{attempt_prefix(first)}/mine/2") == b"2"  # the old keys stay apart


def test_a_dead_attempts_queue_does_not_pair_with_the_next_one(tmp_path: Path) -> None:
    store = torch_dist.FileStore(str(tmp_path / "store"), -1)
    # A dead attempt: five questions were queued; the asker of number 3 died before writing
    # its nonce, number 4's nonce was never answered, and a mark says 2 were answered.
    for _ in range(5):
        store.add(_QUEUE, 1)
    store.set(f"{_REQUEST}1", "old-1")
    store.set(f"{_REQUEST}4", "old-4")
    store.set(f"{_REQUEST}5", "old-5")
    store.set(_ANSWERED, "2")
    store.set(f"{_ANSWER}old-5", "a-token-of-the-dead-attempt")
    token = _token_of(store, 3)
    assert token != "a-token-of-the-dead-attempt"
    assert store.get(f"{_ANSWER}old-4") == token.encode()  # answered, harmlessly
    assert store.check([f"{_REQUEST}1"])  # below the mark: never read again
    # number 3 never got its nonce: the mark stays below it, so a late writer is still read
    assert store.get(_ANSWERED) == b"2"
    # and a world of one needs no one else
    assert _token_of(store, 1) not in (token, "a-token-of-the-dead-attempt")


def test_an_asker_without_a_leader_times_out_with_a_clear_error(tmp_path: Path) -> None:
    store = torch_dist.FileStore(str(tmp_path / "store"), -1)
    with pytest.raises(
        CommTimeoutError, match="rank 1 asked rank 0 for this launch attempt's token"
    ):
        attempt_store(store, 1, 2, 0.3)


def test_a_leader_whose_ranks_never_ask_names_them(tmp_path: Path) -> None:
    store = torch_dist.FileStore(str(tmp_path / "store"), -1)
    with pytest.raises(CommTimeoutError, match=r"rank\(s\) \[1, 2\] never asked"):
        attempt_store(store, 0, 3, 0.3)
