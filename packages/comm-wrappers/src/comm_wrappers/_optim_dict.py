"""`OptimWrapperDict`: several named optimizer wrappers, for models with several optimizers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["OptimWrapperDict", "StepWrapper"]


class StepWrapper(Protocol):
    """What `OptimWrapperDict` and a model's ``train_step`` use of each wrapper.

    MMEngine's optimizer-wrapper protocol, which `OptimWrapper` and `AmpOptimWrapper` follow.
    """

    def update_params(self, loss: torch.Tensor) -> None: ...
    def optim_context(self, model: nn.Module) -> AbstractContextManager[None]: ...
    def zero_grad(self, **kwargs: Any) -> None: ...
    def initialize_count_status(
        self, model: nn.Module, init_counts: int, max_counts: int
    ) -> None: ...
    def get_lr(self) -> dict[str, list[float]]: ...
    def get_momentum(self) -> dict[str, list[float]]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...
    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class OptimWrapperDict:
    """Several named optimizer wrappers, for models that step several optimizers (GANs).

    The model's own ``train_step`` drives each wrapper (``wrappers["generator"]``), so the
    single-optimizer calls (``update_params``, ``optim_context``...) raise and say so.

    Examples:
        >>> import torch
        >>> from comm_wrappers import OptimWrapper
        >>> g, d = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
        >>> wrappers = OptimWrapperDict(
        ...     generator=OptimWrapper(torch.optim.SGD(g.parameters(), lr=0.1)),
        ...     discriminator=OptimWrapper(torch.optim.SGD(d.parameters(), lr=0.2)),
        ... )
        >>> wrappers.get_lr()
        {'generator.lr': [0.1], 'discriminator.lr': [0.2]}
    """

    def __init__(self, **optim_wrappers: StepWrapper) -> None:
        for name, wrapper in optim_wrappers.items():
            if not hasattr(wrapper, "update_params"):
                message = (
                    f"OptimWrapperDict[{name!r}] must be an optimizer wrapper, got "
                    f"{type(wrapper).__name__}; wrap the optimizer in OptimWrapper first"
                )
                raise TypeError(message)
        self.optim_wrappers: dict[str, StepWrapper] = dict(optim_wrappers)

    def _single(self, what: str) -> NotImplementedError:
        names = ", ".join(repr(n) for n in self.optim_wrappers)
        return NotImplementedError(
            f"OptimWrapperDict.{what} is ambiguous: call it on one wrapper, e.g. "
            f"optim_wrapper[name].{what}(...), with name one of {names}"
        )

    def update_params(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Not available: call ``update_params`` on one of the wrappers."""
        raise self._single("update_params")

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Not available: call ``backward`` on one of the wrappers."""
        raise self._single("backward")

    def step(self, **kwargs: Any) -> None:
        """Not available: call ``step`` on one of the wrappers."""
        raise self._single("step")

    def optim_context(self, model: nn.Module) -> Any:
        """Not available: call ``optim_context`` on one of the wrappers."""
        raise self._single("optim_context")

    def zero_grad(self, **kwargs: Any) -> None:
        """Zero the gradients of every optimizer."""
        for wrapper in self.optim_wrappers.values():
            wrapper.zero_grad(**kwargs)

    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int) -> None:
        """Initialise the counters of every wrapper."""
        for wrapper in self.optim_wrappers.values():
            wrapper.initialize_count_status(model, init_counts, max_counts)

    def get_lr(self) -> dict[str, list[float]]:
        """Return ``{"<name>.lr": [...]}`` for every wrapper."""
        return {f"{n}.lr": w.get_lr()["lr"] for n, w in self.optim_wrappers.items()}

    def get_momentum(self) -> dict[str, list[float]]:
        """Return ``{"<name>.momentum": [...]}`` for every wrapper."""
        return {
            f"{n}.momentum": w.get_momentum()["momentum"] for n, w in self.optim_wrappers.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """Return ``{name: wrapper.state_dict()}``."""
        return {name: wrapper.state_dict() for name, wrapper in self.optim_wrappers.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load every wrapper's state; the keys must match the wrappers' names."""
        if set(state_dict) != set(self.optim_wrappers):
            message = (
                f"OptimWrapperDict.load_state_dict: expected keys {sorted(self.optim_wrappers)}, "
                f"got {sorted(state_dict)}"
            )
            raise KeyError(message)
        for name, state in state_dict.items():
            self.optim_wrappers[name].load_state_dict(state)

    @property
    def param_groups(self) -> dict[str, list[dict[str, Any]]]:
        """``{name: param_groups}`` of every wrapper."""
        return {name: w.param_groups for name, w in self.optim_wrappers.items()}

    def __getitem__(self, key: str) -> StepWrapper:
        return self.optim_wrappers[key]

    def __contains__(self, key: object) -> bool:
        return key in self.optim_wrappers

    def __len__(self) -> int:
        return len(self.optim_wrappers)

    def __iter__(self) -> Iterator[str]:
        return iter(self.optim_wrappers)

    def keys(self) -> Any:
        """The wrappers' names."""
        return self.optim_wrappers.keys()

    def values(self) -> Any:
        """The wrappers."""
        return self.optim_wrappers.values()

    def items(self) -> Any:
        """``(name, wrapper)`` pairs."""
        return self.optim_wrappers.items()

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={w!r}" for n, w in self.optim_wrappers.items())
        return f"OptimWrapperDict({inner})"
