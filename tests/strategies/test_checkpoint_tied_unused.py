"""Resume a model with a tied weight and a parameter that never got a gradient.

``Tied`` ties ``out.weight`` to ``mid.weight`` (one parameter, two names in its state
dict) and holds ``unused``, a trainable layer its forward never calls: no gradient ever
reaches it, so a torch optimizer keeps no state for it. Sources (one process, FSDP2 in
DCP shards, DeepSpeed ZeRO-1 and ZeRO-2) train ``BEFORE`` steps at world 2 and save;
targets (these and ZeRO-3) resume each at worlds 1 and 2, train ``AFTER`` more steps,
and must equal one plain-torch process that never stopped (AdamW without weight decay: DeepSpeed's flat
partitions step the unused layer with a zero gradient, which leaves it unchanged, as
torch leaves it), within the matrix's 1e-5.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

import comm_collectives as dist
from comm_strategies.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from comm_wrappers import MMFullyShardedDataParallel2, OptimWrapper
from tests.helpers import full_params, max_diff
from tests.strategies.ckpt_models import strategy_of

SOURCES = ["single", "fsdp2", "zero1", "zero2"]
GLOBAL_BATCH = 8
BEFORE, AFTER = 2, 2
TOLERANCE = 1e-5


class Tied(nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.mid = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.mid.weight  # tied: state-dict names mid.weight and out.weight
        if unused:
            self.unused = nn.Linear(8, 8)  # trainable, never called: no gradient, no state

    def forward(self, inputs: torch.Tensor, targets: Any = None, mode: str = "tensor") -> Any:
        out = self.out(torch.tanh(self.mid(torch.tanh(self.lin1(inputs)))))[:, :2]
        if mode == "loss":
            return {"loss": ((out - targets) ** 2).mean()}
        return out


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, 4, generator=generator), torch.randn(
        GLOBAL_BATCH, 2, generator=generator
    )


def my_share(step: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = global_batch(step)
    if kind == "single":
        return inputs, targets
    size = GLOBAL_BATCH // dist.get_world_size()
    rows = slice(dist.get_rank() * size, (dist.get_rank() + 1) * size)
    return inputs[rows], targets[rows]


def build(kind: str, seed: int, unused: bool) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    module = Tied(unused)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.0)
    if kind.startswith("zero"):
        from comm_wrappers.deepspeed import initialize

        config = {
            "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
            "zero_optimization": {"stage": int(kind[-1])},
            "gradient_clipping": 0.0,
        }
        return initialize(module, config, optimizer)
    model: Any = MMFullyShardedDataParallel2(module) if kind == "fsdp2" else module
    if kind == "fsdp2":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    return model, OptimWrapper(optimizer)


def train(kind: str, model: Any, optim: Any, steps: range) -> None:
    for step in steps:
        data = my_share(step, kind)
        if hasattr(model, "train_step"):
            model.train_step(data, optim)
        else:
            optim.update_params(model(*data, mode="loss")["loss"])


def oracle(unused: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Tied(unused)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    for step in range(BEFORE + AFTER):
        inputs, targets = global_batch(step)
        model(inputs, targets, mode="loss")["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not unused or model.unused.weight not in optimizer.state  # what sources carry
    return full_params(model)


def save_sources(root: str, unused: bool, kinds: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in kinds or SOURCES:
        model, optim = build(kind, 0, unused)
        train(kind, model, optim, range(BEFORE))
        path = save_checkpoint(
            f"{root}/{kind}", model=model, optim_wrapper=optim, strategy=strategy_of(kind)
        )
        if kind == "single" and dist.get_rank() == 0:
            saved = torch.load(path / "optim.pt", weights_only=True)["default"]["state"]
            out["saved_states"] = sorted(saved)
    return out


def resume_all(root: str, targets: list[str], unused: bool) -> dict[str, float]:
    expected = oracle(unused)
    out: dict[str, float] = {}
    for target in targets:
        for source in SOURCES:
            model, optim = build(target, 123, unused)
            try:
                load_checkpoint(f"{root}/{source}", model=model, optim_wrapper=optim)
            except Exception as error:
                raise AssertionError(
                    f"{target}<-{source} at world {dist.get_world_size()}"
                ) from error
            train(target, model, optim, range(BEFORE, BEFORE + AFTER))
            out[f"{target}<-{source}"] = max_diff(full_params(model), expected)
    return out


def resume_everywhere(comm_pools: Any, root: str, unused: bool) -> None:
    for world, targets in ((2, [*SOURCES[1:], "zero3"]), (1, ["single", "zero2"])):
        results = comm_pools.get(world).run(resume_all, root, targets, unused, timeout=600)
        for rank_results in results:
            assert len(rank_results) == len(targets) * len(SOURCES)
            failed = {case: d for case, d in rank_results.items() if not d <= TOLERANCE}
            assert not failed, (world, failed)


def test_tied_weights_resume_under_every_kind(comm_pools: Any, tmp_path: Any) -> None:
    """Every name of the tied weight is in the checkpoint; DeepSpeed ZeRO-1/2 took
    ``out.weight`` for a stranger ("not in the model") from every source, its own too."""
    saved = comm_pools.get(2).run(save_sources, str(tmp_path), False, timeout=300)
    assert saved[0]["saved_states"] == ["lin1.bias", "lin1.weight", "mid.weight"]
    resume_everywhere(comm_pools, str(tmp_path), unused=False)


def test_parameters_without_optimizer_state_resume_under_every_kind(
    comm_pools: Any, tmp_path: Any
) -> None:
    """The unused layer has no optimizer state in the checkpoint: it gets none on resume
    (torch's loads refused: DCP's "Missing key in checkpoint state_dict", the full
    "Missing optimizer state for parameter")."""
    saved = comm_pools.get(2).run(save_sources, str(tmp_path), True, timeout=300)
    assert saved[0]["saved_states"] == ["lin1.bias", "lin1.weight", "mid.weight"]
    resume_everywhere(comm_pools, str(tmp_path), unused=True)


def load_damaged(root: str) -> tuple[str, str]:
    """An FSDP2 checkpoint whose shard files are empty: torch's load raises its
    CheckpointException, a BaseException that ``except Exception`` let through."""
    if dist.get_rank() == 0:
        shutil.copytree(f"{root}/fsdp2", f"{root}/damaged")
        for shard in Path(f"{root}/damaged").rglob("*.distcp"):
            shard.write_bytes(b"")
    dist.barrier()
    model, optim = build("fsdp2", 123, True)
    try:
        load_checkpoint(f"{root}/damaged", model=model, optim_wrapper=optim)
    except BaseException as error:  # the type is the result
        return type(error).__name__, str(error)
    return "", ""


def test_a_damaged_dcp_checkpoint_raises_checkpoint_error_on_every_rank(
    comm_pools: Any, tmp_path: Any
) -> None:
    comm_pools.get(2).run(save_sources, str(tmp_path), True, ("fsdp2",), timeout=300)
    results = comm_pools.get(2).run(load_damaged, str(tmp_path), timeout=300)
    for rank, (kind, message) in enumerate(results):
        assert kind == "CheckpointError", (rank, kind, message[:500])
        assert f"{tmp_path}/damaged" in message, message
        assert f"on rank {rank}" in message, message


def load_into_more_parameters(root: str) -> tuple[str, str]:
    """The saved optimizer trained all but ``lin1.bias`` (and holds ``unused`` without
    state); the target's trains ``lin1.bias`` too: a strict load refuses it."""
    torch.manual_seed(0)
    model = Tied(True)
    held = [p for n, p in model.named_parameters() if n != "lin1.bias"]
    optim = OptimWrapper(torch.optim.AdamW(held, lr=0.01, weight_decay=0.0))
    train("single", model, optim, range(BEFORE))
    save_checkpoint(f"{root}/partial", model=model, optim_wrapper=optim, strategy="single")
    target, target_optim = build("single", 123, True)
    try:
        load_checkpoint(f"{root}/partial", model=target, optim_wrapper=target_optim)
    except CheckpointError as error:
        return type(error).__name__, str(error)
    return "", ""


def test_a_parameter_the_saved_optimizer_did_not_hold_is_still_refused(
    comm_pools: Any, tmp_path: Any
) -> None:
    for kind, message in comm_pools.get(1).run(load_into_more_parameters, str(tmp_path)):
        assert kind == "CheckpointError", message
        assert "lin1.bias" in message, message
        assert "strict=False" in message, message
