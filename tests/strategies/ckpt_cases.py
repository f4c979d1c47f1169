"""Checkpoint cases run on every rank of a real gloo world (tests/strategies/test_checkpoint*).

Models of every kind are built from the wrappers' test net (``tests.wrappers.net``),
trained on rank-dependent batches, saved, and loaded into fresh models of every other
kind. Parameters are compared with functions independent of the code under test
(``full_params`` gathers FSDP shards, DeepSpeed's ``GatheredParameters`` gathers ZeRO-3).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import torch

import comm_collectives as dist
from comm_strategies.checkpoint import (
    CheckpointError,
    full_model_state_dict,
    full_optim_state_dict,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from comm_wrappers import (
    AmpOptimWrapper,
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    OptimWrapper,
)
from tests.helpers import full_params, max_diff
from tests.wrappers.net import BATCH, Net, batch

KINDS = ["single", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3"]
STRATEGY = {"single": "single", "ddp": "ddp", "fsdp": "fsdp", "fsdp2": "fsdp2"}


def net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def build(kind: str, seed: int = 0, *, amp: bool = False) -> tuple[Any, Any]:
    """A model of ``kind`` (fresh, initialised from ``seed``) and its optim wrapper."""
    module = net(seed)
    if kind.startswith("zero"):
        from comm_wrappers.deepspeed import initialize

        optimizer = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.01)
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "zero_optimization": {"stage": int(kind[-1])},
            "gradient_clipping": 0.0,
        }
        return initialize(module, config, optimizer)
    if kind == "ddp":
        model: Any = MMDistributedDataParallel(module)
    elif kind == "fsdp":
        model = MMFullyShardedDataParallel(module)
    elif kind == "fsdp2":
        model = MMFullyShardedDataParallel2(module)
    else:
        model = module
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    if amp:
        return model, AmpOptimWrapper(optimizer, dtype="bfloat16", use_fsdp=kind == "fsdp")
    return model, OptimWrapper(optimizer)


def torch_optimizer(optim: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside an optim wrapper (under ZeRO: the engine's base optimizer)."""
    optimizer = optim.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def strategy_of(kind: str) -> str:
    return STRATEGY.get(kind, "deepspeed")


def train_step(model: Any, optim: Any, step: int) -> None:
    """One step; a plain module (the single strategy) sees rank 0's batch on every rank."""
    if hasattr(model, "train_step"):
        model.train_step(batch(step, 0, dist.get_rank()), optim)
        return
    inputs, targets = batch(step, 0, 0)
    optim.update_params(model(inputs, targets, mode="loss")["loss"])


def train_steps(model: Any, optim: Any, steps: range) -> None:
    for step in steps:
        train_step(model, optim, step)


# ---------------------------------------------------------------- the matrix


def keep_expected(root: str, name: str, params: dict[str, torch.Tensor]) -> None:
    """Rank 0 writes the parameters a load must reproduce (tensors stay out of the pool's pipes)."""
    if dist.get_rank() == 0:
        torch.save(params, f"{root}/expected_{name}.pt")
    dist.barrier()


def expected_of(root: str, name: str) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = torch.load(f"{root}/expected_{name}.pt")
    return params


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
            # DeepSpeed's ZeRO optimizer state moves only to the same stage and world size.
            cross_ds = (target.startswith("zero") or source.startswith("zero")) and (
                target != source or not manifest_path.exists() or dist.get_world_size() != 2
            )
            load_checkpoint(
                path,
                model=model,
                optim_wrapper=optim,
                load_optimizer=not cross_ds and manifest_path.exists(),
                allow_unsafe_pickle=source.startswith(("zero", "ds_")),
            )
            row[source] = max_diff(full_params(model), expected[source])
        out[target] = row
    return out


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


# ---------------------------------------------------------------- plain files, DeepSpeed folders


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


# ---------------------------------------------------------------- resume


