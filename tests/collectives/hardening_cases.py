"""Module-level functions for test_hardening.py, run on every rank of a real gloo world."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as torch_dist

import comm_collectives as dist
from comm_collectives import _capacity, _frame, _route
from comm_core import CollectiveMismatchError, RemoteRankError, process_group
from tests.helpers import caught

N = 200  # elements: the largest dtype (16 bytes) fits the first inline capacity (4 KiB)


def _input(name: str, rank: int) -> torch.Tensor:
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (N,), generator=g).bool()
    if dtype.is_complex:
        return torch.complex(torch.randn(N, generator=g), torch.randn(N, generator=g)).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(N, generator=g, dtype=torch.float64) * 3).to(dtype)
    low = 0 if name.startswith("uint") else -5
    return torch.randint(low, 6, (N,), generator=g, dtype=torch.int64).to(dtype)


def paths_agree(names: list[str], ops: list[str]) -> dict[str, Any]:
    """Each (dtype, op): the bytes of the result on the inline and the long path, how many
    collectives the inline call took, and this rank's input (as float64 where it has one)."""
    rank = dist.get_rank()
    group = torch_dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {}
    for name in names:
        x = _input(name, rank)
        for op in ops:
            results: list[Any] = []
            calls = 0
            for path in ("inline", "long"):
                t = x.clone()
                limit = _capacity.inline_limit(0) if path == "long" else contextlib.nullcontext()
                before = group._get_sequence_number_for_group()
                with limit:
                    try:
                        dist.all_reduce(t, op=op)
                        results.append(t.view(torch.uint8).tolist())
                    except RemoteRankError as exc:
                        results.append(f"RemoteRankError: {exc.failures[0].error_type}")
                    except (ValueError, TypeError) as exc:
                        results.append(type(exc).__name__)
                if path == "inline":
                    calls = group._get_sequence_number_for_group() - before
            value = t.to(torch.float64).tolist() if not (x.is_complex() or name == "bool") else []
            out[f"{name}/{op}"] = {
                "inline": results[0],
                "long": results[1],
                "calls": calls,
                "input": x.to(torch.float64).tolist()
                if not (x.is_complex() or name == "bool")
                else [],
                "result": value if isinstance(results[1], list) else [],
            }
    return out


def dtype_codes() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for a, b in [("float8_e4m3fn", "float8_e5m2"), ("uint16", "uint32"), ("complex32", "int32")]:
        dtype = getattr(torch, a if rank == 0 else b)
        out[f"{a}/{b}"] = caught(dist.all_gather, torch.ones(3).to(dtype))
    ok = dist.all_gather(torch.full((2,), float(rank + 1)).to(torch.float8_e5m2))
    out["float8_ok"] = [t.to(torch.float32).tolist() for t in ok]
    return out


def version_mismatch() -> dict[str, Any]:
    rank = dist.get_rank()
    saved = _frame.VERSION
    if rank == 1:
        _frame.VERSION = saved + 7
    try:
        got = caught(dist.all_reduce, torch.ones(2))
    finally:
        _frame.VERSION = saved
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"caught": got, "next": float(t)}


