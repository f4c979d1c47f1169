"""`DeepSpeedStrategy`: ZeRO 0-3 through a DeepSpeed engine (the ``deepspeed`` extra)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comm_wrappers import AmpOptimWrapper, OptimWrapper

from ._build import build_optimizer, is_optim_wrapper
from .base import SetupContext, Strategy

__all__ = ["DeepSpeedStrategy"]


def _load_config(config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """A deep copy of the config dict, the JSON object of the file it names, or ``{}``."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if not isinstance(config, (str, os.PathLike)):
        message = f"config must be a dict, a JSON file path or None, got {type(config).__name__}"
        raise TypeError(message)
    loaded = json.loads(Path(config).read_text())
    if isinstance(loaded, dict):
        return loaded
    message = f"the DeepSpeed config file {os.fspath(config)!r} must hold a JSON object"
    raise ValueError(message)


class DeepSpeedStrategy(Strategy):
    """Train with a DeepSpeed engine: ZeRO stages 0-3, bf16, accumulation and clipping.

    The config is a dict, the path of a JSON file, or nothing; keywords override its
    entries (``zero_stage=3`` sets ``zero_optimization.stage``). Neither the config nor the
    file is changed. The optimizer is either the config's (``"optimizer": {"type": "AdamW",
    "params": {..., "torch_adam": True}}`` needs no C++ build on the CPU) or the one of
    ``optim_wrapper`` in `prepare` (a config dict, a torch optimizer or an `OptimWrapper`),
    handed to DeepSpeed as its client optimizer. An `OptimWrapper`'s
    ``accumulative_counts`` and ``clip_grad`` become ``gradient_accumulation_steps`` and
    ``gradient_clipping`` (a conflict with the config is an error); an `AmpOptimWrapper`
    with ``dtype="bfloat16"`` turns bf16 on. Without ``gradient_clipping`` anywhere
    gradients are not clipped, as with the other strategies (DeepSpeed alone would clip at
    1.0). ``train_micro_batch_size_per_gpu`` defaults to the runner's batch size
    (``dispatch_kwargs``), else 1.

    Needs ``pip install --no-build-isolation "comm-strategies[deepspeed]"`` (checked in
    `prepare`, so the strategy can be built and configured without DeepSpeed).

    Args:
        config: A DeepSpeed config dict, a JSON file path, or None.
        zero_stage: Overrides ``zero_optimization.stage``.
        zero_optimization: Overrides ``zero_optimization`` (merged key by key).
        bf16: ``True``/``False`` or a dict; overrides ``bf16``.
        fp16: A dict; overrides ``fp16`` (refused by DeepSpeed on most CPUs).
        gradient_accumulation_steps: Overrides the config's.
        gradient_clipping: Overrides the config's (0 turns clipping off).
        train_micro_batch_size_per_gpu: Overrides the config's.
        inputs_to_half: Positions or keys of the inputs cast to the engine's half dtype.
        **kwargs: See `Strategy`.
    """

    name = "deepspeed"

    def __init__(
        self,
        *,
        config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        zero_stage: int | None = None,
        zero_optimization: Mapping[str, Any] | None = None,
        bf16: bool | Mapping[str, Any] | None = None,
        fp16: Mapping[str, Any] | None = None,
        gradient_accumulation_steps: int | None = None,
        gradient_clipping: float | None = None,
        train_micro_batch_size_per_gpu: int | None = None,
        inputs_to_half: Sequence[int | str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        options = _load_config(config)
        if zero_optimization is not None:
            merged = dict(options.get("zero_optimization", {}))
            merged.update(copy.deepcopy(dict(zero_optimization)))
            options["zero_optimization"] = merged
        if zero_stage is not None:
            if zero_stage not in (0, 1, 2, 3):
                message = f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}"
                raise ValueError(message)
            options["zero_optimization"] = {
                **options.get("zero_optimization", {}),
                "stage": zero_stage,
            }
        if bf16 is not None:
            options["bf16"] = {"enabled": bf16} if isinstance(bf16, bool) else dict(bf16)
        if fp16 is not None:
            options["fp16"] = dict(fp16)
        for key, value in (
            ("gradient_accumulation_steps", gradient_accumulation_steps),
            ("gradient_clipping", gradient_clipping),
            ("train_micro_batch_size_per_gpu", train_micro_batch_size_per_gpu),
        ):
            if value is not None:
                options[key] = value
        self.config = options
        self.inputs_to_half = None if inputs_to_half is None else list(inputs_to_half)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the config (0 when it has none)."""
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    def _engine_config(self, optim_wrapper: Any, dispatch: Mapping[str, Any]) -> dict[str, Any]:
        config = copy.deepcopy(self.config)
        if isinstance(optim_wrapper, Mapping):
            for unsupported in ("constructor", "paramwise_cfg"):  # refused as elsewhere
                if unsupported in optim_wrapper:
                    message = (
                        f"optim_wrapper config key {unsupported!r} is not supported by "
                        "DeepSpeedStrategy (the engine would train without it): build the "
                        "optimizer yourself (parameter groups included) and pass it as "
                        f"'optimizer'; got {unsupported}={optim_wrapper[unsupported]!r}"
                    )
                    raise ValueError(message)
            counts = optim_wrapper.get("accumulative_counts")
            clip = optim_wrapper.get("clip_grad")
            wrapper_type = optim_wrapper.get("type", "OptimWrapper")
            is_amp = wrapper_type in ("AmpOptimWrapper", AmpOptimWrapper)
            amp_dtype = optim_wrapper.get("dtype", "bfloat16") if is_amp else None
        elif isinstance(optim_wrapper, OptimWrapper):
            counts = optim_wrapper.accumulative_counts
            clip = optim_wrapper.clip_grad
            amp_dtype = (
                optim_wrapper.cast_dtype if isinstance(optim_wrapper, AmpOptimWrapper) else None
            )
        else:
            counts, clip, amp_dtype = None, None, None
        if counts is not None and counts != 1:
            _agree(config, "gradient_accumulation_steps", int(counts), "accumulative_counts")
        if clip is not None:
            clip = dict(clip)
            if clip.get("type", "norm") != "norm":
                message = "DeepSpeed clips by norm only: clip_grad type 'value' is not supported"
                raise ValueError(message)
            _agree(config, "gradient_clipping", float(clip["max_norm"]), "clip_grad max_norm")
        if amp_dtype is not None and str(amp_dtype).replace("torch.", "") == "bfloat16":
            config.setdefault("bf16", {"enabled": True})
        config.setdefault("gradient_clipping", 0.0)
        if "train_batch_size" not in config:
            batch = dispatch.get("train_micro_batch_size_per_gpu")
            config.setdefault("train_micro_batch_size_per_gpu", int(batch) if batch else 1)
        return config

    def _setup(
        self, model: nn.Module, optim_wrapper: Any, context: SetupContext
    ) -> tuple[nn.Module, Any, Any]:
        """Build the DeepSpeed engine: it places and wraps the model with the optimizer."""
        model = self._compile(model, context.compile)
        dispatch = context.dispatch
        try:
            from comm_wrappers.deepspeed import initialize
        except ImportError as error:
            message = (
                "DeepSpeedStrategy needs DeepSpeed. Install torch first, then: "
                'pip install --no-build-isolation "comm-strategies[deepspeed]"'
            )
            raise ImportError(message) from error
        config = self._engine_config(optim_wrapper, dispatch)
        client: torch.optim.Optimizer | None
        if optim_wrapper is None:
            client = None
        elif isinstance(optim_wrapper, torch.optim.Optimizer):
            client = optim_wrapper
        elif is_optim_wrapper(optim_wrapper):
            client = optim_wrapper.optimizer
        elif isinstance(optim_wrapper, Mapping):
            if "optimizer" not in optim_wrapper:
                message = (
                    "the optim_wrapper config needs an 'optimizer' entry such as "
                    f"dict(type='AdamW', lr=1e-3), got keys {sorted(optim_wrapper)}"
                )
                raise ValueError(message)
            client = build_optimizer(optim_wrapper["optimizer"], model)
        else:
            message = (
                "optim_wrapper must be None, a torch optimizer, an OptimWrapper or a config "
                f"dict, got {type(optim_wrapper).__name__}"
            )
            raise TypeError(message)
        if client is not None and "optimizer" in config:
            message = (
                "both the DeepSpeed config and optim_wrapper name an optimizer: keep one "
                "(remove 'optimizer' from the config, or pass optim_wrapper=None)"
            )
            raise ValueError(message)
        if client is not None:
            # Any torch optimizer works as ZeRO's inner optimizer (DeepSpeed only lists the
            # ones it tested).
            config.setdefault("zero_allow_untested_optimizer", True)
        engine, optim = initialize(model, config, client, inputs_to_half=self.inputs_to_half)
        target = engine.model.basic_optimizer
        if client is None and "optimizer" not in config:
            return engine, None, target
        return engine, optim, target


def _agree(config: dict[str, Any], key: str, value: Any, source: str) -> None:
    if key in config and config[key] != value:
        message = (
            f"the DeepSpeed config says {key}={config[key]!r} but the optim_wrapper's "
            f"{source} is {value!r}; set it in one place"
        )
        raise ValueError(message)
    config[key] = value
