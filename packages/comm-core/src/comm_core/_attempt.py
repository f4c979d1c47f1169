"""Keep each launch attempt's keys apart in a store that outlives the attempt.

A launcher that restarts a job's workers keeps the rendezvous store: torchrun's agent
hosts it for the whole job, a ``file://`` store stays on disk, a Slurm requeue may reuse a
host and port. The keys of the dead attempt are then still there, and the next attempt
reads them as its own: gloo connects to the dead ranks' addresses, a collective pairs with
the dead attempt's call of the same number. Nothing in the launcher's environment names an
attempt reliably (torchrun's restart count is counted per node, and a node joining the job
restarts the workers without changing it).

So the ranks of an attempt agree on a fresh token, and everything they keep in the store
lives under ``comm/attempt/<token>/``. The agreement cannot use a key that an earlier
attempt could have written, so it is a question and an answer:

1. Every rank but 0 draws a nonce, queues it (``comm/attempts/request/<n>``, ``n`` from
   the store's counter) and waits for ``comm/attempts/answer/<nonce>``. Only a process
   that has read this nonce can write that key, and only rank 0 of this attempt reads it.
2. Rank 0 draws the token and answers every queued nonce, earlier attempts' included (no
   one waits for those any more; answering them is harmless), until every rank has said
   it joined under the token's own prefix, which no earlier attempt could have written.

A launcher restarts an attempt only once every process of the previous one is gone, so
no stale process can ask or answer. The exchange costs a few round trips to the store.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

from torch._C._distributed_c10d import PrefixStore, Store  # torch.distributed's (not in stubs)

from .errors import CommTimeoutError

__all__ = ["attempt_prefix", "attempt_store", "current_attempt"]

_QUEUE = "comm/attempts/requests"
_REQUEST = "comm/attempts/request/"
_ANSWER = "comm/attempts/answer/"
_ANSWERED = "comm/attempts/answered"  # the leader's mark: every request up to it was answered
_POLL_FIRST_S = 0.0005
_POLL_MOST_S = 0.05

_current: list[str] = []  # the token of this process's attempt, once agreed


def current_attempt() -> str | None:
    """The token this process's ranks agreed on in `init_dist`, or None before (or without)."""
    return _current[-1] if _current else None


def attempt_prefix(token: str) -> str:
    """The store prefix of the attempt ``token`` (a `PrefixStore` adds the ``/``)."""
    return f"comm/attempt/{token}"


def attempt_store(store: Store, rank: int, world_size: int, timeout: float) -> PrefixStore:
    """Agree on a fresh attempt token with the other ranks; return ``store`` under its prefix.

    Collective over the ``world_size`` ranks that share ``store``. Rank 0 answers; the
    others ask. Bounded by ``timeout`` seconds.

    Raises:
        CommTimeoutError: Rank 0 never answered, or a rank never joined, within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    token = _lead(store, world_size, deadline) if rank == 0 else _ask(store, rank, deadline)
    _current[:] = [token]
    return PrefixStore(attempt_prefix(token), store)


def _hint() -> str:
    """What the launcher says of this attempt, for people reading the store or the logs."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}-r{env.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    if "SLURM_JOB_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}-r{env.get('SLURM_RESTART_COUNT', 0)}"
    return "run"


def _joined_key(token: str, rank: int) -> str:
    return f"{attempt_prefix(token)}/joined/{rank}"


def _ask(store: Store, rank: int, deadline: float) -> str:
    nonce = uuid.uuid4().hex
    number = store.add(_QUEUE, 1)
    store.set(f"{_REQUEST}{number}", nonce)
    answer = f"{_ANSWER}{nonce}"
    try:
        store.wait([answer], timedelta(seconds=max(0.01, deadline - time.monotonic())))
    except Exception as exc:  # the store's timeout (RuntimeError or DistStoreError)
        message = (
            f"init_dist: rank {rank} asked rank 0 for this launch attempt's token and got no "
            "answer in time. Rank 0 has not started, died, uses another store, or is still "
            "waiting for other ranks to reach the store (a store rank 0 hosts waits for every "
            "rank to connect): check which ranks started and rank 0's log; a larger timeout= "
            "gives slow ranks more time."
        )
        raise CommTimeoutError(message) from exc
    token = store.get(answer).decode()
    store.delete_key(answer)
    store.set(_joined_key(token, rank), b"1")  # type: ignore[arg-type]  # bytes work
    return token


def _lead(store: Store, world_size: int, deadline: float) -> str:
    token = f"{_hint()}-{uuid.uuid4().hex[:12]}"
    joined = [_joined_key(token, rank) for rank in range(1, world_size)]
    first = int(store.get(_ANSWERED)) + 1 if store.check([_ANSWERED]) else 1
    pending: set[int] = set()  # queued numbers whose nonce was not written yet
    answered = first - 1
    poll = _POLL_FIRST_S
    while True:
        last = store.add(_QUEUE, 0)
        pending.update(range(answered + 1, last + 1))
        answered = max(answered, last)
        for number in sorted(pending):
            key = f"{_REQUEST}{number}"
            if store.check([key]):  # queued, but its asker may not have written it yet
                store.set(f"{_ANSWER}{store.get(key).decode()}", token)
                store.delete_key(key)
                pending.discard(number)
        if not joined or store.check(joined):
            break
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(joined, start=1) if not store.check([key])]
            message = (
                f"init_dist: rank 0 waited for every rank of this launch attempt and rank(s) "
                f"{missing} never asked for its token. They have not started, or use another "
                "store (check MASTER_ADDR / MASTER_PORT and their logs)."
            )
            raise CommTimeoutError(message)
        time.sleep(poll)
        poll = min(_POLL_MOST_S, poll * 2)
    # an asker that died between drawing its number and writing its nonce holds the mark back
    store.set(_ANSWERED, str(min(pending) - 1 if pending else answered))
    return token
