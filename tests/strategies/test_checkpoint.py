"""The checkpoint contract on 2 real gloo ranks: every save x load pair, resume, errors.

Each rank body (a module-level function that ``comm_pools.get(N).run`` runs on every rank)
stands just above the test that asserts on its results. The worlds are shared: one
module-scoped run saves a checkpoint under every wrapper kind (plus plain .pth files and
DeepSpeed's own folders), then each test loads from that set. Models are built by
tests/strategies/ckpt_models.py and compared with ``full_params``, independent of the code
under test (it gathers FSDP shards; DeepSpeed's ``GatheredParameters`` gathers ZeRO-3).
Set ``COMM_CKPT_MATRIX_OUT`` to a file path to get the measured matrix as markdown.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import time
import warnings
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import comm_collectives as dist
from comm_strategies.checkpoint import (
    CheckpointError,
    _publish,
    convert_checkpoint,
    full_model_state_dict,
    full_optim_state_dict,
    load_checkpoint,
    load_full_model_state_dict,
    load_full_optim_state_dict,
    read_manifest,
    save_checkpoint,
)
from comm_wrappers import MMDistributedDataParallel, MMFullyShardedDataParallel2, OptimWrapper
from tests.helpers import caught, full_params, max_diff
from tests.strategies.ckpt_faults import manifest_unreadable_on
from tests.strategies.ckpt_models import (
    KINDS,
    build,
    expected_of,
    keep_expected,
    strategy_of,
    torch_optimizer,
    train_step,
    train_steps,
)
from tests.wrappers.net import Net

EXACT = 1e-6
PLAIN = ["bare.pth", "mmengine.pth"]
NATIVE = ["ds_0", "ds_1", "ds_2", "ds_3"]
# FSDP models saved as full files (sharded=False): gathered to rank 0 parameter by parameter.
FULL = ["fsdp_full", "fsdp2_full"]


# ------------------------------------------------------------------- the matrix


def save_every_kind(root: str, kinds: list[str]) -> None:
    """Train a model of each kind 2 steps and save it in its natural format.

    A kind ending in ``_full`` saves a full checkpoint (``sharded=False``) instead.
    """
    for name in kinds:
        kind = name.removesuffix("_full")
        model, optim = build(kind)
        train_steps(model, optim, range(2))
        save_checkpoint(
            f"{root}/{name}",
            model=model,
            optim_wrapper=optim,
            strategy=strategy_of(kind),
            sharded=False if name.endswith("_full") else None,
        )
        keep_expected(root, name, full_params(model))


def write_plain_files(root: str, source: str) -> None:
    """A bare state dict and MMEngine's {"state_dict": ..., "meta": ...} with module. prefixes."""
    expected = expected_of(root, source)
    keep_expected(root, "bare.pth", expected)
    keep_expected(root, "mmengine.pth", expected)
    if dist.get_rank() == 0:
        torch.save(expected, f"{root}/bare.pth")
        prefixed = {f"module.{name}": value for name, value in expected.items()}
        torch.save({"state_dict": prefixed, "meta": {"epoch": 3}}, f"{root}/mmengine.pth")
    dist.barrier()


def save_deepspeed_native(root: str) -> None:
    """DeepSpeed's own save_checkpoint folders (no manifest), ZeRO 0-3."""
    for stage in range(4):
        model, optim = build(f"zero{stage}")
        train_steps(model, optim, range(2))
        model.model.save_checkpoint(f"{root}/ds_{stage}", tag="global_step2")
        keep_expected(root, f"ds_{stage}", full_params(model))


