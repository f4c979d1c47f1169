"""The checkpoint contract on 2 real gloo ranks: every save x load pair, resume, errors.

The worlds are shared: one module-scoped run saves a checkpoint under every wrapper kind
(plus plain .pth files and DeepSpeed's own folders), then each test loads from that set.
Set ``COMM_CKPT_MATRIX_OUT`` to a file path to get the measured matrix as markdown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from . import ckpt_cases as cases

EXACT = 1e-6
PLAIN = ["bare.pth", "mmengine.pth"]
NATIVE = ["ds_0", "ds_1", "ds_2", "ds_3"]
# FSDP models saved as full files (sharded=False): gathered to rank 0 parameter by parameter.
FULL = ["fsdp_full", "fsdp2_full"]


@pytest.fixture(scope="module")
def saved(comm_pools: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with one checkpoint per kind, two plain files and DeepSpeed's folders."""
    root = str(tmp_path_factory.mktemp("saved"))
    pool = comm_pools.get(2)
    pool.run(cases.save_every_kind, root, cases.KINDS + FULL, timeout=300)
    pool.run(cases.write_plain_files, root, "fsdp2", timeout=60)
    pool.run(cases.save_deepspeed_native, root, timeout=300)
    return root


def _report(title: str, matrix: dict[str, dict[str, float]]) -> None:
    out = os.environ.get("COMM_CKPT_MATRIX_OUT")
    if not out:
        return
    sources = list(next(iter(matrix.values())))
    lines = [f"### {title}", "", "| load into \\ saved by | " + " | ".join(sources) + " |"]
    lines.append("|---" * (len(sources) + 1) + "|")
    for target, row in matrix.items():
        lines.append(f"| {target} | " + " | ".join(f"{row[s]:.1e}" for s in sources) + " |")
    with open(out, "a") as handle:
        handle.write("\n".join(lines) + "\n\n")


def test_every_kind_loads_every_kind_world_2(comm_pools: Any, saved: str) -> None:
    sources = cases.KINDS + FULL + PLAIN + NATIVE
    results = comm_pools.get(2).run(cases.load_every_kind, saved, sources, cases.KINDS, timeout=600)
    for matrix in results:
        for target, row in matrix.items():
            for source, diff in row.items():
                assert diff <= EXACT, (source, target, diff)
    _report(
        "World 2: saved under a kind, loaded under another (max |diff| of parameters)", results[0]
    )


def test_loads_at_world_size_1(comm_pools: Any, saved: str) -> None:
    """Saved by 2 ranks, loaded by 1: full files, DCP (resharded) and DeepSpeed (consolidated)."""
    sources = cases.KINDS + FULL + PLAIN + NATIVE
    targets = ["single", "fsdp2", "zero3"]
    [matrix] = comm_pools.get(1).run(cases.load_every_kind, saved, sources, targets, timeout=600)
    for target, row in matrix.items():
        for source, diff in row.items():
            assert diff <= EXACT, (source, target, diff)
    _report("World 1: saved by 2 ranks, loaded by 1", matrix)


def test_loads_at_world_size_3(comm_pools: Any, saved: str) -> None:
    """Saved by 2 ranks, loaded by 3: DCP reshards unevenly (a rank holds empty shards)."""
    sources = cases.KINDS + FULL
    targets = ["fsdp2", "zero3"]
    [matrix, *_] = comm_pools.get(3).run(
        cases.load_every_kind, saved, sources, targets, timeout=600
    )
    for target, row in matrix.items():
        for source, diff in row.items():
            assert diff <= EXACT, (source, target, diff)
    _report("World 3: saved by 2 ranks, loaded by 3", matrix)


def test_full_save_of_fsdp_at_world_size_3(comm_pools: Any, tmp_path: Path) -> None:
    """Uneven and empty shards gathered to rank 0 (head.bias: 2 rows over 3 ranks)."""
    root = str(tmp_path)
    pool = comm_pools.get(3)
    pool.run(cases.save_every_kind, root, FULL, timeout=300)
    [matrix, *_] = pool.run(cases.load_every_kind, root, FULL, ["single", "fsdp2"], timeout=300)
    for target, row in matrix.items():
        for source, diff in row.items():
            assert diff <= EXACT, (source, target, diff)


