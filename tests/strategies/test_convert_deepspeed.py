"""DeepSpeed's folders read offline and converted, checked against real engines.

One module-scoped run at world 2 trains DeepSpeed engines (ZeRO 0-3 in fp32, ZeRO 2 and 3
in bf16) two steps, saves each with ``engine.save_checkpoint`` and writes what the engine
itself holds, gathered with DeepSpeed's own ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` (ZeRO-0: the module and the torch optimizer's state):
the truth the offline reader and the conversions must reproduce, independent of them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_strategies.checkpoint import (
    CheckpointError,
    convert_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from comm_strategies.checkpoint import _deepspeed_records as ds_files
from comm_strategies.checkpoint._deepspeed_offline import read_folder
from comm_wrappers import OptimWrapper, OptimWrapperDict
from tests.wrappers.net import BATCH, Net, batch, global_batch

FP32 = ["zero0", "zero1", "zero2", "zero3"]
BF16 = ["zero2_bf16", "zero3_bf16"]
GROUPS = ["zero2_groups", "zero3_groups"]
SGD = ["zero2_sgd"]
MOMENTS = ("exp_avg", "exp_avg_sq")


def state_keys(kind: str) -> tuple[str, ...]:
    """The optimizer state a parameter of ``kind`` carries besides its step."""
    return ("momentum_buffer",) if kind.endswith("_sgd") else MOMENTS


def wrapped(kind: str, *, seed: int = 0, universal: bool = False) -> tuple[Any, Any]:
    """comm's wrapper of a DeepSpeed engine of ``kind`` (``zeroN``, ``zeroN_bf16``,
    ``zeroN_groups``: two parameter groups, or ``zeroN_sgd``: SGD with momentum instead of
    AdamW) with its torch optimizer, and its optim wrapper."""
    from comm_wrappers.deepspeed import initialize

    torch.manual_seed(seed)
    module = Net()
    optimizer = optimizer_of(module, kind, 0.01 + seed)
    stage = int(kind[4])
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "checkpoint": {"load_universal": universal and stage > 0},
        "zero_allow_untested_optimizer": True,  # SGD
    }
    if kind.endswith("_bf16"):
        config["bf16"] = {"enabled": True}
    return initialize(module, config, optimizer)


def optimizer_of(module: torch.nn.Module, kind: str, lr: float) -> torch.optim.Optimizer:
    """The optimizer of ``kind``: AdamW in one group, or (``_groups``) weights and biases
    apart, the biases with twice the learning rate and no weight decay; or SGD."""
    if kind.endswith("_sgd"):
        return torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9, weight_decay=0.01)
    if not kind.endswith("_groups"):
        return torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.01)
    named = list(module.named_parameters())
    groups: list[dict[str, Any]] = [
        {"params": [p for name, p in named if name.endswith("weight")]},
        {
            "params": [p for name, p in named if name.endswith("bias")],
            "lr": 2 * lr,
            "weight_decay": 0.0,
        },
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.01)


def oracle(kind: str, world: int = 2) -> dict[str, dict[str, torch.Tensor]]:
    """One process of plain torch on the global batch, two steps: what ZeRO computes (it
    equals DDP exactly; here up to the order of the sums)."""
    torch.manual_seed(0)
    module = Net()
    optimizer = optimizer_of(module, kind, 0.01)
    for step in range(2):
        inputs, targets = global_batch(step, 0, world)
        module(inputs, targets, mode="loss")["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    named = dict(module.named_parameters())
    truth = {"params": {name: p.detach().clone() for name, p in named.items()}}
    for key in MOMENTS:
        truth[key] = {name: optimizer.state[p][key].clone() for name, p in named.items()}
    return truth


def engine_of(kind: str, *, seed: int = 0, universal: bool = False) -> Any:
    """The DeepSpeed engine itself (see `wrapped`)."""
    return wrapped(kind, seed=seed, universal=universal)[0].model


def train(engine: Any, steps: range, dtype: torch.dtype = torch.float32) -> None:
    for step in steps:
        inputs, targets = batch(step, 0, dist.get_rank())
        loss = engine(inputs.to(dtype), targets, mode="loss")["loss"]
        engine.backward(loss)
        engine.step()


def engine_truth(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """What the engine holds, full, through DeepSpeed's API (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    base = engine.optimizer
    while not isinstance(base, torch.optim.Optimizer):
        base = base.optimizer
    keys = ("momentum_buffer",) if isinstance(base, torch.optim.SGD) else MOMENTS
    truth: dict[str, dict[str, torch.Tensor]] = {"params": {}}
    truth.update({key: {} for key in keys})
    zero = engine.zero_optimization_stage() > 0
    # DeepSpeed 0.19.8 links the optimizer state of the first parameter group only: with
    # two groups, safe_get_full_optimizer_state raises for the second ("exp_avg not found
    # in optimizer state fragment"). Those kinds take their moments from `oracle`.
    moments = len(engine.optimizer.param_groups) == 1
    for name, param in engine.module.named_parameters():
        if zero:
            truth["params"][name] = safe_get_full_fp32_param(param).detach().clone()
            for key in keys if moments else ():
                truth[key][name] = safe_get_full_optimizer_state(param, key).detach().clone()
        else:  # ZeRO-0 in fp32: the module is the master, the client optimizer its state
            truth["params"][name] = param.detach().clone()
            for key in keys:
                truth[key][name] = engine.optimizer.state[param][key].detach().clone()
    return truth