@pytest.fixture(scope="module")
def saved(comm_pools: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with one checkpoint per kind, two plain files and DeepSpeed's folders."""
    root = str(tmp_path_factory.mktemp("saved"))
    pool = comm_pools.get(2)
    pool.run(save_every_kind, root, KINDS + FULL, timeout=300)
    pool.run(write_plain_files, root, "fsdp2", timeout=60)
    pool.run(save_deepspeed_native, root, timeout=300)
    return root


def load_every_kind(
    root: str, sources: list[str], targets: list[str]
) -> dict[str, dict[str, float]]:
    """Load each source checkpoint into a fresh model of each target kind.

    Returns ``{target: {source: max |diff|}}``; a fresh model first differs from every
    source (checked), so a load that did nothing cannot pass.
    """
    expected = {source: expected_of(root, source) for source in sources}
    out: dict[str, dict[str, float]] = {}
    for target in targets:
        model, optim = build(target, seed=123)
        before = full_params(model)
        row = {}
        for source in sources:
            assert max_diff(before, expected[source]) > 1e-2, (target, source)
            path = f"{root}/{source}"
            manifest_path = Path(path) / "manifest.json"
            # Optimizer state moves everywhere: comm's DeepSpeed checkpoints through the
            # portable copy beside DeepSpeed's files, DeepSpeed's own folders read offline.
            load_checkpoint(
                path,
                model=model,
                optim_wrapper=optim,
                load_optimizer=manifest_path.exists() or source.startswith("ds_"),
            )
            row[source] = max_diff(full_params(model), expected[source])
        out[target] = row
    return out


def _report(title: str, matrix: dict[str, dict[str, float]]) -> None:
    out = os.environ.get("COMM_CKPT_MATRIX_OUT")
    if not out:
        return
    sources = list(next(iter(matrix.values())))
    lines = [f"### {title}", "", "| load into \\ saved by | " + " | ".join(sources) + " |"]
    lines.append("|---" * (len(sources) + 1) + "|")
    for target, row in matrix.items():
        lines.append(f"| {target} | " + " | ".join(f"{row[s]:.1e}" for s in sources) + " |")
    with open(out, "a") as handle:
        handle.write("\n".join(lines) + "\n\n")


def test_every_kind_loads_every_kind_world_2(comm_pools: Any, saved: str) -> None:
    sources = KINDS + FULL + PLAIN + NATIVE
    results = comm_pools.get(2).run(load_every_kind, saved, sources, KINDS, timeout=600)
    for matrix in results:
        for target, row in matrix.items():
            for source, diff in row.items():
                assert diff <= EXACT, (source, target, diff)
    _report(
        "World 2: saved under a kind, loaded under another (max |diff| of parameters)", results[0]
    )


def test_loads_at_world_size_1(comm_pools: Any, saved: str) -> None:
    """Saved by 2 ranks, loaded by 1: full files, DCP (resharded) and DeepSpeed (consolidated)."""
    sources = KINDS + FULL + PLAIN + NATIVE
    targets = ["single", "fsdp2", "zero3"]
    [matrix] = comm_pools.get(1).run(load_every_kind, saved, sources, targets, timeout=600)
    for target, row in matrix.items():
        for source, diff in row.items():
            assert diff <= EXACT, (source, target, diff)
    _report("World 1: saved by 2 ranks, loaded by 1", matrix)


def test_loads_at_world_size_3(comm_pools: Any, saved: str) -> None:
    """Saved by 2 ranks, loaded by 3: DCP reshards unevenly (a rank holds empty shards)."""
    sources = KINDS + FULL
    targets = ["fsdp2", "zero3"]
    [matrix, *_] = comm_pools.get(3).run(load_every_kind, saved, sources, targets, timeout=600)
    for target, row in matrix.items():
        for source, diff in row.items():
            assert diff <= EXACT, (source, target, diff)
    _report("World 3: saved by 2 ranks, loaded by 3", matrix)


def test_full_save_of_fsdp_at_world_size_3(comm_pools: Any, tmp_path: Path) -> None:
    """Uneven and empty shards gathered to rank 0 (head.bias: 2 rows over 3 ranks)."""
    root = str(tmp_path)
    pool = comm_pools.get(3)
    pool.run(save_every_kind, root, FULL, timeout=300)
    [matrix, *_] = pool.run(load_every_kind, root, FULL, ["single", "fsdp2"], timeout=300)
    for target, row in matrix.items():
        for source, diff in row.items():
            assert diff <= EXACT, (source, target, diff)


def optimizer_crossing(root: str, pairs: list[tuple[str, str]]) -> dict[str, float]:
    """Resume on another kind: optimizer state crosses too; 2 more steps equal the source's."""
    out = {}
    for source, target in pairs:
        model, optim = build(source)
        train_steps(model, optim, range(2))
        path = save_checkpoint(
            f"{root}/opt_{source}_{target}",
            model=model,
            optim_wrapper=optim,
            strategy=strategy_of(source),
        )
        train_steps(model, optim, range(2, 4))
        expected = full_params(model)
        resumed, resumed_optim = build(target, seed=99)
        load_checkpoint(path, model=resumed, optim_wrapper=resumed_optim)
        train_steps(resumed, resumed_optim, range(2, 4))
        out[f"{source}->{target}"] = max_diff(full_params(resumed), expected)
    return out


def test_optimizer_state_crosses_between_torch_wrappers(comm_pools: Any, tmp_path: Path) -> None:
    pairs = [
        ("ddp", "fsdp"),
        ("fsdp", "fsdp2"),
        ("fsdp2", "ddp"),
        ("ddp", "fsdp2"),
        ("fsdp2", "zero0"),  # ZeRO-0 in fp32 steps the client torch optimizer
    ]
    for result in comm_pools.get(2).run(optimizer_crossing, str(tmp_path), pairs, timeout=300):
        for pair, diff in result.items():
            assert diff <= EXACT, (pair, diff)


# ----------------------------------------------------------------------- resume


def resume_equals_uninterrupted(root: str, kind: str, amp: bool = False) -> dict[str, Any]:
    """Save after 3 steps, continue 3: a fresh model loaded from the save ends the same."""
    model, optim = build(kind, amp=amp)
    scheduler = torch.optim.lr_scheduler.StepLR(torch_optimizer(optim), step_size=2, gamma=0.5)
    rank = dist.get_rank()
    for step in range(3):
        train_step(model, optim, step)
        scheduler.step()
    random.seed(rank)
    numpy.random.seed(rank + 3)
    torch.manual_seed(rank + 7)
    path = save_checkpoint(
        f"{root}/resume_{kind}",
        model=model,
        optim_wrapper=optim,
        schedulers=[scheduler],
        strategy=strategy_of(kind),
        extra={"step": 3, "note": "three steps"},
    )
    draws = (torch.rand(3), random.random(), numpy.random.rand(2).tolist())
    lrs = []
    for step in range(3, 6):
        train_step(model, optim, step)
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    expected = full_params(model)

    resumed, resumed_optim = build(kind, seed=5, amp=amp)
    resumed_scheduler = torch.optim.lr_scheduler.StepLR(
        torch_optimizer(resumed_optim), step_size=2, gamma=0.5
    )
    torch.manual_seed(1234)  # the load must bring the saved RNG state back
    random.seed(1234)
    numpy.random.seed(1234)
    extra = load_checkpoint(
        path,
        model=resumed,
        optim_wrapper=resumed_optim,
        schedulers=[resumed_scheduler],
    )  # DeepSpeed's own files too: read with weights_only, DeepSpeed's records allowed
    resumed_draws = (torch.rand(3), random.random(), numpy.random.rand(2).tolist())
    resumed_lrs = []
    for step in range(extra["step"], 6):
        train_step(resumed, resumed_optim, step)
        resumed_scheduler.step()
        resumed_lrs.append(resumed_scheduler.get_last_lr()[0])
    manifest = read_manifest(path)
    return {
        "diff": max_diff(full_params(resumed), expected),
        "moved": max_diff(expected, full_params(build(kind, seed=5)[0])),
        "draws": bool(torch.equal(draws[0], resumed_draws[0])) and draws[1:] == resumed_draws[1:],
        "lrs": (lrs, resumed_lrs),
        "extra": extra,
        "format": manifest.format,
        "scaler": manifest.has_scaler,
        "files": sorted(manifest.files),
    }


@pytest.mark.parametrize(
    "kind", ["single", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3"]
)
def test_resume_equals_the_run_that_never_stopped(
    comm_pools: Any, tmp_path: Path, kind: str
) -> None:
    expected_format = {"fsdp": "dcp", "fsdp2": "dcp", "single": "full", "ddp": "full"}
    for result in comm_pools.get(2).run(
        resume_equals_uninterrupted, str(tmp_path), kind, timeout=300
    ):
        assert result["diff"] == 0.0
        assert result["moved"] > 1e-2  # the fresh model started elsewhere
        assert result["draws"]
        # StepLR(step_size=2, gamma=0.5) from 0.01: after steps 4, 5, 6.
        assert result["lrs"][0] == result["lrs"][1] == [0.0025, 0.0025, 0.00125]
        assert result["extra"] == {"step": 3, "note": "three steps"}
        assert result["format"] == expected_format.get(kind, "deepspeed")
        assert "rng/rank_0.json" in result["files"]
        assert "rng/rank_1.json" in result["files"]


def test_amp_scaler_state_round_trips(comm_pools: Any, tmp_path: Path) -> None:
    for result in comm_pools.get(2).run(
        resume_equals_uninterrupted, str(tmp_path), "ddp", amp=True, timeout=300
    ):
        assert result["diff"] == 0.0
        assert result["scaler"] is False  # bf16 autocast on CPU needs no scaler
        assert result["draws"]


# --------------------------------------------------------- errors on every rank


def rank0_alone(root: str) -> str:
    """Rank 0 calls save alone: a clear error after the timeout, not a hang."""
    model, _ = build("ddp")
    if dist.get_rank() != 0:
        return ""
    try:
        save_checkpoint(f"{root}/alone", model=model, strategy="ddp", timeout=2)
    except CheckpointError as error:
        return str(error)
    return "no error"


def rank0_alone_leaves_nothing(root: str) -> list[str]:
    dist.barrier()
    return sorted(os.listdir(root))


def save_and_load_after(root: str) -> Any:
    """A collective save and load after a failed call: every rank's numbering agrees."""
    model, _ = build("ddp")
    save_checkpoint(f"{root}/after", model=model, strategy="ddp", extra={"step": 5}, timeout=20)
    return load_checkpoint(f"{root}/after", model=build("ddp")[0], timeout=20)


def test_save_on_rank_0_alone_is_an_error_not_a_hang(comm_pools: Any, tmp_path: Path) -> None:
    pool = comm_pools.get(2)
    messages = pool.run(rank0_alone, str(tmp_path), timeout=60)
    assert "rank(s) [1] did not enter within 2 s" in messages[0]
    assert "Every rank must call save_checkpoint" in messages[0]
    # Nothing was created, and the world is still usable.
    assert pool.run(rank0_alone_leaves_nothing, str(tmp_path), timeout=60) == [[], []]
    # Rank 0 withdrew its entry: the next collective save and load work on both ranks.
    assert pool.run(save_and_load_after, str(tmp_path), timeout=60) == [{"step": 5}] * 2


def outcome_wait_is_bounded() -> tuple[str, float]:
    """Rank 0 waits in the commit for the ranks' outcomes, which rank 1 posts only 4 s
    later: rank 0 raises at its call's 1 s bound; rank 1 then finds the commit given up."""
    from comm_strategies.checkpoint._consensus import Call

    if dist.get_rank() != 0:
        call = Call("save_checkpoint", 30.0)
        time.sleep(4.0)
        caught(call.share, "written", None)
        return "", 0.0
    call = Call("save_checkpoint", 1.0)
    start = time.monotonic()
    try:
        call.share("written", None)
    except CheckpointError as error:
        return str(error), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_the_wait_for_the_ranks_outcome_is_bounded(comm_pools: Any) -> None:
    pool = comm_pools.get(2)
    (message, took), _ = pool.run(outcome_wait_is_bounded, timeout=60)
    assert re.search(r"rank 0 of 2: waited 1\.\d s at step 'written' for rank\(s\) \[1\]", message)
    assert took < 3.0


def slow_rank_against_the_call_timeout(root: str) -> tuple[str, float]:
    """Rank 1 takes 12 s more to write than rank 0; save_checkpoint(timeout=3) must end on
    rank 0 about 3 s after it started (the outcome vote bounded by the call's timeout, not
    by the hour writes get by default), with an error naming the step."""
    from tests.strategies.ckpt_seams import at_step

    model = torch.nn.Linear(2, 1)
    late = at_step("written", lambda: time.sleep(12.0 if dist.get_rank() == 1 else 0.0))
    start = time.monotonic()
    try:
        with late:
            save_checkpoint(f"{root}/slow", model=model, strategy="ddp", timeout=3.0)
        outcome = "no error"
    except CheckpointError as error:
        outcome = str(error)
    return outcome, time.monotonic() - start


def test_a_call_timeout_bounds_the_outcome_wait_too(tmp_path: Path) -> None:
    # a world of its own: the late rank's last vote times out with its exchange pending,
    # which the next collective of a shared world would trip over
    from comm_core.testing import launch

    results = launch(slow_rank_against_the_call_timeout, str(tmp_path), nprocs=2, timeout=90)
    (message, took), (late, _) = results
    assert "at step 'written' for rank(s) [1]" in message, message
    assert took < 8.0, took
    assert late != "no error"  # the slow rank finds the others gone: an error there too
    assert not (tmp_path / "slow").exists()


def late_rank_before_the_data_moves(root: str) -> dict[str, Any]:
    """Rank 1 is 6 s late to enter (FSDP2: the write after the entry runs torch's
    collectives, which wait only for the process group's timeout); with timeout=2 rank 0
    must give up at the entry about 2 s after it started, rank 1 (whose entry comes when
    rank 0 has given up) must give up too, and once both have, the world must still work
    (the next save and load, with no one late)."""
    from comm_strategies.checkpoint import _load
    from tests.strategies.ckpt_seams import at_step

    out: dict[str, Any] = {}
    model, optim = build("fsdp2")
    train_steps(model, optim, range(1))
    late = dist.get_rank() == 1
    start = time.monotonic()
    with at_step("entering", lambda: time.sleep(6.0 if late else 0.0)):
        out["save"] = caught(
            save_checkpoint, f"{root}/late", model=model, optim_wrapper=optim,
            strategy="fsdp2", timeout=2.0,
        )  # fmt: skip
    out["save_took"] = time.monotonic() - start
    dist.barrier()  # rank 1's late entry has timed out too: the ranks are in step again
    good = save_checkpoint(f"{root}/good", model=model, optim_wrapper=optim, strategy="fsdp2")
    read_manifest = _load.read_manifest
    if late:
        _load.read_manifest = lambda source: (time.sleep(6.0), read_manifest(source))[1]
    start = time.monotonic()
    out["load"] = caught(load_checkpoint, good, model=model, optim_wrapper=optim, timeout=2.0)
    out["load_took"] = time.monotonic() - start
    _load.read_manifest = read_manifest
    dist.barrier()
    load_checkpoint(good, model=model, optim_wrapper=optim)
    out["after"] = {k: v.tolist() for k, v in full_params(model).items()}
    return out


def test_a_call_timeout_bounds_the_wait_before_the_data_moves(tmp_path: Path) -> None:
    from comm_core.testing import launch

    first, late = launch(late_rank_before_the_data_moves, str(tmp_path), nprocs=2, timeout=120)
    for verb in ("save", "load"):
        name, message = first[verb]
        assert name == "CheckpointError", message
        assert "rank(s) [1] did not enter within 2 s" in message, message
        assert first[f"{verb}_took"] < 4.5, (verb, first[f"{verb}_took"])
        name, message = late[verb]
        assert name == "CheckpointError", message
        assert "rank(s) [0] did not enter within 2 s" in message, message
    assert not (tmp_path / "late").exists()
    assert first["after"] == late["after"]  # the world went on working: the same model


def one_rank_fails_before_reading(root: str) -> dict[str, Any]:
    """Rank 1 cannot read the manifest (a stale network filesystem); then rank 0 passes
    optimizers under other names. Each call must raise on both ranks at once (the failure
    shared before the data moves), not after the other rank's timeout, and the calls must
    stay in step: a correct load afterwards works."""
    out: dict[str, Any] = {}
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    path = save_checkpoint(f"{root}/ck", model=model, optim_wrapper=optim, strategy="ddp")
    with manifest_unreadable_on(1):
        start = time.monotonic()
        out["unreadable"] = caught(
            load_checkpoint, path, model=model, optim_wrapper=optim, timeout=30
        )
        out["unreadable_took"] = time.monotonic() - start
    other = {"a": optim, "b": torch.optim.SGD(model.parameters(), lr=1.0)}
    start = time.monotonic()
    mine = other if dist.get_rank() == 0 else optim
    out["names"] = caught(load_checkpoint, path, model=model, optim_wrapper=mine, timeout=30)
    out["names_took"] = time.monotonic() - start
    out["after"] = caught(load_checkpoint, path, model=model, optim_wrapper=optim, timeout=30)
    return out


def test_a_rank_that_fails_before_the_data_moves_fails_every_rank_at_once(
    comm_pools: Any, tmp_path: Path
) -> None:
    results = comm_pools.get(2).run(one_rank_fails_before_reading, str(tmp_path), timeout=120)
    for result in results:
        name, message = result["unreadable"]
        assert name == "CheckpointError", message
        assert "rank 1: OSError: stale file handle" in message, message
        assert result["unreadable_took"] < 10.0, result["unreadable_took"]  # not the 30 s
        name, message = result["names"]
        assert name == "CheckpointError", message
        assert "the optim wrapper has ['a', 'b']" in message, message
        assert result["names_took"] < 10.0
        assert result["after"] == ("", ""), result["after"]  # still in step


def errors_on_every_rank(root: str) -> dict[str, str]:
    """Another model's manifest, a truncated file, different paths: errors on every rank."""
    out = {}
    model, optim = build("fsdp2")
    train_steps(model, optim, range(1))
    path = save_checkpoint(f"{root}/good", model=model, strategy="fsdp2", sharded=False)

    class Wider(Net):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(8, 3)

    other = MMFullyShardedDataParallel2(Wider())
    try:
        load_checkpoint(path, model=other)
    except CheckpointError as error:
        out["other_model"] = str(error)
    dist.barrier()  # every rank is done reading before rank 0 cuts the file
    if dist.get_rank() == 0:
        data = (path / "model.pt").read_bytes()
        (path / "model.pt").write_bytes(data[: len(data) // 2])
    dist.barrier()
    try:
        load_checkpoint(path, model=build("fsdp2")[0])
    except CheckpointError as error:
        out["truncated"] = str(error)
    try:
        save_checkpoint(f"{root}/rank{dist.get_rank()}", model=model, strategy="fsdp2")
    except CheckpointError as error:
        out["paths"] = str(error)
    try:
        load_checkpoint(f"{root}/ds_unsafe", model=build("ddp")[0])
    except CheckpointError as error:
        out["missing"] = str(error)
    return out


def test_clear_errors_on_every_rank(comm_pools: Any, tmp_path: Path) -> None:
    results = comm_pools.get(2).run(errors_on_every_rank, str(tmp_path), timeout=120)
    for result in results:
        other = result["other_model"]
        assert "does not fit this model" in other
        assert "head.weight: checkpoint [2, 8], model [3, 8]" in other
        assert "head.bias: checkpoint [2], model [3]" in other
        truncated = result["truncated"]
        assert "model.pt" in truncated
        assert "truncated or corrupt" in truncated
        assert "the ranks passed different paths" in result["paths"]
        assert "ds_unsafe does not exist" in result["missing"]


def strict_false_loads_the_rest(root: str) -> dict[str, Any]:
    """A checkpoint of Net into a wider model: strict raises, strict=False loads the rest
    (weights and optimizer state) and warns with what it skipped; an optimizer state of
    another model is an error naming its entries."""

    class Wider(torch.nn.Module):  # Net with a three-output head
        def __init__(self) -> None:
            super().__init__()
            self.lin1 = torch.nn.Linear(4, 8)
            self.lin2 = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 3)

    model, optim = build("ddp")
    train_steps(model, optim, range(2))
    path = save_checkpoint(f"{root}/net", model=model, optim_wrapper=optim, strategy="ddp")
    saved = {n: v.detach().clone() for n, v in model.module.named_parameters()}
    moments = {
        name: optim.optimizer.state[param]["exp_avg"].clone()
        for name, param in model.module.named_parameters()
    }
    out: dict[str, Any] = {}
    for kind in ("ddp", "zero2"):
        wider = Wider()
        if kind == "ddp":
            target: Any = MMDistributedDataParallel(wider)
            target_optim: Any = OptimWrapper(torch.optim.AdamW(target.parameters(), lr=0.5))
        else:
            from comm_wrappers.deepspeed import initialize

            config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
            optimizer = torch.optim.AdamW(wider.parameters(), lr=0.5)
            target, target_optim = initialize(wider, config, optimizer)
        out[f"{kind}/strict"] = caught(
            load_checkpoint, path, model=target, optim_wrapper=target_optim
        )[1]
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            load_checkpoint(path, model=target, optim_wrapper=target_optim, strict=False)
        out[f"{kind}/warned"] = [
            str(r.message) for r in records if "strict=False" in str(r.message)
        ]
        state = full_optim_state_dict(target, target_optim)
        loaded = dict(full_model_state_dict(target))
        out[f"{kind}/weights"] = max_diff(
            {n: loaded[n] for n in saved if not n.startswith("head")},
            {n: v for n, v in saved.items() if not n.startswith("head")},
        )
        out[f"{kind}/moments"] = max_diff(
            {n: state["state"][n]["exp_avg"] for n in moments if not n.startswith("head")},
            {n: v for n, v in moments.items() if not n.startswith("head")},
        )
        out[f"{kind}/lr"] = state["param_groups"][0]["lr"]
    stranger = full_optim_state_dict(model, optim)
    stranger["state"] = {f"other.{n}": v for n, v in stranger["state"].items()}
    out["stranger"] = caught(load_full_optim_state_dict, model, optim, stranger)[1]
    return out


def strict_false_optimizer_of_fewer_parameters(root: str) -> dict[str, Any]:
    """FSDP2 (the dcp format): a checkpoint whose optimizer trained lin1 only, loaded into
    an optimizer of every parameter (lin2 and the head unfrozen since)."""
    model, _ = build("fsdp2")
    optim = OptimWrapper(torch.optim.AdamW(model.module.lin1.parameters(), lr=0.01))
    train_steps(model, optim, range(2))
    path = save_checkpoint(f"{root}/lin1", model=model, optim_wrapper=optim, strategy="fsdp2")
    saved = full_optim_state_dict(model, optim)["state"]
    weights = dict(full_model_state_dict(model))
    target, target_optim = build("fsdp2", seed=1)
    out: dict[str, Any] = {
        "strict": caught(load_checkpoint, path, model=target, optim_wrapper=target_optim)[1]
    }
    out["states after the refusal"] = len(torch_optimizer(target_optim).state)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        load_checkpoint(path, model=target, optim_wrapper=target_optim, strict=False)
    out["warned"] = [
        (str(r.message), r.filename) for r in records if "strict=False" in str(r.message)
    ]
    state = full_optim_state_dict(target, target_optim)["state"]
    out["stateless"] = sorted(set(weights) - set(state))
    out["moments"] = max_diff(
        {n: state[n]["exp_avg"] for n in saved}, {n: v["exp_avg"] for n, v in saved.items()}
    )
    out["weights"] = max_diff(dict(full_model_state_dict(target)), weights)
    train_step(target, target_optim, 2)  # trains on: lin2's and the head's state start now
    state = full_optim_state_dict(target, target_optim)["state"]
    out["steps"] = {n: float(state[n]["step"]) for n in ("lin1.weight", "lin2.weight", "head.bias")}
    out["path"] = str(path)
    return out


def test_strict_false_loads_an_optimizer_that_trained_fewer_parameters(
    comm_pools: Any, tmp_path: Path
) -> None:
    """The dcp format refused this whatever ``strict`` said (its message told the user to
    pass strict=False), and a refused load left the fresh optimizer with zero states."""
    results = comm_pools.get(2).run(strict_false_optimizer_of_fewer_parameters, str(tmp_path))
    for rank, result in enumerate(results):
        names = "lin2.weight, lin2.bias, head.weight, head.bias"
        assert (
            f"{result['path']} does not fit this optimizer on rank {rank}: it holds no state "
            f"for {names}, parameters this optimizer trains" in result["strict"]
        )
        assert "Pass strict=False" in result["strict"]
        assert result["states after the refusal"] == 0
        assert result["warned"] == [
            (
                f"strict=False: {result['path']} holds nothing for {names} (rank {rank}): their "
                "optimizer state is not loaded",
                __file__,
            )
        ]
        assert result["stateless"] == ["head.bias", "head.weight", "lin2.bias", "lin2.weight"]
        assert result["moments"] == 0.0
        assert result["weights"] == 0.0
        assert result["steps"] == {"lin1.weight": 3.0, "lin2.weight": 1.0, "head.bias": 1.0}


def a_save_before_the_first_step(root: str) -> dict[str, Any]:
    """Per kind, format and mode: a save of an optimizer that has not stepped yet, then three
    steps, against three steps without the save; a fresh model resumed from that save and
    trained the same three steps."""
    out: dict[str, Any] = {}
    for kind in ("ddp", "fsdp", "fsdp2"):
        plain, plain_optim = build(kind)
        train_steps(plain, plain_optim, range(3))
        reference = full_params(plain)
        for sharded in (False, True):
            for async_save in (False, True):
                tag = f"{kind}/{'dcp' if sharded else 'full'}/{'async' if async_save else 'sync'}"
                model, optim = build(kind)
                path = f"{root}/{tag.replace('/', '_')}"
                saved = save_checkpoint(
                    path, model=model, optim_wrapper=optim, strategy=strategy_of(kind),
                    sharded=sharded, async_save=async_save,
                )  # fmt: skip
                if async_save:
                    saved.wait()
                out[f"{tag}/states after the save"] = len(torch_optimizer(optim).state)
                train_steps(model, optim, range(3))
                out[f"{tag}/with the save"] = max_diff(full_params(model), reference)
                resumed, resumed_optim = build(kind, seed=1)
                load_checkpoint(path, model=resumed, optim_wrapper=resumed_optim)
                out[f"{tag}/states after the load"] = len(torch_optimizer(resumed_optim).state)
                train_steps(resumed, resumed_optim, range(3))
                out[f"{tag}/resumed"] = max_diff(full_params(resumed), reference)
    return out


def test_a_save_before_the_first_step_changes_nothing(comm_pools: Any, tmp_path: Path) -> None:
    """torch's state getters give an optimizer that has not stepped zero states at step 1
    (a step at lr 0): a save before training changed the run (AdamW's first update
    bias-corrected as a second one), and a resume from it started at step 1. The save now
    leaves the optimizer without state and writes none; the resumed run equals the one
    that never saved."""
    for result in comm_pools.get(2).run(a_save_before_the_first_step, str(tmp_path), timeout=240):
        assert len(result) == 3 * 2 * 2 * 4  # kinds x formats x modes x measures
        assert {tag: value for tag, value in result.items() if value != 0} == {}


def test_strict_false_loads_what_fits_and_reports_the_rest(comm_pools: Any, tmp_path: Path) -> None:
    for result in comm_pools.get(2).run(strict_false_loads_the_rest, str(tmp_path), timeout=180):
        for kind in ("ddp", "zero2"):
            assert "head.weight: checkpoint [2, 8], model [3, 8]" in result[f"{kind}/strict"]
            assert "Pass strict=False" in result[f"{kind}/strict"]
            [warned] = result[f"{kind}/warned"]
            assert "head.bias: checkpoint [2], model [3]" in warned
            assert result[f"{kind}/weights"] == 0.0
            assert result[f"{kind}/moments"] == 0.0
            assert result[f"{kind}/lr"] == 0.01  # the saved hyperparameters, not 0.5
        assert "other.lin1.weight" in result["stranger"]
        assert "not parameters of this model" in result["stranger"]


def full_state_functions() -> dict[str, Any]:
    """full_model/optim_state_dict on every kind give the same names; loads round-trip."""
    out: dict[str, Any] = {}
    reference = None
    for kind in ["ddp", "fsdp", "fsdp2"]:
        model, optim = build(kind)
        train_steps(model, optim, range(2))
        state = full_model_state_dict(model)
        optim_state = full_optim_state_dict(model, optim)
        if reference is None:
            reference = (state, optim_state)
        out[kind] = {
            "model": max_diff(state, reference[0]),
            "exp_avg": max(
                float(
                    (optim_state["state"][n]["exp_avg"] - reference[1]["state"][n]["exp_avg"])
                    .abs()
                    .max()
                )
                for n in state
            ),
            "names": sorted(optim_state["state"]) == sorted(state),
        }
    return out


def test_full_state_functions_agree_across_wrappers(comm_pools: Any) -> None:
    for result in comm_pools.get(2).run(full_state_functions, timeout=120):
        for kind, values in result.items():
            assert values["model"] <= EXACT, kind
            assert values["exp_avg"] <= EXACT, kind
            assert values["names"], kind


def deepspeed_without_opt_in(root: str) -> float:
    """A DeepSpeed checkpoint of comm's loads elsewhere, optimizer included, with no opt-in:
    comm reads only its own portable files there (weights_only)."""
    model, optim = build("fsdp2", seed=3)
    load_checkpoint(f"{root}/zero2", model=model, optim_wrapper=optim)
    return max_diff(full_params(model), expected_of(root, "zero2"))


def test_comms_deepspeed_checkpoints_need_no_opt_in(comm_pools: Any, saved: str) -> None:
    for diff in comm_pools.get(2).run(deepspeed_without_opt_in, saved, timeout=120):
        assert diff <= EXACT


# ----------------------------------------- the folder at the path (one process)


def test_a_replaced_checkpoint_is_deleted_in_the_background(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path / "ckpt", model=model, strategy="single", extra={"step": 1})
    with torch.no_grad():
        model.weight.fill_(7.0)
    # A replaced copy that a killed process did not finish deleting: the next save of
    # that name removes it.
    (tmp_path / ".ckpt.old-killed").mkdir()
    save_checkpoint(tmp_path / "ckpt", model=model, strategy="single", extra={"step": 2})
    fresh = torch.nn.Linear(3, 2)
    assert load_checkpoint(tmp_path / "ckpt", model=fresh) == {"step": 2}
    assert bool((fresh.weight == 7.0).all())
    _publish._wait_for_deletions()  # what the interpreter does at exit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_users_file_inside_a_checkpoint_is_never_deleted(tmp_path: Path) -> None:
    """Saving again to a checkpoint's path replaced the whole folder, a user's file in it
    too: now it is refused (nothing lost), and keep_last leaves such a folder in place."""
    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path / "ckpt", model=model, strategy="single", extra={"step": 1})
    (tmp_path / "ckpt" / "eval_notes.txt").write_text("mAP 41.2")
    with pytest.raises(CheckpointError) as refused:
        save_checkpoint(tmp_path / "ckpt", model=model, strategy="single", extra={"step": 2})
    assert "holding files comm did not write (eval_notes.txt)" in str(refused.value)
    assert "move them out, or save to another path" in str(refused.value)
    assert (tmp_path / "ckpt" / "eval_notes.txt").read_text() == "mAP 41.2"
    assert load_checkpoint(tmp_path / "ckpt", model=torch.nn.Linear(3, 2)) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left
    with pytest.warns(RuntimeWarning, match=r"keep_last left .*ckpt in place"):
        save_checkpoint(tmp_path / "next", model=model, strategy="single", keep_last=1)
    assert (tmp_path / "ckpt" / "eval_notes.txt").is_file()
    (tmp_path / "ckpt" / "eval_notes.txt").unlink()  # moved out: the next save removes it
    save_checkpoint(tmp_path / "last", model=model, strategy="single", keep_last=1)
    _publish._wait_for_deletions()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


def test_a_file_at_the_path_is_an_error_and_stays(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"found a file at .*notes\.txt, not a checkpoint"):
        save_checkpoint(tmp_path / "notes.txt", model=torch.nn.Linear(3, 2), strategy="single")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_bar_in_the_path_neither_fails_the_save_nor_deletes_another_folder(
    tmp_path: Path,
) -> None:
    # the entry exchange once joined its fields with "|": a path holding one was misread,
    # and rank 0 removed the folder named by the path's part before the bar
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "keep.txt").write_text("mine")
    folder = save_checkpoint(
        tmp_path / "runs|lr=0.1" / "epoch_1",
        model=torch.nn.Linear(3, 2),
        strategy="single",
        extra={"epoch": 1},
    )
    assert folder == tmp_path / "runs|lr=0.1" / "epoch_1"
    assert load_checkpoint(folder, model=torch.nn.Linear(3, 2)) == {"epoch": 1}
    assert (tmp_path / "runs" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "runs|lr=0.1").iterdir()) == ["epoch_1"]


