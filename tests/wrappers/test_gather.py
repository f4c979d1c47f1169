"""FSDP1's full state gathered to rank 0 from the flat shards, against torch's full state dict.

Each rank body runs on every rank of a real gloo world (``comm_pools``) and stands above the
test that asserts on it. Each rank initialises its model from its own seed, so every element
of the full state names the rank whose shard it came from: the oracle is torch's own full
state dict (``get_model_state_dict(..., full_state_dict=True)``), computed from the same
shards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import comm_collectives as dist
from comm_wrappers import MMFullyShardedDataParallel
from comm_wrappers.backends import _fsdp1, _gather, backend_of

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


class Model(nn.Module):
    """Odd sizes (none divides by 2 or 3), buffers persistent and not, a nested block."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.block = nn.Sequential(nn.Linear(7, 3), nn.BatchNorm1d(3))
        self.head = nn.Linear(3, 1, bias=False)
        self.register_buffer("scale", torch.arange(3.0) + 0.5)
        self.register_buffer("scratch", torch.ones(2), persistent=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.norm(self.lin1(inputs))) * self.scale)


def fsdp1(strategy: str, wrap: bool, orig: bool, checkpointed: bool = False, **kwargs: Any) -> Any:
    """An FSDP1 model whose every rank starts from its own values."""
    torch.manual_seed(100 + dist.get_rank())
    module = Model()
    with torch.no_grad():
        module.block[1].running_mean.add_(dist.get_rank())  # rank 0's buffers are saved
    if checkpointed:  # names with _checkpoint_wrapped_module. inside, hooks that drop it
        apply_activation_checkpointing(module, check_fn=lambda m: isinstance(m, nn.Linear))
    policy = ModuleWrapPolicy({nn.Linear, nn.Sequential}) if wrap else None
    return MMFullyShardedDataParallel(
        module, sharding_strategy=strategy, auto_wrap_policy=policy, use_orig_params=orig, **kwargs
    )


def _oracle(model: Any) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    if list(got) != list(want):
        return [f"keys {list(got)} != {list(want)}"]
    return [
        name
        for name, tensor in want.items()
        if got[name].dtype != tensor.dtype
        or got[name].shape != tensor.shape
        or not torch.equal(got[name], tensor)
    ]


def fast_path_matches_torch() -> dict[str, Any]:
    """Every layout: (fast path taken, mismatches) from rank 0, {} elsewhere."""
    results: dict[str, Any] = {}
    taken: list[bool] = []
    real = _fsdp1.flat_to_rank0

    def spy(root: Any) -> Any:
        state = real(root)
        taken.append(state is not None)
        return state

    layouts = [(s, w, o, False) for s in STRATEGIES for w in (False, True) for o in (False, True)]
    for strategy, wrap, orig, checkpointed in [*layouts, ("FULL_SHARD", True, False, True)]:
        model = fsdp1(strategy, wrap, orig, checkpointed)
        if wrap and strategy != "NO_SHARD":  # a step (the unwrapped: never run)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.randn(4, 5)).sum().backward()
            optimizer.step()
        want = _oracle(model)
        taken.clear()
        _fsdp1.flat_to_rank0 = spy
        try:
            got = backend_of(model)._gather_to_rank0()
        finally:
            _fsdp1.flat_to_rank0 = real
        key = f"{strategy} wrap={wrap} orig={orig} checkpointed={checkpointed}"
        if dist.get_rank() == 0:
            assert got is not None
            results[key] = (taken == [True], _compare(got, want), len(got))
        else:
            results[key] = (taken == [True], got, 0)
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp1_flat_shards_equal_torch_full_state(comm_pools: Any, world: int) -> None:
    """Bit for bit, every strategy x auto-wrap x use_orig_params (+ activation checkpointing).

    The fast path was taken each time (not torch's state dict).
    """
    results = comm_pools.get(world).run(fast_path_matches_torch, timeout=240)
    assert len(results[0]) == 13
    for key, (taken, mismatches, count) in results[0].items():
        assert taken, key
        assert mismatches == [], key
        # 9 parameters, "scale" and 3 BatchNorm buffers; "scratch" is not persistent
        assert count == 13, key
    for rank_results in results[1:]:
        assert all(taken and got == {} for taken, got, _ in rank_results.values())


def tied_across_units() -> Any:
    """The head's weight is the first layer's, in another FSDP unit (use_orig_params)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    module[2].weight = module[0].weight
    policy = ModuleWrapPolicy({nn.Linear})
    return MMFullyShardedDataParallel(module, auto_wrap_policy=policy, use_orig_params=True)


def refused_layouts() -> dict[str, Any]:
    """Layouts left to torch: None on every rank, and no rank left waiting."""
    out: dict[str, Any] = {}
    model = fsdp1("FULL_SHARD", wrap=True, orig=False)
    with type(model).summon_full_params(model):
        out["summoned"] = _gather.flat_to_rank0(model)
    precision = MixedPrecision(buffer_dtype=torch.float16)
    model = fsdp1("FULL_SHARD", wrap=False, orig=True, mixed_precision=precision)
    out["buffers in low precision"] = _gather.flat_to_rank0(model)
    model = fsdp1("FULL_SHARD", wrap=False, orig=False)
    model.module.head._register_state_dict_hook(lambda *args: None)
    out["a state-dict hook"] = _gather.flat_to_rank0(model)
    torch.manual_seed(0)
    compiled = Model()
    compiled.block = torch.compile(compiled.block)  # not run: no compiler needed
    out["a compiled submodule"] = _gather.flat_to_rank0(
        MMFullyShardedDataParallel(compiled, use_orig_params=True)
    )
    out["a weight tied across units"] = _gather.flat_to_rank0(tied_across_units())
    out["after refusals, a layout it reads"] = _gather.flat_to_rank0(fsdp1("NO_SHARD", True, True))
    return {k: v if v is None else "a state" for k, v in out.items()}


def test_fsdp1_layouts_it_does_not_read_return_none(comm_pools: Any) -> None:
    [*results] = comm_pools.get(2).run(refused_layouts, timeout=120)
    for result in results:
        assert result == {
            "summoned": None,
            "buffers in low precision": None,
            "a state-dict hook": None,
            "a compiled submodule": None,
            "a weight tied across units": None,
            "after refusals, a layout it reads": "a state",
        }


def compiled_and_tied_full_saves() -> dict[str, Any]:
    """The layouts refused above still save under torch's names (the caller's fallback)."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    compiled = Model()
    compiled.block = torch.compile(compiled.block)
    for key, model in (
        ("compiled", MMFullyShardedDataParallel(compiled, use_orig_params=True)),
        ("tied", tied_across_units()),
    ):
        got = backend_of(model)._gather_to_rank0()
        want = _oracle(model)
        out[key] = sorted(want) if got is None else _compare(got, want) if got else "empty"
    return out


def test_fsdp1_refused_layouts_still_save_under_torchs_names(comm_pools: Any) -> None:
    # The fallback (rows of the sharded state dict) gives torch's names and values: no
    # "_orig_mod." in a compiled submodule's names, the tied weight under both names.
    results = comm_pools.get(2).run(compiled_and_tied_full_saves, timeout=120)
    assert results[0] == {"compiled": [], "tied": []}
