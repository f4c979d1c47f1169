"""DeepSpeed engines: full state in and out (ZeRO 0-3), native files, consolidation.

Imported only when a DeepSpeed engine or DeepSpeed's files are at hand: DeepSpeed is the
``deepspeed`` extra.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from . import _dist
from ._errors import CheckpointError
from ._files import UNSAFE_HINT

DS_FOLDER = "deepspeed"
DS_TAG = "state"


def _deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as error:
        message = (
            "this needs DeepSpeed: install torch first, then "
            'pip install --no-build-isolation "comm-strategies[deepspeed]"'
        )
        raise CheckpointError(message) from error
    return deepspeed


def zero_stage(engine: Any) -> int:
    """The engine's ZeRO stage."""
    return int(engine.zero_optimization_stage())


@contextlib.contextmanager
def _gathered(engine: Any, modifier_rank: int | None) -> Iterator[None]:
    if zero_stage(engine) == 3:
        parameters = list(engine.module.parameters())
        with _deepspeed().zero.GatheredParameters(parameters, modifier_rank=modifier_rank):
            yield
    else:
        yield


def param_shapes(engine: Any) -> dict[str, list[Any]]:
    """``{name: [shape, dtype]}`` of the engine's module (ZeRO-3's full shapes)."""
    out: dict[str, list[Any]] = {}
    module = engine.module
    for name, parameter in module.named_parameters():
        shape = getattr(parameter, "ds_shape", parameter.shape)
        out[name] = [list(shape), str(parameter.dtype).removeprefix("torch.")]
    for name, buffer in module.named_buffers():
        out[name] = [list(buffer.shape), str(buffer.dtype).removeprefix("torch.")]
    return out


def full_model_state(engine: Any, *, rank0_only: bool) -> dict[str, torch.Tensor]:
    """The module's full state on the CPU (collective under ZeRO-3: it gathers)."""
    keep = not rank0_only or _dist.rank() == 0
    with _gathered(engine, modifier_rank=None):
        if not keep:
            return {}
        return {
            name: value.detach().cpu().clone()
            for name, value in engine.module.state_dict().items()
            if isinstance(value, torch.Tensor)
        }


def load_full_model_state(engine: Any, state: Mapping[str, torch.Tensor], strict: bool) -> None:
    """Load a full state into the engine's module and its fp32 master copy (collective).

    Under ZeRO-3 the parameters are gathered, rank 0's copy is written and partitioned
    again on exit. The optimizer's fp32 partitions (ZeRO 1-3, bf16) are then refreshed
    from the new weights, or its next step would bring the old ones back.
    """
    with _gathered(engine, modifier_rank=0), torch.no_grad():
        engine.module.load_state_dict(dict(state), strict=strict)
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if callable(refresh):
        refresh()


def save_native(engine: Any, folder: Path) -> None:
    """``engine.save_checkpoint`` into ``folder/deepspeed/state`` (collective)."""
    engine.save_checkpoint(
        str(folder / DS_FOLDER), tag=DS_TAG, client_state={}, save_latest=False
    )


def load_native(
    engine: Any,
    folder: Path,
    tag: str | None,
    *,
    strict: bool,
    load_optimizer: bool,
) -> None:
    """``engine.load_checkpoint`` of a DeepSpeed folder (collective)."""
    loaded, _ = engine.load_checkpoint(
        str(folder),
        tag=tag,
        load_module_strict=strict,
        load_optimizer_states=load_optimizer,
        load_lr_scheduler_states=False,
        load_module_only=not load_optimizer,
    )
    if loaded is None:
        message = f"DeepSpeed could not load {folder} (tag {tag!r}) on {_dist.where()}"
        raise CheckpointError(message)


