"""DeepSpeed's folders read offline and converted, checked against real engines.

One module-scoped run at world 2 trains DeepSpeed engines (ZeRO 0-3 in fp32, ZeRO 2 and 3
in bf16) two steps, saves each with ``engine.save_checkpoint`` and writes what the engine
itself holds, gathered with DeepSpeed's own ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` (ZeRO-0: the module and the torch optimizer's state):
the truth the offline reader and the conversions must reproduce, independent of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_strategies.checkpoint import convert_checkpoint, load_checkpoint, read_manifest
from comm_strategies.checkpoint._deepspeed_offline import read_folder
from comm_wrappers import OptimWrapper
from tests.wrappers.net import BATCH, Net, batch

FP32 = ["zero0", "zero1", "zero2", "zero3"]
BF16 = ["zero2_bf16", "zero3_bf16"]
MOMENTS = ("exp_avg", "exp_avg_sq")


def engine_of(kind: str, *, seed: int = 0, universal: bool = False) -> Any:
    """A DeepSpeed engine of ``kind`` (``zeroN`` or ``zeroN_bf16``) with a torch AdamW."""
    from comm_wrappers.deepspeed import initialize

    torch.manual_seed(seed)
    module = Net()
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01 + seed, weight_decay=0.01)
    stage = int(kind[4])
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "checkpoint": {"load_universal": universal and stage > 0},
    }
    if kind.endswith("_bf16"):
        config["bf16"] = {"enabled": True}
    model, _ = initialize(module, config, optimizer)
    return model.model


def train(engine: Any, steps: range, dtype: torch.dtype = torch.float32) -> None:
    for step in steps:
        inputs, targets = batch(step, 0, dist.get_rank())
        loss = engine(inputs.to(dtype), targets, mode="loss")["loss"]
        engine.backward(loss)
        engine.step()


def engine_truth(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """What the engine holds, full, through DeepSpeed's API (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    truth: dict[str, dict[str, torch.Tensor]] = {"params": {}}
    truth.update({key: {} for key in MOMENTS})
    zero = engine.zero_optimization_stage() > 0
    for name, param in engine.module.named_parameters():
        if zero:
            truth["params"][name] = safe_get_full_fp32_param(param).detach().clone()
            for key in MOMENTS:
                truth[key][name] = safe_get_full_optimizer_state(param, key).detach().clone()
        else:  # ZeRO-0 in fp32: the module is the master, the client optimizer its state
            truth["params"][name] = param.detach().clone()
            for key in MOMENTS:
                truth[key][name] = engine.optimizer.state[param][key].detach().clone()
    return truth


def save_engines(root: str) -> None:
    for kind in FP32 + BF16:
        engine = engine_of(kind)
        train(engine, range(2), torch.bfloat16 if kind.endswith("_bf16") else torch.float32)
        engine.save_checkpoint(f"{root}/{kind}", tag="global_step2")
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


@pytest.mark.parametrize("kind", BF16)
def test_bf16_masters_come_out_fp32_exact_not_the_bf16_copy(saved: Path, kind: str) -> None:
    truth = truth_of(saved, kind)
    state = read_folder(saved / kind / "global_step2")
    assert max_diff(state.model, truth["params"]) == 0.0
    # The masters carry bits the bf16 copy lost: reading the bf16 weights would not pass.
    rounded = {name: value.bfloat16().float() for name, value in state.model.items()}
    assert max_diff(rounded, state.model) > 0.0


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
        diffs = {key: max_diff(got[key], truth[key]) for key in ("params", *MOMENTS)}
        groups = engine.optimizer.param_groups
        diffs["lr"] = abs(groups[0]["lr"] - 0.01)  # the saved hyperparameters, not seed 7's
        diffs["global_steps"] = abs(engine.global_steps - 2)
        out.append(diffs)
    return out


@pytest.fixture(scope="module")
def universal(saved: Path) -> Path:
    """The ZeRO-2 and the bf16 ZeRO-3 folders (world 2) converted to DeepSpeed's universal
    layout, offline."""
    for kind in ("zero2", "zero3_bf16"):
        folder = convert_checkpoint(saved / kind, saved / "universal" / kind, to="deepspeed")
        assert (folder / "latest_universal").read_text() == "universal"
    return saved / "universal"


@pytest.mark.parametrize(
    ("world", "cases"),
    [
        (1, [("zero2", "zero3")]),
        (3, [("zero2", "zero1")]),
        (2, [("zero2", "zero0"), ("zero3_bf16", "zero2")]),
    ],
    ids=["zero2-to-zero3-world1", "zero2-to-zero1-world3", "to-zero0-and-bf16-to-fp32-world2"],
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
def test_full_and_sharded_load_into_a_plain_module_with_adamw(
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
