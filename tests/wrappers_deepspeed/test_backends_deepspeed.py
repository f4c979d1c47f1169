"""The backend contract for DeepSpeed engines (ZeRO 0-3) on a real 2-rank gloo world.

The same checks as ``tests/wrappers/test_backends.py`` where they apply to an engine:
what DeepSpeed does itself (the gradient sync, clipping, its own checkpoint files) the
adapter leaves to it, and says so.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import comm_collectives as dist
from comm_wrappers.backends import backend_of
from comm_wrappers.deepspeed import initialize
from tests.helpers import caught, full_params, max_diff
from tests.wrappers.net import BATCH, batch, global_batch, make_net, make_optimizer

EXACT = 1e-6


def _config(stage: int, bf16: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,
    }


def _new_weights() -> dict[str, torch.Tensor]:
    """Hand-set weights, unlike any initialisation: entry i of a tensor is 0.01 * (i + k)."""
    out = {}
    for k, (name, value) in enumerate(make_net().state_dict().items()):
        out[name] = (torch.arange(value.numel(), dtype=value.dtype) + k).view_as(value) * 0.01
    return out


def _oracle_step(weights: dict[str, torch.Tensor]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One process: the net with ``weights``, one AdamW step on every rank's batch."""
    net = make_net()
    net.load_state_dict(weights)
    optimizer = make_optimizer(net.parameters(), "adamw")
    inputs, targets = global_batch(0, 0, dist.get_world_size())
    net(inputs, targets, mode="loss")["loss"].backward()
    optimizer.step()
    return net, optimizer


def _engine(stage: int, bf16: bool) -> tuple[Any, Any]:
    """A fresh engine of the test net (and its optim wrapper)."""
    model = make_net()
    return initialize(
        model,
        _config(stage, bf16),
        make_optimizer(model.parameters(), "adamw"),
        inputs_to_half=[0] if bf16 else None,
    )


def native_files(backend: Any, stage: int, bf16: bool, root: str) -> dict[str, Any]:
    """`native_checkpoint()`: DeepSpeed's own files saved, loaded into a fresh engine (read
    by the ``torch_load`` given, the engine's own reader put back after), and which
    folders `fits` takes: by stage, world size and the precision of the optimizer files."""
    world = dist.get_world_size()
    native = backend.native_checkpoint()
    folder = Path(root) / "native"
    native.save(folder, "tag")
    saved = backend.model_state(full=True)
    out: dict[str, Any] = {"latest": (folder / "latest").exists()}

    fresh, _ = _engine(stage, bf16)
    fresh_backend = backend_of(fresh)
    read: list[str] = []

    def recording_load(path: Any, map_location: Any = None) -> Any:
        read.append(Path(path).name)
        return torch.load(path, map_location=map_location, weights_only=False)

    loaded = fresh_backend.native_checkpoint().load(
        folder, "tag", strict=True, load_optimizer=True, torch_load=recording_load
    )
    out["loaded"] = loaded
    out["read_by_torch_load"] = sorted(set(read))
    out["reader_put_back"] = "load" not in vars(fresh_backend.engine.checkpoint_engine)
    out["round_trip"] = max_diff(fresh_backend.model_state(full=True), saved)
    # no tag and no 'latest' file: DeepSpeed loads nothing and says so
    out["nothing"] = fresh_backend.native_checkpoint().load(
        folder / "empty", None, strict=True, load_optimizer=False, torch_load=None
    )

    tag_dir = folder / "tag"
    with tempfile.TemporaryDirectory() as scratch:
        other = Path(scratch)  # optimizer files of the other precision (names only)
        name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        (other / (name if bf16 else "bf16_" + name)).touch()
        out["fits"] = {
            "saved": native.fits(stage, world, tag_dir),
            "other_stage": native.fits((stage + 1) % 4, world, tag_dir),
            "other_world": native.fits(stage, world + 1, tag_dir),
            "unknown": native.fits(None, None, tag_dir),
            "no_optimizer_files": native.fits(stage, world, Path(scratch) / "missing"),
            "other_precision": native.fits(stage, world, other),
        }
    out["optim_files"] = sorted(p.name for p in tag_dir.glob("*optim_states.pt"))
    return out


