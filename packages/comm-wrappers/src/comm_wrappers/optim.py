"""Optimizer wrappers: MMEngine's step protocol, right under DDP, FSDP1 and FSDP2.

`OptimWrapper` runs backward, gradient accumulation (skipping the gradient sync on the
micro-steps), clipping and the optimizer step. `AmpOptimWrapper` adds autocast (bf16 on CPU
too) and a gradient scaler for float16. `OptimWrapperDict` holds several of them.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["AmpOptimWrapper", "OptimWrapper", "OptimWrapperDict"]

_CLIP_TYPES = ("norm", "value")


def _is_fsdp1(model: Any) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel)


def _fsdp1_root(model: Any) -> Any:
    """The root FSDP1 module of ``model`` (itself, or inside it), or None without FSDP1.

    Raises:
        RuntimeError: ``model`` holds FSDP1 units but not their root (e.g. the user's module
            inside the wrapper): the norm of the whole model is out of reach.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(model, nn.Module):
        return None
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    if not units:
        return None
    # _is_root is None before the first forward, when only the outermost unit can be root.
    for unit in units:
        if getattr(unit, "_is_root", None) in (True, None):
            return unit
    message = (
        f"optim_context got a {type(model).__name__} that holds FSDP units but not their root; "
        "pass the FSDP wrapper itself (MMFullyShardedDataParallel), so clipping uses the "
        "whole model's norm"
    )
    raise RuntimeError(message)


@contextlib.contextmanager
def no_sync(model: Any) -> Iterator[None]:
    """Skip the gradient sync of ``model`` for one forward/backward (DDP, FSDP1, FSDP2).

    A model without a way to skip it (one process, DeepSpeed ZeRO 2/3) syncs as usual.
    """
    if getattr(model, "static_graph", False):
        message = (
            "DDP with static_graph=True cannot skip the gradient sync on accumulation "
            "micro-steps (torch fails inside its reducer): use static_graph=False, or "
            "accumulative_counts=1"
        )
        raise ValueError(message)
    own = getattr(model, "no_sync", None)
    if callable(own):
        with own():
            yield
        return
    from ._registry import _fsdp2_module_type

    fsdp2 = _fsdp2_module_type()
    if fsdp2 is not None and isinstance(model, fsdp2):
        model.set_requires_gradient_sync(False)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[attr-defined]
        return
    yield


