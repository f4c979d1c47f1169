"""Write the legacy checkpoint fixtures with the code of the commit they are kept for.

Checkpoints saved by a released format version must keep loading
(``tests/strategies/test_checkpoint_legacy.py``). This script saves, with the public API,
one checkpoint per layout of ``model.WORLD`` into ``v<FORMAT_VERSION>/<layout>`` and the
values a load must bring back into ``v<FORMAT_VERSION>/reference.pt``. Run it from the
repository root with the packages of the commit to keep first on the path, e.g. from a
worktree of that commit::

    git worktree add /tmp/legacy-src <commit>
    PYTHONPATH=/tmp/legacy-src/packages/comm-core/src:/tmp/legacy-src/packages/comm-collectives/src:/tmp/legacy-src/packages/comm-wrappers/src:/tmp/legacy-src/packages/comm-strategies/src \\
        hatch run strategies:python -m tests.strategies.legacy.make_fixtures
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

import comm_collectives as dist
from comm_core.testing import WorldPool
from comm_strategies.checkpoint import save_checkpoint
from comm_strategies.checkpoint._manifest import FORMAT_VERSION
from tests.helpers import full_params

from . import model as m

HERE = Path(__file__).parent


def rng_seed() -> int:
    return 1000 + dist.get_rank()


def save_layout(root: str, kind: str, scratch: str) -> None:
    """Train ``kind`` ``STEPS`` steps, save it, then write what a load must reproduce to
    ``scratch/<kind>_<rank>.pt`` (tensors stay out of the pool's pipes)."""
    model, optim, scheduler = m.build(kind)
    for step in range(m.STEPS):
        m.train_step(model, optim, scheduler, step)
    torch.manual_seed(rng_seed())
    random.seed(rng_seed())
    save_checkpoint(
        f"{root}/{kind}",
        model=model,
        optim_wrapper=optim,
        schedulers=[scheduler],
        strategy=m.STRATEGY.get(kind, "deepspeed" if kind.startswith("zero") else "single"),
        extra=dict(m.EXTRA),
        sharded=False if kind.endswith("_full") else None,
    )
    reference: dict[str, Any] = {
        "draws": (torch.rand(3), random.random()),  # after the save: what its RNG state gives
        "params": full_params(model),
        "moments": m.moments(model, optim),
        "scheduler": m.scheduler_state(scheduler),
        "last_lr": scheduler.get_last_lr(),
        "extra": dict(m.EXTRA),
    }
    if kind == "amp_fp16":
        reference["scaler"] = optim.loss_scaler.state_dict()
    m.train_step(model, optim, scheduler, m.STEPS)
    reference["params_next"] = full_params(model)  # one more step: what a resume gives
    torch.save(reference, f"{scratch}/{kind}_{dist.get_rank()}.pt")


def main() -> None:
    out = HERE / f"v{FORMAT_VERSION}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    scratch = tempfile.mkdtemp()
    reference: dict[str, Any] = {"format_version": FORMAT_VERSION, "layouts": {}}
    for world in sorted(set(m.WORLD.values())):
        with WorldPool(world, timeout=300) as pool:
            for kind in [k for k, w in m.WORLD.items() if w == world]:
                pool.run(save_layout, str(out), kind, scratch, timeout=300)
                reference["layouts"][kind] = [
                    torch.load(f"{scratch}/{kind}_{rank}.pt") for rank in range(world)
                ]
                print(f"saved {kind} at world {world}")
    torch.save(reference, out / "reference.pt")
    shutil.rmtree(scratch)


if __name__ == "__main__":
    # Imported under its package name, so the pool's ranks can import save_layout.
    from tests.strategies.legacy import make_fixtures

    make_fixtures.main()
