"""`ModelParallelStrategy`: tensor parallel + FSDP2 on a 2-D device mesh, and HSDP."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

import comm_collectives as dist
from comm_wrappers import MMFullyShardedDataParallel2
from comm_wrappers.backends import rank_device

from .base import Strategy

__all__ = ["ModelParallelStrategy"]

#: The mesh's dimension names, outermost first ("replicate" only with replicate_size > 1).
REPLICATE, DATA_PARALLEL, TENSOR_PARALLEL = "replicate", "data_parallel", "tensor_parallel"

ParallelizeFn = Callable[[nn.Module, Any], Any]


def _check_size(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        allowed = "an int or None" if optional else "an int"
        message = f"{name} must be {allowed}, got {value!r}"
        raise TypeError(message)
    if value < 1:
        message = f"{name} must be at least 1, got {value}"
        raise ValueError(message)


def mesh_shape(
    world_size: int, data_parallel_size: int | None, tensor_parallel_size: int, replicate_size: int
) -> dict[str, int]:
    """The mesh's dimensions ``{name: size}`` for ``world_size`` ranks, outermost first.

    Args:
        world_size: The number of ranks.
        data_parallel_size: Ranks that shard the model (FSDP2); None: the rest of the world.
        tensor_parallel_size: Ranks that split each layer of the plan.
        replicate_size: Replicas of the sharded model (HSDP); 1: plain FSDP2.

    Raises:
        ValueError: The sizes do not multiply to the world size.

    Examples:
        >>> mesh_shape(8, None, 2, 2)
        {'replicate': 2, 'data_parallel': 2, 'tensor_parallel': 2}
        >>> mesh_shape(4, None, 4, 1)
        {'data_parallel': 1, 'tensor_parallel': 4}
    """
    fixed = tensor_parallel_size * replicate_size
    if data_parallel_size is None:
        if world_size % fixed:
            message = (
                f"ModelParallelStrategy: tensor_parallel_size={tensor_parallel_size} x "
                f"replicate_size={replicate_size} = {fixed} does not divide the world size "
                f"{world_size}; choose sizes whose product divides it (data_parallel_size "
                "takes the rest)"
            )
            raise ValueError(message)
        data_parallel_size = world_size // fixed
    if data_parallel_size * fixed != world_size:
        message = (
            f"ModelParallelStrategy: replicate_size={replicate_size} x data_parallel_size="
            f"{data_parallel_size} x tensor_parallel_size={tensor_parallel_size} = "
            f"{data_parallel_size * fixed} ranks, but the world has {world_size}; the sizes "
            "must multiply to the world size (data_parallel_size=None takes the rest)"
        )
        raise ValueError(message)
    shape = {REPLICATE: replicate_size} if replicate_size > 1 else {}
    shape[DATA_PARALLEL] = data_parallel_size
    shape[TENSOR_PARALLEL] = tensor_parallel_size
    return shape


class ModelParallelStrategy(Strategy):
    """Tensor parallel inside each group of ranks, FSDP2 (or HSDP) across the groups.

    `prepare` builds a ``DeviceMesh`` named ``("data_parallel", "tensor_parallel")``
    (``("replicate", "data_parallel", "tensor_parallel")`` when ``replicate_size > 1``),
    calls ``parallelize_fn(model, device_mesh)`` (which applies the tensor-parallel plan,
    e.g. ``parallelize_module(model, device_mesh["tensor_parallel"], plan)``), checks that
    every split dimension divides evenly, then shards the model with ``fully_shard`` over
    the data-parallel dimension (both ``replicate`` and ``data_parallel`` for HSDP) unless
    the function sharded its root already. The step API is that of the other strategies:
    ``model.train_step(batch, optim_wrapper)`` or ``optim_wrapper.update_params(loss)``.

    Ranks that differ only in their tensor-parallel coordinate must see the same batch:
    take each rank's share with `sampler` (or `data_parallel_rank` and
    `data_parallel_world_size`), not with the world rank. For the same reason
    ``diff_rank_seed=True`` seeds each rank with ``seed + data_parallel_rank``; the model's
    initial values are still one model's: rank 0's, broadcast before the plan (as DDP does).

    A model built on the meta device (``with torch.device("meta"): model = Net()``) stays
    there through the plan and ``fully_shard``; each rank then allocates its shards only
    (``to_empty``) and initialises them: ``reset_parameters()`` of every submodule that has
    one, then the model's own ``init_weights()`` if it has one, under the strategy's seed.
    (A ``parallelize_fn`` that materialises the model itself is left alone.)

    Args:
        parallelize_fn: ``fn(model, device_mesh)`` applying the tensor-parallel plan (and
            optionally activation checkpointing or its own ``fully_shard`` calls, over the
            strategy's shard mesh: ``device_mesh["data_parallel"]``, or
            ``device_mesh["replicate", "data_parallel"]`` for HSDP); it may return the model
            (or a replacement module), or None. None: no plan (FSDP2 or HSDP only). When it
            shards the root itself, the result is still wrapped (the step API), and
            ``model_wrapper`` options, which only the strategy's ``fully_shard`` takes, are
            refused.
        data_parallel_size: Ranks that shard the model; None: the world divided by the
            other sizes.
        tensor_parallel_size: Ranks that split each planned layer.
        replicate_size: Replicas of the sharded model (HSDP) when above 1.
        model_wrapper: Options of `MMFullyShardedDataParallel2` (``mixed_precision``,
            ``auto_wrap_policy``, ``reshard_after_forward``, ...). Not mutated.
        **kwargs: See `Strategy`.

    Raises:
        TypeError: A size is not an int, or ``parallelize_fn`` is not callable.
        ValueError: A size is below 1; ``tensor_parallel_size > 1`` without a plan.

    Examples:
        >>> import torch
        >>> strategy = ModelParallelStrategy(seed=0)  # a world of one: a 1 x 1 mesh
        >>> model, optim, _ = strategy.prepare(
        ...     torch.nn.Linear(2, 1), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1))
        ... )
        >>> strategy.device_mesh.mesh_dim_names
        ('data_parallel', 'tensor_parallel')
        >>> optim.update_params(model(torch.ones(3, 2)).sum())
        >>> strategy.teardown()
    """

    name = "model_parallel"

    def __init__(
        self,
        *,
        parallelize_fn: ParallelizeFn | None = None,
        data_parallel_size: int | None = None,
        tensor_parallel_size: int = 1,
        replicate_size: int = 1,
        model_wrapper: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if parallelize_fn is not None and not callable(parallelize_fn):
            message = (
                f"parallelize_fn must be a callable fn(model, device_mesh), got {parallelize_fn!r}"
            )
            raise TypeError(message)
        _check_size("data_parallel_size", data_parallel_size, optional=True)
        _check_size("tensor_parallel_size", tensor_parallel_size)
        _check_size("replicate_size", replicate_size)
        if tensor_parallel_size > 1 and parallelize_fn is None:
            message = (
                f"tensor_parallel_size={tensor_parallel_size} needs a parallelize_fn that "
                "applies a tensor-parallel plan, e.g. lambda model, mesh: parallelize_module("
                'model, mesh["tensor_parallel"], {"fc1": ColwiseParallel(), "fc2": '
                "RowwiseParallel()})"
            )
            raise ValueError(message)
        self.parallelize_fn = parallelize_fn
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.replicate_size = replicate_size
        self.model_wrapper = copy.deepcopy(dict(model_wrapper or {}))
        if "mesh" in self.model_wrapper or "type" in self.model_wrapper:
            message = (
                "ModelParallelStrategy builds the mesh and picks FSDP2 itself; remove 'mesh' "
                "and 'type' from model_wrapper"
            )
            raise ValueError(message)
        self._mesh: Any = None

    # ------------------------------------------------------------------ the mesh
    @property
    def device_mesh(self) -> Any:
        """The ``DeviceMesh`` (built by `setup_env`, else None)."""
        return self._mesh

    def setup_env(self) -> None:
        """Start the process group (see `Strategy.setup_env`), then build the device mesh.

        Raises:
            ValueError: The sizes do not multiply to the world size (on every rank).
        """
        super().setup_env()
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            shape = mesh_shape(
                self.world_size,
                self.data_parallel_size,
                self.tensor_parallel_size,
                self.replicate_size,
            )
            device = rank_device()
            if device.type != "cpu":
                getattr(torch, device.type).set_device(device)
            self._mesh = init_device_mesh(
                device.type, tuple(shape.values()), mesh_dim_names=tuple(shape)
            )
            if self.diff_rank_seed and self._seed is not None:
                # One seed per data-parallel group: its tensor-parallel ranks must draw
                # the same numbers (dropout in the replicated parts of the model).
                self._seed_everything(self._seed + self.data_parallel_rank)

    def _shard_mesh(self) -> Any:
        """The mesh ``fully_shard`` shards over: data parallel, or replicate x data parallel."""
        names = self._mesh.mesh_dim_names
        if REPLICATE in names:
            return self._mesh[REPLICATE, DATA_PARALLEL]
        return self._mesh[DATA_PARALLEL]

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the ranks that see different data (0 before the mesh)."""
        if self._mesh is None:
            return 0
        coordinate = self._mesh.get_coordinate() or [0]
        names = list(self._mesh.mesh_dim_names)
        index = coordinate[names.index(DATA_PARALLEL)]
        if REPLICATE in names:
            index += coordinate[names.index(REPLICATE)] * self._mesh.size(
                names.index(DATA_PARALLEL)
            )
        return int(index)

    @property
    def data_parallel_world_size(self) -> int:
        """How many ranks see different data: replicate x data parallel (1 before the mesh)."""
        if self._mesh is None:
            return 1
        return int(self._shard_mesh().size())

    def sampler(
        self,
        dataset: Any,
        *,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> torch.utils.data.DistributedSampler[Any]:
        """A ``DistributedSampler`` over the data-parallel ranks (tensor-parallel ranks share).

        Each data-parallel rank gets its own share of ``dataset``; the ranks of one
        tensor-parallel group (same data-parallel coordinates) get the same indices, in
        the same order. Call ``set_epoch`` on it every epoch, as with any sampler.

        Args:
            dataset: A map-style dataset (with ``__len__``).
            shuffle: Shuffle the indices each epoch.
            seed: The shuffle's seed; None: the strategy's seed (the same on every rank).
            drop_last: Drop the tail instead of padding it by repetition.

        Raises:
            RuntimeError: Called before `setup_env` (or `prepare`): there is no mesh yet.
        """
        if self._mesh is None:
            message = "ModelParallelStrategy.sampler needs the device mesh: call prepare (or setup_env) first"
            raise RuntimeError(message)
        return torch.utils.data.DistributedSampler(
            dataset,
            num_replicas=self.data_parallel_world_size,
            rank=self.data_parallel_rank,
            shuffle=shuffle,
            seed=int(seed if seed is not None else (self.seed or 0)),
            drop_last=drop_last,
        )

    # ------------------------------------------------------------------ wrapping
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        on_meta = _on_meta(model)
        error: BaseException | None = None
        sharded = False
        try:
            if not on_meta:
                model = model.to(rank_device())
                self._same_initial_values(model)
            if self.parallelize_fn is not None:
                returned = self.parallelize_fn(model, self._mesh)
                if returned is not None and not isinstance(returned, nn.Module):
                    message = (
                        "parallelize_fn must return the model (or a replacement nn.Module) or "
                        f"None, got a {type(returned).__name__}: {_short(returned)}"
                    )
                    raise TypeError(message)
                if returned is not None:
                    model = returned
            _check_even_split(model)
            self._check_fsdp_meshes(model)
            sharded = _is_fully_sharded(model)
            if sharded and self.model_wrapper:
                message = (
                    f"model_wrapper options {sorted(self.model_wrapper)} cannot apply: "
                    "parallelize_fn called fully_shard on the root itself, so the strategy's "
                    "fully_shard (which takes them) does not run. Pass them to your own "
                    "fully_shard calls (e.g. mp_policy=MixedPrecisionPolicy(param_dtype="
                    "torch.bfloat16)), or leave the root's fully_shard to the strategy"
                )
                raise ValueError(message)
        except Exception as failure:  # raised on every rank, below
            error = failure
        # Every rank raises when any rank's plan failed: none of them goes on to a forward
        # whose collectives the failed rank would never join.
        dist.agree("ModelParallelStrategy.parallelize_fn", error)
        wrapped: nn.Module
        if sharded:  # the function sharded the root itself: the same wrapper, no new shard
            wrapped = _wrapper_of_sharded(model, self._shard_mesh())
        else:
            wrapped = MMFullyShardedDataParallel2(
                model, mesh=self._shard_mesh(), **copy.deepcopy(self.model_wrapper)
            )
        if on_meta and _on_meta(model):  # (unless parallelize_fn materialised it itself)
            self._materialise(model)
        return wrapped

    def _check_fsdp_meshes(self, model: nn.Module) -> None:
        """Raise when ``fully_shard`` ran (in ``parallelize_fn``) over another mesh than the strategy's.

        Under HSDP a module sharded over ``mesh["data_parallel"]`` alone never reduces its
        gradients across the replicas: they would train apart.
        """
        from torch.distributed.fsdp import FSDPModule

        expected = self._shard_mesh()
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in module._get_fsdp_state()._fsdp_param_groups:
                mesh = group.mesh_info.mesh
                if _same_mesh(mesh, expected):
                    continue
                where = f"module {name!r}" if name else "the root module"
                message = (
                    f"rank {self.rank}: parallelize_fn called fully_shard on {where} over the "
                    f"mesh {_describe(mesh)}, but this strategy shards over {_describe(expected)}; "
                    "its gradients would not be reduced over every data-parallel rank. Pass "
                    "mesh=device_mesh["
                    + ", ".join(repr(n) for n in expected.mesh_dim_names)
                    + "] to fully_shard (or leave fully_shard to the strategy)"
                )
                raise ValueError(message)

    def _materialise(self, model: nn.Module) -> None:
        """Allocate a meta model's (sharded) tensors on this rank's device and initialise them.

        ``reset_parameters()`` of every submodule that has one, then the model's own
        ``init_weights()`` when it has one, under the strategy's common seed (the random
        state afterwards is what it was).
        """
        model.to_empty(device=rank_device())
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self._seed if self._seed is not None else 0)
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
            init_weights = getattr(model, "init_weights", None)
            if callable(init_weights):
                init_weights()

    def teardown(self) -> None:
        """Forget the mesh, then destroy the process group if `setup_env` created it."""
        super().teardown()
        self._mesh = None

    def __repr__(self) -> str:
        state = "prepared" if self._prepared else "not prepared"
        sizes = (
            f"data_parallel_size={self.data_parallel_size}, "
            f"tensor_parallel_size={self.tensor_parallel_size}, replicate_size={self.replicate_size}"
        )
        return f"{type(self).__name__}({sizes}, {state})"


