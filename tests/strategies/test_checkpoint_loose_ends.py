"""Checkpoint loose ends from an outside review: optimizers whose param groups differ from
the saved ones, what a save in place keeps that comm did not write, and what a file that
is not a checkpoint is said to be. One process, tiny models."""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from comm_strategies import checkpoint as ck
from comm_strategies.checkpoint import CheckpointError


def two_layers(n: int = 2) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, n))


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    optimizer.zero_grad()
    model(torch.randn(3, 4)).pow(2).sum().backward()
    optimizer.step()


def grouped(model: torch.nn.Sequential, order: tuple[int, int], lrs: tuple[float, float]) -> Any:
    """AdamW with one group per layer, in ``order``, with learning rates ``lrs``."""
    return torch.optim.AdamW(
        [
            {"params": list(model[order[0]].parameters()), "lr": lrs[0]},
            {"params": list(model[order[1]].parameters()), "lr": lrs[1]},
        ],
        lr=0.5,
    )


def hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


@pytest.fixture(params=[False, True], ids=["full", "dcp"])
def sharded(request: Any) -> bool:
    return bool(request.param)


def saved_one_group(root: Path, sharded: bool) -> tuple[Path, torch.nn.Module, Any]:
    model = two_layers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    one_step(model, optimizer, 1)
    path = root / "one_group"
    ck.save_checkpoint(
        path, model=model, strategy="single", optim_wrapper=optimizer, sharded=sharded
    )
    return path, model, optimizer


def saved_two_groups(root: Path, sharded: bool) -> tuple[Path, torch.nn.Sequential, Any]:
    """A checkpoint of ``two_layers`` after one step of AdamW with one group per layer."""
    model = two_layers()
    optimizer = grouped(model, (0, 1), (0.1, 0.01))
    one_step(model, optimizer, 1)
    path = root / "two_groups"
    ck.save_checkpoint(
        path, model=model, strategy="single", optim_wrapper=optimizer, sharded=sharded
    )
    return path, model, optimizer


# ---- 1. param groups


def test_an_optimizer_with_more_param_groups_is_refused(tmp_path: Path, sharded: bool) -> None:
    path, _, _ = saved_one_group(tmp_path, sharded)
    model = two_layers()
    optimizer = grouped(model, (0, 1), (0.5, 0.01))
    before = hyper(optimizer)
    with pytest.raises(CheckpointError) as caught:
        ck.load_checkpoint(path, model=model, optim_wrapper=optimizer)
    message = str(caught.value)
    assert "1 parameter group(s), this optimizer 2" in message
    assert "rank 0" in message
    assert "same param groups" in message
    assert "load_optimizer=False" in message
    assert hyper(optimizer) == before  # untouched: every group keeps its hyperparameters
    # the weights alone still load
    ck.load_checkpoint(path, model=model, optim_wrapper=optimizer, load_optimizer=False)


