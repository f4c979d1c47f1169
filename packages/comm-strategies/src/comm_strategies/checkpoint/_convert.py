"""Offline conversion between every checkpoint format, on the CPU, without a process group.

Sources: a comm checkpoint folder (formats full, dcp, deepspeed), DeepSpeed's own folder
(ZeRO 0-3, or its universal layout) and a plain ``.pt``/``.pth`` file. Targets: one plain
file (the weights), a comm folder of format ``full`` or ``dcp`` (``sharded``) with the
optimizer state, and DeepSpeed's universal layout that a plain DeepSpeed engine of any
ZeRO stage and world size loads. DCP is read and written with ``no_dist``; DeepSpeed's
files are read by ``_deepspeed_offline`` with ``weights_only=True``.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import IO, Any

import torch

from comm_wrappers.backends import describe_params, quiet_torch

from . import _deepspeed_offline as ds_offline
from . import _publish
from ._convert_source import Source, read_source
from ._errors import CheckpointError
from ._files import rng_file, rng_json, save_tensor_file, write_json, write_private
from ._layout import DCP_FOLDER, EXTRA_FILE, MODEL_FILE, OPTIM_FILE, SCALER_FILE, SCHEDULERS_FILE
from ._manifest import write_manifest
from ._reading import _not_a_torch_file

TARGETS = ("plain", "full", "sharded", "deepspeed")
PLAIN_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
# What a converted folder copies from a comm source folder as it is.
_SIDE_FILES = (SCHEDULERS_FILE, SCALER_FILE, EXTRA_FILE)


def convert_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    to: str | None = None,
    allow_unsafe_pickle: bool = False,
    progress: bool = False,
) -> Path:
    """Convert a checkpoint offline, on the CPU, without a process group.

    Reads any checkpoint (a comm folder of format full, dcp or deepspeed; DeepSpeed's own
    folder, ZeRO 0-3 in fp32 or bf16, or its universal layout; a plain ``.pt``/``.pth``)
    and writes, by ``to``:

    - ``"plain"`` (the default for a destination ending in ``.pt``/``.pth``/``.bin``/
      ``.ckpt``, in any case): the full model state dict as one file that
      ``torch.load(weights_only=True)`` reads. Weights only.
    - ``"full"``: a checkpoint folder of format ``full`` (``model.pt``, ``optim.pt`` with
      the optimizer state keyed by parameter names, the source's schedulers, scaler, user
      state and RNG states) that `load_checkpoint` loads into any strategy.
    - ``"sharded"`` (the default for any other destination): a checkpoint folder in torch
      distributed checkpoint form, optimizer state included, which `load_checkpoint`
      reshards into FSDP, DDP or a plain module at any world size.
    - ``"deepspeed"``: DeepSpeed's universal checkpoint layout (weights, fp32 masters, Adam
      moments and steps per parameter) that plain DeepSpeed loads into an engine of any
      ZeRO stage (1-3) and world size with ``{"checkpoint": {"load_universal": true}}``,
      and a ZeRO-0 engine with ``engine.load_checkpoint(path, tag="universal")``.

    DeepSpeed's masters come out as fp32 (a bf16 engine's fp32 masters, not its bf16
    copy). Every file written loads with ``weights_only=True``; the destination is
    written under a temporary name and renamed when complete.

    Args:
        source: A checkpoint folder, a DeepSpeed checkpoint folder or a ``.pth`` file.
        destination: The file or folder to write (replaced atomically if it exists and is a
            checkpoint of the same kind: for ``"plain"``, a file with one of the suffixes
            above that holds torch's zip or legacy pickle format; anything else there, a
            symbolic link included, is refused, never replaced).
        to: ``"plain"``, ``"full"``, ``"sharded"`` or ``"deepspeed"``; None chooses
            ``"plain"`` or ``"sharded"`` from the destination's suffix.
        allow_unsafe_pickle: Allow source files that need full unpickling (old pickles,
            DeepSpeed files holding objects beyond its plain records); only trusted files.
        progress: Show a progress bar on stderr while writing.

    Returns:
        The destination.

    Raises:
        ValueError: ``to`` is not one of the targets.
        CheckpointError: The source is missing, is no checkpoint, or is damaged; the
            destination is a folder that is not a checkpoint; a plain destination is a
            folder, a symbolic link, or an existing file that is not a weights file.

    Examples:
        >>> import tempfile, torch
        >>> from comm_strategies.checkpoint import convert_checkpoint, save_checkpoint
        >>> folder = tempfile.mkdtemp()
        >>> path = save_checkpoint(folder + "/ckpt", model=torch.nn.Linear(2, 1), strategy="single")
        >>> out = convert_checkpoint(path, folder + "/weights.pt")
        >>> sorted(torch.load(out, weights_only=True))
        ['bias', 'weight']
        >>> ds = convert_checkpoint(path, folder + "/ds", to="deepspeed")
        >>> (ds / "latest_universal").read_text()
        'universal'
    """
    src, dst = Path(source), Path(destination).absolute()
    if to is None:
        to = "plain" if _plain_suffix(dst) else "sharded"
    if to not in TARGETS:
        message = f"to must be one of {', '.join(map(repr, TARGETS))}; got {to!r}"
        raise ValueError(message)
    read = read_source(src, optimizer=to != "plain", allow_unsafe_pickle=allow_unsafe_pickle)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if to == "plain":
        _check_plain_destination(dst)
        state = {k: v.contiguous() for k, v in read.model.items()}
        save_with_progress(state, dst, progress=progress, label="writing")
        return dst
    if to == "deepspeed":
        return _write_deepspeed(read, dst, progress=progress)
    return _write_folder(read, dst, sharded=to == "sharded", progress=progress)


def _write_folder(read: Source, dst: Path, *, sharded: bool, progress: bool) -> Path:
    """A comm checkpoint folder: format ``full`` (model.pt/optim.pt) or ``dcp``."""
    temporary = _begin(dst)
    try:
        if sharded:
            _write_dcp(read, temporary, progress)
        else:
            model = {k: v.contiguous() for k, v in read.model.items()}
            save_with_progress(model, temporary / MODEL_FILE, progress=progress, label=MODEL_FILE)
            if read.optim:
                save_with_progress(
                    read.optim, temporary / OPTIM_FILE, progress=progress, label=OPTIM_FILE
                )
        side = _copy_side_files(read, temporary)
        write_manifest(
            temporary,
            strategy=read.strategy,
            world_size=read.world_size,
            format="dcp" if sharded else "full",
            params=describe_params(read.model),
            optimizer_keys=list(read.optim),
            **side,
        )
        _publish.finish(temporary, dst)
    except BaseException:
        _publish.abandon(temporary)
        raise
    return dst


def _write_dcp(read: Source, folder: Path, progress: bool) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    state: dict[str, Any] = {"model": read.model}
    if read.optim:
        state["optim"] = read.optim
    bar = Progress("writing", _nbytes(state), enabled=progress)
    try:
        with quiet_torch():
            dcp_save(state, checkpoint_id=str(folder / DCP_FOLDER), no_dist=True)
        bar.advance(_nbytes(state))
    finally:
        bar.close()


def _copy_side_files(read: Source, folder: Path) -> dict[str, Any]:
    """Copy the source's schedulers, scaler, user state and RNG states; the manifest's
    fields that describe them."""
    manifest, source = read.manifest, read.folder
    if manifest is None or source is None:
        return {"num_schedulers": 0, "has_scaler": False, "rng_ranks": [], "extra_keys": []}
    for name in _SIDE_FILES:
        if (source / name).is_file():
            with (source / name).open("rb") as into:  # into a private file, renamed whole
                write_private(folder / name, partial(shutil.copyfileobj, into))
    rng_ranks = []
    for rank in manifest.rng_ranks:  # layout version 1's torch files written as JSON
        file = rng_file(source, rank)
        if file.is_file() or file.with_suffix(".pt").is_file():
            write_json(rng_json(source, rank), rng_file(folder, rank), compact=True)
            rng_ranks.append(rank)
    return {
        "num_schedulers": manifest.num_schedulers if (folder / SCHEDULERS_FILE).is_file() else 0,
        "has_scaler": manifest.has_scaler and (folder / SCALER_FILE).is_file(),
        "rng_ranks": rng_ranks,
        "extra_keys": list(manifest.extra_keys) if (folder / EXTRA_FILE).is_file() else [],
    }


# ---------------------------------------------------------------- DeepSpeed's universal layout


def _write_deepspeed(read: Source, dst: Path, *, progress: bool) -> Path:
    """DeepSpeed's universal layout under ``dst`` (a DeepSpeed ``save_dir``)."""
    if len(read.optim) > 1:
        message = (
            f"the source holds {len(read.optim)} optimizers ({sorted(read.optim)}); a DeepSpeed "
            "engine has one: convert to 'full' or 'sharded' instead"
        )
        raise CheckpointError(message)
    optim = next(iter(read.optim.values()), None)
    ds = read.deepspeed
    files = list(
        ds_offline.universal_files(
            read.model,
            optim,
            world_size=read.world_size,
            global_steps=ds.global_steps if ds is not None else None,
            lr_scheduler=ds.lr_scheduler if ds is not None else None,
        )
    )
    temporary = _begin(dst, deepspeed=True)
    bar = Progress("writing", sum(_nbytes(obj) for _, obj in files), enabled=progress)
    try:
        for relative, obj in files:
            path = temporary / relative
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if isinstance(obj, str):
                path.write_text(obj)
                path.chmod(0o600)
            else:
                save_tensor_file(obj, path)
            bar.advance(_nbytes(obj))
        _publish.finish(temporary, dst)
    except BaseException:
        _publish.abandon(temporary)
        raise
    finally:
        bar.close()
    return dst


