"""`MMSeparateDistributedDataParallel`: one DDP per child, for models with several optimizers."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ._registry import register_model_wrapper
from .backends import rank_device
from .ddp import MMDistributedDataParallel, require_process_group

__all__ = ["MMSeparateDistributedDataParallel"]

_HAS_FORWARD_SYNC_BUFFERS = (
    "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
)


@register_model_wrapper
class MMSeparateDistributedDataParallel(nn.Module):
    """Wrap every child of ``module`` that has trainable parameters in its own DDP.

    For models that step several optimizers, each over its own part (GANs): the model's
    own ``train_step(data, optim_wrappers)`` runs, and each part synchronises its
    gradients on its own. Children with no trainable parameters are moved to the device
    and left unwrapped.

    Unlike MMEngine's class, ``no_sync()`` works for any number of children (and children
    without parameters), and ``module`` is changed only once every child is wrapped.

    Args:
        module: The model; its direct children are wrapped.
        broadcast_buffers: Whether each child's DDP broadcasts its buffers before the forward
            (torch's ``forward_sync_buffers`` where it has replaced ``broadcast_buffers``).
        find_unused_parameters: Passed to each child's DDP.
        **kwargs: Other DDP keywords, passed to each child's DDP.

    Raises:
        NotInitializedError: No process group is initialised.
        ValueError: ``module`` holds trainable parameters itself (not in a child).
    """

    def __init__(
        self,
        module: nn.Module,
        broadcast_buffers: bool = False,
        find_unused_parameters: bool = False,
        **kwargs: Any,
    ) -> None:
        require_process_group(type(self).__name__)
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if own:
            message = (
                f"{type(module).__name__} holds trainable parameters itself ({', '.join(own)}); "
                "separate DDP synchronises only its children, so these would drift apart "
                "across ranks. Move them into a child module, or freeze them."
            )
            raise ValueError(message)
        super().__init__()
        device = rank_device()  # the process group's kind: CPU under gloo, GPU under nccl
        if _HAS_FORWARD_SYNC_BUFFERS:
            # torch >= 2.13 deprecates broadcast_buffers for forward_sync_buffers (which
            # still syncs the buffers once, at construction).
            kwargs.setdefault("forward_sync_buffers", broadcast_buffers)
        else:
            kwargs.setdefault("broadcast_buffers", broadcast_buffers)
        wrapped: dict[str, nn.Module] = {}
        for name, child in module.named_children():
            child = child.to(device)
            if any(p.requires_grad for p in child.parameters()):
                wrapped[name] = MMDistributedDataParallel(
                    child, find_unused_parameters=find_unused_parameters, **kwargs
                )
            else:
                wrapped[name] = child
        # Every child wrapped: only now is the caller's module changed.
        for name, child in wrapped.items():
            setattr(module, name, child)
        module.to(device)  # parameters and buffers held by the module itself
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the model (its children synchronise through their own DDP)."""
        return self.module(*args, **kwargs)

    def _own(self, name: str) -> Any:
        method = getattr(self.module, name, None)
        if not callable(method):
            message = (
                f"MMSeparateDistributedDataParallel runs the model's own {name}, and "
                f"{type(self.module).__name__} has none: define {name}(...) on the model "
                "(it drives each optimizer wrapper of an OptimWrapperDict)"
            )
            raise AttributeError(message)
        return method

    def train_step(self, data: Any, optim_wrapper: Any) -> Any:
        """Run the model's own ``train_step`` (it steps each optimizer wrapper)."""
        return self._own("train_step")(data, optim_wrapper)

    def val_step(self, data: Any) -> Any:
        """Run the model's own ``val_step``."""
        return self._own("val_step")(data)

    def test_step(self, data: Any) -> Any:
        """Run the model's own ``test_step``."""
        return self._own("test_step")(data)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the gradient sync of every wrapped child."""
        with contextlib.ExitStack() as stack:
            for child in self.module.children():
                if isinstance(child, MMDistributedDataParallel):
                    stack.enter_context(child.no_sync())
            yield