def test_a_folder_that_is_not_a_checkpoint_is_an_error_and_stays(tmp_path: Path) -> None:
    work_dir = tmp_path / "work_dir"
    (work_dir / "logs").mkdir(parents=True)
    (work_dir / "logs" / "train.log").write_text("epoch 1")
    with pytest.raises(CheckpointError, match=r"found a folder at .*work_dir that is not a"):
        save_checkpoint(work_dir, model=torch.nn.Linear(3, 2), strategy="single")
    assert (work_dir / "logs" / "train.log").read_text() == "epoch 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work_dir"]
    # an empty folder is taken
    (tmp_path / "empty").mkdir()
    save_checkpoint(tmp_path / "empty", model=torch.nn.Linear(3, 2), strategy="single")
    assert (tmp_path / "empty" / "manifest.json").is_file()


def test_a_folder_with_a_foreign_manifest_is_an_error_and_stays(tmp_path: Path) -> None:
    # manifest.json is a common name (a web app's, a data set's): only a manifest this
    # package wrote makes a folder a checkpoint that a save may replace
    app = tmp_path / "webapp"
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "my app", "format_version": 3}')
    (app / "index.html").write_text("mine")
    with pytest.raises(CheckpointError, match=r"found a folder at .*webapp that is not a"):
        save_checkpoint(app, model=torch.nn.Linear(3, 2), strategy="single")
    assert (app / "index.html").read_text() == "mine"
    assert sorted(p.name for p in app.iterdir()) == ["index.html", "manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["webapp"]


def test_glob_characters_in_the_name_remove_only_its_own_leftovers(tmp_path: Path) -> None:
    # the leftovers of killed saves are found by a pattern built from the name: a name
    # holding *, ? or [ once matched (and deleted) other saves' folders and user files
    (tmp_path / ".epoch_1.tmp-running").mkdir()  # another save of another name
    (tmp_path / ".notes.old-2024").write_text("mine")
    (tmp_path / ".ckpt[1].tmp-killed").mkdir()  # a killed save of this very name
    model = torch.nn.Linear(3, 2)
    for name, step in (("*", 1), ("epoch_?", 2), ("ckpt[1]", 3)):
        save_checkpoint(tmp_path / name, model=model, strategy="single", extra={"step": step})
        assert load_checkpoint(tmp_path / name, model=torch.nn.Linear(3, 2)) == {"step": step}
    _publish._wait_for_deletions()
    assert (tmp_path / ".notes.old-2024").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "*",
        ".epoch_1.tmp-running",
        ".notes.old-2024",
        "ckpt[1]",
        "epoch_?",
    ]


