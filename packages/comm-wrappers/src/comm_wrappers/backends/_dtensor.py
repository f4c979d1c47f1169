"""The adapter of DTensor models on a device mesh: tensor parallel, FSDP2 + TP, HSDP.

A model whose parameters are DTensors on a mesh of more than one dimension (a
tensor-parallel plan applied with ``parallelize_module``, then ``fully_shard`` over the
data-parallel dimension; or ``fully_shard`` over a 2-D mesh: HSDP), or on more than one
mesh (FSDP2's 1-D data-parallel mesh for the layers the plan left alone, the 2-D mesh for
the ones it split). State dicts go through ``torch.distributed.checkpoint.state_dict``
as for FSDP2 (full tensors are gathered by torch, over every mesh dimension); the norm
of the whole model is reduced once per mesh and the parts combined, because torch's
``clip_grad_norm_`` cannot stack norms that live on different meshes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from .._registry import _fsdp2_module_type
from ._base import Backend
from ._fsdp2 import gradient_sync_off

__all__ = ["DTensorBackend", "dtensor_meshes", "is_dtensor_model"]


def _mesh_of(tensor: Any) -> Any:
    return getattr(tensor, "device_mesh", None) if hasattr(tensor, "placements") else None


def dtensor_meshes(model: nn.Module) -> list[Any]:
    """The distinct device meshes of ``model``'s DTensor parameters, in parameter order."""
    meshes: list[Any] = []
    for param in model.parameters():
        mesh = _mesh_of(param)
        if mesh is not None and not any(mesh is seen or mesh == seen for seen in meshes):
            meshes.append(mesh)
    return meshes


@contextlib.contextmanager
def _quiet_redistribute() -> Iterator[None]:
    """Silence DTensor's advice to flatten the mesh when a norm is reduced over 2 dims."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _describe_mesh(mesh: Any) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    sizes = mesh.shape
    return ",".join(f"{name}={size}" for name, size in zip(names, sizes, strict=True))


class DTensorBackend(Backend):
    """DTensor parameters on an N-D mesh: tensor parallel with or without FSDP2, HSDP.

    ``no_sync`` skips FSDP2's gradient reduction (tensor-parallel layers have none to
    skip: their collectives are part of the forward and backward); clipping uses the norm
    of the whole model, each mesh's part reduced over that mesh; mixed precision is FSDP2's
    ``MixedPrecisionPolicy``, given where the model was sharded.
    """

    kind: ClassVar[str] = "dtensor"
    _shards: ClassVar[bool] = True

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Skip the gradient reduce-scatter (and HSDP's all-reduce) of every sharded module."""
        return gradient_sync_off(self.model)

    def describe(self) -> dict[str, Any]:
        """``{"wrapper": "dtensor", "sharding": "<meshes>", "zero_stage": None}``.

        ``sharding`` names the parameters' meshes, e.g.
        ``"data_parallel=2,tensor_parallel=2;data_parallel=2"``, prefixed with
        ``fully_shard:`` when FSDP2 shards the model.
        """
        fsdp2 = _fsdp2_module_type()
        sharded = fsdp2 is not None and any(isinstance(m, fsdp2) for m in self.model.modules())
        meshes = ";".join(_describe_mesh(mesh) for mesh in dtensor_meshes(self._target()))
        prefix = "fully_shard:" if sharded else "tensor_parallel:"
        return {"wrapper": self.kind, "sharding": prefix + meshes, "zero_stage": None}

    def _clip(self, params: list[torch.Tensor], options: dict[str, Any]) -> torch.Tensor:
        """Clip by the whole model's norm: one reduction per mesh, the parts combined."""
        norm_type = float(options["norm_type"])
        meshes: list[Any] = []
        groups: list[list[torch.Tensor]] = []
        for param in params:
            if param.grad is None:
                continue
            mesh = _mesh_of(param.grad)
            index = next((i for i, seen in enumerate(meshes) if seen == mesh), -1)
            if index < 0:
                meshes.append(mesh)
                groups.append([])
            groups[index].append(param)
        if not groups:
            return torch.tensor(0.0)
        parts: list[torch.Tensor] = []
        with _quiet_redistribute():
            for members in groups:
                grads = [p.grad for p in members if p.grad is not None]
                part = nn.utils.get_total_norm(grads, norm_type, False, options["foreach"])
                full_tensor = getattr(part, "full_tensor", None)
                parts.append(full_tensor() if callable(full_tensor) else part)
        device = parts[0].device
        total: torch.Tensor = torch.linalg.vector_norm(
            torch.stack([part.to(device) for part in parts]), norm_type
        )
        if options["error_if_nonfinite"] and not torch.isfinite(total).all():
            return total  # the caller raises before anything is scaled
        for members in groups:
            nn.utils.clip_grads_with_norm_(
                members, float(options["max_norm"]), total, options["foreach"]
            )
        return total

    def _gather_to_rank0(self) -> dict[str, torch.Tensor] | None:
        return None  # torch's full state dict gathers over every mesh dimension


def is_dtensor_model(model: nn.Module) -> bool:
    """Whether ``model`` needs `DTensorBackend`: DTensor parameters on a mesh of more than
    one dimension, or on more than one mesh, or DTensors without FSDP2 (tensor parallel
    alone)."""
    meshes = dtensor_meshes(model)
    if not meshes:
        return False
    if len(meshes) > 1 or any(mesh.ndim > 1 for mesh in meshes):
        return True
    fsdp2 = _fsdp2_module_type()
    return not (fsdp2 is not None and any(isinstance(m, fsdp2) for m in model.modules()))
