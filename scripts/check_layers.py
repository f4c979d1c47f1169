"""The layer contract, checked over every package's src/ and pyproject.toml.

1. No module imports a comm package above its own layer.
2. A package declares, of the comm packages, only the one directly beneath it, with a
   bounded range (">=X,<Y").
3. Every third-party module a package imports is declared in its dependencies.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["comm-core", "comm-collectives", "comm-wrappers", "comm-strategies"]
# Imports that may be missing from the dependencies: loaded only by the tool they plug into.
OPTIONAL = {
    ("comm_core", "comm_core/testing/plugin.py", "pytest"),
    # NumPy's generator state is saved in checkpoints when NumPy is installed.
    ("comm_strategies", "comm_strategies/checkpoint/_files.py", "numpy"),
    ("comm_strategies", "comm_strategies/checkpoint/_reading.py", "numpy"),
    ("comm_strategies", "comm_strategies/integrations/mmengine.py", "mmengine"),
    ("comm_strategies", "comm_strategies/integrations/_mmengine_runner.py", "mmengine"),
    ("comm_strategies", "comm_strategies/integrations/_mmengine_hook.py", "mmengine"),
    ("comm_strategies", "comm_strategies/integrations/_mmengine_state.py", "mmengine"),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def main() -> int:
    problems: list[str] = []
    stdlib = set(sys.stdlib_module_names)
    for index, dist in enumerate(LAYERS):
        folder = ROOT / "packages" / dist
        if not (folder / "pyproject.toml").exists():
            continue
        module = dist.replace("-", "_")
        meta = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        declared = {
            re.split(r"[<>=!~ \[;]", dep, maxsplit=1)[0].strip().lower(): dep
            for dep in meta.get("dependencies", [])
        }
        below = LAYERS[index - 1] if index else None
        for name, spec in declared.items():
            if name in LAYERS and name != below:
                problems.append(
                    f"{dist} declares {name}; only {below or 'no comm package'} is allowed"
                )
            if name == below and not re.search(r">=\s*[\d.]+\s*,\s*<\s*[\d.]+", spec):
                problems.append(f"{dist} declares {spec!r}; use a bounded range such as >=0.1,<0.2")
        if below and below not in declared:
            problems.append(f"{dist} does not declare {below}, the layer beneath it")
        # An extra's packages may be imported too (by the modules that need the extra).
        extras = {
            re.split(r"[<>=!~ \[;]", dep, maxsplit=1)[0].strip().lower()
            for deps in meta.get("optional-dependencies", {}).values()
            for dep in deps
        }
        allowed = {n.replace("-", "_") for n in set(declared) | extras} | {module}
        # The layers further down come with the one beneath (each pins the next), so an
        # upper layer may import them too: comm_strategies reaches comm_core's functions
        # through comm_collectives, as comm_wrappers does.
        allowed |= {layer.replace("-", "_") for layer in LAYERS[: max(index - 1, 0)]} - {
            "comm_core"
        }
        upper = {layer.replace("-", "_") for layer in LAYERS[index + 1 :]}
        for path in sorted((folder / "src").rglob("*.py")):
            relative = path.relative_to(folder / "src").as_posix()
            for imported in _imports(path):
                if imported in upper:
                    problems.append(f"{relative}: imports {imported}, a layer above {dist}")
                elif (
                    imported not in stdlib
                    and imported not in allowed
                    and (module, relative, imported) not in OPTIONAL
                ):
                    problems.append(f"{relative}: imports {imported}, not declared by {dist}")
    for problem in problems:
        print(f"layer contract: {problem}", file=sys.stderr)
    if not problems:
        print("layer contract: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