def _is_fully_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _wrapper_of_sharded(model: nn.Module, mesh: Any) -> nn.Module:
    """`MMFullyShardedDataParallel2` around a root ``fully_shard`` was applied to already.

    The step API (``train_step``, ``no_sync``) without a second ``fully_shard``.
    """
    wrapper = MMFullyShardedDataParallel2.__new__(MMFullyShardedDataParallel2)
    nn.Module.__init__(wrapper)
    wrapper.mesh = mesh
    wrapper.module = model
    return wrapper


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _same_mesh(mesh: Any, other: Any) -> bool:
    return bool(
        tuple(mesh.mesh_dim_names or ()) == tuple(other.mesh_dim_names or ())
        and mesh.mesh.tolist() == other.mesh.tolist()
    )


def _describe(mesh: Any) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return f"{tuple(names)} of ranks {mesh.mesh.tolist()}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _check_even_split(model: nn.Module) -> None:
    """Raise when the plan split a parameter along a dimension its mesh does not divide.

    torch would accept the uneven shards; the checkpoints, the clipping and the comparison
    with one process all assume even ones, and an uneven split is almost always a plan
    written for another mesh.
    """
    from torch.distributed.tensor import DTensor, Shard

    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        names = mesh.mesh_dim_names or ()
        for axis, placement in enumerate(param.placements):
            if not isinstance(placement, Shard):
                continue
            if axis < len(names) and names[axis] in (DATA_PARALLEL, REPLICATE):
                continue  # FSDP's own shards (parallelize_fn's fully_shard): uneven is fine
            size = mesh.size(axis)
            length = param.shape[placement.dim]
            if length % size:
                axis_name = names[axis] if axis < len(names) else f"dim {axis}"
                message = (
                    f"the tensor-parallel plan splits {name} (shape {tuple(param.shape)}) "
                    f"along dimension {placement.dim} of length {length} over the "
                    f"{axis_name!r} mesh dimension of size {size}, which does not divide it; "
                    "choose a tensor_parallel_size that divides the layer's width, or leave "
                    "this layer out of the plan"
                )
                raise ValueError(message)
