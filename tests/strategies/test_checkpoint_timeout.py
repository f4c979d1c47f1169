"""save_checkpoint's timeout= at its edges (infinity, NaN, zero) on 2 real gloo ranks."""

from __future__ import annotations

import os
from typing import Any

from . import ckpt_cases as cases


def test_a_timeout_not_a_positive_finite_number_is_refused_on_every_rank(
    comm_run_distributed: Any, tmp_path: Any
) -> None:
    results = comm_run_distributed(cases.save_with_unbounded_timeouts, str(tmp_path), timeout=120)
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