def test_optimizer_state_crosses_between_torch_wrappers(comm_pools: Any, tmp_path: Path) -> None:
    pairs = [
        ("ddp", "fsdp"),
        ("fsdp", "fsdp2"),
        ("fsdp2", "ddp"),
        ("ddp", "fsdp2"),
        ("fsdp2", "zero0"),  # ZeRO-0 in fp32 steps the client torch optimizer
    ]
    for result in comm_pools.get(2).run(
        cases.optimizer_crossing, str(tmp_path), pairs, timeout=300
    ):
        for pair, diff in result.items():
            assert diff <= EXACT, (pair, diff)


@pytest.mark.parametrize(
    "kind", ["single", "ddp", "fsdp", "fsdp2", "zero0", "zero1", "zero2", "zero3"]
)
def test_resume_equals_the_run_that_never_stopped(
    comm_pools: Any, tmp_path: Path, kind: str
) -> None:
    expected_format = {"fsdp": "dcp", "fsdp2": "dcp", "single": "full", "ddp": "full"}
    for result in comm_pools.get(2).run(
        cases.resume_equals_uninterrupted, str(tmp_path), kind, timeout=300
    ):
        assert result["diff"] == 0.0
        assert result["moved"] > 1e-2  # the fresh model started elsewhere
        assert result["draws"]
        # StepLR(step_size=2, gamma=0.5) from 0.01: after steps 4, 5, 6.
        assert result["lrs"][0] == result["lrs"][1] == [0.0025, 0.0025, 0.00125]
        assert result["extra"] == {"step": 3, "note": "three steps"}
        assert result["format"] == expected_format.get(kind, "deepspeed")
        assert "rng/rank_0.pt" in result["files"]
        assert "rng/rank_1.pt" in result["files"]


def test_amp_scaler_state_round_trips(comm_pools: Any, tmp_path: Path) -> None:
    for result in comm_pools.get(2).run(
        cases.resume_equals_uninterrupted, str(tmp_path), "ddp", amp=True, timeout=300
    ):
        assert result["diff"] == 0.0
        assert result["scaler"] is False  # bf16 autocast on CPU needs no scaler
        assert result["draws"]


def test_save_on_rank_0_alone_is_an_error_not_a_hang(comm_pools: Any, tmp_path: Path) -> None:
    pool = comm_pools.get(2)
    messages = pool.run(cases.rank0_alone, str(tmp_path), timeout=60)
    assert "rank(s) [1] did not reach 'enter' within 2 s" in messages[0]
    assert "Every rank must call save_checkpoint" in messages[0]
    # Nothing was created, and the world is still usable.
    assert pool.run(cases.rank0_alone_leaves_nothing, str(tmp_path), timeout=60) == [[], []]
    # Rank 0 withdrew its entry: the next collective save and load work on both ranks.
    assert pool.run(cases.save_and_load_after, str(tmp_path), timeout=60) == [{"step": 5}] * 2


def test_the_wait_for_the_ranks_outcome_is_bounded(comm_pools: Any) -> None:
    pool = comm_pools.get(2)
    (message, took), _ = pool.run(cases.outcome_wait_is_bounded, timeout=60)
    assert "rank 0 waited 1 s at step 'done' for the other ranks' outcome" in message
    assert took < 3.0


def test_clear_errors_on_every_rank(comm_pools: Any, tmp_path: Path) -> None:
    results = comm_pools.get(2).run(cases.errors_on_every_rank, str(tmp_path), timeout=120)
    for result in results:
        other = result["other_model"]
        assert "does not fit this model" in other
        assert "head.weight: checkpoint [2, 8], model [3, 8]" in other
        assert "head.bias: checkpoint [2], model [3]" in other
        truncated = result["truncated"]
        assert "model.pt" in truncated
        assert "truncated or corrupt" in truncated
        assert "the ranks passed different paths" in result["paths"]
        assert "ds_unsafe does not exist" in result["missing"]


