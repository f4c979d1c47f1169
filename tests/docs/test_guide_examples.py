"""Run the docs' code blocks marked runnable, so that an example that stops working fails CI.

A block is marked by an HTML comment (invisible on the site) on the line right before its
opening fence, which must be a ```` ```python ```` fence:

- ``<!-- runnable -->``: the block is a program; run it with ``python``;
- ``<!-- runnable: torchrun -->``: run it under torchrun on 2 local ranks;
- ``<!-- runnable: pytest -->``: it is a test file; run pytest on it;
- ``<!-- runnable: python torchrun -->``: modes combine, one run each;
- ``<!-- runnable: continue -->``: it continues the page's previous runnable block; the
  blocks run as one program, in the modes of the first.

Programs run in a fresh folder, on the CPU (``CUDA_VISIBLE_DEVICES`` empty), without the
launcher variables of the environment that runs the tests, each bounded by a timeout after
which its whole process group (torchrun and its ranks) is killed. The program's line
numbers are the page's: a traceback points into the Markdown file. A block that imports an
optional dependency (MMEngine, DeepSpeed) is skipped, with the reason, where it is missing.

A program runs exactly as the page shows it and ends as an ordinary program does: comm's
exit teardown (registered when comm_core is imported) destroys the process group before
the interpreter's own teardown, so nothing is appended.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import free_port

DOCS = Path(__file__).resolve().parents[2] / "docs"
MARKER = re.compile(r"^<!--\s*runnable(?::(?P<modes>[^>]*))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)\s*$")
MODES = ("python", "torchrun", "pytest")
TIMEOUT_S = {"python": 120, "torchrun": 240, "pytest": 180}
# Optional dependencies: a block importing one of these modules needs that distribution.
OPTIONAL = {
    "mmengine": "mmengine",
    "deepspeed": "deepspeed",
    "comm_wrappers.deepspeed": "deepspeed",
}
# Variables that would make a program think a launcher started it.
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "TORCHELASTIC_")
LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
LAUNCHER_VARIABLES |= {"MASTER_ADDR", "MASTER_PORT", "MPI_LOCALRANKID"}


@dataclass
class Program:
    """One or more marked blocks of a page that run together."""

    page: str
    line: int  # of the first block's fence
    modes: tuple[str, ...]
    lines: dict[int, str] = field(default_factory=dict)  # page line number -> code
    blocks: int = 0

    def source(self) -> str:
        """The code, each line at its line number in the page (the others blank)."""
        last = max(self.lines, default=0)
        return "\n".join(self.lines.get(n, "") for n in range(1, last + 1)) + "\n"


def collect(pages: list[Path]) -> tuple[list[Program], list[str]]:
    """Return the programs of the pages' runnable blocks, and the markers that are wrong."""
    programs: list[Program] = []
    errors: list[str] = []
    for path in pages:
        page = path.relative_to(DOCS).as_posix()
        lines = path.read_text().splitlines()
        current: Program | None = None
        for index, text in enumerate(lines):
            marker = MARKER.match(text)
            if not marker:
                continue
            where = f"docs/{page}:{index + 1}"
            opening = FENCE.match(lines[index + 1]) if index + 1 < len(lines) else None
            if opening is None or opening["lang"] != "python":
                errors.append(f"{where}: the line after the marker is not a ```python fence")
                continue
            modes = tuple((marker["modes"] or "python").split())
            if modes == ("continue",):
                if current is None:
                    errors.append(f"{where}: 'continue' without a runnable block before it")
                    continue
                program = current
            elif not modes or any(m not in MODES for m in modes):
                errors.append(f"{where}: unknown mode in {modes}; expected {MODES} or continue")
                continue
            else:
                program = current = Program(page, index + 2, modes)
                programs.append(program)
            program.blocks += 1
            fence = opening["fence"]
            for number in range(index + 3, len(lines) + 1):
                code = lines[number - 1]
                if code.startswith(fence[0] * len(fence)) and not code.strip(fence[0]).strip():
                    break
                program.lines[number] = code
            else:
                errors.append(f"{where}: the block is not closed")
    return programs, errors


PAGES = sorted(DOCS.rglob("*.md"))
PROGRAMS, MARKER_ERRORS = collect(PAGES)
RUNS = [(program, mode) for program in PROGRAMS for mode in program.modes]


def test_markers_are_well_formed() -> None:
    assert not MARKER_ERRORS, "\n".join(MARKER_ERRORS)
    assert PROGRAMS, "no runnable block found in docs/"


def _missing_dependency(source: str) -> str | None:
    """The optional distribution the program imports and this environment lacks, if any."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = [node.module]
        else:
            continue
        for module in modules:
            for prefix, distribution in OPTIONAL.items():
                wanted = module == prefix or module.startswith(prefix + ".")
                if wanted and importlib.util.find_spec(distribution) is None:
                    return distribution
    return None


def _environment() -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in LAUNCHER_VARIABLES and not name.startswith(LAUNCHER_PREFIXES)
    }
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def _command(mode: str, script: str) -> list[str]:
    if mode == "python":
        return [sys.executable, script]
    if mode == "pytest":
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", script]
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("--master-addr", "127.0.0.1", "--master-port", str(free_port()), script),
    ]


@pytest.mark.parametrize(
    ("program", "mode"), RUNS, ids=[f"{p.page}:{p.line}-{mode}" for p, mode in RUNS]
)
def test_runnable_block_runs_without_error(program: Program, mode: str, tmp_path: Path) -> None:
    source = program.source()
    missing = _missing_dependency(source)
    if missing is not None:
        pytest.skip(f"docs/{program.page}:{program.line} needs {missing}, not installed here")
    stem = re.sub(r"\W", "_", Path(program.page).stem)  # no module name a library may import
    script = f"test_{stem}_md.py" if mode == "pytest" else f"docs_{stem}_md.py"
    (tmp_path / script).write_text(source)
    process = subprocess.Popen(
        _command(mode, script),
        cwd=tmp_path,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills the ranks too
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S[mode])
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(
            f"docs/{program.page}:{program.line} ({mode}) did not finish in "
            f"{TIMEOUT_S[mode]} s; its output:\n{output[-6000:]}"
        )
    assert process.returncode == 0, (
        f"docs/{program.page}:{program.line} ({mode}) exited with {process.returncode} "
        f"(line numbers are the page's); its output:\n{output[-6000:]}"
    )
