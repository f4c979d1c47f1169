"""Checkpoints saved by an earlier commit keep loading with today's code.

``legacy/make_fixtures.py`` saved, with the code of the commit that kept them, a tiny model
(``legacy/model.py``) trained 2 AdamW steps with a StepLR scheduler under each layout of
``legacy/v<FORMAT_VERSION>/``, and what a load must bring back (``reference.pt``): the
parameters, AdamW's moments, the scheduler's state, ``extra``, the draws the saved RNG
state gives, and the parameters after one more step (what a resume computes). Every rank
trained on the same batches, so every layout holds the values of one plain torch run.

Each test copies the fixtures, loads them into fresh models (initialised elsewhere) in a
world of 1 or 2 gloo ranks, and compares with the reference exactly.
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import comm_collectives as dist
from comm_strategies.checkpoint import CheckpointError, load_checkpoint, read_manifest
from tests.helpers import full_params

from .legacy import model as m

LEGACY = Path(__file__).parent / "legacy"
VERSIONS = sorted(p.name for p in LEGACY.glob("v*") if (p / "reference.pt").is_file())
FORMAT = {"single": "full", "amp_fp16": "full", "ddp": "full", "fsdp2_full": "full",
          "fsdp": "dcp", "fsdp2": "dcp", "zero0": "deepspeed", "zero2": "deepspeed"}  # fmt: skip
DEEPSPEED = ["zero0", "zero2"]


@pytest.fixture(scope="module", params=VERSIONS)
def legacy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of one format version's fixtures (a load never touches the committed files)."""
    root = tmp_path_factory.mktemp("legacy") / request.param
    shutil.copytree(LEGACY / request.param, root)
    return root


def _reference(root: Path) -> dict[str, Any]:
    reference: dict[str, Any] = torch.load(root / "reference.pt")
    return reference


