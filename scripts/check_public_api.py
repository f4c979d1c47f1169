"""Fail when a package's public names (its __all__) change without the snapshot changing.

Run with --update to rewrite the snapshots in docs/api/ after an intended change.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["comm_core", "comm_core.testing", "comm_collectives", "comm_wrappers"]


def main() -> int:
    update = "--update" in sys.argv
    failed = False
    for name in PACKAGES:
        names = sorted(importlib.import_module(name).__all__)
        snapshot = ROOT / "docs" / "api" / f"{name}.txt"
        text = "\n".join(names) + "\n"
        if update:
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            snapshot.write_text(text)
            continue
        known = snapshot.read_text().split() if snapshot.exists() else []
        added, removed = sorted(set(names) - set(known)), sorted(set(known) - set(names))
        if added or removed:
            failed = True
            print(f"{name}: public API changed; added {added}, removed {removed}.", file=sys.stderr)
            print("  If intended, run: hatch run full:api --update", file=sys.stderr)
    if not failed and not update:
        print("public API: unchanged")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
