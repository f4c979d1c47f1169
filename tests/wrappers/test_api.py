"""Options, errors, the registry and the optimizer wrappers: multi-rank and in one process."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

import comm_collectives as dist
import comm_wrappers
from comm_collectives import NotInitializedError
from comm_wrappers import (
    AmpOptimWrapper,
    LossModel,
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    MMSeparateDistributedDataParallel,
    OptimWrapper,
    OptimWrapperDict,
    is_model_wrapper,
    parse_losses,
    unwrap_model,
)
from tests.helpers import caught, full_params

from .net import BATCH, Gan, Net, batch, make_net, make_optimizer, wrap


class NoMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.lin(inputs)


def bad_inputs() -> dict[str, Any]:
    """Each bad option or model gives an error that says what is valid and how to fix it."""
    policy = {"type": "size_based_auto_wrap_policy", "min_num_params": 10}
    mixed = {"param_dtype": "bfloat16"}
    out: dict[str, Any] = {
        "strategy": caught(lambda: wrap("fsdp", sharding_strategy="FULL_SHARDED")),
        "prefetch": caught(lambda: wrap("fsdp", backward_prefetch="PRE")),
        "policy": caught(lambda: wrap("fsdp", auto_wrap_policy={"type": "size_policy"})),
        "policy_class": caught(lambda: wrap("fsdp", auto_wrap_policy="Block")),
        "mixed": caught(lambda: wrap("fsdp", mixed_precision={"param_dtype": "bf17"})),
        "mixed2_buffer": caught(
            lambda: wrap("fsdp2", mixed_precision={"buffer_dtype": "bfloat16"})
        ),
        "init_fn": caught(lambda: wrap("fsdp", param_init_fn="no_such_init")),
        "ignored": caught(lambda: wrap("fsdp", ignored_modules=["nope"])),
        "clip": caught(
            lambda: OptimWrapper(
                make_optimizer(make_net().parameters(), "sgd"), clip_grad={"type": "l2"}
            )
        ),
    }
    # The accepted forms work and the caller's dicts are left as they were.
    fsdp = wrap("fsdp", auto_wrap_policy=policy, mixed_precision=mixed, cpu_offload=False)
    fsdp2 = wrap("fsdp2", auto_wrap_policy=["Linear"], mixed_precision=mixed)
    out["configs_untouched"] = policy == {
        "type": "size_based_auto_wrap_policy",
        "min_num_params": 10,
    } and mixed == {"param_dtype": "bfloat16"}
    out["fsdp_units"] = sum(isinstance(m, FullyShardedDataParallel) for m in fsdp.modules())
    from torch.distributed.fsdp import FSDPModule

    out["fsdp2_units"] = sum(isinstance(m, FSDPModule) for m in fsdp2.modules())
    no_mode = MMDistributedDataParallel(NoMode())
    wrapper = OptimWrapper(torch.optim.SGD(no_mode.parameters(), lr=0.1))
    out["no_mode"] = caught(lambda: no_mode.train_step((torch.ones(1, 2),), wrapper))
    adapted = MMDistributedDataParallel(LossModel(NoMode(), nn.MSELoss()))
    wrapper = OptimWrapper(torch.optim.SGD(adapted.parameters(), lr=0.1))
    out["adapted"] = sorted(adapted.train_step((torch.ones(1, 2), torch.zeros(1, 1)), wrapper))
    return out


def test_bad_options_say_what_is_valid(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(bad_inputs):
        assert r["strategy"][0] == "ValueError"
        assert "FULL_SHARD, HYBRID_SHARD, NO_SHARD, SHARD_GRAD_OP" in r["strategy"][1]
        assert "got 'FULL_SHARDED'" in r["strategy"][1]
        assert "BACKWARD_POST, BACKWARD_PRE" in r["prefetch"][1]
        assert "size_based_auto_wrap_policy, transformer_auto_wrap_policy" in r["policy"][1]
        assert "'Block' is not a module class of the model" in r["policy_class"][1]
        assert "classes are Linear, Net" in r["policy_class"][1]
        assert "'bf16', 'bfloat16'" in r["mixed"][1]
        assert "got 'bf17'" in r["mixed"][1]
        assert "unknown field(s) buffer_dtype for MixedPrecisionPolicy" in r["mixed2_buffer"][1]
        assert "registered name (reset_parameters)" in r["init_fn"][1]
        assert "no submodule 'nope'; it has head, lin1, lin2" in r["ignored"][1]
        assert "('norm', 'value'), got 'l2'" in r["clip"][1]
        # Accepted forms: the caller's dicts are untouched; every Linear is its own unit
        # (3 Linear layers + the root).
        assert r["configs_untouched"]
        assert r["fsdp_units"] == 4
        assert r["fsdp2_units"] == 4
        assert r["no_mode"][0] == "TypeError"
        assert "NoMode.forward takes no 'mode' argument" in r["no_mode"][1]
        assert "comm_wrappers.LossModel(module, loss_fn)" in r["no_mode"][1]
        assert r["adapted"] == ["loss"]


class PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(2, 1)
        self.unused = nn.Linear(2, 1)

    def forward(self, inputs: torch.Tensor, mode: str = "tensor") -> Any:
        out = self.used(inputs)
        return {"loss": out.sum()} if mode == "loss" else out


def anomalous_params() -> list[str]:
    model = MMDistributedDataParallel(
        PartlyUsed(), detect_anomalous_params=True, find_unused_parameters=True
    )
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.train_step((torch.ones(1, 2),), wrapper)
    return [str(w.message) for w in caught if "took no part" in str(w.message)]


def test_detect_anomalous_params_names_every_unused_parameter(comm_run_distributed: Any) -> None:
    for messages in comm_run_distributed(anomalous_params):
        assert len(messages) == 1
        assert "2 parameter(s)" in messages[0]
        assert "unused.weight, unused.bias" in messages[0]


def registry_builtins() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = make_net()
    ddp = nn.parallel.DistributedDataParallel(net)
    # torch's default mesh is on the machine's accelerator: a gloo world needs a CPU one
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = fully_shard(make_net(), mesh=mesh)
    fsdp1 = FullyShardedDataParallel(make_net(), device_id=torch.device("cpu"))
    ours = MMFullyShardedDataParallel2(make_net())
    return {
        "ddp": (is_model_wrapper(ddp), unwrap_model(ddp) is net),
        "fsdp1": (is_model_wrapper(fsdp1), type(unwrap_model(fsdp1)).__name__),
        "fsdp2": (is_model_wrapper(sharded), unwrap_model(sharded) is sharded),
        "ours2": (is_model_wrapper(ours), unwrap_model(ours) is ours.module),
        "plain": is_model_wrapper(net),
    }


def test_registry_knows_torch_and_our_wrappers(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(registry_builtins):
        assert r == {
            "ddp": (True, True),
            "fsdp1": (True, "Net"),
            "fsdp2": (True, True),
            "ours2": (True, True),
            "plain": False,
        }


def param_init_fn_dict() -> dict[str, Any]:
    """A model built on the meta device, materialised by ``param_init_fn=dict(type=...)``."""
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Net()
    spec = {"type": "reset_parameters", "device": "cpu"}
    original = copy.deepcopy(spec)
    model = MMFullyShardedDataParallel(net, param_init_fn=spec)
    full = full_params(model)
    gathered = dist.all_gather_object({k: v.sum().item() for k, v in full.items()})
    return {
        "devices": sorted({str(p.device) for p in model.parameters()}),
        "same_on_ranks": all(g == gathered[0] for g in gathered),
        "untouched": spec == original,
    }


def test_param_init_fn_as_a_dict_materialises_a_meta_model(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(param_init_fn_dict):
        assert r == {"devices": ["cpu"], "same_on_ranks": True, "untouched": True}


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize(
    "wrapper",
    [
        MMDistributedDataParallel,
        MMSeparateDistributedDataParallel,
        MMFullyShardedDataParallel,
        MMFullyShardedDataParallel2,
    ],
)
def test_wrapping_without_a_process_group_says_to_call_init_dist(wrapper: Any) -> None:
    with pytest.raises(NotInitializedError, match=r"Call comm_collectives.init_dist\('pytorch'\)"):
        wrapper(make_net())


def test_register_model_wrapper_for_a_third_party_wrapper() -> None:
    class Holder(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    net = nn.Linear(1, 1)
    assert not comm_wrappers.is_model_wrapper(Holder(net))
    comm_wrappers.register_model_wrapper(Holder, lambda h: h.inner)
    nested = Holder(nn.DataParallel(net))
    assert comm_wrappers.is_model_wrapper(nested)
    assert comm_wrappers.unwrap_model(nested) is net
    with pytest.raises(ValueError, match="already a registered model wrapper"):
        comm_wrappers.register_model_wrapper(Holder)
    with pytest.raises(TypeError, match="expects a class"):
        comm_wrappers.register_model_wrapper(net)  # type: ignore[arg-type]


def _linear() -> nn.Linear:
    model = nn.Linear(2, 1, bias=False)
    nn.init.ones_(model.weight)
    return model


def test_accumulation_counts_and_the_short_last_update() -> None:
    model = _linear()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=1.0), accumulative_counts=3)
    # 5 passes in all: one update of 3, then a short one of 2 (divided by 2, not 3).
    wrapper.initialize_count_status(model, 0, 5)
    updates, syncs = [], []
    for i in range(5):
        syncs.append(wrapper.should_sync())
        loss = model(torch.full((1, 2), float(i + 1))).sum()
        wrapper.update_params(loss)
        updates.append(wrapper.should_update())
    assert syncs == [False, False, True, False, True]
    assert updates == [False, False, True, False, True]
    # Gradient of the sum is the input: first update (1+2+3)/3 = 2, then (4+5)/2 = 4.5.
    assert model.weight.tolist() == [[1 - 2 - 4.5, 1 - 2 - 4.5]]
    assert wrapper.inner_count == 5


def test_clip_by_value_and_by_norm_in_one_process() -> None:
    model = _linear()
    wrapper = OptimWrapper(
        torch.optim.SGD(model.parameters(), lr=1.0), clip_grad={"type": "value", "clip_value": 0.5}
    )
    wrapper.update_params(model(torch.full((1, 2), 3.0)).sum())
    assert model.weight.tolist() == [[0.5, 0.5]]  # gradient 3 clipped to 0.5
    clip = {"max_norm": 1.0}
    original = copy.deepcopy(clip)
    model = _linear()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=1.0), clip_grad=clip)
    wrapper.update_params(model(torch.full((1, 2), 3.0)).sum())
    # Gradient (3, 3) has norm 3 * sqrt(2); clipped to norm 1: each 1/sqrt(2).
    assert model.weight.detach() == pytest.approx(torch.full((1, 2), 1 - 2**-0.5), abs=1e-6)
    assert float(wrapper.grad_norm) == pytest.approx(3 * 2**0.5)  # type: ignore[arg-type]
    assert clip == original
    with pytest.raises(ValueError, match="needs 'max_norm'"):
        OptimWrapper(torch.optim.SGD(model.parameters(), lr=1.0), clip_grad={"type": "norm"})


def test_optim_wrapper_validates_its_arguments() -> None:
    params = _linear().parameters()
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer, got list"):
        OptimWrapper([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="accumulative_counts must be >= 1, got 0"):
        OptimWrapper(torch.optim.SGD(params, lr=1.0), accumulative_counts=0)


def test_lr_momentum_and_state_dict_round_trip() -> None:
    model = _linear()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    assert wrapper.get_lr() == {"lr": [0.5]}
    assert wrapper.get_momentum() == {"momentum": [0.9]}
    adam = OptimWrapper(torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.99)))
    assert adam.get_momentum() == {"momentum": [0.8]}
    wrapper.update_params(model(torch.ones(1, 2)).sum())
    state = wrapper.state_dict()
    other = OptimWrapper(torch.optim.SGD(_linear().parameters(), lr=0.1, momentum=0.9))
    other.load_state_dict(state)
    assert other.get_lr() == {"lr": [0.5]}
    assert torch.equal(
        other.optimizer.state_dict()["state"][0]["momentum_buffer"],
        state["state"][0]["momentum_buffer"],
    )


def test_amp_bf16_on_cpu_autocasts_and_needs_no_scaler() -> None:
    model = _linear()
    wrapper = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=1.0), dtype="bf16")
    with wrapper.optim_context(model):
        out = model(torch.ones(1, 2))
    assert out.dtype == torch.bfloat16
    assert wrapper.loss_scaler is None
    wrapper.update_params(out.float().sum())
    assert model.weight.tolist() == [[0.0, 0.0]]
    assert "loss_scaler" not in wrapper.state_dict()


def test_amp_float16_scaler_state_round_trips_without_mutating() -> None:
    model = _linear()
    wrapper = AmpOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=1.0), dtype=torch.float16, loss_scale=512.0
    )
    state = wrapper.state_dict()
    assert state["loss_scaler"]["scale"] == 512.0
    saved = copy.deepcopy(state)
    other = AmpOptimWrapper(torch.optim.SGD(_linear().parameters(), lr=1.0), dtype="float16")
    other.load_state_dict(state)
    assert state.keys() == saved.keys()  # the caller's dict keeps "loss_scaler"
    assert other.loss_scaler.get_scale() == 512.0
    with pytest.raises(ValueError, match="loss_scale must be 'dynamic', a number or a dict"):
        AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=1.0), dtype="fp16", loss_scale="x")
    with pytest.raises(ValueError, match=r"dtype must be a torch\.dtype or one of"):
        AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=1.0), dtype="float8")


def test_optim_wrapper_dict() -> None:
    g, d = _linear(), _linear()
    wrappers = OptimWrapperDict(
        generator=OptimWrapper(torch.optim.SGD(g.parameters(), lr=0.1)),
        discriminator=OptimWrapper(torch.optim.SGD(d.parameters(), lr=0.2, momentum=0.5)),
    )
    assert list(wrappers) == ["generator", "discriminator"]
    assert wrappers.get_lr() == {"generator.lr": [0.1], "discriminator.lr": [0.2]}
    assert wrappers.get_momentum() == {"generator.momentum": [0], "discriminator.momentum": [0.5]}
    with pytest.raises(NotImplementedError, match=r"optim_wrapper\[name\].update_params"):
        wrappers.update_params(torch.tensor(1.0))
    with pytest.raises(KeyError, match="expected keys"):
        wrappers.load_state_dict({"generator": {}})
    state = wrappers.state_dict()
    assert set(state) == {"generator", "discriminator"}
    wrappers.load_state_dict(state)
    with pytest.raises(TypeError, match="wrap the optimizer in OptimWrapper first"):
        OptimWrapperDict(g=torch.optim.SGD(g.parameters(), lr=0.1))  # type: ignore[arg-type]


def test_parse_losses_follows_mmengine() -> None:
    loss, log_vars = parse_losses(
        {
            "loss_cls": torch.tensor([1.0, 3.0]),
            "loss_box": [torch.tensor(1.0), torch.tensor([2.0, 4.0])],
            "acc": torch.tensor(0.5),
        }
    )
    assert float(loss) == 2.0 + 4.0  # mean 2, plus 1 + mean 3
    assert list(log_vars) == ["loss", "loss_cls", "loss_box", "acc"]
    assert float(log_vars["acc"]) == 0.5
    with pytest.raises(ValueError, match="no key of the losses contains 'loss'"):
        parse_losses({"acc": torch.tensor(1.0)})
    with pytest.raises(
        TypeError, match="loss 'loss' must be a tensor or a list of tensors, got float"
    ):
        parse_losses({"loss": 1.0})


def test_loss_model_adapter() -> None:
    model = LossModel(_linear(), nn.L1Loss())
    losses = model(torch.ones(1, 2), torch.zeros(1, 1), mode="loss")
    assert float(losses["loss"].detach()) == 2.0
    with pytest.raises(ValueError, match=r"needs targets: pass the batch as \(inputs, targets\)"):
        model(torch.ones(1, 2), mode="loss")
    with pytest.raises(ValueError, match="mode must be one of 'loss', 'predict', 'tensor'"):
        model(torch.ones(1, 2), mode="train")


def doctor_check() -> list[tuple[str, bool, str]]:
    from comm_wrappers.doctor import check

    return [(r.name, r.ok, r.detail) for r in check()]


def test_doctor_check_runs_one_ddp_step(comm_run_distributed: Any) -> None:
    for results in comm_run_distributed(doctor_check, world_size=3):
        (name, ok, detail), deepspeed_row = results
        assert (name, ok) == ("ddp train_step", True), detail
        assert deepspeed_row[0] == "deepspeed"


def test_doctor_check_in_a_plain_process_is_not_applicable() -> None:
    from comm_wrappers.doctor import check

    ddp_row, deepspeed_row = check()  # no process group in pytest's process
    assert (ddp_row.name, ddp_row.ok, ddp_row.detail) == (
        "ddp train_step", True, "n/a (no process group)"
    )  # fmt: skip
    assert deepspeed_row.name == "deepspeed"


def test_deepspeed_module_without_deepspeed_says_how_to_install() -> None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("DeepSpeed is installed here; this checks an environment without it")
    with pytest.raises(
        ImportError, match=r'pip install --no-build-isolation "comm-wrappers\[deepspeed\]"'
    ):
        import comm_wrappers.deepspeed  # noqa: F401


def fsdp1_clip_without_the_model() -> tuple[str, str] | None:
    """update_params outside optim_context under FSDP1: clipping by norm refuses the shard."""
    model = wrap("fsdp")
    wrapper = OptimWrapper(
        make_optimizer(model.parameters(), "sgd"), clip_grad={"type": "norm", "max_norm": 0.1}
    )
    inputs, targets = batch(0, 0, dist.get_rank())
    loss = model(inputs, targets, mode="loss")["loss"]
    return caught(lambda: wrapper.update_params(loss))


def test_fsdp1_clipping_without_the_model_raises(comm_run_distributed: Any) -> None:
    for name, message in comm_run_distributed(fsdp1_clip_without_the_model):
        assert name == "RuntimeError"
        assert "instead of this rank's shard" in message
        assert "optim_wrapper.optim_context(model)" in message


class Overflowing(nn.Module):
    """Rank 0's gradient of ``a`` overflows in float16; ``rest`` is finite everywhere."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.ones(4))
        self.rest = nn.Linear(16, 16)

    def forward(self, inputs: torch.Tensor, big: torch.Tensor, mode: str = "tensor") -> Any:
        return {"loss": (self.a * big).sum() + self.rest(inputs).float().pow(2).mean()}


