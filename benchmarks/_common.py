"""What the benchmark scripts share: the ranks' environment and the results folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def rank_env() -> dict[str, str]:
    """The environment of the ranks, applied to this process too (DeepSpeed reads it here).

    One thread a rank. DeepSpeed JIT-builds a small C++ op on its first start (~25 s): keep
    it where later runs (and the tests, scripts/lib.sh) find it. Another Python environment
    needs a folder of its own: torch names the build after the op alone, so two environments
    sharing a folder rebuild it for each other.
    """
    env = {
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(ROOT / ".tools" / "torch-extensions")
        ),
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
    }
    os.environ.update(env)
    return env


def write_results(out: Path, result: Any, table: str, svg: str | None = None) -> None:
    """Write results.json, results.md (and chart.svg) into ``out``; print the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(table)
    if svg is not None:
        (out / "chart.svg").write_text(svg)
    print(table)


def median_interval(
    values: list[float],
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    groups: int = 1,
) -> tuple[float, float]:
    """A bootstrap confidence interval of the median of ``values`` (percentile method).

    With ``groups`` > 1, ``values`` are that many equal runs one after the other, and the
    bootstrap is two-stage: runs are drawn with replacement, then values within each drawn
    run. A bias that lasts a whole run then widens the interval as it should (drawing the
    values alone would treat them as independent and give an interval far too narrow).
    The seed is fixed, so the same samples always give the same interval.
    """
    import numpy as np

    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return (float("nan"), float("nan"))
    runs = data.reshape(groups, -1) if groups > 1 and data.size % groups == 0 else data[None]
    count, size = runs.shape
    rng = np.random.default_rng(seed)
    picked_runs = rng.integers(0, count, size=(resamples, count))
    picked_values = rng.integers(0, size, size=(resamples, count, size))
    drawn = runs[picked_runs[:, :, None], picked_values].reshape(resamples, -1)
    medians = np.median(drawn, axis=1)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return (float(low), float(high))
