"""collect_results: put the per-rank results of a distributed evaluation back in order.

With a ``DistributedSampler`` rank ``r`` of ``W`` holds items ``r, r + W, r + 2W, ...``.
Rank 0 receives the parts one rank at a time, interleaves them, keeps ``None`` results, and
truncates the padding the sampler added. A large part is streamed (``_stream``): its
sender pickles it chunk by chunk while rank 0 unpickles the chunks already there, so rank 0
holds the parts it rebuilt, the one it is rebuilding and a few chunks in transit. No shared
filesystem is needed. With an explicit ``tmpdir`` the parts of the other ranks go through
that folder instead, written atomically and private (0600); rank 0 checks that it sees
every part (a folder that is not shared across nodes is an error on every rank), and only
what this call created is removed.

Every call ends with rank 0's verdict (one small broadcast): when a sender failed to pickle
the rest of its part, or rank 0 failed to unpickle one, every rank raises the same
[`RemoteRankError`][comm_core.RemoteRankError].
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as torch_dist

from comm_core import CommError, get_comm_device, get_cpu_group, get_rank, get_world_size

from ._agree import raise_everywhere
from ._capacity import inline_capacity
from ._faults import transport
from ._frame import Header, Inline, Peer, signature_of
from ._handshake import handshake, start_handshake
from ._serialization import decode, dump, encode
from ._stream import POST_AHEAD_BYTES, PartReader, PartWriter, PeerFailedError
from ._watch import wait_p2p
from .tensors import global_rank

__all__ = ["collect_results", "collect_results_cpu", "collect_results_gpu"]

_DEVICES = ("cpu", "gpu")
_PART_PREFIX = "comm-part-"


def _mode(device: str, tmpdir: str | None) -> int:
    """The path a call takes, in every header: ranks on different paths get a clear error."""
    path = "folder" if device == "cpu" and tmpdir is not None else f"messages/{device}"
    return signature_of(["collect_results", path])


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
        tmpdir: Folder for the parts in cpu mode; it must be shared by all ranks (on every
            node) and writable by this user only: rank 0 unpickles what it finds there.
            Created (0700) by rank 0 if missing and then removed; a folder that existed is
            left in place. None: the parts travel as messages, no shared folder needed.
        group: Process group; the default group when None.

    Returns:
        On rank 0 the ``size`` results in order; None on the other ranks.

    Raises:
        RemoteRankError: A rank passed an invalid argument (``results`` not a list, a
            negative ``size``, an unknown ``device``), could not pickle or write its part,
            or rank 0 could not read one (for instance ``tmpdir`` is not shared by the
            nodes); raised on every rank.
        CollectiveMismatchError: The ranks passed different ``device`` or ``tmpdir`` modes.

    Examples:
        >>> collect_results([0, None, 2], size=2)  # a world of one
        [0, None]
    """
    if get_world_size(group) == 1:
        _check_args(results, size, device)
        return results[:size]
    try:
        _check_args(results, size, device)
    except Exception as exc:
        _report_bad_args(exc, device, tmpdir, group)
    if device == "cpu" and tmpdir is not None:
        return _collect_through_folder(results, size, tmpdir, group)
    mode = _mode(device, tmpdir)
    if device == "cpu":
        return _collect_by_messages(results, size, get_cpu_group(group), torch.device("cpu"), mode)
    return _collect_by_messages(results, size, group, get_comm_device(group), mode)


def _report_bad_args(
    error: BaseException, device: str, tmpdir: str | None, group: torch_dist.ProcessGroup | None
) -> NoReturn:
    """Send an argument error in the first handshake of the call the other ranks make.

    Every path of collect_results starts with a handshake on the group its device names (the
    CPU group in cpu mode), so the other ranks raise at once instead of waiting for this
    rank's part. An unknown device is sent on the CPU group, as cpu mode (the default) does.
    """
    device = device if device in _DEVICES else "cpu"
    route = get_cpu_group(group) if device == "cpu" else group
    header = Header("collect_results", error=error, signature=_mode(device, tmpdir))
    handshake(header, route, same=_SAME, hint=_HINT)
    raise error  # not reached: the handshake raises on every rank


def collect_results_cpu(
    result_part: list[Any], size: int, tmpdir: str | None = None
) -> list[Any] | None:
    """``collect_results(result_part, size, "cpu", tmpdir)``."""
    return collect_results(result_part, size, "cpu", tmpdir)


def collect_results_gpu(result_part: list[Any], size: int) -> list[Any] | None:
    """``collect_results(result_part, size, "gpu")``."""
    return collect_results(result_part, size, "gpu")


