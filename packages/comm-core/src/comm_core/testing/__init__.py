"""Test kit: run functions on N real local gloo ranks, from pytest or from a notebook.

The pytest fixtures (``comm_run_distributed``, ``comm_pools``) live in
``comm_core.testing.plugin``, which pytest loads by itself once comm-core is installed.
"""

from .pool import PoolCache, RankReport, RanksFailedError, WorldPool, launch

__all__ = ["PoolCache", "RankReport", "RanksFailedError", "WorldPool", "launch"]
