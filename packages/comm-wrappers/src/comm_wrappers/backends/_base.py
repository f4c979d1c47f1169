"""`Backend`: what the layers above ask of a prepared model, answered for a plain module.

One adapter per backend (plain module here; DDP, FSDP1, FSDP2 and DeepSpeed in the modules
beside this one), chosen once for a model by `backend_of`. Optimizer wrappers ask it for
the gradient sync, clipping, scaler and autocast device; checkpoints for the state dicts,
the natural format, the manifest's description and the backend's own checkpoint files
(`Backend.native_checkpoint`, DeepSpeed's). Nothing above it branches on the kind of
model.

Every backend but DeepSpeed goes through ``torch.distributed.checkpoint.state_dict``: one
naming (the user module's names, no ``module.`` or FSDP prefixes) and optimizer state keyed
by those names, whatever the wrapper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dsd
from torch.optim import Optimizer

from comm_collectives import get_rank

from .._registry import is_model_wrapper, module_device, unwrap_model
from ._device import rank_device
from ._native import NativeCheckpoint
from ._state import (
    describe_params,
    has_tensor_state,
    left_unstepped,
    quiet_torch,
    stateless_names,
    to_cpu,
)

__all__ = ["Backend", "new_grad_scaler"]


class Backend:
    """What a model's backend knows, asked by optimizers, strategies and checkpoints.

    Get one with [`backend_of`][comm_wrappers.backends.backend_of], which decides the
    backend once; callers may keep it for that model. This class serves a plain module;
    the adapters of DDP, FSDP1, FSDP2 and DeepSpeed subclass it. Every method that moves
    state is collective under a sharded backend: every rank calls it.

    Attributes:
        kind: ``"module"``, ``"ddp"``, ``"fsdp1"``, ``"fsdp2"`` or ``"deepspeed"`` (a
            checkpoint manifest's ``wrapper``).
        model: The model given to `backend_of`.
        engine: The DeepSpeed engine, else None.

    Examples:
        >>> import torch
        >>> from comm_wrappers.backends import backend_of
        >>> backend = backend_of(torch.nn.Linear(2, 1))
        >>> backend.kind, backend.format_for(None), sorted(backend.model_state(full=True))
        ('module', 'full', ['bias', 'weight'])
    """

    kind: ClassVar[str] = "module"
    # Whether the parameters are split across ranks: full states are then gathered (and
    # scattered on load), and a full state on rank 0 only is a collective.
    _shards: ClassVar[bool] = False
    # The sharding `describe` records, for the adapters that do not compute it.
    _sharding: ClassVar[str | None] = None
    #: Whether a sharded state saved at another world size loads into the model's own
    #: sharded state (torch distributed checkpoint reshards it); else through the full one.
    reshards_sharded_state: ClassVar[bool] = True

    def __init__(self, model: nn.Module, engine: Any = None) -> None:
        self.model = model
        self.engine = engine

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r}, model={type(self.model).__name__})"

    def _target(self) -> nn.Module:
        """The module torch's state-dict functions take: the user's, without wrappers."""
        inner: nn.Module = unwrap_model(self.model)
        return inner

    # ------------------------------------------------------------------ the step
    def no_sync(self) -> AbstractContextManager[None]:
        """Skip the gradient sync for one forward/backward.

        A plain module has none to skip, unless it is a wrapper of its own with a
        ``no_sync()`` method: that is entered.

        Raises:
            ValueError: DDP with ``static_graph=True`` (torch cannot skip its sync).
        """
        own = getattr(self.model, "no_sync", None)
        if callable(own):
            context: AbstractContextManager[None] = own()
            return context
        return contextlib.nullcontext()

    def clip_grad_norm(
        self,
        params: list[torch.Tensor],
        *,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip gradients by the norm of the whole model; return that total norm.

        Args:
            params: The parameters whose gradients to clip (an optimizer's, with a grad).
            max_norm: The largest total norm left.
            norm_type: The norm's order.
            error_if_nonfinite: Raise when the total norm is nan or inf.
            foreach: torch's ``foreach`` implementation choice.

        Raises:
            RuntimeError: The total norm is not finite and ``error_if_nonfinite``; the
                parameters are FSDP1 shards but the adapter is not FSDP1's (it has not the
                FSDP model); a DeepSpeed engine (it clips inside its own step).
        """
        options = {
            "max_norm": max_norm,
            "norm_type": norm_type,
            "error_if_nonfinite": error_if_nonfinite,
            "foreach": foreach,
        }
        norm = self._clip(params, options)
        if error_if_nonfinite and not torch.isfinite(norm).all():
            message = (
                f"the total gradient norm is {float(norm)} (not finite) and "
                "clip_grad has error_if_nonfinite=True"
            )
            raise RuntimeError(message)
        return norm

    def _clip(self, params: list[torch.Tensor], options: dict[str, Any]) -> torch.Tensor:
        """Clip by the whole model's norm and return it (DTensors: reduced across ranks).

        ``options``: ``max_norm``, ``norm_type``, ``error_if_nonfinite``, ``foreach``.
        torch checks ``error_if_nonfinite`` before it scales anything: the gradients are
        left as they were when it raises. A rank's FSDP1 shards are refused: only the FSDP
        model's own ``clip_grad_norm_`` knows the whole model's norm.
        """
        if any(getattr(p, "_fsdp_flattened", False) for p in params):
            message = (
                "clipping by norm under FSDP needs the model, to use the whole model's norm "
                "instead of this rank's shard: run the forward inside "
                "optim_wrapper.optim_context(model), with model the FSDP wrapper itself "
                "(train_step does), before update_params"
            )
            raise RuntimeError(message)
        norm = nn.utils.clip_grad_norm_(params, **options)
        full_tensor = getattr(norm, "full_tensor", None)
        return full_tensor() if callable(full_tensor) else norm

    def grad_scaler(self, device_type: str, **kwargs: Any) -> torch.amp.GradScaler:
        """A gradient scaler for float16 on ``device_type`` (``GradScaler`` keywords)."""
        return new_grad_scaler(device_type, sharded=False, **kwargs)

    def compute_device(self) -> torch.device:
        """Where the model computes (and autocast runs): its parameters' device.

        A wrapper whose parameters rest on the CPU (FSDP's CPU offload) computes on this
        rank's device (`rank_device`).
        """
        device = module_device(self.model)
        if device.type == "cpu" and is_model_wrapper(self.model):
            return rank_device()
        return device

    # ------------------------------------------------------------------ checkpoints
    def format_for(self, sharded: bool | None) -> str:
        """The checkpoint format: ``"full"``, ``"dcp"`` or ``"deepspeed"``.

        Args:
            sharded: The caller's choice; None: this backend's natural format (torch
                distributed checkpoint for sharded models, full files otherwise).
        """
        natural = self._shards if sharded is None else sharded
        return "dcp" if natural else "full"

    def describe(self) -> dict[str, Any]:
        """``{"wrapper": kind, "sharding": ..., "zero_stage": ...}`` for a manifest."""
        return {"wrapper": self.kind, "sharding": self._sharding, "zero_stage": None}

    def native_checkpoint(self) -> NativeCheckpoint | None:
        """The backend's own checkpoint files, for backends that have them; None for the
        others.

        A DeepSpeed engine's are its ``save_checkpoint`` / ``load_checkpoint`` files (see
        [`NativeCheckpoint`][comm_wrappers.backends.NativeCheckpoint]); a plain module,
        DDP and FSDP have none: their checkpoints are the full or sharded states above.
        """
        return None

    def param_shapes(self) -> dict[str, list[Any]]:
        """``{name: [shape, dtype]}`` of the full model's state, without gathering it."""
        with quiet_torch():
            state = dsd.get_model_state_dict(self._target())
        return describe_params(state)

    def _full_options(self, rank0_only: bool) -> dsd.StateDictOptions:
        """Options for a full state dict; offloaded to rank 0's CPU where torch allows it."""
        offload = rank0_only and self._shards and self._offload_works()
        return dsd.StateDictOptions(full_state_dict=True, cpu_offload=offload)

    def _offload_works(self) -> bool:
        """Whether torch can gather a full state dict to rank 0's CPU for this model."""
        return True

    def _gather_to_rank0(self) -> dict[str, torch.Tensor] | None:
        """The full model state on rank 0 at the cost of one model there, or None."""
        return None

    def model_state(self, *, full: bool, rank0_only: bool = False) -> dict[str, Any]:
        """The model's state, by the user module's parameter names.

        Args:
            full: Full CPU tensors; else each rank's own shards (DTensor, ShardedTensor),
                as torch distributed checkpoint saves them (full tensors when unsharded).
            rank0_only: With ``full``, only rank 0 gets the state; the others ``{}``.
        """
        target = self._target()
        with quiet_torch():
            if not full:
                return dict(dsd.get_model_state_dict(target))
            if rank0_only and not self._shards and get_rank() != 0:
                return {}  # nothing to gather: rank 0 holds the whole model
            state = self._gather_to_rank0() if rank0_only else None
            if state is None:
                options = self._full_options(rank0_only)
                state = to_cpu(dsd.get_model_state_dict(target, options=options))
        return {} if rank0_only and get_rank() != 0 else dict(state)

    def load_model_state(self, state: Mapping[str, Any], *, full: bool, strict: bool) -> None:
        """Load a full (every rank passes it) or sharded model state into the model.

        Args:
            state: By the user module's names (see `model_state`).
            full: ``state`` holds full tensors, the same on every rank.
            strict: Every name of the model must be in ``state``, and no other.
        """
        # Unsharded models hold full tensors: nothing to distribute.
        options = dsd.StateDictOptions(full_state_dict=full and self._shards, strict=strict)
        with quiet_torch():
            dsd.set_model_state_dict(self._target(), dict(state), options=options)

    def optim_state(
        self, optimizer: Optimizer, *, full: bool, rank0_only: bool = False, to_load: bool = False
    ) -> dict[str, Any]:
        """One optimizer's state keyed by parameter names: full (CPU tensors) or sharded.

        An optimizer that has not stepped yet is left as it is, and its state has no
        entry (torch's getters give it zero states at step 1, by a step at lr 0: a save
        would change the run that took it), unless ``to_load``.

        Args:
            optimizer: A torch optimizer over this model's parameters.
            full: Full CPU tensors; else each rank's own shards.
            rank0_only: With ``full``, only rank 0 gets the state; the others ``{}``.
            to_load: The state a load reads into in place (torch distributed
                checkpoint): an optimizer without state gets torch's zero states.

        Raises:
            ValueError: The state has no per-parameter form (see `optimizer_not_portable`).
        """
        reason = self.optimizer_not_portable()
        if reason is not None:
            raise ValueError(reason)
        target = self._target()
        with quiet_torch(), left_unstepped([optimizer], to_load) as unstepped:
            if not full:
                return unstepped(optimizer, dsd.get_optimizer_state_dict(target, optimizer))
            if rank0_only and not self._shards and get_rank() != 0:
                return {}
            options = self._full_options(rank0_only)
            state = to_cpu(dsd.get_optimizer_state_dict(target, optimizer, options=options))
        return {} if rank0_only and get_rank() != 0 else unstepped(optimizer, state)

    def load_optim_state(
        self, optimizer: Optimizer, state: Mapping[str, Any], *, full: bool, strict: bool = True
    ) -> None:
        """Load one optimizer's state keyed by parameter names (full or sharded).

        ``strict=False``: parameters without an entry in ``state`` are left without one
        (torch's optimizer load replaces the whole state: one they had is dropped).
        A parameter that ``state``'s groups list without an entry (it had no gradient yet
        when it was saved) gets no state, as in the run that saved.

        Raises:
            ValueError: The state has no per-parameter form (see `optimizer_not_portable`),
                or (``strict``) a trainable parameter is in neither its entries nor its
                groups.
        """
        reason = self.optimizer_not_portable()
        if reason is not None:
            raise ValueError(reason)
        # Unsharded models hold full tensors: nothing to distribute. torch's full path also
        # needs one tensor state to find the device: without one there is nothing to shard.
        full = full and self._shards and has_tensor_state(state)
        # A parameter the saved groups list without a state had no gradient yet when it
        # was saved: it gets no state here either (torch's strict load would refuse it).
        # Only torch's check is relaxed: a parameter the saved groups do not list at all
        # is still refused.
        strict, state = self._optim_strict(optimizer, state, strict=strict)
        options = dsd.StateDictOptions(full_state_dict=full, strict=strict)
        with quiet_torch():
            dsd.set_optimizer_state_dict(self._target(), optimizer, dict(state), options=options)

    def sharded_state(
        self, optimizers: Mapping[str, Optimizer], *, to_load: bool = False
    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """The model's and each optimizer's own shards (collective under sharding).

        What `model_state` and `optim_state` with ``full=False`` return, taken with one
        call of torch's ``get_state_dict`` (one check of the model's names, not one per
        state) when there is one optimizer and this backend keeps the base class's state
        dicts; else with those methods.

        Args:
            optimizers: By a key of the caller's (an optimizer wrapper's names).
            to_load: The state a load reads into (see `optim_state`).

        Returns:
            ``(model_state, {key: optimizer_state})``.

        Raises:
            ValueError: The state has no per-parameter form (see `optimizer_not_portable`).
        """
        if len(optimizers) == 1 and self._base_state_dicts():
            reason = self.optimizer_not_portable()
            if reason is not None:
                raise ValueError(reason)
            ((key, optimizer),) = optimizers.items()
            with quiet_torch(), left_unstepped([optimizer], to_load) as unstepped:
                model_state, optim_state = dsd.get_state_dict(self._target(), optimizer)
                return dict(model_state), {key: unstepped(optimizer, optim_state)}
        model_state = self.model_state(full=False)
        states = {
            key: self.optim_state(optimizer, full=False, to_load=to_load)
            for key, optimizer in optimizers.items()
        }
        return model_state, states

    def load_sharded_state(
        self,
        model_state: Mapping[str, Any],
        optim_states: Mapping[str, tuple[Optimizer, Mapping[str, Any]]],
        *,
        strict: bool,
    ) -> None:
        """Load the model's and the optimizers' own shards, as `sharded_state` took them.

        What `load_model_state` then `load_optim_state` for each optimizer do
        (``full=False``, ``strict``), with one call of torch's
        ``set_state_dict`` when there is one optimizer whose load is as strict as the
        model's and this backend keeps the base class's state dicts.

        Args:
            model_state: By the user module's names.
            optim_states: ``{key: (optimizer, its state)}``.
            strict: Every name of the model must be in ``model_state``, and no other; every
                trainable parameter of an optimizer in its state (see `load_optim_state`).

        Raises:
            ValueError: As `load_optim_state`.
        """
        if len(optim_states) == 1 and self._base_state_dicts():
            ((optimizer, state),) = optim_states.values()
            reason = self.optimizer_not_portable()
            if reason is not None:
                raise ValueError(reason)
            torch_strict, state = self._optim_strict(optimizer, state, strict=strict)
            if torch_strict == strict:
                options = dsd.StateDictOptions(strict=strict)
                with quiet_torch():
                    dsd.set_state_dict(
                        self._target(),
                        optimizer,
                        model_state_dict=dict(model_state),
                        optim_state_dict=dict(state),
                        options=options,
                    )
                return
        self.load_model_state(model_state, full=False, strict=strict)
        for optimizer, state in optim_states.values():
            self.load_optim_state(optimizer, state, full=False, strict=strict)

    def _base_state_dicts(self) -> bool:
        """Whether this backend's state dicts are the base class's (torch's functions)."""
        cls = type(self)
        return all(
            getattr(cls, name) is getattr(Backend, name)
            for name in ("model_state", "optim_state", "load_model_state", "load_optim_state")
        )

    def _optim_strict(
        self, optimizer: Optimizer, state: Mapping[str, Any], *, strict: bool
    ) -> tuple[bool, Mapping[str, Any]]:
        """The ``strict`` of torch's optimizer load and the state to give it. torch's check
        is off when the saved groups list parameters without a state (their owner had no
        gradient yet). A strict load first checks that no trainable parameter is missing
        from both the entries and the groups (torch's own check would refuse it only after
        filling the optimizer's state); a ``strict=False`` one lists the missing ones in
        their groups, so that torch loads them without a state as well (a tied one would
        leave its group a parameter short)."""
        if not strict:
            return False, self._listed(optimizer, state)
        missing = self.unlisted_params(optimizer, state)
        if missing:
            message = (
                f"the optimizer state has no entry for {', '.join(missing[:8])} (rank "
                f"{get_rank()}): parameters this optimizer trains that the saved optimizer "
                "did not hold; is it another optimizer's state? Pass strict=False to load "
                "the entries that fit and leave these parameters without optimizer state"
            )
            raise ValueError(message)
        return not stateless_names(state), state

    def _listed(self, optimizer: Optimizer, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state`` with each of its `unlisted_params` in the saved group matching its
        group in ``optimizer`` (as it is when the groups cannot be matched)."""
        missing = self.unlisted_params(optimizer, state)
        groups = self.optimizer_groups(optimizer) if missing else None
        saved = state.get("param_groups")
        if groups is None or not isinstance(saved, list) or len(saved) != len(groups):
            return state
        listed = [{**group, "params": list(group.get("params", []))} for group in saved]
        for name in missing:
            index = next(i for i, names in enumerate(groups) if name in names)
            listed[index]["params"].append(name)
        return {**state, "param_groups": listed}

    def optimizer_groups(self, optimizer: Optimizer) -> list[list[str]] | None:
        """Each of ``optimizer``'s param groups as the names of its parameters.

        By the user module's names, as an optimizer state keyed by names lists them (every
        name of a tied parameter; every original name of an FSDP1 flat parameter). None
        when a parameter of a group is not one of the model's (an optimizer over flat
        partitions): its groups cannot be told by name.
        """
        from torch.distributed.checkpoint.state_dict import _get_fqns

        target = self._target()
        names: dict[int, set[str]] = {}
        for name, param in target.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), set()).update(_get_fqns(target, name))
        groups = []
        for group in optimizer.param_groups:
            if any(id(param) not in names for param in group["params"]):
                return None
            groups.append(sorted({n for param in group["params"] for n in names[id(param)]}))
        return groups

    def unlisted_params(self, optimizer: Optimizer, state: Mapping[str, Any]) -> list[str]:
        """The trainable parameters of ``optimizer`` in neither the optimizer ``state``'s
        entries nor its groups (by torch's names for them: the user module's, whatever the
        wrapper): a strict load refuses them, a ``strict=False`` one leaves them without
        optimizer state."""
        from torch.distributed.checkpoint.state_dict import _get_fqns

        listed = set(state.get("state", {})) | {
            name for group in state.get("param_groups", []) for name in group.get("params", [])
        }
        trained = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        target = self._target()
        return [  # torch's names asked only for a name the state does not hold as it is
            sorted(fqns)[0]
            for name, param in target.named_parameters()
            if id(param) in trained
            and name not in listed
            and not (fqns := _get_fqns(target, name)) & listed
        ]

    def optimizer_not_portable(self) -> str | None:
        """None, or why the optimizer state has no per-parameter full form (DeepSpeed)."""
        return None


def new_grad_scaler(device_type: str, *, sharded: bool, **kwargs: Any) -> torch.amp.GradScaler:
    """``torch.amp.GradScaler``, or FSDP's ``ShardedGradScaler`` with ``sharded``.

    The sharded one agrees across ranks on skipping a step: every rank skips it when any
    rank's gradients overflowed.
    """
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, **kwargs)
    return torch.amp.GradScaler(device_type, **kwargs)