def _lists(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {name: value.tolist() for name, value in sorted(tensors.items())}


def _moments_lists(moments: dict[str, dict[str, torch.Tensor]] | None) -> Any:
    if moments is None:
        return None
    return {name: _lists(entry) for name, entry in sorted(moments.items())}


# ---------------------------------------------------------------- run on every rank


def load_layouts(root: str, cases: list[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    """Load each ``(layout, target kind, load options)`` into a fresh model of that kind.

    Returns, per layout, what the load left as plain lists (the pool's pipes carry no
    tensors): the fresh parameters, the loaded parameters, moments, scheduler state and
    ``extra``, the next draws of the restored RNG, and the parameters one step later.
    """
    out = {}
    for layout, target, options in cases:
        model, optim, scheduler = m.build(target, seed=123)
        result: dict[str, Any] = {"fresh": _lists(full_params(model))}
        torch.manual_seed(99)  # the load must bring the saved RNG state back
        random.seed(99)
        result["extra"] = load_checkpoint(
            f"{root}/{layout}",
            model=model,
            optim_wrapper=optim,
            schedulers=[scheduler],
            **options,
        )
        result["draws"] = (torch.rand(3).tolist(), random.random())
        result["params"] = _lists(full_params(model))
        result["scheduler"] = m.scheduler_state(scheduler)
        result["last_lr"] = scheduler.get_last_lr()
        if options.get("load_optimizer", True):
            result["moments"] = _moments_lists(m.moments(model, optim))
            if target == "amp_fp16":
                result["scaler"] = optim.loss_scaler.state_dict()
            m.train_step(model, optim, scheduler, m.STEPS)
            result["params_next"] = _lists(full_params(model))
        out[layout] = result
    return out


def load_refused(root: str, layout: str) -> str:
    """Load ``layout`` into a plain model, weights only, without ``allow_unsafe_pickle``."""
    model, _, _ = m.build("single", seed=123)
    try:
        load_checkpoint(f"{root}/{layout}", model=model, load_optimizer=False)
    except CheckpointError as error:
        return str(error)
    return f"no error on rank {dist.get_rank()}"


# ---------------------------------------------------------------- assertions


def _assert_loaded(layout: str, result: dict[str, Any], reference: dict[str, Any]) -> None:
    """What one rank loaded equals what the saving rank recorded, value for value."""
    expected = _lists(reference["params"])
    fresh_gap = max(
        abs(a - b)
        for name in expected
        for a, b in zip(torch.tensor(result["fresh"][name]).flatten().tolist(),
                        torch.tensor(expected[name]).flatten().tolist())
    )  # fmt: skip
    assert fresh_gap > 1e-2, (layout, fresh_gap)  # a load that did nothing cannot pass
    assert result["params"] == expected, layout
    assert result["extra"] == reference["extra"] == {"step": 2}, layout
    assert result["scheduler"] == reference["scheduler"], layout
    # StepLR(step_size=1, gamma=0.5) from 0.01, stepped twice.
    assert result["last_lr"] == reference["last_lr"] == [0.0025], layout
    draws, value = reference["draws"]
    assert result["draws"] == (draws.tolist(), value), layout
    if "params_next" in result:
        assert result["params_next"] == _lists(reference["params_next"]), layout
        if result["moments"] is not None and reference["moments"] is not None:
            assert result["moments"] == _moments_lists(reference["moments"]), layout
    if "scaler" in result:
        assert result["scaler"] == reference["scaler"], layout


# ---------------------------------------------------------------- tests


def test_references_equal_a_plain_torch_run(legacy: Path) -> None:
    """The recorded values are right: plain torch, no comm code, gives them bit for bit."""
    torch.manual_seed(m.SEED)
    net = m.TinyNet()
    optimizer = torch.optim.AdamW(net.parameters(), lr=m.LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    initial = {n: p.detach().clone() for n, p in net.named_parameters()}
    for step in range(m.STEPS + 1):
        if step == m.STEPS:  # the state the checkpoints hold
            trained = {n: p.detach().clone() for n, p in net.named_parameters()}
            moments = {n: {k: v.clone() for k, v in optimizer.state[p].items()}
                       for n, p in net.named_parameters()}  # fmt: skip
        inputs, targets = m.batch(step)
        ((net(inputs) - targets) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    after_next = {n: p.detach().clone() for n, p in net.named_parameters()}
    assert _lists(initial) != _lists(trained)
    layouts = _reference(legacy)["layouts"]
    assert sorted(layouts) == sorted(FORMAT)
    for layout, ranks in layouts.items():
        if layout == "amp_fp16":  # float16 autocast: other values, checked by its own load
            continue
        for reference in ranks:
            assert _lists(reference["params"]) == _lists(trained), layout
            assert _lists(reference["params_next"]) == _lists(after_next), layout
            if reference["moments"] is not None:
                assert _moments_lists(reference["moments"]) == _moments_lists(moments), layout


def test_manifests_record_the_layout_that_saved_them(legacy: Path) -> None:
    for layout, ranks in _reference(legacy)["layouts"].items():
        manifest = read_manifest(legacy / layout)
        assert manifest.format_version == int(legacy.name[1:])
        assert manifest.format == FORMAT[layout]
        assert manifest.world_size == len(ranks) == m.WORLD[layout]
        assert manifest.has_optimizer
        assert manifest.num_schedulers == 1
        assert manifest.has_scaler == (layout == "amp_fp16")
        assert manifest.extra_keys == ["step"]
        assert manifest.zero_stage == (int(layout[-1]) if layout in DEEPSPEED else None)
        assert sorted(manifest.params) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]


def test_world_2_layouts_load_into_the_layout_that_saved_them(
    comm_pools: Any, legacy: Path
) -> None:
    """Optimizer, scheduler, RNG and extra under the same layout: a resume continues exactly.

    DeepSpeed's own files load here without ``allow_unsafe_pickle``.
    """
    layouts = _reference(legacy)["layouts"]
    cases = [(layout, layout, {}) for layout in layouts if m.WORLD[layout] == 2]
    results = comm_pools.get(2).run(load_layouts, str(legacy), cases, timeout=300)
    for rank, result in enumerate(results):
        assert sorted(result) == sorted(c[0] for c in cases)
        for layout, loaded in result.items():
            assert "params_next" in loaded
            _assert_loaded(layout, loaded, layouts[layout][rank])


def test_every_layout_loads_into_a_plain_model_in_one_process(
    comm_pools: Any, legacy: Path
) -> None:
    """Every layout with its optimizer state, DeepSpeed's included (read offline, its fp32
    masters and ZeRO partitions joined), without ``allow_unsafe_pickle``: the next step
    equals the plain run's."""
    layouts = _reference(legacy)["layouts"]
    cases = [(layout, "amp_fp16" if layout == "amp_fp16" else "single", {}) for layout in layouts]
    [result] = comm_pools.get(1).run(load_layouts, str(legacy), cases, timeout=300)
    assert sorted(result) == sorted(layouts)
    for layout, loaded in result.items():
        assert "params_next" in loaded, layout
        _assert_loaded(layout, loaded, layouts[layout][0])  # rank 0's RNG state


def _plant_an_object(tag_dir: Path) -> None:
    """Put an object of a class DeepSpeed's files never hold into one of its files."""
    path = tag_dir / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    states["planted"] = argparse.Namespace(note="not a DeepSpeed record")
    torch.save(states, path)


@pytest.mark.parametrize("layout", DEEPSPEED)
def test_deepspeed_files_holding_other_objects_need_allow_unsafe_pickle(
    comm_pools: Any, legacy: Path, tmp_path: Path, layout: str
) -> None:
    """Only DeepSpeed's record classes are allowed: a file with any other object is refused
    without the opt-in (the error names it), and loads with it."""
    root = tmp_path / "planted"
    shutil.copytree(legacy, root)
    _plant_an_object(root / layout / "deepspeed" / "state")
    [message] = comm_pools.get(1).run(load_refused, str(root), layout, timeout=120)
    assert "allow_unsafe_pickle" in message, message
    assert "argparse.Namespace" in message or "Namespace" in message, message
