"""Sphinx configuration of numcoll's documentation site.

Build it with ``python -m sphinx -W -b html docs docs/_build`` (``pip install -e ".[docs]"``).
Pages are MyST Markdown; the API reference is generated from the docstrings (autodoc +
napoleon, NumPy style).

intersphinx (links to the Python, NumPy and torch documentation) needs the network to fetch
each project's ``objects.inv``; it is enabled only when ``NUMCOLL_DOCS_INTERSPHINX=1``, so an
offline build (this machine, CI) stays warning-free under ``-W``.
"""

from __future__ import annotations

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout's numcoll, installed or not

import numcoll  # noqa: E402

project = "numcoll"
author = "The numcoll authors"
copyright = "the numcoll authors, BSD-3-Clause"  # noqa: A001 - Sphinx's name
release = numcoll.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "tools", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# Tables of measurements are wide; GitHub-style slugs for headings.
suppress_warnings = ["myst.header"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
napoleon_numpy_docstring = True
napoleon_google_docstring = False
napoleon_use_rtype = False

intersphinx_mapping = {
    "python": ("https://docs.python.org/3", None),
    "numpy": ("https://numpy.org/doc/stable", None),
    "torch": ("https://pytorch.org/docs/stable", None),
}
if os.environ.get("NUMCOLL_DOCS_INTERSPHINX") != "1":
    # Offline: keep the mapping above (for a networked build) but fetch nothing.
    extensions.remove("sphinx.ext.intersphinx")

html_theme = "furo"
html_title = f"numcoll {release}"
html_static_path: list[str] = []
