"""Fail when a package's public names (its __all__) change, or the API reference disagrees.

Two checks, one per package:

- snapshot: ``__all__`` against docs/api/<package>.txt. Run with --update to rewrite the
  snapshots after an intended change.
- reference: the docs site's objects inventory (what mkdocstrings rendered, page by page)
  against ``__all__``. A package's page must render each of its names, and nothing outside
  them: no module, no internal helper. A name it re-exports from a package below (the whole
  comm_core API in comm_collectives) is rendered on that package's page, which it links to.
  The site is built into a temporary folder; --site DIR reads DIR/objects.inv instead.

A module whose optional dependency is missing (comm_wrappers.deepspeed without DeepSpeed)
is read without importing it: its ``__all__`` must then be a literal list.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Page:
    """The reference page of one public module."""

    path: str  # under docs/
    reexports: str | None = None  # the package below whose names it re-exports and links to


PAGES = {
    "comm_core": Page("reference/comm_core.md"),
    "comm_core.testing": Page("reference/testing.md"),
    "comm_collectives": Page("reference/comm_collectives.md", reexports="comm_core"),
    "comm_wrappers": Page("reference/comm_wrappers.md"),
    "comm_wrappers.deepspeed": Page("reference/comm_wrappers_deepspeed.md"),
    "comm_wrappers.backends": Page("reference/comm_wrappers_backends.md"),
    "comm_strategies": Page("reference/comm_strategies.md"),
    "comm_strategies.checkpoint": Page("reference/comm_strategies_checkpoint.md"),
}


def public_names(module: str) -> list[str]:
    """Return the module's ``__all__``, read from its source when it cannot be imported."""
    try:
        return sorted(importlib.import_module(module).__all__)
    except ImportError:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return sorted(ast.literal_eval(node.value))
    message = f"{module}: cannot be imported here and has no literal __all__ to read."
    raise RuntimeError(message)


def check_snapshots(update: bool) -> list[str]:
    """Compare every module's ``__all__`` with its snapshot (or rewrite the snapshots)."""
    errors = []
    for module in PAGES:
        names = public_names(module)
        snapshot = ROOT / "docs" / "api" / f"{module}.txt"
        if update:
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            snapshot.write_text("\n".join(names) + "\n")
            continue
        known = snapshot.read_text().split() if snapshot.exists() else []
        added, removed = sorted(set(names) - set(known)), sorted(set(known) - set(names))
        if added or removed:
            errors.append(
                f"{module}: public API changed; added {added}, removed {removed}. "
                "If intended, run: hatch run full:api --update"
            )
    return errors


def read_inventory(site: Path) -> dict[str, str]:
    """Map each object mkdocstrings rendered to its page (``reference/comm_core.md``)."""
    lines = (site / "objects.inv").read_bytes().split(b"\n", 4)
    rendered = {}
    for line in zlib.decompress(lines[4]).decode().splitlines():
        name, _role, priority, uri, _display = line.split(" ", 4)
        if priority == "1":  # 2: a secondary name (an alias) of an object rendered elsewhere
            rendered[name] = uri.split("#")[0].rstrip("/") + ".md"
    return rendered


def _reexported(module: str, below: str) -> set[str]:
    """The names of ``module`` that are the same objects as in the package ``below``."""
    names = set(public_names(module)) & set(public_names(below))
    upper, lower = importlib.import_module(module), importlib.import_module(below)
    return {n for n in names if n != "__version__" and getattr(upper, n) is getattr(lower, n)}


def check_reference(rendered: dict[str, str]) -> list[str]:
    """Compare what each reference page rendered with its module's ``__all__``."""
    errors = []
    page_of = {page.path: module for module, page in PAGES.items()}
    known_pages = {f"reference/{p.name}" for p in (ROOT / "docs" / "reference").glob("*.md")}
    for path in sorted(known_pages - set(page_of)):
        errors.append(f"docs/{path}: a reference page of no public module (add it to PAGES).")
    for name, path in sorted(rendered.items()):
        module = page_of.get(path)
        if module is None:
            errors.append(f"docs/{path} renders {name}, outside the API reference pages.")
        elif name != module and not name.startswith(module + "."):
            errors.append(f"docs/{path} renders {name}, which is not part of {module}.")
    for module, page in PAGES.items():
        names = set(public_names(module))
        elsewhere = _reexported(module, page.reexports) if page.reexports else set()
        on_page = {n for n, p in rendered.items() if p == page.path}
        shown = {n[len(module) + 1 :].split(".")[0] for n in on_page if n.startswith(module + ".")}
        for name in sorted(shown - names):
            errors.append(f"docs/{page.path} renders {module}.{name}, which is not in __all__.")
        for name in sorted(shown & elsewhere):
            errors.append(
                f"docs/{page.path} renders {module}.{name}, which {module} re-exports from "
                f"{page.reexports}: it belongs on that package's page."
            )
        for name in sorted(names - shown - elsewhere):
            errors.append(f"docs/{page.path} does not render {module}.{name} (in __all__).")
        if page.reexports:  # its own page renders them (checked there); this one links to it
            below = PAGES[page.reexports]
            link = f"({Path(below.path).name})"
            if link not in (ROOT / "docs" / page.path).read_text():
                errors.append(f"docs/{page.path} does not link to {below.path}.")
    return errors


def build_site(folder: Path) -> None:
    """Build the docs (strict) into ``folder``."""
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
    if subprocess.run([*command, "--site-dir", str(folder)], cwd=ROOT).returncode != 0:
        message = "the docs build failed (its errors are above); nothing to compare"
        raise SystemExit(f"public API: {message}")


def main() -> int:
    args = sys.argv[1:]
    update = "--update" in args
    errors = check_snapshots(update)
    if update:
        print("public API: snapshots rewritten")
        return 0
    if "--site" in args:
        rendered = read_inventory(Path(args[args.index("--site") + 1]))
    else:
        with tempfile.TemporaryDirectory(prefix="comm-api-site-") as folder:
            build_site(Path(folder))
            rendered = read_inventory(Path(folder))
    errors += check_reference(rendered)
    for error in errors:
        print(error, file=sys.stderr)
    if not errors:
        names = sum(len(public_names(m)) for m in PAGES)
        print(f"public API: unchanged; the reference renders exactly __all__ ({names} names)")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
