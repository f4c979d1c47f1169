"""Every collective in a plain process: it returns what a world of one would."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import comm_collectives as dist
import comm_core
from comm_collectives._serialization import decode, encode, frame_pieces


def test_comm_core_api_is_re_exported() -> None:
    for name in set(comm_core.__all__) - {"__version__", "barrier"}:
        assert getattr(dist, name) is getattr(comm_core, name)
        assert name in dist.__all__
    # comm_collectives' barrier is checked like a collective and takes async_op
    assert dist.barrier is not comm_core.barrier
    assert "barrier" in dist.__all__


def test_tensor_collectives_in_a_world_of_one() -> None:
    t = torch.tensor([1.0, 3.0])
    for op in ("sum", "mean", "max", "min", "product"):
        dist.all_reduce(t, op=op)
        assert t.tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match="expected one of sum, mean, max, min, product"):
        dist.all_reduce(t, op="average")
    ints = torch.tensor([3], dtype=torch.int64)
    dist.all_reduce(ints, op="mean")
    assert ints.tolist() == [3]
    assert [p.tolist() for p in dist.all_gather(t)] == [[1.0, 3.0]]
    assert [p.tolist() for p in dist.gather(t)] == [[1.0, 3.0]]
    with pytest.raises(ValueError, match="dst=1 is not a rank of the group"):
        dist.gather(t, dst=1)
    dist.broadcast(t)
    assert t.tolist() == [1.0, 3.0]
    seeds = {dist.sync_random_seed() for _ in range(5)}
    assert all(0 <= s < 2**31 for s in seeds)


def test_object_collectives_in_a_world_of_one() -> None:
    obj = {"a": [1, None], "t": torch.ones(2)}
    assert dist.all_gather_object(obj) == [obj]
    assert dist.gather_object(obj) == [obj]
    items = [1, "two"]
    dist.broadcast_object_list(items)
    assert items == [1, "two"]
    with pytest.raises(TypeError, match="data must be a list, got tuple"):
        dist.broadcast_object_list((1, 2))  # type: ignore[arg-type]


def test_dict_and_param_reductions_in_a_world_of_one() -> None:
    d = {"a": torch.tensor([2.0]), "b": torch.tensor([3])}
    dist.all_reduce_dict(d, op="mean")
    assert (d["a"].tolist(), d["b"].tolist()) == ([2.0], [3])
    params = [torch.nn.Parameter(torch.ones(2))]
    dist.all_reduce_params(params, op="sum")
    assert params[0].tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match="dict of tensors, got list"):
        dist.all_reduce_dict([1, 2])  # type: ignore[arg-type]


def test_collect_results_in_a_world_of_one() -> None:
    assert dist.collect_results([0, None, 2, 3], 3) == [0, None, 2]
    assert dist.collect_results_cpu([1, 2], 5) == [1, 2]
    assert dist.collect_results_gpu([None], 1) == [None]
    with pytest.raises(ValueError, match="device must be one of cpu, gpu, got 'cuda'"):
        dist.collect_results([1], 1, device="cuda")


def test_debug_mode_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COMM_DEBUG", raising=False)
    assert not dist.debug_enabled()
    with dist.debug_mode():
        assert dist.debug_enabled()
    monkeypatch.setenv("COMM_DEBUG", "1")
    assert dist.debug_enabled()
    monkeypatch.setenv("COMM_DEBUG", "0")
    assert not dist.debug_enabled()


def test_serialization_keeps_buffers_out_of_the_pickle_stream() -> None:
    big = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    tensor = torch.arange(1 << 18, dtype=torch.float64)  # 2 MiB
    encoded = encode({"array": big, "tensor": tensor})
    frame = np.empty(encoded.nbytes, dtype=np.uint8)
    encoded.write_into(frame)
    stream, *buffers = frame_pieces(frame)
    assert stream.nbytes < 2048  # only the structure, not the 6 MiB of data
    assert sorted(b.nbytes for b in buffers) == [2 << 20, 4 << 20]
    back = decode(frame)
    assert np.array_equal(back["array"], big)
    assert torch.equal(back["tensor"], tensor)
    # zero-copy: the rebuilt array lives inside the received frame
    assert np.shares_memory(back["array"], frame)


def test_layout_signature_follows_keys_shapes_dtypes_and_devices() -> None:
    from comm_collectives.coalesced import _Layout, _layout_signature

    def signature(data: dict[str, torch.Tensor]) -> int:
        keys = sorted(data)
        values = [data[k] for k in keys]
        return _layout_signature(keys, _Layout.of(values))

    base = {"a": torch.zeros(2), "b": torch.tensor(1.0)}
    first = signature(base)
    assert signature({"a": torch.ones(2), "b": torch.tensor(5.0)}) == first  # values do not count
    changed = [
        {"a": torch.zeros(3), "b": torch.tensor(1.0)},  # a shape
        {"a": torch.zeros(2, dtype=torch.float64), "b": torch.tensor(1.0)},  # a dtype
        {"a": torch.zeros(2), "c": torch.tensor(1.0)},  # a key
        {"a": torch.zeros(2), "b": torch.tensor(1.0, device="meta")},  # a device type
        {"a": torch.zeros(1, 2), "b": torch.tensor(1.0)},  # the same elements, another rank
    ]
    signatures = [signature(data) for data in changed]
    assert first not in signatures
    assert len(set(signatures)) == len(changed)
    assert signature(base) == first  # remembered layouts give the same digest again
