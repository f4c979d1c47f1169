"""A third-party strategy registered through a real installed entry point, loaded lazily."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PROBE = textwrap.dedent(
    """
    import json, sys
    from comm_strategies import available_strategies, build_strategy
    listed = "third" in available_strategies()
    imported_before = "third_party_strategies" in sys.modules
    strategy = build_strategy("third", deterministic=True)
    try:
        build_strategy("broken")
    except ImportError as error:
        broken = str(error)
    print(json.dumps({
        "listed": listed,
        "imported_before": imported_before,
        "type": type(strategy).__name__,
        "module": type(strategy).__module__,
        "deterministic": strategy.deterministic,
        "broken": broken,
    }))
    """
)


def _install_fake_distribution(site: Path) -> None:
    """A package and its dist-info, as pip would leave them in site-packages."""
    package = site / "third_party_strategies"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from comm_strategies import SingleDeviceStrategy\n\n\n"
        "class ThirdPartyStrategy(SingleDeviceStrategy):\n"
        "    name = 'third'\n"
    )
    info = site / "third_party_strategies-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: third-party-strategies\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[comm.strategies]\n"
        "third = third_party_strategies:ThirdPartyStrategy\n"
        "broken = third_party_strategies:NoSuchStrategy\n"
    )


def test_an_entry_point_strategy_is_listed_without_import_and_built_by_name(
    tmp_path: Path,
) -> None:
    _install_fake_distribution(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["listed"] is True
    assert result["imported_before"] is False  # listed by name, imported only when built
    assert result["type"] == "ThirdPartyStrategy"
    assert result["module"] == "third_party_strategies"
    assert result["deterministic"] is True
    assert "'broken' (third_party_strategies:NoSuchStrategy) failed to load" in result["broken"]
