"""The comm-strategies distribution as installed."""

import re
from importlib.metadata import requires, version

import comm_strategies


def test_version_matches_the_installed_distribution() -> None:
    assert comm_strategies.__version__ == version("comm-strategies")


def test_depends_on_comm_wrappers_only_of_the_comm_packages() -> None:
    names = [re.split(r"[<>=\[; ]", r, maxsplit=1)[0] for r in requires("comm-strategies") or []]
    # The plain requirement and the [deepspeed] extra's.
    assert sorted(n for n in names if n.startswith("comm-")) == ["comm-wrappers", "comm-wrappers"]