# ---------------------------------------------------------------- where the converter writes
# A plain weights file replaces only a weights file; a folder replaces only a comm
# checkpoint, a universal folder this wrote, an empty folder, or nothing.


def _plain_suffix(path: Path) -> bool:
    """Whether ``path`` ends in one of `PLAIN_SUFFIXES`, in any case (``UP.PT`` too)."""
    return path.suffix.lower() in PLAIN_SUFFIXES


def _check_plain_destination(dst: Path) -> None:
    """Refuse to replace what is not a weights file: a symbolic link, a folder, or a file of
    another kind (a ``.pt``/``.pth``/``.bin``/``.ckpt`` file already there in torch's zip or
    legacy pickle format is replaced, atomically)."""
    if dst.is_symlink():
        # Replacing it would put a regular file in the link's place: the link lost, its
        # target left as it was.
        message = (
            f"cannot convert into {dst}: it is a symbolic link (to {os.readlink(dst)}); pass "
            "the link's target path to replace that file, or remove the link"
        )
        raise CheckpointError(message)
    if dst.is_dir():
        message = (
            f"cannot convert into {dst}: it is a folder; a plain weights file needs a file "
            f"name (e.g. {dst / 'model.pt'}), or pass to='full' or 'sharded' for a folder"
        )
        raise CheckpointError(message)
    if not dst.exists():
        return
    if not dst.is_file():  # a FIFO, a socket, a device: not read, never replaced
        what = "it is not a regular file"
    elif not _plain_suffix(dst):
        what = (
            f"its suffix is {dst.suffix or 'none'!r}, expected one of {', '.join(PLAIN_SUFFIXES)}"
        )
    else:
        with dst.open("rb") as handle:
            head = handle.read(4)
        # torch.save's zip format, or its legacy pickle (torch before 1.6).
        if head == b"PK\x03\x04" or head[:1] == b"\x80":
            return
        what = f"it is {_not_a_torch_file(dst) or 'of another format'}"
    message = (
        f"cannot convert into {dst}: the file exists and is not a weights file: {what}; "
        "remove it or choose another name"
    )
    raise CheckpointError(message)


def _begin(dst: Path, *, deepspeed: bool = False) -> Path:
    """A private temporary folder next to ``dst`` after checking ``dst`` may be replaced
    (a comm checkpoint, a universal folder this wrote, an empty folder, or nothing)."""
    temporary = _publish.temporary_name(dst)
    if deepspeed and (dst / ds_offline.UNIVERSAL_LATEST).is_file():
        temporary.mkdir(mode=0o700)
        return temporary
    status = _publish.begin(dst, temporary)
    if status != "ok":
        raise CheckpointError(f"cannot convert into {dst}: {status}")
    return temporary


# ---------------------------------------------------------------- progress


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
    try:
        write_private(path, lambda handle: torch.save(obj, _CountingWriter(handle, bar)))  # type: ignore[arg-type]
    finally:
        bar.close()
