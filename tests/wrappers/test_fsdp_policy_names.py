"""FSDP options named the way MMEngine configs name them: dotted paths, functions, ``FUNCTIONS``.

From an outside review of the classic MMEngine Runner: MMEngine resolves ``auto_wrap_policy``
and ``param_init_fn`` through its ``FUNCTIONS`` registry, which also takes dotted import paths,
and lazy-import configs give the function itself as ``type``. Each form must wrap the model
exactly as comm's short name does, under FSDP1 and FSDP2 on 2 gloo ranks.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

from tests.helpers import caught, full_params

from .net import wrap

SIZE_POLICY = "torch.distributed.fsdp.wrap.size_based_auto_wrap_policy"
FILL = 0.25


def pick_width_8(module: nn.Module) -> bool:
    """lin1 and lin2 of the test net (8 outputs), not the head."""
    return isinstance(module, nn.Linear) and module.out_features == 8


def width_8_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """An FSDP1-style policy function, as a user registers one in MMEngine's FUNCTIONS."""
    return recurse or pick_width_8(module)


def fill_init(module: nn.Module, value: float = FILL) -> None:
    """A ``param_init_fn``: materialise a meta module's own tensors, filled with ``value``."""
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.fill_(value)


def units(model: nn.Module) -> list[str]:
    """The names of the FSDP units (FSDP1 instances or modules ``fully_shard`` was applied to)."""
    kinds = (FullyShardedDataParallel, FSDPModule)
    if not isinstance(model, FullyShardedDataParallel):
        model = model.module  # MMFullyShardedDataParallel2 keeps the sharded model there
    return [
        name.replace("_fsdp_wrapped_module.", "")
        for name, module in model.named_modules()
        if isinstance(module, kinds)
    ]


def wrappings(with_mmengine: bool) -> dict[str, dict[str, list[str]]]:
    """Each accepted form -> the FSDP units it makes, under FSDP1 and FSDP2."""
    size = {"min_num_params": 40}  # lin1 (40 parameters) and lin2 (72); not the head (18)
    forms: dict[str, Any] = {
        "short name": {"type": "size_based_auto_wrap_policy", **size},
        "dict, dotted type": {"type": SIZE_POLICY, **size},
        "dict, function type": {"type": size_based_auto_wrap_policy, **size},
        "bare short name": "size_based_auto_wrap_policy",
        "bare dotted path": SIZE_POLICY,
        "lambda, short name": {"type": "lambda_auto_wrap_policy", "lambda_fn": pick_width_8},
        "dotted user function": f"{__name__}.width_8_policy",
        "policy class, dotted": {
            "type": "torch.distributed.fsdp.wrap.ModuleWrapPolicy",
            "module_classes": {nn.Linear},
        },
        "policy class, dotted, class names": {
            "type": "torch.distributed.fsdp.wrap.ModuleWrapPolicy",
            "module_classes": ["Linear"],
        },
        "policy class, dotted, one class name": {
            "type": "torch.distributed.fsdp.wrap.ModuleWrapPolicy",
            "module_classes": "Linear",
        },
        "class names": ["Linear"],
    }
    if with_mmengine:
        from mmengine.registry import FUNCTIONS

        FUNCTIONS.register_module(name="comm_test_width_8_policy", force=True)(width_8_policy)
        forms["FUNCTIONS name"] = "comm_test_width_8_policy"
        forms["dict, FUNCTIONS name"] = {"type": "comm_test_width_8_policy"}
    out: dict[str, dict[str, list[str]]] = {}
    for label, form in forms.items():
        out[label] = {kind: units(wrap(kind, auto_wrap_policy=form)) for kind in ("fsdp", "fsdp2")}
    return out


def init_fn_forms(with_mmengine: bool) -> dict[str, Any]:
    """Each ``param_init_fn`` form on a meta model (FSDP1) -> its full parameters."""
    from comm_wrappers import MMFullyShardedDataParallel

    from .net import Net

    forms: dict[str, Any] = {
        "function": fill_init,
        "dotted path": f"{__name__}.fill_init",
        "dict, dotted type with kwargs": {"type": f"{__name__}.fill_init", "value": FILL},
        "dict, function type": {"type": fill_init},
    }
    if with_mmengine:
        from mmengine.registry import FUNCTIONS

        FUNCTIONS.register_module(name="comm_test_fill_init", force=True)(fill_init)
        forms["FUNCTIONS name"] = "comm_test_fill_init"
        forms["dict, FUNCTIONS name"] = {"type": "comm_test_fill_init", "value": FILL}
    out: dict[str, Any] = {}
    for label, form in forms.items():
        with torch.device("meta"):
            net = Net()
        model = MMFullyShardedDataParallel(net, auto_wrap_policy=["Linear"], param_init_fn=form)
        out[label] = {name: value.tolist() for name, value in full_params(model).items()}
    out["unknown"] = caught(lambda: MMFullyShardedDataParallel(net, param_init_fn="no_such_fn"))
    return out


