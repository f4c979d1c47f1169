"""`ElasticSampler`: the data position in global samples continues at any world size.

The expected orders are computed here, independently of the sampler: by hand for an
unshuffled dataset, and from ``torch.randperm`` seeded with ``seed + epoch`` (the
documented order) cut into global batches otherwise. A world of W ranks is simulated in
one process by passing ``rank``/``world_size`` explicitly where that is enough; the
indivisible global batch and the end-to-end resume run on real gloo worlds of 1, 2 and 3.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

import comm_collectives as dist
from comm_strategies import ElasticSampler, build_strategy
from tests.helpers import caught, full_params

SEED = 7


def expected_global_batches(
    n: int, global_batch: int, count: int, *, seed: int = SEED, drop_last: bool = False
) -> list[list[int]]:
    """The first ``count`` global batches of the documented order, epoch after epoch."""
    out: list[list[int]] = []
    epoch = 0
    while len(out) < count:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        steps = n // global_batch if drop_last else -(-n // global_batch)
        while len(order) < steps * global_batch:  # completed from the permutation's start
            order = order + order
        out += [order[s * global_batch : (s + 1) * global_batch] for s in range(steps)]
        epoch += 1
    return out[:count]


def samplers_of(world: int, *args: Any, **kwargs: Any) -> list[ElasticSampler]:
    """One sampler per simulated rank."""
    return [ElasticSampler(*args, rank=r, world_size=world, **kwargs) for r in range(world)]


def train_simulated(samplers: list[ElasticSampler], steps: int) -> list[list[int]]:
    """Run ``steps`` optimizer steps as a loop on each rank would, micro batch by micro batch.

    Returns the global batches: the ranks' micro batches, in rank order, of each step.
    """
    micro, accumulation = samplers[0].micro_batch_size, samplers[0].accumulation_steps
    batches: list[list[int]] = []
    while len(batches) < steps:
        for s in samplers:
            s.set_epoch(s.epoch)  # what a loop does at each epoch's start: keeps the position
        iterators = [iter(s) for s in samplers]
        for _ in range(len(samplers[0]) // (micro * accumulation)):
            ranks = [
                [[next(it) for _ in range(micro)] for _ in range(accumulation)] for it in iterators
            ]
            batches.append([i for rank in ranks for mb in rank for i in mb])
            for s in samplers:
                s.advance()
            if len(batches) == steps:
                break
        assert all(next(it, None) is None or len(batches) == steps for it in iterators)
    return batches


# ------------------------------------------------------------------ the order


def test_each_rank_takes_a_contiguous_share_of_each_global_batch_by_hand() -> None:
    # 10 samples, global batch 4, 2 ranks, no shuffle: global batches [0-3] [4-7] [8 9 0 1]
    # (the last completed from the start); rank 0 takes the first half of each.
    rank0, rank1 = samplers_of(2, 10, global_batch_size=4, shuffle=False)
    assert list(rank0) == [0, 1, 4, 5, 8, 9]
    assert list(rank1) == [2, 3, 6, 7, 0, 1]
    assert (len(rank0), len(rank1), rank0.steps_per_epoch) == (6, 6, 3)
    dropped = samplers_of(2, 10, global_batch_size=4, shuffle=False, drop_last=True)
    assert [list(s) for s in dropped] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # 3 samples, global batch 8: the permutation repeats until the batch is full.
    small = samplers_of(4, 3, global_batch_size=8, shuffle=False)
    assert [list(s) for s in small] == [[0, 1], [2, 0], [1, 2], [0, 1]]


def test_the_union_over_ranks_of_a_global_batch_is_the_seeded_permutation_slice() -> None:
    n, g = 23, 6
    expected = expected_global_batches(n, g, 4)
    for world in (1, 2, 3, 6):
        shares = [list(s) for s in samplers_of(world, n, global_batch_size=g, seed=SEED)]
        per = g // world
        for step in range(4):
            union = [i for share in shares for i in share[step * per : (step + 1) * per]]
            assert union == expected[step], (world, step)
    # epoch 1 is another permutation, the same on every rank
    s = ElasticSampler(n, global_batch_size=g, seed=SEED)
    s.set_epoch(1)
    assert list(s) == [i for b in expected_global_batches(n, g, 8)[4:8] for i in b]
    assert list(s) != [i for b in expected for i in b]


def test_in_a_plain_process_the_sampler_is_rank_0_of_a_world_of_one() -> None:
    s = ElasticSampler(list(range(12)), global_batch_size=4, seed=SEED)
    assert (s.rank, s.world_size, s.micro_batch_size, s.accumulation_steps) == (0, 1, 4, 1)
    assert list(s) == [i for b in expected_global_batches(12, 4, 3) for i in b]


def test_accumulation_splits_the_rank_share_into_capped_micro_batches() -> None:
    split = ElasticSampler.split_global_batch
    assert split(12, 2) == (6, 1)
    assert split(12, 2, max_micro_batch_size=4) == (3, 2)  # 6 = 2 x 3
    assert split(12, 1, max_micro_batch_size=5) == (4, 3)  # 12 = 3 x 4
    assert split(12, 3, max_micro_batch_size=4) == (4, 1)
    assert split(14, 2, max_micro_batch_size=3) == (1, 7)  # 7 is prime: micro batches of 1
    s = ElasticSampler(24, global_batch_size=12, world_size=2, rank=1, max_micro_batch_size=4)
    assert (s.micro_batch_size, s.accumulation_steps, s.batch_size_per_rank) == (3, 2, 6)


def test_an_indivisible_global_batch_is_a_clear_error_in_one_process() -> None:
    with pytest.raises(ValueError) as error:
        ElasticSampler(100, global_batch_size=10, rank=2, world_size=4)
    text = str(error.value)
    assert text.startswith("ElasticSampler on rank 2: global_batch_size=10 cannot be split")
    assert "over world_size=4 ranks (10 % 4 = 2)" in text
    assert "Pick a global batch divisible by 4 (8 or 12)" in text
    assert "world size that divides 10 (e.g. 1, 2, 5, 10)" in text
    with pytest.raises(ValueError, match="with or without accumulation"):
        ElasticSampler(100, global_batch_size=10, world_size=4, rank=0, max_micro_batch_size=1)


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(TypeError, match="global_batch_size must be an int, got float"):
        ElasticSampler(10, global_batch_size=4.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="global_batch_size must be an int, got bool"):
        ElasticSampler(10, global_batch_size=True)
    with pytest.raises(ValueError, match="global_batch_size must be >= 1, got 0"):
        ElasticSampler(10, global_batch_size=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\) for a world of 2, got 2"):
        ElasticSampler(10, global_batch_size=4, rank=2, world_size=2)
    with pytest.raises(TypeError, match="map-style dataset"):
        ElasticSampler(iter(range(3)), global_batch_size=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holds no full global batch of 8 with drop_last=True"):
        ElasticSampler(5, global_batch_size=8, drop_last=True)
    with pytest.raises(ValueError, match="steps must be >= 0, got -1"):
        ElasticSampler(10, global_batch_size=2).advance(-1)


# ------------------------------------------------------------------ resuming


@pytest.mark.parametrize(
    ("after", "max_micro"),
    [(1, None), (2, None), (3, None), (6, None), (1, 2), (4, 1)],
    ids=["world1", "world2", "world3", "world6", "world1-accumulate", "world4-accumulate"],
)
@pytest.mark.parametrize("stop", [3, 4, 9])  # mid-epoch, at an epoch's end, in epoch 2
def test_a_resume_at_another_world_size_continues_the_global_batches(
    after: int, max_micro: int | None, stop: int
) -> None:
    n, g, total = 22, 12, 13  # 2 global batches per epoch, the second completed
    uninterrupted = train_simulated(samplers_of(2, n, global_batch_size=g, seed=SEED), total)
    assert uninterrupted == expected_global_batches(n, g, total)
    first = samplers_of(2, n, global_batch_size=g, seed=SEED)
    before = train_simulated(first, stop)
    states = [s.state_dict() for s in first]
    assert all(state == states[0] for state in states)  # the same on every rank
    assert states[0] == {
        "epoch": stop // 2,
        "position": stop % 2 * g,
        "seed": SEED,
        "global_batch_size": g,
        "num_samples": n,
        "shuffle": True,
        "drop_last": False,
    }
    second = samplers_of(after, n, global_batch_size=g, seed=0, max_micro_batch_size=max_micro)
    for s in second:
        s.load_state_dict(pickle.loads(pickle.dumps(states[0])))
    assert second[0].seed == SEED  # the state's seed replaces the constructor's
    after_resume = train_simulated(second, total - stop)
    assert before + after_resume == uninterrupted


def test_set_epoch_keeps_the_current_epoch_and_restarts_another() -> None:
    n, g = 12, 4
    expected = expected_global_batches(n, g, 9)
    s = ElasticSampler(n, global_batch_size=g, seed=SEED)
    s.advance(2)
    s.set_epoch(0)  # the current epoch: no-op, position kept
    assert (s.epoch, s.position, list(s)) == (0, 8, expected[2])
    s.set_epoch(2)  # another epoch: from its start
    assert (s.epoch, s.position, list(s)) == (2, 0, [i for b in expected[6:9] for i in b])
    s.advance()
    s.set_epoch(1)  # going back is another epoch too
    assert (s.epoch, s.position) == (1, 0)
    s.advance(3)  # the epoch's last step: the next epoch, from its start
    assert (s.epoch, s.position, len(s)) == (2, 0, 12)
    s.set_epoch(2)  # so the loop's set_epoch(epoch + 1) changes nothing
    assert list(s) == [i for b in expected[6:9] for i in b]
    s.advance(7)  # across epochs: 2 full epochs and one step
    assert (s.epoch, s.position) == (4, 4)


def test_an_epoch_loop_that_calls_set_epoch_resumes_mid_epoch() -> None:
    # The loop users write, stopped mid-epoch 1 and restarted from the state.
    n, g, epochs = 10, 4, 3
    expected = expected_global_batches(n, g, 3 * epochs)

    def loop(sampler: ElasticSampler, stop_after: int | None) -> list[list[int]]:
        seen: list[list[int]] = []
        for epoch in range(sampler.epoch, epochs):  # the first epoch from the sampler
            sampler.set_epoch(epoch)
            loader = DataLoader(
                TensorDataset(torch.arange(n)), sampler=sampler, batch_size=sampler.micro_batch_size
            )
            for (batch,) in loader:
                seen.append(batch.tolist())
                sampler.advance()
                if len(seen) == stop_after:
                    return seen
        return seen

    first = ElasticSampler(n, global_batch_size=g, seed=SEED)
    head = loop(first, stop_after=4)
    resumed = ElasticSampler(n, global_batch_size=g, seed=SEED)
    resumed.load_state_dict(first.state_dict())
    assert (resumed.epoch, resumed.position) == (1, 4)
    assert head + loop(resumed, stop_after=None) == expected


def test_dataloader_workers_give_the_same_batches_and_do_not_move_the_position() -> None:
    n, g = 40, 8
    data = TensorDataset(torch.arange(n))
    expected = expected_global_batches(n, g, 5)
    rank1 = [b[4:8] for b in expected]  # rank 1 of 2: the second half of each global batch

    def loader(
        sampler: ElasticSampler, workers: int, batch_sampler: bool = False
    ) -> DataLoader[Any]:
        if batch_sampler:
            batches = BatchSampler(sampler, sampler.micro_batch_size, drop_last=False)
            return DataLoader(data, batch_sampler=batches, num_workers=workers)
        return DataLoader(
            data, sampler=sampler, batch_size=sampler.micro_batch_size, num_workers=workers
        )

    for workers, as_batches in ((0, False), (2, False), (2, True)):
        s = ElasticSampler(data, global_batch_size=g, seed=SEED, rank=1, world_size=2)
        assert [b[0].tolist() for b in loader(s, workers, as_batches)] == rank1
    # Stop after 2 steps while the workers have prefetched further: the position is what
    # advance() counted, and a resume at world 1 continues with the third global batch.
    s = ElasticSampler(data, global_batch_size=g, seed=SEED, rank=1, world_size=2)
    iterator = iter(loader(s, 2))
    for _ in range(2):
        next(iterator)
        s.advance()
    assert s.state_dict()["position"] == 2 * g
    del iterator
    alone = ElasticSampler(data, global_batch_size=g, seed=SEED)
    alone.load_state_dict(s.state_dict())
    assert [b[0].tolist() for b in loader(alone, 2)] == expected[2:]


def test_the_state_is_plain_picklable_and_loads_with_weights_only() -> None:
    s = ElasticSampler(30, global_batch_size=6, seed=SEED, rank=0, world_size=3)
    s.advance(7)
    state = s.state_dict()
    buffer = io.BytesIO()
    torch.save({"sampler": state}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["sampler"] == state
    assert pickle.loads(pickle.dumps(state)) == state
    assert state == {
        "epoch": 1,
        "position": 12,
        "seed": SEED,
        "global_batch_size": 6,
        "num_samples": 30,
        "shuffle": True,
        "drop_last": False,
    }


def test_a_state_for_another_dataset_or_global_batch_is_refused() -> None:
    state = ElasticSampler(30, global_batch_size=6).state_dict()
    cases = [
        (ElasticSampler(31, global_batch_size=6), "num_samples=30, this sampler has num_samples=31"),
        (ElasticSampler(30, global_batch_size=12), "global_batch_size=6, this sampler has global_batch_size=12"),
        (ElasticSampler(30, global_batch_size=6, shuffle=False), "shuffle=True, this sampler has shuffle=False"),
        (ElasticSampler(30, global_batch_size=6, drop_last=True), "drop_last=False, this sampler has drop_last=True"),
    ]  # fmt: skip
    for sampler, expected in cases:
        kind, text = caught(sampler.load_state_dict, state)
        assert kind == "ValueError"
        assert text.startswith("ElasticSampler.load_state_dict on rank 0: the state was saved")
        assert expected in text
        assert "the global batch must not change" in text
    fresh = ElasticSampler(30, global_batch_size=6)
    kind, text = caught(fresh.load_state_dict, {"epoch": 0})
    assert kind == "ValueError"
    assert "the state lacks ['position', 'seed'," in text
    assert caught(fresh.load_state_dict, {**state, "position": 5})[0] == "ValueError"
    assert caught(fresh.load_state_dict, {**state, "position": 36})[0] == "ValueError"
    assert caught(fresh.load_state_dict, [1, 2])[0] == "TypeError"
    fresh.load_state_dict({**state, "epoch": 2, "position": 30})  # the end: the next epoch
    assert (fresh.epoch, fresh.position) == (3, 0)


# ------------------------------------------------------------------ real worlds


def sampler_in_world(n: int, good: int, bad: int) -> dict[str, Any]:
    """Build samplers from the process group's rank and world; one that cannot split."""
    error = caught(ElasticSampler, n, global_batch_size=bad, seed=SEED)
    sampler = ElasticSampler(n, global_batch_size=good, seed=SEED)
    indices = list(sampler)
    sampler.advance(3)
    states = dist.all_gather_object(pickle.dumps(sampler.state_dict()))
    return {
        "error": error,
        "rank": (sampler.rank, sampler.world_size),
        "indices": indices,
        "states": [pickle.loads(s) for s in states],
    }


