"""The backend contract: every adapter of ``comm_wrappers.backends`` passes the same test.

One rank function (`contract`) runs every check for one kind of model on a real 2-rank
gloo world and returns what it measured; the test asserts it against values computed
independently: a one-process oracle on the plain model (the whole batch of every rank
for synchronised kinds, the rank's own batch for a plain module), or hand-set weights.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import comm_collectives as dist
from comm_wrappers import MMDistributedDataParallel, MMSeparateDistributedDataParallel
from comm_wrappers.backends import Backend, backend_of, rank_device
from tests.helpers import caught, max_diff
from tests.wrappers.net import Gan, batch, global_batch, make_net, make_optimizer, wrap

EXACT = 1e-6
KINDS = {  # test id -> (wrap kind, options, expected Backend.kind, expected sharding)
    "module": ("module", {}, "module", None),
    "ddp": ("ddp", {}, "ddp", None),
    "fsdp1": ("fsdp", {}, "fsdp1", "FULL_SHARD"),
    "fsdp1-units": ("fsdp", {"auto_wrap_policy": ["Linear"]}, "fsdp1", "FULL_SHARD"),
    "fsdp1-no-shard": ("fsdp", {"sharding_strategy": "NO_SHARD"}, "fsdp1", "NO_SHARD"),
    "fsdp2": ("fsdp2", {}, "fsdp2", "fully_shard"),
}


# ---------------------------------------------------------------- helpers run on every rank
def _model(kind: str, options: dict[str, Any]) -> nn.Module:
    return make_net() if kind == "module" else wrap(kind, **options)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("module.", "")


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the whole model sees it (FSDP shards gathered)."""
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            return {_clean(n): p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        full = getattr(grad, "full_tensor", None)
        out[_clean(name)] = (full() if callable(full) else grad).detach().clone()  # type: ignore[union-attr]
    return out


def _shown_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """The gradients the parameters show right now, without any collective."""
    return {
        _clean(n): None if p.grad is None else p.grad.detach().clone()
        for n, p in model.named_parameters()
    }


def _loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    loss: torch.Tensor = model(*data, mode="loss")["loss"]
    return loss


def _oracle_grads(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One process, plain torch: the gradients accumulated over ``batches``."""
    net = make_net()
    for data in batches:
        _loss(net, data).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}  # type: ignore[union-attr]


def _gathered(value: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    return dist.all_gather_object(value)


def _new_weights() -> dict[str, torch.Tensor]:
    """Hand-set weights, unlike any initialisation: entry i of a tensor is 0.01 * (i + k)."""
    out = {}
    for k, (name, value) in enumerate(make_net().state_dict().items()):
        out[name] = (torch.arange(value.numel(), dtype=value.dtype) + k).view_as(value) * 0.01
    return out


def _plain_forward(weights: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    net = make_net()
    net.load_state_dict(weights)
    with torch.no_grad():
        out: torch.Tensor = net(inputs)
    return out


# ---------------------------------------------------------------- the contract, per rank
def contract(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """Every check of the backend contract for one kind; the measured values."""
    rank, world = dist.get_rank(), dist.get_world_size()
    synced = kind != "module"
    own = [batch(0, 0, rank)]
    first = [global_batch(0, 0, world)] if synced else own
    second = [global_batch(0, 1, world)] if synced else [batch(0, 1, rank)]
    out: dict[str, Any] = {}

    model = _model(kind, options)
    backend = backend_of(model)
    plain = make_net()
    out["kind"] = backend.kind
    out["is_backend"] = isinstance(backend, Backend) and backend.model is model
    out["engine"] = backend.engine
    out["native"] = backend.native_checkpoint()  # no checkpoint files of its own
    out["describe"] = backend.describe()
    out["formats"] = [backend.format_for(s) for s in (None, True, False)]
    out["compute_device"] = str(backend.compute_device())
    out["rank_device"] = str(rank_device())
    out["scaler"] = type(backend.grad_scaler("cpu")).__name__
    out["shapes"] = backend.param_shapes()
    expected_shapes = {
        n: [list(v.shape), str(v.dtype).removeprefix("torch.")]
        for n, v in plain.state_dict().items()
    }
    out["shapes_ok"] = out["shapes"] == expected_shapes

    # model_state: full on every rank, and on rank 0 only.
    full = backend.model_state(full=True)
    out["full_state"] = max_diff(full, plain.state_dict())
    out["full_on_cpu"] = {str(v.device) for v in full.values()}
    rank0 = backend.model_state(full=True, rank0_only=True)
    out["rank0_state"] = max_diff(rank0, plain.state_dict()) if rank == 0 else rank0

    # load_model_state: hand-set weights in, the same weights out, the same forward.
    weights = _new_weights()
    backend.load_model_state(weights, full=True, strict=True)
    out["loaded"] = max_diff(backend.model_state(full=True), weights)
    inputs, _ = own[0]
    with torch.no_grad():
        out["forward"] = float((model(inputs) - _plain_forward(weights, inputs)).abs().max())
    # Sharded round trip: this rank's shards out, other weights in, the shards back.
    sharded = copy.deepcopy(backend.model_state(full=False))
    backend.load_model_state(plain.state_dict(), full=True, strict=True)
    backend.load_model_state(sharded, full=False, strict=True)
    out["sharded_round_trip"] = max_diff(backend.model_state(full=True), weights)
    backend.load_model_state(plain.state_dict(), full=True, strict=True)

    # no_sync: the first backward keeps this rank's own gradients; the second syncs both.
    with backend.no_sync():
        _loss(model, own[0]).backward()
    shown = _shown_grads(model)
    out["no_sync_shown"] = (
        "none"
        if all(g is None for g in shown.values())
        else max_diff({k: g for k, g in shown.items() if g is not None}, _oracle_grads(own))
    )
    out["no_sync_ranks_differ"] = (
        out["no_sync_shown"] == "none"
        or max_diff(*_gathered({k: g for k, g in shown.items() if g is not None})) > 1e-3
    )
    _loss(model, batch(0, 1, rank)).backward()
    out["accumulated"] = max_diff(_full_grads(model), _oracle_grads(first + second))

    # Without no_sync: averaged gradients, and the whole model's norm for clipping.
    model = _model(kind, options)
    backend = backend_of(model)
    optimizer = make_optimizer(model.parameters(), "adamw")
    # Not stepped yet: the getters leave it so and give no entry (torch's give it zero
    # states at step 1); the state a load reads into has them.
    states = [
        backend.optim_state(optimizer, full=True),
        *backend.sharded_state({"o": optimizer})[1].values(),
    ]
    out["unstepped"] = [(len(state["state"]), len(optimizer.state)) for state in states]
    target = backend.sharded_state({"o": optimizer}, to_load=True)[1]["o"]["state"]
    out["to_load"] = (len(target), sorted({float(state["step"]) for state in target.values()}))
    optimizer.state.clear()
    _loss(model, own[0]).backward()
    grads = _full_grads(model)
    out["synced"] = max_diff(grads, _oracle_grads(first))
    out["synced_ranks_equal"] = max_diff(*_gathered(grads)) if synced else 0.0
    oracle_norm = float(torch.cat([g.flatten() for g in _oracle_grads(first).values()]).norm())
    params = [p for p in model.parameters() if p.grad is not None]
    norm = backend.clip_grad_norm(params, max_norm=0.05)
    out["norm"], out["oracle_norm"] = float(norm), oracle_norm
    params = [p for p in model.parameters() if p.grad is not None]
    out["norm_after_clip"] = float(backend.clip_grad_norm(params, max_norm=1e9))

    # optim_state after one AdamW step (on the clipped gradients), against the oracle.
    optimizer.step()
    net = make_net()
    oracle_optim = make_optimizer(net.parameters(), "adamw")
    for data in first:
        _loss(net, data).backward()
    nn.utils.clip_grad_norm_(list(net.parameters()), 0.05)
    oracle_optim.step()
    names = [n for n, _ in net.named_parameters()]
    oracle_avg = {names[i]: s["exp_avg"] for i, s in oracle_optim.state_dict()["state"].items()}
    # a snapshot: on the CPU the full state shares memory with the live moments
    state = copy.deepcopy(backend.optim_state(optimizer, full=True))
    out["optim_names"] = state["param_groups"][0]["params"]
    out["exp_avg"] = max_diff({n: s["exp_avg"] for n, s in state["state"].items()}, oracle_avg)
    rank0_optim = backend.optim_state(optimizer, full=True, rank0_only=True)
    out["rank0_optim"] = (
        max_diff({n: s["exp_avg"] for n, s in rank0_optim["state"].items()}, oracle_avg)
        if rank == 0
        else rank0_optim
    )
    # Another step changes the moments; loading the saved state brings them back.
    optimizer.zero_grad()
    _loss(model, batch(1, 0, rank)).backward()
    optimizer.step()
    backend.load_optim_state(optimizer, state, full=True)
    again = backend.optim_state(optimizer, full=True)
    out["optim_round_trip"] = max_diff(
        {n: s["exp_avg"] for n, s in again["state"].items()}, oracle_avg
    )
    out["optim_steps"] = sorted({float(s["step"]) for s in again["state"].values()})
    out["not_portable"] = backend.optimizer_not_portable()
    return out


def other_models() -> dict[str, Any]:
    """backend_of on models built by torch directly and on wrappers holding wrappers."""
    inner = wrap("fsdp", auto_wrap_policy=["Linear"])
    _loss(inner, batch(0, 0, dist.get_rank())).backward()  # the first forward decides the root
    user_module = inner.module  # holds FSDP units, not their root
    sharded = make_net()
    fully_shard(sharded)
    return {
        "separate_ddp": backend_of(MMSeparateDistributedDataParallel(Gan())).kind,
        "container_of_ddp": backend_of(nn.Sequential(MMDistributedDataParallel(make_net()))).kind,
        "torch_fsdp1": backend_of(
            FullyShardedDataParallel(make_net(), device_id=torch.device("cpu"))
        ).kind,
        "torch_fsdp2": backend_of(sharded).kind,
        "fsdp2_is_fsdp_module": isinstance(sharded, FSDPModule),
        "user_module_of_fsdp1": backend_of(user_module).kind,
        "user_module_state": caught(lambda: backend_of(user_module).model_state(full=True)),
        "static_graph": caught(
            lambda: (
                backend_of(MMDistributedDataParallel(make_net(), static_graph=True))
                .no_sync()
                .__enter__()
            )
        ),
    }


# ---------------------------------------------------------------- the tests
@pytest.mark.parametrize("case", list(KINDS))
def test_every_backend_passes_the_contract(comm_run_distributed: Any, case: str) -> None:
    kind, options, expected_kind, sharding = KINDS[case]
    results = comm_run_distributed(contract, kind, options, timeout=120)
    sharded = expected_kind.startswith("fsdp")
    for rank, r in enumerate(results):
        assert r["kind"] == expected_kind
        assert r["is_backend"]
        assert r["engine"] is None
        assert r["native"] is None
        assert r["describe"] == {"wrapper": expected_kind, "sharding": sharding, "zero_stage": None}
        assert r["formats"] == (["dcp", "dcp", "full"] if sharded else ["full", "dcp", "full"])
        assert r["compute_device"] == r["rank_device"] == "cpu"
        assert r["scaler"] == ("ShardedGradScaler" if expected_kind == "fsdp1" else "GradScaler")
        assert r["shapes_ok"], r["shapes"]
        assert r["full_state"] == 0.0
        assert r["full_on_cpu"] == {"cpu"}
        assert r["rank0_state"] == (0.0 if rank == 0 else {})
        assert r["loaded"] == 0.0
        assert r["forward"] < EXACT
        assert r["sharded_round_trip"] == 0.0
        # Inside no_sync a rank keeps its own gradients (FSDP2 keeps them unreduced inside
        # and shows none); the next synced backward reduces both micro-steps.
        if expected_kind == "fsdp2":
            assert r["no_sync_shown"] == "none"
        else:
            assert r["no_sync_shown"] < EXACT
        assert r["no_sync_ranks_differ"] or expected_kind == "module"
        assert r["accumulated"] < EXACT
        assert r["synced"] < EXACT
        assert r["synced_ranks_equal"] < EXACT
        assert r["norm"] == pytest.approx(r["oracle_norm"], rel=1e-5)
        assert r["oracle_norm"] > 0.05  # clipping was active
        assert r["norm_after_clip"] == pytest.approx(0.05, rel=1e-4)
        assert r["optim_names"] == ["lin1.weight", "lin1.bias", "lin2.weight", "lin2.bias",
                                    "head.weight", "head.bias"]  # fmt: skip
        assert r["exp_avg"] < EXACT
        assert r["rank0_optim"] == (r["exp_avg"] if rank == 0 else {})
        assert r["optim_round_trip"] < EXACT
        assert r["optim_steps"] == [1.0]
        assert r["unstepped"] == [(0, 0), (0, 0)]
        assert r["to_load"] == (6, [1.0])
        assert r["not_portable"] is None
    if expected_kind == "module":  # nothing synchronised: each rank trained on its own data
        assert results[0]["norm"] != pytest.approx(results[1]["norm"])


def test_backend_of_finds_wrappers_inside_and_models_built_by_torch(
    comm_run_distributed: Any,
) -> None:
    for r in comm_run_distributed(other_models, timeout=120):
        assert r["separate_ddp"] == "ddp"
        assert r["container_of_ddp"] == "ddp"
        assert r["torch_fsdp1"] == "fsdp1"
        assert r["torch_fsdp2"] == "fsdp2"
        assert r["fsdp2_is_fsdp_module"]
        assert r["user_module_of_fsdp1"] == "fsdp1"
        assert r["user_module_state"][0] == "RuntimeError"
        assert "pass the FSDP wrapper itself" in r["user_module_state"][1]
        assert r["static_graph"][0] == "ValueError"
        assert "static_graph=True cannot skip the gradient sync" in r["static_graph"][1]


@pytest.mark.parametrize("value", [None, 3, "model", [nn.Linear(1, 1)]])
def test_backend_of_a_non_module_raises_type_error(value: Any) -> None:
    with pytest.raises(
        TypeError, match=r"model must be the nn\.Module .* got (NoneType|int|str|list)"
    ):
        backend_of(value)


def test_a_plain_module_in_one_process() -> None:
    net = make_net()
    backend = backend_of(net)
    assert backend.kind == "module"
    assert backend.native_checkpoint() is None
    assert str(backend.compute_device()) == "cpu"
    assert isinstance(backend.grad_scaler("cpu"), torch.amp.GradScaler)
    assert not isinstance(backend.grad_scaler("cpu"), ShardedGradScaler)
    with backend.no_sync():
        pass
    assert backend.model_state(full=True, rank0_only=True).keys() == net.state_dict().keys()
