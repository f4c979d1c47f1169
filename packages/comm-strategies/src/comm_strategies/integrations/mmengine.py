"""comm's strategies in MMEngine's ``FlexibleRunner`` (import this module to register them).

Importing ``comm_strategies.integrations.mmengine`` registers, in MMEngine's ``STRATEGIES``
registry, one adapter per comm strategy: ``CommSingleDeviceStrategy``,
``CommDDPStrategy``, ``CommFSDPStrategy`` (``fsdp_version=1|2``) and
``CommDeepSpeedStrategy``. Then::

    runner = FlexibleRunner(model, ..., strategy=dict(type="CommDeepSpeedStrategy", zero_stage=2))

Only this module imports MMEngine; ``comm_strategies`` itself never does.

The adapters take the keywords the runner passes (``work_dir``, ``experiment_name``,
``env_kwargs`` with ``launcher``, ``randomness`` and ``dist_cfg``, ``log_kwargs``,
``auto_scale_lr``) and give it what it reads (``logger``, ``log_dir``, ``timestamp``,
``collect_env``, MMEngine's ``save_checkpoint`` / ``load_checkpoint`` / ``resume``
signatures). Unlike MMEngine's own strategies, nothing happens at construction: the
process group, the seed, the log folder and the logger come at their first use (the
runner asks for the logger while it is built). The runner's ``before_save_checkpoint``
and ``after_load_checkpoint`` hooks run under every strategy, DeepSpeed included; they see
the runner's checkpoint dict (``meta``, ``message_hub`` and what hooks add), not the
model's state. Param scheduler configs are built with MMEngine's ``PARAM_SCHEDULERS``.

A run started again by the launcher (``resume=True``) goes on from the newest complete
checkpoint: `prepare` corrects ``work_dir/last_checkpoint``, which the runner reads next,
when a kill left it missing, stale, or older than the newest checkpoint.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from mmengine.logging import MMLogger
from mmengine.registry import MODELS, PARAM_SCHEDULERS, STRATEGIES

import comm_collectives as dist

from ..base import Strategy
from ..ddp import DDPStrategy
from ..deepspeed import DeepSpeedStrategy
from ..fsdp import FSDPStrategy
from ..single import SingleDeviceStrategy
from ._mmengine_hook import CommRunnerHook
from ._mmengine_resume import repair_pointer as _repair_pointer
from ._mmengine_runner import (
    CommDistributedDataParallel,
    CommFullyShardedDataParallel,
    CommFullyShardedDataParallel2,
    CommSeparateDistributedDataParallel,
    _register,
    comm_wrappers_in_use,
    use_comm_wrappers,
)
from ._mmengine_state import decode_message_hub as _decode_message_hub
from ._mmengine_state import encode_message_hub as _encode_message_hub
from ._mmengine_state import plain as _plain

__all__ = [
    "CommDDPStrategy",
    "CommDeepSpeedStrategy",
    "CommDistributedDataParallel",
    "CommFSDPStrategy",
    "CommFullyShardedDataParallel",
    "CommFullyShardedDataParallel2",
    "CommRunnerHook",
    "CommSeparateDistributedDataParallel",
    "CommSingleDeviceStrategy",
    "MMEngineStrategyMixin",
    "comm_wrappers_in_use",
    "use_comm_wrappers",
]


class MMEngineStrategyMixin(Strategy):
    """What MMEngine's ``FlexibleRunner`` needs from a strategy, on top of a comm `Strategy`.

    Args:
        work_dir: The runner's work folder (checkpoints, logs).
        experiment_name: Name of the run; default the timestamp.
        env_kwargs: ``dict(launcher=..., randomness=dict(seed=, diff_rank_seed=,
            deterministic=), dist_cfg=dict(backend=...))`` as the runner builds it.
        log_kwargs: ``dict(log_level=...)`` for the logger.
        auto_scale_lr: Accepted for the runner's sake; not applied.
        allow_unsafe_pickle: Let the runner's ``resume`` / ``load_from`` read checkpoints
            that need full unpickling (DeepSpeed's own files, old pickles): only for files
            you trust. The runner cannot pass it per call, so it is set here.
        **kwargs: The comm strategy's own keywords.
    """

    def __init__(
        self,
        *,
        work_dir: str | os.PathLike[str] = "work_dirs",
        experiment_name: str | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        log_kwargs: Mapping[str, Any] | None = None,
        auto_scale_lr: Mapping[str, Any] | None = None,
        allow_unsafe_pickle: bool = False,
        **kwargs: Any,
    ) -> None:
        env = copy.deepcopy(dict(env_kwargs or {}))
        randomness = dict(env.get("randomness") or {})
        dist_cfg = dict(env.get("dist_cfg") or {})
        backend = dist_cfg.get("backend")
        if backend == "nccl" and not torch.cuda.is_available():
            backend = None  # the runner's default; gloo on a machine without CUDA
        launcher = env.get("launcher")
        kwargs.setdefault("launcher", None if launcher in (None, "none") else launcher)
        kwargs.setdefault("backend", backend)
        kwargs.setdefault("seed", randomness.get("seed"))
        kwargs.setdefault("diff_rank_seed", bool(randomness.get("diff_rank_seed", False)))
        kwargs.setdefault("deterministic", bool(randomness.get("deterministic", False)))
        super().__init__(work_dir=work_dir, **kwargs)
        self._env_kwargs = env
        self._randomness = randomness
        self._experiment_name_option = experiment_name
        self._log_kwargs = dict(log_kwargs or {})
        self.auto_scale_lr = auto_scale_lr
        self.allow_unsafe_pickle = allow_unsafe_pickle
        self._timestamp: str | None = None
        self._logger: Any = None
        self._source_model: Any = None
        self._dispatch: dict[str, Any] = {}

    # ------------------------------------------------------------------ runner facts
    @property
    def timestamp(self) -> str:
        """Rank 0's start time (``%Y%m%d_%H%M%S``), the same on every rank."""
        if self._timestamp is None:
            self.setup_env()
            stamp = [time.strftime("%Y%m%d_%H%M%S", time.localtime())]
            dist.broadcast_object_list(stamp, src=0)
            self._timestamp = str(stamp[0])
        return self._timestamp

    @property
    def experiment_name(self) -> str:
        """The experiment's name (default: the timestamp)."""
        return self._experiment_name_option or self.timestamp

    @property
    def log_dir(self) -> str:
        """``work_dir/timestamp`` (created at first use)."""
        path = Path(self.work_dir or ".") / self.timestamp
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    @property
    def logger(self) -> Any:
        """The runner's ``MMLogger`` (built at first use)."""
        if self._logger is None:
            options = {"log_level": "INFO", **self._log_kwargs}
            options.setdefault("log_file", os.path.join(self.log_dir, f"{self.timestamp}.log"))
            options.setdefault("name", self.experiment_name)
            options.setdefault("file_mode", "a")
            self._logger = MMLogger.get_instance(**options)
        return self._logger

    @property
    def randomness(self) -> dict[str, Any]:
        """The runner's randomness settings, with the seed in use."""
        return {**self._randomness, "seed": self.seed}

    def collect_env(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """System and runtime facts for the runner's log."""
        from mmengine.utils.dl_utils import collect_env

        runtime = dict(self._env_kwargs)
        runtime.update(self.randomness)
        runtime["Distributed launcher"] = self.launcher or dist.infer_launcher()
        runtime["Distributed training"] = self.distributed
        runtime["World size"] = self.world_size
        runtime["Strategy"] = type(self).__name__
        return dict(collect_env()), runtime

    # ------------------------------------------------------------------ prepare
    def prepare(
        self,
        model: Any,
        *,
        optim_wrapper: Any = None,
        param_scheduler: Any = None,
        compile: Any = False,
        dispatch_kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """`Strategy.prepare`, plus the runner's ways.

        The runner's ``val()`` / ``test()`` after ``train()`` prepare the same model again
        without an optimizer: that returns the prepared objects. Any other second call is
        an error, as in `Strategy`.
        """
        if self._prepared and optim_wrapper is None and model in (self.model, self._source_model):
            return self.model, self.optim_wrapper, self.param_schedulers
        self._source_model = model
        dispatch = dict(dispatch_kwargs or {})
        self._dispatch = dispatch
        if isinstance(compile, Mapping) and compile.get("target") == "train_step":
            compile = {**compile, "target": "forward"}  # compile the model, not the step
        prepared = super().prepare(
            model,
            optim_wrapper=optim_wrapper,
            param_scheduler=param_scheduler,
            compile=compile,
            dispatch_kwargs=dispatch,
        )
        self._repair_last_checkpoint()
        return prepared

    def _repair_last_checkpoint(self) -> None:
        """Make ``work_dir/last_checkpoint`` name the newest complete checkpoint (collective).

        The runner reads that file right after `prepare` to auto resume (``resume=True``);
        a kill can leave it missing, stale or older than the latest checkpoint
        (`repair_pointer`). Rank 0 corrects it; the others wait.
        """
        if self.work_dir is None:
            return
        if self.rank == 0:
            _repair_pointer(self.work_dir)
        if self.distributed:
            dist.barrier()

    def _build_model(self, model: Any) -> torch.nn.Module:
        if isinstance(model, Mapping) and isinstance(model.get("type"), str):
            model = MODELS.build(copy.deepcopy(dict(model)))
        built: torch.nn.Module = super()._build_model(model)
        init = getattr(built, "init_weights", None)
        if callable(init) and self._dispatch.get("init_weights_for_test_or_val", True):
            init()
        return built

    def _build_schedulers(self, config: Any, optimizer: Any) -> list[Any]:
        if config is None:
            return []
        items = list(config) if isinstance(config, (list, tuple)) else [config]
        built = []
        for item in items:
            if not isinstance(item, Mapping):
                built.append(item)
                continue
            options = copy.deepcopy(dict(item))
            by_epoch = options.get("by_epoch", True)
            end = self._dispatch.get("max_epochs" if by_epoch else "max_iters")
            if end is not None:
                options.setdefault("end", end)
            defaults = {"optimizer": optimizer}
            if self._dispatch.get("epoch_length") is not None:
                defaults["epoch_length"] = self._dispatch["epoch_length"]
            built.append(PARAM_SCHEDULERS.build(options, default_args=defaults))
        return built

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(  # type: ignore[override]
        self,
        filename: str | os.PathLike[str],
        *,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        extra_ckpt: Mapping[str, Any] | None = None,
        callback: Callable[[dict[str, Any]], None] | None = None,
        **kwargs: Any,
    ) -> Path:
        """MMEngine's signature: the runner's ``meta`` / ``message_hub`` become user state.

        ``callback`` (the runner's ``before_save_checkpoint`` hooks) gets the checkpoint
        dict first, and what it adds is saved too.
        """
        checkpoint = copy.copy(dict(extra_ckpt or {}))
        if callback is not None:
            callback(checkpoint)
        if "message_hub" in checkpoint:
            checkpoint["message_hub"] = _encode_message_hub(checkpoint["message_hub"])
        checkpoint = _plain(checkpoint)
        return super().save_checkpoint(
            filename,
            save_optimizer=save_optimizer,
            save_param_scheduler=save_param_scheduler,
            extra=checkpoint,
            **kwargs,
        )

    def load_checkpoint(  # type: ignore[override]
        self,
        filename: str | os.PathLike[str],
        *,
        map_location: Any = "cpu",
        strict: bool = False,
        revise_keys: Any = None,
        callback: Callable[[dict[str, Any]], None] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """MMEngine's signature; ``module.`` prefixes are handled by the checkpoint loader."""
        kwargs.setdefault("allow_unsafe_pickle", self.allow_unsafe_pickle)
        extra: dict[str, Any] = super().load_checkpoint(filename, strict=strict, **kwargs)
        checkpoint = self._decoded(extra)
        if callback is not None:
            callback(checkpoint)
        return checkpoint

    def resume(  # type: ignore[override]
        self,
        filename: str | os.PathLike[str],
        *,
        resume_optimizer: bool = True,
        map_location: Any = "default",
        resume_param_scheduler: bool = True,
        callback: Callable[[dict[str, Any]], None] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """MMEngine's signature: returns the runner's checkpoint dict (``meta``, ...)."""
        kwargs.setdefault("allow_unsafe_pickle", self.allow_unsafe_pickle)
        extra: dict[str, Any] = super().resume(
            filename,
            resume_optimizer=resume_optimizer,
            resume_param_scheduler=resume_param_scheduler,
            **kwargs,
        )
        checkpoint = self._decoded(extra)
        if callback is not None:
            callback(checkpoint)
        return checkpoint

    @staticmethod
    def _decoded(extra: Mapping[str, Any]) -> dict[str, Any]:
        checkpoint = dict(extra)
        if "message_hub" in checkpoint:
            checkpoint["message_hub"] = _decode_message_hub(checkpoint["message_hub"])
        checkpoint.setdefault("meta", {})
        return checkpoint


class CommSingleDeviceStrategy(MMEngineStrategyMixin, SingleDeviceStrategy):
    """`SingleDeviceStrategy` for MMEngine's ``FlexibleRunner``."""


class CommDDPStrategy(MMEngineStrategyMixin, DDPStrategy):
    """`DDPStrategy` for MMEngine's ``FlexibleRunner``."""


class CommFSDPStrategy(MMEngineStrategyMixin, FSDPStrategy):
    """`FSDPStrategy` (``fsdp_version=1|2``) for MMEngine's ``FlexibleRunner``."""


class CommDeepSpeedStrategy(MMEngineStrategyMixin, DeepSpeedStrategy):
    """`DeepSpeedStrategy` for MMEngine's ``FlexibleRunner``.

    The runner passes ``train_micro_batch_size_per_gpu`` (its batch size); it becomes the
    config's unless the config sets one.
    """

    def __init__(self, *, train_micro_batch_size_per_gpu: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if train_micro_batch_size_per_gpu is not None:
            self.config.setdefault("train_micro_batch_size_per_gpu", train_micro_batch_size_per_gpu)


for _adapter in (
    CommSingleDeviceStrategy,
    CommDDPStrategy,
    CommFSDPStrategy,
    CommDeepSpeedStrategy,
):
    STRATEGIES.register_module(module=_adapter, force=True)
_register()  # comm's wrappers in MODEL_WRAPPERS, for the classic Runner