def contract(stage: int, bf16: bool, root: str) -> dict[str, Any]:
    """Every check of the backend contract on one engine; the measured values."""
    rank = dist.get_rank()
    plain = make_net()
    model = make_net()
    # A bf16 engine runs the model in bf16: its float inputs must be cast too.
    wrapper, optim = initialize(
        model,
        _config(stage, bf16),
        make_optimizer(model.parameters(), "adamw"),
        inputs_to_half=[0] if bf16 else None,
    )
    backend = backend_of(wrapper)
    out: dict[str, Any] = {
        "kind": backend.kind,
        "engine_found": backend.engine is wrapper.model and backend.model is wrapper,
        "engine_itself": backend_of(wrapper.model).kind,
        "describe": backend.describe(),
        "formats": [backend.format_for(s) for s in (None, True, False)],
        "compute_device": str(backend.compute_device()),
        "scaler": type(backend.grad_scaler("cpu")).__name__,
        "clip": caught(backend.clip_grad_norm, list(model.parameters()), max_norm=1.0),
        "sharded_state": caught(backend.model_state, full=False),
        "not_portable": backend.optimizer_not_portable(),
    }
    with backend.no_sync():  # nothing to skip: the engine syncs by its own config
        pass
    dtype = "bfloat16" if bf16 else "float32"
    out["shapes"] = backend.param_shapes() == {
        n: [list(v.shape), dtype] for n, v in plain.state_dict().items()
    }
    full = backend.model_state(full=True)
    out["full_state"] = max_diff(
        full, {n: v.to(full[n].dtype) for n, v in plain.state_dict().items()}
    )
    rank0 = backend.model_state(full=True, rank0_only=True)
    out["rank0_state"] = sorted(rank0) if rank == 0 else rank0

    # Hand-set weights in: they come out again, and the next step starts from them (the
    # fp32 master copy was refreshed, or ZeRO's step would bring the old weights back).
    weights = _new_weights()
    backend.load_model_state(weights, full=True, strict=True)
    loaded = backend.model_state(full=True)
    out["loaded"] = max_diff(loaded, {n: v.to(loaded[n].dtype) for n, v in weights.items()})
    wrapper.train_step(batch(0, 0, rank), optim)
    net, oracle_optim = _oracle_step(weights)
    out["stepped"] = max_diff(full_params(wrapper), dict(net.named_parameters()))

    if out["not_portable"] is None:  # the moments, by parameter name, at any stage
        names = [n for n, _ in net.named_parameters()]
        expected = {names[i]: s["exp_avg"] for i, s in oracle_optim.state_dict()["state"].items()}
        # a snapshot: on the CPU the full state shares memory with the live moments
        state = copy.deepcopy(backend.optim_state(optim.optimizer, full=True))
        out["exp_avg"] = max_diff({n: s["exp_avg"] for n, s in state["state"].items()}, expected)
        wrapper.train_step(batch(1, 0, rank), optim)
        backend.load_optim_state(optim.optimizer, state, full=True)
        again = backend.optim_state(optim.optimizer, full=True)
        out["optim_round_trip"] = max_diff(
            {n: s["exp_avg"] for n, s in again["state"].items()}, expected
        )
        rank0_optim = backend.optim_state(optim.optimizer, full=True, rank0_only=True)
        out["rank0_optim"] = sorted(rank0_optim["state"]) if rank == 0 else rank0_optim
    else:
        out["optim_state"] = caught(backend.optim_state, optim.optimizer, full=True)
    out["native"] = native_files(backend, stage, bf16, root)
    return out


@pytest.mark.parametrize(
    ("stage", "bf16"), [(0, False), (1, False), (2, False), (3, False), (0, True), (2, True)]
)
def test_every_zero_stage_passes_the_backend_contract(
    comm_run_distributed: Any, tmp_path: Path, stage: int, bf16: bool
) -> None:
    names = ["head.bias", "head.weight", "lin1.bias", "lin1.weight", "lin2.bias", "lin2.weight"]
    runs = comm_run_distributed(contract, stage, bf16, str(tmp_path), timeout=180)
    for rank, r in enumerate(runs):
        assert r["kind"] == r["engine_itself"] == "deepspeed"
        assert r["engine_found"]
        assert r["describe"] == {"wrapper": "deepspeed", "sharding": None, "zero_stage": stage}
        assert r["formats"] == ["deepspeed", "deepspeed", "full"]
        assert r["compute_device"] == "cpu"
        assert r["scaler"] == "GradScaler"
        assert r["clip"][0] == "RuntimeError"
        assert "gradient_clipping=1.0 in its config" in r["clip"][1]
        assert r["sharded_state"][0] == "ValueError"
        assert "DeepSpeed's own checkpoint files" in r["sharded_state"][1]
        assert r["shapes"]
        assert r["full_state"] < (1e-2 if bf16 else EXACT)
        assert r["rank0_state"] == (names if rank == 0 else {})
        assert r["loaded"] < (1e-2 if bf16 else EXACT)
        assert r["stepped"] < (2e-2 if bf16 else EXACT)
        if stage > 0 or not bf16:  # ZeRO 1-3 (DeepSpeed's per-parameter API), ZeRO-0 fp32
            tolerance = 1e-2 if bf16 else EXACT
            assert r["not_portable"] is None
            assert r["exp_avg"] < tolerance
            assert r["optim_round_trip"] < tolerance
            assert r["rank0_optim"] == (names if rank == 0 else {})
        else:
            assert "ZeRO stage 0 in bf16 or fp16" in r["not_portable"]
            assert "has no per-parameter full form" in r["not_portable"]
            assert r["optim_state"] == ("ValueError", r["not_portable"])
        native = r["native"]
        assert not native["latest"]  # saved without a 'latest' file
        assert native["loaded"] is True
        assert any(n.endswith("model_states.pt") for n in native["read_by_torch_load"])
        assert native["reader_put_back"]
        assert native["round_trip"] == 0.0
        assert native["nothing"] is False
        assert native["fits"] == {
            "saved": True,
            "other_stage": False,
            "other_world": False,
            "unknown": False,
            "no_optimizer_files": True,
            "other_precision": False,
        }
        if stage > 0:  # ZeRO 1-3 partition the optimizer: one file per rank, named by precision
            prefix = "bf16_zero_pp_rank_" if bf16 else "zero_pp_rank_"
            assert len(native["optim_files"]) == 2
            assert all(name.startswith(prefix) for name in native["optim_files"])
