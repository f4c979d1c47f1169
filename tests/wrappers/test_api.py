"""Options, errors, the registry and the optimizer wrappers: multi-rank and in one process."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

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
    parse_losses,
)

from . import cases


def test_bad_options_say_what_is_valid(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(cases.bad_inputs):
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


def test_detect_anomalous_params_names_every_unused_parameter(comm_run_distributed: Any) -> None:
    for messages in comm_run_distributed(cases.anomalous_params):
        assert len(messages) == 1
        assert "2 parameter(s)" in messages[0]
        assert "unused.weight, unused.bias" in messages[0]


def test_registry_knows_torch_and_our_wrappers(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(cases.registry_builtins):
        assert r == {
            "ddp": (True, True),
            "fsdp1": (True, "Net"),
            "fsdp2": (True, True),
            "ours2": (True, True),
            "plain": False,
        }


def test_param_init_fn_as_a_dict_materialises_a_meta_model(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(cases.param_init_fn_dict):
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
        wrapper(cases.make_net())


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


def test_doctor_check_runs_one_ddp_step(comm_run_distributed: Any) -> None:
    for results in comm_run_distributed(cases.doctor_check, world_size=3):
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


def test_fsdp1_clipping_without_the_model_raises(comm_run_distributed: Any) -> None:
    for name, message in comm_run_distributed(cases.fsdp1_clip_without_the_model):
        assert name == "RuntimeError"
        assert "instead of this rank's shard" in message
        assert "optim_wrapper.optim_context(model)" in message


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere_under_fsdp1(
    comm_run_distributed: Any,
) -> None:
    results = comm_run_distributed(cases.fp16_overflow_on_one_rank_under_fsdp1)
    for use_fsdp in (False, True):
        states = [r[use_fsdp] for r in results]
        # Without use_fsdp the scaler is switched to FSDP's sharded one at the first step.
        assert all(s["sharded"] for s in states)
        assert {s["scale"] for s in states} == {65536.0 / 2}
        assert not any(s["stepped"] for s in states)


def test_review_regressions(comm_run_distributed: Any) -> None:
    for r in comm_run_distributed(cases.review_errors):
        # The policy picks lin1 and lin2 (8 outputs each), plus the root.
        assert r["custom1"] == 3
        assert r["custom2"] == 3
        assert r["static"][0] == "ValueError"
        assert "static_graph=True cannot skip the gradient sync" in r["static"][1]
        assert r["inner"][0] == "RuntimeError"
        assert "pass the FSDP wrapper itself" in r["inner"][1]
        assert r["nonfinite"][0] == "RuntimeError"
        assert "(not finite) and clip_grad has error_if_nonfinite=True" in r["nonfinite"][1]
        assert r["own_param"][0] == "ValueError"
        assert "holds trainable parameters itself (scale)" in r["own_param"][1]
        assert r["no_train_step"][0] == "AttributeError"
        assert "Gan has none: define val_step" in r["no_train_step"][1]
        assert r["fsdp2_strategy"][0] == "TypeError"
        assert "no 'sharding_strategy': reshard_after_forward=True" in r["fsdp2_strategy"][1]
        assert r["mp_ignore"] == "MMFullyShardedDataParallel"


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
