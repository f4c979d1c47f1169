"""collect_results under faults: a tmpdir that is not shared, ranks on different paths,
groups under a backend string other than "gloo", destroy and re-init; plus the linear
reassembly of large in-band objects and the mode of part files."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from comm_collectives import _faults, _stream, results
from comm_core import RemoteRankError
from comm_core.testing import RanksFailedError, WorldPool
from tests.helpers import caught

# ---------------------------------------------------------------- M1: a folder not shared


def folder_per_node(base: str, shared_with_rank_0: list[int]) -> dict[str, Any]:
    """Each rank gets its own folder, as on its own node, except the ranks listed, which
    see rank 0's: rank 0 then misses the parts of the others."""
    rank = dist.get_rank()
    node = 0 if rank == 0 or rank in shared_with_rank_0 else rank
    folder = os.path.join(base, f"node{node}")
    os.makedirs(folder, exist_ok=True)
    first = caught(dist.collect_results, [f"r{rank}"], dist.get_world_size(), tmpdir=folder)
    dist.barrier()  # every rank has cleaned up before the folders are listed
    left = sorted(os.listdir(folder))
    again = dist.collect_results([f"r{rank}"], dist.get_world_size())  # no stale state
    return {"first": first, "left": left, "exists": os.path.isdir(folder), "again": again}


def folder_missing_elsewhere(base: str) -> dict[str, Any]:
    """Rank 0 creates its folder; rank 1's node does not have it."""
    rank = dist.get_rank()
    folder = os.path.join(base, f"missing{rank}")
    first = caught(dist.collect_results, [rank], 2, tmpdir=folder)
    return {"first": first, "exists": os.path.exists(folder)}


@pytest.mark.parametrize("world", [2, 3])
def test_a_folder_not_shared_raises_on_every_rank(
    comm_run_distributed: Any, tmp_path: Path, world: int
) -> None:
    shared = [2] if world == 3 else []  # rank 2 shares rank 0's node: only rank 1 is unseen
    out = comm_run_distributed(folder_per_node, str(tmp_path), shared, world_size=world)
    for r in out:
        name, message = r["first"]
        assert name == "RemoteRankError", message
        assert "collect_results failed on rank(s) 0" in message
        assert "is not a folder shared by the ranks" in message
        assert "rank 0 does not see the part file(s) of rank(s) 1 in it" in message
        assert "tmpdir=None" in message
        assert r["left"] == []  # every part file was removed, by rank 0 or by its writer
        assert r["exists"]  # the user's folders stay
        assert r["again"] == ([f"r{i}" for i in range(world)] if r is out[0] else None)


def test_a_folder_only_rank_0_sees_raises_on_every_rank(
    comm_run_distributed: Any, tmp_path: Path
) -> None:
    out = comm_run_distributed(folder_missing_elsewhere, str(tmp_path), world_size=2)
    for r in out:
        name, message = r["first"]
        assert name == "RemoteRankError", message
        assert "collect_results failed on rank(s) 1" in message
        assert "rank 1 does not see the folder, which rank 0 has" in message
    assert not out[0]["exists"]  # rank 0 created it, so rank 0 removed it
    assert not out[1]["exists"]


# ---------------------------------------------------------------- M5: a bad argument on one rank


def bad_argument_on(victim: int, base: str) -> dict[str, Any]:
    """One rank passes an invalid argument, by messages and through a folder (rank 0 creates
    it): every rank raises at once, and the next call works."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    odd = rank == victim
    folder = os.path.join(base, "parts")  # missing: rank 0 creates it, and must remove it
    out: dict[str, Any] = {}
    for tmpdir in (None, folder):
        cases = {
            "tuple": (((rank,) if odd else [rank]), world, "cpu"),
            "size": ([rank], -1 if odd else world, "cpu"),
            "device": ([rank], world, "npu" if odd else "cpu"),
        }
        for name, (part, size, device) in cases.items():
            start = time.monotonic()
            got = caught(dist.collect_results, part, size, device=device, tmpdir=tmpdir)
            key = f"{name}/{'folder' if tmpdir else 'messages'}"
            out[key] = (*got, time.monotonic() - start)
    dist.barrier()  # rank 0 has cleaned up before any rank looks
    out["left"] = os.path.exists(folder)
    out["again"] = dist.collect_results([rank], world)
    return out


@pytest.mark.parametrize("victim", [0, 1])
def test_a_bad_argument_on_one_rank_raises_on_every_rank(
    comm_run_distributed: Any, tmp_path: Path, victim: int
) -> None:
    out = comm_run_distributed(bad_argument_on, victim, str(tmp_path), world_size=2, timeout=60)
    for rank, r in enumerate(out):
        for key in ("tuple", "size", "device"):
            for path in ("messages", "folder"):
                name, message, took = r[f"{key}/{path}"]
                assert name == "RemoteRankError", (rank, key, path, message)
                assert f"collect_results failed on rank(s) {victim}" in message
                assert took < 10.0
        assert "results must be a list, got tuple" in r["tuple/messages"][1]
        assert "size must be >= 0, got -1" in r["size/folder"][1]
        assert "device must be one of cpu, gpu, got 'npu'" in r["device/messages"][1]
        assert r["left"] is False  # rank 0 removed the folder it created
        assert r["again"] == ([0, 1] if rank == 0 else None)


# ---------------------------------------------------------------- M10: a rank killed mid-call


def _kill_me() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillOnPickle:
    """Pickling it kills the sender: its part is then cut off in the middle of its stream."""

    def __reduce__(self) -> tuple[Any, ...]:
        _kill_me()
        return (KillOnPickle, ())


class KillOnLoad:
    """Unpickling it kills the process that reads it: rank 0."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_kill_me, ())


