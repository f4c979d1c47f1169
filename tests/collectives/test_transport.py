"""The transport under the collectives: inline data in the handshake frame, reused buffers."""

from __future__ import annotations

import gc
import itertools
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from comm_collectives import _buffers as buffers
from comm_collectives._capacity import inline_capacity


def capacity_adapts() -> dict[str, Any]:
    """Every rank records the capacity after each step; a fresh group starts at 4 KiB."""
    rank, world = dist.get_dist_info()
    group = torch_dist.new_group(list(range(world)))
    caps = {"start": inline_capacity(group)}
    blob = bytes([rank]) * 10_000  # pickles to ~10 KB: too big for 4 KiB, fits 12 KiB
    first = dist.all_gather_object(blob, group=group)  # long path; the capacity grows
    caps["after 10 KB"] = inline_capacity(group)
    second = dist.all_gather_object(blob, group=group)  # inline now
    caps["again"] = inline_capacity(group)
    for _ in range(32):  # 32 calls using a quarter of it or less: halved
        dist.all_reduce(torch.ones(1), group=group)
    caps["after 32 small"] = inline_capacity(group)
    huge = dist.all_gather_object(np.full(100_000, rank, dtype=np.float64), group=group)
    caps["after 800 KB"] = inline_capacity(group)  # beyond the budget: not grown
    # one rank's object fits, the other's does not: both take the long path together
    mixed = dist.all_gather_object(b"s" if rank == 0 else b"L" * 20_000, group=group)
    caps["after mixed"] = inline_capacity(group)
    torch_dist.destroy_process_group(group)
    return {
        "caps": caps,
        "first_second": (
            [len(b) for b in first],
            [b[0] for b in first],
            first == second,
        ),
        "huge": [(a.shape, float(a.min()), float(a.max())) for a in huge],
        "mixed": [(b[:1], len(b)) for b in mixed],
    }


@pytest.mark.parametrize("world", [2, 3])
def test_inline_capacity_adapts_the_same_on_every_rank(
    comm_run_distributed: Any, world: int
) -> None:
    results = comm_run_distributed(capacity_adapts, world_size=world)
    # budget: min(256 KiB, 1 MiB // world), so an 800 KB object never rides inline
    assert results[0]["caps"] == {
        "start": 4096,
        "after 10 KB": 12288,  # 10 112 bytes + an eighth, in 4 KiB steps
        "again": 12288,
        "after 32 small": 8192,
        "after 800 KB": 8192,
        "after mixed": 24576,
    }
    for r in results:
        assert r["caps"] == results[0]["caps"]
        assert r["first_second"] == ([10_000] * world, list(range(world)), True)
        assert r["huge"] == [((100_000,), float(k), float(k)) for k in range(world)]
        assert r["mixed"] == [(b"s", 1)] + [(b"L", 20_000)] * (world - 1)


# The long path: the handshake, the vote on the local work after it, the data transfer; a
# reduction moves its data in two steps (all-to-all, then all-gather of the reduced chunks).
# all_reduce and broadcast stage their data before the handshake (a tensor's size tells
# every rank that it takes the long path), so no vote follows; sync_random_seed has no
# local work after the handshake.
_LONG = {"all_reduce": 3, "broadcast": 2, "all_reduce_dict": 4, "sync_random_seed": 2}


def collectives_per_call() -> dict[str, int]:
    """How many collectives each small call issues, read from the group's sequence number."""
    rank = dist.get_rank()
    group = torch_dist.distributed_c10d._get_default_group()
    calls = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(3)),
        "broadcast": lambda: dist.broadcast(torch.ones(3)),
        "all_gather": lambda: dist.all_gather(torch.ones(rank + 1)),
        "gather": lambda: dist.gather(torch.ones(rank + 1)),
        "all_gather_object": lambda: dist.all_gather_object({"rank": rank}),
        "gather_object": lambda: dist.gather_object({"rank": rank}),
        "broadcast_object_list": lambda: dist.broadcast_object_list([rank]),
        "all_reduce_dict": lambda: dist.all_reduce_dict({"a": torch.ones(()), "b": torch.ones(2)}),
        "sync_random_seed": dist.sync_random_seed,
    }
    counts = {}
    for name, call in calls.items():
        before = group._get_sequence_number_for_group()
        call()
        counts[name] = group._get_sequence_number_for_group() - before
    return counts


