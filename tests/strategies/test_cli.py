"""``comm-ckpt inspect`` and ``convert``, offline on the CPU (no process group)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import comm_collectives as dist
from comm_strategies import cli
from comm_strategies.checkpoint import (
    CheckpointError,
    convert_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from comm_wrappers import OptimWrapper, unwrap_model
from tests.helpers import full_params, max_diff
from tests.strategies.ckpt_models import (
    build,
    expected_of,
    keep_expected,
    torch_optimizer,
    train_steps,
)
from tests.wrappers.net import Net


def save_for_cli(root: str) -> None:
    """An FSDP2 DCP checkpoint and a DeepSpeed ZeRO-0 folder, with their parameters."""
    model, optim = build("fsdp2")
    train_steps(model, optim, range(2))
    save_checkpoint(
        f"{root}/fsdp2",
        model=model,
        optim_wrapper=optim,
        strategy="fsdp2",
        extra={"step": 2},
    )
    keep_expected(root, "fsdp2", full_params(model))
    # The optimizer state a conversion must carry, from torch's own API (names as keys).
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim_state = get_optimizer_state_dict(
        unwrap_model(model), torch_optimizer(optim), options=options
    )
    if dist.get_rank() == 0:
        torch.save(optim_state, f"{root}/expected_fsdp2_optim.pt")
    model, optim = build("zero0")
    train_steps(model, optim, range(2))
    model.model.save_checkpoint(f"{root}/ds_0", tag="global_step2")
    keep_expected(root, "ds_0", full_params(model))


@pytest.fixture(scope="module")
def saved(comm_pools: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    comm_pools.get(2).run(save_for_cli, str(root), timeout=300)
    return root


def test_inspect_prints_the_manifest(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", str(saved / "fsdp2")]) == 0
    out = capsys.readouterr().out
    assert "strategy     fsdp2 (fsdp2), world size 2" in out
    assert "format       dcp, fully_shard" in out
    assert "optimizer    yes" in out
    assert "RNG states   ranks [0, 1]" in out
    assert "user state   step" in out
    assert "tensors      6 (130 elements; float32)" in out  # 4*8+8 + 8*8+8 + 8*2+2
    assert "lin1.weight  (8, 4)  float32" in out


def test_inspect_json(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", "--json", str(saved / "fsdp2")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 2
    assert data["params"]["head.weight"] == [[2, 8], "float32"]
    assert data["num_params"] == 130


def test_convert_sharded_to_one_plain_file(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "weights.pt"
    assert cli.main(["convert", str(saved / "fsdp2"), str(out), "--quiet"]) == 0
    state = torch.load(out, weights_only=True)  # loads without full unpickling
    expected = expected_of(str(saved), "fsdp2")
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[name], expected[name]) for name in expected)


def test_convert_deepspeed_zero0_without_the_opt_in(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # DeepSpeed's own files load with weights_only=True: no --allow-unsafe-pickle needed.
    out = tmp_path / "zero0.pth"
    assert cli.main(["convert", str(saved / "ds_0"), str(out), "--progress"]) == 0
    captured = capsys.readouterr()
    assert "100%" in captured.err  # the progress bar
    assert f"wrote {out}" in captured.out
    state = torch.load(out, weights_only=True)
    expected = expected_of(str(saved), "ds_0")
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[name], expected[name]) for name in expected)


def load_converted(folder: str) -> float:
    """A folder converted from a plain file loads into FSDP1 at world 2 (resharded by DCP)."""
    model, _ = build("fsdp", seed=11)
    load_checkpoint(folder, model=model)
    return max_diff(full_params(model), expected_of(str(Path(folder).parent), "fsdp2"))


def test_convert_plain_to_sharded_loads_into_fsdp(
    comm_pools: Any, saved: Path, tmp_path: Path
) -> None:
    plain = saved / "plain.pt"
    assert cli.main(["convert", str(saved / "fsdp2"), str(plain), "--quiet"]) == 0
    folder = saved / "resharded"
    assert cli.main(["convert", str(plain), str(folder), "--quiet"]) == 0
    assert (folder / "manifest.json").is_file()
    assert (folder / "dcp" / ".metadata").is_file()
    for diff in comm_pools.get(2).run(load_converted, str(folder), timeout=120):
        assert diff == 0.0
    shutil.rmtree(folder)


@pytest.mark.parametrize("to", ["full", "sharded"])
def test_convert_moves_the_optimizer_into_a_plain_module_with_adamw(
    saved: Path, tmp_path: Path, to: str
) -> None:
    """FSDP2 at world 2 (DCP) -> a full or sharded folder -> a plain module, one process."""
    folder = tmp_path / to
    assert cli.main(["convert", str(saved / "fsdp2"), str(folder), "--to", to, "--quiet"]) == 0
    manifest = read_manifest(folder)
    assert manifest.format == ("dcp" if to == "sharded" else "full")
    assert manifest.has_optimizer
    assert manifest.rng_ranks == [0, 1]  # the side files came along
    assert manifest.extra_keys == ["step"]
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    extra = load_checkpoint(folder, model=model, optim_wrapper=OptimWrapper(optimizer))
    assert extra == {"step": 2}
    params = dict(model.named_parameters())
    assert (
        max_diff({k: v.detach() for k, v in params.items()}, expected_of(str(saved), "fsdp2"))
        == 0.0
    )
    expected: dict[str, Any] = torch.load(saved / "expected_fsdp2_optim.pt", weights_only=True)
    for name, param in params.items():
        for key, value in expected["state"][name].items():
            assert torch.equal(optimizer.state[param][key], value), (name, key)
    assert optimizer.param_groups[0]["lr"] == expected["param_groups"][0]["lr"] == 0.01


def test_convert_in_a_subprocess_shows_a_progress_bar(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "full"
    arguments = ["convert", str(saved / "fsdp2"), str(out), "--to", "full", "--progress"]
    result = subprocess.run(
        [sys.executable, "-m", "comm_strategies.cli", *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "model.pt [" in result.stderr  # one bar per file written
    assert "optim.pt [" in result.stderr
    assert "100%" in result.stderr
    assert f"wrote {out}" in result.stdout
    assert read_manifest(out).format == "full"


def test_bad_conversions_are_clear_errors(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["convert", str(saved / "fsdp2"), str(tmp_path / "x"), "--to", "zero"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'zero'" in err, err
    assert "deepspeed" in err  # the choices are listed
    with pytest.raises(
        ValueError, match="to must be one of 'plain', 'full', 'sharded', 'deepspeed'"
    ):
        convert_checkpoint(saved / "fsdp2", tmp_path / "x", to="zero")
    folder = tmp_path / "not_a_checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    assert cli.main(["convert", str(folder), str(tmp_path / "out"), "--to", "full"]) == 2
    err = capsys.readouterr().err
    assert f"{folder} is not a checkpoint" in err, err
    assert not (tmp_path / "out").exists()
    # A destination folder that is not a checkpoint is kept, not replaced.
    assert cli.main(["convert", str(saved / "fsdp2"), str(folder), "--to", "full"]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    assert (folder / "notes.txt").read_text() == "hello"
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_checkpoint(tmp_path / "missing", tmp_path / "y", to="deepspeed")
    # A plain destination that is a folder, or a file of another kind, is kept, not replaced.
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert cli.main(["convert", str(saved / "fsdp2"), str(notes), "--to", "plain"]) == 2
    err = capsys.readouterr().err
    assert "the file exists and is not a weights file" in err, err
    assert notes.read_text() == "mine"
    with pytest.raises(CheckpointError, match="it is a folder; a plain weights file"):
        convert_checkpoint(saved / "fsdp2", folder, to="plain")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    # A file with a weights suffix is looked into: text named .ckpt is no weights file.
    text = tmp_path / "full.ckpt"
    text.write_text("lightning notes")
    with pytest.raises(CheckpointError, match="not a weights file: it is a text file"):
        convert_checkpoint(saved / "fsdp2", text, to="plain")
    assert text.read_text() == "lightning notes"
    # A symbolic link is refused: replacing it would lose the link and keep its target.
    link = tmp_path / "link.pt"
    link.symlink_to(notes)
    assert cli.main(["convert", str(saved / "fsdp2"), str(link), "--to", "plain"]) == 2
    err = capsys.readouterr().err
    assert "it is a symbolic link" in err, err
    assert "pass the link's target path" in err, err
    assert link.is_symlink()
    assert notes.read_text() == "mine"
    expected = torch.load(convert_checkpoint(saved / "fsdp2", tmp_path / "new.pt"))
    assert sorted(expected) != []
    # Weights files already there are replaced, whatever the case of the suffix, in
    # torch's zip format or its legacy pickle.
    for name, legacy in (("weights.pt", False), ("UP.PT", False), ("old.Pth", True)):
        weights = tmp_path / name
        torch.save({"old": torch.zeros(1)}, weights, _use_new_zipfile_serialization=not legacy)
        assert weights.read_bytes()[:1] == (b"\x80" if legacy else b"P")
        assert convert_checkpoint(saved / "fsdp2", weights) == weights  # plain, by suffix
        got = torch.load(weights, weights_only=True)
        assert sorted(got) == sorted(expected), name
        assert all(torch.equal(got[k], expected[k]) for k in expected), name


def test_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", str(tmp_path / "nothing")]) == 2
    assert f"{tmp_path / 'nothing'} does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    assert cli.main(["convert", str(bad), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err
    assert "is not a checkpoint: it is a text file" in err


def test_console_script_and_module_run(saved: Path) -> None:
    scripts = Path(sys.executable).parent
    commands = [[sys.executable, "-m", "comm_strategies.cli"]]
    if (scripts / "comm-ckpt").exists():
        commands.append([str(scripts / "comm-ckpt")])
    for command in commands:
        result = subprocess.run(
            [*command, "inspect", str(saved / "fsdp2")],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ),
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert "world size 2" in result.stdout


class _Payload:
    """Unpickling it runs ``touch MARKER``: a file must never do that without the opt-in."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_runs_code_is_refused_and_names_the_opt_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from comm_strategies.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    marker = tmp_path / "executed"
    model = torch.nn.Linear(2, 1)
    plain = tmp_path / "m.pth"
    torch.save({"state_dict": model.state_dict(), "payload": _Payload(marker)}, plain)
    folder = save_checkpoint(tmp_path / "c", model=model, strategy="single", extra={"step": 1})
    torch.save({"step": _Payload(marker)}, folder / "extra.pt")
    for source in (plain, folder):
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(source, model=torch.nn.Linear(2, 1))
        message = str(caught.value)
        assert "allow_unsafe_pickle=True" in message, message
        assert "truncated or corrupt" not in message, message
        assert "posix.system" in message, message  # names what was refused
    assert cli.main(["inspect", str(plain)]) == 2
    err = capsys.readouterr().err
    assert "--allow-unsafe-pickle" in err or "allow_unsafe_pickle" in err, err
    assert not marker.exists()
    # With the opt-in the file is what it says it is (and the payload runs: trusted files only).
    load_checkpoint(plain, model=torch.nn.Linear(2, 1), allow_unsafe_pickle=True)
    assert marker.exists()


def test_inspect_a_deepspeed_folder(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # DeepSpeed's own folder (no manifest): read safely, without the opt-in.
    assert cli.main(["inspect", str(saved / "ds_0")]) == 0
    out = capsys.readouterr().out
    assert "DeepSpeed checkpoint folder" in out, out
    assert "tensors      6 (130 elements; float32)" in out, out
    assert "head.weight  (2, 8)  float32" in out, out
