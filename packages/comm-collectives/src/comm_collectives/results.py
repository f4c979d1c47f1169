"""collect_results: put the per-rank results of a distributed evaluation back in order.

With a ``DistributedSampler`` rank ``r`` of ``W`` holds items ``r, r + W, r + 2W, ...``.
Rank 0 receives the parts one rank at a time, interleaves them, keeps ``None`` results, and
truncates the padding the sampler added. Each part is streamed (``comm_collectives.stream``):
its sender pickles it chunk by chunk while rank 0 unpickles the chunks already there, so
rank 0 holds its results plus a few chunks in transit. No shared filesystem is needed; with
an explicit ``tmpdir`` the parts go through that folder instead, written atomically, and
only what this call created is removed.

Every call ends with rank 0's verdict (one small broadcast): when a sender failed to pickle
the rest of its part, or rank 0 failed to unpickle one, every rank raises the same
[`RemoteRankError`][comm_core.RemoteRankError].
"""

from __future__ import annotations

import itertools
import os
import uuid
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

from comm_core import get_backend, get_comm_device, get_rank, get_world_size

from .protocol import Header, Inline, Peer, handshake, inline_capacity, raise_everywhere
from .serialization import decode, dump, encode
from .stream import PartReader, PartWriter, PeerFailedError
from .tensors import global_rank

__all__ = ["collect_results", "collect_results_cpu", "collect_results_gpu"]

_DEVICES = ("cpu", "gpu")
_cpu_groups: dict[object, torch_dist.ProcessGroup] = {}


def _cpu_group(group: torch_dist.ProcessGroup | None) -> torch_dist.ProcessGroup | None:
    """A gloo group over the ranks of ``group`` (``group`` itself when it is gloo already)."""
    if get_backend(group) == "gloo":
        return group
    key = group if group is not None else "default"
    if key not in _cpu_groups:
        ranks = None if group is None else torch_dist.get_process_group_ranks(group)
        _cpu_groups[key] = torch_dist.new_group(ranks=ranks, backend="gloo")
    return _cpu_groups[key]


_MISSING = object()


def _interleave(parts: list[list[Any]], size: int) -> list[Any]:
    """Merge the parts in sampler order: item ``i`` of rank ``r`` goes to ``r + i * W``."""
    world = len(parts)
    lengths = [len(part) for part in parts]
    if lengths[0] - lengths[-1] <= 1 and all(a >= b for a, b in itertools.pairwise(lengths)):
        # the shape a sampler gives (the first ranks hold one more item, or all the same):
        # part r fills exactly the slots r, r + W, ..., so slice assignment places it in C
        ordered: list[Any] = [None] * sum(lengths)
        for rank, part in enumerate(parts):
            ordered[rank::world] = part
        del ordered[size:]
        return ordered
    ordered = []
    for row in itertools.zip_longest(*parts, fillvalue=_MISSING):
        ordered.extend(item for item in row if item is not _MISSING)
        if len(ordered) >= size:
            break
    return ordered[:size]


def _check_args(results: Any, size: int, device: str) -> None:
    if device not in _DEVICES:
        message = f"collect_results: device must be one of {', '.join(_DEVICES)}, got {device!r}."
        raise ValueError(message)
    if not isinstance(results, list):
        message = f"collect_results: results must be a list, got {type(results).__name__}."
        raise TypeError(message)
    if size < 0:
        message = f"collect_results: size must be >= 0, got {size}."
        raise ValueError(message)


def collect_results(
    results: list[Any],
    size: int,
    device: str = "cpu",
    tmpdir: str | None = None,
    group: torch_dist.ProcessGroup | None = None,
) -> list[Any] | None:
    """Collect every rank's results on rank 0, in dataset order.

    Args:
        results: This rank's results, in the order its sampler gave the items.
        size: Length of the dataset; the padding a sampler adds is cut off.
        device: ``"cpu"`` sends the parts over a CPU (gloo) group, or through ``tmpdir``;
            ``"gpu"`` sends them over the group's own backend on its device.
        tmpdir: Folder for the parts in cpu mode; it must be shared by all ranks. Created
            (private) if missing and then removed; a folder that existed is left in place.
        group: Process group; the default group when None.

    Returns:
        On rank 0 the ``size`` results in order; None on the other ranks.

    Raises:
        RemoteRankError: A rank could not pickle or write its part (raised on every rank).

    Examples:
        >>> collect_results([0, None, 2], size=2)  # a world of one
        [0, None]
    """
    _check_args(results, size, device)
    if get_world_size(group) == 1:
        return results[:size]
    if device == "cpu" and tmpdir is not None:
        return _collect_through_folder(results, size, tmpdir, group)
    return _collect_by_messages(results, size, _cpu_group(group) if device == "cpu" else group)


def collect_results_cpu(
    result_part: list[Any], size: int, tmpdir: str | None = None
) -> list[Any] | None:
    """``collect_results(result_part, size, "cpu", tmpdir)``."""
    return collect_results(result_part, size, "cpu", tmpdir)


