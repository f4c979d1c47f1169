"""Offline conversion: any checkpoint to one plain file, a plain file to a sharded folder.

No process group: DCP is read and written with ``no_dist``, DeepSpeed folders are
consolidated from their files.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

from .._names import strip_prefixes
from . import _deepspeed_files as ds_files
from . import _publish
from ._errors import CheckpointError
from ._files import fsync_enabled, load_tensor_file, write_json
from ._formats import quiet_torch, read_dcp_full
from ._layout import DCP_FOLDER, DS_FOLDER, DS_TAG, MODEL_FILE
from ._manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, read_manifest
from ._params import describe_params
from ._save import _versions

PLAIN_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class Progress:
    """A text progress bar on a stream (stderr), by bytes; silent when disabled."""

    def __init__(self, label: str, total: int, *, enabled: bool, stream: IO[str] | None = None):
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._shown = -1
        self._start = time.monotonic()

    def advance(self, amount: int) -> None:
        self.done += amount
        percent = min(100, self.done * 100 // self.total)
        if self.enabled and percent != self._shown:
            self._shown = percent
            filled = percent * 30 // 100
            bar = "#" * filled + "." * (30 - filled)
            mib = self.done / 2**20
            self.stream.write(f"\r{self.label} [{bar}] {percent:3d}% {mib:,.1f} MiB")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            seconds = time.monotonic() - self._start
            self.stream.write(f" ({seconds:.1f} s)\n")
            self.stream.flush()


class _CountingWriter:
    """A binary file that reports the bytes written to a `Progress`."""

    def __init__(self, handle: IO[bytes], progress: Progress) -> None:
        self.handle = handle
        self.progress = progress

    def write(self, data: Any) -> int:
        written = self.handle.write(data)
        self.progress.advance(len(memoryview(data).cast("B")))
        return written

    def flush(self) -> None:
        self.handle.flush()


def _nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    return 0


def save_with_progress(obj: Any, path: Path, *, progress: bool, label: str) -> None:
    """``torch.save`` to a private file through a temporary name, with a progress bar."""
    bar = Progress(label, _nbytes(obj), enabled=progress)
    partial = path.with_name(path.name + f".partial-{uuid.uuid4().hex[:8]}")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            torch.save(obj, _CountingWriter(handle, bar))  # type: ignore[arg-type]
            handle.flush()
            if fsync_enabled():
                os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        bar.close()


def full_model_state_of(
    source: Path, *, allow_unsafe_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """The full model state dict of any checkpoint, read in this process (no group)."""
    if source.is_file():
        data = load_tensor_file(
            source, allow_unsafe_pickle=allow_unsafe_pickle, mmap=True, what="checkpoint"
        )
        if isinstance(data, Mapping) and isinstance(data.get("state_dict"), Mapping):
            data = data["state_dict"]
        elif isinstance(data, Mapping) and isinstance(data.get("module"), Mapping):
            data = data["module"]
        if not isinstance(data, Mapping):
            message = f"{source} holds a {type(data).__name__}, not a state dict"
            raise CheckpointError(message)
        return strip_prefixes({k: v for k, v in data.items() if isinstance(v, torch.Tensor)})
    if not (source / MANIFEST_NAME).is_file() and ds_files.is_deepspeed_folder(source):
        return ds_files.consolidate(source, allow_unsafe_pickle=allow_unsafe_pickle)
    manifest = read_manifest(source)
    if manifest.format == "full":
        state: dict[str, torch.Tensor] = load_tensor_file(
            source / MODEL_FILE,
            allow_unsafe_pickle=allow_unsafe_pickle,
            mmap=True,
            what="model state",
        )
        return state
    if manifest.format == "dcp":
        full: dict[str, torch.Tensor] = read_dcp_full(source)["model"]
        return full
    return ds_files.consolidate(
        source / DS_FOLDER / DS_TAG, allow_unsafe_pickle=allow_unsafe_pickle
    )


def convert_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    to: str | None = None,
    allow_unsafe_pickle: bool = False,
    progress: bool = False,
) -> Path:
    """Convert a checkpoint offline, on the CPU, without a process group.

    ``to="plain"`` (the default for a destination ending in ``.pt``/``.pth``/``.bin``/
    ``.ckpt``) writes the full model state dict as one file that plain
    ``torch.load(weights_only=True)`` reads: from a checkpoint folder of any format, a
    DeepSpeed folder (ZeRO 0-3) or another file. ``to="sharded"`` (the default for any
    other destination) writes a checkpoint folder whose model state is in torch
    distributed checkpoint form, which `load_checkpoint` reshards into FSDP at any world
    size. Only the weights move: optimizer state stays in the source.

    Args:
        source: A checkpoint folder, a DeepSpeed checkpoint folder or a ``.pth`` file.
        destination: The file or folder to write (replaced atomically if it exists).
        to: ``"plain"`` or ``"sharded"``; None chooses from the destination's suffix.
        allow_unsafe_pickle: Allow sources that need full unpickling (DeepSpeed's files).
        progress: Show a progress bar on stderr while writing.

    Returns:
        The destination.

    Examples:
        >>> import tempfile, torch
        >>> from comm_strategies.checkpoint import convert_checkpoint, save_checkpoint
        >>> folder = tempfile.mkdtemp()
        >>> path = save_checkpoint(folder + "/ckpt", model=torch.nn.Linear(2, 1), strategy="single")
        >>> out = convert_checkpoint(path, folder + "/weights.pt")
        >>> sorted(torch.load(out, weights_only=True))
        ['bias', 'weight']
    """
    src, dst = Path(source), Path(destination).absolute()
    if to is None:
        to = "plain" if dst.suffix in PLAIN_SUFFIXES else "sharded"
    if to not in ("plain", "sharded"):
        message = f"to must be 'plain' or 'sharded', got {to!r}"
        raise ValueError(message)
    if not src.exists():
        message = f"checkpoint {src} does not exist"
        raise CheckpointError(message)
    state = full_model_state_of(src, allow_unsafe_pickle=allow_unsafe_pickle)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if to == "plain":
        save_with_progress(
            {k: v.contiguous() for k, v in state.items()}, dst, progress=progress, label="writing"
        )
        return dst
    return _write_sharded(state, src, dst, progress=progress)


def _write_sharded(state: dict[str, torch.Tensor], src: Path, dst: Path, *, progress: bool) -> Path:
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    strategy = "convert"
    if (src / MANIFEST_NAME).is_file():
        strategy = read_manifest(src).strategy
    temporary = _publish.temporary_name(dst)
    temporary.mkdir(mode=0o700)
    try:
        bar = Progress("writing", _nbytes(state), enabled=progress)
        with quiet_torch():
            dcp_save({"model": state}, checkpoint_id=str(temporary / DCP_FOLDER), no_dist=True)
        bar.advance(_nbytes(state))
        bar.close()
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            strategy=strategy,
            wrapper="module",
            world_size=1,
            format="dcp",
            zero_stage=None,
            sharding=None,
            params=describe_params(state),
            has_optimizer=False,
            optimizer_keys=[],
            num_schedulers=0,
            has_scaler=False,
            rng_ranks=[],
            extra_keys=[],
            versions=_versions(),
            saved_at=time.time(),
            files=_publish.list_files(temporary),
        )
        write_json(manifest.to_json(), temporary / MANIFEST_NAME)
        _publish.finish(temporary, dst)
    except BaseException:
        _publish.abandon(temporary)
        raise
    return dst