def _has_mmengine() -> bool:
    try:
        import mmengine.registry  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("with_mmengine", [False, True], ids=["plain", "mmengine"])
def test_every_policy_form_wraps_as_the_short_name(
    comm_run_distributed: Any, with_mmengine: bool
) -> None:
    if with_mmengine and not _has_mmengine():
        pytest.skip("MMEngine is not installed in this environment")
    for rank, result in enumerate(comm_run_distributed(wrappings, with_mmengine)):
        size_units = result["short name"]
        # size_based: the root, lin1 and lin2 (the head has too few parameters)
        assert size_units == {"fsdp": ["", "lin1", "lin2"], "fsdp2": ["", "lin1", "lin2"]}
        for label in ("dict, dotted type", "dict, function type"):
            assert result[label] == size_units, (rank, label, result[label])
        # size_based with its default minimum (1e8): only the root
        for label in ("bare short name", "bare dotted path"):
            assert result[label] == {"fsdp": [""], "fsdp2": [""]}, (rank, label, result[label])
        picked = result["lambda, short name"]
        assert picked == size_units  # the same modules, picked by the lambda
        for label in ("dotted user function", "FUNCTIONS name", "dict, FUNCTIONS name"):
            if label in result:
                assert result[label] == picked, (rank, label, result[label])
        every_linear = result["class names"]
        assert every_linear["fsdp"] == ["", "lin1", "lin2", "head"]
        assert result["policy class, dotted"] == every_linear, (rank, result)
        # ModuleWrapPolicy's module_classes may name the model's classes, as
        # transformer_layer_cls may (was: TypeError from isinstance() in torch)
        for label in ("policy class, dotted, class names", "policy class, dotted, one class name"):
            assert result[label] == every_linear, (rank, label, result[label])


@pytest.mark.parametrize("with_mmengine", [False, True], ids=["plain", "mmengine"])
def test_every_param_init_fn_form_initialises_as_the_function(
    comm_run_distributed: Any, with_mmengine: bool
) -> None:
    if with_mmengine and not _has_mmengine():
        pytest.skip("MMEngine is not installed in this environment")
    for rank, result in enumerate(comm_run_distributed(init_fn_forms, with_mmengine)):
        error_type, message = result.pop("unknown")
        assert error_type == "ValueError", (rank, message)
        assert "got 'no_such_fn'" in message
        assert "registered name (reset_parameters)" in message
        assert "dotted import path" in message
        assert "FUNCTIONS" in message
        expected = result["function"]
        assert sorted(expected) == [
            "head.bias",
            "head.weight",
            "lin1.bias",
            "lin1.weight",
            "lin2.bias",
            "lin2.weight",
        ]
        assert all(v == FILL for values in expected.values() for v in _flat(values))
        for label, params in result.items():
            assert params == expected, (rank, label)


def _flat(values: Any) -> list[float]:
    if isinstance(values, list):
        return [v for item in values for v in _flat(item)]
    return [values]


def test_unknown_policy_names_list_the_accepted_forms() -> None:
    from comm_wrappers._fsdp_options import coerce_auto_wrap_policy

    net = nn.Sequential(nn.Linear(2, 2))
    for value in ({"type": "no_such_policy"}, {"type": "torch.no_such_policy"}, {"type": None}):
        error_type, message = caught(coerce_auto_wrap_policy, value, net)
        assert error_type == "ValueError", message
        assert "size_based_auto_wrap_policy, transformer_auto_wrap_policy" in message
        assert "dotted import path" in message
        assert "FUNCTIONS" in message
        assert f"got {value['type']!r}" in message
    # a dotted path to something not callable is refused too
    error_type, message = caught(coerce_auto_wrap_policy, {"type": "torch.float32"}, net)
    assert error_type == "ValueError", message
    # a bare name that is neither a class of the model nor a function
    error_type, message = caught(coerce_auto_wrap_policy, "NoSuchBlock", net)
    assert error_type == "ValueError"
    assert "'NoSuchBlock' is not a module class of the model" in message
    assert "dotted import path" in message
    # a class name in ModuleWrapPolicy's module_classes that the model does not have
    policy = {"type": "torch.distributed.fsdp.wrap.ModuleWrapPolicy", "module_classes": ["Block"]}
    error_type, message = caught(coerce_auto_wrap_policy, policy, net)
    assert error_type == "ValueError", message
    assert "module_classes: 'Block' is not a module class of the model" in message
    assert "the model's classes are Linear, Sequential" in message


def test_the_wrappers_never_import_mmengine() -> None:
    code = (
        "import sys, torch\n"
        "from comm_wrappers._fsdp_options import coerce_auto_wrap_policy, coerce_param_init_fn\n"
        "net = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
        f"coerce_auto_wrap_policy({{'type': {SIZE_POLICY!r}, 'min_num_params': 1}}, net)\n"
        "try:\n"
        "    coerce_param_init_fn('no_such_init')\n"
        "except ValueError:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('mmengine')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
