"""The documentation site builds with warnings as errors, the README stays a front page,
and user pages carry no issue numbers or "was/before" history.

The build needs the ``docs`` extra (``pip install -e ".[docs]"``: Sphinx, myst-parser,
furo); without it that one test is skipped, saying so. It is offline: intersphinx is on only
with ``NUMCOLL_DOCS_INTERSPHINX=1`` (see docs/conf.py).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def user_pages() -> list[pathlib.Path]:
    return [ROOT / "README.md",
            *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]


@pytest.mark.timeout(300)
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    missing = [m for m in ("sphinx", "myst_parser", "furo") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the docs extra is not installed (no {', '.join(missing)}): "
                    'pip install -e ".[docs]"')
    env = {k: v for k, v in os.environ.items() if k != "NUMCOLL_DOCS_INTERSPHINX"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                          "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
                         capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0, out.stderr[-6000:]
    for page in ("index", "getting-started", "guide/faults", "coming-from-mpi4py",
                 "api/collectives", "changelog", "performance/measured"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page
    api = (tmp_path / "html" / "api" / "collectives.html").read_text()
    assert 'id="numcoll.all_reduce"' in api and 'id="numcoll.bfloat16"' in api


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    # the two commands of its first block stay true (the demo, the tests)
    assert "pip install -e . && python -m numcoll.demo" in text
    assert "python -m pytest" in text
    for page in ("docs/getting-started.md", "docs/guide/index.md", "docs/api/index.md",
                 "docs/performance/index.md", "docs/coming-from-mpi4py.md"):
        assert f"]({page})" in text, page


#: Internal history has no place in user pages: issue numbers anywhere (the changelog
#: included: it names releases and sections), "was ..." comparisons outside the changelog.
ISSUE = re.compile(r"\b[Ii]ssues? #?\d|\bround \d")
HISTORY = re.compile(r"\(was \d|\bwas \d[\d.]* ?(?:s|ms|us)\b|\bbefore issue\b|\bno longer\b")


def test_no_issue_numbers_and_no_history_in_user_pages():
    issues, history = [], []
    for page in user_pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            where = f"{page.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
            if ISSUE.search(line):
                issues.append(where)
            if page.name != "changelog.md" and HISTORY.search(line):
                history.append(where)
    assert not issues, "issue numbers in user pages:\n" + "\n".join(issues)
    assert not history, "history outside docs/changelog.md:\n" + "\n".join(history)


def test_the_measured_page_is_what_the_saved_runs_give():
    out = subprocess.run([sys.executable, str(DOCS / "tools" / "perf_tables.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
