"""DeepSpeed's checkpoint folders read offline and safely: full fp32 weights and optimizer state.

Reads what ``engine.save_checkpoint`` writes under ``save_dir/tag`` (ZeRO 0, 1, 2, 3; fp32 or
bf16) and DeepSpeed's universal layout (``tag/zero/<name>/fp32.pt``...), in one process,
with ``torch.load(weights_only=True)`` and DeepSpeed's few record classes allowed: no
process group, no full unpickling. The layouts, as DeepSpeed 0.19 writes them:

- ZeRO 1/2: ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank R
  holds, per parameter group, R's piece of the flat fp32 masters
  (``single_partition_of_fp32_groups``), the base optimizer's state over the same piece
  (``base_optimizer_state``) and where each parameter's fragment lies in the piece
  (``param_slice_mappings``); the pieces of the ranks, in rank order, tile the parameters.
- ZeRO 3: the same files hold ``fp32_flat_groups`` per sub-group; each parameter takes
  ``ceil(numel / world)`` elements of every rank's flat group (the last rank padded);
  ``zero_pp_rank_R_mp_rank_00_model_states.pt`` holds ``param_shapes`` and the buffers.
- ZeRO 0: ``mp_rank_00_model_states.pt`` holds the whole module and the optimizer's own
  state dict (bf16: its fp32 masters as ``fp32_groups``).

The optimizer state comes out in the form of torch's
``get_optimizer_state_dict(..., full_state_dict=True)``: keyed by parameter names.
"""

from __future__ import annotations

from pathlib import Path

from ._deepspeed_records import UNIVERSAL_FOLDER, UNIVERSAL_OPTIM_FILE, DeepSpeedState, load_file
from ._deepspeed_universal import UNIVERSAL_LATEST, _read_universal, universal_files
from ._deepspeed_zero import _rank_files, _read_zero0, _read_zero3, _read_zero12, _stage_of
from ._errors import CheckpointError

__all__ = ["UNIVERSAL_LATEST", "DeepSpeedState", "read_folder", "universal_files"]


def read_folder(
    tag_dir: Path, *, optimizer: bool = True, allow_unsafe_pickle: bool = False
) -> DeepSpeedState:
    """Read a DeepSpeed tag folder (``save_dir/tag``) into full states, offline.

    Args:
        tag_dir: The folder that holds ``*model_states.pt`` (and the optimizer files).
        optimizer: Also rebuild the full optimizer state (else ``optim`` is None).
        allow_unsafe_pickle: Fall back to full unpickling for files that hold objects
            beyond DeepSpeed's plain records (only files you trust).

    Raises:
        CheckpointError: A missing, truncated or foreign file, or a layout that does not
            add up (the message names the file and what was expected).
    """
    unsafe = allow_unsafe_pickle
    if (tag_dir / UNIVERSAL_FOLDER / UNIVERSAL_OPTIM_FILE).is_file():  # the universal layout
        return _read_universal(tag_dir, optimizer, unsafe)
    _refuse_model_parallel(tag_dir)
    optim_files = _rank_files(tag_dir, "optim_states.pt")
    if not optim_files:
        return _read_zero0(tag_dir, optimizer, unsafe)
    first = load_file(optim_files[0], allow_unsafe_pickle=unsafe)
    stage = _stage_of(first, optim_files[0])
    if stage == 3:
        return _read_zero3(tag_dir, optim_files, first, optimizer, unsafe)
    return _read_zero12(tag_dir, optim_files, first, optimizer, unsafe)


def _refuse_model_parallel(tag_dir: Path) -> None:
    """Tensor-, pipeline- or expert-parallel saves split the parameters further: refused
    by name rather than read half."""
    others = sorted(
        p.name
        for pattern in ("*mp_rank_0[1-9]*", "*mp_rank_[1-9]*", "layer_*", "*expert_*")
        for p in tag_dir.glob(pattern)
    )
    if others:
        message = (
            f"{tag_dir} holds the files of a tensor-, pipeline- or expert-parallel save "
            f"({', '.join(others[:4])}...): this reader takes data-parallel ZeRO checkpoints "
            "only; convert it with DeepSpeed's ds_to_universal.py first (comm reads the "
            "universal folder it writes)"
        )
        raise CheckpointError(message)