def save_engines(root: str) -> None:
    """DeepSpeed's own folders (``engine.save_checkpoint``) and, for ZeRO-1, a comm
    checkpoint folder of format ``deepspeed`` (``comm_zero1``), with the engines' truth."""
    for kind in FP32 + BF16 + GROUPS + SGD:
        model, optim = wrapped(kind)
        engine = model.model
        train(engine, range(2), torch.bfloat16 if kind.endswith("_bf16") else torch.float32)
        engine.save_checkpoint(f"{root}/{kind}", tag="global_step2")
        if kind == "zero1":
            save_checkpoint(
                f"{root}/comm_zero1", model=model, optim_wrapper=optim, strategy="deepspeed"
            )
        truth = engine_truth(engine)
        if dist.get_rank() == 0:
            torch.save(truth, f"{root}/truth_{kind}.pt")
        dist.barrier()


@pytest.fixture(scope="module")
def saved(comm_pools: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ds_convert")
    comm_pools.get(2).run(save_engines, str(root), timeout=300)
    return root


def truth_of(root: Path, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    truth: dict[str, dict[str, torch.Tensor]] = torch.load(root / f"truth_{kind}.pt")
    if kind.endswith("_groups"):
        truth.update({key: oracle(kind)[key] for key in MOMENTS})
    return truth


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


NAMES = ["lin1.weight", "lin1.bias", "lin2.weight", "lin2.bias", "head.weight", "head.bias"]


@pytest.mark.parametrize("kind", FP32 + BF16)
def test_offline_reader_equals_what_the_engine_holds(saved: Path, kind: str) -> None:
    truth = truth_of(saved, kind)
    # No allow_unsafe_pickle anywhere: every file loads with weights_only=True.
    state = read_folder(saved / kind / "global_step2")
    assert state.stage == int(kind[4])
    assert state.world_size == 2
    assert state.bf16 == kind.endswith("_bf16")
    assert state.global_steps == 2
    assert list(state.model) == NAMES
    assert all(value.dtype == torch.float32 for value in state.model.values())
    assert max_diff(state.model, truth["params"]) == 0.0
    assert state.optim is not None
    for key in MOMENTS:
        moments = {name: entry[key] for name, entry in state.optim["state"].items()}
        assert max_diff(moments, truth[key]) == 0.0, key
    assert {float(entry["step"]) for entry in state.optim["state"].values()} == {2.0}
    [group] = state.optim["param_groups"]
    assert group["params"] == NAMES
    assert (group["lr"], group["weight_decay"], group["betas"]) == (0.01, 0.01, (0.9, 0.999))
    # What comm's loaders call for a DeepSpeed folder elsewhere: the same, without the opt-in.
    save_dir, tag = ds_files.split_folder(saved / kind)
    consolidated = read_folder(save_dir / tag, optimizer=False, allow_unsafe_pickle=False).model
    assert max_diff(consolidated, truth["params"]) == 0.0


@pytest.mark.parametrize("kind", GROUPS)
def test_offline_reader_keeps_each_parameter_group(saved: Path, kind: str) -> None:
    truth = truth_of(saved, kind)
    state = read_folder(saved / kind / "global_step2")
    assert max_diff(state.model, truth["params"]) == 0.0
    assert state.optim is not None
    weights, biases = state.optim["param_groups"]
    assert weights["params"] == ["lin1.weight", "lin2.weight", "head.weight"]
    assert (weights["lr"], weights["weight_decay"]) == (0.01, 0.01)
    assert biases["params"] == ["lin1.bias", "lin2.bias", "head.bias"]
    assert (biases["lr"], biases["weight_decay"]) == (0.02, 0.0)
    assert max_diff(state.model, oracle(kind)["params"]) < 1e-6  # the oracle is independent
    for key in MOMENTS:
        moments = {name: entry[key] for name, entry in state.optim["state"].items()}
        assert max_diff(moments, truth[key]) < 1e-6, key


def test_offline_reader_takes_sgd_momentum(saved: Path) -> None:
    truth = truth_of(saved, "zero2_sgd")
    state = read_folder(saved / "zero2_sgd" / "global_step2")
    assert max_diff(state.model, truth["params"]) == 0.0
    assert state.optim is not None
    assert {tuple(entry) for entry in state.optim["state"].values()} == {("momentum_buffer",)}
    momentum = {name: entry["momentum_buffer"] for name, entry in state.optim["state"].items()}
    assert max_diff(momentum, truth["momentum_buffer"]) == 0.0
    [group] = state.optim["param_groups"]
    assert (group["momentum"], group["lr"], group["params"]) == (0.9, 0.01, NAMES)


@pytest.mark.parametrize("kind", BF16)
def test_bf16_masters_come_out_fp32_exact_not_the_bf16_copy(saved: Path, kind: str) -> None:
    truth = truth_of(saved, kind)
    state = read_folder(saved / kind / "global_step2")
    assert max_diff(state.model, truth["params"]) == 0.0
    # The masters carry bits the bf16 copy lost: reading the bf16 weights would not pass.
    rounded = {name: value.bfloat16().float() for name, value in state.model.items()}
    assert max_diff(rounded, state.model) > 0.0


def other_precision(root: str) -> dict[str, float]:
    """A bf16 engine's folder loaded into an fp32 engine of the same stage and world size:
    its optimizer files have the other names (``bf16_zero_pp_rank_*``), so the backend's
    ``native_checkpoint().fits`` refuses it and the folder is read offline."""
    model, optim = wrapped("zero2", seed=3)
    load_checkpoint(f"{root}/zero2_bf16", model=model, optim_wrapper=optim)
    held = engine_truth(model.model)
    truth: dict[str, dict[str, torch.Tensor]] = torch.load(f"{root}/truth_zero2_bf16.pt")
    return {key: max_diff(held[key], truth[key]) for key in truth}


def test_a_folder_of_another_precision_loads_offline_into_an_engine(
    comm_pools: Any, saved: Path
) -> None:
    for result in comm_pools.get(2).run(other_precision, str(saved), timeout=300):
        assert result == {"params": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}


# --------------------------------------------- to DeepSpeed's universal layout and back


def load_universal(cases: list[tuple[str, str, str]]) -> list[dict[str, float]]:
    """Load universal folders into fresh engines with plain DeepSpeed: ``(folder, engine
    kind, source kind)`` each; the differences from what the source engine held."""
    out = []
    for folder, kind, source in cases:
        engine = engine_of(kind, seed=7, universal=True)
        zero0 = engine.zero_optimization_stage() == 0
        # ZeRO-0 has no universal loader: it reads the module and optimizer of these files.
        path, _ = engine.load_checkpoint(folder, tag="universal" if zero0 else None)
        assert path is not None
        truth = truth_of(Path(folder).parent.parent, source)
        got = engine_truth(engine)
        if kind.endswith("_groups"):
            got.update(flat_moments(engine))
        diffs = {key: max_diff(got[key], truth[key]) for key in ("params", *state_keys(kind))}
        if kind.endswith("_groups"):  # the source's moments came from the oracle
            diffs.update({key: float(diffs[key] >= 1e-6) for key in MOMENTS})
        groups = engine.optimizer.param_groups
        diffs["lr"] = abs(groups[0]["lr"] - 0.01)  # the saved hyperparameters, not seed 7's
        if kind.endswith("_groups"):
            diffs["lr_biases"] = abs(groups[1]["lr"] - 0.02)
        diffs["global_steps"] = abs(engine.global_steps - 2)
        # Training goes on as plain torch from the saved state would (tolerance: the sums'
        # order; a wrong step count, moment or learning rate moves the weights by ~1e-3).
        train(engine, range(2, 3))
        expected = one_more_step(truth, kind, dist.get_world_size())
        diffs["next_step"] = float(max_diff(engine_truth(engine)["params"], expected) >= 1e-6)
        out.append(diffs)
    return out


def one_more_step(
    truth: dict[str, dict[str, torch.Tensor]], kind: str, world: int
) -> dict[str, torch.Tensor]:
    """Plain torch: the saved weights and optimizer state (step 2), one step on the global
    batch of step 2 at ``world`` ranks."""
    module = Net()
    named = dict(module.named_parameters())
    with torch.no_grad():
        for name, param in named.items():
            param.copy_(truth["params"][name])
    optimizer = optimizer_of(module, kind, 0.01)
    for name, param in named.items():
        optimizer.state[param] = {key: truth[key][name].clone() for key in state_keys(kind)}
        if not kind.endswith("_sgd"):  # torch's SGD keeps no step
            optimizer.state[param]["step"] = torch.tensor(2.0)
    inputs, targets = global_batch(2, 0, world)
    module(inputs, targets, mode="loss")["loss"].backward()
    optimizer.step()
    return {name: param.detach().clone() for name, param in named.items()}


def flat_moments(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The moments of a ZeRO-1/2 engine in a world of one, by name: each group's flat
    state cut in the group's parameter order (DeepSpeed's layout with one partition)."""
    named = {param: name for name, param in engine.module.named_parameters()}
    out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in MOMENTS}
    zero = engine.optimizer
    for group, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
        state = zero.optimizer.state[flat]
        offset = 0
        for param in group:
            for key in MOMENTS:
                piece = state[key].narrow(0, offset, param.numel())
                out[key][named[param]] = piece.view_as(param).clone()
            offset += param.numel()
    return out


@pytest.fixture(scope="module")
def universal(saved: Path) -> Path:
    """The ZeRO-2 (AdamW in one and two parameter groups, SGD) and the bf16 ZeRO-3 folders
    (world 2) converted to DeepSpeed's universal layout, offline."""
    for kind in ("zero2", "zero3_bf16", "zero2_groups", "zero2_sgd"):
        folder = convert_checkpoint(saved / kind, saved / "universal" / kind, to="deepspeed")
        assert (folder / "latest_universal").read_text() == "universal"
    return saved / "universal"


@pytest.mark.parametrize(
    ("world", "cases"),
    [
        (1, [("zero2", "zero3"), ("zero2_groups", "zero1_groups"), ("zero2_sgd", "zero1_sgd")]),
        (3, [("zero2", "zero1")]),
        (2, [("zero2", "zero0"), ("zero3_bf16", "zero2")]),
    ],
    ids=[
        "zero2-to-zero3-and-groups-world1",
        "zero2-to-zero1-world3",
        "to-zero0-and-bf16-to-fp32-world2",
    ],
)
def test_universal_loads_into_other_stages_and_world_sizes(
    comm_pools: Any, universal: Path, world: int, cases: list[tuple[str, str]]
) -> None:
    runs = [(str(universal / source), kind, source) for source, kind in cases]
    for results in comm_pools.get(world).run(load_universal, runs, timeout=240):
        for (source, kind), diffs in zip(cases, results):
            assert all(value == 0.0 for value in diffs.values()), (source, kind, diffs)


def test_universal_folder_reads_back_offline(saved: Path, tmp_path: Path) -> None:
    truth = truth_of(saved, "zero3")
    folder = convert_checkpoint(saved / "zero3", tmp_path / "universal", to="deepspeed")
    back = read_folder(folder / "universal")
    assert max_diff(back.model, truth["params"]) == 0.0
    assert back.optim is not None
    for key in MOMENTS:
        moments = {name: entry[key] for name, entry in back.optim["state"].items()}
        assert max_diff(moments, truth[key]) == 0.0
    plain = convert_checkpoint(folder, tmp_path / "weights.pt")
    assert max_diff(torch.load(plain, weights_only=True), truth["params"]) == 0.0
    # Every file of the universal folder is plain data: weights_only loads each.
    for file in folder.rglob("*.pt"):
        torch.load(file, weights_only=True)


# ------------------------------------------------ to comm folders, into a plain module


@pytest.mark.parametrize("to", ["full", "sharded"])
@pytest.mark.parametrize("kind", ["zero1", "zero3_bf16"])
def test_full_and_sharded_load_into_a_plain_module_with_optimizer_of(
    saved: Path, tmp_path: Path, to: str, kind: str
) -> None:
    truth = truth_of(saved, kind)
    folder = convert_checkpoint(saved / kind, tmp_path / to, to=to)
    manifest = read_manifest(folder)
    assert manifest.format == ("dcp" if to == "sharded" else "full")
    assert manifest.has_optimizer
    assert manifest.world_size == 2
    torch.manual_seed(9)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(folder, model=model, optim_wrapper=OptimWrapper(optimizer))
    params = dict(model.named_parameters())
    assert max_diff({k: v.detach() for k, v in params.items()}, truth["params"]) == 0.0
    for key in MOMENTS:
        moments = {name: optimizer.state[param][key] for name, param in params.items()}
        assert max_diff(moments, truth[key]) == 0.0
    assert {float(optimizer.state[p]["step"]) for p in params.values()} == {2.0}
    assert optimizer.param_groups[0]["lr"] == 0.01


def test_deepspeeds_own_folder_refuses_two_optimizers_and_loads_the_weights(saved: Path) -> None:
    """DeepSpeed's folder holds one optimizer: a wrapper of two is refused before anything
    loads, with the folder, the stage, the world and the way out; the weights then load."""
    truth = truth_of(saved, "zero1")
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    halves = (list(model.parameters())[:2], list(model.parameters())[2:])
    wrappers = OptimWrapperDict(
        a=OptimWrapper(torch.optim.AdamW(halves[0], lr=0.5)),
        b=OptimWrapper(torch.optim.AdamW(halves[1], lr=0.5)),
    )
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(saved / "zero1", model=model, optim_wrapper=wrappers)
    message = str(caught.value)
    assert f"{saved / 'zero1' / 'global_step2'} holds the optimizer state of DeepSpeed ZeRO-1" in (
        message
    )
    assert "on 2 rank(s)" in message
    assert "DeepSpeed has one optimizer, the optim wrapper has ['a', 'b']" in message
    assert "load_optimizer=False" in message
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    load_checkpoint(saved / "zero1", model=model, optim_wrapper=wrappers, load_optimizer=False)
    params = {k: v.detach() for k, v in model.named_parameters()}
    assert max_diff(params, truth["params"]) == 0.0


def test_a_comm_deepspeed_folder_refuses_optimizer_state_that_cannot_move(
    saved: Path, tmp_path: Path
) -> None:
    """A comm folder of format deepspeed without its portable copy (format version 1),
    loaded with its optimizer into a model whose optimizer state has no portable form: the
    refusal names the folder passed, the stage, the world, the reason and what
    load_optimizer=False still loads; nothing is loaded."""
    from comm_wrappers.backends import Backend

    class NotPortable(Backend):
        def optimizer_not_portable(self) -> str | None:
            return "its optimizer keeps mixed-precision state of its own"

    source = tmp_path / "epoch_3"
    shutil.copytree(saved / "comm_zero1", source)
    for name in ("model.pt", "optim.pt"):
        (source / name).unlink()
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(source, model=NotPortable(model), optim_wrapper=optimizer)
    assert str(caught.value) == (
        f"{source} holds the optimizer state of DeepSpeed ZeRO-1 on 2 rank(s), which cannot "
        "load into this module model: its optimizer keeps mixed-precision state of its own. "
        "Pass load_optimizer=False to load the weights (and schedulers, RNG, user state) only."
    )
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not optimizer.state


@pytest.mark.parametrize("portable", [True, False], ids=["portable-copy", "native-files-only"])
def test_a_comm_deepspeed_folder_converts_with_its_optimizer(
    saved: Path, tmp_path: Path, portable: bool
) -> None:
    """A comm folder of format deepspeed: from its model.pt/optim.pt, or (a folder without
    them, as format version 1 wrote) from DeepSpeed's files under deepspeed/state."""
    truth = truth_of(saved, "zero1")
    source = tmp_path / "source"
    shutil.copytree(saved / "comm_zero1", source)
    assert read_manifest(source).format == "deepspeed"
    if not portable:
        for name in ("model.pt", "optim.pt"):
            (source / name).unlink(missing_ok=True)
    folder = convert_checkpoint(source, tmp_path / "full", to="full")
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(folder, model=model, optim_wrapper=OptimWrapper(optimizer))
    params = dict(model.named_parameters())
    assert max_diff({k: v.detach() for k, v in params.items()}, truth["params"]) == 0.0
    for key in MOMENTS:
        moments = {name: optimizer.state[param][key] for name, param in params.items()}
        assert max_diff(moments, truth[key]) == 0.0


@pytest.fixture(scope="module")
def deepspeeds_universal(saved: Path) -> Path:
    """DeepSpeed's own ds_to_universal run on the ZeRO-3 and the two-group ZeRO-2 folders,
    both at once (each is a process that imports DeepSpeed)."""
    runs = {}
    for kind in ("zero3", "zero2_groups"):
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        command += ["--input_folder", str(saved / kind / "global_step2")]
        command += ["--output_folder", str(saved / "ds_universal" / kind)]
        command += ["--inject_missing_state"]  # ZeRO 1/2: a client's universal info (none)
        runs[kind] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    for kind, run in runs.items():
        output, _ = run.communicate(timeout=180)
        assert run.returncode == 0, (kind, output[-3000:])
    return saved / "ds_universal"


@pytest.mark.parametrize("kind", ["zero3", "zero2_groups"])
def test_deepspeeds_own_universal_folder_reads_offline(
    saved: Path, deepspeeds_universal: Path, kind: str
) -> None:
    """What DeepSpeed's ds_to_universal writes (ZeRO-3: flat tensors and no step.pt;
    ZeRO-2: groups named by index) reads the same as the folder it came from."""
    out = deepspeeds_universal / kind
    truth = truth_of(saved, kind)
    state = read_folder(out)
    assert max_diff(state.model, truth["params"]) == 0.0
    assert state.optim is not None
    for key in MOMENTS:
        moments = {name: entry[key] for name, entry in state.optim["state"].items()}
        assert max_diff(moments, truth[key]) < (1e-6 if kind.endswith("_groups") else 1e-30)
    assert {float(entry["step"]) for entry in state.optim["state"].values()} == {2.0}
    names = [group["params"] for group in state.optim["param_groups"]]
    lrs = [group["lr"] for group in state.optim["param_groups"]]
    if kind.endswith("_groups"):
        assert names == [NAMES[0::2], NAMES[1::2]]
        assert lrs == [0.01, 0.02]
    else:
        assert names == [NAMES]
        assert lrs == [0.01]


def test_a_tensor_parallel_folder_is_refused_by_name(saved: Path, tmp_path: Path) -> None:
    folder = tmp_path / "tp"
    shutil.copytree(saved / "zero1" / "global_step2", folder)
    shutil.copy(folder / "mp_rank_00_model_states.pt", folder / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match="tensor-, pipeline- or expert-parallel save"):
        read_folder(folder)


class ClientObject:
    """A user's object in DeepSpeed's client state: not one of DeepSpeed's plain records."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_a_file_holding_other_objects_needs_the_opt_in(saved: Path, tmp_path: Path) -> None:
    folder = tmp_path / "client"
    shutil.copytree(saved / "zero1" / "global_step2", folder)
    states = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)
    states["client"] = ClientObject(3)  # engine.save_checkpoint(client_state={...}) does this
    torch.save(states, folder / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError) as refused:
        read_folder(folder)
    assert "allow_unsafe_pickle=True" in str(refused.value)
    assert "ClientObject" in str(refused.value)  # names what was refused
    truth = truth_of(saved, "zero1")
    state = read_folder(folder, allow_unsafe_pickle=True)
    assert max_diff(state.model, truth["params"]) == 0.0