def fp16_overflow_on_one_rank_under_fsdp1() -> dict[str, Any]:
    """Every rank skips the step and lowers the scale, with or without use_fsdp."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    out = {}
    big = torch.tensor(1e35 if dist.get_rank() == 0 else 1.0)
    for use_fsdp in (False, True):
        model = MMFullyShardedDataParallel(Overflowing())
        wrapper = AmpOptimWrapper(
            torch.optim.SGD(model.parameters(), lr=0.1), dtype="float16", use_fsdp=use_fsdp
        )
        before = full_params(model)
        model.train_step((torch.ones(2, 16), big), wrapper)
        after = full_params(model)
        out[use_fsdp] = {
            "sharded": isinstance(wrapper.loss_scaler, ShardedGradScaler),
            "scale": float(wrapper.loss_scaler.get_scale()),
            "stepped": bool((before["rest.weight"] != after["rest.weight"]).any()),
        }
    return out


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere_under_fsdp1(
    comm_run_distributed: Any,
) -> None:
    results = comm_run_distributed(fp16_overflow_on_one_rank_under_fsdp1)
    for use_fsdp in (False, True):
        states = [r[use_fsdp] for r in results]
        # Without use_fsdp the scaler is switched to FSDP's sharded one at the first step.
        assert all(s["sharded"] for s in states)
        assert {s["scale"] for s in states} == {65536.0 / 2}
        assert not any(s["stepped"] for s in states)


def custom_policy_units() -> tuple[int, int]:
    """FSDP units made under torch's CustomPolicy picking the Linear layers of 8 outputs."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp.wrap import CustomPolicy

    policy = CustomPolicy(lambda module: isinstance(module, nn.Linear) and module.out_features == 8)
    fsdp1 = wrap("fsdp", auto_wrap_policy=policy)
    fsdp2 = wrap("fsdp2", auto_wrap_policy=policy)
    return (
        sum(isinstance(m, FullyShardedDataParallel) for m in fsdp1.modules()),
        sum(isinstance(m, FSDPModule) for m in fsdp2.modules()),
    )


