"""`Strategy`: how a model is placed, wrapped, optimised and checkpointed, for any training loop."""

from __future__ import annotations

import copy
import os
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as torch_dist
from torch import nn

import comm_collectives as dist

from ._activation import apply_activation_checkpointing, coerce_activation_checkpointing
from ._broadcast import broadcast_module_state as broadcast_module_state
from ._build import (
    build_optim_wrapper,
    build_schedulers,
    is_optim_wrapper,
    optimizers_of,
    rebuild_over,
    trainable_names,
)
from ._checkpointing import CheckpointMixin
from .checkpoint import _consensus as checkpoint_calls
from .checkpoint import _publish as checkpoint_publish

__all__ = ["Strategy"]


@dataclass(frozen=True)
class SetupContext:
    """What `Strategy.prepare` knows besides the model and the optimizer, for `_setup`.

    Attributes:
        names: ``id(parameter) -> name`` of the unwrapped model, to rebuild a built
            optimizer whose parameters the wrapping replaced.
        schedulers: Schedulers passed in built (they follow a rebuilt optimizer).
        dispatch: The runner's facts (``max_iters``, the micro-batch size).
        compile: `prepare`'s ``compile``.
    """

    names: Mapping[int, str]
    schedulers: Sequence[Any]
    dispatch: Mapping[str, Any]
    compile: bool | Mapping[str, Any]


