"""Helpers shared by the tests of every layer, written once.

Only torch is imported here at module level: tests/core and tests/collectives run in
environments without the upper packages, so what needs comm_wrappers or DeepSpeed is
imported inside the function that needs it. The CPU world fixture ``cpu_gloo_world`` is in
tests/conftest.py.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (for a launcher's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def caught(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str]:
    """Call ``fn(*args, **kwargs)``; return the type name and message of what it raised.

    Returns ``("", "")`` when it raised nothing, so a rank body can return the outcome of a
    call that must fail (or must not) for the test to assert.
    """
    try:
        fn(*args, **kwargs)
    except Exception as error:  # the outcome is the result
        return type(error).__name__, str(error)
    return "", ""


class Unpicklable:
    """An object whose pickling raises: a rank's part or argument that cannot travel."""

    def __reduce__(self) -> Any:
        message = "this object refuses to be pickled"
        raise RuntimeError(message)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("module.", "")


def full_params(model: Any) -> dict[str, torch.Tensor]:
    """Full parameters by the user's names, gathered independently of the code under test.

    Plain modules and DDP as they are, FSDP1 through ``summon_full_params``, FSDP2's DTensor
    shards through ``full_tensor``, a DeepSpeed engine (or our wrapper of one) through
    DeepSpeed's ``GatheredParameters`` (as float32). Wrapper prefixes are removed.
    """
    engine = model if hasattr(model, "zero_optimization_stage") else getattr(model, "model", None)
    if engine is not None and hasattr(engine, "zero_optimization_stage"):
        import deepspeed

        module = engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {_clean(n): p.detach().float().clone() for n, p in module.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {_clean(n): p.detach().clone() for n, p in model.named_parameters()}
    from comm_wrappers import unwrap_model

    out = {}
    for name, param in unwrap_model(model).named_parameters():
        full = getattr(param, "full_tensor", None)
        value = full() if callable(full) else param
        out[_clean(name)] = value.detach().clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two dicts of tensors with the same names."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)
