"""Async save and retention on 2 real gloo ranks, and auto-resume under a strategy.

The rank bodies stand above the tests that assert on their results. An async save is held
in its background thread (`ckpt_seams`, step ``"writing"``) until the training thread has
changed the model, so a checkpoint
that equals the state at the call proves the copy was taken at the call. Expected values
come from the model itself (``full_params``) and from training the same steps, never from
the code under test.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_strategies import build_strategy
from comm_strategies.checkpoint import (
    CheckpointError,
    SaveHandle,
    _async,
    _publish,
    find_latest,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from tests.helpers import full_params, max_diff
from tests.strategies.ckpt_models import build, strategy_of, train_step, train_steps
from tests.strategies.ckpt_seams import patch_step

HOLD_S = 30.0  # the longest a held background save waits for the test to release it


_undo: list[Any] = []


def _hold_until(released: threading.Event) -> None:
    def hold() -> None:
        if not released.wait(HOLD_S):
            message = "the test never released the async save"
            raise RuntimeError(message)

    _undo.append(patch_step("writing", hold))


def _unhook() -> None:
    while _undo:
        _undo.pop()()


# ------------------------------------------------- the copy, the handle, the load


def async_save_is_the_state_at_the_call(root: str, kind: str) -> dict[str, Any]:
    """Save asynchronously after 2 steps, train step 2 while the save is held, then load."""
    model, optim = build(kind)
    train_steps(model, optim, range(2))
    at_call = full_params(model)
    released = threading.Event()
    _hold_until(released)
    try:
        handle = save_checkpoint(
            f"{root}/{kind}", model=model, optim_wrapper=optim, strategy=strategy_of(kind),
            extra={"step": 2}, async_save=True,
        )  # fmt: skip
        running = not handle.done()
        train_step(model, optim, 2)  # changes the parameters and moments in place
        after_step = full_params(model)
        released.set()
        path = handle.wait(timeout=60)
    finally:
        _unhook()
    fresh, fresh_optim = build(kind, seed=1)
    extra = load_checkpoint(path, model=fresh, optim_wrapper=fresh_optim)
    loaded = full_params(fresh)
    train_step(fresh, fresh_optim, 2)  # the saved moments give the same step 2
    return {
        "type": type(handle).__name__,
        "running_after_return": running,
        "done": handle.done(),
        "path": str(path),
        "extra": extra,
        "format": read_manifest(path).format,
        "moved_by_step": max_diff(after_step, at_call),
        "loaded_vs_call": max_diff(loaded, at_call),
        "step_after_load": max_diff(full_params(fresh), after_step),
    }


@pytest.mark.parametrize(("kind", "fmt"), [("ddp", "full"), ("fsdp2", "dcp"), ("fsdp", "dcp")])
def test_async_save_writes_the_state_at_the_call_and_loads_it(
    comm_pools: Any, tmp_path: Path, kind: str, fmt: str
) -> None:
    results = comm_pools.get(2).run(
        async_save_is_the_state_at_the_call, str(tmp_path), kind, timeout=120
    )
    for result in results:
        assert result["type"] == "SaveHandle"
        assert result["running_after_return"]  # the call returned before the files
        assert result["done"]
        assert result["path"] == str(tmp_path / kind)
        assert result["extra"] == {"step": 2}
        assert result["format"] == fmt
        assert result["moved_by_step"] > 1e-4  # the step after the call changed the model
        assert result["loaded_vs_call"] == 0.0  # yet the checkpoint holds the call's state
        assert result["step_after_load"] == 0.0  # optimizer state of the call too
    assert sorted(p.name for p in tmp_path.iterdir()) == [kind]  # no temporary folder left


# ------------------------------------- a second save waits; failures reach every rank


def second_save_waits_for_the_first(root: str) -> dict[str, Any]:
    model, optim = build("ddp")
    train_steps(model, optim, range(1))
    released = threading.Event()
    _hold_until(released)
    try:
        first = save_checkpoint(
            f"{root}/first", model=model, optim_wrapper=optim, strategy="ddp", async_save=True
        )
        _unhook()  # the second save is not held
        timer = threading.Timer(1.0, released.set)
        timer.start()
        started = time.monotonic()
        second = save_checkpoint(f"{root}/second", model=model, strategy="ddp")  # synchronous
        waited = time.monotonic() - started
        first_done_when_second_returned = first.done()
        timer.join()
    finally:
        _unhook()
    return {
        "waited": waited,
        "first_done": first_done_when_second_returned,
        "first": str(first.wait(timeout=60)),
        "second": str(second),
        "order": read_manifest(first.path).saved_at < read_manifest(second).saved_at,
    }


def test_a_second_save_waits_for_the_async_one(comm_pools: Any, tmp_path: Path) -> None:
    for result in comm_pools.get(2).run(
        second_save_waits_for_the_first, str(tmp_path), timeout=120
    ):
        assert result["waited"] >= 0.9  # held until the timer released the first save
        assert result["first_done"]
        assert result["first"] == str(tmp_path / "first")
        assert result["second"] == str(tmp_path / "second")
        assert result["order"]  # the first was published before the second


class _BrokenScheduler:
    def state_dict(self) -> dict[str, Any]:
        message = "this scheduler cannot be saved"
        raise RuntimeError(message)


def async_failure_on_one_rank(root: str, where: str) -> dict[str, Any]:
    """Fail the save on one rank: rank 1's background writes through the test hook, rank
    0's with user state that torch.save cannot pickle (a local lambda, written by rank 0),
    or rank 0's copy at the call (a scheduler whose state_dict raises)."""
    model, optim = build("ddp")
    train_steps(model, optim, range(1))
    me = dist.get_rank()
    extra: dict[str, Any] = {"step": 1}
    schedulers: list[Any] = []
    if where == "copy" and me == 0:
        schedulers.append(_BrokenScheduler())
    if where == "rank 1" and me == 1:

        def fail(value: Any, path: Path) -> None:
            message = "disk full (injected on rank 1)"
            raise OSError(message)

        monkeypatched = _async.save_file
        _async.save_file = fail  # type: ignore[assignment]
        _undo.append(lambda: setattr(_async, "save_file", monkeypatched))
    if where == "rank 0":
        extra["callback"] = lambda: None
    try:
        handle = save_checkpoint(
            f"{root}/broken", model=model, optim_wrapper=optim, strategy="ddp", extra=extra,
            schedulers=schedulers, async_save=True,
        )  # fmt: skip
        try:
            handle.wait(timeout=60)
        except CheckpointError as error:
            message = str(error)
        else:
            message = "no error"
        # the same error on every wait(), and the next save works
        again = ""
        try:
            handle.wait(timeout=1)
        except CheckpointError as error:
            again = str(error)
    finally:
        _unhook()
    after = save_checkpoint(f"{root}/after", model=model, strategy="ddp", async_save=True)
    return {"message": message, "again": again, "after": str(after.wait(timeout=60))}


