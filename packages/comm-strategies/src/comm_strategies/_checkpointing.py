"""`CheckpointMixin`: the checkpoint methods of `Strategy` (save, resume, load, state dicts)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from comm_wrappers.backends import Backend, backend_of

from . import checkpoint
from .checkpoint._consensus import wait_previous

__all__ = ["CheckpointMixin"]


class CheckpointMixin:
    """Save, resume and load the prepared model, optimizer and schedulers of a `Strategy`.

    Every method is collective; each one needs `Strategy.prepare` to have run.
    """

    # Set by `Strategy`.
    name: str
    keep_last: int | None
    model: Any
    optim_wrapper: Any
    param_schedulers: list[Any]
    _work_dir: Path | None
    _prepared: bool
    _backend: Backend | None = None  # the model's adapter, kept by `_model_backend`

    def _model_backend(self) -> Backend:
        """The prepared model's backend adapter, decided once per model, not at every save
        and load (again when ``self.model`` is another object; a model wrapped in place
        after `prepare`, which no strategy does, would keep its first adapter)."""
        if self._backend is None or self._backend.model is not self.model:
            self._backend = backend_of(self.model)
        return self._backend

    def _require_prepared(self, what: str) -> None:
        if not self._prepared:
            message = f"{type(self).__name__}.{what} needs a prepared model: call prepare first"
            raise RuntimeError(message)

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        extra: Mapping[str, Any] | None = None,
        sharded: bool | None = None,
        timeout: float | None = None,
        keep_last: int | None = None,
    ) -> Path:
        """Save a checkpoint directory (collective: every rank calls it).

        Args:
            path: The checkpoint directory; relative paths are under `work_dir` when set.
            save_optimizer: Include the optimizer state.
            save_param_scheduler: Include the schedulers.
            extra: User state (step, epoch, EMA, ...) given back by `resume`.
            sharded: None for the strategy's natural format.
            timeout: Seconds a rank waits for the others to enter the call; None:
                `COMM_CHECKPOINT_TIMEOUT`, or 300.
            keep_last: Once published, keep only the newest N complete checkpoints in the
                directory's parent; None: the strategy's ``keep_last`` (None keeps all).

        Returns:
            The checkpoint directory.
        """
        self._require_prepared("save_checkpoint")
        return Path(
            checkpoint.save_checkpoint(
                self._resolve(path),
                **self._save_options(save_optimizer, save_param_scheduler, extra),
                sharded=sharded,
                timeout=timeout,
                keep_last=self.keep_last if keep_last is None else keep_last,
            )
        )

    def save_checkpoint_async(
        self,
        path: str | os.PathLike[str],
        *,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        extra: Mapping[str, Any] | None = None,
        sharded: bool | None = None,
        timeout: float | None = None,
        keep_last: int | None = None,
    ) -> checkpoint.SaveHandle:
        """`save_checkpoint` with the files written in the background (collective).

        Returns once the state is copied to the CPU; training may go on. The handle's
        ``wait()`` returns the checkpoint directory (or raises on every rank when any rank
        failed) and ``done()`` says whether it is written. The manifest and the rename
        happen once every rank finished; the next save waits for this one. The arguments
        are `save_checkpoint`'s.
        """
        self._require_prepared("save_checkpoint_async")
        handle: checkpoint.SaveHandle = checkpoint.save_checkpoint(
            self._resolve(path),
            **self._save_options(save_optimizer, save_param_scheduler, extra),
            sharded=sharded,
            timeout=timeout,
            keep_last=self.keep_last if keep_last is None else keep_last,
            async_save=True,
        )
        return handle

    def _save_options(
        self, save_optimizer: bool, save_param_scheduler: bool, extra: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        return {
            "model": self._model_backend(),
            "optim_wrapper": self.optim_wrapper if save_optimizer else None,
            "schedulers": self.param_schedulers if save_param_scheduler else (),
            "strategy": self.name,
            "extra": None if extra is None else dict(extra),
        }

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        strict: bool = True,
        allow_unsafe_pickle: bool = False,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Load the model's weights only, from any checkpoint of the contract or a plain .pth.

        Collective. Returns the checkpoint's user state (``extra``). ``timeout``: seconds a
        rank waits for the others to enter the call (None: `COMM_CHECKPOINT_TIMEOUT`, or 300).
        """
        self._require_prepared("load_checkpoint")
        weights_only = {"load_optimizer": False, "load_schedulers": False, "load_rng": False}
        return self._load(
            self._resolve(path),
            strict=strict,
            allow_unsafe_pickle=allow_unsafe_pickle,
            timeout=timeout,
            **weights_only,
        )

    def resume(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        resume_optimizer: bool = True,
        resume_param_scheduler: bool = True,
        load_rng: bool = True,
        timeout: float | None = None,
        allow_unsafe_pickle: bool = False,
        missing_ok: bool = False,
    ) -> dict[str, Any]:
        """Restore model, optimizer, schedulers and RNG states (collective).

        A job that a launcher restarts (``torchrun --max-restarts``, a requeued Slurm job)
        calls ``resume(missing_ok=True)`` once after `prepare`: the first attempt finds no
        checkpoint and starts from scratch, every later one goes on from the latest complete
        checkpoint (a save or a ``keep_last`` removal killed half-way never counts).

        Args:
            path: The checkpoint; None resumes from the latest complete one in `work_dir`.
            resume_optimizer: Restore the optimizer state.
            resume_param_scheduler: Restore the schedulers.
            load_rng: Restore each rank's random generators.
            allow_unsafe_pickle: Allow formats that need full unpickling (DeepSpeed's own).
            timeout: Seconds a rank waits for the others to enter the call; None:
                `COMM_CHECKPOINT_TIMEOUT`, or 300.
            missing_ok: With ``path=None``: when `work_dir` holds no complete checkpoint,
                return an empty dict and change nothing instead of raising.

        Returns:
            The checkpoint's user state (``extra``); empty when nothing was resumed.

        Raises:
            FileNotFoundError: ``path=None``, no complete checkpoint and not ``missing_ok``.
        """
        self._require_prepared("resume")
        if path is None:
            if self._work_dir is None:
                message = "resume() without a path needs the strategy's work_dir"
                raise ValueError(message)
            wait_previous()  # the latest is an async save of this process still committing
            latest = checkpoint.find_latest(self._work_dir)
            if latest is None and missing_ok:
                return {}
            if latest is None:
                message = (
                    f"resume(): no complete checkpoint under {self._work_dir}; pass "
                    "missing_ok=True to start from scratch when there is none"
                )
                raise FileNotFoundError(message)
            source = Path(latest)  # already under work_dir (relative when work_dir is)
        else:
            source = self._resolve(path)
        return self._load(
            source,
            optim_wrapper=self.optim_wrapper,
            schedulers=self.param_schedulers,
            load_optimizer=resume_optimizer,
            load_schedulers=resume_param_scheduler,
            load_rng=load_rng,
            allow_unsafe_pickle=allow_unsafe_pickle,
            timeout=timeout,
        )

    def _load(self, source: Path, **options: Any) -> dict[str, Any]:
        """`load_checkpoint` of the checkpoint package into the prepared model."""
        return dict(checkpoint.load_checkpoint(source, model=self._model_backend(), **options))

    def model_state_dict(self) -> dict[str, Any]:
        """The full, unprefixed model state on the CPU, on every rank (collective)."""
        self._require_prepared("model_state_dict")
        return dict(checkpoint.full_model_state_dict(self._model_backend()))

    def optim_state_dict(self) -> dict[str, Any]:
        """The full optimizer state keyed by parameter names (collective)."""
        self._require_prepared("optim_state_dict")
        return dict(checkpoint.full_optim_state_dict(self._model_backend(), self.optim_wrapper))

    def load_model_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load a full model state (unprefixed names) into the prepared model (collective)."""
        self._require_prepared("load_model_state_dict")
        checkpoint.load_full_model_state_dict(
            self._model_backend(), dict(state_dict), strict=strict
        )

    def load_optim_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full optimizer state (from `optim_state_dict`) (collective)."""
        self._require_prepared("load_optim_state_dict")
        checkpoint.load_full_optim_state_dict(
            self._model_backend(), self.optim_wrapper, dict(state_dict)
        )

    def _resolve(self, path: str | os.PathLike[str]) -> Path:
        resolved = Path(path)
        if not resolved.is_absolute() and self._work_dir is not None:
            resolved = self._work_dir / resolved
        return resolved
