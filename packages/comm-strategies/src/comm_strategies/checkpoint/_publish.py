"""The temporary folder and the atomic publish of a checkpoint, in a fixed order.

``begin`` (rank 0): clear what killed saves of the name left, check that the path may be
replaced, create a private temporary folder next to it. Every rank then writes into that
folder. ``finish`` (rank 0, after every rank wrote): rename it to its name; a checkpoint
already there is hidden by a rename and deleted in the background. ``retain`` (rank 0,
after ``finish``): the older complete checkpoints next to it beyond ``keep_last`` are
hidden and deleted the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import comm_collectives as dist

from ._errors import CheckpointError
from ._files import fsync_enabled
from ._manifest import MANIFEST_NAME, Manifest, read_manifest, write_manifest


def temporary_name(final: Path) -> Path:
    """A fresh temporary folder name next to ``final`` (hidden, unique)."""
    return final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"


def begin(final: Path, temporary: Path) -> str:
    """Rank 0's first step: ``"ok"`` once ``temporary`` exists, else what went wrong."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(final)
        status = _replaceable(final)
        if status == "ok":
            temporary.mkdir(mode=0o700)
    except OSError as caught:
        status = f"cannot create {temporary}: {caught}"
    return status


@dataclass
class Publication:
    """What rank 0's `publish` needs, gathered as a save goes on (`_save`)."""

    final: Path
    temporary: Path
    keep_last: int | None
    strategy: str
    fmt: str
    optimizer_keys: list[str]
    num_schedulers: int
    extra_keys: list[str]
    described: dict[str, Any] = field(default_factory=dict)
    params: dict[str, list[Any]] = field(default_factory=dict)
    has_scaler: bool = False


def publish(publication: Publication) -> None:
    """Rank 0, once every rank's files are whole: the manifest, the rename into place, the
    retention."""
    world = dist.get_world_size()
    write_manifest(
        publication.temporary,
        strategy=publication.strategy,
        world_size=world,
        format=publication.fmt,
        params=publication.params,
        optimizer_keys=publication.optimizer_keys,
        num_schedulers=publication.num_schedulers,
        has_scaler=publication.has_scaler,
        rng_ranks=list(range(world)),
        extra_keys=publication.extra_keys,
        **publication.described,
    )
    finish(publication.temporary, publication.final)
    if publication.keep_last is not None:
        retain(publication.final, publication.keep_last)


def abandon(temporary: Path) -> None:
    """Remove a temporary folder whose save failed."""
    shutil.rmtree(temporary, ignore_errors=True)


def _replaceable(final: Path) -> str:
    """ "ok" when a save may put a checkpoint at ``final``, else what is in the way.

    Only a checkpoint (a folder with a manifest), an empty folder or a symbolic link is
    replaced: a user's file, or a folder of other things (a work_dir passed by mistake),
    would be deleted with it.
    """
    if final.is_symlink() or not final.exists():
        return "ok"
    if not final.is_dir():
        return f"found a file at {final}, not a checkpoint folder; pass another path or remove it"
    if not any(final.iterdir()):
        return "ok"
    manifest = _our_manifest(final)
    if manifest is not None:
        foreign = not_ours(final, manifest)
        if not foreign:
            return "ok"
        shown = ", ".join(foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        )
        return (
            f"found the checkpoint {final} holding files comm did not write ({shown}"
            f"{_legend(foreign)}); a save replaces the whole folder and would delete them: "
            "move them out, or save to another path"
        )
    return (
        f"found a folder at {final} that is not a checkpoint (no {MANIFEST_NAME} written by "
        "comm-strategies in it); a save replaces the folder at its path, so pass another "
        "path (a new folder inside it, say) or remove the folder"
    )


def _our_manifest(folder: Path) -> Manifest | None:
    """The manifest of ``folder`` when this package wrote it, else None (``manifest.json``
    alone is a common name: a web app's or a data set's folder may hold one)."""
    try:
        manifest = read_manifest(folder)
    except CheckpointError:  # none, damaged, or another program's
        return None
    return manifest if "comm-strategies" in manifest.versions else None