@pytest.mark.parametrize(
    ("where", "failed", "cause"),
    [
        ("rank 1", "rank 1", "disk full (injected on rank 1)"),
        ("rank 0", "rank 0", "pickle"),
        ("copy", "rank 0", "this scheduler cannot be saved"),
    ],
)
def test_an_async_save_failing_on_one_rank_raises_on_every_rank_at_wait(
    comm_pools: Any, tmp_path: Path, where: str, failed: str, cause: str
) -> None:
    results = comm_pools.get(2).run(async_failure_on_one_rank, str(tmp_path), where, timeout=120)
    for result in results:
        assert failed in result["message"], result["message"]
        assert cause in result["message"].lower() or cause in result["message"], result
        assert result["again"] == result["message"]
        assert result["after"] == str(tmp_path / "after")
    assert not (tmp_path / "broken").exists()  # nothing published, temporary folder removed
    _publish._wait_for_deletions()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["after"]


# ------------------------------------------------------------------- retention


def save_with_keep_last(root: str) -> list[str]:
    """Four saves with keep_last=2, synchronous and async in turn; the last one held until
    the test looked: what it removes goes only after it is published."""
    model, optim = build("ddp")
    seen_while_held: list[str] = []
    for step in range(1, 5):
        train_step(model, optim, step)
        released = threading.Event()
        if step == 4:
            _hold_until(released)
        try:
            saved = save_checkpoint(
                f"{root}/step_{step}", model=model, optim_wrapper=optim, strategy="ddp",
                extra={"step": step}, keep_last=2, async_save=step % 2 == 0,
            )  # fmt: skip
            if step == 4:
                dist.barrier()
                seen_while_held = sorted(p.name for p in Path(root).iterdir() if p.name[0] != ".")
                released.set()
            if isinstance(saved, SaveHandle):
                saved.wait(timeout=60)
        finally:
            _unhook()
    _publish._wait_for_deletions()  # rank 0 deletes the removed folders in the background
    return seen_while_held


