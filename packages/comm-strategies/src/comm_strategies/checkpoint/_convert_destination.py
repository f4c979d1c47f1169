"""Where the converter writes: the checks before a destination is replaced.

A plain weights file replaces only a weights file; a folder replaces only a comm
checkpoint, a universal folder this wrote, an empty folder, or nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import _deepspeed_offline as ds_offline
from . import _publish
from ._errors import CheckpointError
from ._files import _not_a_torch_file

PLAIN_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


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