def test_in_a_real_world_the_indivisible_batch_raises_on_every_rank(
    comm_run_distributed: Any,
) -> None:
    n, good, bad = 20, 6, 10
    results = comm_run_distributed(sampler_in_world, n, good, bad, world_size=3, timeout=60)
    expected = expected_global_batches(n, good, 4)
    for rank, result in enumerate(results):
        kind, text = result["error"]
        assert kind == "ValueError"
        assert text.startswith(f"ElasticSampler on rank {rank}: global_batch_size=10 cannot be")
        assert "over world_size=3 ranks (10 % 3 = 1)" in text
        assert "Pick a global batch divisible by 3 (9 or 12)" in text
        assert result["rank"] == (rank, 3)
        assert result["indices"] == [i for b in expected for i in b[2 * rank : 2 * rank + 2]]
        assert result["states"] == [results[0]["states"][0]] * 3  # equal on every rank
    assert results[0]["states"][0]["position"] == 3 * good


# ------------------------------------------------------------------ end to end

N, G, STEPS = 20, 6, 9  # 4 global batches per epoch (the last completed): 9 steps end in epoch 2


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(N, 4, generator=generator, dtype=torch.float64)
    targets = torch.tanh(inputs @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]], dtype=torch.float64))
    return TensorDataset(
        inputs, targets + 0.1 * torch.randn(N, 1, generator=generator, dtype=torch.float64)
    )


