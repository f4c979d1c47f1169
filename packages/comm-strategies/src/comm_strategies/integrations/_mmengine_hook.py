"""`CommRunnerHook`: what comm's wrappers need from MMEngine's classic ``Runner``, and
`attach_runner_hook`, which the wrappers call to give the runner building them one.

Imported by ``_mmengine_runner`` and ``_mmengine_wrappers``; only with MMEngine installed.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from mmengine.hooks import Hook

from comm_wrappers import MMSeparateDistributedDataParallel

from ._mmengine_full_state import (
    _add_saved_group_keys,
    _GatheredModel,
    _is_full_optimizer_state,
    _sharded_root,
    _strip_module,
    _tensors_to_cpu,
    _without_child_wrappers,
)
from ._mmengine_resume import repair_auto_resume, write_whole_files
from ._mmengine_state import decode_message_hub, encode_message_hub, plain

__all__ = ["CommRunnerHook", "attach_runner_hook"]


def attach_runner_hook(runner: Any) -> None:
    """Give a classic ``Runner`` a `CommRunnerHook` unless one is registered (idempotent).

    Called by comm's wrappers when the runner's ``wrap_model`` builds one: that happens in
    the runner's ``__init__`` before its hooks exist, so the hook is added right after the
    runner registers its own (``default_hooks``, ``custom_hooks``). A runner whose hooks
    exist already gets it at once. A `CommRunnerHook` (or subclass) the user added is
    kept, and no second one is added.
    """
    hooks = getattr(runner, "_hooks", None)
    if hooks is None:
        if "register_hooks" in vars(runner):
            return  # attached already, waiting for the runner's hooks
        original = runner.register_hooks

        def register_hooks(*args: Any, **kwargs: Any) -> Any:
            del runner.register_hooks  # back to the class's method
            result = original(*args, **kwargs)
            attach_runner_hook(runner)
            return result

        # On this runner object only: MMEngine's class is not changed.
        runner.register_hooks = register_hooks
        return
    if not any(isinstance(hook, CommRunnerHook) for hook in hooks):
        runner.register_hook(CommRunnerHook())


class CommRunnerHook(Hook):  # type: ignore[misc]
    """What comm's wrappers need from MMEngine's classic ``Runner``, beside ``CheckpointHook``.

    comm's wrappers built by the ``Runner`` (``model_wrapper_cfg=dict(type="Comm...")``)
    add it themselves (`attach_runner_hook`); a wrapper built by hand and passed as
    ``model=`` needs ``custom_hooks=[dict(type="CommRunnerHook")]``. Added more than once,
    the first one the runner calls does the work and the others do nothing. It does these
    things:

    - A run started again by the launcher (``resume=True``) goes on from the newest whole
      checkpoint: before the runner reads ``work_dir/last_checkpoint``, rank 0 corrects
      what a kill left there (missing, empty, naming a removed, truncated or older file;
      `repair_pointer`), and rank 0 writes each checkpoint under a hidden temporary name
      and renames it, so a checkpoint's name holds a whole file or none.

    - Checkpoints load with ``torch.load(weights_only=True)``: the runner's message hub
      (``HistoryBuffer`` objects, numpy values) is written as plain lists and numbers and
      read back. Without it, MMEngine 0.10.7's own resume fails on torch >= 2.6, whose
      ``torch.load`` refuses those classes.
    - Sharded wrappers (`CommFullyShardedDataParallel`, FSDP1 or FSDP2) save and resume
      full state. The ``Runner`` saves on rank 0 alone (``save_checkpoint`` is
      ``master_only``), where only rank 0's shard exists: with this hook every rank first
      gathers the full model and optimizer state (torch's
      ``torch.distributed.checkpoint.state_dict``), rank 0 writes it under the usual
      ``state_dict`` / ``optimizer`` keys, and a resume loads it back into each rank's
      shards, so training goes on as if it had never stopped. During the rank-0 save
      ``runner.model`` is a stand-in holding the gathered state. The runner's own step that
      broadcasts ``model.module.state_dict()`` after ``init_weights`` (shards of different
      sizes per rank) is skipped: the wrapper ran ``init_weights`` before sharding.
    - `CommSeparateDistributedDataParallel` checkpoints carry the model's own parameter
      names (the runner would write each child's ``.module.``, which its loader does not
      expect).

    Its priority is ``"LOWEST"``: it encodes what the other hooks added to the
    checkpoint. A checkpoint whose optimizer state was saved by an unsharded wrapper
    (indexed by position) cannot resume a sharded one: that is a ``ValueError`` naming
    the fix, instead of full-size state in each rank's shards.
    """

    priority = "LOWEST"

    def __init__(self) -> None:
        self._full: tuple[dict[str, Any], dict[str, Any] | None] | None = None

    def _acts_for(self, runner: Any) -> bool:
        """Whether this hook is the one acting for ``runner`` (the first one called)."""
        acting = runner.__dict__.setdefault("_comm_runner_hook", self)
        return acting is self

    def before_run(self, runner: Any) -> None:
        """Make saves whole or absent, sharded state gathered; point auto resume right."""
        if not self._acts_for(runner):
            return
        write_whole_files(runner)
        self._gather_before_saves(runner)
        repair_auto_resume(runner)

    def _gather_before_saves(self, runner: Any) -> None:
        """Make the runner's ``save_checkpoint`` gather sharded state on every rank first."""
        if _sharded_root(runner.model) is None or getattr(runner, "_comm_saves_full", False):
            return
        # The wrapper ran init_weights before sharding; the runner's own step broadcasts
        # the tensors of model.module.state_dict(), shards of different sizes per rank.
        runner._init_model_weights = lambda: None
        original = runner.save_checkpoint
        signature = inspect.signature(original)

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind_partial(*args, **kwargs)
            save_optimizer = bool(bound.arguments.get("save_optimizer", True))
            self._full = gathered = self._gather(runner, save_optimizer)
            # Rank 0 saves alone and calls model.module.state_dict(): on a sharded model
            # that call may gather (nested FSDP1 units) while the other ranks train on.
            # It gets the state gathered above instead, on every rank at once.
            model = runner.model
            runner.model = _GatheredModel(gathered[0])
            try:
                return original(*args, **kwargs)
            finally:
                runner.model = model
                self._full = None

        # On this runner object only: MMEngine's class is not changed.
        runner.save_checkpoint = save_checkpoint
        runner._comm_saves_full = True

    @staticmethod
    def _gather(runner: Any, save_optimizer: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        root = _sharded_root(runner.model)
        if root is None:
            message = "CommRunnerHook gathers the state of sharded wrappers only"
            raise TypeError(message)
        options = StateDictOptions(full_state_dict=True)
        model_state = get_model_state_dict(root, options=options)
        optim_state = None
        optimizer = getattr(runner.optim_wrapper, "optimizer", None)
        if save_optimizer and isinstance(optimizer, torch.optim.Optimizer):
            optim_state = get_optimizer_state_dict(root, optimizer, options=options)
        return model_state, optim_state

    def before_save_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        """Put the gathered full state in; make the rest loadable with ``weights_only``."""
        if not self._acts_for(runner):
            return
        if self._full is not None:
            model_state, optim_state = self._full
            checkpoint["state_dict"] = {k: v.detach().cpu() for k, v in model_state.items()}
            if "optimizer" in checkpoint and optim_state is not None:
                checkpoint["optimizer"] = _tensors_to_cpu(optim_state)
        elif isinstance(runner.model, MMSeparateDistributedDataParallel):
            # Each child is a DDP: its names carry ``.module.``, which MMEngine's loader
            # (unwrapping the children) does not expect. Save the user's names.
            checkpoint["state_dict"] = _without_child_wrappers(
                runner.model.module, checkpoint.get("state_dict", {})
            )
        if "message_hub" in checkpoint:
            checkpoint["message_hub"] = encode_message_hub(checkpoint["message_hub"])
        for key in list(checkpoint):
            checkpoint[key] = plain(checkpoint[key])

    def after_load_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        """Read the message hub back; load full state into a sharded model's shards."""
        if not self._acts_for(runner):
            return
        if "message_hub" in checkpoint:
            checkpoint["message_hub"] = decode_message_hub(checkpoint["message_hub"])
        root = _sharded_root(runner.model)
        if root is None:
            return
        from mmengine.optim import OptimWrapper
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False)
        state = checkpoint.get("state_dict")
        if isinstance(state, Mapping):
            full = {_strip_module(key): value for key, value in state.items()}
            incompatible = set_model_state_dict(root, full, options=options)
            if incompatible.missing_keys or incompatible.unexpected_keys:
                runner.logger.warning(
                    f"CommRunnerHook: missing keys {list(incompatible.missing_keys)}, "
                    f"unexpected keys {list(incompatible.unexpected_keys)}"
                )
            # The runner loads ``state_dict`` into ``model.module`` next: give it the
            # shards just loaded, so that load changes nothing.
            checkpoint["state_dict"] = dict(runner.model.module.state_dict())
        optim_wrapper = runner.optim_wrapper
        optim_state = checkpoint.get("optimizer")
        resuming = bool(getattr(runner, "_resume", True))  # load_from loads weights only
        if not (resuming and isinstance(optim_state, dict)):
            return
        if isinstance(optim_wrapper, Mapping):
            # load_or_resume() before train(): the optimizer is still its config. The
            # runner would build it after this hook and load the full, name-keyed state
            # into the shards; build it now (over the sharded parameters; the runner's
            # later build returns it unchanged) so the state goes through torch's API.
            optim_wrapper = runner.optim_wrapper = runner.build_optim_wrapper(optim_wrapper)
            if isinstance(optim_wrapper, OptimWrapper):
                _add_saved_group_keys(optim_wrapper.optimizer, optim_state)
        if not isinstance(optim_wrapper, OptimWrapper):
            return
        if not _is_full_optimizer_state(optim_state):
            message = (
                "CommRunnerHook: this checkpoint's optimizer state was saved by an unsharded "
                f"wrapper (parameters by position), and {type(runner.model).__name__} is "
                "sharded: resume it with the wrapper that saved it, or load the weights "
                "only (load_from=..., resume=False)"
            )
            raise ValueError(message)
        set_optimizer_state_dict(root, optim_wrapper.optimizer, optim_state, options=options)
        # The runner's resume loads ``optimizer`` next: this rank's state, as loaded.
        checkpoint["optimizer"] = optim_wrapper.state_dict()