def test_a_custom_wrap_policy_makes_a_unit_of_each_module_it_picks(
    comm_run_distributed: Any,
) -> None:
    for units in comm_run_distributed(custom_policy_units):
        # The policy picks lin1 and lin2 (8 outputs each), plus the root: under FSDP1 and FSDP2.
        assert units == (3, 3)


def accumulate_under_a_static_graph() -> tuple[str, str]:
    model = MMDistributedDataParallel(make_net(), static_graph=True)
    wrapper = OptimWrapper(make_optimizer(model.parameters(), "sgd"), accumulative_counts=2)
    return caught(model.train_step, batch(0, 0, 0), wrapper)


def test_ddp_with_a_static_graph_refuses_to_skip_the_gradient_sync(
    comm_run_distributed: Any,
) -> None:
    for name, message in comm_run_distributed(accumulate_under_a_static_graph):
        assert name == "ValueError"
        assert "static_graph=True cannot skip the gradient sync" in message


def clip_with_the_inner_module_in_optim_context() -> tuple[str, str]:
    """Clipping by norm under FSDP1 when optim_context is given the user's module."""
    model = wrap("fsdp", auto_wrap_policy=["Linear"])
    wrapper = OptimWrapper(make_optimizer(model.parameters(), "sgd"), clip_grad={"max_norm": 0.1})
    inputs, targets = batch(0, 0, dist.get_rank())
    with wrapper.optim_context(model):  # the first forward decides the root
        model(inputs, targets, mode="loss")["loss"].backward()
    wrapper.zero_grad()

    def step_with_inner_module() -> None:
        with wrapper.optim_context(unwrap_model(model)):
            loss = model(inputs, targets, mode="loss")["loss"]
        wrapper.update_params(loss)

    return caught(step_with_inner_module)


