"""Examples that cannot rot: every ```python block of README.md and docs/**/*.md runs.

Each block runs in a fresh interpreter (this checkout first on the path, the current
directory a temporary one, ``NUMBA_ENABLE_CUDASIM=1`` so that device examples run without
a GPU) with a time limit, and passes when it exits with status 0. Two markers, each on the
line right above a block:

- ``<!-- not-runnable: <reason> -->``: the block is not run. The reason is required (it
  needs several hosts, a launcher's environment, a GPU...): an empty one fails here.
- ``<!-- continues -->``: the block is the next part of the example above it. It runs
  joined to the blocks before it (from the last block without the marker), once, as one
  program; those blocks are not run on their own.

Keep examples small (thread ranks, a few KiB): the whole file should take well under a
minute or two.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOT_RUNNABLE = re.compile(r"^<!--\s*not-runnable:(.*?)-->\s*$")
CONTINUES = re.compile(r"^<!--\s*continues\s*-->\s*$")
#: Each example's own limit; the slowest start process ranks and compile kernels.
EXAMPLE_TIMEOUT_S = 90


@dataclasses.dataclass
class Block:
    path: pathlib.Path
    line: int            # 1-based line of the opening fence
    code: str
    marker: str | None   # the line right above the fence, when it is a marker

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[pathlib.Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", *docs]


def python_blocks(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of one Markdown file (fences of three or more backticks)."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(`{3,})\s*python\s*$", lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(1), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        above = lines[start - 1].strip() if start > 0 else ""
        marker = above if (NOT_RUNNABLE.match(above) or CONTINUES.match(above)) else None
        blocks.append(Block(path, start + 1, "\n".join(lines[start + 1:j]) + "\n", marker))
        i = j + 1
    return blocks


def examples(paths: list[pathlib.Path] | None = None
             ) -> tuple[list[tuple[str, str]], list[Block]]:
    """(where, program) for each example to run, and the blocks marked not runnable."""
    runs, skipped = [], []
    for path in pages() if paths is None else paths:
        pending: list[Block] = []
        for block in python_blocks(path):
            if block.marker and NOT_RUNNABLE.match(block.marker):
                skipped.append(block)
                continue
            if block.marker and CONTINUES.match(block.marker):
                assert pending, f"{block.where}: <!-- continues --> with no example above it"
                pending.append(block)
            else:
                if pending:
                    runs.append((pending[0].where, "".join(b.code for b in pending)))
                pending = [block]
        if pending:
            runs.append((pending[0].where, "".join(b.code for b in pending)))
    return runs, skipped


RUNS, SKIPPED = examples()


def test_every_not_runnable_marker_gives_a_reason():
    bare = [b.where for b in SKIPPED if not NOT_RUNNABLE.match(b.marker).group(1).strip()]
    assert not bare, f"<!-- not-runnable: --> without a reason at {bare}"


def test_the_pages_have_examples_to_run():
    assert len(RUNS) >= 10, RUNS
    assert any(where.startswith("README.md") for where, _ in RUNS)


def test_a_marker_that_is_not_right_above_a_block_is_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- not-runnable: needs a GPU -->\n```python\nx = 1\n```\n\n"
                    "<!-- not-runnable:  -->\n```python\ny = 2\n```\n")
    blocks = python_blocks(page)
    assert [b.marker is not None for b in blocks] == [True, True]
    assert not NOT_RUNNABLE.match(blocks[1].marker).group(1).strip()


def test_continued_blocks_run_as_one_program(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("```python\na = 1\n```\ntext\n<!-- continues -->\n```python\nb = a + 1\n```\n"
                    "<!-- not-runnable: needs two hosts -->\n```python\nc = 3\n```\n"
                    "```python\nd = 4\n```\n")
    runs, skipped = examples([page])
    assert runs == [("page.md:1", "a = 1\nb = a + 1\n"), ("page.md:13", "d = 4\n")]
    assert [b.line for b in skipped] == [10]


#: Packages an example may need that numcoll does not install: such an example is
#: skipped, saying so, where the package is missing (CI's newest lane has them).
OPTIONAL = {"torch": 'pip install "numcoll[torch]"', "mpi4py": "pip install mpi4py"}


@pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 30)
@pytest.mark.parametrize("where,program", RUNS, ids=[w for w, _ in RUNS])
def test_example_runs(where, program, tmp_path):
    for extra, install in OPTIONAL.items():
        if re.search(rf"^\s*(import|from)\s+{extra}\b", program, re.M) and \
                importlib.util.find_spec(extra) is None:
            pytest.skip(f"{where}: the example needs {extra} ({install}), not installed here")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    env.setdefault("NUMCOLL_CUDA_THREADS", "4")
    env.setdefault("NUMCOLL_CUDA_BLOCKS", "2")
    env.setdefault("OMP_NUM_THREADS", "1")
    script = tmp_path / "example.py"
    script.write_text(program)
    try:
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{where}: the example ran past {EXAMPLE_TIMEOUT_S} s\n{exc.stdout}\n"
                    f"{exc.stderr}")
    assert out.returncode == 0, (f"{where}: the example failed (exit {out.returncode})\n"
                                 f"--- program\n{program}--- stdout\n{out.stdout}"
                                 f"--- stderr\n{out.stderr}")
