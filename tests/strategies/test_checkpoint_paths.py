"""save_checkpoint and load_checkpoint under odd folder names on 2 real gloo ranks."""

from __future__ import annotations

import os
from typing import Any

import torch

from comm_strategies.checkpoint import load_checkpoint, save_checkpoint


def save_and_load_odd_names(root: str) -> dict[str, Any]:
    """Save and load under names holding a bar, quotes, a newline, non-ASCII letters and a
    byte that is not UTF-8 (a name read from the filesystem with os.fsdecode)."""
    model = torch.nn.Linear(2, 1)
    out: dict[str, Any] = {}
    for name in ("a|b", "q\"u'o", "new\nline", "ünï€", os.fsdecode(b"x\xff")):
        try:
            path = save_checkpoint(
                os.path.join(root, name), model=model, strategy="ddp", extra={"n": name}
            )
            loaded = load_checkpoint(path, model=torch.nn.Linear(2, 1))
            out[repr(name)] = loaded["n"] == name
        except Exception as error:  # the case reports any outcome
            out[repr(name)] = f"{type(error).__name__}: {error}"
    return out


def test_odd_names_save_and_load(comm_run_distributed: Any, tmp_path: Any) -> None:
    results = comm_run_distributed(save_and_load_odd_names, str(tmp_path), timeout=120)
    strange = "'x\\udcff'"
    for out in results:
        assert out == {"'a|b'": True, "'q\"u\\'o'": True, "'new\\nline'": True,
                       "'ünï€'": True, strange: out[strange]}  # fmt: skip
        # a name that is not UTF-8 (os.fsdecode's surrogate) once failed load_checkpoint's
        # entry exchange with a bare UnicodeEncodeError; torch's memory-mapped load still
        # cannot open such a path, which is now a CheckpointError on every rank
        assert out[strange].startswith("CheckpointError: model state"), out[strange]
        assert "surrogates not allowed" in out[strange]
    assert results[0][strange] == results[1][strange]