def test_fsdp1_clipping_given_the_inner_module_says_to_pass_the_wrapper(
    comm_run_distributed: Any,
) -> None:
    for name, message in comm_run_distributed(clip_with_the_inner_module_in_optim_context):
        assert name == "RuntimeError"
        assert "pass the FSDP wrapper itself" in message


def clip_a_nonfinite_norm() -> tuple[str, str]:
    """A NaN batch under FSDP1 with ``error_if_nonfinite=True`` clipping."""
    model = wrap("fsdp")
    wrapper = OptimWrapper(
        make_optimizer(model.parameters(), "sgd"),
        clip_grad={"max_norm": 0.1, "error_if_nonfinite": True},
    )
    _, targets = batch(0, 0, dist.get_rank())
    nan_batch = (torch.full((BATCH, 4), float("nan")), targets)
    return caught(model.train_step, nan_batch, wrapper)


def test_fsdp1_clipping_a_nonfinite_norm_raises_under_error_if_nonfinite(
    comm_run_distributed: Any,
) -> None:
    for name, message in comm_run_distributed(clip_a_nonfinite_norm):
        assert name == "RuntimeError"
        assert "(not finite) and clip_grad has error_if_nonfinite=True" in message


class WithOwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.child = nn.Linear(2, 2)


def separate_ddp_of_a_module_with_its_own_parameter() -> tuple[str, str]:
    return caught(MMSeparateDistributedDataParallel, WithOwnParameter())


