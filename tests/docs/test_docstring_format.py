"""The packages' docstrings render on the docs site: Markdown for mkdocstrings, Google style.

Sphinx roles (``:class:`X```) show raw there; cross-references use mkdocstrings' syntax,
``[`X`][comm_core.X]``, which the strict docs build checks. Examples render as code only
in an ``Examples:`` section (an ``Example:`` section is an admonition: one run-on line).
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "packages").glob("*/src/**/*.py"))
# Any role, with or without a domain: :func:`x`, :py:class:`x`, :any:`x`, :math:`x`...
SPHINX_ROLE = re.compile(r":(?:[\w-]+:)?[\w-]+:`")
# Google style renders an "Example:" section as an admonition: its code, one run-on line.
EXAMPLE_HEADER = re.compile(r"^\s*Example:\s*$", re.MULTILINE)
EXAMPLES = re.compile(r"^\s*Examples:\s*$", re.MULTILINE)


def _docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                found.append((getattr(node, "lineno", 1), docstring))
    # Attribute docstrings: a string statement right after an assignment.
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for before, after in itertools.pairwise(body):
            value = after.value if isinstance(after, ast.Expr) else None
            text = value.value if isinstance(value, ast.Constant) else None
            if isinstance(before, ast.Assign | ast.AnnAssign) and isinstance(text, str):
                found.append((after.lineno, text))
    return found


def test_the_checks_catch_what_they_are_for() -> None:
    assert SPHINX_ROLE.search("see :func:`f` and")
    assert SPHINX_ROLE.search(":py:class:`X`")
    assert SPHINX_ROLE.search(":any:`X`")
    assert not SPHINX_ROLE.search("a dict: {'a': 1} and `code`")
    assert EXAMPLE_HEADER.search("Summary.\n\n    Example:\n        x = 1\n")
    assert not EXAMPLE_HEADER.search("Summary.\n\n    Examples:\n        >>> x = 1\n")


def test_docstrings_have_no_sphinx_roles_and_examples_in_examples_sections() -> None:
    assert SOURCES, "no package sources found"
    problems = []
    for path in SOURCES:
        where = path.relative_to(ROOT).as_posix()
        for line, docstring in _docstrings(path):
            role = SPHINX_ROLE.search(docstring)
            if role:
                problems.append(f"{where}:{line}: a Sphinx role ({role[0]}...)")
            if EXAMPLE_HEADER.search(docstring):
                problems.append(f"{where}:{line}: an 'Example:' section (use 'Examples:' with >>>)")
            first_prompt = docstring.find(">>>")
            examples = EXAMPLES.search(docstring)
            if first_prompt != -1 and (examples is None or examples.start() > first_prompt):
                problems.append(f"{where}:{line}: a '>>>' example outside an 'Examples:' section")
    assert not problems, "\n".join(problems)