def train_with_sampler(
    work: str,
    *,
    save_at: list[int],
    resume: str | None,
    max_micro: int | None,
    load_sampler: bool = True,
) -> dict[str, Any]:
    """Train a float64 MLP under DDP with the sampler to STEPS, saving and resuming."""
    strategy = build_strategy("ddp", work_dir=work, seed=0)
    sampler = ElasticSampler(N, global_batch_size=G, seed=SEED, max_micro_batch_size=max_micro)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optim_wrapper = {
        "optimizer": {"type": "SGD", "lr": 0.1, "momentum": 0.9},
        "accumulative_counts": sampler.accumulation_steps,
    }
    model, optim, _ = strategy.prepare(net.double(), optim_wrapper=optim_wrapper)
    step = 0
    if resume is not None:
        extra = strategy.resume(resume, timeout=60)
        step = extra["step"]
        if load_sampler:
            sampler.load_state_dict(extra["sampler"])
    loader = DataLoader(dataset(), sampler=sampler, batch_size=sampler.micro_batch_size)
    for epoch in range(sampler.epoch, 10):
        sampler.set_epoch(epoch)
        for micro, (inputs, targets) in enumerate(loader):
            with optim.optim_context(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)  # the share's mean
            optim.update_params(loss)  # divided by the accumulation; DDP averages the ranks
            if (micro + 1) % sampler.accumulation_steps:
                continue
            sampler.advance()
            step += 1
            if step in save_at:
                extra = {"sampler": sampler.state_dict(), "step": step}
                strategy.save_checkpoint(f"step_{step}", extra=extra, timeout=60)
            if step == STEPS:
                params = {k: v.tolist() for k, v in full_params(model).items()}  # no shared memory
                return {"params": params, "state": sampler.state_dict()}
    raise AssertionError("the loop ended before STEPS")