class OptimWrapper:
    """Backward, gradient accumulation, clipping and the optimizer step in one call.

    MMEngine's ``OptimWrapper`` protocol: ``train_step`` runs the forward inside
    ``optim_context(model)`` and calls ``update_params(loss)``, which divides the loss by
    the accumulation count, runs backward, and every ``accumulative_counts`` calls clips,
    steps and zeroes the gradients. On the micro-steps ``optim_context`` enters the model's
    ``no_sync()``, so gradients are all-reduced only once per update.

    Clipping by norm uses the norm of the whole model: under FSDP1 the wrapper's own
    ``clip_grad_norm_``, under FSDP2 the sharded gradients' global norm; never a rank's
    local shard. The model is the one last passed to ``optim_context``.

    Args:
        optimizer: A torch optimizer.
        accumulative_counts: Backward passes per optimizer step.
        clip_grad: ``dict(type="norm", max_norm=..., norm_type=2)`` or
            ``dict(type="value", clip_value=...)``; ``type`` defaults to ``"norm"``. Not
            mutated.

    Attributes:
        grad_norm: The total gradient norm measured by the last clipping by norm (a tensor),
            or None.

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.ones_(model.weight)
        >>> wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.5))
        >>> wrapper.update_params(model(torch.ones(1, 2)).sum())
        >>> model.weight
        Parameter containing:
        tensor([[0.5000, 0.5000]], requires_grad=True)
    """

    def __init__(
        self,
        optimizer: Optimizer,
        accumulative_counts: int = 1,
        clip_grad: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            message = (
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "build it over the wrapped model's parameters first"
            )
            raise TypeError(message)
        if isinstance(accumulative_counts, bool) or not isinstance(accumulative_counts, int):
            message = f"accumulative_counts must be an int >= 1, got {accumulative_counts!r}"
            raise TypeError(message)
        if accumulative_counts < 1:
            message = f"accumulative_counts must be >= 1, got {accumulative_counts}"
            raise ValueError(message)
        self.optimizer = optimizer
        self._accumulative_counts = accumulative_counts
        self._inner_count = 0
        self._max_counts = -1
        self._remainder_counts = -1
        self._divisible_counts = -1
        self._model: Any = None
        self._fsdp_root: Any = None
        self._fsdp_root_of: Any = None
        self.grad_norm: torch.Tensor | None = None
        self.clip_grad_kwargs: dict[str, Any] = {}
        self._clip_type: str | None = None
        if clip_grad is not None:
            self._set_clip(clip_grad)

    def _set_clip(self, clip_grad: Mapping[str, Any]) -> None:
        if not isinstance(clip_grad, Mapping):
            message = (
                "clip_grad must be a dict such as dict(type='norm', max_norm=1.0), "
                f"got {type(clip_grad).__name__}"
            )
            raise TypeError(message)
        kwargs = dict(clip_grad)
        clip_type = kwargs.pop("type", "norm")
        if clip_type not in _CLIP_TYPES:
            message = f"clip_grad type must be one of {_CLIP_TYPES}, got {clip_type!r}"
            raise ValueError(message)
        required = "max_norm" if clip_type == "norm" else "clip_value"
        if required not in kwargs:
            message = (
                f"clip_grad of type {clip_type!r} needs {required!r}, got keys {sorted(clip_grad)}"
            )
            raise ValueError(message)
        self._clip_type = clip_type
        self.clip_grad_kwargs = kwargs

    # ------------------------------------------------------------------ the step
    def update_params(
        self,
        loss: torch.Tensor,
        step_kwargs: Mapping[str, Any] | None = None,
        zero_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Scale the loss for accumulation, run backward, and step + zero when it is time."""
        loss = self.scale_loss(loss)
        self.backward(loss)
        if self.should_update():
            self.step(**(step_kwargs or {}))
            self.zero_grad(**(zero_kwargs or {}))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Divide the loss by the number of backward passes in the current update."""
        if self._max_counts == -1 or self._inner_count < self._divisible_counts:
            factor = self._accumulative_counts
        else:
            factor = self._remainder_counts
        # No division (and no node in the backward graph) without accumulation.
        return loss if factor == 1 else loss / factor

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Run ``loss.backward(**kwargs)`` and count the pass."""
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]
        self._inner_count += 1

    def step(self, **kwargs: Any) -> None:
        """Clip the gradients (if configured) and step the optimizer."""
        if self._clip_type is not None:
            self._clip_grad()
        self.optimizer.step(**kwargs)

    def zero_grad(self, **kwargs: Any) -> None:
        """Zero the optimizer's gradients."""
        self.optimizer.zero_grad(**kwargs)

    def _grad_params(self) -> list[torch.Tensor]:
        return [
            p
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    def _root_unit(self) -> Any:
        # Looked up once per model (walking every module on every step costs time), once
        # FSDP has decided which unit is the root (at the first forward).
        if self._fsdp_root_of is not self._model:
            root = _fsdp1_root(self._model)
            if root is None or getattr(root, "_is_root", None) is not None:
                self._fsdp_root, self._fsdp_root_of = root, self._model
            return root
        return self._fsdp_root

    def _clip_grad(self) -> None:
        params = self._grad_params()
        if self._clip_type == "value":
            if params:
                nn.utils.clip_grad_value_(params, **self.clip_grad_kwargs)
            return
        root = self._root_unit()
        if root is not None:
            # FSDP1: every rank holds a shard; FSDP's own method all-reduces the norm. It takes
            # max_norm and norm_type only: error_if_nonfinite is checked here.
            options = dict(self.clip_grad_kwargs)
            error_if_nonfinite = options.pop("error_if_nonfinite", False)
            options.pop("foreach", None)
            self.grad_norm = root.clip_grad_norm_(**options)
            if error_if_nonfinite and not torch.isfinite(self.grad_norm).all():
                message = (
                    f"the total gradient norm is {float(self.grad_norm)} (not finite) and "
                    "clip_grad has error_if_nonfinite=True"
                )
                raise RuntimeError(message)
            return
        if not params:
            return
        if self._model is None and any(getattr(p, "_fsdp_flattened", False) for p in params):
            message = (
                "clipping by norm under FSDP needs the model, to use the whole model's norm "
                "instead of this rank's shard: run the forward inside "
                "optim_wrapper.optim_context(model) (train_step does) before update_params"
            )
            raise RuntimeError(message)
        norm = nn.utils.clip_grad_norm_(params, **self.clip_grad_kwargs)
        # FSDP2: the gradients are DTensors and the norm is reduced across the mesh.
        full_tensor = getattr(norm, "full_tensor", None)
        self.grad_norm = full_tensor() if callable(full_tensor) else norm

    # ------------------------------------------------------------------ accumulation
    @contextlib.contextmanager
    def optim_context(self, model: nn.Module) -> Iterator[None]:
        """Enter ``model``'s ``no_sync()`` on a micro-step that must not synchronise.

        Also remembers ``model`` for clipping by norm (FSDP needs the whole model's norm).
        """
        self._model = model
        if self.should_sync():
            yield
        else:
            with no_sync(model):
                yield

    def should_update(self) -> bool:
        """Whether the backward pass just counted completes an update."""
        return (
            self._inner_count % self._accumulative_counts == 0
            or self._inner_count == self._max_counts
        )

    def should_sync(self) -> bool:
        """Whether the next backward pass completes an update (so gradients must sync)."""
        return (self._inner_count + 1) % self._accumulative_counts == 0 or (
            self._inner_count + 1
        ) == self._max_counts

    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int) -> None:
        """Set the pass counter (after a resume) and the total number of passes.

        With ``max_counts`` not a multiple of ``accumulative_counts``, the last, shorter
        update divides the loss by its own length instead.
        """
        self._inner_count = init_counts
        self._max_counts = max_counts
        if init_counts % self._accumulative_counts != 0:
            warnings.warn(
                f"resumed at pass {init_counts}, inside an accumulation of "
                f"{self._accumulative_counts}: the first update after the resume is partial",
                stacklevel=2,
            )
        if self._accumulative_counts > 1 and _has_batch_norm(model):
            warnings.warn(
                "gradient accumulation with BatchNorm layers: the statistics see micro-batches, "
                "so results differ from one big batch",
                stacklevel=2,
            )
        self._remainder_counts = max_counts % self._accumulative_counts
        self._divisible_counts = max_counts - self._remainder_counts

    @property
    def inner_count(self) -> int:
        """Backward passes counted so far."""
        return self._inner_count

    @property
    def accumulative_counts(self) -> int:
        """Backward passes per optimizer step."""
        return self._accumulative_counts

    # ------------------------------------------------------------------ state
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        """The optimizer's defaults."""
        return self.optimizer.defaults

    def get_lr(self) -> dict[str, list[float]]:
        """Return ``{"lr": [lr of each parameter group]}``."""
        return {"lr": [group["lr"] for group in self.param_groups]}

    def get_momentum(self) -> dict[str, list[float]]:
        """Return ``{"momentum": [...]}``: each group's momentum, or its first beta, or 0."""
        values = []
        for group in self.param_groups:
            if "momentum" in group:
                values.append(group["momentum"])
            elif "betas" in group:
                values.append(group["betas"][0])
            else:
                values.append(0)
        return {"momentum": values}

    def state_dict(self) -> dict[str, Any]:
        """Return the optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load an optimizer state dict (the argument is not mutated)."""
        self.optimizer.load_state_dict(dict(state_dict))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(optimizer={type(self.optimizer).__name__}, "
            f"accumulative_counts={self._accumulative_counts}, "
            f"clip_grad={self._clip_spec()!r})"
        )

    def _clip_spec(self) -> dict[str, Any] | None:
        if self._clip_type is None:
            return None
        return {"type": self._clip_type, **self.clip_grad_kwargs}


def _has_batch_norm(model: Any) -> bool:
    if not isinstance(model, nn.Module):
        return False
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
}


def to_dtype(value: str | torch.dtype, name: str) -> torch.dtype:
    """Turn ``"bfloat16"``, ``"bf16"``, ``torch.bfloat16``... into a torch dtype."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.lower().removeprefix("torch.")]
    message = f"{name} must be a torch.dtype or one of {sorted(_DTYPES)}, got {value!r}"
    raise ValueError(message)


class AmpOptimWrapper(OptimWrapper):
    """`OptimWrapper` with autocast in ``optim_context`` and, for float16, a gradient scaler.

    bfloat16 needs no scaler and works on CPU. float16 gets ``torch.amp.GradScaler`` (the
    sharded scaler with ``use_fsdp=True``, as MMEngine's FSDP strategy passes).

    Args:
        optimizer: A torch optimizer.
        loss_scale: ``"dynamic"``, a float (a static scale), or a dict of ``GradScaler``
            keywords. Used for float16 only.
        dtype: The autocast dtype (a torch dtype or a name such as ``"bfloat16"``);
            default float16 where the model computes on CUDA (under nccl, or with CUDA and
            no process group), bfloat16 elsewhere (also under gloo on a machine with a GPU).
        use_fsdp: Use FSDP's ``ShardedGradScaler`` from the start. Under an FSDP1 model it
            is chosen anyway at the first ``optim_context`` (a plain scaler would let the
            ranks disagree on skipping a step).
        **kwargs: `OptimWrapper` arguments.

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> wrapper = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), dtype="bfloat16")
        >>> with wrapper.optim_context(model):
        ...     out = model(torch.ones(1, 2))
        >>> out.dtype
        torch.bfloat16
    """

    def __init__(
        self,
        optimizer: Optimizer,
        loss_scale: str | float | Mapping[str, Any] = "dynamic",
        dtype: str | torch.dtype | None = None,
        use_fsdp: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizer, **kwargs)
        from .fsdp import default_device_id

        # float16 where the model will compute on CUDA (under nccl, or CUDA without a
        # process group); bfloat16 on the CPU, also under gloo on a machine with a GPU.
        self._device_type = default_device_id().type
        default = "float16" if self._device_type == "cuda" else "bfloat16"
        self.cast_dtype = to_dtype(default if dtype is None else dtype, "dtype")
        self._static_scale: float | None = None
        self.loss_scaler: Any = None
        self._scaler_kwargs: dict[str, Any] = {}
        self._scaler_checked_for: Any = None
        self._autocast_for: Any = None
        self._autocast_type = "cpu"
        if self.cast_dtype == torch.float16:
            if loss_scale == "dynamic":
                pass
            elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
                self._static_scale = float(loss_scale)
                self._scaler_kwargs = {"init_scale": float(loss_scale)}
            elif isinstance(loss_scale, Mapping):
                self._scaler_kwargs = dict(loss_scale)
            else:
                message = (
                    f"loss_scale must be 'dynamic', a number or a dict of GradScaler "
                    f"keywords, got {loss_scale!r}"
                )
                raise ValueError(message)
            self.loss_scaler = self._new_scaler(sharded=use_fsdp)

    def _new_scaler(self, sharded: bool) -> Any:
        device = "cuda" if self._device_type == "cuda" else "cpu"
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device, **self._scaler_kwargs)
        return torch.amp.GradScaler(device, **self._scaler_kwargs)

    def _use_sharded_scaler_for(self, model: Any) -> None:
        """Under FSDP1 every rank must skip a step when any rank's shard overflowed."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if self.loss_scaler is None or isinstance(self.loss_scaler, ShardedGradScaler):
            return
        if self._scaler_checked_for is model:
            return
        self._scaler_checked_for = model
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return
        scaler = self._new_scaler(sharded=True)
        scaler.load_state_dict(self.loss_scaler.state_dict())
        self.loss_scaler = scaler

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Run backward on the scaled loss (float16) or the loss, and count the pass."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]
        self._inner_count += 1

    def step(self, **kwargs: Any) -> None:
        """Unscale, clip, step through the scaler (float16), or step as `OptimWrapper`."""
        if self.loss_scaler is None:
            super().step(**kwargs)
            return
        if self._clip_type is not None:
            self.loss_scaler.unscale_(self.optimizer)
            self._clip_grad()
        self.loss_scaler.step(self.optimizer, **kwargs)
        self.loss_scaler.update(self._static_scale)

    @contextlib.contextmanager
    def optim_context(self, model: nn.Module) -> Iterator[None]:
        """Skip the sync on micro-steps (as `OptimWrapper`) and autocast to ``cast_dtype``.

        Autocast runs on the model's device type, or on the machine's accelerator when the
        parameters are offloaded to the CPU by a sharded wrapper.
        """
        if self._autocast_for is not model:  # decided once per model, not every step
            self._autocast_type, self._autocast_for = _autocast_device(model), model
        with (
            super().optim_context(model),
            torch.autocast(self._autocast_type, dtype=self.cast_dtype),
        ):
            self._use_sharded_scaler_for(model)
            yield

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict, plus ``"loss_scaler"`` when a scaler is used."""
        state = dict(self.optimizer.state_dict())
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the optimizer's and the scaler's state (the argument is not mutated)."""
        state = dict(state_dict)
        scaler_state = state.pop("loss_scaler", None)
        if scaler_state is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(copy.copy(scaler_state))
        self.optimizer.load_state_dict(state)