def test_keep_last_removes_only_older_complete_checkpoints(comm_pools: Any, tmp_path: Path) -> None:
    root = tmp_path / "work"
    root.mkdir()
    (root / "logs").mkdir()
    (root / "logs" / "train.log").write_text("step 1\n")
    foreign = root / "webapp"  # another program's manifest.json: never ours to remove
    foreign.mkdir()
    (foreign / "manifest.json").write_text(json.dumps({"name": "app", "saved_at": 0}))
    (root / "step_9").mkdir()  # an incomplete folder with a newer name
    (root / "step_9" / "model.pt").write_bytes(b"partial")
    (root / "notes.txt").write_text("keep me\n")
    seen = comm_pools.get(2).run(save_with_keep_last, str(root), timeout=180)
    for names in seen:  # while step_4 was held: step_2 and step_3 still there
        assert names == ["logs", "notes.txt", "step_2", "step_3", "step_9", "webapp"], names
    assert sorted(p.name for p in root.iterdir()) == [
        "logs", "notes.txt", "step_3", "step_4", "step_9", "webapp",
    ]  # fmt: skip
    assert (root / "logs" / "train.log").read_text() == "step 1\n"
    assert find_latest(root) == root / "step_4"


def test_keep_last_must_be_a_positive_int(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        save_checkpoint(tmp_path / "a", model=model, strategy="single", keep_last=0)
    with pytest.raises(TypeError, match="keep_last must be an int or None"):
        save_checkpoint(tmp_path / "a", model=model, strategy="single", keep_last=True)
    assert list(tmp_path.iterdir()) == []


def test_strategy_keep_last_and_resume_takes_the_latest_complete_one(tmp_path: Path) -> None:
    # In this process (world 1): the strategy's keep_last, an async save beside its saves,
    # and resume() with no path skipping a newer folder whose save never finished.
    strategy = build_strategy("single", work_dir=tmp_path, seed=0, keep_last=2)
    model, optim, _ = strategy.prepare(
        torch.nn.Linear(2, 1), optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.1}}
    )
    weights = {}
    for step in range(1, 5):
        optim.update_params(model(torch.full((1, 2), float(step))).sum())
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
        if step == 3:  # asynchronously, into work_dir
            handle = strategy.save_checkpoint_async("step_3", extra={"step": 3})
            assert isinstance(handle, SaveHandle)
        else:  # waits for step_3's save first
            strategy.save_checkpoint(f"step_{step}", extra={"step": step})
    assert handle.wait(timeout=60) == tmp_path / "step_3"
    (tmp_path / "step_7").mkdir()  # newer, incomplete (no manifest): never resumed from
    (tmp_path / ".step_8.tmp-0123456789ab").mkdir()
    _publish._wait_for_deletions()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name[0] != ".") == [
        "step_3", "step_4", "step_7",
    ]  # fmt: skip
    other = build_strategy("single", work_dir=tmp_path, seed=1)
    other_model, _, _ = other.prepare(
        torch.nn.Linear(2, 1), optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.1}}
    )
    assert other.resume() == {"step": 4}
    for name, value in other_model.state_dict().items():
        assert torch.equal(value, weights[4][name]), name
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        build_strategy("single", keep_last=0)
    with pytest.raises(TypeError, match="keep_last must be an int"):
        build_strategy("single", keep_last="2")