def killed_in_collect(victim: int, where: str, folder: str, tmpdir: str | None) -> str:
    """``victim`` dies while collect_results streams (``"pickle"``: pickling its part, after
    8 MiB were sent; ``"announce"``: pickling item 10,000 of 30,000 short strings, in its
    second 64 KiB frame, while its part's handshake travels) or, on rank 0, while reading
    the part of rank ``victim`` (``"load"``). The survivors record what they raised (the
    world ends with the dead rank)."""
    _faults._LIVENESS_WAIT_S = 1.0
    rank, world = dist.get_rank(), dist.get_world_size()
    part: list[Any]
    if where == "announce":
        part = [f"{rank}-{i}" for i in range(30_000)]
        if rank == victim:
            part[10_000] = KillOnPickle()
    else:
        part = [bytes(1 << 20) for _ in range(8)]
        if rank == victim:
            part.append(KillOnPickle() if where == "pickle" else KillOnLoad())
    record: dict[str, Any] = {"raised": "", "ranks": None, "lost": False}
    start = time.monotonic()
    try:
        dist.collect_results(part, world * len(part), tmpdir=tmpdir)
    except RemoteRankError as exc:
        lost = [f.rank for f in exc.failures if f.error_type == "comm.RankLost"]
        record.update(raised="RemoteRankError", ranks=list(exc.ranks), lost=lost)
    except Exception as exc:
        record["raised"] = f"unexpected {type(exc).__name__}: {exc}"
    record["seconds"] = round(time.monotonic() - start, 3)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    return "survived"


@pytest.fixture(scope="module")
def world_of_3() -> Iterator[WorldPool]:
    # the process group's own timeout is far above the bound: no survivor may wait for it
    with WorldPool(3, timeout=60.0, pg_timeout=60.0) as pool:
        yield pool


# (victim, where it dies, through a folder): a sender while it streams (rank 1: rank 2,
# done with its part, waits for the verdict, which a broadcast would route through rank 1),
# rank 0 while it reads a part (it then dies in the middle of the call on either path), a
# sender while its part's handshake travels (rank 1 or rank 2)
KILLS = [
    (1, "pickle", False),
    (1, "load", False),
    (1, "load", True),
    (1, "announce", False),
    (2, "announce", False),
]


@pytest.mark.parametrize(("victim", "where", "folder"), KILLS)
def test_a_rank_killed_in_collect_results_is_named_by_every_survivor(
    world_of_3: WorldPool, tmp_path: Path, victim: int, where: str, folder: bool
) -> None:
    dead = 0 if where == "load" else victim
    records = tmp_path / "records"
    records.mkdir()
    tmpdir = str(tmp_path / "parts") if folder else None
    with pytest.raises(RanksFailedError) as info:
        world_of_3.run(killed_in_collect, victim, where, str(records), tmpdir, timeout=60.0)
    states = {r.rank: r.state for r in info.value.reports}
    # a stuck survivor fails: killed while its handshake's frames travel, the sender is seen
    # by one survivor, which leaves, while the other may wait on that live survivor (in the
    # handshake's all-to-all, or for its part's stream); the watched waits of the
    # collectives make it leave too (comm_collectives._watch)
    assert states == {r: "died" if r == dead else "ok" for r in range(3)}, str(info.value)
    for rank in {0, 1, 2} - {dead}:
        record = json.loads((records / f"rank{rank}.json").read_text())
        assert record["raised"] == "RemoteRankError", record
        assert dead in record["ranks"], record
        assert dead in record["lost"], record
        assert record["seconds"] < 10.0, record


# ---------------------------------------------------------------- Minor 8: different paths


def mixed_modes(base: str) -> dict[str, Any]:
    rank = dist.get_rank()
    tmpdir = base if rank == 0 else None  # rank 0 through a folder, the others by messages
    first = caught(dist.collect_results, [rank], 2, tmpdir=tmpdir)
    devices = caught(dist.collect_results, [rank], 2, device="cpu" if rank else "gpu")
    again = dist.collect_results([rank], 2)
    return {"first": first, "devices": devices, "again": again}


def test_ranks_on_different_paths_get_a_mismatch_error(
    comm_run_distributed: Any, tmp_path: Path
) -> None:
    out = comm_run_distributed(mixed_modes, str(tmp_path), world_size=2)
    for rank, r in enumerate(out):
        for key in ("first", "devices"):
            name, message = r[key]
            assert name == "CollectiveMismatchError", message
            assert "the same device, and either every rank or no rank with a tmpdir" in message
        assert r["again"] == ([0, 1] if rank == 0 else None)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- M2, M3: "cpu:gloo" groups