def test_a_link_at_the_path_is_replaced_and_its_target_kept(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    target = save_checkpoint(tmp_path / "epoch_1", model=model, strategy="single")
    (tmp_path / "latest").symlink_to(target)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for name, step in (("latest", 2), ("dangling", 3)):
        save_checkpoint(tmp_path / name, model=model, strategy="single", extra={"step": step})
        assert not (tmp_path / name).is_symlink()
        assert load_checkpoint(tmp_path / name, model=torch.nn.Linear(3, 2)) == {"step": step}
    _publish._wait_for_deletions()
    # the links themselves were removed, not what "latest" pointed to
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "epoch_1", "latest"]
    assert (target / "manifest.json").is_file()


# -------------------------------------------- a failure outside the file writes


class _BrokenScheduler:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("this scheduler cannot be saved")


def state_capture_fails_on_rank_0(root: str) -> str:
    """A failure outside the file writes (a scheduler's state_dict, on rank 0 only) reaches
    every rank as a CheckpointError instead of leaving the others in the outcome check."""
    model, optim = build("ddp")
    schedulers: list[Any] = [_BrokenScheduler()] if dist.get_rank() == 0 else []
    try:
        save_checkpoint(
            f"{root}/broken", model=model, optim_wrapper=optim, schedulers=schedulers,
            strategy="ddp",
        )  # fmt: skip
    except CheckpointError as error:
        return str(error)
    return "no error"