def minor_cases(long_path: bool) -> dict[str, Any]:
    """Leaf tensors that require grad, a read-only root in broadcast, conjugate views,
    all_reduce_params all or nothing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    limit = _capacity.inline_limit(0) if long_path else contextlib.nullcontext()
    with limit:
        leaf = torch.full((3,), float(rank + 1), requires_grad=True)
        dist.all_reduce(leaf)
        out["leaf"] = (leaf.detach().tolist(), leaf.requires_grad)
        # the root's tensor is an expanded view (not writable in place); only read
        data = torch.ones(1).expand(1000) * 0 + 5 if rank == 0 else torch.zeros(1000)
        if rank == 0:
            data = torch.full((1,), 5.0).expand(1000)
        dist.broadcast(data, src=0)
        out["broadcast"] = (float(data.min()), float(data.max()))
        z = torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)
        views = dist.all_gather(z.conj() if rank == world - 1 else z)
        out["conj"] = [[(c.real, c.imag) for c in v.tolist()] for v in views]
        neg = dist.all_gather(z.conj().imag if rank == 0 else z.imag)  # a negative-bit view
        out["neg"] = [v.tolist() for v in neg]
        objs = dist.all_gather_object({"z": z.conj()})
        out["conj_object"] = [[(c.real, c.imag) for c in o["z"].tolist()] for o in objs]
        # mean of a float buffer and an integer counter whose mean is not exact
        running = torch.full((2,), float(rank))
        counter = torch.tensor(10 + rank)
        out["params"] = caught(dist.all_reduce_params, [running, counter], op="mean")
        out["params_untouched"] = (running.tolist(), int(counter))
    return out


def mismatch_pickles() -> dict[str, Any]:
    import pickle

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    try:
        dist.all_reduce(torch.ones(rank + 1))
    except CollectiveMismatchError as exc:
        again = pickle.loads(pickle.dumps(exc))
        out["mismatch"] = (str(again) == str(exc), again.rows == exc.rows, again.operation)
    try:
        dist.all_gather_object((lambda: 0) if rank == 0 else 1)
    except RemoteRankError as exc:
        again = pickle.loads(pickle.dumps(exc))
        out["remote"] = (str(again) == str(exc), again.ranks, again.operation)
    return out


def side_channel_counts() -> dict[str, Any]:
    """Collectives on the group itself and on the side group, per call, with the headers on
    the side group (the nccl layout, forced on gloo)."""
    rank = dist.get_rank()
    group = torch_dist.distributed_c10d._get_default_group()
    saved = _route.side_channel, process_group._CPU_BACKENDS
    # the nccl layout on gloo: headers on the CPU route, and gloo counted as a backend
    # without CPU support, so the route is comm-core's CPU twin of the default group
    _route.side_channel, process_group._CPU_BACKENDS = True, ()
    try:
        side = _route.header_route(group)[0]
        assert side is not None
        out: dict[str, Any] = {}
        for name, path in (("inline", False), ("long", True)):
            t = torch.full((3,), float(rank + 1))
            data0 = group._get_sequence_number_for_group()
            side0 = side._get_sequence_number_for_group()
            limit = _capacity.inline_limit(0) if path else contextlib.nullcontext()
            with limit:
                dist.all_reduce(t)
            out[name] = (
                t.tolist(),
                group._get_sequence_number_for_group() - data0,
                side._get_sequence_number_for_group() - side0,
            )
        out["mismatch"] = caught(dist.all_reduce, torch.ones(rank + 1))[0]
        out["remote"] = caught(dist.all_reduce, torch.ones(2), op="avg" if rank else "sum")[0]
        out["same_side"] = _route.header_route(group)[0] is side
        # one CPU twin of the world: the headers' route is the group collect_results uses
        out["is_cpu_twin"] = side is dist.get_cpu_group() and side is not group
        return out
    finally:
        _route.side_channel, process_group._CPU_BACKENDS = saved


def unchecked_cases() -> dict[str, Any]:
    """The unchecked path: the backend's own collective, one per call, right values."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = torch_dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {}
    with dist.unchecked():
        before = group._get_sequence_number_for_group()
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, op="mean")
        out["all_reduce"] = (t.tolist(), group._get_sequence_number_for_group() - before)
        ints = torch.tensor([2 * rank, 4], dtype=torch.int32)
        dist.all_reduce(ints, op="mean")
        out["int_mean"] = (ints.tolist(), str(ints.dtype))
        flags = torch.tensor([rank == 0, False])
        dist.all_reduce(flags, op="max")
        out["bool"] = flags.tolist()
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=world - 1)
        out["broadcast"] = b.tolist()
        d = {"a": torch.tensor(float(rank)), "n": torch.tensor([rank, 1])}
        before = group._get_sequence_number_for_group()
        dist.all_reduce_dict(d)
        out["dict"] = (
            float(d["a"]),
            d["n"].tolist(),
            group._get_sequence_number_for_group() - before,
        )
        params = [torch.ones(2) * rank, torch.tensor([rank], dtype=torch.int64)]
        dist.all_reduce_params(params, op="max")
        out["params"] = [p.tolist() for p in params]
        with dist.debug_mode():  # debug mode turns the checks back on
            out["debug"] = caught(dist.all_reduce, torch.ones(rank + 1))[0]
    return out


def side_channel_subgroups() -> dict[str, Any]:
    """Headers on the CPU route with subgroups that only some ranks use, then a group of
    every rank: no group creation may depend on which groups a rank made before."""
    rank = dist.get_rank()
    saved = _route.side_channel, process_group._CPU_BACKENDS
    # the nccl layout on gloo: headers on the CPU route, and gloo counted as a backend
    # without CPU support, so the route is comm-core's CPU twin of the default group
    _route.side_channel, process_group._CPU_BACKENDS = True, ()
    try:
        pair = torch_dist.new_group([0, 1])
        out: dict[str, Any] = {}
        if rank in (0, 1):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=pair)
            out["pair"] = float(t)
        everyone = torch_dist.new_group([0, 1, 2])
        out["everyone"] = dist.all_gather_object(rank * 10, group=everyone)
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        out["default"] = float(t)
        torch_dist.destroy_process_group(pair)
        torch_dist.destroy_process_group(everyone)
        return out
    finally:
        _route.side_channel, process_group._CPU_BACKENDS = saved


def debug_env_on_one_rank_unchecked() -> dict[str, Any]:
    """COMM_DEBUG set on the last rank only, inside unchecked: every rank still issues the
    backend's one all-reduce (a handshake on one rank only waited for the timeout)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = torch_dist.distributed_c10d._get_default_group()
    previous = os.environ.get("COMM_DEBUG")
    if rank == world - 1:
        os.environ["COMM_DEBUG"] = "1"
    try:
        t = torch.full((3,), float(rank + 1))
        before = group._get_sequence_number_for_group()
        with dist.unchecked():
            dist.all_reduce(t)
        return {"sum": t.tolist(), "calls": group._get_sequence_number_for_group() - before}
    finally:
        if previous is None:
            os.environ.pop("COMM_DEBUG", None)
        else:
            os.environ["COMM_DEBUG"] = previous