class Strategy(CheckpointMixin):
    """The base of every strategy: MMEngine's ``BaseStrategy`` surface, without side effects.

    A strategy turns a model (and an optimizer and schedulers, built or as config dicts)
    into what a training loop drives: ``model, optim_wrapper, schedulers =
    strategy.prepare(model, optim_wrapper=..., param_scheduler=...)``, then
    ``optim_wrapper.update_params(loss)`` (or ``model.train_step(batch, optim_wrapper)``)
    in the loop. Subclasses say how the model is wrapped (`_wrap_model`).

    Constructing a strategy does nothing else: the process group, the seed and the work
    folder come with `setup_env` (called by `prepare`) and with the first save.

    Args:
        work_dir: Folder of checkpoints (created at the first save); None: none.
        launcher: ``"pytorch"``, ``"slurm"``, ``"mpi"`` or ``"none"``; None infers it from
            the environment (comm_core's ``infer_launcher``).
        backend: Process group backend; None picks nccl with CUDA, else gloo.
        timeout: Timeout of collectives, in seconds; None: torch's default for the backend
            (10 minutes for nccl, else 30).
        seed: The seed of every random generator; None draws one (the same on every rank).
        diff_rank_seed: Seed each rank with ``seed + rank`` (e.g. for data augmentation).
        deterministic: Use deterministic algorithms (``torch.use_deterministic_algorithms``).
        keep_last: The default of `save_checkpoint`'s ``keep_last``: after each save, keep
            only the newest N complete checkpoints beside it; None keeps them all.
        activation_checkpointing: Module classes (a set) whose submodules recompute their
            activations in the backward, applied by `prepare` before wrapping.

    Attributes:
        model: The prepared model (None before `prepare`).
        optim_wrapper: The prepared optimizer wrapper (or None).
        param_schedulers: The prepared schedulers (a list, maybe empty).
    """

    #: Short name recorded in checkpoints and accepted by `build_strategy`.
    name: str = "base"
    #: Whether the strategy needs a process group (one of one is created in a plain process).
    needs_process_group: ClassVar[bool] = True

    def __init__(
        self,
        *,
        work_dir: str | os.PathLike[str] | None = None,
        launcher: str | None = None,
        backend: str | None = None,
        timeout: float | None = None,
        seed: int | None = None,
        diff_rank_seed: bool = False,
        deterministic: bool = False,
        keep_last: int | None = None,
        activation_checkpointing: Any = None,
    ) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            message = f"seed must be an int or None, got {seed!r}"
            raise TypeError(message)
        checkpoint_publish.check_keep_last(keep_last, type(self).__name__)
        self.keep_last = keep_last
        self.activation_checkpointing = coerce_activation_checkpointing(activation_checkpointing)
        self._work_dir = None if work_dir is None else Path(work_dir)
        self.launcher = launcher
        self.backend = backend
        self.timeout = timeout
        self._seed_option = seed
        self._seed: int | None = None
        self.diff_rank_seed = diff_rank_seed
        self.deterministic = deterministic
        self._env_ready = False
        self._owns_group = False
        self._prepared = False
        self.model: Any = None
        self.optim_wrapper: Any = None
        self.param_schedulers: list[Any] = []

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """This process's rank (0 in a plain process)."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """The number of processes (1 in a plain process)."""
        return dist.get_world_size()

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1

    @property
    def seed(self) -> int | None:
        """The seed in use: None before `setup_env`."""
        return self._seed

    @property
    def work_dir(self) -> Path | None:
        """The checkpoint folder (not created until a checkpoint is saved)."""
        return self._work_dir

    # ------------------------------------------------------------------ environment
    def setup_env(self) -> None:
        """Start the process group (if needed and none exists), then seed every generator.

        Idempotent. The launcher is inferred from the environment when not given; a plain
        process gets a private world of one when the strategy needs a process group.
        """
        if self._env_ready:
            return
        if self.needs_process_group and not dist.is_distributed():
            launcher = self.launcher or dist.infer_launcher()
            if launcher == "none":
                self._init_world_of_one()
            else:
                dist.init_dist(launcher, self.backend, timeout=self.timeout)
            self._owns_group = True
        seed = self._seed_option if self._seed_option is not None else dist.sync_random_seed()
        self._seed = seed
        self._seed_everything(seed + (self.rank if self.diff_rank_seed else 0))
        if self.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        self._env_ready = True

    def _init_world_of_one(self) -> None:
        backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        torch_dist.init_process_group(
            backend,
            store=torch_dist.HashStore(),  # type: ignore[attr-defined]
            rank=0,
            world_size=1,
            timeout=None if self.timeout is None else timedelta(seconds=self.timeout),
        )
        dist.init_local_group()

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)
        numpy = sys.modules.get("numpy")  # seeded when in use; not a dependency
        if numpy is not None:
            numpy.random.seed(seed % 2**32)

    def teardown(self) -> None:
        """Destroy the process group if `setup_env` created it (collective: every rank).

        A barrier first, so that no rank is still in a collective, then a short pause
        outside the interpreter lock: gloo's worker threads release finished work there,
        and a process group destroyed while one of them waits for the lock deadlocks torch
        (its destructor joins the thread while holding the lock). An async save still
        running is waited for before (its ranks agree through the group's store).
        """
        checkpoint_calls.wait_previous()
        if self._owns_group:
            dist.barrier()
            time.sleep(0.05)
            dist.destroy_dist()
            self._owns_group = False
        self._env_ready = False

    # ------------------------------------------------------------------ prepare
    def prepare(
        self,
        model: nn.Module | Mapping[str, Any],
        *,
        optim_wrapper: Any = None,
        param_scheduler: Any = None,
        compile: bool | Mapping[str, Any] = False,
        dispatch_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[Any, Any, list[Any]]:
        """Place and wrap the model, then build the optimizer over the wrapped parameters.

        Args:
            model: An ``nn.Module`` or ``dict(type=ModelClass, **kwargs)``.
            optim_wrapper: An optimizer wrapper, a torch optimizer, or a config such as
                ``dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1),
                accumulative_counts=2, clip_grad=dict(max_norm=1.0))``. A built optimizer
                whose parameters the wrapping replaced (FSDP2) is rebuilt, by name.
            param_scheduler: A scheduler, a config ``dict(type="StepLR", step_size=...)``,
                or a list of them. Built schedulers are kept (moved to a rebuilt optimizer).
            compile: ``True`` or ``dict(target="forward", **torch_compile_options)``.
            dispatch_kwargs: Runner facts: ``max_iters`` (sets the accumulation tail),
                ``train_micro_batch_size_per_gpu`` (DeepSpeed).

        Returns:
            ``(model, optim_wrapper, schedulers)``; also kept as attributes.

        Raises:
            RuntimeError: `prepare` was called already on this strategy.
        """
        if self._prepared:
            message = (
                f"{type(self).__name__}.prepare was called already; a strategy prepares one "
                "model once. Use the objects it returned (strategy.model, "
                "strategy.optim_wrapper, strategy.param_schedulers), or a new strategy."
            )
            raise RuntimeError(message)
        dispatch = dict(dispatch_kwargs or {})
        self.setup_env()
        module = self._build_model(model)
        apply_activation_checkpointing(module, self.activation_checkpointing)
        names = trainable_names(module)
        schedulers_in = _built_schedulers(param_scheduler)
        context = SetupContext(names, schedulers_in, dispatch, compile)
        wrapped, optim, target = self._setup(module, optim_wrapper, context)
        schedulers = self._build_schedulers(param_scheduler, target)
        max_iters = dispatch.get("max_iters")
        if optim is not None and max_iters is not None:
            for each in optimizers_of(optim).values():
                init = getattr(each, "initialize_count_status", None)
                if callable(init):
                    init(wrapped, 0, int(max_iters))
        self.model, self.optim_wrapper, self.param_schedulers = wrapped, optim, schedulers
        self._prepared = True
        return wrapped, optim, schedulers

    def _build_model(self, model: nn.Module | Mapping[str, Any]) -> nn.Module:
        if isinstance(model, Mapping):
            options = copy.deepcopy(dict(model))
            kind = options.pop("type", None)
            if not callable(kind):
                message = (
                    "a model config needs 'type' set to a class or a callable, got "
                    f"{kind!r}; build the model yourself and pass the module"
                )
                raise TypeError(message)
            model = kind(**options)
        if not isinstance(model, nn.Module):
            message = f"model must be an nn.Module or a config dict, got {type(model).__name__}"
            raise TypeError(message)
        return model

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        """Place and wrap the model; subclasses override."""
        raise NotImplementedError

    def _same_initial_values(self, model: nn.Module) -> None:
        """Under ``diff_rank_seed``, give every rank rank 0's parameters and buffers.

        The ranks built the model under different seeds (``seed + rank``); the shards of one
        model must come from one set of values, as DDP's broadcast at construction makes
        them: the model is then what one process seeded with the strategy's seed builds.
        Sharding strategies (``fsdp``, ``fsdp2``, ``model_parallel``) call it before they
        shard; each rank's random generators are left as they were. Tensors on the meta
        device (initialised later, on each rank) are skipped; a tensor on another device
        than the group communicates on goes through a copy there.
        """
        if not (self.diff_rank_seed and self.world_size > 1):
            return
        broadcast_module_state(model)

    def _compile(self, model: nn.Module, compile: bool | Mapping[str, Any]) -> nn.Module:
        if not compile:
            return model
        options: dict[str, Any] = {} if compile is True else copy.deepcopy(dict(compile))
        target = options.pop("target", "forward")
        method = getattr(model, target, None)
        if not callable(method):
            message = f"compile target {target!r} is not a method of {type(model).__name__}"
            raise ValueError(message)
        setattr(model, target, torch.compile(method, **options))
        return model

    def _setup(
        self, model: nn.Module, optim_wrapper: Any, context: SetupContext
    ) -> tuple[nn.Module, Any, Any]:
        """Wrap (and compile) the model, then build the optimizer over its parameters.

        The one hook for a backend that wraps the model and the optimizer together
        (DeepSpeed's engine overrides it); the others only say how to wrap (`_wrap_model`).

        Args:
            model: The built, unwrapped model.
            optim_wrapper: What `prepare` got (None, a built wrapper or optimizer, a config).
            context: What else `prepare` knows.

        Returns:
            ``(model, optim_wrapper, optimizer)``: the optimizer is the torch optimizer that
            scheduler configs are built over (None without one).
        """
        wrapped = self._compile(self._wrap_model(model), context.compile)
        if optim_wrapper is None:
            return wrapped, None, None
        optim = build_optim_wrapper(optim_wrapper, wrapped)
        for each in optimizers_of(optim).values():
            if is_optim_wrapper(each) and isinstance(each.optimizer, torch.optim.Optimizer):
                each.optimizer = rebuild_over(
                    each.optimizer, context.names, wrapped, context.schedulers
                )
        target = optim.optimizer if is_optim_wrapper(optim) else None
        return wrapped, optim, target

    def _build_schedulers(self, config: Any, optimizer: Any) -> list[Any]:
        """Build the scheduler configs over ``optimizer``; built schedulers pass through."""
        return build_schedulers(config, optimizer)

    def __repr__(self) -> str:
        state = "prepared" if self._prepared else "not prepared"
        return f"{type(self).__name__}(name={self.name!r}, {state})"


def _built_schedulers(config: Any) -> list[Any]:
    if config is None:
        return []
    items = list(config) if isinstance(config, (list, tuple)) else [config]
    return [item for item in items if not isinstance(item, Mapping)]