def test_a_failure_capturing_state_on_one_rank_is_an_error_on_every_rank(
    comm_pools: Any, tmp_path: Path
) -> None:
    messages = comm_pools.get(2).run(state_capture_fails_on_rank_0, str(tmp_path), timeout=60)
    for message in messages:
        assert "rank 0" in message, message
        assert "this scheduler cannot be saved" in message, message
    assert not (tmp_path / "broken").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_user_state_that_is_not_a_mapping_fails_the_save_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    # dict(extra) once failed outside the recorded writes: a raw ValueError on the saving
    # rank while the others waited in the outcome vote
    model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match=r"writing the user state \(extra\)"):
        save_checkpoint(tmp_path / "ckpt", model=model, strategy="single", extra=["step", 5])  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # neither the checkpoint nor its temporary folder


def test_a_text_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    # the weights-only unpickler stops on stray bytes with a bare KeyError or IndexError
    for name, text in (("hello.pth", "hello\n"), ("notes.pth", "a\nb c\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(CheckpointError) as error:
            load_checkpoint(tmp_path / name, model=torch.nn.Linear(3, 2))
        message = str(error.value)
        assert f"{name} is not a checkpoint: it is a text file (it starts with " in message
        assert "Expected a file written by torch.save" in message
        assert "truncated or corrupt" not in message
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(40)))
    with pytest.raises(CheckpointError, match="binary data of another format"):
        load_checkpoint(tmp_path / "image.png", model=torch.nn.Linear(3, 2))
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is not a checkpoint: it is empty \(0 bytes\)"):
        load_checkpoint(tmp_path / "empty.pt", model=torch.nn.Linear(3, 2))