def not_ours(folder: Path, manifest: Manifest | None = None) -> list[str]:
    """What a checkpoint folder holds that its manifest does not list (a user's notes, an
    evaluation's output): what replacing or removing the folder would destroy.

    Files, and also what is not a file: a symbolic link of any kind (to a file, to a
    folder, dangling; never followed) and an empty folder that holds none of the listed
    files, each by its path inside ``folder`` (``"name/"`` for a folder, ``"name@"`` for
    a link). ``manifest``: the folder's, when the caller read it already.
    """
    listed = set((manifest or read_manifest(folder)).files) | {MANIFEST_NAME}
    parents = {str(Path(name).parent) for name in listed}
    parents |= {str(p) for name in listed for p in Path(name).parents}
    foreign, pending = [], [(str(folder), "")]
    while pending:  # links are listed, not followed
        here, prefix = pending.pop()
        with os.scandir(here) as entries:
            for entry in entries:
                relative = prefix + entry.name
                if entry.is_symlink():
                    foreign.append(relative + "@")
                elif entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, relative + "/"))
                    if relative not in parents and not any(Path(entry.path).iterdir()):
                        foreign.append(relative + "/")
                elif relative not in listed:
                    foreign.append(relative)
    return sorted(foreign)


def _legend(names: list[str]) -> str:
    """How `not_ours` marks folders and links, when ``names`` holds one."""
    if any(name.endswith(("/", "@")) for name in names):
        return "; NAME/ is a folder, NAME@ a symbolic link"
    return ""


def finish(temporary: Path, final: Path) -> None:
    """Rename the finished folder to its name; a folder already there is replaced.

    The replaced folder is hidden by a rename, then deleted in the background: deleting a
    large checkpoint (freeing its pages, or many round trips on a network filesystem) is
    not part of writing the new one, which is complete and visible once renamed.
    """
    old = None
    if final.exists() or final.is_symlink():  # a dangling link is replaced too
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(final, old)
    os.replace(temporary, final)
    _fsync_dir(final.parent)
    if old is not None:
        _delete_later(old)


def newest_first(parent: Path, *, whole: bool = False, unpublished: bool = False) -> list[Path]:
    """The complete checkpoints this package wrote in ``parent``, newest first.

    The order is `find_latest`'s: by the manifest's ``saved_at``, then by name. Only
    folders whose manifest this package wrote (`_our_manifest`) are listed, and no
    symbolic link (a ``latest`` link to one of them is not a second checkpoint). Hidden
    names (temporary and replaced folders) never count, but with ``unpublished`` a finished
    temporary folder ``.NAME.tmp-*`` counts when no ``NAME`` is there and a replaced
    ``.NAME.old-*`` is: its save was killed between hiding the checkpoint it replaced and
    renaming itself into place (no complete ``NAME`` would be left otherwise). With
    ``whole``, a checkpoint counts only when every file its manifest lists is there at the
    size it lists (a machine that crashed can leave a file short).
    """
    entries = list(parent.iterdir())
    visible = {entry.name for entry in entries if not entry.name.startswith(".")}
    replaced = {m.group(1) for e in entries if (m := _REPLACED.fullmatch(e.name)) is not None}
    found: list[tuple[tuple[float, str], Path]] = []
    for candidate in entries:
        if candidate.name.startswith("."):
            # a publish of NAME cut between its two renames: no NAME, a hidden old NAME
            cut = _UNPUBLISHED.fullmatch(candidate.name)
            name = cut.group(1) if cut else ""
            if not (unpublished and name and name not in visible and name in replaced):
                continue
        if candidate.is_symlink() or not candidate.is_dir():
            continue
        manifest = _our_manifest(candidate)
        if manifest is None or (whole and not is_whole(candidate, manifest.files)):
            continue
        found.append(((manifest.saved_at, candidate.name), candidate))
    return [path for _, path in sorted(found, key=lambda item: item[0], reverse=True)]


def is_whole(folder: Path, files: dict[str, int]) -> bool:
    """Whether every file of ``files`` (name: size) is in ``folder`` at its size."""
    try:
        return all((folder / name).stat().st_size == size for name, size in files.items())
    except OSError:
        return False


