"""``activation_checkpointing=`` on every strategy: the same parameters as without it.

A net of two blocks (each a linear layer and a tanh) trains 2 steps of AdamW, clipping by
norm, under each strategy on 4 gloo ranks (DeepSpeed on 2), once with ``activation_checkpointing={Block}``
and once without. The parameters must equal each other and the one-process oracle (within
1e-6, 1e-5 for the 2-D mesh), and the blocks' forward must run twice as often with it (the
recomputation in the backward happened).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

import comm_collectives as dist
from comm_strategies import build_strategy
from comm_strategies._activation import apply_activation_checkpointing, is_checkpointed
from comm_wrappers import unwrap_model
from tests.helpers import full_params, max_diff

STEPS, BATCH = 2, 4
ADAMW = {"type": "AdamW", "lr": 0.01, "weight_decay": 0.01}


class Block(nn.Module):
    """A linear layer and a tanh; counts its forward calls (recomputations included)."""

    calls = 0

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return torch.tanh(self.lin(x))


class BlockNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block1, self.block2 = Block(4, 8), Block(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, inputs: torch.Tensor, targets: Any = None, mode: str = "tensor") -> Any:
        out = self.head(self.block2(self.block1(inputs)))
        if mode == "loss":
            return {"loss": ((out - targets) ** 2).mean()}
        return out


def block_plan(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"block1.lin": ColwiseParallel(), "block2.lin": RowwiseParallel()}
    parallelize_module(model, mesh["tensor_parallel"], plan)


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 2, generator=generator)


def oracle(world: int) -> dict[str, torch.Tensor]:
    model = BlockNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(STEPS):
        parts = [data(step, rank) for rank in range(world)]
        inputs, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        model(inputs, targets, mode="loss")["loss"].backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return full_params(model)


STRATEGIES: list[tuple[str, dict[str, Any]]] = [
    ("single", {}),
    ("ddp", {}),
    ("fsdp", {}),
    ("fsdp2", {}),
    ("deepspeed", {"zero_stage": 3}),
    ("model_parallel", {"parallelize_fn": block_plan, "tensor_parallel_size": 2}),
]


def train(name: str, options: dict[str, Any], checkpointed: bool) -> tuple[Any, int]:
    extra = {"activation_checkpointing": {Block}} if checkpointed else {}
    strategy = build_strategy(name, seed=0, **options, **extra)
    optim_config = {"optimizer": dict(ADAMW), "clip_grad": {"max_norm": 0.5}}
    model, optim, _ = strategy.prepare(
        BlockNet(),
        optim_wrapper=optim_config,
        dispatch_kwargs={"train_micro_batch_size_per_gpu": BATCH},
    )
    rank = getattr(strategy, "data_parallel_rank", strategy.rank)
    if name == "single":
        rank = 0
    Block.calls = 0
    for step in range(STEPS):
        with optim.optim_context(model):
            loss = model(*data(step, rank), mode="loss")["loss"]
        optim.update_params(loss)
    return model, Block.calls


def compare_all(strategies: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, options in strategies:
        plain, calls = train(name, options, checkpointed=False)
        recomputed, calls_with = train(name, options, checkpointed=True)
        if name == "single":
            world = 1
        elif name == "model_parallel":
            world = dist.get_world_size() // 2
        else:
            world = dist.get_world_size()
        out[name] = {
            "with_vs_without": max_diff(full_params(recomputed), full_params(plain)),
            "with_vs_oracle": max_diff(full_params(recomputed), oracle(world)),
            "calls": (calls, calls_with),
        }
    return out


def check(results: list[dict[str, dict[str, Any]]]) -> None:
    for rank, result in enumerate(results):
        for name, figures in result.items():
            tolerance = 1e-5 if name == "model_parallel" else 1e-6
            assert figures["with_vs_without"] < tolerance, (name, rank, figures)
            assert figures["with_vs_oracle"] < tolerance, (name, rank, figures)
            calls, calls_with = figures["calls"]
            assert calls == 2 * STEPS, (name, figures)  # two blocks, one forward a step
            assert calls_with == 2 * calls, (name, figures)  # and once more in the backward


def test_activation_checkpointing_gives_the_same_parameters(comm_pools: Any) -> None:
    torch_only = [entry for entry in STRATEGIES if entry[0] != "deepspeed"]
    check(comm_pools.get(4).run(compare_all, torch_only, timeout=300))


def test_activation_checkpointing_under_deepspeed_zero3(comm_pools: Any) -> None:
    # On the 2 ranks the other strategy tests start DeepSpeed in already.
    deepspeed = [entry for entry in STRATEGIES if entry[0] == "deepspeed"]
    check(comm_pools.get(2).run(compare_all, deepspeed, timeout=300))


def test_activation_checkpointing_checks_its_classes() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module subclasses"):
        build_strategy("single", activation_checkpointing={"Block"})
    with pytest.raises(ValueError, match="has no module of these classes"):
        apply_activation_checkpointing(nn.Linear(2, 2), {Block})
    model = BlockNet()
    names = [name for name, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model, Block) == 2
    assert apply_activation_checkpointing(model, {Block}) == 0  # applied once only
    assert [name for name, _ in model.named_parameters()] == names
    assert isinstance(model.block1, Block)


class FlagBlock(nn.Module):
    """Takes keyword arguments named like ``torch.utils.checkpoint``'s own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, debug: bool = False, context_fn: Any = None, scale: float = 1.0
    ) -> torch.Tensor:
        out = torch.tanh(self.lin(x)) * scale
        if debug:
            out = out * 0.0
        if context_fn is not None:
            out = context_fn(out)
        return out