@pytest.mark.parametrize("timeout", ["5", True, [1]])
def test_a_timeout_that_is_not_a_number_is_refused(tmp_path: Path, timeout: Any) -> None:
    with pytest.raises(CheckpointError, match="timeout must be a number of seconds"):
        save_checkpoint(
            tmp_path / "ckpt", model=torch.nn.Linear(3, 2), strategy="single", timeout=timeout
        )
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------- DeepSpeed's own folder


def _moments(optim: Any) -> float:
    """The sum of every Adam moment of the engine's inner optimizer (its flat partitions)."""
    state = torch_optimizer(optim).state
    return float(sum(v["exp_avg"].abs().sum() for v in state.values()))


def native_folder_restores_the_engines_optimizer(root: str) -> tuple[float, float, float]:
    """DeepSpeed's own folder into the engine, no optim wrapper passed: the engine owns its
    optimizer, so its moments come back with the weights (load_optimizer=True)."""
    model, optim = build("zero1")
    train_steps(model, optim, range(2))
    model.model.save_checkpoint(f"{root}/own", tag="step2")
    saved = _moments(optim)
    train_steps(model, optim, range(2, 5))
    moved = _moments(optim)
    load_checkpoint(f"{root}/own", model=model)
    return saved, moved, _moments(optim)


