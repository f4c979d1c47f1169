"""The adapter of DeepSpeed engines (ZeRO 0-3), found without importing DeepSpeed.

DeepSpeed is the ``deepspeed`` extra: it is imported only where an engine's parameters
must be gathered (ZeRO-3), and an engine cannot exist before DeepSpeed is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn

from comm_collectives import get_rank

from .._registry import _deepspeed_engine_type
from ._base import Backend

__all__ = ["DeepSpeedBackend", "engine_of"]


def engine_of(model: Any) -> Any:
    """The DeepSpeed engine ``model`` is or holds as ``model`` (its wrapper), or None."""
    engine_type = _deepspeed_engine_type()
    if engine_type is None:
        return None
    for _ in range(8):  # wrappers hold the engine as their "model" submodule
        if model is None or isinstance(model, engine_type):
            return model
        model = model.__dict__.get("_modules", {}).get("model")
    return None


class DeepSpeedBackend(Backend):
    """A DeepSpeed engine: it syncs, clips and scales by its config; its own checkpoints.

    Its natural checkpoint is DeepSpeed's own files; full states go through the engine's
    module (gathered under ZeRO-3). The optimizer state has a per-parameter form only
    under ZeRO-0 in fp32 (the client torch optimizer).
    """

    kind: ClassVar[str] = "deepspeed"

    def __init__(self, model: nn.Module, engine: Any) -> None:
        super().__init__(model, engine)

    def _target(self) -> nn.Module:
        module: nn.Module = self.engine.module
        return module

    def no_sync(self) -> AbstractContextManager[None]:
        """Nothing to enter: the engine accumulates by its config's
        ``gradient_accumulation_steps`` (its own ``no_sync`` refuses ZeRO 2 and 3)."""
        return contextlib.nullcontext()

    def _stage(self) -> int:
        return int(self.engine.zero_optimization_stage())

    def _clip(self, params: list[torch.Tensor], options: dict[str, Any]) -> torch.Tensor:
        message = (
            "a DeepSpeed engine clips its gradients itself, inside engine.step(): set "
            f"gradient_clipping={options['max_norm']} in its config (DeepSpeedStrategy maps "
            "clip_grad there) instead of clipping from an optimizer wrapper"
        )
        raise RuntimeError(message)

    def format_for(self, sharded: bool | None) -> str:
        """``"deepspeed"`` (the engine's own files) unless ``sharded`` is False (``"full"``)."""
        return "full" if sharded is False else "deepspeed"

    def describe(self) -> dict[str, Any]:
        """``{"wrapper": "deepspeed", "sharding": None, "zero_stage": the ZeRO stage}``."""
        return {"wrapper": self.kind, "sharding": None, "zero_stage": self._stage()}

    def param_shapes(self) -> dict[str, list[Any]]:
        """``{name: [shape, dtype]}`` of the engine's module (ZeRO-3's full shapes)."""
        out: dict[str, list[Any]] = {}
        module = self._target()
        for name, parameter in module.named_parameters():
            shape = getattr(parameter, "ds_shape", parameter.shape)
            out[name] = [list(shape), str(parameter.dtype).removeprefix("torch.")]
        for name, buffer in module.named_buffers():
            out[name] = [list(buffer.shape), str(buffer.dtype).removeprefix("torch.")]
        return out

    @contextlib.contextmanager
    def _gathered(self, modifier_rank: int | None) -> Iterator[None]:
        """ZeRO-3: the full parameters on every rank (written back from ``modifier_rank``)."""
        if self._stage() != 3:
            yield
            return
        import deepspeed

        parameters = list(self._target().parameters())
        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=modifier_rank):
            yield

    def model_state(self, *, full: bool, rank0_only: bool = False) -> dict[str, Any]:
        """The module's full state on the CPU (collective under ZeRO-3: it gathers).

        Raises:
            ValueError: ``full=False``: an engine's sharded state is its own files
                (``engine.save_checkpoint``, the ``"deepspeed"`` format).
        """
        _require_full(full, "model_state")
        keep = not rank0_only or get_rank() == 0
        with self._gathered(modifier_rank=None):
            if not keep:
                return {}
            return {
                name: value.detach().cpu().clone()
                for name, value in self._target().state_dict().items()
                if isinstance(value, torch.Tensor)
            }

    def load_model_state(self, state: Mapping[str, Any], *, full: bool, strict: bool) -> None:
        """Load a full state into the engine's module and its fp32 master copy (collective).

        Under ZeRO-3 the parameters are gathered, rank 0's copy is written and partitioned
        again on exit. The optimizer's fp32 partitions (ZeRO 1-3, bf16) are then refreshed
        from the new weights, or its next step would bring the old ones back.

        Raises:
            ValueError: ``full=False`` (see `model_state`).
        """
        _require_full(full, "load_model_state")
        with self._gathered(modifier_rank=0), torch.no_grad():
            self._target().load_state_dict(dict(state), strict=strict)
        refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
        if callable(refresh):
            refresh()

    def optimizer_not_portable(self) -> str | None:
        """Why this engine's optimizer state has no per-parameter form, or None (ZeRO-0 fp32)."""
        stage = self._stage()
        if stage > 0:
            form = f"its own partitioned form (ZeRO stage {stage})"
        elif self.engine.bfloat16_enabled() or self.engine.fp16_enabled():
            form = "its own mixed-precision optimizer's form (ZeRO stage 0 in bf16 or fp16)"
        else:
            return None
        return (
            f"DeepSpeed keeps this engine's optimizer state in {form}, which has no "
            "per-parameter full form here"
        )


def _require_full(full: bool, what: str) -> None:
    if not full:
        message = (
            f"DeepSpeedBackend.{what}(full=False): an engine's sharded state is DeepSpeed's "
            "own checkpoint files (engine.save_checkpoint, the 'deepspeed' format); ask for "
            "full=True"
        )
        raise ValueError(message)
