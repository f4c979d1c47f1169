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
from torch.optim import Optimizer

from comm_collectives import get_rank

from .._registry import _deepspeed_engine_type
from ._base import Backend
from ._deepspeed_native import EngineCheckpoint
from ._native import NativeCheckpoint

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

    Its natural checkpoint is DeepSpeed's own files, saved and loaded through
    `native_checkpoint` (``engine.save_checkpoint`` / ``load_checkpoint``). Full states
    (the form every backend shares) are read and written with DeepSpeed's public
    per-parameter API: the fp32 master weights and the optimizer state of ZeRO 1-3 and
    bf16, at any world size; the client torch optimizer's own state under ZeRO-0 in fp32.
    Only ZeRO-0 in fp16 has no per-parameter optimizer state.
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

    def native_checkpoint(self) -> NativeCheckpoint:
        """The engine's own checkpoint files: ``engine.save_checkpoint`` and
        ``engine.load_checkpoint``, natively for an engine of the same ZeRO stage, world
        size and precision."""
        return EngineCheckpoint(self.engine)

    def param_shapes(self) -> dict[str, list[Any]]:
        """``{name: [shape, dtype]}`` of the engine's module (ZeRO-3's full shapes).

        The names of its state dict, as every other backend gives them: each name of a
        tied parameter (``out.weight`` beside ``embed.weight``), persistent buffers only.
        """
        out: dict[str, list[Any]] = {}
        for name, value in self._target().state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor):
                shape = getattr(value, "ds_shape", value.shape)
                out[name] = [list(shape), str(value.dtype).removeprefix("torch.")]
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

    # ------------------------------------------------------------------ portable state
    # DeepSpeed's optimizers (ZeRO 1-3, and the BF16_Optimizer some ZeRO-0 bf16 engines
    # get) keep fp32 master weights and optimizer state in flat partitions. DeepSpeed's public per-parameter API
    # (deepspeed.utils.safe_get_full_fp32_param / safe_get_full_optimizer_state and their
    # safe_set_ twins) reads and writes them by the module's parameters at any stage: it
    # gives the full form every other backend speaks, whatever the world size. Only the
    # layout of the flat groups (which parameter is in which torch parameter group, and
    # which flat tensor holds the group's state) is read from the optimizer's attributes.

    def _flat_groups(self) -> list[tuple[int, torch.Tensor, list[nn.Parameter]]] | None:
        """``[(param group index, flat fp32 partition, its module parameters)]``, or None
        when the engine's optimizer keeps no flat partitions (ZeRO-0 fp32, fp16)."""
        zero = self.engine.optimizer
        if zero is None:
            return None
        if hasattr(zero, "sub_group_to_group_id") and hasattr(zero, "fp16_groups"):  # ZeRO-3
            return [
                (int(zero.sub_group_to_group_id[index]), flat, list(params))
                for index, (flat, params) in enumerate(
                    zip(zero.fp32_partitioned_groups_flat, zero.fp16_groups)
                )
            ]
        for flats, lows in (
            ("single_partition_of_fp32_groups", "bit16_groups"),  # ZeRO 1 and 2
            ("fp32_groups_flat_partition", "bf16_groups"),  # BF16_Optimizer
        ):
            if hasattr(zero, flats) and hasattr(zero, lows):
                return [
                    (index, flat, list(params))
                    for index, (flat, params) in enumerate(
                        zip(getattr(zero, flats), getattr(zero, lows))
                    )
                ]
        return None

    def optimizer_groups(self, optimizer: Optimizer) -> list[list[str]] | None:
        """Each param group as the names of its parameters: the torch optimizer's own
        groups under ZeRO-0 in fp32; else the engine's flat partitions, joined by group
        (ZeRO-3's sub-groups share their group's index)."""
        flat = self._flat_groups()
        if flat is None:
            return super().optimizer_groups(optimizer)
        names: dict[int, set[str]] = {}
        for name, param in self._target().named_parameters(remove_duplicate=False):
            names.setdefault(id(param), set()).add(name)
        joined: dict[int, set[str]] = {index: set() for index in range(len(optimizer.param_groups))}
        for index, _, params in flat:
            for param in params:
                joined.setdefault(index, set()).update(names.get(id(param), ()))
        return [sorted(joined[index]) for index in sorted(joined)]

    def _relink(self) -> None:
        """Point every parameter's fragment at its group's optimizer state (ZeRO 1-2, bf16).

        DeepSpeed links them once, after the first step of the first group: a second
        group's state did not exist yet then, and its moments stay unreachable through
        the per-parameter API ("exp_avg not found in optimizer state fragment", 0.19.8).
        ZeRO-3 reads the optimizer's state directly and needs no link.
        """
        zero = self.engine.optimizer
        relink = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
        if callable(relink):
            zero._hp_optimizer_states_linked = False
            relink()

    def _base_optimizer(self) -> Optimizer:
        """The torch optimizer that steps the flat partitions."""
        zero = self.engine.optimizer
        base: Optimizer = getattr(zero, "optimizer", zero)
        return base

    def _names(self) -> dict[int, str]:
        return {id(p): name for name, p in self._target().named_parameters()}

    def model_state(self, *, full: bool, rank0_only: bool = False) -> dict[str, Any]:
        """The module's full state on the CPU, with the fp32 master weights (collective).

        Where the optimizer keeps fp32 masters (ZeRO 1-3, bf16), the parameters are those
        masters, not the module's bf16/fp16 copy; buffers come from the module (gathered
        under ZeRO-3).

        Raises:
            ValueError: ``full=False``: an engine's sharded state is its own files
                (``engine.save_checkpoint``, the ``"deepspeed"`` format).
        """
        _require_full(full, "model_state")
        keep = not rank0_only or get_rank() == 0
        with self._gathered(modifier_rank=None):
            state = (
                {
                    name: value.detach().cpu().clone()
                    for name, value in self._target().state_dict().items()
                    if isinstance(value, torch.Tensor)
                }
                if keep
                else {}
            )
        groups = self._flat_groups()
        if groups is None:
            return state
        from deepspeed.utils import safe_get_full_fp32_param

        aliases: dict[int, list[str]] = {}  # a tied parameter has several names
        for name, param in self._target().named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        for _, _, params in groups:
            for param in params:
                master = safe_get_full_fp32_param(param)  # collective: every rank asks
                if not keep or master is None:
                    continue
                for name in aliases.get(id(param), []):
                    if name in state:
                        state[name] = master.detach().cpu().reshape(state[name].shape).clone()
        return state

    def load_model_state(self, state: Mapping[str, Any], *, full: bool, strict: bool) -> None:
        """Load a full state into the engine's module and its fp32 masters (collective).

        Under ZeRO-3 the parameters are gathered, rank 0's copy is written and partitioned
        again on exit. The fp32 masters (ZeRO 1-3, bf16) are then set from ``state``
        itself, exactly (not from the module's bf16 copy): otherwise the next step would
        bring the old weights back, or lose the low bits of the new ones.

        Raises:
            ValueError: ``full=False`` (see `model_state`).
        """
        _require_full(full, "load_model_state")
        with self._gathered(modifier_rank=0), torch.no_grad():
            self._target().load_state_dict(dict(state), strict=strict)
        groups = self._flat_groups()
        if groups is None:
            refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
            if callable(refresh):
                refresh()
            return
        names = self._names()
        with torch.no_grad():
            for _, _, params in groups:
                for param in params:
                    value = state.get(names.get(id(param), ""))
                    if isinstance(value, torch.Tensor) and param.requires_grad:
                        _set_full(param, value, None)

    def _check_optimizer(self, optimizer: Any) -> None:
        if optimizer is not self.engine.optimizer and optimizer is not self._base_optimizer():
            message = (
                f"the optimizer passed ({type(optimizer).__name__}) is not this DeepSpeed "
                "engine's (engine.optimizer): pass the engine's optimizer wrapper"
            )
            raise ValueError(message)

    def optim_state(
        self, optimizer: Optimizer, *, full: bool, rank0_only: bool = False, to_load: bool = False
    ) -> dict[str, Any]:
        """The engine's optimizer state, full and keyed by parameter names (collective).

        The same form as every other backend's full optimizer state (torch's
        ``get_optimizer_state_dict(full_state_dict=True)``): ``{"state": {name: {"step",
        "exp_avg", ...}}, "param_groups": [{hyperparameters, "params": [names]}]}``, read
        from the flat partitions with DeepSpeed's per-parameter API.

        Raises:
            ValueError: ``full=False``, a state with no per-parameter form (fp16 at ZeRO-0),
                or an optimizer that is not the engine's.
        """
        groups = self._flat_groups()
        if groups is None:
            return super().optim_state(optimizer, full=full, rank0_only=rank0_only, to_load=to_load)
        _require_full(full, "optim_state")
        self._check_optimizer(optimizer)
        from deepspeed.utils import safe_get_full_optimizer_state

        keep = not rank0_only or get_rank() == 0
        base = self._base_optimizer()
        names = self._names()
        if base.state:
            self._relink()
        out_groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": []}
            for group in base.param_groups
        ]
        states: dict[str, dict[str, Any]] = {}
        for index, flat, params in groups:
            flat_state = base.state.get(flat, {})
            keys = _element_keys(flat_state, flat)
            for param in params:
                name = names[id(param)]
                out_groups[index]["params"].append(name)
                if not keys:
                    continue
                entry = {key: _copy(value) for key, value in flat_state.items() if key not in keys}
                for key in keys:  # collective: every rank asks for every key
                    value = safe_get_full_optimizer_state(param, key)
                    if keep and value is not None:
                        entry[key] = value.detach().cpu().reshape(_shape(param)).clone()
                states[name] = entry
        if not keep:
            return {}
        return {"state": states, "param_groups": out_groups}

    def load_optim_state(
        self, optimizer: Optimizer, state: Mapping[str, Any], *, full: bool, strict: bool = True
    ) -> None:
        """Load a full optimizer state keyed by parameter names into the flat partitions.

        A fresh engine has no optimizer state yet: it is created (zeros, then the saved
        values), as the optimizer's first step would. Hyperparameters (``lr``, ``betas``,
        ...) come from the saved groups, matched by their parameters' names.

        Raises:
            ValueError: ``full=False``, no per-parameter form, not the engine's optimizer,
                or a parameter of the model missing from ``state`` (unless ``strict=False``).
        """
        groups = self._flat_groups()
        if groups is None:
            super().load_optim_state(optimizer, state, full=full, strict=strict)
            return
        _require_full(full, "load_optim_state")
        self._check_optimizer(optimizer)

        base = self._base_optimizer()
        names = self._names()
        saved_states: Mapping[str, Any] = state.get("state", {})
        saved_groups = list(state.get("param_groups", []))
        group_of = {name: g for g, group in enumerate(saved_groups) for name in group["params"]}
        for index, flat, params in groups:
            first = names[id(params[0])] if params else None
            if first in group_of:
                saved = saved_groups[group_of[first]]
                base.param_groups[index].update({k: v for k, v in saved.items() if k != "params"})
            entries = [saved_states.get(names[id(p)]) for p in params]
            sample = next((e for e in entries if e), None)
            if sample is None:
                continue  # the optimizer had not stepped: nothing to restore
            keys = [k for k, v in sample.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
            current = base.state.get(flat, {})
            base.state[flat] = {  # what a strict=False load skips keeps its current values
                **{k: _copy(v) for k, v in sample.items() if k not in keys},
                **{k: current[k] if k in current else torch.zeros_like(flat) for k in keys},
            }
        self._relink()  # ZeRO 1-2, bf16: point the parameters at the new state
        with torch.no_grad():
            for _, flat, params in groups:
                keys = _element_keys(base.state.get(flat, {}), flat)
                for param in params:
                    name = names[id(param)]
                    entry = saved_states.get(name)
                    if not keys or not param.requires_grad:
                        continue
                    if not entry and name in group_of:
                        # saved without a state (no gradient yet): zero moments, which a
                        # step with no gradient leaves as torch's absent state would
                        entry = {key: torch.zeros(_shape(param)) for key in keys}
                    elif not entry and not strict:
                        continue  # strict=False: this parameter keeps its own state
                    if not entry:
                        message = (
                            f"the optimizer state has no entry for {names[id(param)]!r}, "
                            "a parameter of this model"
                        )
                        raise ValueError(message)
                    for key in keys:
                        _set_full(param, entry[key], key)

    def optimizer_not_portable(self) -> str | None:
        """Why this engine's optimizer state has no per-parameter form, or None.

        Every ZeRO stage has one (DeepSpeed's per-parameter API), and ZeRO-0 in fp32 (the
        client torch optimizer). ZeRO-0 in bf16 or fp16 keeps its state in DeepSpeed's
        mixed-precision optimizer, which has none.
        """
        if self._flat_groups() is not None:
            return None
        if self.engine.fp16_enabled() or self.engine.bfloat16_enabled():
            return (
                "DeepSpeed keeps this engine's optimizer state in its own mixed-precision "
                "optimizer (ZeRO stage 0 in bf16 or fp16), which has no per-parameter full "
                "form: use ZeRO stage 1-3 for checkpoints that move"
            )
        return None


def _shape(param: torch.Tensor) -> torch.Size:
    """A parameter's full shape (ZeRO-3 keeps it as ``ds_shape``)."""
    shape: torch.Size = getattr(param, "ds_shape", param.shape)
    return shape


def _set_full(param: torch.Tensor, value: torch.Tensor, key: str | None) -> None:
    """Set a parameter's full fp32 master (``key`` None) or optimizer state ``key``.

    ZeRO-3 takes this rank's slice through DeepSpeed's local setters: its full setter
    cannot fill the last rank's padded partition when the size does not divide evenly.
    """
    flat = value.detach().float().cpu().flatten()
    if not hasattr(param, "ds_id"):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if key is None:
            safe_set_full_fp32_param(param, flat.view(_shape(param)))
        else:
            safe_set_full_optimizer_state(param, flat.view(_shape(param)), key)
        return
    import torch.distributed as torch_dist
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

    size = int(param.ds_tensor.numel())  # type: ignore[attr-defined]
    start = size * torch_dist.get_rank(group=getattr(param, "ds_process_group", None))
    piece = torch.zeros(size, dtype=torch.float32)
    chunk = flat[start : start + size]
    piece[: chunk.numel()] = chunk
    if key is None:
        safe_set_local_fp32_param(param, piece)
    else:
        safe_set_local_optimizer_state(param, piece, key)


def _element_keys(flat_state: Mapping[str, Any], flat: torch.Tensor) -> list[str]:
    """The optimizer-state keys that hold one value per element of ``flat`` (moments)."""
    return [
        key
        for key, value in flat_state.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == flat.numel()
    ]


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _require_full(full: bool, what: str) -> None:
    if not full:
        message = (
            f"DeepSpeedBackend.{what}(full=False): an engine's sharded state is DeepSpeed's "
            "own checkpoint files (engine.save_checkpoint, the 'deepspeed' format); ask for "
            "full=True"
        )
        raise ValueError(message)
