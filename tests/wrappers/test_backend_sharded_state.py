"""`Backend.sharded_state` / `load_sharded_state`: the model's and the optimizers' own shards
taken and loaded together, with one check of torch's options for a model and one optimizer.

On 2 gloo ranks, an FSDP2 model (and a plain module, whose "shards" are full tensors) with
AdamW: the combined state equals what `model_state` and `optim_state` (``full=False``)
return one by one; loading it back after more steps restores the model and the optimizer
exactly (the full tensors compared with the ones taken before those steps); torch's
``_verify_options`` runs once for each (twice for the separate calls); two optimizers fall
back to the separate calls with the same result.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.fsdp import fully_shard

import comm_collectives as dist
from comm_wrappers.backends import backend_of
from tests.wrappers.net import Net

SEED = 7


def _local(value: Any) -> Any:
    """A nested state with every tensor a plain local tensor (a DTensor's own shard)."""
    if isinstance(value, dict):
        return {key: _local(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_local(item) for item in value]
    to_local = getattr(value, "to_local", None)
    if callable(to_local):
        return to_local().clone()
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value


def _difference(left: Any, right: Any) -> float:
    """The largest absolute difference between two nested states (inf when their keys,
    lengths or non-tensor values differ)."""
    if isinstance(left, dict) and isinstance(right, dict):
        if set(left) != set(right):
            return float("inf")
        return max((_difference(left[key], right[key]) for key in left), default=0.0)
    if isinstance(left, list) and isinstance(right, list):
        if len(left) != len(right):
            return float("inf")
        return max((_difference(a, b) for a, b in zip(left, right)), default=0.0)
    if isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor):
        if left.shape != right.shape:
            return float("inf")
        return float((left.double() - right.double()).abs().max()) if left.numel() else 0.0
    return 0.0 if left == right else float("inf")


def _train(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], step: int) -> None:
    generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
    inputs = torch.randn(4, 4, generator=generator)
    targets = torch.randn(4, 2, generator=generator)
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


class _CountChecks:
    """Counts the calls of torch's ``_verify_options`` (the check of a model's names that
    every state-dict function of torch starts with) while in use."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = dsd._verify_options

    def __enter__(self) -> _CountChecks:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._original(*args, **kwargs)

        dsd._verify_options = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dsd._verify_options = self._original


def together_and_apart(sharded: bool, two_optimizers: bool) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = Net()
    if sharded:
        fully_shard(model)
    params = list(model.parameters())
    if two_optimizers:
        optimizers = {
            "first": torch.optim.AdamW(params[:2], lr=0.01),
            "second": torch.optim.SGD(params[2:], lr=0.1, momentum=0.9),
        }
    else:
        optimizers = {"adamw": torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)}
    backend = backend_of(model)
    _train(model, list(optimizers.values()), 0)
    out: dict[str, Any] = {"kind": backend.kind}

    with _CountChecks() as checks:
        model_state, optim_states = backend.sharded_state(optimizers)
    out["take_checks"] = checks.calls
    apart_model = backend.model_state(full=False)
    apart_optim = {key: backend.optim_state(opt, full=False) for key, opt in optimizers.items()}
    out["model_vs_apart"] = _difference(_local(model_state), _local(apart_model))
    out["optim_vs_apart"] = _difference(_local(optim_states), _local(apart_optim))

    # the full tensors now, to compare with after the load; a copy of the shards to load
    # (cloned: a full state on the CPU may share memory with the live tensors)
    full_model = _local(backend.model_state(full=True))
    full_optim = _local({k: backend.optim_state(opt, full=True) for k, opt in optimizers.items()})
    model_state, optim_states = copy.deepcopy((model_state, optim_states))
    _train(model, list(optimizers.values()), 1)  # moves the model and the moments on
    out["moved"] = _difference(backend.model_state(full=True), full_model)

    pairs = {key: (optimizers[key], optim_states[key]) for key in optimizers}
    with _CountChecks() as checks:
        backend.load_sharded_state(model_state, pairs, strict=True)
    out["load_checks"] = checks.calls
    out["model_restored"] = _difference(backend.model_state(full=True), full_model)
    restored = {key: backend.optim_state(opt, full=True) for key, opt in optimizers.items()}
    out["optim_restored"] = _difference(restored, full_optim)
    return out


@pytest.mark.parametrize(
    ("sharded", "two_optimizers"),
    [(True, False), (False, False), (True, True)],
    ids=["fsdp2", "module", "fsdp2-two-optimizers"],
)
def test_sharded_state_equals_the_separate_calls_and_loads_back(
    comm_run_distributed: Any, sharded: bool, two_optimizers: bool
) -> None:
    results = comm_run_distributed(together_and_apart, sharded, two_optimizers, timeout=120)
    for result in results:
        assert result["kind"] == ("fsdp2" if sharded else "module")
        assert result["model_vs_apart"] == 0.0
        assert result["optim_vs_apart"] == 0.0
        assert result["moved"] > 1e-4  # the step after the save changed the model
        assert result["model_restored"] == 0.0
        assert result["optim_restored"] == 0.0
        # one check for the model and one optimizer; the model's then each optimizer's
        # (torch's functions one by one) for two optimizers
        assert result["take_checks"] == (3 if two_optimizers else 1)
        assert result["load_checks"] == (3 if two_optimizers else 1)
