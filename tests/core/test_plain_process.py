"""Every query and helper in a plain process: a world of one, no process group."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import comm_core as dist
from comm_core import DeviceMismatchError, cast_data_device, get_data_device


def test_queries_describe_a_world_of_one() -> None:
    assert not dist.is_distributed()
    assert dist.get_world_size() == 1
    assert dist.get_rank() == 0
    assert dist.get_dist_info() == (0, 1)
    assert dist.get_backend() is None
    assert dist.get_local_rank() == 0
    assert dist.get_local_size() == 1
    assert dist.get_local_group() is None
    assert dist.get_default_group() is None
    assert dist.is_main_process()
    dist.barrier()  # a no-op, must not raise
    assert dist.get_comm_device() == torch.device("cpu")


def test_master_only_keeps_name_docstring_and_runs_on_main() -> None:
    calls: list[int] = []

    @dist.master_only
    def save(value: int) -> int:
        """Save a value."""
        calls.append(value)
        return value * 2

    assert save.__name__ == "save"
    assert save.__doc__ == "Save a value."
    assert save(21) == 42
    assert calls == [21]


def test_default_backend_is_gloo_without_cuda() -> None:
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert dist.default_backend() == expected


def test_get_device_names_a_device_type() -> None:
    if torch.cuda.is_available():
        assert dist.get_device() == "cuda"
    elif torch.backends.mps.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        assert dist.get_device() in {"xpu", "mps"}
    else:
        assert dist.get_device() == "cpu"


Pair = collections.namedtuple("Pair", ["left", "right"])


def test_get_data_device_of_nested_structures() -> None:
    cpu = torch.device("cpu")
    assert get_data_device(torch.zeros(2)) == cpu
    assert get_data_device({"a": torch.zeros(1), "b": [torch.ones(1), (torch.ones(2),)]}) == cpu
    assert get_data_device(Pair(torch.zeros(1), torch.zeros(1))) == cpu
    assert get_data_device(torch.zeros(1, device="meta")) == torch.device("meta")
    # values that hold no tensor are skipped when others do
    assert get_data_device([[], torch.zeros(1)]) == cpu


def test_get_data_device_mixed_devices_names_both_paths() -> None:
    data = {"x": torch.zeros(1), "y": [torch.zeros(1, device="meta")]}
    with pytest.raises(DeviceMismatchError) as info:
        get_data_device(data)
    text = str(info.value)
    assert "data['x'] is on cpu" in text
    assert "data['y'][0] is on meta" in text
    assert "non-distributed process" in text


def test_get_data_device_bad_inputs() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        get_data_device({})
    with pytest.raises(TypeError, match="got int at data"):
        get_data_device(3)


def test_cast_data_device_keeps_container_types() -> None:
    data = {
        "pair": Pair(torch.ones(1), [torch.zeros(2)]),
        "tuple": (torch.ones(1), "label", 3),
        "od": collections.OrderedDict(a=torch.ones(1)),
    }
    moved = cast_data_device(data, "meta")
    assert type(moved) is dict
    assert type(moved["pair"]) is Pair
    assert moved["pair"].left.device == torch.device("meta")
    assert type(moved["pair"].right) is list
    assert moved["pair"].right[0].device == torch.device("meta")
    assert moved["tuple"][1:] == ("label", 3)
    assert type(moved["od"]) is collections.OrderedDict
    assert moved["od"]["a"].device == torch.device("meta")
    # the input is untouched
    assert data["pair"].left.device == torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor
    labels: list[torch.Tensor]
    name: str = "batch"
    size: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", int(self.inputs.shape[0]))


def test_cast_data_device_moves_a_dataclass_batch() -> None:
    batch = Batch(torch.ones(3, 2), [torch.zeros(1)])
    moved = cast_data_device({"batch": batch}, "meta")["batch"]
    assert type(moved) is Batch
    assert moved.inputs.device == torch.device("meta")
    assert moved.labels[0].device == torch.device("meta")
    assert (moved.name, moved.size) == ("batch", 3)
    assert batch.inputs.device == torch.device("cpu")  # the input is untouched
    assert cast_data_device(Batch, "meta") is Batch  # a class is not an instance


@dataclasses.dataclass
class Scaled:
    inputs: torch.Tensor
    scale: dataclasses.InitVar[float]  # an init-only argument, not kept as a field
    mask: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self, scale: float) -> None:
        self.inputs = self.inputs * scale
        self.mask = self.inputs > 0


def test_cast_data_device_moves_a_dataclass_with_an_init_only_argument() -> None:
    batch = Scaled(torch.tensor([-1.0, 2.0]), scale=3.0)
    moved = cast_data_device(batch, "meta")
    assert type(moved) is Scaled
    assert moved.inputs.device == torch.device("meta")
    assert moved.mask.device == torch.device("meta")
    assert batch.inputs.tolist() == [-3.0, 6.0]  # scaled once, by the caller's __init__


@dataclasses.dataclass
class Tagged:
    inputs: torch.Tensor
    weights: torch.Tensor = dataclasses.field(init=False, default=torch.empty(0))


def test_cast_data_device_keeps_a_field_set_after_init() -> None:
    batch = Tagged(torch.ones(2))
    batch.weights = torch.full((2,), 0.5)
    moved = cast_data_device(batch, "meta")
    assert moved.weights.shape == (2,)
    assert moved.weights.device == torch.device("meta")


@dataclasses.dataclass
class Tokens:
    ids: torch.Tensor

    def __post_init__(self) -> None:  # prepends the start token, as a tokenizer's batch may
        self.ids = torch.cat([torch.tensor([0]), self.ids])


def test_cast_data_device_does_not_run_post_init_again() -> None:
    batch = Tokens(torch.tensor([5, 6]))
    assert batch.ids.tolist() == [0, 5, 6]
    assert cast_data_device(batch, "cpu").ids.tolist() == [0, 5, 6]


def test_cast_data_device_into_out() -> None:
    src = {"a": torch.tensor([1.0, 2.0]), "b": [torch.tensor([3])]}
    out = {"a": torch.zeros(2), "b": [torch.zeros(1, dtype=torch.long)]}
    result = cast_data_device(src, "cpu", out=out)
    # as MMEngine: the moved data comes back, and out holds a copy of it
    assert result is not out
    assert result["a"].tolist() == [1.0, 2.0]
    assert result["b"][0].tolist() == [3]
    assert out["a"].tolist() == [1.0, 2.0]
    assert out["b"][0].tolist() == [3]
    # the device is honoured with out as well (it was ignored)
    on_meta = cast_data_device(
        src,
        "meta",
        out={
            "a": torch.empty(2, device="meta"),
            "b": [torch.empty(1, dtype=torch.long, device="meta")],
        },
    )
    assert on_meta["a"].device == torch.device("meta")
    with pytest.raises(TypeError, match="keys of data"):
        cast_data_device(src, "cpu", out={"a": torch.zeros(2)})


def test_cast_data_device_keeps_a_defaultdict_and_its_factory() -> None:
    data: collections.defaultdict[str, list[torch.Tensor]] = collections.defaultdict(list)
    data["x"].append(torch.ones(1))
    moved = cast_data_device(data, "meta")
    assert type(moved) is collections.defaultdict
    assert moved.default_factory is list
    assert moved["x"][0].device == torch.device("meta")
    assert moved["missing"] == []


def test_cast_data_device_copies_a_dataclass_into_out() -> None:
    # out= mirrors data: a dataclass's tensor fields are copied into out's, as a dict's
    # values are (they were skipped without a word, out kept its old values)
    batch = Tagged(torch.tensor([1.0, 2.0]))
    batch.weights = torch.tensor([0.25, 0.5])
    out = Tagged(torch.zeros(2))
    out.weights = torch.zeros(2)
    cast_data_device({"b": batch}, "cpu", out={"b": out})
    assert out.inputs.tolist() == [1.0, 2.0]
    assert out.weights.tolist() == [0.25, 0.5]
    with pytest.raises(TypeError, match=r"out must mirror data.*data\['b'\] is a Tagged"):
        cast_data_device({"b": batch}, "cpu", out={"b": [torch.zeros(2)]})
