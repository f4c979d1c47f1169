"""How a sharded (DCP) save shares its outcome, on 2 real gloo ranks.

Every save follows one commit protocol, with or without ``timeout=``: the entry, every
rank's write (DCP's own collectives raise a failure to write a shard on every rank) and
small files, then the commit: the ranks' outcomes shared, rank 0 publishing (manifest,
rename) when none failed, and its outcome shared. Every failure must raise on every rank,
naming the rank, and leave neither the checkpoint nor its temporary folder; the world
must stay in step for the next save.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

import comm_collectives as dist
from comm_strategies.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from tests.helpers import caught, full_params
from tests.strategies.ckpt_models import build, train_steps


def _listed(root: str) -> list[str]:
    """What ``root`` holds once every rank's call returned, before any rank goes on."""
    dist.barrier()
    listed = sorted(os.listdir(root))
    dist.barrier()
    return listed


def publish_fails_on_rank_0(root: str, timeout: float | None) -> dict[str, Any]:
    """Rank 0 cannot publish (its manifest write fails) after every rank wrote its shards."""
    from comm_strategies.checkpoint import _manifest

    model, optim = build("fsdp2")
    train_steps(model, optim, range(1))
    publish = _manifest.write_json
    if dist.get_rank() == 0:

        def broken(*args: Any, **kwargs: Any) -> None:
            raise OSError("disk full")

        _manifest.write_json = broken
    try:
        out: dict[str, Any] = {
            "error": caught(
                save_checkpoint,
                f"{root}/ck",
                model=model,
                optim_wrapper=optim,
                strategy="fsdp2",
                timeout=timeout,
            )
        }
    finally:
        _manifest.write_json = publish
    out["left"] = _listed(root)
    good = save_checkpoint(f"{root}/good", model=model, optim_wrapper=optim, strategy="fsdp2")
    load_checkpoint(good, model=model, optim_wrapper=optim)
    out["files"] = sorted(read_manifest(good).files)
    return out


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["default", "timeout"])
def test_a_failed_publish_raises_on_every_rank_and_leaves_nothing(
    comm_pools: Any, tmp_path: Path, timeout: float | None
) -> None:
    first, second = comm_pools.get(2).run(
        publish_fails_on_rank_0, str(tmp_path), timeout, timeout=120
    )
    name, message = first["error"]
    assert name == "CheckpointError", message
    assert message.startswith(f"cannot publish {tmp_path / 'ck'}: OSError: disk full"), message
    name, message = second["error"]
    assert name == "CheckpointError", message
    assert "failed on 1 rank(s): rank 0: CheckpointError: cannot publish" in message, message
    assert "disk full" in message, message
    for result in (first, second):
        assert result["left"] == [], result["left"]  # no checkpoint, no temporary folder
        assert "rng/rank_0.json" in result["files"]
        assert "rng/rank_1.json" in result["files"]
        assert "dcp/.metadata" in result["files"]


def small_file_fails_on_rank_1(root: str) -> dict[str, Any]:
    """Rank 1 cannot take its RNG state: every rank raises at the commit; nothing is left."""
    from comm_strategies.checkpoint import _files

    model, optim = build("fsdp2")
    train_steps(model, optim, range(1))
    capture = _files.capture_rng
    if dist.get_rank() == 1:

        def broken() -> dict[str, Any]:
            raise RuntimeError("generator state unavailable")

        _files.capture_rng = broken
    start = time.monotonic()
    try:
        out: dict[str, Any] = {
            "error": caught(
                save_checkpoint,
                f"{root}/ck",
                model=model,
                optim_wrapper=optim,
                strategy="fsdp2",
                timeout=60,
            )
        }
    finally:
        _files.capture_rng = capture
    out["took"] = time.monotonic() - start
    out["left"] = _listed(root)
    save_checkpoint(f"{root}/good", model=model, optim_wrapper=optim, strategy="fsdp2")
    return out


def test_a_small_file_failing_on_one_rank_raises_on_every_rank(
    comm_pools: Any, tmp_path: Path
) -> None:
    for result in comm_pools.get(2).run(small_file_fails_on_rank_1, str(tmp_path), timeout=120):
        name, message = result["error"]
        assert name == "CheckpointError", message
        assert "rank 1" in message, message
        assert "generator state unavailable" in message, message
        assert result["took"] < 10.0, result["took"]  # at the exchange, not the timeout
        assert result["left"] == [], result["left"]


