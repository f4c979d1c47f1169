"""The manifest: what a checkpoint holds, written last, readable without torch.distributed."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..__about__ import __version__
from ._errors import CheckpointError
from ._files import write_json
from ._layout import DEFAULT_KEY

MANIFEST_NAME = "manifest.json"
# 2: each rank's RNG states in rng/rank_N.json (1: rng/rank_N.pt, still read)
FORMAT_VERSION = 2
FORMATS = ("full", "dcp", "deepspeed")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a checkpoint folder holds, from its ``manifest.json``.

    Attributes:
        format_version: Version of this layout (2; version 1 kept the RNG states in
            torch files, which are still read).
        strategy: The strategy's short name at save time (``"single"``, ``"ddp"``,
            ``"fsdp"``, ``"fsdp2"``, ``"deepspeed"``, or what the caller gave).
        wrapper: The model's kind: ``"module"``, ``"ddp"``, ``"fsdp1"``, ``"fsdp2"`` or
            ``"deepspeed"``.
        world_size: Number of ranks that saved it.
        format: How the model and optimizer are stored: ``"full"`` (one
            ``model.pt`` / ``optim.pt`` with full tensors), ``"dcp"`` (sharded, torch
            distributed checkpoint under ``dcp/``) or ``"deepspeed"`` (DeepSpeed's own
            files under ``deepspeed/``).
        zero_stage: DeepSpeed's ZeRO stage, else None.
        sharding: FSDP's sharding (``"FULL_SHARD"``, ``"fully_shard"``...), else None.
        params: Parameter and buffer names (no wrapper prefixes) to ``[shape, dtype]``.
        has_optimizer: Whether optimizer state was saved.
        optimizer_keys: The names of an ``OptimWrapperDict``'s optimizers, or ``[]``.
        num_schedulers: How many scheduler states ``schedulers.pt`` holds.
        has_scaler: Whether a gradient scaler's state was saved.
        rng_ranks: The ranks whose RNG states are under ``rng/``.
        extra_keys: The keys of the user state in ``extra.pt``.
        versions: Library versions at save time (torch, comm-strategies, DeepSpeed).
        saved_at: Seconds since the epoch when the checkpoint was completed.
        files: Every file of the checkpoint, relative to its folder, with its size.
    """

    format_version: int
    strategy: str
    wrapper: str
    world_size: int
    format: str
    zero_stage: int | None
    sharding: str | None
    params: dict[str, list[Any]]
    has_optimizer: bool
    optimizer_keys: list[str]
    num_schedulers: int
    has_scaler: bool
    rng_ranks: list[int]
    extra_keys: list[str]
    versions: dict[str, str]
    saved_at: float
    files: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "manifest") -> Manifest:
        """Build a manifest from its JSON dict; clear errors for a foreign or newer one."""
        version = data.get("format_version")
        if not isinstance(version, int):
            message = f"{source} has no integer 'format_version': not a comm checkpoint manifest"
            raise CheckpointError(message)
        if version > FORMAT_VERSION:
            message = (
                f"{source} has format_version {version}, newer than this comm-strategies "
                f"reads ({FORMAT_VERSION}): upgrade comm-strategies"
            )
            raise CheckpointError(message)
        names = [field.name for field in dataclasses.fields(cls)]
        missing = [name for name in names if name not in data]
        if missing:
            message = f"{source} lacks the fields {missing}: it is damaged or not a comm manifest"
            raise CheckpointError(message)
        return cls(**{name: data[name] for name in names})


def write_manifest(folder: Path, *, optimizer_keys: Sequence[str], **fields: Any) -> Manifest:
    """Write the manifest of the checkpoint in ``folder`` (its last file); return it.

    The one place a manifest is made (a save's publish and the converter). ``fields``: the
    `Manifest` fields the caller knows (``wrapper``, ``zero_stage`` and ``sharding`` may be
    left out: a module's); the format version, the optimizer fields from
    ``optimizer_keys`` (the saved optimizers' keys; one unnamed optimizer is recorded as
    ``[]``), the libraries' versions, the time and every file of ``folder`` with its size
    are filled in here.
    """
    keys = sorted(optimizer_keys)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        has_optimizer=bool(keys),
        optimizer_keys=[] if keys in ([], [DEFAULT_KEY]) else keys,
        versions=_versions(),
        saved_at=time.time(),
        files=list_files(folder),
        **{"wrapper": "module", "zero_stage": None, "sharding": None, **fields},
    )
    write_json(manifest.to_json(), folder / MANIFEST_NAME)
    return manifest


def _versions() -> dict[str, str]:
    versions = {"torch": str(torch.__version__), "comm-strategies": __version__}
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None:
        versions["deepspeed"] = str(getattr(deepspeed, "__version__", "?"))
    return versions


def list_files(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` (relative path, size), sorted; links are not followed."""
    found: dict[str, int] = {}
    pending = [(folder, "")]
    while pending:
        here, prefix = pending.pop()
        with os.scandir(here) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append((Path(entry.path), f"{prefix}{entry.name}/"))
                elif entry.is_file():
                    found[prefix + entry.name] = entry.stat().st_size
    return dict(sorted(found.items()))


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read a checkpoint folder's manifest (no process group, no torch.distributed needed).

    Args:
        path: The checkpoint folder (or its ``manifest.json``).

    Returns:
        The `Manifest`.

    Raises:
        CheckpointError: No manifest (an unfinished or foreign folder), or a damaged one.

    Examples:
        >>> import tempfile, torch
        >>> from comm_strategies.checkpoint import save_checkpoint, read_manifest
        >>> folder = tempfile.mkdtemp()
        >>> path = save_checkpoint(folder + "/step_1", model=torch.nn.Linear(2, 1), strategy="single")
        >>> manifest = read_manifest(path)
        >>> manifest.format, manifest.world_size, manifest.params["weight"]
        ('full', 1, [[1, 2], 'float32'])
    """
    folder = Path(path)
    file = folder if folder.name == MANIFEST_NAME else folder / MANIFEST_NAME
    if not file.is_file():
        if not file.parent.exists():
            message = f"checkpoint {file.parent} does not exist"
        else:
            message = (
                f"{file.parent} has no {MANIFEST_NAME}: it is not a finished comm checkpoint "
                "(a save killed before its end leaves no manifest; use an earlier checkpoint, "
                "see find_latest)"
            )
        raise CheckpointError(message)
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        message = f"{file} is not valid JSON ({error}): the manifest is damaged"
        raise CheckpointError(message) from error
    if not isinstance(data, dict):
        message = f"{file} holds a {type(data).__name__}, not a manifest object"
        raise CheckpointError(message)
    return Manifest.from_json(data, str(file))
