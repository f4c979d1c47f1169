"""The converter's DeepSpeed target: DeepSpeed's universal layout written under a folder."""

from __future__ import annotations

from pathlib import Path

from . import _deepspeed_offline as ds_offline
from . import _publish
from ._convert_destination import _begin
from ._convert_progress import Progress, _nbytes
from ._convert_source import Source
from ._errors import CheckpointError
from ._files import save_tensor_file


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
