"""MMEngine's auto resume after a restart: ``work_dir/last_checkpoint`` kept honest.

MMEngine's runners resume "the latest checkpoint" (``resume=True``) from the path that
``work_dir/last_checkpoint`` names (``find_latest_checkpoint``). ``CheckpointHook`` writes
that file after each save, on rank 0, in place, and removes the checkpoints beyond
``max_keep_ckpts`` before the next save. A kill can therefore leave it

- missing: the first save finished, the file was not written yet;
- older than the latest checkpoint: the kill came between the save and the file's update;
- naming a checkpoint that is gone or half gone: retention (``max_keep_ckpts=1``) removed
  it, or was killed while removing it, and the next save never finished;
- empty: the kill came while the file itself was written.

`repair_pointer` looks at the checkpoints themselves and makes the file name the newest
complete one (or removes it when there is none, so that the run starts from scratch):
a comm checkpoint folder counts when its manifest is there and every file the manifest
lists is whole; an MMEngine ``.pth`` file when it is a whole zip archive (``torch.save``'s
format, whose directory is written last). Hidden names (temporary and replaced folders)
never count. It runs on rank 0 before the runner reads the file; nothing of MMEngine is
changed. For the classic ``Runner`` (`CommRunnerHook`), `repair_auto_resume` does it at
``before_run`` and `write_whole_files` makes rank 0's checkpoint files appear whole or
not at all. No MMEngine import here (the runner is duck-typed).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import uuid
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import comm_collectives as dist

from ..checkpoint import CheckpointError, read_manifest
from ..checkpoint._publish import is_whole

__all__ = [
    "POINTER",
    "complete_since",
    "latest_complete",
    "repair_auto_resume",
    "repair_pointer",
    "template_pattern",
    "write_whole_files",
]

POINTER = "last_checkpoint"


def template_pattern(filename_tmpl: str) -> re.Pattern[str]:
    """The names ``CheckpointHook``'s ``filename_tmpl`` (``"iter_{}.pth"``) gives."""
    head, _, tail = filename_tmpl.partition("{}")
    return re.compile(re.escape(head) + r"\d+" + re.escape(tail))


def complete_since(path: Path) -> float | None:
    """When the checkpoint at ``path`` was completed, or None when it is not whole.

    A comm checkpoint folder: its manifest's ``saved_at``, once every file the manifest
    lists is there with its size. A file: its modification time, once it is a whole zip
    archive (``torch.save``). Hidden names never count.
    """
    if path.name.startswith("."):
        return None
    try:
        if path.is_dir():
            manifest = read_manifest(path)
            if "comm-strategies" not in manifest.versions:
                return None
            return float(manifest.saved_at) if is_whole(path, manifest.files) else None
        if path.is_file() and zipfile.is_zipfile(path):
            return path.stat().st_mtime
    except (CheckpointError, OSError):
        return None
    return None


def latest_complete(
    folders: Iterable[Path], *, names: re.Pattern[str] | None = None
) -> Path | None:
    """The newest whole checkpoint in ``folders``: comm folders, or files matching ``names``.

    Args:
        folders: Where to look (not recursively).
        names: With a pattern, the files whose whole name matches it are the candidates
            (MMEngine's ``.pth`` checkpoints); without, the comm checkpoint folders.
    """
    best: tuple[float, str] | None = None
    found: Path | None = None
    for folder in dict.fromkeys(folders):
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.is_symlink():
                continue
            if names is None and not entry.is_dir():
                continue
            if names is not None and not (entry.is_file() and names.fullmatch(entry.name)):
                continue
            since = complete_since(entry)
            if since is not None and (best is None or (since, entry.name) > best):
                best, found = (since, entry.name), entry
    return found


