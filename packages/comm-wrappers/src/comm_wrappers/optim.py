"""Optimizer wrappers: MMEngine's step protocol, right under every backend.

`OptimWrapper` runs backward, gradient accumulation (skipping the gradient sync on the
micro-steps), clipping and the optimizer step. `AmpOptimWrapper` adds autocast (bf16 on CPU
too) and a gradient scaler for float16. `OptimWrapperDict` holds several of them. What
depends on the model's backend (how to skip the sync, the whole model's norm, which scaler,
where autocast runs) is asked of the model's adapter (`comm_wrappers.backends`), decided
once per model; no wrapper names a backend.
"""

from ._amp import AmpOptimWrapper
from ._optim_dict import OptimWrapperDict
from ._optim_wrapper import OptimWrapper

__all__ = ["AmpOptimWrapper", "OptimWrapper", "OptimWrapperDict"]
