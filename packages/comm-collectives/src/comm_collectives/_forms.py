"""The two call forms of all_gather and gather (MMEngine's and torch's), told apart.

MMEngine's ``all_gather(data, group)`` and ``gather(data, dst, group)`` return lists;
torch's ``all_gather(tensor_list, tensor, ...)`` and ``gather(tensor, gather_list, dst,
...)`` fill a list. The public functions take ``*args, **kwargs``, pick the form from the
arguments (see their docstrings) and bind them here against the form's signature.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as torch_dist

__all__ = [
    "ALL_GATHER_MM",
    "ALL_GATHER_TORCH",
    "GATHER_MM",
    "GATHER_TORCH",
    "bind",
    "check_outputs",
]


def _mm_all_gather(data: torch.Tensor, group: torch_dist.ProcessGroup | None = None) -> None:
    """MMEngine's form of all_gather."""


def _torch_all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: torch_dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> None:
    """torch's form of all_gather."""


def _mm_gather(
    data: torch.Tensor, dst: int = 0, group: torch_dist.ProcessGroup | None = None
) -> None:
    """MMEngine's form of gather."""


def _torch_gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: torch_dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> None:
    """torch's form of gather."""


ALL_GATHER_MM = inspect.signature(_mm_all_gather)
ALL_GATHER_TORCH = inspect.signature(_torch_all_gather)
GATHER_MM = inspect.signature(_mm_gather)
GATHER_TORCH = inspect.signature(_torch_gather)


def bind(
    operation: str, form: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The arguments of ``form`` (with defaults), or a TypeError showing both forms."""
    try:
        bound = form.bind(*args, **kwargs)
    except TypeError as exc:
        forms = {
            "all_gather": "all_gather(data, group=None) -> list, or all_gather(tensor_list, "
            "tensor, group=None, async_op=False)",
            "gather": "gather(data, dst=0, group=None) -> list, or gather(tensor, "
            "gather_list=None, dst=0, group=None, async_op=False)",
        }[operation]
        message = f"{operation}: the arguments fit neither form ({exc}); the forms are {forms}."
        raise TypeError(message) from None
    bound.apply_defaults()
    return dict(bound.arguments)


def check_outputs(
    operation: str,
    name: str,
    outputs: object,
    tensor: torch.Tensor,
    world: int,
) -> None:
    """The torch form's output list: a list of ``world`` tensors of ``tensor``'s dtype."""
    if not isinstance(outputs, (list, tuple)):
        message = f"{operation}: {name} must be a list of tensors, got {type(outputs).__name__}."
        raise TypeError(message)
    if len(outputs) != world:
        message = (
            f"{operation}: {name} must hold one tensor per rank of the group ({world}), got "
            f"{len(outputs)}; allocate it as [torch.empty_like(tensor) for _ in range({world})]."
        )
        raise ValueError(message)
    for index, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            message = (
                f"{operation}: {name}[{index}] must be a torch.Tensor, got {type(out).__name__}."
            )
            raise TypeError(message)
        if out.dtype != tensor.dtype:
            message = (
                f"{operation}: {name}[{index}] has dtype {out.dtype}, the tensor sent has "
                f"{tensor.dtype}; the output tensors must have the dtype of the input."
            )
            raise TypeError(message)
