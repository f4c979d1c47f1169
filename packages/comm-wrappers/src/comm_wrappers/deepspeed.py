"""DeepSpeed engines with the same step API (the ``deepspeed`` extra).

Install with ``pip install --no-build-isolation "comm-wrappers[deepspeed]"`` after torch.
Nothing is imported from DeepSpeed modules it has removed (MMEngine 0.10.7 imports
``deepspeed.runtime.fp16.onebit`` and breaks on DeepSpeed 0.19).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

try:
    import deepspeed as _deepspeed
except ImportError as _error:  # pragma: no cover - exercised in an environment without it
    _message = (
        "comm_wrappers.deepspeed needs DeepSpeed. Install torch first, then: "
        'pip install --no-build-isolation "comm-wrappers[deepspeed]"'
    )
    raise ImportError(_message) from _error

from comm_collectives import get_local_rank

from ._model import check_mode_argument, model_parse_losses, preprocess, run_forward, to_device
from ._param_groups import LrMomentumMixin
from ._registry import _register_imported, register_model_wrapper
from .ddp import require_process_group

__all__ = ["DeepSpeedOptimWrapper", "MMDeepSpeedEngineWrapper", "initialize"]

_register_imported()


def _engine_of(model: Any) -> Any:
    return model.model if isinstance(model, MMDeepSpeedEngineWrapper) else model


class DeepSpeedOptimWrapper(LrMomentumMixin):
    """The step protocol on a DeepSpeed engine: ``update_params`` = engine backward + step.

    Gradient accumulation and clipping follow the engine's config
    (``gradient_accumulation_steps``, ``gradient_clipping``): the engine scales the loss,
    synchronises at the accumulation boundary and steps only there.

    Args:
        optimizer: The engine's optimizer (``engine.optimizer``).
        model: The engine (or its `MMDeepSpeedEngineWrapper`); ``optim_context(model)``
            sets it when it is not given here.
    """

    def __init__(self, optimizer: Any, model: Any = None) -> None:
        self.optimizer = optimizer
        self.model: Any = None if model is None else _engine_of(model)
        self._boundary = False

    def _engine(self, what: str) -> Any:
        if self.model is None:
            message = (
                f"DeepSpeedOptimWrapper.{what} needs the engine: pass model=engine to the "
                "constructor, or call it inside optim_context(model)"
            )
            raise RuntimeError(message)
        return self.model

    def update_params(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Run the engine's backward and step (it steps only at accumulation boundaries)."""
        self.backward(loss)
        self.step()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward(loss)``: scaled for accumulation, synced at the boundary."""
        engine = self._engine("backward")
        # The engine counts the micro-step in step(): until then its boundary flag says
        # whether this backward's micro-step ends an accumulation.
        self._boundary = bool(engine.is_gradient_accumulation_boundary())
        engine.backward(loss, **kwargs)

    def step(self, **kwargs: Any) -> None:
        """``engine.step()``: clips (per the config) and steps at the accumulation boundary."""
        self._engine("step").step(**kwargs)

    def zero_grad(self) -> None:
        """Zero the engine's gradients (the engine also does it after each step)."""
        self._engine("zero_grad").zero_grad()

    @contextlib.contextmanager
    def optim_context(self, model: Any) -> Iterator[None]:
        """Bind the engine; DeepSpeed manages syncing and precision itself."""
        if self.model is None:
            self.model = _engine_of(model)
        yield

    def should_update(self) -> bool:
        """Whether the last backward's micro-step ends an accumulation (its step updates)."""
        return self._boundary

    def should_sync(self) -> bool:
        """Whether the next backward ends an accumulation (DeepSpeed syncs gradients there)."""
        return bool(self._engine("should_sync").is_gradient_accumulation_boundary())

    def initialize_count_status(self, model: Any, init_counts: int, max_counts: int) -> None:
        """Nothing to do: the engine counts its own micro-steps and restores them on load."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups."""
        if self.optimizer is None:
            message = (
                "this DeepSpeed engine has no optimizer (none in the config, none passed to "
                "initialize): it can run val_step/test_step only"
            )
            raise RuntimeError(message)
        groups: list[dict[str, Any]] = self.optimizer.param_groups
        return groups

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its ZeRO partition under ZeRO 1-3)."""
        state: dict[str, Any] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load this rank's optimizer state, saved by `state_dict` in a world of the same size.

        Under ZeRO 1-3 the fp32 master partition is restored too, and the model's
        parameters are set from it.
        """
        group = getattr(self.optimizer, "dp_process_group", None)
        if group is None:  # ZeRO 0: a torch optimizer (or DeepSpeed's fp16/bf16 wrapper)
            self.optimizer.load_state_dict(dict(state_dict))
            return
        # ZeRO optimizers take one state per data-parallel rank and read their own entry.
        states = [dict(state_dict)] * torch.distributed.get_world_size(group)
        self.optimizer.load_state_dict(states, load_from_fp32_weights=True)
        # The fp32 master partition is restored: copy it into the model's parameters.
        update = getattr(self.optimizer, "update_lp_params", None)
        if callable(update):  # ZeRO 1 and 2
            update()
        else:  # ZeRO 3
            for group_index in range(len(self.optimizer.fp16_partitioned_groups_flat)):
                self.optimizer._reassign_or_swap_out_partitioned_parameters(group_index)