def collectives_per_call_long() -> dict[str, int]:
    """The same calls with inline data switched off: handshake plus data transfer."""
    from comm_collectives._capacity import inline_limit

    with inline_limit(0):
        return collectives_per_call()


@pytest.mark.parametrize(("path", "expected"), [("inline", 1), ("long", 3)])
def test_small_calls_take_one_collective_with_inline_data(
    comm_run_distributed: Any, path: str, expected: int
) -> None:
    case = collectives_per_call if path == "inline" else collectives_per_call_long
    results = comm_run_distributed(case, world_size=2)
    for counts in results:
        wanted = dict.fromkeys(counts, expected)
        if path == "long":
            wanted.update(_LONG)
        assert counts == wanted
        assert len(counts) == 9


def _summary(arrays: list[Any]) -> list[tuple[float, float, int]]:
    return [(float(a.min()), float(a.max()), int(a.size)) for a in arrays]


def buffers_reused_safely() -> dict[str, Any]:
    """Large results stay intact while later calls reuse the transfer buffers."""
    rank = dist.get_rank()
    n = 1 << 19  # 4 MiB of float64 a rank: far beyond any inline capacity
    first = dist.all_gather_object(np.full(n, rank, dtype=np.float64))
    kept_tensor = dist.all_gather(torch.full((n + rank,), float(10 + rank)))
    for step in range(3):  # buffers come and go; the kept results must not change
        dist.all_gather_object(np.full(n, 100 + step, dtype=np.float64))
    box = [np.full(n, 7.0) if rank == 0 else None]
    dist.broadcast_object_list(box)
    out: dict[str, Any] = {
        "first": _summary(first),
        "kept_tensor": [(float(t.min()), float(t.max()), t.numel()) for t in kept_tensor],
        "broadcast": _summary(box),
    }
    del first, kept_tensor, box
    gc.collect()
    out["cached_after_release"] = buffers._pool.cached_bytes() > 0
    again = dist.all_gather_object(np.full(n, -rank, dtype=np.float64))
    out["again"] = _summary(again)
    dist.empty_cache()
    out["cached_after_empty"] = buffers._pool.cached_bytes()
    return out


def test_results_stay_intact_while_buffers_are_reused(comm_run_distributed: Any) -> None:
    n = 1 << 19
    for r in comm_run_distributed(buffers_reused_safely, world_size=2):
        assert r["first"] == [(0.0, 0.0, n), (1.0, 1.0, n)]
        assert r["kept_tensor"] == [(10.0, 10.0, n), (11.0, 11.0, n + 1)]
        assert r["broadcast"] == [(7.0, 7.0, n)]
        assert r["cached_after_release"] is True
        assert r["again"] == [(0.0, 0.0, n), (-1.0, -1.0, n)]
        assert r["cached_after_empty"] == 0


def test_a_buffer_returns_to_the_cache_only_when_its_last_view_is_gone() -> None:
    buffers.empty_cache()
    cpu = torch.device("cpu")
    t = buffers.empty_bytes(3 << 20, cpu)
    t.fill_(5)
    array_view = t.numpy()[10:20]
    tensor_view = t.view(torch.float32)[3:]
    del t
    assert buffers._pool.cached_bytes() == 0
    del array_view
    assert buffers._pool.cached_bytes() == 0
    assert int(tensor_view.view(torch.uint8)[0]) == 5
    del tensor_view
    assert buffers._pool.cached_bytes() == 3 << 20
    reused = buffers.empty_bytes(2 << 20, cpu)  # the cached 3 MiB buffer serves it
    assert buffers._pool.cached_bytes() == 0
    assert int(reused[0]) == 5  # same memory, not a fresh page
    del reused
    buffers.empty_cache()
    assert buffers._pool.cached_bytes() == 0


def test_small_and_device_buffers_are_not_cached() -> None:
    buffers.empty_cache()
    small = buffers.empty_bytes(1000, torch.device("cpu"))
    assert small.numel() == 1000
    del small
    assert buffers._pool.cached_bytes() == 0