def test_deepspeeds_own_folder_restores_the_engines_optimizer(
    comm_pools: Any, tmp_path: Path
) -> None:
    results = comm_pools.get(2).run(
        native_folder_restores_the_engines_optimizer, str(tmp_path), timeout=120
    )
    for saved, moved, restored in results:
        assert moved != saved  # three more steps changed the moments
        assert restored == saved


def test_the_rng_file_is_json_and_a_version_1_torch_file_still_loads(tmp_path: Path) -> None:
    """Each rank's generators are saved as JSON (layout version 2); a folder of layout
    version 1 (``rng/rank_N.pt``, torch's format) restores the same generators."""
    from comm_strategies.checkpoint._files import rng_json

    model = torch.nn.Linear(2, 1)
    random.seed(5)
    numpy.random.seed(6)
    torch.manual_seed(7)
    folder = save_checkpoint(tmp_path / "ck", model=model, strategy="single")
    expected = (random.random(), numpy.random.rand(2).tolist(), torch.rand(2).tolist())
    manifest = read_manifest(folder)
    assert manifest.format_version == 2
    assert "rng/rank_0.json" in manifest.files
    saved = json.loads((folder / "rng" / "rank_0.json").read_text())
    assert sorted(saved) == ["numpy", "python", "torch"]
    assert len(saved["python"]["state"]) == 625  # Mersenne Twister: 624 words and a position

    for version_1 in (False, True):
        if version_1:  # the same states in the torch file a version-1 save wrote
            legacy = {
                "python": {"version": 3, "state": torch.tensor(saved["python"]["state"])},
                "torch": torch.frombuffer(
                    bytearray(base64.b64decode(saved["torch"])), dtype=torch.uint8
                ),
                "numpy": dict(saved["numpy"], keys=torch.tensor(saved["numpy"]["keys"])),
            }
            (folder / "rng" / "rank_0.json").unlink()
            torch.save(legacy, folder / "rng" / "rank_0.pt")
        random.seed(0)
        numpy.random.seed(0)
        torch.manual_seed(0)
        load_checkpoint(folder, model=torch.nn.Linear(2, 1))
        got = (random.random(), numpy.random.rand(2).tolist(), torch.rand(2).tolist())
        assert got == expected, (version_1, got, expected)
    assert rng_json(folder, 0) == saved  # the version-1 file, as convert writes it again
    converted = convert_checkpoint(folder, tmp_path / "converted", to="full")
    assert json.loads((converted / "rng" / "rank_0.json").read_text()) == saved
    assert not (converted / "rng" / "rank_0.pt").exists()