def repair_pointer(
    work_dir: str | os.PathLike[str],
    *,
    folders: Iterable[str | os.PathLike[str]] = (),
    names: re.Pattern[str] | None = None,
) -> Path | None:
    """Make ``work_dir/last_checkpoint`` name the newest whole checkpoint; return it.

    Call it on one rank (rank 0) before the runner reads the file, then let the others
    wait (a barrier). The checkpoints are looked for in ``work_dir``, in ``folders`` and in
    the folder of the checkpoint the file names now. The file is replaced atomically, and
    only when it is wrong; it is removed when no whole checkpoint exists (the runner then
    starts from scratch). A file naming another storage (``s3://...``) is left alone.

    Args:
        work_dir: The runner's work folder, which holds ``last_checkpoint``.
        folders: Other folders holding checkpoints (``CheckpointHook``'s ``out_dir``).
        names: See `latest_complete`.

    Returns:
        The checkpoint the file names afterwards, or None.
    """
    work = Path(work_dir)
    pointer = work / POINTER
    try:
        named = pointer.read_text().strip() if pointer.is_file() else ""
    except OSError:
        named = ""
    if "://" in named:
        return None
    current = Path(named) if named else None
    search = [work, *(Path(folder) for folder in folders)]
    if current is not None:
        search.append(current.parent)
    newest = latest_complete(search, names=names)
    named_since = None if current is None else complete_since(current)
    if current is not None and named_since is not None:
        newest_since = None if newest is None else complete_since(newest)
        if (
            newest is None
            or newest_since is None
            or (newest_since, newest.name)
            <= (
                named_since,
                current.name,
            )
        ):
            return current  # whole, and nothing newer: left as it is
    if newest is None:
        if pointer.is_file():
            pointer.unlink()
        return None
    target = Path(os.path.abspath(newest))
    temporary = work / f".{POINTER}.tmp-{uuid.uuid4().hex[:12]}"
    temporary.write_text(str(target))
    os.replace(temporary, pointer)
    return target


def write_whole_files(runner: Any) -> None:
    """Make rank 0's ``save_checkpoint`` write a hidden temporary file and rename it.

    MMEngine writes the checkpoint file in place: a kill during the write leaves a
    truncated file under the checkpoint's name. With this, the name holds a whole file or
    none; what a killed save left (``.NAME.tmp-XXXX``) is removed by the next save of that
    name. Local folders only (no ``backend_args`` / ``file_client_args``).
    """
    if getattr(runner, "_comm_saves_whole", False):
        return
    original = runner.save_checkpoint
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        out_dir, filename = str(given["out_dir"]), str(given["filename"])
        local = given.get("file_client_args") is None and given.get("backend_args") is None
        if runner.rank != 0 or not local or "://" in out_dir:
            return original(*args, **kwargs)
        final = Path(out_dir) / filename
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            stale.unlink(missing_ok=True)
        temporary = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
        given["filename"] = temporary.name
        try:
            result = original(*bound.args, **bound.kwargs)
            os.replace(temporary, final)
        finally:
            temporary.unlink(missing_ok=True)
        return result

    # On this runner object only: MMEngine's class is not changed.
    runner.save_checkpoint = save_checkpoint
    runner._comm_saves_whole = True


def repair_auto_resume(runner: Any) -> None:
    """Before an auto resume, make ``work_dir/last_checkpoint`` name the newest whole file.

    See `repair_pointer`: a kill can leave the file missing, stale, or older than the
    newest checkpoint. Rank 0 corrects it; every rank then reads it in ``load_or_resume``.
    """
    if not getattr(runner, "_resume", False) or getattr(runner, "_load_from", None) is not None:
        return
    if getattr(runner, "_has_loaded", False):
        return
    folders: list[str] = []
    patterns: list[str] = []
    for hook in getattr(runner, "hooks", []):
        if not any(cls.__name__ == "CheckpointHook" for cls in type(hook).__mro__):
            continue  # MMEngine's CheckpointHook and its subclasses
        patterns.append(template_pattern(hook.filename_tmpl).pattern)
        out_dir = hook.out_dir
        if isinstance(out_dir, str) and "://" not in out_dir:
            base = os.path.basename(str(runner.work_dir).rstrip(os.sep))
            folders += [out_dir, os.path.join(out_dir, base)]
    names = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None
    if names is None:
        names = re.compile(r"[^.].*\.pth")
    if runner.rank == 0:
        repair_pointer(runner.work_dir, folders=folders, names=names)
    if runner.world_size > 1:
        dist.barrier()