def _collect_by_messages(
    results: list[Any],
    size: int,
    group: torch_dist.ProcessGroup | None,
    device: torch.device,
    mode: int,
) -> list[Any] | None:
    if get_rank(group) != 0:
        _send_part(results, group, device, mode)
        return None
    # raises if a rank failed early or takes another path
    peers = handshake(Header("collect_results", signature=mode), group, same=_SAME, hint=_HINT)
    readers = [
        PartReader(_head_of(peer), peer.count, global_rank(group, peer.rank), group, device)
        for peer in peers[1:]
    ]
    parts: list[list[Any]] = [results]
    error: BaseException | None = None
    failed = False
    for index, reader in enumerate(readers):
        try:
            # the receives of this part, and of the next unless it is one large message, are
            # posted before unpickling starts (a receive posted late costs milliseconds on
            # gloo)
            reader.post()
            if index + 1 < len(readers) and readers[index + 1].count <= POST_AHEAD_BYTES:
                readers[index + 1].post()
            if not failed:
                try:
                    parts.append(reader.load())
                except PeerFailedError:  # the sender reports its own error in the verdict
                    failed = True
                except CommError:
                    raise
                except Exception as exc:
                    error, failed = exc, True
            # after a failure the remaining parts are still received: no sender is left
            # blocked, and no stale message is left in the channel for a later call
            reader.finish()
        except CommError:
            # a watched wait found that another rank left the call (a sender whose handshake
            # failed, say): every rank leaves it, as that rank's failure notice says
            raise
        except RuntimeError as exc:
            # the transport: this sender is gone (a killed process). The parts of the
            # others are still received, and the verdict still goes out, so the live
            # senders raise now instead of waiting for rank 0 until the timeout
            error, failed = error or exc, True
    _verdict(failed, error, group, device)
    return _interleave(parts, size)


_SAME = ("signature",)
_HINT = (
    "every rank must call collect_results with the same device, and either every rank or "
    "no rank with a tmpdir."
)


def _head_of(peer: Peer) -> bytes:
    if peer.payload is None:  # the sender's head always fits: capacities are equal
        message = f"collect_results: rank {peer.rank}'s first bytes did not come inline"
        raise RuntimeError(message)
    return peer.payload.cpu().numpy().tobytes()


def _send_part(
    results: list[Any], group: torch_dist.ProcessGroup | None, device: torch.device, mode: int
) -> None:
    def announce(head: bytearray, count: int) -> Callable[[], None]:
        inline = Inline.of_tensor(torch.from_numpy(np.frombuffer(head, dtype=np.uint8)))
        header = Header("collect_results", count=count, signature=mode)
        pending = start_handshake(header, group, payload=inline)

        def outcome() -> None:
            pending.result(same=_SAME, hint=_HINT)

        return outcome

    writer = PartWriter(announce, inline_capacity(group), global_rank(group, 0), group, device)
    error: BaseException | None = None
    try:
        writer.finish(dump(results, writer))
    except Exception as exc:
        if writer.stage == "pickling":  # nothing sent yet: the handshake reports it
            handshake(Header("collect_results", error=exc, signature=mode), group)
        if writer.stage == "announcing":  # the pickler failed while the handshake ran
            with transport("collect_results", group):
                writer.confirm()  # when it fails, that is the error every rank raises
        if writer.stage != "streaming":  # the handshake or the transport failed
            with transport("collect_results", group):  # a lost rank 0: named
                raise
        with transport("collect_results", group):
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
    root = global_rank(group, 0)
    with transport("collect_results", group):  # a lost rank: the library's error, naming it
        if device.type != "cpu":
            # a device group (nccl): one broadcast; messages to each rank would open a
            # communicator per pair
            torch_dist.broadcast(flag, root, group=group)
        elif get_rank(group) != 0:
            received = torch_dist.irecv(flag, root, group=group)
            assert received is not None, "this rank is a member of the group"
            wait_p2p(received, "collect_results", group, device)
        else:
            # on a CPU group rank 0 sends the verdict to each rank itself, not by a
            # broadcast: a broadcast may route it through another rank, and when that rank
            # is dead (killed in the middle of its part) the ranks behind it would wait for
            # the verdict until the timeout
            lost: RuntimeError | None = None
            works = []
            for peer in range(1, get_world_size(group)):
                try:  # a send to a dead rank may fail at once or when waited for
                    works.append(torch_dist.isend(flag, global_rank(group, peer), group=group))
                except RuntimeError as exc:
                    lost = lost or exc
            for work in works:
                try:
                    if work is not None:
                        wait_p2p(work, "collect_results", group, device)
                except CommError:  # a rank left the call: every rank leaves it
                    raise
                except RuntimeError as exc:  # a dead rank: the others still hear the verdict
                    lost = lost or exc
            if lost is not None and not failed:  # the others finished: only rank 0 raises
                raise lost
    if int(flag.item()):
        raise_everywhere("collect_results", error, group)