def shard_write_fails_on_rank_1(root: str) -> dict[str, Any]:
    """Rank 1 cannot write its DCP shard: DCP raises on every rank; nothing is left."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    model, optim = build("fsdp2")
    train_steps(model, optim, range(1))
    write_data = _FileSystemWriter.write_data
    if dist.get_rank() == 1:

        def broken(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError("no space left on device")

        _FileSystemWriter.write_data = broken  # type: ignore[method-assign]
    try:
        out: dict[str, Any] = {
            "error": caught(
                save_checkpoint,
                f"{root}/ck",
                model=model,
                optim_wrapper=optim,
                strategy="fsdp2",
            )
        }
    finally:
        _FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    out["left"] = _listed(root)
    return out


def test_a_shard_that_cannot_be_written_fails_every_rank_and_leaves_nothing(
    comm_pools: Any, tmp_path: Path
) -> None:
    for result in comm_pools.get(2).run(shard_write_fails_on_rank_1, str(tmp_path), timeout=120):
        name, message = result["error"]
        assert name == "CheckpointError", message
        assert "torch distributed checkpoint could not write" in message, message
        assert "no space left on device" in message, message
        assert "RANK 1" in message, message  # DCP names the rank
        assert result["left"] == [], result["left"]


def stages_of_a_dcp_save(root: str) -> dict[str, Any]:
    """The steps a save reached, in order; the manifest only once every rank wrote."""
    from tests.strategies.ckpt_seams import recording

    model, optim = build("fsdp2")
    train_steps(model, optim, range(1))
    stages: list[str] = []
    with recording(stages):
        path = save_checkpoint(f"{root}/ck", model=model, optim_wrapper=optim, strategy="fsdp2")
    fresh, fresh_optim = build("fsdp2")
    load_checkpoint(path, model=fresh, optim_wrapper=fresh_optim)
    same = {k: v.tolist() for k, v in full_params(fresh).items()} == {
        k: v.tolist() for k, v in full_params(model).items()
    }
    return {"stages": stages, "same": same}


def test_a_dcp_save_publishes_after_every_rank_wrote(comm_pools: Any, tmp_path: Path) -> None:
    first, second = comm_pools.get(2).run(stages_of_a_dcp_save, str(tmp_path), timeout=120)
    assert first["stages"] == ["entered", "written", "manifest"]
    assert second["stages"] == ["entered", "written"]
    assert first["same"]
    assert second["same"]


def failures_beside_the_files(root: str) -> dict[str, Any]:
    """Rank 0 fails while describing the full state it writes (outside any file write),
    then rank 1 fails reading the model file of a load: each call must raise a
    CheckpointError on both ranks, naming the rank, leave nothing behind, and the calls
    after it must work."""
    from comm_strategies.checkpoint import _formats

    model, optim = build("ddp")
    train_steps(model, optim, range(1))
    out: dict[str, Any] = {}
    describe = _formats.describe_params
    if dist.get_rank() == 0:

        def broken(state: Any) -> Any:
            raise RuntimeError("out of memory (injected on rank 0)")

        _formats.describe_params = broken
    try:
        out["save"] = caught(
            save_checkpoint, f"{root}/ck", model=model, optim_wrapper=optim, strategy="ddp"
        )
    finally:
        _formats.describe_params = describe
    out["left"] = _listed(root)
    good = save_checkpoint(f"{root}/good", model=model, optim_wrapper=optim, strategy="ddp")
    read = _formats.load_tensor_file
    if dist.get_rank() == 1:

        def unreadable(*args: Any, **kwargs: Any) -> Any:
            raise OSError("input/output error (injected on rank 1)")

        _formats.load_tensor_file = unreadable
    try:
        out["load"] = caught(load_checkpoint, good, model=model, optim_wrapper=optim)
    finally:
        _formats.load_tensor_file = read
    out["after"] = caught(load_checkpoint, good, model=model, optim_wrapper=optim)
    return out


def test_a_failure_beside_the_file_writes_and_a_failed_read_raise_on_every_rank(
    comm_pools: Any, tmp_path: Path
) -> None:
    for rank, result in enumerate(
        comm_pools.get(2).run(failures_beside_the_files, str(tmp_path), timeout=120)
    ):
        name, message = result["save"]
        assert name == "CheckpointError", message
        assert "out of memory (injected on rank 0)" in message, message
        assert "rank 0" in message, message
        assert result["left"] == [], result["left"]
        name, message = result["load"]
        assert name == "CheckpointError", message
        assert "input/output error (injected on rank 1)" in message, message
        if rank == 0:
            assert message.startswith("load_checkpoint failed on 1 rank(s): rank 1:"), message
        assert result["after"] == ("", ""), result["after"]