def resume_equals_uninterrupted(root: str, kind: str, amp: bool = False) -> dict[str, Any]:
    """Save after 3 steps, continue 3: a fresh model loaded from the save ends the same."""
    model, optim = build(kind, amp=amp)
    scheduler = torch.optim.lr_scheduler.StepLR(torch_optimizer(optim), step_size=2, gamma=0.5)
    rank = dist.get_rank()
    for step in range(3):
        train_step(model, optim, step)
        scheduler.step()
    random.seed(rank)
    torch.manual_seed(rank + 7)
    path = save_checkpoint(
        f"{root}/resume_{kind}",
        model=model,
        optim_wrapper=optim,
        schedulers=[scheduler],
        strategy=strategy_of(kind),
        extra={"step": 3, "note": "three steps"},
    )
    draws = (torch.rand(3), random.random())
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
    extra = load_checkpoint(
        path,
        model=resumed,
        optim_wrapper=resumed_optim,
        schedulers=[resumed_scheduler],
    )  # DeepSpeed's own files too: read with weights_only, DeepSpeed's records allowed
    resumed_draws = (torch.rand(3), random.random())
    resumed_lrs = []
    for step in range(extra["step"], 6):
        train_step(resumed, resumed_optim, step)
        resumed_scheduler.step()
        resumed_lrs.append(resumed_scheduler.get_last_lr()[0])
    manifest = read_manifest(path)
    return {
        "diff": max_diff(full_params(resumed), expected),
        "moved": max_diff(expected, full_params(build(kind, seed=5)[0])),
        "draws": bool(torch.equal(draws[0], resumed_draws[0])) and draws[1] == resumed_draws[1],
        "lrs": (lrs, resumed_lrs),
        "extra": extra,
        "format": manifest.format,
        "scaler": manifest.has_scaler,
        "files": sorted(manifest.files),
    }


# ---------------------------------------------------------------- errors


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


def outcome_wait_is_bounded() -> tuple[str, float]:
    """Rank 0 waits for the ranks' outcome flag, which rank 1 sends only 4 s later: rank 0
    raises after its 1 s bound; rank 1's late flag then completes rank 0's pending one."""
    from comm_strategies.checkpoint._consensus import Call

    call = Call("save_checkpoint", 30.0)
    if dist.get_rank() != 0:
        time.sleep(4.0)
        call.vote("done", None, timeout=30.0)
        return "", 0.0
    start = time.monotonic()
    try:
        call.vote("done", None, timeout=1.0)
    except CheckpointError as error:
        return str(error), time.monotonic() - start
    return "no error", time.monotonic() - start


def save_and_load_after(root: str) -> Any:
    """A collective save and load after a failed call: every rank's numbering agrees."""
    model, _ = build("ddp")
    save_checkpoint(f"{root}/after", model=model, strategy="ddp", extra={"step": 5}, timeout=20)
    return load_checkpoint(f"{root}/after", model=build("ddp")[0], timeout=20)


def rank0_alone_leaves_nothing(root: str) -> list[str]:
    dist.barrier()
    return sorted(os.listdir(root))


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


def deepspeed_without_opt_in(root: str) -> str:
    """DeepSpeed's files need full unpickling: refused without allow_unsafe_pickle."""
    model, _ = build("fsdp2", seed=3)
    try:
        load_checkpoint(f"{root}/zero2", model=model, load_optimizer=False)
    except CheckpointError as error:
        return str(error)
    return "no error"


def save_for_cli(root: str) -> None:
    """An FSDP2 DCP checkpoint and a DeepSpeed ZeRO-0 folder, with their parameters."""
    model, optim = build("fsdp2")
    train_steps(model, optim, range(2))
    save_checkpoint(
        f"{root}/fsdp2",
        model=model,
        optim_wrapper=optim,
        strategy="fsdp2",
        extra={"step": 2},
    )
    keep_expected(root, "fsdp2", full_params(model))
    model, optim = build("zero0")
    train_steps(model, optim, range(2))
    model.model.save_checkpoint(f"{root}/ds_0", tag="global_step2")
    keep_expected(root, "ds_0", full_params(model))


def load_converted(folder: str) -> float:
    """A folder converted from a plain file loads into FSDP1 at world 2 (resharded by DCP)."""
    model, _ = build("fsdp", seed=11)
    load_checkpoint(folder, model=model)
    return max_diff(full_params(model), expected_of(str(Path(folder).parent), "fsdp2"))


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


def save_with_unbounded_timeouts(root: str) -> dict[str, str]:
    """timeout= at its edges (infinity, NaN, zero, negative), with rank 1 entering late:
    each rank's outcome (the error's type and text, or "ok")."""
    import math

    model = torch.nn.Linear(3, 2)
    out: dict[str, str] = {}
    cases = (("inf", math.inf), ("nan", math.nan), ("zero", 0.0), ("negative", -1.0))
    for name, timeout in cases:
        if dist.get_rank() == 1:
            time.sleep(0.5)  # past the quick check: the store's own bounded wait runs
        try:
            save_checkpoint(f"{root}/{name}", model=model, strategy="ddp", timeout=timeout)
            out[name] = "ok"
        except Exception as error:  # the case reports any outcome
            out[name] = f"{type(error).__name__}: {error}"
        dist.barrier()
    return out


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
