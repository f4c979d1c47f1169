"""Transitional: the names tests/strategies/ckpt_cases.py and ckpt_train.py still import here.

The test net lives in ``tests.wrappers.net``, ``full_params`` and ``max_diff`` in
``tests.helpers``; the rank bodies moved next to their assertions (test_api.py,
test_equivalence.py). Delete this module once those two files import from there.
"""

from tests.helpers import full_params as params_of
from tests.helpers import max_diff
from tests.wrappers.net import BATCH, Net, batch

__all__ = ["BATCH", "Net", "batch", "max_diff", "params_of"]