def find_tag(folder: Path) -> str:
    """The tag of a DeepSpeed checkpoint folder: its ``latest`` file, or its only tag."""
    latest = folder / "latest"
    if latest.is_file():
        return latest.read_text().strip()
    tags = sorted(p.name for p in folder.iterdir() if p.is_dir() and _has_states(p))
    if len(tags) == 1:
        return tags[0]
    message = (
        f"{folder} has no 'latest' file and {len(tags)} checkpoint tags ({tags}): pass the "
        "tag's folder itself"
    )
    raise CheckpointError(message)


def _has_states(folder: Path) -> bool:
    return any(folder.glob("*model_states.pt"))


def is_deepspeed_folder(folder: Path) -> bool:
    """Whether ``folder`` is a DeepSpeed checkpoint folder (``save_dir`` or ``save_dir/tag``)."""
    if not folder.is_dir():
        return False
    if _has_states(folder):
        return True
    return (folder / "latest").is_file() or any(
        _has_states(p) for p in folder.iterdir() if p.is_dir()
    )


def split_folder(folder: Path) -> tuple[Path, str]:
    """``(save_dir, tag)`` of a DeepSpeed folder given as ``save_dir`` or ``save_dir/tag``."""
    if _has_states(folder):
        return folder.parent, folder.name
    return folder, find_tag(folder)


def require_unsafe(folder: Path, allow_unsafe_pickle: bool) -> None:
    """DeepSpeed's files need full unpickling: refuse without the caller's opt-in."""
    if not allow_unsafe_pickle:
        message = (
            f"{folder} holds DeepSpeed's own files, which only load with full unpickling "
            f"(torch.load(weights_only=False)). {UNSAFE_HINT}."
        )
        raise CheckpointError(message)


def consolidate(folder: Path, *, allow_unsafe_pickle: bool) -> dict[str, torch.Tensor]:
    """One full fp32 state dict from a DeepSpeed checkpoint folder, offline (ZeRO 0-3).

    ZeRO 1-3 go through DeepSpeed's ``zero_to_fp32``; ZeRO-0 (which ``zero_to_fp32``
    cannot read) takes the module state of ``mp_rank_00_model_states.pt``.
    """
    require_unsafe(folder, allow_unsafe_pickle)
    save_dir, tag = split_folder(folder)
    tag_dir = save_dir / tag
    if not any(tag_dir.glob("*optim_states.pt")):  # ZeRO-0: the module state is whole
        states = _load_unsafe(tag_dir / "mp_rank_00_model_states.pt")
        module = states.get("module") if isinstance(states, dict) else None
        if not isinstance(module, Mapping):
            message = f"{tag_dir / 'mp_rank_00_model_states.pt'} has no 'module' state dict"
            raise CheckpointError(message)
        return {k: v.float() if v.is_floating_point() else v for k, v in module.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    log = io.StringIO()
    try:
        # zero_to_fp32 prints its progress (and progress bars): keep them off the log.
        with torch.no_grad(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=tag)
    except Exception as error:
        message = f"DeepSpeed's zero_to_fp32 cannot read {tag_dir}: {error}\n{log.getvalue()}"
        raise CheckpointError(message) from error
    return {name: value.detach().clone() for name, value in state.items()}


def _load_unsafe(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        message = f"{path} is truncated or corrupt: {error}"
        raise CheckpointError(message) from error


def folder_world_size(tag_dir: Path) -> int | None:
    """How many data-parallel ranks saved a DeepSpeed tag folder (from its file names)."""
    optim = list(tag_dir.glob("*optim_states.pt"))
    if optim:
        return len(optim)
    return None


def native_layout(folder: Path) -> tuple[int | None, int | None]:
    """``(ZeRO stage, data-parallel world size)`` recorded in a DeepSpeed tag folder."""
    files = sorted(folder.glob("*model_states.pt"))
    if not files:
        return None, None
    states = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
    config = states.get("ds_config", {}) if isinstance(states, dict) else {}
    stage = config.get("zero_optimization", {}).get("stage", 0)
    world = states.get("dp_world_size") if isinstance(states, dict) else None
    return (None if stage is None else int(stage)), (None if world is None else int(world))