def test_full_state_functions_agree_across_wrappers(comm_pools: Any) -> None:
    for result in comm_pools.get(2).run(cases.full_state_functions, timeout=120):
        for kind, values in result.items():
            assert values["model"] <= EXACT, kind
            assert values["exp_avg"] <= EXACT, kind
            assert values["names"], kind


def test_deepspeed_files_need_the_opt_in(comm_pools: Any, saved: str) -> None:
    for message in comm_pools.get(2).run(cases.deepspeed_without_opt_in, saved, timeout=120):
        assert "allow_unsafe_pickle=True" in message
        assert "zero2" in message


def test_a_replaced_checkpoint_is_deleted_in_the_background(tmp_path: Path) -> None:
    import torch

    from comm_strategies.checkpoint import _publish, load_checkpoint, save_checkpoint

    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path / "ckpt", model=model, strategy="single", extra={"step": 1})
    with torch.no_grad():
        model.weight.fill_(7.0)
    # A replaced copy that a killed process did not finish deleting: the next save of
    # that name removes it.
    (tmp_path / ".ckpt.old-killed").mkdir()
    save_checkpoint(tmp_path / "ckpt", model=model, strategy="single", extra={"step": 2})
    fresh = torch.nn.Linear(3, 2)
    assert load_checkpoint(tmp_path / "ckpt", model=fresh) == {"step": 2}
    assert bool((fresh.weight == 7.0).all())
    _publish._wait_for_deletions()  # what the interpreter does at exit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_file_at_the_path_is_an_error_and_stays(tmp_path: Path) -> None:
    import torch

    from comm_strategies.checkpoint import CheckpointError, save_checkpoint

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"found a file at .*notes\.txt, not a checkpoint"):
        save_checkpoint(tmp_path / "notes.txt", model=torch.nn.Linear(3, 2), strategy="single")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_bar_in_the_path_neither_fails_the_save_nor_deletes_another_folder(
    tmp_path: Path,
) -> None:
    # the entry exchange once joined its fields with "|": a path holding one was misread,
    # and rank 0 removed the folder named by the path's part before the bar
    import torch

    from comm_strategies.checkpoint import load_checkpoint, save_checkpoint

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "keep.txt").write_text("mine")
    folder = save_checkpoint(
        tmp_path / "runs|lr=0.1" / "epoch_1",
        model=torch.nn.Linear(3, 2),
        strategy="single",
        extra={"epoch": 1},
    )
    assert folder == tmp_path / "runs|lr=0.1" / "epoch_1"
    assert load_checkpoint(folder, model=torch.nn.Linear(3, 2)) == {"epoch": 1}
    assert (tmp_path / "runs" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "runs|lr=0.1").iterdir()) == ["epoch_1"]


def test_a_folder_that_is_not_a_checkpoint_is_an_error_and_stays(tmp_path: Path) -> None:
    import torch

    from comm_strategies.checkpoint import CheckpointError, save_checkpoint

    work_dir = tmp_path / "work_dir"
    (work_dir / "logs").mkdir(parents=True)
    (work_dir / "logs" / "train.log").write_text("epoch 1")
    with pytest.raises(CheckpointError, match=r"found a folder at .*work_dir that is not a"):
        save_checkpoint(work_dir, model=torch.nn.Linear(3, 2), strategy="single")
    assert (work_dir / "logs" / "train.log").read_text() == "epoch 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work_dir"]
    # an empty folder is taken
    (tmp_path / "empty").mkdir()
    save_checkpoint(tmp_path / "empty", model=torch.nn.Linear(3, 2), strategy="single")
    assert (tmp_path / "empty" / "manifest.json").is_file()


