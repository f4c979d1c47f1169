"""`ElasticSampler`: a data position counted in global samples, so that it reshards.

The order of an epoch is a seeded permutation of the dataset, the same on every rank and
at every world size; it is cut into global batches, and each rank takes a contiguous share
of each one. The position (how many samples of the epoch the optimizer has consumed) is
counted in global samples, so a checkpoint saved at one world size continues the same
sequence of global batches at any other that can split the global batch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

import comm_collectives as dist

__all__ = ["ElasticSampler"]

_STATE_KEYS = (
    "epoch",
    "position",
    "seed",
    "global_batch_size",
    "num_samples",
    "shuffle",
    "drop_last",
)


def _int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``; TypeError or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        message = f"ElasticSampler: {name} must be an int, got {type(value).__name__} {value!r}"
        raise TypeError(message)
    if value < minimum:
        message = f"ElasticSampler: {name} must be >= {minimum}, got {value}"
        raise ValueError(message)
    return int(value)


def _near_divisors(number: int, near: int, count: int = 4) -> list[int]:
    """The ``count`` divisors of ``number`` closest to ``near``, in increasing order."""
    divisors = [d for d in range(1, number + 1) if number % d == 0]
    return sorted(sorted(divisors, key=lambda d: (abs(d - near), d))[:count])


class ElasticSampler(Sampler[int]):
    """Shuffle, shard and checkpoint a dataset's order by global batches, at any world size.

    Each epoch is a permutation of ``range(num_samples)`` drawn from a ``torch.Generator``
    seeded with ``seed + epoch`` (the identity when ``shuffle=False``), the same on every
    rank. It is cut into global batches of ``global_batch_size`` samples; with
    ``drop_last=False`` the last one is completed with samples from the start of the
    permutation (repeated, as ``DistributedSampler`` pads), with ``drop_last=True`` an
    incomplete last batch is dropped. Rank ``r`` of ``W`` takes the contiguous slice
    ``[r * s, (r + 1) * s)`` of every global batch, ``s = global_batch_size // W``, split
    into ``accumulation_steps`` micro batches of ``micro_batch_size``: iterating the
    sampler yields this rank's indices, one share after the other, from the current
    position to the end of the epoch. Give the loader ``batch_size=micro_batch_size``.

    The position counts the global samples the optimizer has consumed in the current
    epoch (a multiple of ``global_batch_size``). Iterating does not move it: a
    ``DataLoader`` with workers draws indices ahead of training (its prefetch), so the
    sampler cannot know from its own iterator what was trained on. The loop calls
    [`advance`][comm_strategies.ElasticSampler.advance] after each optimizer step
    instead; completing an epoch moves to the next one (epoch + 1, position 0).
    [`state_dict`][comm_strategies.ElasticSampler.state_dict] is the same on every rank
    and at every world size; after
    [`load_state_dict`][comm_strategies.ElasticSampler.load_state_dict] the next
    iteration continues with the next global batch, whatever the world size now is.
    [`set_epoch`][comm_strategies.ElasticSampler.set_epoch] with the current epoch keeps
    the position (a loop that calls it at each epoch's start continues mid-epoch after a
    resume); another epoch starts that one from its beginning.

    Args:
        dataset: The map-style dataset (anything with ``len``) or its length.
        global_batch_size: Samples per optimizer step over all ranks; it stays the same
            at every world size (the per-rank batch adapts).
        shuffle: Draw a seeded permutation each epoch; False: the dataset's order.
        seed: The permutation's seed (the same on every rank).
        drop_last: Drop an incomplete last global batch instead of completing it.
        max_micro_batch_size: The most samples a rank takes in one forward pass; None: no
            cap (one micro batch per step). With a cap, the sampler picks the fewest
            accumulation steps that split the rank's share into micro batches of at most
            this size.
        rank: This rank; None: the current process group's (0 without one).
        world_size: The number of ranks that share each global batch; None: the current
            process group's (1 without one).

    Raises:
        TypeError: An argument of the wrong type (an int that is a bool, a float).
        ValueError: ``global_batch_size`` cannot be split evenly over ``world_size`` ranks
            (raised on every rank, since each computes it alike), an epoch without a
            single global batch (``drop_last=True``), or a rank outside the world.

    Examples:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> data = TensorDataset(torch.arange(10.0))
        >>> sampler = ElasticSampler(data, global_batch_size=4, shuffle=False)
        >>> loader = DataLoader(data, sampler=sampler, batch_size=sampler.micro_batch_size)
        >>> [batch[0].tolist() for batch in loader]
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 0.0, 1.0]]
        >>> sampler.advance(2)  # two optimizer steps done
        >>> sampler.state_dict()["position"]
        8
        >>> other = ElasticSampler(10, global_batch_size=4, shuffle=False, rank=1, world_size=2)
        >>> other.load_state_dict(sampler.state_dict())
        >>> list(other)  # rank 1 of 2: the second half of the third global batch
        [0, 1]
    """

    def __init__(
        self,
        dataset: Sized | int,
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        max_micro_batch_size: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(dataset, numbers.Integral) and not isinstance(dataset, bool):
            num_samples = int(dataset)
        elif isinstance(dataset, Sized):
            num_samples = len(dataset)
        else:
            message = (
                "ElasticSampler: dataset must be a map-style dataset (with len) or its length, "
                f"got {type(dataset).__name__}"
            )
            raise TypeError(message)
        self._num_samples = _int("the dataset's length", num_samples, 1)
        self._global_batch_size = _int("global_batch_size", global_batch_size, 1)
        self._shuffle = bool(shuffle)
        self._seed = _int("seed", seed, 0)
        self._drop_last = bool(drop_last)
        world = dist.get_world_size() if world_size is None else world_size
        self._world_size = _int("world_size", world, 1)
        self._rank = _int("rank", dist.get_rank() if rank is None else rank, 0)
        if self._rank >= self._world_size:
            message = (
                f"ElasticSampler: rank must be in [0, {self._world_size}) for a world of "
                f"{self._world_size}, got {self._rank}"
            )
            raise ValueError(message)
        self._max_micro_batch_size = (
            None
            if max_micro_batch_size is None
            else _int("max_micro_batch_size", max_micro_batch_size, 1)
        )
        self._micro_batch_size, self._accumulation_steps = self.split_global_batch(
            self._global_batch_size,
            self._world_size,
            max_micro_batch_size=self._max_micro_batch_size,
            rank=self._rank,
        )
        if self._drop_last:
            self._steps_per_epoch = self._num_samples // self._global_batch_size
        else:
            self._steps_per_epoch = math.ceil(self._num_samples / self._global_batch_size)
        if self._steps_per_epoch == 0:
            message = (
                f"ElasticSampler: a dataset of {self._num_samples} samples holds no full global "
                f"batch of {self._global_batch_size} with drop_last=True; use drop_last=False "
                "(the batch is completed by repetition) or a smaller global_batch_size"
            )
            raise ValueError(message)
        self._epoch = 0
        self._position = 0

    # ------------------------------------------------------------------ the split
    @staticmethod
    def split_global_batch(
        global_batch_size: int,
        world_size: int,
        *,
        max_micro_batch_size: int | None = None,
        rank: int | None = None,
    ) -> tuple[int, int]:
        """Split a global batch over ranks and accumulation steps.

        ``micro_batch_size * world_size * accumulation_steps == global_batch_size``, with
        the fewest accumulation steps whose micro batch is at most ``max_micro_batch_size``.

        Args:
            global_batch_size: Samples per optimizer step over all ranks.
            world_size: The number of ranks.
            max_micro_batch_size: The most samples a rank takes in one forward pass; None:
                no cap (one accumulation step).
            rank: The rank named in the error message; None: the current process's.

        Returns:
            ``(micro_batch_size, accumulation_steps)``.

        Raises:
            ValueError: ``global_batch_size`` is not a multiple of ``world_size``: no
                accumulation makes the ranks' shares equal.

        Examples:
            >>> ElasticSampler.split_global_batch(48, 4, max_micro_batch_size=5)
            (4, 3)
        """
        global_batch_size = _int("global_batch_size", global_batch_size, 1)
        world_size = _int("world_size", world_size, 1)
        if global_batch_size % world_size != 0:
            where = dist.get_rank() if rank is None else rank
            below = global_batch_size // world_size * world_size
            sizes = [s for s in (below, below + world_size) if s > 0]
            worlds = ", ".join(str(d) for d in _near_divisors(global_batch_size, world_size))
            message = (
                f"ElasticSampler on rank {where}: global_batch_size={global_batch_size} cannot "
                f"be split evenly over world_size={world_size} ranks "
                f"({global_batch_size} % {world_size} = {global_batch_size % world_size}), with "
                "or without accumulation, so the sequence of global batches cannot continue "
                f"exactly at this world size. Pick a global batch divisible by {world_size} "
                f"({' or '.join(str(s) for s in sizes)}), or run on a world size that divides "
                f"{global_batch_size} (e.g. {worlds})."
            )
            raise ValueError(message)
        share = global_batch_size // world_size
        if max_micro_batch_size is None:
            return share, 1
        cap = _int("max_micro_batch_size", max_micro_batch_size, 1)
        steps = next(a for a in range(math.ceil(share / cap), share + 1) if share % a == 0)
        return share // steps, steps

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """This rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks that share each global batch."""
        return self._world_size

    @property
    def num_samples(self) -> int:
        """The dataset's length."""
        return self._num_samples

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self._global_batch_size

    @property
    def batch_size_per_rank(self) -> int:
        """Samples a rank takes per optimizer step: ``global_batch_size // world_size``."""
        return self._global_batch_size // self._world_size

    @property
    def micro_batch_size(self) -> int:
        """Samples a rank takes per forward pass: the loader's ``batch_size``."""
        return self._micro_batch_size

    @property
    def accumulation_steps(self) -> int:
        """Forward/backward passes per optimizer step (``accumulative_counts``)."""
        return self._accumulation_steps

    @property
    def seed(self) -> int:
        """The permutation's seed (epoch ``e`` uses ``seed + e``)."""
        return self._seed

    @property
    def shuffle(self) -> bool:
        """Whether each epoch is a seeded permutation."""
        return self._shuffle

    @property
    def drop_last(self) -> bool:
        """Whether an incomplete last global batch is dropped (else completed)."""
        return self._drop_last

    @property
    def steps_per_epoch(self) -> int:
        """Global batches (optimizer steps) in one epoch."""
        return self._steps_per_epoch

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def position(self) -> int:
        """Global samples of the current epoch consumed so far (a multiple of the global batch)."""
        return self._position

    # ------------------------------------------------------------------ the order
    def _epoch_order(self) -> torch.Tensor:
        """The current epoch's global order, ``(steps_per_epoch, global_batch_size)``."""
        if self._shuffle:
            generator = torch.Generator()
            generator.manual_seed(self._seed + self._epoch)
            order = torch.randperm(self._num_samples, generator=generator)
        else:
            order = torch.arange(self._num_samples)
        total = self._steps_per_epoch * self._global_batch_size
        if total > self._num_samples:  # completed from the start of the permutation
            order = order.repeat(math.ceil(total / self._num_samples))
        return order[:total].view(self._steps_per_epoch, self._global_batch_size)

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices from the current position to the end of the epoch.

        The order is computed when the iterator is made, so an `advance` that moves to the
        next epoch while a loader still draws from it does not change what it yields.
        """
        share = self.batch_size_per_rank
        start = self._rank * share
        rows = self._epoch_order()[self._position // self._global_batch_size :]
        indices: list[int] = rows[:, start : start + share].reshape(-1).tolist()
        return iter(indices)

    def __len__(self) -> int:
        """The number of indices the next iteration yields on this rank."""
        remaining = self._steps_per_epoch - self._position // self._global_batch_size
        return remaining * self.batch_size_per_rank

    # ------------------------------------------------------------------ the position
    def advance(self, steps: int = 1) -> None:
        """Count ``steps`` optimizer steps (global batches) as consumed.

        Call it after each optimizer step, on every rank (not after each micro batch of an
        accumulation). At the end of an epoch the sampler moves to the next one: epoch + 1,
        position 0.

        Args:
            steps: The number of global batches consumed.

        Raises:
            TypeError: ``steps`` is not an int.
            ValueError: ``steps`` is negative.
        """
        steps = _int("steps", steps, 0)
        consumed = self._position // self._global_batch_size + steps
        self._epoch += consumed // self._steps_per_epoch
        self._position = consumed % self._steps_per_epoch * self._global_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Go to ``epoch``: from its beginning, unless it is the current epoch.

        With the current epoch nothing changes, so a loop that calls
        ``set_epoch(epoch)`` at each epoch's start continues mid-epoch after
        `load_state_dict`. Take the first epoch of such a loop from
        [`epoch`][comm_strategies.ElasticSampler.epoch] after loading.

        Args:
            epoch: The epoch (its permutation is seeded with ``seed + epoch``).

        Raises:
            TypeError: ``epoch`` is not an int.
            ValueError: ``epoch`` is negative.
        """
        epoch = _int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch = epoch
            self._position = 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The data position, the same on every rank and for every world size.

        Plain ints and bools: it goes into a checkpoint's ``extra`` (loaded with
        ``weights_only=True``) and through any pickle.

        Returns:
            ``{"epoch", "position", "seed", "global_batch_size", "num_samples", "shuffle",
            "drop_last"}``; ``position`` counts the global samples of the epoch consumed.
        """
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "global_batch_size": self._global_batch_size,
            "num_samples": self._num_samples,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from `state_dict`, at this or any other world size).

        The state's seed replaces this sampler's. The dataset's length, the global batch,
        ``shuffle`` and ``drop_last`` must be the same: otherwise the sequence of global
        batches could not continue, and the state is refused.

        Args:
            state: A `state_dict`.

        Raises:
            TypeError: ``state`` is not a mapping, or a value has the wrong type.
            ValueError: A key is missing, a value is out of range, or the state is for
                another dataset length, global batch, ``shuffle`` or ``drop_last``.
        """
        where = f"ElasticSampler.load_state_dict on rank {self._rank}"
        if not isinstance(state, Mapping):
            message = f"{where}: expected a state_dict() mapping, got {type(state).__name__}"
            raise TypeError(message)
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            message = (
                f"{where}: the state lacks {missing}; expected the keys {list(_STATE_KEYS)} "
                f"of ElasticSampler.state_dict(), got {sorted(state)}"
            )
            raise ValueError(message)
        fixed = {
            "num_samples": self._num_samples,
            "global_batch_size": self._global_batch_size,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
        }
        for key, mine in fixed.items():
            if state[key] != mine:
                message = (
                    f"{where}: the state was saved with {key}={state[key]!r}, this sampler has "
                    f"{key}={mine!r}; the sequence of global batches cannot continue. "
                    f"Build the sampler with {key}={state[key]!r} (the per-rank batch and the "
                    "accumulation adapt to the world size, the global batch must not change)."
                )
                raise ValueError(message)
        epoch = _int("the state's epoch", state["epoch"], 0)
        seed = _int("the state's seed", state["seed"], 0)
        position = _int("the state's position", state["position"], 0)
        end = self._steps_per_epoch * self._global_batch_size
        if position % self._global_batch_size != 0 or position > end:
            message = (
                f"{where}: the state's position {position} is not a multiple of the global "
                f"batch {self._global_batch_size} in [0, {end}]"
            )
            raise ValueError(message)
        self._seed = seed
        self._epoch = epoch
        self._position = 0
        self.advance(position // self._global_batch_size)  # the epoch's end: the next one

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(num_samples={self._num_samples}, "
            f"global_batch_size={self._global_batch_size}, rank={self._rank}, "
            f"world_size={self._world_size}, micro_batch_size={self._micro_batch_size}, "
            f"accumulation_steps={self._accumulation_steps}, epoch={self._epoch}, "
            f"position={self._position})"
        )