def _collect_through_folder(
    results: list[Any], size: int, tmpdir: str, group: torch_dist.ProcessGroup | None
) -> list[Any] | None:
    me = get_rank(group)
    mode = _mode("cpu", tmpdir)
    cpu_group = get_cpu_group(group)
    device = torch.device("cpu")
    # 1. rank 0 alone creates a missing folder, so it alone knows whether to remove it; a
    #    rank that does not see the folder then is on a node that does not share it
    created = False
    error: BaseException | None = None
    if me == 0:
        try:
            os.makedirs(tmpdir, mode=0o700)
            created = True
        except FileExistsError:  # there already (exist_ok would not tell who created it)
            if not os.path.isdir(tmpdir):
                error = NotADirectoryError(f"collect_results: tmpdir {tmpdir!r} is a file.")
        except Exception as exc:
            error = exc
    header = Header("collect_results", error=error, root=0, signature=mode)
    try:
        handshake(header, cpu_group, same=_SAME, hint=_HINT)
    except BaseException:  # another rank failed (a bad argument): no folder is left behind
        if created:
            _remove_if_empty(tmpdir)
        raise
    # 2. every other rank writes its part, atomically and private: rank 0 never sees a
    #    half-written file, and no other user can read or swap a part
    path = ""
    if me != 0:
        try:
            if not os.path.isdir(tmpdir):
                raise _not_shared(tmpdir, [me], created_by_rank_0=None)
            path = os.path.join(tmpdir, f"{_PART_PREFIX}{me}-{uuid.uuid4().hex}.bin")
            _write_private(path, results)
        except Exception as exc:
            error = exc
    try:
        handshake(Header("collect_results", error=error, root=0, signature=mode), cpu_group)
    except BaseException:
        _remove(path)
        if created:
            _remove_if_empty(tmpdir)
        raise
    # 3. rank 0 reads the parts in rank order from its own view of the folder (a shared
    #    folder may be mounted elsewhere on another node), removing each file it has read
    names = _exchange_names(os.path.basename(path), cpu_group)
    if me != 0:
        try:
            _verdict(False, None, cpu_group, device)
        finally:
            _remove(path)  # still there only when rank 0 could not see it
        return None
    parts: list[list[Any]] = [results]
    paths = [os.path.join(tmpdir, name) for name in names[1:]]
    unseen = _unseen(tmpdir, paths)
    if unseen:
        error = _not_shared(tmpdir, unseen, created_by_rank_0=created)
    for part_path in paths:
        if error is None:  # after a failure the other parts are still removed
            try:
                _check_owner(part_path)
                parts.append(decode(np.fromfile(part_path, dtype=np.uint8)))
            except Exception as exc:
                error = exc
        _remove(part_path)
    if created:
        _remove_if_empty(tmpdir)
    _verdict(error is not None, error, cpu_group, device)
    return _interleave(parts, size)


_VISIBLE_WITHIN_S = 2.0


def _unseen(tmpdir: str, paths: list[str]) -> list[int]:
    """The ranks (from 1) whose part file rank 0 does not see, after a short grace.

    A network filesystem may answer from a cached listing for a moment after another node
    created a file; listing the folder makes it look again.
    """
    deadline = time.monotonic() + _VISIBLE_WITHIN_S
    while True:
        unseen = [rank for rank, p in enumerate(paths, start=1) if not os.path.exists(p)]
        if not unseen or time.monotonic() > deadline:
            return unseen
        try:
            os.listdir(tmpdir)
        except OSError:
            return unseen
        time.sleep(0.1)


class FolderNotSharedError(RuntimeError):
    """collect_results: a rank does not see the folder or files another rank wrote."""


def _not_shared(tmpdir: str, ranks: list[int], created_by_rank_0: bool | None) -> Exception:
    if created_by_rank_0 is None:  # raised on a rank that does not see the folder at all
        seen = f"rank {ranks[0]} does not see the folder, which rank 0 has"
    else:
        listed = ", ".join(map(str, ranks))
        seen = f"rank 0 does not see the part file(s) of rank(s) {listed} in it"
    message = (
        f"collect_results: tmpdir {tmpdir!r} is not a folder shared by the ranks: {seen}. "
        "In cpu mode a tmpdir must be on a filesystem every node mounts (at the same path). "
        "Pass a shared folder, or tmpdir=None to send the parts as messages, which needs "
        "no shared filesystem."
    )
    return FolderNotSharedError(message)


def _check_owner(path: str) -> None:
    """Refuse to unpickle a part file that another user owns (it could run any code)."""
    owner = os.stat(path).st_uid
    if hasattr(os, "getuid") and owner != os.getuid():
        message = (
            f"collect_results: part file {path!r} belongs to user id {owner}, not to this "
            f"user ({os.getuid()}); it is not unpickled. Give tmpdir a folder only you can "
            "write to."
        )
        raise PermissionError(message)


def _write_private(path: str, results: list[Any]) -> None:
    """Write the frame of ``results`` to ``path`` (mode 0600), through a temporary name."""
    encoded = encode(results)
    frame = np.empty(encoded.nbytes, dtype=np.uint8)
    encoded.write_into(frame)
    partial = path + ".partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(frame.data)
        os.replace(partial, path)
    except BaseException:
        _remove(partial)
        raise


def _remove(path: str) -> None:
    """Remove a part file and its temporary name, if they are there."""
    if not path:
        return
    for name in (path, path + ".partial"):
        try:
            os.remove(name)
        except OSError:  # gone already, or not ours to remove: never a reason to stop here
            pass


def _remove_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)  # only when empty: never delete what others put there
    except OSError:
        pass


def _exchange_names(name: str, group: torch_dist.ProcessGroup | None) -> list[str]:
    names: list[Any] = [None] * get_world_size(group)
    torch_dist.all_gather_object(names, name, group=group)
    return [str(n) for n in names]