DAMAGES: dict[str, Any] = {
    "cut short": None,
    "not an object": [1, 2],
    "torch's state cut": lambda s: dict(s, torch=s["torch"][:100]),
    "torch's state not base64": lambda s: dict(s, torch="not base64!"),
    "python's state short": lambda s: dict(s, python=dict(s["python"], state=[1] * 10)),
    "python's state a string": lambda s: dict(s, python="x"),
    "python's version missing": lambda s: dict(s, python={"state": s["python"]["state"]}),
    "numpy's keys short": lambda s: dict(s, numpy=dict(s["numpy"], keys=[1, 2])),
    "numpy's keys negative": lambda s: dict(s, numpy=dict(s["numpy"], keys=[-1] * 624)),
    "a CUDA state not base64": lambda s: dict(s, cuda=["?"]),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_rng_file_names_itself_and_the_way_out(tmp_path: Path, damage: str) -> None:
    """Whatever is wrong in it, the RNG file fails the load before anything is set (the
    model and every generator as they were), naming the file and ``load_rng=False``."""
    model = torch.nn.Linear(2, 1)
    folder = save_checkpoint(tmp_path / "ck", model=model, strategy="single")
    file = folder / "rng" / "rank_0.json"
    change = DAMAGES[damage]
    if change is None:
        file.write_text(file.read_text()[:40])
    else:
        saved = json.loads(file.read_text())
        file.write_text(json.dumps(change(saved) if callable(change) else change))
    target = torch.nn.Linear(2, 1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    random.seed(3)
    torch.manual_seed(3)
    generators = (random.getstate(), torch.get_rng_state())
    with pytest.raises(CheckpointError, match=r"rank_0\.json is truncated or corrupt") as info:
        load_checkpoint(folder, model=target)
    assert "load_rng=False" in str(info.value)
    assert max_diff(dict(target.state_dict()), before) == 0.0  # nothing loaded
    assert random.getstate() == generators[0]
    assert torch.equal(torch.get_rng_state(), generators[1])
    load_checkpoint(folder, model=target, load_rng=False)  # the way out
    assert max_diff(dict(target.state_dict()), dict(model.state_dict())) == 0.0


def test_the_model_s_backend_adapter_stands_for_the_model(tmp_path: Path) -> None:
    """save_checkpoint and load_checkpoint take the adapter a caller keeps (as `Strategy`
    does) in place of the model, with the same files and the same values."""
    from comm_wrappers.backends import backend_of

    model = torch.nn.Linear(3, 2)
    by_model = save_checkpoint(tmp_path / "by_model", model=model, strategy="single")
    by_backend = save_checkpoint(
        tmp_path / "by_backend", model=backend_of(model), strategy="single"
    )
    assert read_manifest(by_model).files == read_manifest(by_backend).files
    target = torch.nn.Linear(3, 2)
    load_checkpoint(by_backend, model=backend_of(target))
    assert max_diff(dict(target.state_dict()), dict(model.state_dict())) == 0.0
    # the full-state functions too; an adapter is its own adapter
    adapter = backend_of(target)
    assert backend_of(adapter) is adapter
    assert max_diff(full_model_state_dict(adapter), dict(model.state_dict())) == 0.0
    other = torch.nn.Linear(3, 2)
    load_full_model_state_dict(
        backend_of(other), {"module.weight": torch.ones(2, 3), "module.bias": torch.zeros(2)}
    )
    assert other.weight.tolist() == [[1.0] * 3] * 2
    optimizer = torch.optim.SGD(other.parameters(), lr=0.25)
    state = full_optim_state_dict(backend_of(other), optimizer)
    assert state["param_groups"][0]["params"] == ["weight", "bias"]
    state["param_groups"][0]["lr"] = 0.5
    load_full_optim_state_dict(backend_of(other), optimizer, state)
    assert optimizer.param_groups[0]["lr"] == 0.5