def test_a_folder_with_a_foreign_manifest_is_an_error_and_stays(tmp_path: Path) -> None:
    # manifest.json is a common name (a web app's, a data set's): only a manifest this
    # package wrote makes a folder a checkpoint that a save may replace
    import torch

    from comm_strategies.checkpoint import CheckpointError, save_checkpoint

    app = tmp_path / "webapp"
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "my app", "format_version": 3}')
    (app / "index.html").write_text("mine")
    with pytest.raises(CheckpointError, match=r"found a folder at .*webapp that is not a"):
        save_checkpoint(app, model=torch.nn.Linear(3, 2), strategy="single")
    assert (app / "index.html").read_text() == "mine"
    assert sorted(p.name for p in app.iterdir()) == ["index.html", "manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["webapp"]


def test_glob_characters_in_the_name_remove_only_its_own_leftovers(tmp_path: Path) -> None:
    # the leftovers of killed saves are found by a pattern built from the name: a name
    # holding *, ? or [ once matched (and deleted) other saves' folders and user files
    import torch

    from comm_strategies.checkpoint import _publish, load_checkpoint, save_checkpoint

    (tmp_path / ".epoch_1.tmp-running").mkdir()  # another save of another name
    (tmp_path / ".notes.old-2024").write_text("mine")
    (tmp_path / ".ckpt[1].tmp-killed").mkdir()  # a killed save of this very name
    model = torch.nn.Linear(3, 2)
    for name, step in (("*", 1), ("epoch_?", 2), ("ckpt[1]", 3)):
        save_checkpoint(tmp_path / name, model=model, strategy="single", extra={"step": step})
        assert load_checkpoint(tmp_path / name, model=torch.nn.Linear(3, 2)) == {"step": step}
    _publish._wait_for_deletions()
    assert (tmp_path / ".notes.old-2024").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "*",
        ".epoch_1.tmp-running",
        ".notes.old-2024",
        "ckpt[1]",
        "epoch_?",
    ]


def test_a_link_at_the_path_is_replaced_and_its_target_kept(tmp_path: Path) -> None:
    import torch

    from comm_strategies.checkpoint import _publish, load_checkpoint, save_checkpoint

    model = torch.nn.Linear(3, 2)
    target = save_checkpoint(tmp_path / "epoch_1", model=model, strategy="single")
    (tmp_path / "latest").symlink_to(target)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for name, step in (("latest", 2), ("dangling", 3)):
        save_checkpoint(tmp_path / name, model=model, strategy="single", extra={"step": step})
        assert not (tmp_path / name).is_symlink()
        assert load_checkpoint(tmp_path / name, model=torch.nn.Linear(3, 2)) == {"step": step}
    _publish._wait_for_deletions()
    # the links themselves were removed, not what "latest" pointed to
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "epoch_1", "latest"]
    assert (target / "manifest.json").is_file()


def test_a_failure_capturing_state_on_one_rank_is_an_error_on_every_rank(
    comm_pools: Any, tmp_path: Path
) -> None:
    messages = comm_pools.get(2).run(cases.state_capture_fails_on_rank_0, str(tmp_path), timeout=60)
    for message in messages:
        assert "rank 0" in message, message
        assert "this scheduler cannot be saved" in message, message
    assert not (tmp_path / "broken").exists()


def _moments(optim: Any) -> float:
    """The sum of every Adam moment of the engine's inner optimizer (its flat partitions)."""
    state = cases.torch_optimizer(optim).state
    return float(sum(v["exp_avg"].abs().sum() for v in state.values()))


def native_folder_restores_the_engines_optimizer(root: str) -> tuple[float, float, float]:
    """DeepSpeed's own folder into the engine, no optim wrapper passed: the engine owns its
    optimizer, so its moments come back with the weights (load_optimizer=True)."""
    from comm_strategies.checkpoint import load_checkpoint

    model, optim = cases.build("zero1")
    cases.train_steps(model, optim, range(2))
    model.model.save_checkpoint(f"{root}/own", tag="step2")
    saved = _moments(optim)
    cases.train_steps(model, optim, range(2, 5))
    moved = _moments(optim)
    load_checkpoint(f"{root}/own", model=model)
    return saved, moved, _moments(optim)


def test_deepspeeds_own_folder_restores_the_engines_optimizer(
    comm_pools: Any, tmp_path: Path
) -> None:
    results = comm_pools.get(2).run(
        native_folder_restores_the_engines_optimizer, str(tmp_path), timeout=120
    )
    for saved, moved, restored in results:
        assert moved != saved  # three more steps changed the moments
        assert restored == saved