def test_separate_ddp_refuses_a_module_that_holds_parameters_itself(
    comm_run_distributed: Any,
) -> None:
    for name, message in comm_run_distributed(separate_ddp_of_a_module_with_its_own_parameter):
        assert name == "ValueError"
        assert "holds trainable parameters itself (scale)" in message


def separate_ddp_val_step_without_the_modules_own() -> tuple[str, str]:
    return caught(lambda: MMSeparateDistributedDataParallel(Gan()).val_step(None))


def test_separate_ddp_val_step_says_to_define_it_on_the_module(comm_run_distributed: Any) -> None:
    for name, message in comm_run_distributed(separate_ddp_val_step_without_the_modules_own):
        assert name == "AttributeError"
        assert "Gan has none: define val_step" in message


def fsdp2_given_a_sharding_strategy() -> tuple[str, str]:
    return caught(wrap, "fsdp2", sharding_strategy="FULL_SHARD")


def test_fsdp2_refuses_sharding_strategy_and_names_its_own_option(
    comm_run_distributed: Any,
) -> None:
    for name, message in comm_run_distributed(fsdp2_given_a_sharding_strategy):
        assert name == "TypeError"
        assert "no 'sharding_strategy': reshard_after_forward=True" in message


def fsdp1_with_module_classes_to_ignore() -> str:
    mixed = {"_module_classes_to_ignore": (nn.BatchNorm1d,)}
    return type(wrap("fsdp", mixed_precision=mixed)).__name__