def test_checkpointed_modules_get_every_keyword_argument() -> None:
    # debug= and context_fn= were taken by torch.utils.checkpoint instead of the block.
    torch.manual_seed(0)
    plain = FlagBlock()
    recomputed = FlagBlock()
    recomputed.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(recomputed, FlagBlock) == 1
    x = torch.randn(3, 4)
    for kwargs in (
        {"debug": True},
        {"context_fn": torch.neg, "scale": 2.0},
        {"debug": False, "scale": 3.0},
    ):
        expected, got = plain(x, **kwargs), recomputed(x, **kwargs)
        assert torch.equal(expected, got), kwargs
        expected.sum().backward()
        got.sum().backward()
        assert plain.lin.weight.grad is not None
        assert recomputed.lin.weight.grad is not None
        assert torch.equal(plain.lin.weight.grad, recomputed.lin.weight.grad), kwargs
    assert float(plain(x, debug=True).abs().sum()) == 0.0


def test_checkpointed_models_keep_their_classes_names_and_pickle() -> None:
    import copy
    import io

    model = BlockNet()
    keys = list(model.state_dict())
    apply_activation_checkpointing(model, {Block})
    assert type(model.block1) is Block  # the class is not swapped
    assert list(model.state_dict()) == keys  # checkpoints stay portable
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(model)
    x = torch.randn(2, 4)
    for other in (loaded, copied):
        assert type(other.block2) is Block
        assert torch.equal(other(x), model(x))
        other.block1.lin.weight.data.add_(1.0)  # independent of the original
        assert not torch.equal(other.block1.lin.weight, model.block1.lin.weight)
        Block.calls = 0
        other(x).sum().backward()
        assert Block.calls == 4  # still recomputed in the backward (2 blocks x 2)


def autowrap_by_class_name() -> dict[str, dict[str, Any]]:
    """``auto_wrap_policy="Block"`` (a class name) with activation checkpointing of Block."""
    options: dict[str, Any] = {"model_wrapper": {"auto_wrap_policy": "Block"}}
    planned = {**options, "parallelize_fn": block_plan, "tensor_parallel_size": 2}
    return compare_all([("fsdp", options), ("fsdp2", options), ("model_parallel", planned)])


def test_activation_checkpointing_with_auto_wrap_policy_by_class_name(comm_pools: Any) -> None:
    # The renamed class (CheckpointedBlock) made "Block" unknown to the policy.
    results = comm_pools.get(2).run(autowrap_by_class_name, timeout=180)
    for result in results:
        assert set(result) == {"fsdp", "fsdp2", "model_parallel"}
    check(results)


def hooked_forward(module: Block, x: torch.Tensor) -> torch.Tensor:
    """An instance ``forward`` as accelerate-style hooks set one: it counts its calls and
    changes the result (twice the class forward's), so that which forward ran shows."""
    module.hook_calls += 1
    return 2.0 * Block.forward(module, x)


def hooked_net() -> BlockNet:
    model = BlockNet()
    for block in (model.block1, model.block2):
        block.hook_calls = 0
        block.forward = functools.partial(hooked_forward, block)
    return model


def test_a_forward_set_on_the_instance_is_the_one_checkpointed() -> None:
    # The class forward ran instead, dropping the instance's (the hook's) forward.
    plain = hooked_net()
    strategy = build_strategy("single", seed=0, activation_checkpointing={Block})
    recomputed, _, _ = strategy.prepare(hooked_net())
    blocks = [unwrap_model(recomputed).block1, unwrap_model(recomputed).block2]
    assert all(is_checkpointed(block) for block in blocks)
    inputs, targets = data(0, 0)
    expected = plain(inputs, targets, mode="loss")["loss"]
    got = recomputed(inputs, targets, mode="loss")["loss"]
    assert torch.equal(got, expected)
    assert float(expected) != float(BlockNet()(inputs, targets, mode="loss")["loss"])
    expected.backward()
    got.backward()
    wanted = {name: p.grad for name, p in plain.named_parameters()}
    for name, param in unwrap_model(recomputed).named_parameters():
        assert param.grad is not None, name
        assert torch.equal(param.grad, wanted[name]), name
    assert [plain.block1.hook_calls, plain.block2.hook_calls] == [1, 1]
    assert [block.hook_calls for block in blocks] == [2, 2]  # recomputed in the backward
    for block in blocks:  # the hook's forward is kept, recoverable
        assert block.forward.args[1].func is hooked_forward
        assert block.forward.args[1].args == (block,)
    assert apply_activation_checkpointing(recomputed, {Block}) == 0  # applied once only