def check_keep_last(keep_last: int | None, caller: str) -> None:
    """Raise when ``keep_last`` is neither None nor an int of at least 1."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)):
        message = (
            f"{caller}: keep_last must be an int or None, got {keep_last!r} "
            f"({type(keep_last).__name__})"
        )
        raise TypeError(message)
    if keep_last is not None and keep_last < 1:
        message = (
            f"{caller}: keep_last must be at least 1 (the new checkpoint is always kept), "
            f"got {keep_last}; pass None to keep every checkpoint"
        )
        raise ValueError(message)


def retain(final: Path, keep_last: int) -> list[Path]:
    """Remove the older checkpoints next to ``final``, keeping the newest ``keep_last``.

    Called by rank 0 after ``final`` was published, so a checkpoint is never removed before
    its successor is whole. ``final`` is always kept; of the other complete checkpoints
    (`newest_first`) the newest ``keep_last - 1`` are kept. Nothing else is touched: a
    folder without this package's manifest (logs, a half-written save, another program's
    files) stays, and so does a checkpoint holding files its manifest does not list (with a
    warning). Each removed folder is hidden by a rename (``.NAME.old-XXXX``: no reader
    takes it for a checkpoint from then on) and deleted in the background. Failures are
    ignored (a later save tries again).

    Returns:
        The checkpoints removed (their names before the rename).
    """
    try:
        others = [path for path in newest_first(final.parent) if path.name != final.name]
    except OSError:
        return []
    removed = []
    for path in others[max(0, keep_last - 1) :]:
        foreign = not_ours(path)
        if foreign:  # a file comm did not write: the folder stays, with a warning
            warnings.warn(
                f"keep_last left {path} in place: it holds files comm did not write "
                f"({', '.join(foreign[:5])}{_legend(foreign)}); move them out and it goes "
                "at the next save",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        hidden = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
        try:
            os.replace(path, hidden)
        except OSError:
            continue
        _delete_later(hidden)
        removed.append(path)
    return removed


_deleting: dict[Path, threading.Thread] = {}
_EXIT_WAIT_S = 60.0


def _delete_later(folder: Path) -> None:
    """Delete ``folder`` in a background thread; the interpreter waits for it at exit."""
    for done in [path for path, thread in _deleting.items() if not thread.is_alive()]:
        del _deleting[done]
    thread = threading.Thread(
        target=_remove_entry, args=(folder,), name="comm-checkpoint-delete", daemon=True
    )
    thread.start()
    _deleting[folder] = thread


@atexit.register
def _wait_for_deletions() -> None:
    """Let the background deletions finish at exit, for at most a minute in all (a stuck
    filesystem must not hold the process; what is left, like a killed process's hidden
    ``.NAME.old-*`` folder, is removed by the next save under that name)."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    for thread in list(_deleting.values()):
        thread.join(max(0.0, deadline - time.monotonic()))


def _fsync_dir(folder: Path) -> None:
    if fsync_enabled():
        with contextlib.suppress(OSError):
            descriptor = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)


_LEFTOVER = re.compile(r"\..+\.(tmp|old)-[0-9a-f]{12}")  # temporary_name's, retain's names
_UNPUBLISHED = re.compile(r"\.(.+)\.tmp-[0-9a-f]{12}")  # temporary_name's, with NAME
_REPLACED = re.compile(r"\.(.+)\.old-[0-9a-f]{12}")  # finish's and retain's, with NAME
_swept: set[Path] = set()  # the folders whose leftovers this process has removed


def _remove_stale(final: Path) -> None:
    """Remove the temporary folders that earlier, killed saves of ``final`` left behind,
    and replaced copies whose background deletion a killed process did not finish.

    The first save of a process in a folder removes those of every name: a job restarted
    after a kill (during a save, or during ``keep_last``'s removal of an old checkpoint)
    may never save under the dead process's names again. This process has no save in
    flight then, so every hidden temporary or replaced folder there is a dead one.
    """
    parent = final.parent
    with os.scandir(parent) as entries:  # one listing for both kinds
        names = [entry.name for entry in entries if entry.name.startswith(".")]
    if parent in _swept:
        prefixes: tuple[str, ...] = (f".{final.name}.tmp-", f".{final.name}.old-")
        found = [parent / name for name in names if name.startswith(prefixes)]
    else:
        _swept.add(parent)
        # a save killed between its two renames: its finished folder is the checkpoint
        for unpublished in newest_first(parent, whole=True, unpublished=True):
            if unpublished.name.startswith(".") and not (parent / _name_of(unpublished)).exists():
                os.replace(unpublished, parent / _name_of(unpublished))
        names = [name for name in names if (parent / name).exists()]
        found = [parent / name for name in names if _LEFTOVER.fullmatch(name)]
    for stale in found:
        thread = _deleting.get(stale)
        if thread is None or not thread.is_alive():  # not being deleted already
            _remove_entry(stale)


def _name_of(unpublished: Path) -> str:
    match = _UNPUBLISHED.fullmatch(unpublished.name)
    return match.group(1) if match else unpublished.name


def _remove_entry(path: Path) -> None:
    """Remove a replaced checkpoint: a folder with what it holds, a symbolic link itself
    (never what it points to); errors are ignored, a later save of the name tries again."""
    with contextlib.suppress(OSError):
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)
