"""save_checkpoint and load_checkpoint under odd folder names on 2 real gloo ranks."""

from __future__ import annotations

from typing import Any

from . import ckpt_cases as cases


def test_odd_names_save_and_load(comm_run_distributed: Any, tmp_path: Any) -> None:
    results = comm_run_distributed(cases.save_and_load_odd_names, str(tmp_path), timeout=120)
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
