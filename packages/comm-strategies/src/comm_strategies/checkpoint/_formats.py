"""How a checkpoint stores the model and optimizer: one writer/reader pair per format.

``full`` (``model.pt``/``optim.pt``, full tensors written by rank 0), ``dcp`` (every rank
writes its shards with torch distributed checkpoint) and ``deepspeed`` (DeepSpeed's own
files, and the full files beside them; the ``dcp`` pair is in ``_format_dcp``, what they
share in ``_format_common``). Writers and readers call the model's backend adapter
(``comm_wrappers.backends``) and never ask which backend it is: the adapter decides
(sharded state or full; its own files, ``backend.native_checkpoint()``, or none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import comm_collectives as dist
from comm_wrappers.backends import Backend, describe_params

from ._consensus import Attempts, where
from ._deepspeed_records import safe_load
from ._errors import CheckpointError
from ._files import save_tensor_file
from ._format_common import LoadRequest, Optimizers, check_portable, load_full
from ._format_dcp import DcpFormat
from ._layout import DS_FOLDER, DS_TAG, MODEL_FILE, OPTIM_FILE
from ._manifest import Manifest
from ._params import check_against
from ._reading import load_tensor_file


class FullFormat:
    """Full tensors gathered to rank 0 and written there as ``model.pt`` / ``optim.pt``."""

    name: ClassVar[str] = "full"

    def write(
        self, backend: Backend, optimizers: Optimizers, folder: Path, attempts: Attempts
    ) -> dict[str, list[Any]]:
        leader = dist.get_rank() == 0
        state = backend.model_state(full=True, rank0_only=True)
        # What rank 0 writes, described from the state it holds (asking the model for its
        # shapes would cost FSDP1 a sharded state dict: every unit unsharded once more).
        params = describe_params(state) if leader else {}
        if leader:
            with attempts.keep(MODEL_FILE):
                save_tensor_file(state, folder / MODEL_FILE)
        del state
        if optimizers:
            states = {
                key: backend.optim_state(optimizer, full=True, rank0_only=True)
                for key, optimizer in optimizers.items()
            }
            if leader:
                with attempts.keep(OPTIM_FILE):
                    save_tensor_file(states, folder / OPTIM_FILE)
        return params

    def read(
        self, source: Path, manifest: Manifest, backend: Backend, request: LoadRequest
    ) -> None:
        check_portable(manifest, source, backend, request)
        unsafe = request.allow_unsafe_pickle

        def optim_states() -> Any:  # read once the model is in (see _load_full)
            return load_tensor_file(
                source / OPTIM_FILE, allow_unsafe_pickle=unsafe, mmap=True, what="optimizer state"
            )

        load_full(
            backend,
            load_tensor_file(
                source / MODEL_FILE, allow_unsafe_pickle=unsafe, mmap=True, what="model state"
            ),
            optim_states,
            request,
            str(source),
        )


class DeepSpeedFormat:
    """DeepSpeed's own files under ``deepspeed/``, and beside them the portable full copy
    (``model.pt`` with the fp32 master weights, ``optim.pt`` keyed by parameter names).

    Written and read natively through the backend's ``native_checkpoint()``: the fast
    path into a DeepSpeed model of the same ZeRO stage, world size and precision (its
    ``fits``); every other model (another stage, another world size, DDP, FSDP, one
    process) reads the portable copy, optimizer state included. Checkpoints of format
    version 1 have no portable copy: their weights are consolidated from DeepSpeed's files.
    """

    name: ClassVar[str] = "deepspeed"

    def write(
        self, backend: Backend, optimizers: Optimizers, folder: Path, attempts: Attempts
    ) -> dict[str, list[Any]]:
        native = backend.native_checkpoint()
        if native is None:
            message = f"the deepspeed format needs a DeepSpeed model, got a {backend.kind} model"
            raise CheckpointError(message)
        # ZeRO-0 in fp16 has no portable optimizer state: its copy holds the weights only
        portable = optimizers if backend.optimizer_not_portable() is None else {}
        params = FullFormat().write(backend, portable, folder, attempts)
        # Last: DeepSpeed's save ends in a barrier of its own, which a rank that failed
        # inside it skips; nothing collective follows it before the commit.
        with attempts.keep("DeepSpeed's files"):
            native.save(folder / DS_FOLDER, DS_TAG)
        return params

    def read(
        self, source: Path, manifest: Manifest, backend: Backend, request: LoadRequest
    ) -> None:
        portable = (source / MODEL_FILE).is_file()
        if not portable:  # format version 1: DeepSpeed's files are the only copy
            self._native(source, manifest, backend, request)
            return
        # The native files only where the model matches them: names and shapes (a strict
        # load; a strict=False load that skips entries takes the portable copy), then what
        # the backend's fits() checks (DeepSpeed: stage, world size and precision).
        skipped = check_against(
            backend.param_shapes(), manifest.params, str(source), request.strict
        )
        native = backend.native_checkpoint()
        if (
            skipped
            or native is None
            or not native.fits(
                manifest.zero_stage, manifest.world_size, source / DS_FOLDER / DS_TAG
            )
        ):
            FullFormat().read(source, manifest, backend, request)
            return
        error: BaseException | None = None
        try:
            self._native(source, manifest, backend, request)
        except Exception as caught:  # e.g. other parameter groups: DeepSpeed's own error
            error = caught
        # every rank learns whether any rank's native load failed (the load's own call)
        if any(request.call.outcomes("native", error)):
            FullFormat().read(source, manifest, backend, request)  # overwrites it all

    def _native(
        self, source: Path, manifest: Manifest, backend: Backend, request: LoadRequest
    ) -> None:
        layout = (manifest.zero_stage, manifest.world_size)
        load_native_folder(source / DS_FOLDER, DS_TAG, layout, backend, request, checkpoint=source)


def load_native_folder(
    save_dir: Path,
    tag: str,
    layout: tuple[int | None, int | None],
    backend: Backend,
    request: LoadRequest,
    *,
    load_optimizer: bool | None = None,
    checkpoint: Path | None = None,
) -> None:
    """A DeepSpeed folder saved with ``layout`` = (ZeRO stage, world size): natively into a
    model whose ``backend.native_checkpoint()`` fits it, else read offline into full
    states (fp32 masters and the optimizer state keyed by names) and loaded as a full
    checkpoint.

    ``load_optimizer`` is what a native load loads (default: whether ``request`` has
    optimizers): DeepSpeed's model owns its optimizer, so a folder of DeepSpeed's own
    loads it even without an optimizer wrapper passed; the optimizers of ``request`` are
    those that must move (one: DeepSpeed has one). DeepSpeed reads its files with
    ``weights_only=True`` (`safe_load`) unless ``request.allow_unsafe_pickle``.
    ``checkpoint``: the comm checkpoint folder holding ``save_dir``, for messages.
    """
    stage, world = layout
    unsafe = request.allow_unsafe_pickle
    native = backend.native_checkpoint()
    if native is not None and native.fits(stage, world, save_dir / tag):
        loaded = native.load(
            save_dir,
            tag,
            strict=request.strict,
            load_optimizer=bool(request.optimizers) if load_optimizer is None else load_optimizer,
            torch_load=None if unsafe else safe_load,
        )
        if not loaded:
            message = f"DeepSpeed could not load {save_dir} (tag {tag!r}) on {where()}"
            raise CheckpointError(message)
        return
    why = backend.optimizer_not_portable() if request.optimizers else None
    if len(request.optimizers) > 1:
        why = f"DeepSpeed has one optimizer, the optim wrapper has {sorted(request.optimizers)}"
    if why is not None:
        rest = " (and schedulers, RNG, user state)" if checkpoint is not None else ""
        message = (
            f"{checkpoint or save_dir / tag} holds the optimizer state of DeepSpeed "
            f"ZeRO-{stage} on {world} rank(s), which cannot load into this {backend.kind} "
            f"model: {why}. Pass load_optimizer=False to load the weights{rest} only."
        )
        raise CheckpointError(message)
    from ._deepspeed_offline import read_folder

    state = read_folder(
        save_dir / tag, optimizer=bool(request.optimizers), allow_unsafe_pickle=unsafe
    )
    optim_states = {key: state.optim for key in request.optimizers if state.optim is not None}
    moved = LoadRequest(
        request.call,
        request.strict,
        {k: v for k, v in request.optimizers.items() if k in optim_states},
        unsafe,
    )
    load_full(backend, state.model, optim_states, moved, str(save_dir / tag))


FORMATS: dict[str, FullFormat | DcpFormat | DeepSpeedFormat] = {
    fmt.name: fmt for fmt in (FullFormat(), DcpFormat(), DeepSpeedFormat())
}
