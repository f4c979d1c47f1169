"""comm-strategies: Single / DDP / FSDP / DeepSpeed strategies for any training loop."""

from .__about__ import __version__

__all__ = ["__version__"]