def subgroup_then_world(store_path: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    sub = torch_dist.new_group([1, 2])
    if rank in (1, 2):
        out["sub"] = dist.collect_results([f"r{rank}"], 2, group=sub)
    everyone = torch_dist.new_group([0, 1, 2])  # hung when only [1, 2] made a twin group
    value = torch.tensor([float(rank)])
    torch_dist.all_reduce(value, group=everyone)
    out["sum"] = value.item()
    out["first"] = dist.collect_results([rank], 3)
    dist.destroy_dist()
    dist.init_dist("pytorch", "cpu:gloo", timeout=60, init_method=f"file://{store_path}")
    out["after_reinit"] = dist.collect_results([rank * 10], 3)  # failed on a stale twin
    out["objects"] = dist.all_gather_object(rank)
    return out


def test_cpu_gloo_subgroup_and_reinit(cpu_gloo_world: WorldPool, tmp_path: Path) -> None:
    out = cpu_gloo_world.run(subgroup_then_world, str(tmp_path / "store2"))
    assert "sub" not in out[0]
    assert out[1]["sub"] == ["r1", "r2"]  # rank 1 is rank 0 of the subgroup
    assert out[2]["sub"] is None
    for rank, r in enumerate(out):
        assert r["sum"] == 0 + 1 + 2
        assert r["first"] == ([0, 1, 2] if rank == 0 else None)
        assert r["after_reinit"] == ([0, 10, 20] if rank == 0 else None)
        assert r["objects"] == [0, 1, 2]


# ---------------------------------------------------------------- M6: linear reassembly


def test_chunk_buffer_copies_each_byte_once_and_keeps_chunks_as_received() -> None:
    buffer = _stream.ChunkBuffer()
    chunks = [bytes([i % 251]) * _stream.CHUNK_BYTES for i in range(64)]  # 8 MiB
    for chunk in chunks:
        buffer.append(chunk)
    # appending never joins: the chunks are held as they came (no copy per chunk)
    assert all(held is chunk for held, chunk in zip(buffer._chunks, chunks))
    head = buffer.read(10)
    big = bytearray(len(chunks) * _stream.CHUNK_BYTES - 10 - 5)
    assert buffer.readinto(memoryview(big)) == len(big)
    tail = buffer.read(100)  # only 5 bytes are left
    expected = b"".join(chunks)
    assert head + bytes(big) + tail == expected
    assert buffer.size == 0
    assert buffer.copied == len(expected)  # every byte copied out once: linear


def test_chunk_buffer_reads_across_chunks_and_lines() -> None:
    buffer = _stream.ChunkBuffer()
    for piece in (b"ab", b"c\nde", b"", b"f", b"g\n", b"h"):
        buffer.append(piece)
    assert buffer.has_line()
    assert buffer.readline() == b"abc\n"
    assert buffer.read(3) == b"def"
    assert buffer.readline() == b"g\n"
    assert not buffer.has_line()
    assert buffer.readline() == b"h"
    assert buffer.read(4) == b""
    assert buffer.copied == 10


def big_inband_object(nbytes: int) -> dict[str, Any]:
    rank = dist.get_rank()
    payload = bytes([rank + 1]) * nbytes  # an in-band object: bytes are pickled in the stream
    out = dist.collect_results([payload, f"after {rank}"], 4)
    if out is None:
        return {"out": None}
    return {"out": [(len(item), item[:1]) if isinstance(item, bytes) else item for item in out]}


def test_a_large_in_band_object_comes_back_whole(comm_run_distributed: Any) -> None:
    nbytes = 24 * 1024 * 1024 + 3  # streamed in about 200 chunks
    out = comm_run_distributed(big_inband_object, nbytes, world_size=2, timeout=120)
    assert out[1]["out"] is None
    assert out[0]["out"] == [(nbytes, b"\x01"), (nbytes, b"\x02"), "after 0", "after 1"]


# ---------------------------------------------------------------- Security 22: private files


def test_part_files_are_written_private_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        path = str(tmp_path / "part.bin")
        results._write_private(path, [1, "two", torch.arange(3)])
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not os.path.exists(path + ".partial")
    import numpy as np

    from comm_collectives._serialization import decode

    back = decode(np.fromfile(path, dtype=np.uint8))
    assert back[:2] == [1, "two"]
    assert back[2].tolist() == [0, 1, 2]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs chown")
def test_a_part_file_of_another_user_is_not_unpickled(tmp_path: Path) -> None:
    path = str(tmp_path / "part.bin")
    results._write_private(path, ["mine"])
    results._check_owner(path)  # this user's own file passes
    os.chown(path, os.getuid() + 4242, -1)
    with pytest.raises(PermissionError, match=f"belongs to user id {os.getuid() + 4242}"):
        results._check_owner(path)