class MMDeepSpeedEngineWrapper(nn.Module):
    """A DeepSpeed engine with ``train_step`` / ``val_step`` / ``test_step``.

    An ``nn.Module`` holding the engine as ``model``; other attributes are looked up on the
    engine (``wrapper.save_checkpoint(...)`` is the engine's).

    Args:
        model: A ``deepspeed.DeepSpeedEngine``.
        inputs_to_half: Positions (tuple batches) or keys (dict batches) of the inputs to
            cast to the engine's low precision dtype (bf16 or fp16) when it has one.
    """

    def __init__(self, *, model: Any, inputs_to_half: Sequence[int | str] | None = None) -> None:
        super().__init__()
        self.model = model
        self.inputs_to_half = None if inputs_to_half is None else list(inputs_to_half)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            engine = self.__dict__.get("_modules", {}).get("model")
            if engine is None:
                raise
            return getattr(engine, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the engine; the ``inputs_to_half`` positions and keywords are cast first.

        A plain loop calls the wrapper directly (``model(inputs, labels, mode="loss")``),
        so the cast of `train_step` applies here too: positions index ``args``, names
        ``kwargs``. Tensors on another device are moved to the engine's first, as DDP and
        FSDP move a plain loop's CPU batch to the GPU.
        """
        device = self.model.device
        if device.type != "cpu":
            args, kwargs = to_device(args, device), to_device(kwargs, device)
        if self.inputs_to_half is not None:
            args = self._cast_inputs_half(args)
            kwargs = self._cast_inputs_half(kwargs)
        return self.model(*args, **kwargs)

    def _half_dtype(self) -> torch.dtype | None:
        if self.model.bfloat16_enabled():
            return torch.bfloat16
        if self.model.fp16_enabled():
            return torch.float16
        return None

    def _cast_inputs_half(self, data: Any) -> Any:
        if self.inputs_to_half is None:
            return data
        dtype = self._half_dtype()
        if dtype is None:
            return data

        def cast(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(dtype)
            return value

        if isinstance(data, Mapping):
            return {k: cast(v) if k in self.inputs_to_half else v for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(
                cast(v) if i in self.inputs_to_half else v for i, v in enumerate(data)
            )
        return data

    def train_step(self, data: Any, optim_wrapper: Any) -> Mapping[str, torch.Tensor]:
        """Preprocess, forward in ``"loss"`` mode through the engine, engine backward + step."""
        module = self.model.module
        with optim_wrapper.optim_context(self):
            batch = self._cast_inputs_half(preprocess(module, data, True))
            check_mode_argument(module)
            losses = run_forward(self.model, batch, "loss")
        loss, log_vars = model_parse_losses(module, losses)
        optim_wrapper.update_params(loss)
        return log_vars

    def val_step(self, data: Any) -> Any:
        """Preprocess (``training=False``) and forward in ``"predict"`` mode through the engine."""
        module = self.model.module
        batch = self._cast_inputs_half(preprocess(module, data, False))
        check_mode_argument(module)
        return run_forward(self.model, batch, "predict")

    def test_step(self, data: Any) -> Any:
        """Like `val_step`."""
        return self.val_step(data)


register_model_wrapper(MMDeepSpeedEngineWrapper, lambda wrapper: wrapper.model)


def initialize(
    model: nn.Module,
    config: Mapping[str, Any] | str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    inputs_to_half: Sequence[int | str] | None = None,
    **kwargs: Any,
) -> tuple[MMDeepSpeedEngineWrapper, DeepSpeedOptimWrapper]:
    """Build a DeepSpeed engine on the live process group and wrap it for the step API.

    Args:
        model: The model (MMEngine ``BaseModel`` contract, or a `LossModel`).
        config: A DeepSpeed config dict (not mutated) or the path of a JSON file.
            DeepSpeed clips gradients at norm 1.0 unless ``gradient_clipping`` says
            otherwise (0 turns clipping off). ``steps_per_print`` defaults to
            never, ``train_micro_batch_size_per_gpu`` to 1 when no batch size is given.
            On CPU use ``{"optimizer": {"type": "AdamW", "params": {..., "torch_adam": True}}}``
            or a client torch optimizer: neither needs a C++ build.
        optimizer: A client torch optimizer built over ``model.parameters()``.
        inputs_to_half: See `MMDeepSpeedEngineWrapper`.
        **kwargs: Other ``deepspeed.initialize`` keywords.

    Returns:
        ``(wrapper, optim_wrapper)``.

    Raises:
        NotInitializedError: No process group: call ``init_dist`` first (DeepSpeed then
            reuses it instead of looking for MPI).
    """
    require_process_group("comm_wrappers.deepspeed.initialize")
    # The engine reads LOCAL_RANK from the environment (mpirun and srun do not set it).
    os.environ.setdefault("LOCAL_RANK", str(get_local_rank()))
    if isinstance(config, (str, os.PathLike)):
        with open(config) as file:
            config = json.load(file)
    if not isinstance(config, Mapping):
        message = f"config must be a dict or the path of a JSON file, got {type(config).__name__}"
        raise TypeError(message)
    options = copy.deepcopy(dict(config))
    options.setdefault("steps_per_print", 10**13)
    if "train_batch_size" not in options:
        options.setdefault("train_micro_batch_size_per_gpu", 1)
    if optimizer is None and "optimizer" in options:
        kwargs.setdefault("model_parameters", [p for p in model.parameters() if p.requires_grad])
    engine, engine_optimizer, _, _ = _deepspeed.initialize(
        model=model, optimizer=optimizer, config=options, dist_init_required=False, **kwargs
    )
    return (
        MMDeepSpeedEngineWrapper(model=engine, inputs_to_half=inputs_to_half),
        DeepSpeedOptimWrapper(engine_optimizer, model=engine),
    )