def test_fsdp1_mixed_precision_takes_torchs_module_classes_to_ignore(
    comm_run_distributed: Any,
) -> None:
    names = comm_run_distributed(fsdp1_with_module_classes_to_ignore)
    assert names == ["MMFullyShardedDataParallel", "MMFullyShardedDataParallel"]


def test_unwrap_model_of_a_compiled_module() -> None:
    net = nn.Linear(2, 2)
    compiled = torch.compile(net)
    assert comm_wrappers.is_model_wrapper(compiled)
    assert comm_wrappers.unwrap_model(compiled) is net


def test_to_device_moves_only_what_is_elsewhere() -> None:
    # what MMDeepSpeedEngineWrapper.forward does with a plain loop's batch under a GPU engine
    from comm_wrappers._model import to_device

    cpu = torch.device("cpu")
    flat = (torch.ones(2), torch.zeros(1))
    assert to_device(flat, cpu) is flat  # already there: the same object, no copy
    kwargs: dict[str, Any] = {}
    assert to_device(kwargs, cpu) is kwargs
    nested = (torch.ones(2), {"labels": [torch.zeros(1)]})  # not flat: cast_data_device
    moved = to_device(nested, cpu)
    assert moved is not nested
    assert moved[1]["labels"][0].device == cpu
    assert torch.equal(moved[0], nested[0])
    # a model on the meta device (built before materialisation): the batch is left alone
    assert to_device(nested, torch.device("meta")) is nested


def test_a_nonfinite_norm_raises_before_any_gradient_is_scaled() -> None:
    # torch checks error_if_nonfinite before it scales: the gradients stay as they were
    model = nn.Linear(2, 1)
    wrapper = OptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1),
        clip_grad={"max_norm": 1.0, "error_if_nonfinite": True},
    )
    model.weight.grad = torch.ones(1, 2)
    model.bias.grad = torch.tensor([float("inf")])
    with pytest.raises(RuntimeError, match="non-finite"):
        wrapper.step()
    assert model.weight.grad.tolist() == [[1.0, 1.0]]
    assert wrapper.optimizer.state == {}  # and the step did not run


class _OwnNoSync(nn.Module):
    """A wrapper of the user's own with a ``no_sync()``: accumulation must enter it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 1)
        self.entered = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.inner(inputs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.entered += 1
        yield


def test_a_models_own_no_sync_is_entered_on_the_micro_steps() -> None:
    model = _OwnNoSync()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=2)
    for _ in range(4):
        with wrapper.optim_context(model):
            loss = model(torch.ones(1, 2)).sum()
        wrapper.update_params(loss)
    assert model.entered == 2  # micro-steps 1 and 3 skip the sync; 2 and 4 sync
