"""Coalesced reductions: all_reduce_dict and all_reduce_params.

Both flatten many tensors into one buffer per dtype (and per size bucket), so a dict of
128 scalars costs one handshake and one reduction, not 128; when the flattened dict fits
the handshake frame it travels inside it and is reduced locally: one collective in all.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as torch_dist

from comm_core import CollectiveMismatchError, get_world_size

from ._agree import agree
from ._faults import transport
from ._frame import Header, Inline, dtype_code, inline_payloads, signature_of
from ._handshake import handshake
from ._modes import checks_enabled, local_fault
from ._reduce import (
    backend_reduce,
    check_op_dtype,
    prepare_reduction,
    reduce_op_name,
    reduce_rows,
)

__all__ = ["all_reduce_dict", "all_reduce_params"]


def all_reduce_dict(
    data: dict[str, torch.Tensor], op: str = "sum", group: torch_dist.ProcessGroup | None = None
) -> None:
    """Reduce every tensor of a dict across ranks, in place (the values are replaced).

    All tensors of one dtype travel in one collective; integer means are exact. Every rank
    must hold the same keys with the same shapes, dtypes and device types: if not, every
    rank raises a [`CollectiveMismatchError`][comm_core.CollectiveMismatchError] listing
    each rank's keys. Either every value is replaced or none is.

    Args:
        data: Tensors by key.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``.
        group: Process group; the default group when None.

    Examples:
        >>> d = {"loss": torch.tensor(2.0)}
        >>> all_reduce_dict(d, op="mean")  # a world of one
        >>> d
        {'loss': tensor(2.)}
    """
    if get_world_size(group) == 1:
        reduce_op_name(op)
        _check_dict(data)
        return
    if not checks_enabled():
        _all_reduce_dict_unchecked(data, reduce_op_name(op), group)
        return
    name, error = "", None
    keys: list[Any] = []
    values: list[torch.Tensor] = []
    layout: _Layout | None = None
    try:
        name = reduce_op_name(op)
        keys, values = _check_dict(data)
        layout = _Layout.of(values)
        for dtype in set(layout.dtypes):
            check_op_dtype(dtype, name, "all_reduce_dict")
        local_fault("local", "all_reduce_dict")
    except Exception as exc:
        error = exc
    ready = layout if error is None else None  # None: nothing to send, the error travels
    segments = [] if ready is None else _segments(keys, values, ready)
    peers = handshake(
        Header(
            "all_reduce_dict",
            error=error,
            reduce_op=name or None,
            signature=0 if ready is None else _layout_signature(keys, ready),
        ),
        group,
        same=("reduce_op",),
        payload=_dict_payload(segments) if error is None else None,
        varying=False,
    )
    if len({p.signature for p in peers}) > 1:
        _raise_key_mismatch(keys, values, group)
    payloads = inline_payloads(peers)
    if payloads is not None:
        results = _reduce_inline(segments, payloads, name)
    else:
        reductions = _prepare_all([seg.values for seg in segments], name, group, "all_reduce_dict")
        results = [
            (seg, _unflat(seg.values, reduction.run()))
            for seg, reduction in zip(segments, reductions)
        ]
    # every segment is reduced before any value is replaced: an error loses nothing
    for seg, reduced in results:
        data.update(zip(seg.keys, reduced))


def _all_reduce_dict_unchecked(
    data: dict[str, torch.Tensor], op: str, group: torch_dist.ProcessGroup | None
) -> None:
    """One backend all-reduce per dtype, no handshake (inside ``unchecked``)."""
    keys, values = _check_dict(data)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, value in enumerate(values):
        by_dtype.setdefault(value.dtype, []).append(index)
    done = []
    for indices in by_dtype.values():
        parts = [values[i] for i in indices]
        flat = backend_reduce(parts, op, group, "all_reduce_dict")
        done.append(([keys[i] for i in indices], _unflat(parts, flat)))
    for part_keys, reduced in done:  # every dtype reduced before any value is replaced
        data.update(zip(part_keys, reduced))


def _check_dict(data: object) -> tuple[list[Any], list[torch.Tensor]]:
    if not isinstance(data, Mapping):
        message = f"all_reduce_dict: data must be a dict of tensors, got {type(data).__name__}."
        raise TypeError(message)
    keys = sorted(data, key=str)
    values = [data[k] for k in keys]
    for key, value in zip(keys, values):
        if not isinstance(value, torch.Tensor):
            message = (
                f"all_reduce_dict: data[{key!r}] is a {type(value).__name__}, not a tensor; "
                "wrap numbers with torch.tensor(value)."
            )
            raise TypeError(message)
    return keys, values


def _prepare_all(
    groups: list[list[torch.Tensor]],
    op: str,
    group: torch_dist.ProcessGroup | None,
    operation: str,
) -> list[Any]:
    """Prepare the long path of every flat buffer, then vote: a local failure (a device
    move, an allocation) raises on every rank before any data moves."""
    reductions = []
    error: BaseException | None = None
    try:
        reductions = [prepare_reduction(parts, op, group, operation) for parts in groups]
    except Exception as exc:
        error = exc
    agree(operation, error, group=group)
    return reductions


def _unflat(values: list[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """Cut a reduced flat buffer into tensors shaped, typed and placed like ``values``."""
    sizes = [v.numel() for v in values]
    return [
        part.view(v.shape).to(device=v.device, dtype=v.dtype, copy=part.device == v.device)
        for part, v in zip(torch.split(flat, sizes), values)
    ]


@dataclass
class _Segment:
    """The keys of one dtype, and where their values lie in the flattened dict."""

    dtype: torch.dtype
    keys: list[Any] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    offset: int = 0
    nbytes: int = 0
    scalars: bool = False  # every value 0-dim: stacked and unbound instead of cat / split


@dataclass(frozen=True)
class _Layout:
    """The dtype, shape and device type of each value, each read once per call."""

    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[torch.Size, ...]
    devices: tuple[str, ...] | None  # None: every value on the CPU

    @classmethod
    def of(cls, values: list[torch.Tensor]) -> _Layout:
        # map with attrgetter: a few tenths of a microsecond a tensor, where a Python loop
        # reading the same attributes (the device above all) costs about a microsecond
        on_cpu = all(map(_IS_CPU, values))
        devices = None if on_cpu else tuple(v.device.type for v in values)
        return cls(tuple(map(_DTYPE, values)), tuple(map(_SHAPE, values)), devices)


_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")
_IS_CPU = attrgetter("is_cpu")


def _segments(keys: list[Any], values: list[torch.Tensor], layout: _Layout) -> list[_Segment]:
    by_dtype: dict[torch.dtype, _Segment] = {}
    shapes: dict[torch.dtype, list[torch.Size]] = {}
    for key, value, dtype, shape in zip(keys, values, layout.dtypes, layout.shapes):
        seg = by_dtype.get(dtype)
        if seg is None:
            seg = by_dtype[dtype] = _Segment(dtype)
            shapes[dtype] = []
        seg.keys.append(key)
        seg.values.append(value)
        shapes[dtype].append(shape)
    offset = 0
    for seg in by_dtype.values():
        seg_shapes = shapes[seg.dtype]
        seg.offset = offset
        seg.nbytes = sum(map(math.prod, seg_shapes)) * seg.values[0].element_size()
        seg.scalars = not any(seg_shapes)  # every shape () (an empty torch.Size is falsy)
        offset += (seg.nbytes + 15) // 16 * 16  # every segment aligned for any dtype's view
    return list(by_dtype.values())


def _layout_signature(keys: list[Any], layout: _Layout) -> int:
    """Digest of the keys, shapes, dtypes and device types, equal on ranks that hold the
    same layout. Recent layouts are remembered: a loop reduces the same dict every step."""
    # keys equal across types (True == 1 == 1.0) have different reprs, hence digests: the
    # memo holds str keys as they are (the common case) and other keys by their repr
    named = all(type(key) is str for key in keys)
    memo = (tuple(keys) if named else repr(keys), layout)
    cached = _SIGNATURES.get(memo)
    if cached is not None:
        return cached
    words: list[int] = []
    devices = layout.devices or ("cpu",) * len(layout.dtypes)
    for dtype, shape, device in zip(layout.dtypes, layout.shapes, devices):
        words += (dtype_code(dtype), _DEVICE_TYPES.get(device, 99), len(shape))
        words += shape
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8)
    digest.update(array("q", words).tobytes())
    signature = int.from_bytes(digest.digest(), "little") >> 1
    if len(_SIGNATURES) >= _SIGNATURES_KEPT:
        _SIGNATURES.clear()
    _SIGNATURES[memo] = signature
    return signature


_SIGNATURES: dict[tuple[tuple[Any, ...] | str, _Layout], int] = {}
_SIGNATURES_KEPT = 64


_DEVICE_TYPES = {"cpu": 0, "cuda": 1, "xpu": 2, "mps": 3, "npu": 4, "hpu": 5, "meta": 6}


def _flat(seg: _Segment) -> torch.Tensor:
    if seg.scalars:
        return torch.stack(seg.values)
    return torch.cat([v.reshape(-1) for v in seg.values])


def _unflatten(seg: _Segment, flat: torch.Tensor) -> list[torch.Tensor]:
    if seg.scalars:
        return list(flat.unbind(0))
    sizes = [v.numel() for v in seg.values]
    return [part.view(v.shape) for part, v in zip(torch.split(flat, sizes), seg.values)]


def _dict_payload(segments: list[_Segment]) -> Inline:
    total = segments[-1].offset + segments[-1].nbytes if segments else 0

    def write(out: torch.Tensor) -> None:
        with torch.no_grad():
            for seg in segments:
                out[seg.offset : seg.offset + seg.nbytes].view(seg.dtype).copy_(_flat(seg))

    # data on an accelerator never rides in headers that travel on the CPU
    devices = [v.device for seg in segments for v in seg.values if v.device.type != "cpu"]
    return Inline(total, write, devices[0] if devices else torch.device("cpu"))


def _reduce_inline(
    segments: list[_Segment], payloads: list[torch.Tensor], op: str
) -> list[tuple[_Segment, list[torch.Tensor]]]:
    """Reduce the flattened dicts gathered inline; every rank computes the same values."""
    results = []
    for seg in segments:
        rows = torch.stack(
            [row[seg.offset : seg.offset + seg.nbytes].view(seg.dtype) for row in payloads]
        )
        reduced = reduce_rows(rows, op, "all_reduce_dict")
        reduced = reduced.to(device=seg.values[0].device, dtype=seg.dtype)
        results.append((seg, _unflatten(seg, reduced)))
    return results


def _raise_key_mismatch(
    keys: list[Any], values: list[torch.Tensor], group: torch_dist.ProcessGroup | None
) -> None:
    layout = [(k, tuple(v.shape), f"{v.dtype} {v.device.type}") for k, v in zip(keys, values)]
    gathered: list[Any] = [None] * get_world_size(group)
    with transport("all_reduce_dict", group):
        torch_dist.all_gather_object(gathered, layout, group=group)
    key_sets = [{k for k, _, _ in g} for g in gathered]
    common = set.intersection(*key_sets)
    rows = []
    for rank, (entries, rank_keys) in enumerate(zip(gathered, key_sets)):
        differing = [
            f"{k} {list(s)} {d.replace('torch.', '')}" for k, s, d in entries if k in common
        ]
        rows.append(
            {
                "rank": rank,
                "keys": len(rank_keys),
                "only here": ", ".join(sorted(map(str, rank_keys - common))) or "-",
                "shared keys (shape dtype)": "; ".join(differing)
                if len(differing) <= 4
                else f"{len(differing)} keys",
            }
        )
    missing = set.union(*key_sets) - common
    problem = (
        f"the ranks hold different keys ({', '.join(sorted(map(str, missing)))} missing on some ranks)."
        if missing
        else "the ranks hold the same keys with different shapes or dtypes."
    )
    raise CollectiveMismatchError(
        "all_reduce_dict",
        problem,
        rows,
        "every rank must reduce the same keys with the same shapes and dtypes.",
    )


def all_reduce_params(
    params: Iterable[torch.Tensor],
    coalesce: bool = True,
    bucket_size_mb: float = -1,
    op: str = "sum",
    group: torch_dist.ProcessGroup | None = None,
) -> None:
    """Reduce parameters (or any tensors) across ranks, in place.

    Args:
        params: Tensors or ``nn.Parameter``s, e.g. ``model.parameters()``.
        coalesce: Flatten tensors into buckets (one collective per bucket) instead of one
            collective per tensor.
        bucket_size_mb: Largest bucket in MiB; one bucket per dtype when <= 0.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``.
        group: Process group; the default group when None.
    """
    if get_world_size(group) == 1:
        reduce_op_name(op)
        return
    if not checks_enabled():
        name = reduce_op_name(op)
        plain = [p.data if isinstance(p, torch.nn.Parameter) else p for p in params]
        groups = _buckets(plain, bucket_size_mb) if coalesce else [[t] for t in plain]
        flats = [backend_reduce(b, name, group, "all_reduce_params") for b in groups]
        with torch.no_grad():
            for bucket, flat in zip(groups, flats):
                for tensor, value in zip(bucket, _unflat(bucket, flat)):
                    tensor.copy_(value)
        return
    name, tensors, error = "", [], None
    try:
        name = reduce_op_name(op)
        tensors = [p.data if isinstance(p, torch.nn.Parameter) else p for p in params]
        for index, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                message = (
                    f"all_reduce_params: item {index} of params is a {type(tensor).__name__}, "
                    "not a tensor."
                )
                raise TypeError(message)
            check_op_dtype(tensor.dtype, name, "all_reduce_params")
        local_fault("local", "all_reduce_params")
    except Exception as exc:
        error = exc
    # an empty list still takes part: a rank whose list is empty (an unused branch) makes
    # every rank raise a mismatch instead of leaving the others in the handshake
    layout = [(tuple(t.shape), dtype_code(t.dtype), t.device.type) for t in tensors]
    handshake(
        Header(
            "all_reduce_params",
            error=error,
            reduce_op=name or None,
            signature=signature_of(layout) if error is None else 0,
            count=len(tensors),
        ),
        group,
        same=("reduce_op", "signature"),
        hint="every rank must pass the same parameters (shapes, dtypes and devices, in order).",
        varying=False,
    )
    if not tensors:
        return
    groups = _buckets(tensors, bucket_size_mb) if coalesce else [[t] for t in tensors]
    reductions = _prepare_all(groups, name, group, "all_reduce_params")
    reduced = [_unflat(bucket, r.run()) for bucket, r in zip(groups, reductions)]
    # every bucket is reduced before any tensor is written: all or nothing
    with torch.no_grad():
        for bucket, values in zip(groups, reduced):
            for tensor, value in zip(bucket, values):
                tensor.copy_(value)


def _buckets(tensors: list[torch.Tensor], bucket_size_mb: float) -> list[list[torch.Tensor]]:
    limit = int(bucket_size_mb * 1024 * 1024) if bucket_size_mb > 0 else 0
    open_buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    done: list[list[torch.Tensor]] = []
    for tensor in tensors:
        key = (tensor.dtype, tensor.device)
        nbytes = tensor.numel() * tensor.element_size()
        bucket = open_buckets.setdefault(key, [])
        if limit and bucket and sizes[key] + nbytes > limit:
            done.append(bucket)
            bucket = open_buckets[key] = []
            sizes[key] = 0
        bucket.append(tensor)
        sizes[key] = sizes.get(key, 0) + nbytes
    return done + [b for b in open_buckets.values() if b]
