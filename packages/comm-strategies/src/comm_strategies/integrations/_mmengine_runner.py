"""comm's model wrappers in MMEngine's classic ``Runner`` (``MODEL_WRAPPERS``).

Imported by ``comm_strategies.integrations.mmengine``; only with MMEngine installed.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
from mmengine.registry import HOOKS, MODEL_WRAPPERS, Registry
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from comm_wrappers import (
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    MMSeparateDistributedDataParallel,
    register_model_wrapper,
)

from ._mmengine_full_state import (
    _sharded_root,
)
from ._mmengine_hook import CommRunnerHook
from ._mmengine_wrappers import (
    CommDistributedDataParallel,
    CommFullyShardedDataParallel,
    CommFullyShardedDataParallel2,
    CommSeparateDistributedDataParallel,
)

__all__ = [
    "CommDistributedDataParallel",
    "CommFullyShardedDataParallel",
    "CommFullyShardedDataParallel2",
    "CommSeparateDistributedDataParallel",
    "comm_wrappers_in_use",
    "use_comm_wrappers",
]


_CLASSES: dict[str, type] = {
    "CommDistributedDataParallel": CommDistributedDataParallel,
    "CommSeparateDistributedDataParallel": CommSeparateDistributedDataParallel,
    "CommFullyShardedDataParallel": CommFullyShardedDataParallel,
    "CommFullyShardedDataParallel2": CommFullyShardedDataParallel2,
}

# MMEngine's own names, and comm's class each resolves to under `use_comm_wrappers`.
_MMENGINE_NAMES: dict[str, type] = {
    "MMDistributedDataParallel": CommDistributedDataParallel,
    "MMSeparateDistributedDataParallel": CommSeparateDistributedDataParallel,
    "MMFullyShardedDataParallel": CommFullyShardedDataParallel,
}

# comm's base wrappers (which a user may build by hand and pass to the Runner), for
# MMEngine's ``is_model_wrapper``: kept in a child registry of scope ``comm`` so that the
# names MMEngine's own registry holds stay as they are. Configs name the Comm* classes.
_COMM_SCOPE = "comm"


def _comm_registry() -> Registry:
    child = MODEL_WRAPPERS.children.get(_COMM_SCOPE)
    if child is None:
        child = Registry("model_wrapper", parent=MODEL_WRAPPERS, scope=_COMM_SCOPE)
    return child


def _register() -> None:
    for name, wrapper in _CLASSES.items():
        MODEL_WRAPPERS.register_module(name=name, module=wrapper, force=True)
    bases: list[type] = [
        MMDistributedDataParallel,
        MMSeparateDistributedDataParallel,
        MMFullyShardedDataParallel,
        MMFullyShardedDataParallel2,
    ]
    # The DeepSpeed wrapper when its module is imported already (importing DeepSpeed is
    # slow, and none of its wrappers can exist before).
    deepspeed_wrapper = getattr(
        sys.modules.get("comm_wrappers.deepspeed"), "MMDeepSpeedEngineWrapper", None
    )
    if isinstance(deepspeed_wrapper, type):
        bases.append(deepspeed_wrapper)
    HOOKS.register_module(module=CommRunnerHook, force=True)
    child = _comm_registry()
    for wrapper in bases:
        child.register_module(name=wrapper.__name__, module=wrapper, force=True)
    _bridge_mmengine_wrappers()
    check_runner_sharded_models()
    if restarts_allowed():
        route_runner_init_dist()


def restarts_allowed() -> bool:
    """Whether torchrun started this process with restarts allowed (``--max-restarts`` > 0)."""
    try:
        return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    except ValueError:
        return False


def route_runner_init_dist() -> bool:
    """Make the classic ``Runner`` start its process group with `comm_collectives.init_dist`.

    MMEngine's own ``init_dist`` calls ``torch.distributed.init_process_group`` on the
    launcher's store, which outlives a failed attempt under ``torchrun --max-restarts``: the
    restarted workers read the dead attempt's keys (gloo connects to dead addresses, nccl
    takes a dead attempt's id) and fail or hang. comm's keeps each attempt's keys apart.
    Done when this module is imported in a process that torchrun may restart
    (`restarts_allowed`); nothing changes elsewhere. Returns whether the ``Runner``'s
    ``init_dist`` is comm's now (False when ``mmengine.runner`` cannot be imported).
    """
    try:
        import mmengine.runner.runner as runner_module
    except ImportError:  # mmengine.runner needs OpenCV; without it there is no Runner
        return False
    runner_module.init_dist = _comm_init_dist
    return True


def check_runner_sharded_models() -> bool:
    """Make the classic ``Runner`` refuse a sharded model it has no `CommRunnerHook` for.

    Without the hook, the runner's ``train()`` broadcasts each tensor of
    ``model.module.state_dict()`` (shards of different sizes per rank: gloo aborts the
    process, FSDP2's DTensors raise) and saves rank 0's shard alone. comm's wrappers built
    by the runner bring the hook (`attach_runner_hook`); a sharded model built elsewhere
    and passed as ``model=`` does not. The runner asks ``is_model_wrapper(self.model)``
    before either step (first in ``train()``; in ``load_checkpoint()`` and
    ``save_checkpoint()``): this routes that name in MMEngine's runner module (as
    `route_runner_init_dist` does ``init_dist``) to a check that raises a ``ValueError``
    naming what to add there, on every rank in ``train()`` and ``load_checkpoint()``.
    Its answers are unchanged. Done when the integration is imported; returns whether the
    check is in place (False when ``mmengine.runner`` cannot be imported).
    """
    try:
        import mmengine.runner.runner as runner_module
    except ImportError:  # mmengine.runner needs OpenCV; without it there is no Runner
        return False
    current = runner_module.is_model_wrapper
    if getattr(current, "_comm_checks_sharded", False):
        return True
    answer = current

    def is_model_wrapper(model: Any, *args: Any, **kwargs: Any) -> bool:
        wrapped = bool(answer(model, *args, **kwargs))
        if wrapped and _sharded_root(model) is not None:
            caller = sys._getframe(1)
            runner = caller.f_locals.get("self")
            if isinstance(runner, runner_module.Runner):
                _require_runner_hook(runner, model, caller.f_code.co_name)
        return wrapped

    is_model_wrapper._comm_checks_sharded = True  # type: ignore[attr-defined]
    is_model_wrapper.__wrapped__ = answer  # type: ignore[attr-defined]
    runner_module.is_model_wrapper = is_model_wrapper
    return True


def _require_runner_hook(runner: Any, model: Any, step: str) -> None:
    hooks = getattr(runner, "_hooks", None)
    if hooks is None or any(isinstance(hook, CommRunnerHook) for hook in hooks):
        return  # the runner is still being built (wrap_model), or it has the hook
    message = (
        f"Runner.{step}() on rank {runner.rank} (world_size={runner.world_size}): the "
        f"model is a sharded wrapper ({type(model).__name__}) and the runner has no "
        "CommRunnerHook, without which it would broadcast shards of different sizes and "
        "save rank 0's shard alone. Add custom_hooks=[dict(type='CommRunnerHook')] to the "
        "Runner (after `import comm_strategies.integrations.mmengine`), or let the Runner "
        "build the wrapper: model_wrapper_cfg=dict(type='CommFullyShardedDataParallel') "
        "adds the hook itself"
    )
    raise ValueError(message)


def _unwrap_mmengine(wrapper: Any) -> Any:
    # MMEngine's wrappers hold the model as ``module``; its DeepSpeed one as ``model``.
    inner = getattr(wrapper, "module", None)
    return wrapper.model if inner is None and hasattr(wrapper, "model") else inner


def _bridge_mmengine_wrappers() -> None:
    """Make comm's ``is_model_wrapper`` know every class in MMEngine's ``MODEL_WRAPPERS``."""
    registries = [MODEL_WRAPPERS, *MODEL_WRAPPERS.children.values()]
    for registry in registries:
        for wrapper in registry.module_dict.values():
            if not isinstance(wrapper, type) or issubclass(wrapper, _TORCH_WRAPPERS):
                continue  # torch's wrappers (and subclasses) are comm built-ins already
            try:
                register_model_wrapper(wrapper, _unwrap_mmengine)
            except ValueError:  # registered already
                pass


_TORCH_WRAPPERS = (DistributedDataParallel, nn.DataParallel, FullyShardedDataParallel)


_saved: dict[str, Any] | None = None


def comm_wrappers_in_use() -> bool:
    """Return whether `use_comm_wrappers` is on."""
    return _saved is not None


def use_comm_wrappers(enable: bool = True) -> None:
    """Make MMEngine's own wrapper names build comm's wrappers (opt-in; reversible).

    With it on, ``MMDistributedDataParallel``, ``MMSeparateDistributedDataParallel`` and
    ``MMFullyShardedDataParallel`` in MMEngine's ``MODEL_WRAPPERS`` resolve to
    `CommDistributedDataParallel`, `CommSeparateDistributedDataParallel` and
    `CommFullyShardedDataParallel`, and the ``Runner``'s default wrapper (used when a
    config has no ``model_wrapper_cfg``) is `CommDistributedDataParallel`: an existing
    config runs on the CPU (gloo) and gets comm's behaviour. The ``Runner`` also starts
    its process group with `comm_collectives.init_dist` (MMEngine's own calls
    ``torch.cuda.set_device`` and fails without CUDA; its default backend nccl becomes
    gloo there). MMEngine's own classes stay
    registered (under ``comm`` scope names ``mmengine_<name>``) so its
    ``is_model_wrapper`` still knows models wrapped before. ``use_comm_wrappers(False)``
    puts back exactly what was there. Nothing else changes in MMEngine unless this is
    called, except in a process that torchrun may restart: there importing the integration
    already routes the ``Runner``'s ``init_dist`` to comm's (`route_runner_init_dist`).

    Args:
        enable: Turn the opt-in on (True) or off (False). Repeating a state is a no-op.

    Examples:
        >>> import contextlib, io
        >>> with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's import notice
        ...     import mmengine.runner
        >>> from comm_strategies.integrations.mmengine import use_comm_wrappers
        >>> use_comm_wrappers()
        >>> from mmengine.registry import MODEL_WRAPPERS
        >>> MODEL_WRAPPERS.get("MMDistributedDataParallel").__name__
        'CommDistributedDataParallel'
        >>> use_comm_wrappers(False)
        >>> MODEL_WRAPPERS.get("MMDistributedDataParallel").__module__
        'mmengine.model.wrappers.distributed'
    """
    global _saved
    import mmengine.runner.runner as runner_module

    if enable and _saved is None:
        saved: dict[str, Any] = {
            "registry": {name: MODEL_WRAPPERS.module_dict.get(name) for name in _MMENGINE_NAMES},
            "default": runner_module.MMDistributedDataParallel,
            "init_dist": runner_module.init_dist,
        }
        runner_module.init_dist = _comm_init_dist
        child = _comm_registry()
        for name, original in saved["registry"].items():
            if original is not None:
                child.register_module(name=f"mmengine_{name}", module=original, force=True)
        for name, wrapper in _MMENGINE_NAMES.items():
            MODEL_WRAPPERS.register_module(name=name, module=wrapper, force=True)
        runner_module.MMDistributedDataParallel = CommDistributedDataParallel
        _saved = saved
    elif not enable and _saved is not None:
        for name, original in _saved["registry"].items():
            if original is None:
                MODEL_WRAPPERS.module_dict.pop(name, None)
            else:
                MODEL_WRAPPERS.register_module(name=name, module=original, force=True)
            _comm_registry().module_dict.pop(f"mmengine_{name}", None)
        runner_module.MMDistributedDataParallel = _saved["default"]
        runner_module.init_dist = _saved["init_dist"]
        _saved = None


def _comm_init_dist(
    launcher: str, backend: str = "nccl", init_backend: str = "torch", **kwargs: Any
) -> None:
    """MMEngine's ``init_dist`` as the ``Runner`` calls it, done by `comm_collectives.init_dist`.

    MMEngine's own selects a CUDA device unconditionally (``torch.cuda.set_device``), which
    fails on a machine without CUDA; comm's selects one only for a CUDA backend, runs the
    same launchers, and keeps each launch attempt's store keys apart (restart-safe). Without
    CUDA, ``backend="nccl"`` (MMEngine's default) becomes gloo. Other ``init_backend``s
    (DeepSpeed's, ColossalAI's) and launchers go to MMEngine's own.
    """
    if init_backend != "torch" or launcher not in ("pytorch", "slurm", "mpi"):
        from mmengine.dist import init_dist as mmengine_init_dist

        mmengine_init_dist(launcher, backend, init_backend=init_backend, **kwargs)
        return
    from comm_collectives import init_dist

    if backend == "nccl" and not torch.cuda.is_available():
        backend = "gloo"
    timeout = kwargs.pop("timeout", None)
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    init_dist(launcher, backend, timeout=timeout, **kwargs)
