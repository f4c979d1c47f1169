"""Which device computes, which device communicates, and moving nested data between them."""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

from .errors import DeviceMismatchError, rank_context

__all__ = ["cast_data_device", "get_comm_device", "get_data_device", "get_device"]

T = TypeVar("T")

# Backend -> device type, for the backends torch knows beyond gloo and nccl.
_BACKEND_DEVICE = {
    "nccl": "cuda",
    "gloo": "cpu",
    "mpi": "cpu",
    "ucc": "cpu",
    "hccl": "npu",
    "cncl": "mlu",
    "mccl": "musa",
    "xccl": "xpu",
}


def get_device() -> str:
    """Return the type of the best device of this machine: cuda, xpu, mps, or cpu.

    Examples:
        >>> get_device() in {"cuda", "xpu", "mps", "cpu"}
        True
    """
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def get_comm_device(group: torch_dist.ProcessGroup | None = None) -> torch.device:
    """Return the device a collective on ``group`` needs its tensors on.

    nccl -> the current CUDA device, gloo and mpi -> cpu, and the other backends torch knows
    to their device; cpu in a plain process.

    Examples:
        >>> get_comm_device()  # no process group here
        device(type='cpu')
    """
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return torch.device("cpu")
    backend = str(torch_dist.get_backend(group)).lower()
    device_type = _BACKEND_DEVICE.get(backend)
    if device_type is None:
        # e.g. "cpu:gloo,cuda:nccl": prefer the accelerator part.
        parts = dict(p.split(":", 1) for p in backend.split(",") if ":" in p)
        device_type = next((d for d in parts if d != "cpu"), "cpu")
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type, None)
    if module is not None and hasattr(module, "current_device") and module.is_available():
        return torch.device(device_type, module.current_device())
    return torch.device(device_type)


def get_data_device(data: Any) -> torch.device:
    """Return the device of a tensor or of every tensor inside a nested structure.

    Mappings, sequences and named tuples are searched; every tensor found must be on the
    same device.

    Args:
        data: A tensor, or a mapping / sequence (named tuples included) holding tensors.

    Returns:
        The common device.

    Raises:
        DeviceMismatchError: Tensors on different devices.
        ValueError: No tensor inside ``data``.
        TypeError: ``data`` is neither a tensor nor a container.

    Examples:
        >>> get_data_device({"a": torch.zeros(1), "b": [torch.ones(2)]})
        device(type='cpu')
    """
    found = _find_device(data, "data")
    if found is None:
        message = (
            "get_data_device: expected at least one tensor in the data, got an empty "
            f"{type(data).__name__} on {rank_context()}."
        )
        raise ValueError(message)
    return found[0]


def _find_device(data: Any, path: str) -> tuple[torch.device, str] | None:
    if isinstance(data, torch.Tensor):
        return data.device, path
    if isinstance(data, Mapping):
        items: list[tuple[str, Any]] = [(f"{path}[{k!r}]", v) for k, v in data.items()]
    elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(data)]
    else:
        message = (
            "get_data_device: expected a tensor, or a mapping or sequence of tensors, got "
            f"{type(data).__name__} at {path} on {rank_context()}."
        )
        raise TypeError(message)
    first: tuple[torch.device, str] | None = None
    for item_path, value in items:
        found = _find_device(value, item_path)
        if found is None:
            continue
        if first is None:
            first = found
        elif found[0] != first[0]:
            message = (
                f"get_data_device: all tensors must be on one device, but {first[1]} is on "
                f"{first[0]} and {found[1]} is on {found[0]} ({rank_context()}). Move them "
                "to one device first, e.g. with cast_data_device(data, device)."
            )
            raise DeviceMismatchError(message)
    return first


def cast_data_device(data: T, device: torch.device | str, out: Any = None) -> T:
    """Move a tensor, or every tensor inside a nested structure, to ``device``.

    Container types are kept (named tuples included). A dataclass instance comes back as a
    shallow copy whose fields hold the moved values; its ``__init__`` and
    ``__post_init__`` do not run again, so what they derived stays as it was. Values that
    are not tensors are returned unchanged. With ``out``, the moved tensors are also copied
    into the matching tensors of ``out`` (which must have the same structure), as MMEngine
    does.

    Args:
        data: A tensor, or a mapping / sequence holding tensors.
        device: The target device.
        out: Optional structure of tensors to copy into.

    Returns:
        The moved data.

    Raises:
        TypeError: ``out`` does not have the structure of ``data``.

    Examples:
        >>> cast_data_device({"x": torch.ones(1)}, "cpu")
        {'x': tensor([1.])}
    """
    target = torch.device(device)
    moved = _cast(data, target)
    if out is not None:
        _copy_into(moved, out, "data")
    return moved  # type: ignore[no-any-return]


def _cast(data: Any, device: torch.device) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, defaultdict):  # its constructor takes the factory first
        return defaultdict(data.default_factory, {k: _cast(v, device) for k, v in data.items()})
    if isinstance(data, Mapping):
        return type(data)({k: _cast(v, device) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_cast(v, device) for v in data))
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        # a copy with its fields set directly (frozen ones too): no __init__ or
        # __post_init__ runs again, and fields outside __init__ move like the others
        moved = copy.copy(data)
        for field in dataclasses.fields(data):
            if hasattr(data, field.name):  # a field without a default may be unset
                object.__setattr__(moved, field.name, _cast(getattr(data, field.name), device))
        return moved
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        return type(data)(_cast(v, device) for v in data)  # type: ignore[call-arg]
    return data


def _copy_into(data: Any, out: Any, path: str) -> None:
    if isinstance(data, torch.Tensor):
        if not isinstance(out, torch.Tensor):
            message = (
                f"cast_data_device: out must mirror data, but {path} is a tensor in data and "
                f"a {type(out).__name__} in out."
            )
            raise TypeError(message)
        out.copy_(data)
        return
    if dataclasses.is_dataclass(data) and not isinstance(data, (type, Mapping)):  # as _cast
        if type(out) is not type(data):
            message = (
                f"cast_data_device: out must mirror data, but {path} is a "
                f"{type(data).__name__} in data and a {type(out).__name__} in out."
            )
            raise TypeError(message)
        for field in dataclasses.fields(data):
            if hasattr(data, field.name):
                value = getattr(data, field.name)
                _copy_into(value, getattr(out, field.name, None), f"{path}.{field.name}")
        return
    if isinstance(data, Mapping):
        if not isinstance(out, Mapping) or set(out) != set(data):
            message = f"cast_data_device: out must have the keys of data at {path}."
            raise TypeError(message)
        for key, value in data.items():
            _copy_into(value, out[key], f"{path}[{key!r}]")
        return
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        if not isinstance(out, Sequence) or len(out) != len(data):
            message = f"cast_data_device: out must have the length of data at {path}."
            raise TypeError(message)
        for index, (value, target) in enumerate(zip(data, out)):
            _copy_into(value, target, f"{path}[{index}]")
