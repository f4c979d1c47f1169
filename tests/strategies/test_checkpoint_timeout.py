"""save_checkpoint's timeout= at its edges (infinity, NaN, zero) on 2 real gloo ranks."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import comm_collectives as dist
from comm_strategies.checkpoint import save_checkpoint


def save_with_unbounded_timeouts(root: str) -> dict[str, str]:
    """timeout= at its edges (infinity, NaN, zero, negative), with rank 1 entering late:
    each rank's outcome (the error's type and text, or "ok")."""
    import math

    model = torch.nn.Linear(3, 2)
    out: dict[str, str] = {}
    cases = (("inf", math.inf), ("nan", math.nan), ("zero", 0.0), ("negative", -1.0))
    for name, timeout in cases:
        if dist.get_rank() == 1:
            time.sleep(0.5)  # past the quick check: the store's own bounded wait runs
        try:
            save_checkpoint(f"{root}/{name}", model=model, strategy="ddp", timeout=timeout)
            out[name] = "ok"
        except Exception as error:  # the case reports any outcome
            out[name] = f"{type(error).__name__}: {error}"
        dist.barrier()
    return out


def test_a_timeout_not_a_positive_finite_number_is_refused_on_every_rank(
    comm_run_distributed: Any, tmp_path: Any
) -> None:
    results = comm_run_distributed(save_with_unbounded_timeouts, str(tmp_path), timeout=120)
    # each was refused at once, before any exchange, with the same clear error on every
    # rank (infinity and NaN once failed the store's wait at once as "rank(s) [1] did not
    # reach 'enter' within inf s"; 0 waited for the store's own timeout, unbounded here)
    for out in results:
        for name in ("inf", "nan", "zero", "negative"):
            assert out[name].startswith("CheckpointError: save_checkpoint: timeout must be a"), (
                name,
                out[name],
            )
    assert results[0] == results[1]
    assert sorted(os.listdir(tmp_path)) == []