def test_strict_false_loads_the_group_that_fits_and_keeps_the_other_hyperparameters(
    tmp_path: Path,
) -> None:
    path, saved_model, saved_optimizer = saved_one_group(tmp_path, False)
    model = two_layers()
    optimizer = grouped(model, (0, 1), (0.5, 0.01))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.load_checkpoint(path, model=model, optim_wrapper=optimizer, strict=False)
    assert [w.filename for w in caught] == [__file__]  # once, not again as "holds nothing"
    shown = " ".join(str(w.message) for w in caught)
    assert "1.weight" in shown
    assert "1.bias" in shown
    assert "0.weight" not in shown
    # group 0 holds the saved group's parameters: its hyperparameters and state are saved
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    saved_state = saved_optimizer.state[saved_model[0].weight]
    state = optimizer.state[model[0].weight]
    assert torch.equal(state["exp_avg"], saved_state["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], saved_state["exp_avg_sq"])
    # group 1's parameters were saved in group 0: no state, its own hyperparameters
    assert optimizer.param_groups[1]["lr"] == 0.01
    assert optimizer.param_groups[1]["betas"] == (0.9, 0.999)
    assert not optimizer.state.get(model[1].weight)
    one_step(model, optimizer, 2)  # every group has what a step needs


def test_parameters_in_another_group_are_refused(tmp_path: Path, sharded: bool) -> None:
    path, _, _ = saved_two_groups(tmp_path, sharded)
    target = two_layers()
    swapped = grouped(target, (1, 0), (0.3, 0.03))
    with pytest.raises(CheckpointError) as caught:
        ck.load_checkpoint(path, model=target, optim_wrapper=swapped)
    message = str(caught.value)
    assert "parameter 0.weight is in group 0 of the saved optimizer, in group 1 of this one" in (
        message
    )
    assert "(and 3 more)" in message
    assert "load_optimizer=False" in message
    assert [g["lr"] for g in swapped.param_groups] == [0.3, 0.03]


def test_the_same_groups_resume_exactly(tmp_path: Path, sharded: bool) -> None:
    path, model, optimizer = saved_two_groups(tmp_path, sharded)
    target = two_layers()
    resumed = grouped(target, (0, 1), (0.7, 0.07))
    ck.load_checkpoint(path, model=target, optim_wrapper=resumed)
    assert [g["lr"] for g in resumed.param_groups] == [0.1, 0.01]
    one_step(model, optimizer, 2)
    one_step(target, resumed, 2)
    for name, value in model.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


def test_load_full_optim_state_dict_refuses_other_groups() -> None:
    model = two_layers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    one_step(model, optimizer, 1)
    state = ck.full_optim_state_dict(model, optimizer)
    target = two_layers()
    other = grouped(target, (0, 1), (0.5, 0.01))
    with pytest.raises(CheckpointError, match=r"1 parameter group\(s\), this optimizer 2"):
        ck.load_full_optim_state_dict(target, other, state)
    assert [g["lr"] for g in other.param_groups] == [0.5, 0.01]


def test_load_full_optim_state_dict_missing_a_parameter_is_a_checkpoint_error() -> None:
    """A state without the bias's entry (its group lists only the weight): refused as a
    CheckpointError naming the state, the parameter and the rank before the optimizer is
    touched (torch's own check fills its state first); strict=False loads the weight's
    state and leaves the bias without one."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = ck.full_optim_state_dict(model, optimizer)
    del state["state"]["bias"]
    state["param_groups"][0]["params"] = ["weight"]
    target = torch.nn.Linear(3, 2)
    resumed = torch.optim.Adam(target.parameters(), lr=0.5)
    with pytest.raises(CheckpointError) as caught:
        ck.load_full_optim_state_dict(target, resumed, state)
    message = str(caught.value)
    assert message.startswith(
        "the optimizer state does not fit this optimizer on rank 0: it holds no state for "
        "bias, parameters this optimizer trains"
    )
    assert "Pass strict=False" in message
    assert not resumed.state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.load_full_optim_state_dict(target, resumed, state, strict=False)
    assert [(str(w.message), w.filename) for w in caught] == [
        (
            "strict=False: the optimizer state holds nothing for bias (rank 0): their "
            "optimizer state is not loaded",
            __file__,
        )
    ]
    assert torch.equal(
        resumed.state[target.weight]["exp_avg"], optimizer.state[model.weight]["exp_avg"]
    )
    assert not resumed.state.get(target.bias)
    assert resumed.param_groups[0]["lr"] == 0.1


def _strict_then_loose(
    path: Path, target: torch.nn.Module, resumed: torch.optim.Optimizer
) -> tuple[str, list[warnings.WarningMessage]]:
    """A strict load's refusal (the fresh optimizer left without state), then the warnings
    of a strict=False load."""
    with pytest.raises(CheckpointError) as refused:
        ck.load_checkpoint(path, model=target, optim_wrapper=resumed)
    assert not resumed.state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.load_checkpoint(path, model=target, optim_wrapper=resumed, strict=False)
    return str(refused.value), caught


def test_strict_false_loads_an_optimizer_that_trained_fewer_parameters(
    tmp_path: Path, sharded: bool
) -> None:
    """A checkpoint whose optimizer trained the first layer only, loaded into one that
    trains both: refused (optimizer untouched) unless strict=False, which loads the first
    layer's state and hyperparameters, warns naming the second layer's parameters, leaves
    them without state (as torch's optimizer load does) and trains on. It was refused in
    the DCP format whatever ``strict`` said, and loaded silently in the full one."""
    model = two_layers()
    optimizer = torch.optim.AdamW(model[0].parameters(), lr=0.1)
    one_step(model, optimizer, 1)
    path = tmp_path / "first_layer"
    ck.save_checkpoint(
        path, model=model, strategy="single", optim_wrapper=optimizer, sharded=sharded
    )
    target = two_layers()
    resumed = torch.optim.AdamW(target.parameters(), lr=0.5)
    refusal, caught = _strict_then_loose(path, target, resumed)
    assert (
        f"{path} does not fit this optimizer on rank 0: it holds no state for 1.weight, "
        "1.bias, parameters this optimizer trains" in refusal
    )
    assert "Pass strict=False" in refusal
    assert [(str(w.message), w.filename) for w in caught] == [
        (
            f"strict=False: {path} holds nothing for 1.weight, 1.bias (rank 0): their "
            "optimizer state is not loaded",
            __file__,
        )
    ]
    for name in ("weight", "bias"):
        saved, loaded = (
            optimizer.state[getattr(model[0], name)],
            resumed.state[getattr(target[0], name)],
        )
        assert torch.equal(loaded["exp_avg"], saved["exp_avg"]), name
        assert float(loaded["step"]) == 1.0
        assert not resumed.state.get(getattr(target[1], name))
    assert resumed.param_groups[0]["lr"] == 0.1
    one_step(target, resumed, 2)  # trains on: the second layer's state starts now
    assert float(resumed.state[target[1].weight]["step"]) == 1.0
    assert float(resumed.state[target[0].weight]["step"]) == 2.0


class _Tied(torch.nn.Module):
    """An embedding whose weight the output layer shares (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(5, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.emb(tokens)))


def _tied_step(model: _Tied, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.tensor([1, 2])).pow(2).sum().backward()
    optimizer.step()


def test_strict_false_loads_what_fits_when_the_saved_optimizer_left_a_tied_weight_out(
    tmp_path: Path, sharded: bool
) -> None:
    """The tied weight gets no state, the rest loads (torch failed on the group's size)."""
    model = _Tied()
    optimizer = torch.optim.AdamW(model.mid.parameters(), lr=0.1)
    _tied_step(model, optimizer)
    path = tmp_path / "tied"
    ck.save_checkpoint(
        path, model=model, strategy="single", optim_wrapper=optimizer, sharded=sharded
    )
    target = _Tied()
    resumed = torch.optim.AdamW(target.parameters(), lr=0.5)
    refusal, caught = _strict_then_loose(path, target, resumed)
    assert f"{path} does not fit this optimizer on rank 0: it holds no state for emb.weight," in (
        refusal
    )
    assert [str(w.message) for w in caught] == [
        f"strict=False: {path} holds nothing for emb.weight (rank 0): their optimizer state "
        "is not loaded"
    ]
    assert not resumed.state.get(target.emb.weight)
    assert torch.equal(
        resumed.state[target.mid.weight]["exp_avg"], optimizer.state[model.mid.weight]["exp_avg"]
    )
    _tied_step(target, resumed)
    assert float(resumed.state[target.emb.weight]["step"]) == 1.0


def test_strict_false_skips_a_reshaped_layer_and_its_optimizer_state(
    tmp_path: Path, sharded: bool
) -> None:
    """A head of another size: its weights and moments are not read (the dcp format failed
    on the moments' shapes), the first layer's are, and one warning names the head."""
    model = two_layers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    one_step(model, optimizer, 1)
    path = tmp_path / "narrow"
    ck.save_checkpoint(
        path, model=model, strategy="single", optim_wrapper=optimizer, sharded=sharded
    )
    target = two_layers(n=3)
    head = target[1].weight.detach().clone()
    resumed = torch.optim.AdamW(target.parameters(), lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.load_checkpoint(path, model=target, optim_wrapper=resumed, strict=False)
    assert [w.filename for w in caught] == [__file__]
    assert "shapes differ: 1.bias: checkpoint [2], model [3]" in str(caught[0].message)
    assert torch.equal(target[1].weight, head)
    assert torch.equal(target[0].weight, model[0].weight)
    assert torch.equal(
        resumed.state[target[0].weight]["exp_avg"], optimizer.state[model[0].weight]["exp_avg"]
    )
    assert not resumed.state.get(target[1].weight)
    one_step(target, resumed, 2)


# ---- 7. a save in place keeps what comm did not write


def _link_to_user_folder(folder: Path, root: Path) -> tuple[str, Path]:
    data = root / "user_data"
    data.mkdir()
    (data / "big.bin").write_bytes(b"x" * 10)
    os.symlink(data, folder / "data_link")
    return "data_link@", data / "big.bin"


@pytest.mark.parametrize("kind", ["empty folder", "dangling link", "link to a folder"])
def test_a_save_in_place_refuses_what_comm_did_not_write(tmp_path: Path, kind: str) -> None:
    model = two_layers()
    path = tmp_path / "ckpt"
    ck.save_checkpoint(path, model=model, strategy="single")
    target = None
    if kind == "empty folder":
        (path / "eval_out").mkdir()
        shown, entry = "eval_out/", path / "eval_out"
    elif kind == "dangling link":
        os.symlink(tmp_path / "does-not-exist", path / "dangling")
        shown, entry = "dangling@", path / "dangling"
    else:
        shown, target = _link_to_user_folder(path, tmp_path)
        entry = path / "data_link"
    with pytest.raises(CheckpointError) as caught:
        ck.save_checkpoint(path, model=model, strategy="single")
    message = str(caught.value)
    assert shown in message
    assert "comm did not write" in message
    assert "move them out, or save to another path" in message
    assert entry.is_symlink() or entry.is_dir()
    if target is not None:
        assert target.read_bytes() == b"x" * 10
    # once it is moved out, the save goes through
    entry.unlink() if entry.is_symlink() else entry.rmdir()
    ck.save_checkpoint(path, model=model, strategy="single")


def test_keep_last_leaves_a_checkpoint_holding_an_empty_user_folder(tmp_path: Path) -> None:
    model = two_layers()
    ck.save_checkpoint(tmp_path / "a", model=model, strategy="single")
    (tmp_path / "a" / "eval_out").mkdir()
    with pytest.warns(RuntimeWarning, match="eval_out/"):
        ck.save_checkpoint(tmp_path / "b", model=model, strategy="single", keep_last=1)
    assert (tmp_path / "a" / "eval_out").is_dir()


# ---- 8. what a file that is not a checkpoint is


def _refusal(path: Path, **kwargs: Any) -> str:
    with pytest.raises(CheckpointError) as caught:
        ck.load_checkpoint(path, model=torch.nn.Linear(2, 2), **kwargs)
    return str(caught.value)


def test_a_zip_archive_from_elsewhere(tmp_path: Path) -> None:
    path = tmp_path / "docs.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "hi")
    message = _refusal(path)
    assert "a zip archive that is not a torch checkpoint (it holds readme.txt" in message
    assert "Expected a file written by torch.save" in message
    assert "corrupt" not in message
    assert "inline_container" not in message


def test_a_plain_python_pickle(tmp_path: Path) -> None:
    path = tmp_path / "plain.pkl"
    path.write_bytes(pickle.dumps({"weight": [1.0, 2.0]}, protocol=4))
    for unsafe in (False, True):
        message = _refusal(path, allow_unsafe_pickle=unsafe)
        assert "a Python pickle that torch.save did not write" in message
        assert "corrupt" not in message


class _WithExtraState(torch.nn.Module):
    """A module whose state dict holds a non-tensor entry of its own (``_extra_state``)."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.tag = tag

    def get_extra_state(self) -> Any:
        return {"tag": self.tag}

    def set_extra_state(self, state: Any) -> None:
        self.tag = state["tag"]


def test_a_plain_file_s_entries_that_are_not_tensors(tmp_path: Path) -> None:
    """A weights file with other entries beside the tensors (an epoch, a nested
    ``{"state_dict": {"module": ...}}``): load and convert leave them out with a warning
    naming the file, the entries and the user's line; a module's ``_extra_state`` loads
    from the file, and convert (weights only) leaves it out with the same warning."""
    source = _WithExtraState("trained")
    weights = {k: v for k, v in source.state_dict().items() if k != "_extra_state"}
    path = tmp_path / "weights.pt"
    torch.save({"state_dict": {"module": {**source.state_dict(), "epoch": 3}}}, path)
    target = _WithExtraState("new")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.load_checkpoint(path, model=target)
    shown = [w for w in caught if "not tensors" in str(w.message)]
    assert len(shown) == 1, [str(w.message) for w in caught]
    assert str(shown[0].message) == (
        f"{path}['state_dict']['module']: left out 1 entr(ies) that are not tensors: epoch"
    )
    assert shown[0].filename == __file__
    assert target.tag == "trained"
    for name, value in weights.items():
        assert torch.equal(target.state_dict()[name], value), name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ck.convert_checkpoint(path, tmp_path / "plain.pt")
    shown = [w for w in caught if "not tensors" in str(w.message)]
    assert [str(w.message).rsplit(": ", 1)[1] for w in shown] == ["_extra_state, epoch"]
    assert shown[0].filename == __file__
    assert sorted(torch.load(out, weights_only=True)) == sorted(weights)
    # a wrapper's state dict with a tensor beside it at the top (a metric): the wrapped one
    beside = tmp_path / "beside.pt"
    torch.save({"state_dict": source.state_dict(), "best": torch.tensor(0.9), "epoch": 3}, beside)
    target = _WithExtraState("new")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.load_checkpoint(beside, model=target)
    assert not [str(w.message) for w in caught if "not tensors" in str(w.message)]
    assert target.tag == "trained"
    for name, value in weights.items():
        assert torch.equal(target.state_dict()[name], value), name


def test_a_plain_file_that_wraps_itself(tmp_path: Path) -> None:
    """A pickle whose dict holds itself under 'state_dict' (pickle keeps the cycle) is
    refused after two levels of unwrapping, not followed forever, in load and convert."""
    looped: dict[str, Any] = {"epoch": 3}
    looped["state_dict"] = looped
    path = tmp_path / "looped.pt"
    torch.save(looped, path)
    expected = (
        f"{path}['state_dict']['state_dict'] holds no state dict: expected {{name: tensor}}, "
        "or one under 'state_dict' or 'module' (two levels deep at most), got a dict with keys "
        "['epoch', 'state_dict']"
    )
    assert _refusal(path) == expected
    with pytest.raises(CheckpointError) as caught:
        ck.convert_checkpoint(path, tmp_path / "plain.pt")
    assert str(caught.value) == expected
    assert not (tmp_path / "plain.pt").exists()


def test_torch_legacy_pickles(tmp_path: Path) -> None:
    source = torch.nn.Linear(2, 2)
    default = tmp_path / "legacy.pth"
    torch.save(source.state_dict(), default, _use_new_zipfile_serialization=False)
    model = torch.nn.Linear(2, 2)
    ck.load_checkpoint(default, model=model)  # protocol 2: weights_only reads it
    assert torch.equal(model.weight, source.weight)
    framed = tmp_path / "legacy4.pth"
    torch.save(source.state_dict(), framed, _use_new_zipfile_serialization=False, pickle_protocol=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        message = _refusal(framed)
        assert "legacy format" in message
        assert "pickle protocol 4" in message
        assert "allow_unsafe_pickle=True" in message
        assert "corrupt" not in message
        model = torch.nn.Linear(2, 2)
        ck.load_checkpoint(framed, model=model, allow_unsafe_pickle=True)
    assert torch.equal(model.weight, source.weight)


def test_a_utf8_text_whose_probe_ends_inside_a_character(tmp_path: Path) -> None:
    path = tmp_path / "config.py"
    line = "# 模型配置文件, 训练参数与数据集设置\n"
    path.write_text(line * 20 + "model = dict(type='Classifier')\n", encoding="utf-8")
    assert (line * 20).encode()[256] & 0xC0 == 0x80  # byte 256 is inside a character
    message = _refusal(path)
    assert "a text file (it starts with '# 模型配置文件" in message


def test_binary_data_that_decodes_as_utf8_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x08\x00\x00\x00\x01\x02\x03\x04" + bytes(range(32)) * 4)
    message = _refusal(path)
    assert "binary data of another format (it starts with b'\\x08\\x00" in message
    assert "text file" not in message


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_dcp_checkpoint_without_optimizer_state_converts_and_resumes(
    tmp_path: Path, name: str
) -> None:
    """A `dcp` checkpoint of an optimizer without state (saved before the first step; plain
    SGD never has one): DCP keeps no empty dict, and its full form, read back without
    ``"state"``, failed in torch's load (KeyError 'param_groups.0.weight.lr'). Converted to
    `full` and resumed, it trains as the run that never saved."""

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        if name == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1)
        return torch.optim.AdamW(model.parameters(), lr=0.1)

    reference = two_layers()
    reference_optimizer = make(reference)
    for seed in range(3):
        one_step(reference, reference_optimizer, seed)
    model = two_layers()
    optimizer = make(model)
    if name == "sgd":  # stateless however long it trains
        one_step(model, optimizer, 0)
    ck.save_checkpoint(
        tmp_path / "dcp", model=model, strategy="single", optim_wrapper=optimizer, sharded=True
    )
    assert not optimizer.state
    ck.convert_checkpoint(tmp_path / "dcp", tmp_path / "full", to="full")
    state = torch.load(tmp_path / "full" / "optim.pt", weights_only=True)
    assert state["default"]["state"] == {}
    resumed = two_layers()
    torch.nn.init.zeros_(resumed[0].weight)
    resumed_optimizer = make(resumed)
    ck.load_checkpoint(tmp_path / "full", model=resumed, optim_wrapper=resumed_optimizer)
    assert not resumed_optimizer.state
    for seed in range(1 if name == "sgd" else 0, 3):
        one_step(resumed, resumed_optimizer, seed)
    for mine, theirs in zip(resumed.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