def _autocast_device(model: Any) -> str:
    from ._registry import is_model_wrapper, module_device
    from .fsdp import default_device_id

    if not isinstance(model, nn.Module):
        return default_device_id().type
    device_type = module_device(model).type
    if device_type == "cpu" and is_model_wrapper(model):
        # FSDP with CPU offload computes on the process group's device (GPU under nccl)
        return default_device_id().type
    return device_type


class OptimWrapperDict:
    """Several named optimizer wrappers, for models that step several optimizers (GANs).

    The model's own ``train_step`` drives each wrapper (``wrappers["generator"]``), so the
    single-optimizer calls (``update_params``, ``optim_context``...) raise and say so.

    Examples:
        >>> import torch
        >>> g, d = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
        >>> wrappers = OptimWrapperDict(
        ...     generator=OptimWrapper(torch.optim.SGD(g.parameters(), lr=0.1)),
        ...     discriminator=OptimWrapper(torch.optim.SGD(d.parameters(), lr=0.2)),
        ... )
        >>> wrappers.get_lr()
        {'generator.lr': [0.1], 'discriminator.lr': [0.2]}
    """

    def __init__(self, **optim_wrappers: OptimWrapper) -> None:
        for name, wrapper in optim_wrappers.items():
            if not hasattr(wrapper, "update_params"):
                message = (
                    f"OptimWrapperDict[{name!r}] must be an optimizer wrapper, got "
                    f"{type(wrapper).__name__}; wrap the optimizer in OptimWrapper first"
                )
                raise TypeError(message)
        self.optim_wrappers: dict[str, OptimWrapper] = dict(optim_wrappers)

    def _single(self, what: str) -> NotImplementedError:
        names = ", ".join(repr(n) for n in self.optim_wrappers)
        return NotImplementedError(
            f"OptimWrapperDict.{what} is ambiguous: call it on one wrapper, e.g. "
            f"optim_wrapper[name].{what}(...), with name one of {names}"
        )

    def update_params(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Not available: call ``update_params`` on one of the wrappers."""
        raise self._single("update_params")

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Not available: call ``backward`` on one of the wrappers."""
        raise self._single("backward")

    def step(self, **kwargs: Any) -> None:
        """Not available: call ``step`` on one of the wrappers."""
        raise self._single("step")

    def optim_context(self, model: nn.Module) -> Any:
        """Not available: call ``optim_context`` on one of the wrappers."""
        raise self._single("optim_context")

    def zero_grad(self, **kwargs: Any) -> None:
        """Zero the gradients of every optimizer."""
        for wrapper in self.optim_wrappers.values():
            wrapper.zero_grad(**kwargs)

    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int) -> None:
        """Initialise the counters of every wrapper."""
        for wrapper in self.optim_wrappers.values():
            wrapper.initialize_count_status(model, init_counts, max_counts)

    def get_lr(self) -> dict[str, list[float]]:
        """Return ``{"<name>.lr": [...]}`` for every wrapper."""
        return {f"{n}.lr": w.get_lr()["lr"] for n, w in self.optim_wrappers.items()}

    def get_momentum(self) -> dict[str, list[float]]:
        """Return ``{"<name>.momentum": [...]}`` for every wrapper."""
        return {
            f"{n}.momentum": w.get_momentum()["momentum"] for n, w in self.optim_wrappers.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """Return ``{name: wrapper.state_dict()}``."""
        return {name: wrapper.state_dict() for name, wrapper in self.optim_wrappers.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load every wrapper's state; the keys must match the wrappers' names."""
        if set(state_dict) != set(self.optim_wrappers):
            message = (
                f"OptimWrapperDict.load_state_dict: expected keys {sorted(self.optim_wrappers)}, "
                f"got {sorted(state_dict)}"
            )
            raise KeyError(message)
        for name, state in state_dict.items():
            self.optim_wrappers[name].load_state_dict(state)

    @property
    def param_groups(self) -> dict[str, list[dict[str, Any]]]:
        """``{name: param_groups}`` of every wrapper."""
        return {name: w.param_groups for name, w in self.optim_wrappers.items()}

    def __getitem__(self, key: str) -> OptimWrapper:
        return self.optim_wrappers[key]

    def __contains__(self, key: object) -> bool:
        return key in self.optim_wrappers

    def __len__(self) -> int:
        return len(self.optim_wrappers)

    def __iter__(self) -> Iterator[str]:
        return iter(self.optim_wrappers)

    def keys(self) -> Any:
        """The wrappers' names."""
        return self.optim_wrappers.keys()

    def values(self) -> Any:
        """The wrappers."""
        return self.optim_wrappers.values()

    def items(self) -> Any:
        """``(name, wrapper)`` pairs."""
        return self.optim_wrappers.items()

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={w!r}" for n, w in self.optim_wrappers.items())
        return f"OptimWrapperDict({inner})"