def collect_results_gpu(result_part: list[Any], size: int) -> list[Any] | None:
    """``collect_results(result_part, size, "gpu")``."""
    return collect_results(result_part, size, "gpu")


def _collect_by_messages(
    results: list[Any], size: int, group: torch_dist.ProcessGroup | None
) -> list[Any] | None:
    device = get_comm_device(group)
    if get_rank(group) != 0:
        _send_part(results, group, device)
        return None
    peers = handshake(Header("collect_results"), group)  # raises if a rank failed early
    readers = [
        PartReader(_head_of(peer), peer.count, global_rank(group, peer.rank), group, device)
        for peer in peers[1:]
    ]
    parts: list[list[Any]] = [results]
    error: BaseException | None = None
    failed = False
    for index, reader in enumerate(readers):
        # the receives of this part and of the next are posted before unpickling starts
        for ahead in readers[index : index + 2]:
            ahead.post()
        if not failed:
            try:
                parts.append(reader.load())
            except PeerFailedError:  # the sender reports its own error in the verdict
                failed = True
            except Exception as exc:
                error, failed = exc, True
        # after a failure the remaining parts are still received: no sender is left
        # blocked, and no stale message is left in the channel for a later call
        reader.finish()
    _verdict(failed, error, group, device)
    return _interleave(parts, size)


def _head_of(peer: Peer) -> bytes:
    if peer.payload is None:  # the sender's head always fits: capacities are equal
        message = f"collect_results: rank {peer.rank}'s first bytes did not come inline"
        raise RuntimeError(message)
    return peer.payload.cpu().numpy().tobytes()


def _send_part(
    results: list[Any], group: torch_dist.ProcessGroup | None, device: torch.device
) -> None:
    def announce(head: bytearray, count: int) -> None:
        inline = Inline.of_tensor(torch.from_numpy(np.frombuffer(head, dtype=np.uint8)))
        handshake(Header("collect_results", count=count), group, payload=inline)

    writer = PartWriter(announce, inline_capacity(group), global_rank(group, 0), group, device)
    error: BaseException | None = None
    try:
        writer.finish(dump(results, writer))
    except Exception as exc:
        if writer.stage == "pickling":  # nothing sent yet: the handshake reports it
            handshake(Header("collect_results", error=exc), group)
        if writer.stage != "streaming":  # the handshake or the transport failed
            raise
        writer.fail()
        error = exc
    _verdict(error is not None, error, group, device)


def _verdict(
    failed: bool,
    error: BaseException | None,
    group: torch_dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Rank 0 tells every rank whether the call failed; then every rank raises the same error.

    ``failed`` counts on rank 0 only; ``error`` is this rank's own failure, if any.
    """
    flag = torch.tensor([int(failed)], dtype=torch.int64, device=device)
    torch_dist.broadcast(flag, global_rank(group, 0), group=group)
    if int(flag.item()):
        raise_everywhere("collect_results", error, group)


def _collect_through_folder(
    results: list[Any], size: int, tmpdir: str, group: torch_dist.ProcessGroup | None
) -> list[Any] | None:
    me = get_rank(group)
    # 1. rank 0 alone creates a missing folder, so it alone knows whether to remove it
    created = False
    error: BaseException | None = None
    if me == 0 and not os.path.isdir(tmpdir):
        try:
            os.makedirs(tmpdir, mode=0o700)
            created = True
        except Exception as exc:
            error = exc
    handshake(Header("collect_results", error=error, root=0), group)
    # 2. every rank writes its part atomically: readers never see a half-written file
    path = ""
    try:
        encoded = encode(results)
        path = os.path.join(tmpdir, f"comm-part-{me}-{uuid.uuid4().hex}.bin")
        frame = np.empty(encoded.nbytes, dtype=np.uint8)
        encoded.write_into(frame)
        frame.tofile(path + ".partial")
        os.replace(path + ".partial", path)
    except Exception as exc:
        error = exc
    try:
        handshake(Header("collect_results", error=error, root=0), group)
    except BaseException:
        for leftover in (path, path + ".partial"):
            if leftover and os.path.exists(leftover):
                os.remove(leftover)
        if created:
            _remove_if_empty(tmpdir)
        raise
    # 3. rank 0 reads the parts in rank order, removing each file it has read
    names = _exchange_names(path, group)
    if me != 0:
        _verdict(False, None, group, get_comm_device(group))
        return None
    parts: list[list[Any]] = [results]
    for name in names[1:]:
        if error is None:  # after a failure the other parts are still removed
            try:
                parts.append(decode(np.fromfile(name, dtype=np.uint8)))
            except Exception as exc:
                error = exc
        os.remove(name)
    os.remove(path)
    if created:
        _remove_if_empty(tmpdir)
    _verdict(error is not None, error, group, get_comm_device(group))
    return _interleave(parts, size)


def _remove_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)  # only when empty: never delete what others put there
    except OSError:
        pass


def _exchange_names(path: str, group: torch_dist.ProcessGroup | None) -> list[str]:
    names: list[Any] = [None] * get_world_size(group)
    torch_dist.all_gather_object(names, path, group=_cpu_group(group))
    return [str(n) for n in names]
