"""Sphinx configuration: the user guide (docs/*.md), README.md and benchmarks/*.md as
MyST Markdown, and the API reference read from the docstrings by autodoc.

Built from the repository root so that links between README.md, docs/ and benchmarks/
are checked like links inside the guide (a broken one is a warning, and the build runs
with warnings as errors):

    python -m sphinx -W --keep-going -b html -c docs . docs/_build/html    # make docs
"""

from __future__ import annotations

import os
import sys

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

project = "ddpcomm"
author = "ddpcomm contributors"
copyright = "ddpcomm contributors"  # noqa: A001 - Sphinx's name

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "docs/index"
# Only these pages; the walk skips the big trees outright.
include_patterns = ["README.md", "docs/**", "benchmarks/README.md", "benchmarks/RESULTS.md"]
exclude_patterns = [
    "docs/_build",
    ".venv",
    ".git",
    "build",
    "csrc",
    "ddpcomm",
    "tests",
    "benchmarks/results",
]
myst_heading_anchors = 3  # [text](page.md#a-heading) links are checked too
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_title = "ddpcomm"
html_theme_options = {"nosidebar": False}


class ArgparseHelp(SphinxDirective):
    """``{argparse-help} module:function``: the help text of the parser ``function``
    returns, as printed by ``--help``, so the reference never drifts from the CLI."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        import importlib

        module, func = self.arguments[0].split(":")
        text = getattr(importlib.import_module(module), func)().format_help()
        return [nodes.literal_block(text, text)]


def _front_page(app, exception) -> None:
    """``index.html`` at the top of the output, forwarding to the guide's index."""
    if exception is None and app.builder.format == "html":
        with open(os.path.join(app.outdir, "index.html"), "w") as f:
            f.write('<meta http-equiv="refresh" content="0; url=docs/index.html">\n')


def setup(app) -> None:
    os.environ.setdefault("COLUMNS", "88")  # argparse wraps its help to the terminal width
    app.add_directive("argparse-help", ArgparseHelp)
    app.connect("build-finished", _front_page)