def test_cache_limit_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    buffers.empty_cache()
    monkeypatch.setenv("COMM_BUFFER_CACHE_MB", "2")
    big = buffers.empty_bytes(3 << 20, torch.device("cpu"))
    del big  # 3 MiB > the 2 MiB limit: freed, not kept
    assert buffers._pool.cached_bytes() == 0
    # A bad value never raises (it is read inside a finalizer, and may differ between
    # ranks): one warning, and the default of 256 MiB.
    monkeypatch.setenv("COMM_BUFFER_CACHE_MB", "lots")
    with pytest.warns(
        RuntimeWarning,
        match="COMM_BUFFER_CACHE_MB must be a number of MiB, got 'lots'; the default 256 MiB is used",
    ):
        assert buffers._limit() == 256 << 20
    big = buffers.empty_bytes(3 << 20, torch.device("cpu"))
    del big  # given back under the default limit: kept, with no exception in the finalizer
    assert buffers._pool.cached_bytes() == 3 << 20
    monkeypatch.setenv("COMM_BUFFER_CACHE_MB", "-5")
    assert buffers._limit() == 0
    monkeypatch.setenv("COMM_BUFFER_CACHE_MB", "-inf")
    assert buffers._limit() == 0
    buffers.empty_cache()


def test_decoded_arrays_keep_their_buffer_alive() -> None:
    from comm_collectives._serialization import decode, encode

    buffers.empty_cache()
    encoded = encode({"a": np.arange(1 << 19, dtype=np.float32), "t": torch.ones(1 << 18)})
    frame = buffers.empty_bytes(encoded.nbytes, torch.device("cpu"))
    encoded.write_into(frame.numpy())
    obj = decode(frame.numpy())
    del frame
    array_slice, tensor_slice = obj["a"][5:], obj["t"][2:]
    del obj
    as_tensor = torch.from_numpy(array_slice)
    del array_slice
    assert buffers._pool.cached_bytes() == 0
    assert float(as_tensor[0]) == 5.0
    assert float(tensor_slice.sum()) == (1 << 18) - 2
    del as_tensor, tensor_slice
    assert buffers._pool.cached_bytes() > 0
    buffers.empty_cache()


def _large_object(src: int) -> dict[str, Any]:
    """An object whose frame has pieces above and below the direct threshold (4 MiB)."""
    n = (4 << 20) // 4 + 7  # a float32 array just over 4 MiB
    grid = torch.arange(2048 * 1024, dtype=torch.float32).reshape(2048, 1024) + src
    return {
        "array": np.arange(n, dtype=np.float32) * (src + 1),
        "small": torch.arange(10) * (src + 2),
        "text": f"from rank {src}",
        "float64": torch.full((1 << 19,), float(src) + 0.5, dtype=torch.float64),  # 4 MiB
        "read_only": np.frombuffer(bytes(range(256)) * (1 << 14), dtype=np.uint8),  # 4 MiB
        "strided": grid[:, ::2],  # not contiguous: pickled as a contiguous 4 MiB copy
        "bf16": torch.full((3,), 1.5 + src, dtype=torch.bfloat16),
        "words": [f"w{i}" for i in range(600_000)],  # an in-band stream over 4 MiB
    }


