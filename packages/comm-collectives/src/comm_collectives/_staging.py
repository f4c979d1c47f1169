"""Argument checks and staging of the tensors a collective moves.

The helpers the tensor collectives, the rooted calls and the point-to-point calls share:
the checks of a tensor and a root rank, the translation of a group rank to a global one,
and the staging of a tensor on the communication device as bytes (padded and split for
the uneven-shape gathers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as torch_dist

from comm_core import get_world_size

from ._buffers import empty_bytes
from ._modes import local_fault


def global_rank(group: torch_dist.ProcessGroup | None, rank: int) -> int:
    """Translate a rank of ``group`` into the global rank torch's rooted calls expect."""
    if group is None or group is torch_dist.group.WORLD:
        return rank
    return int(torch_dist.get_global_rank(group, rank))


def _check_tensor(name: str, data: object) -> None:
    if not isinstance(data, torch.Tensor):
        message = f"{name}: data must be a torch.Tensor, got {type(data).__name__}."
        raise TypeError(message)
    if data.is_nested:  # it has no shape to announce
        message = (
            f"{name}: nested tensors are not supported; pass a dense tensor (for example "
            "torch.nested.to_padded_tensor(t, 0.0)) or one call per component."
        )
        raise TypeError(message)


def _check_root(name: str, root: int, group: torch_dist.ProcessGroup | None, what: str) -> None:
    world = get_world_size(group)
    if not isinstance(root, int) or isinstance(root, bool):
        message = f"{name}: {what} must be an int rank of the group, got {root!r}."
        raise TypeError(message)
    if not 0 <= root < world:
        message = f"{name}: {what}={root} is not a rank of the group (0..{world - 1})."
        raise ValueError(message)


def _staged(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` itself when contiguous on ``device``, else a contiguous copy there.

    The caller copies the result back into ``tensor`` when it is a copy.
    """
    if tensor.device == device and tensor.is_contiguous():
        return tensor
    return tensor.to(device).contiguous()


def _local_checks(operation: str, data: object, check: Callable[[], None] | None = None) -> None:
    """The argument checks of a tensor collective and the test hook, before the handshake."""
    _check_tensor(operation, data)
    if check is not None:
        check()
    local_fault("local", operation)


def _checked(
    operation: str, data: object, check: Callable[[], None] | None = None
) -> BaseException | None:
    try:
        _local_checks(operation, data, check)
    except Exception as exc:
        return exc
    return None


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: gloo moves bytes of any dtype."""
    flat = tensor.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:  # one element of a strided view
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def _plain(data: torch.Tensor) -> torch.Tensor:
    """``data`` without autograd and with conjugate / negative bits materialised."""
    return data.detach().resolve_conj().resolve_neg()


def _padded_send(data: torch.Tensor, device: torch.device, width: int) -> torch.Tensor:
    """The bytes of ``data`` on ``device``, zero-padded to ``width`` elements."""
    flat = _as_bytes(_plain(data).to(device).contiguous())
    nbytes = width * data.element_size()
    if flat.numel() == nbytes:
        return flat
    send = empty_bytes(nbytes, device)
    send[: flat.numel()] = flat
    send[flat.numel() :] = 0
    return send


def _split(
    out: torch.Tensor,
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Cut the gathered bytes into one tensor per rank, each with its own shape."""
    rows = out.view(len(shapes), -1).to(device)
    size = torch.empty((), dtype=dtype).element_size()
    return [row[: _numel(shape) * size].view(dtype).view(shape) for row, shape in zip(rows, shapes)]


def _fill(outputs: Sequence[torch.Tensor], parts: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for out, part in zip(outputs, parts):
            out.copy_(part)


def _own(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether torch can write into ``tensor`` directly: contiguous, on ``device``."""
    return tensor.device == device and tensor.is_contiguous() and not tensor.requires_grad


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
