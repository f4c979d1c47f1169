"""mkdocs hook: the home page's package versions come from each package's ``__about__.py``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = "<!-- package-versions -->"
LAYERS = ["comm-core", "comm-collectives", "comm-wrappers", "comm-strategies"]


def _versions() -> str:
    rows = ["| package | version | changes |", "|---|---|---|"]
    abouts = {a.parents[2].name: a for a in ROOT.glob("packages/*/src/*/__about__.py")}
    for package in sorted(abouts, key=lambda p: LAYERS.index(p) if p in LAYERS else 99):
        about = abouts[package]
        match = re.search(r'__version__\s*=\s*"([^"]+)"', about.read_text())
        version = match.group(1) if match else "?"
        rows.append(f"| `{package}` | {version} | [changelog](changelog/{package}.md) |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the placeholder with a table of the packages' versions."""
    if PLACEHOLDER in markdown:
        return markdown.replace(PLACEHOLDER, _versions())
    return markdown