def expected_large_object(src: int) -> dict[str, Any]:
    """Hand-derived description of :func:`_large_object` (independent of pickling)."""
    n = (4 << 20) // 4 + 7
    return {
        "array": ((n,), float(src + 1), float((n - 1) * (src + 1))),
        "small": [k * (src + 2) for k in range(10)],
        "text": f"from rank {src}",
        "float64": (torch.float64, 1 << 19, (float(src) + 0.5) * (1 << 19)),
        "read_only": (4 << 20, 1, (255 * 256 // 2) * (1 << 14)),
        "strided": ((2048, 512), 1024.0 + 2 + src, 2047 * 1024 + 1022 + src),
        "bf16": (torch.bfloat16, [1.5 + src] * 3),
        "words": (600_000, "w0", "w599999"),
    }


def _describe(obj: dict[str, Any]) -> dict[str, Any]:
    array, grid = obj["array"], obj["strided"]
    return {
        "array": (array.shape, float(array[1]), float(array[-1])),
        "small": obj["small"].tolist(),
        "text": obj["text"],
        "float64": (obj["float64"].dtype, obj["float64"].numel(), float(obj["float64"].sum())),
        "read_only": (
            obj["read_only"].size,
            int(obj["read_only"][257]),
            int(obj["read_only"].sum()),
        ),
        "strided": (tuple(grid.shape), float(grid[1, 1]), float(grid[-1, -1])),
        "bf16": (obj["bf16"].dtype, obj["bf16"].tolist()),
        "words": (len(obj["words"]), obj["words"][0], obj["words"][-1]),
    }


def broadcast_large_pieces(src: int, long_path: bool) -> dict[str, Any]:
    """broadcast_object_list of :func:`_large_object` from ``src``; every rank records the
    plan of messages it derived and how many collectives the call took."""
    from comm_collectives import objects
    from comm_collectives._capacity import inline_limit

    rank = dist.get_rank()
    group = torch_dist.distributed_c10d._get_default_group()
    plans: list[list[tuple[int, int, int]]] = []
    sent: list[tuple[int, str | None]] = []  # the root's messages: piece, memory they lie in
    original, original_message = objects._broadcast_plan, objects._plan_message
    obj = _large_object(src)
    sources = {
        "array": (obj["array"].ctypes.data, obj["array"].nbytes),
        "float64": (obj["float64"].data_ptr(), obj["float64"].numel() * 8),
        "read_only": (obj["read_only"].ctypes.data, obj["read_only"].nbytes),
    }

    def recording(*args: Any) -> list[tuple[int, int, int]]:
        plan = original(*args)
        plans.append(plan)
        return plan

    def recording_message(encoded: Any, first: int, end: int, piece: int) -> torch.Tensor:
        message = original_message(encoded, first, end, piece)
        address = message.data_ptr()
        inside = [name for name, (a, n) in sources.items() if a <= address < a + n]
        sent.append((piece, inside[0] if inside else None))
        return message

    objects._broadcast_plan = recording  # type: ignore[assignment]
    objects._plan_message = recording_message  # type: ignore[assignment]
    try:
        box: list[Any] = [obj if rank == src else None]
        before = group._get_sequence_number_for_group()
        if long_path:
            with inline_limit(0):
                dist.broadcast_object_list(box, src=src)
        else:
            dist.broadcast_object_list(box, src=src)
        collectives = group._get_sequence_number_for_group() - before
        # one big array alone: the handshake and one message, as for a copied frame
        single: list[Any] = [np.full(1 << 21, 3.0) if rank == src else None]
        before = group._get_sequence_number_for_group()
        dist.broadcast_object_list(single, src=src)
        single_collectives = group._get_sequence_number_for_group() - before
    finally:
        objects._broadcast_plan = original  # type: ignore[assignment]
        objects._plan_message = original_message  # type: ignore[assignment]
    return {
        "object": _describe(box[0]),
        "plans": plans,
        "sent": sent,
        "collectives": collectives,
        "single": (float(single[0].min()), float(single[0].max()), single[0].size),
        "single_collectives": single_collectives,
    }


@pytest.mark.parametrize("long_path", [False, True])
@pytest.mark.parametrize(("world", "src"), [(2, 0), (3, 2)])
def test_broadcast_sends_large_pieces_from_their_own_memory(
    comm_run_distributed: Any, world: int, src: int, long_path: bool
) -> None:
    from comm_collectives.objects import DIRECT_BYTES

    results = comm_run_distributed(broadcast_large_pieces, src, long_path, world_size=world)
    expected = expected_large_object(src)
    plans = results[0]["plans"]
    for r in results:
        assert r["object"] == expected
        assert r["plans"] == plans  # every rank derived the same messages
        assert r["single"] == (3.0, 3.0, 1 << 21)
        # the handshake, the vote after the local work, then the array's own memory
        assert r["single_collectives"] == 3
    (plan, single) = plans
    for r in results:  # only the root sends
        assert (r["sent"] != []) is (r is results[src])
    if long_path:  # no head inline: the frame goes as one copied message
        assert len(plan) == 1
        assert (plan[0][0], plan[0][2]) == (0, -1)
        assert results[0]["collectives"] == 3
        assert results[src]["sent"][0] == (-1, None)
        return
    # the root's messages of the array and the tensor lie in their own memory; the
    # read-only array is copied; the single array of the second call is piece 1
    assert results[src]["sent"][len(plan) :] == [(1, None)]
    assert results[src]["sent"][: len(plan)] == [
        (0, None),
        (1, "array"),
        (-1, None),
        (3, "float64"),
        (4, None),
        (5, None),
        (-1, None),
    ]
    # the stream and the five buffers of 4 MiB or more go from their own memory, in frame
    # order; the small buffers between them go copied, in runs
    direct = [(first, end, piece) for first, end, piece in plan if piece >= 0]
    assert [piece for _, _, piece in direct] == [0, 1, 3, 4, 5]
    assert all(end - first >= DIRECT_BYTES - 4096 for first, end, _ in direct)
    assert [piece for _, _, piece in plan] == [0, 1, -1, 3, 4, 5, -1]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(plan))  # in order, no overlap
    assert results[0]["collectives"] == 2 + len(plan)  # handshake, vote, the messages
    assert len(single) == 1
    assert single[0][2] == 1


def test_frame_ranges_join_to_the_whole_frame_with_zeroed_padding() -> None:
    from comm_collectives._serialization import encode, frame_offsets, head_lengths

    encoded = encode({"a": np.arange(1000, dtype=np.int16), "t": torch.ones(37), "s": "x" * 333})
    whole = np.full(encoded.nbytes, 0xAB, dtype=np.uint8)
    encoded.write_into(whole)
    for cuts in ([0, encoded.nbytes], [0, 7, 64, 65, 500, 2100, encoded.nbytes]):
        joined = np.concatenate([_written(encoded, a, b) for a, b in itertools.pairwise(cuts)])
        assert bytes(joined) == bytes(whole)
    lengths = head_lengths(whole)
    assert lengths == [p.nbytes for p in encoded.pieces]
    assert head_lengths(whole[:8]) is None  # the count alone: the lengths are missing
    # every byte outside the head and the pieces is zero
    used = np.zeros(encoded.nbytes, dtype=bool)
    used[: 8 * (1 + len(lengths))] = True
    for offset, length in zip(frame_offsets(lengths), lengths):
        used[offset : offset + length] = True
    assert not whole[~used].any()


def _written(encoded: Any, start: int, stop: int) -> np.ndarray:
    out = np.full(stop - start, 0xAB, dtype=np.uint8)
    encoded.write_into(out, start, stop)
    return out


def test_broadcast_plan_by_hand() -> None:
    from comm_collectives.objects import _broadcast_plan

    # head: 5 words = 40 -> 64; stream 100 B at 64 (to 192); 5 MiB at 192; 10 B at
    # 192 + 5 MiB; 4 MiB at 192 + 5 MiB + 64
    lengths = [100, 5 << 20, 10, 4 << 20]
    assert _broadcast_plan(lengths, 4096, 9437440) == [
        (4096, 5243072, 1),
        (5243072, 5243082, -1),
        (5243136, 9437440, 3),
    ]
    assert _broadcast_plan(lengths, 0, 9437440)[0] == (64, 164, -1)  # the head is not re-sent
    assert _broadcast_plan(None, 4096, 10_000) == [(4096, 10_000, -1)]
    assert _broadcast_plan(None, 0, 10_000) == [(0, 10_000, -1)]
    assert _broadcast_plan([1, 2], 4096, 4096) == []


def test_a_padded_frame_sends_nothing_stale() -> None:
    from comm_collectives._serialization import encode
    from comm_collectives.objects import _send_tensor

    width = 3 << 20
    encoded = encode({"a": np.arange(1000, dtype=np.int64)})
    whole = np.empty(encoded.nbytes, dtype=np.uint8)
    encoded.write_into(whole)
    for sent in (encoded, None):  # None: a rank whose object failed sends padding only
        buffers.empty_cache()
        stale = buffers.empty_bytes(width, torch.device("cpu"))
        stale.numpy()[:] = 0xAB  # an earlier transfer's bytes, back in the cache below
        del stale
        frame = _send_tensor(sent, width, torch.device("cpu")).numpy()
        assert buffers._pool.cached_bytes() == 0  # it reused the stale buffer
        used = 0 if sent is None else encoded.nbytes
        assert bytes(frame[:used]) == bytes(whole[:used])
        assert frame.size == width
        assert not frame[used:].any()
        del frame
    buffers.empty_cache()