# ------------------------------------------------------------ DeepSpeed's own files


def deepspeed_async_is_done_at_return(root: str) -> tuple[bool, str, str]:
    model, optim = build("zero1")
    train_steps(model, optim, range(1))
    handle = save_checkpoint(
        f"{root}/ds", model=model, optim_wrapper=optim, strategy="deepspeed", async_save=True
    )
    done = handle.done()
    return done, str(handle.wait(timeout=1)), read_manifest(handle.path).format


def test_deepspeed_files_are_written_before_an_async_save_returns(
    comm_pools: Any, tmp_path: Path
) -> None:
    pytest.importorskip("deepspeed")
    for done, path, fmt in comm_pools.get(2).run(
        deepspeed_async_is_done_at_return, str(tmp_path), timeout=120
    ):
        assert done
        assert path == str(tmp_path / "ds")
        assert fmt == "deepspeed"


# ------------------------------------------------------- the handle in one process


def test_wait_with_a_timeout_and_an_unobserved_failure(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    released = threading.Event()
    _hold_until(released)
    try:
        handle = save_checkpoint(tmp_path / "held", model=model, strategy="single", async_save=True)
        with pytest.raises(TimeoutError, match=r"still running after 0\.1 s"):
            handle.wait(timeout=0.1)
        assert not handle.done()
        assert not (tmp_path / "held").exists()  # published only once written
        released.set()
        assert handle.wait(timeout=60) == tmp_path / "held"
    finally:
        _unhook()
    # A failed async save whose wait() nobody called: the next save warns, then saves.
    failed = save_checkpoint(
        tmp_path / "bad", model=model, strategy="single", extra={"f": lambda: None},
        async_save=True,
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"previous async save .*bad.* failed") as warned:
        assert save_checkpoint(tmp_path / "next", model=model, strategy="single").name == "next"
    assert [Path(w.filename).name for w in warned] == [Path(__file__).name]  # the caller's line
    with pytest.raises(CheckpointError, match="user state"):
        failed.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held", "next"]


def test_resume_takes_the_async_save_still_committing(tmp_path: Path) -> None:
    """resume() with no path waits for this process's async save before it looks for the
    latest checkpoint: with keep_last=1, the one it would have found is gone by then."""
    strategy = build_strategy("single", work_dir=tmp_path, seed=0, keep_last=1)
    strategy.prepare(torch.nn.Linear(2, 1), optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.1}})
    strategy.save_checkpoint("step_1", extra={"step": 1})
    released = threading.Event()
    _hold_until(released)
    try:
        handle = strategy.save_checkpoint_async("step_2", extra={"step": 2})
        threading.Timer(0.5, released.set).start()  # published while resume() waits
        assert strategy.resume() == {"step": 2}
    finally:
        released.set()
        _unhook()
    assert handle.wait(timeout=60) == tmp_path / "step_2"


def test_a_call_on_the_pending_saves_own_thread_does_not_wait_for_itself(tmp_path: Path) -> None:
    from comm_strategies.checkpoint import _consensus

    handle = SaveHandle(tmp_path / "pending")  # ends only when the test ends it
    returned = threading.Event()

    def the_saves_thread() -> None:
        _consensus.in_background(handle, threading.current_thread())
        _consensus.wait_previous()  # must return at once on the save's own thread
        returned.set()

    thread = threading.Thread(target=the_saves_thread, daemon=True)
    thread.start()
    try:
        assert returned.wait(timeout=10), "wait_previous waited for its own thread"
        assert not handle.done()
    finally:
        handle._end(None)  # a thread stuck in the wait ends too
        thread.join(timeout=10)
        _consensus._background = None
