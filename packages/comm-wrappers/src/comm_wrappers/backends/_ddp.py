"""The adapter of models holding torch's DistributedDataParallel (DDP, separate DDP)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

from torch.nn.parallel import DistributedDataParallel

from ._base import Backend

__all__ = ["DDPBackend"]


class DDPBackend(Backend):
    """DDP: whole parameters on every rank, gradients all-reduced in the backward.

    Also a model holding several DDP modules (`MMSeparateDistributedDataParallel`'s
    children): ``no_sync`` skips the sync of every one of them.
    """

    kind: ClassVar[str] = "ddp"

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the gradient all-reduce of every DDP module for one forward/backward.

        Raises:
            ValueError: A DDP module has ``static_graph=True``: torch cannot skip its sync.
        """
        units = [m for m in self.model.modules() if isinstance(m, DistributedDataParallel)]
        if any(getattr(unit, "static_graph", False) for unit in units):
            message = (
                "DDP with static_graph=True cannot skip the gradient sync on accumulation "
                "micro-steps (torch fails inside its reducer): use static_graph=False, or "
                "accumulative_counts=1"
            )
            raise ValueError(message)
        with contextlib.ExitStack() as stack:
            for unit in units:
                stack.enter_context(unit.no_sync())
            yield