def test_ddp_at_world_2_resumed_at_worlds_1_and_3_trains_as_if_uninterrupted(
    comm_pools: Any, tmp_path: Any
) -> None:
    work = str(tmp_path / "work")
    pool = comm_pools.get(2)
    uninterrupted = pool.run(
        train_with_sampler, work, save_at=[3, 6], resume=None, max_micro=None, timeout=120
    )
    assert uninterrupted[0]["state"] == uninterrupted[1]["state"] == {
        "epoch": 2, "position": 6, "seed": SEED, "global_batch_size": G, "num_samples": N,
        "shuffle": True, "drop_last": False,
    }  # fmt: skip
    reference = uninterrupted[0]["params"]
    runs = {
        # mid-epoch 0, one rank, micro batches of 3 accumulated twice
        "world1": (1, f"{work}/step_3", 3, True),
        # mid-epoch 1, three ranks of 2 samples
        "world3": (3, f"{work}/step_6", None, True),
        # the control: the same resume without the sampler's state restarts epoch 0
        "no_state": (1, f"{work}/step_3", None, False),
    }
    diffs = {}
    f64 = torch.float64
    for name, (world, path, max_micro, load) in runs.items():
        results = comm_pools.get(world).run(
            train_with_sampler,
            str(tmp_path / name),
            save_at=[],
            resume=path,
            max_micro=max_micro,
            load_sampler=load,
            timeout=120,
        )
        diffs[name] = max(
            (
                torch.tensor(results[0]["params"][k], dtype=f64)
                - torch.tensor(reference[k], dtype=f64)
            )
            .abs()
            .max()
            .item()
            for k in reference
        )
    assert diffs["world1"] < 1e-5, diffs
    assert diffs["world3"] < 1e-5, diffs
    assert diffs["no_state"] > 1e-3, diffs  # the comparison sees the data order
