"""Sphinx configuration for smddp's documentation.

Build (CI does the same, with warnings as errors)::

    python -m sphinx -W -b html docs /tmp/docs-out

Pages are Markdown (MyST) or reStructuredText. The API reference is generated from the
docstrings. Pages that other parts of the project contribute (``launching.md``,
``backends.md``, ...) are listed in the index when they exist, so the build never depends on
a page that has not landed yet; any other page added to ``docs/`` is listed too.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # document the checkout, installed or not

import smddp  # noqa: E402

project = "smddp"
author = "smddp developers"
copyright = "smddp developers"  # noqa: A001 - Sphinx's name
release = version = smddp.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "README.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# Pages written for GitHub often start at "##" or skip a level; that is cosmetic.
suppress_warnings = ["myst.header"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Optional third-party libraries that smddp's modules import: mocked only where missing.
autodoc_mock_imports = [
    name for name in ("sagemaker", "boto3", "botocore", "cupy", "oneccl_bindings_for_pytorch")
    if importlib.util.find_spec(name) is None
]

html_theme = "alabaster"
html_title = f"smddp {release}"
html_theme_options = {"description": "SageMaker's distributed data parallel library for PyTorch, anywhere"}

# ------------------------------------------------------------------------------ page list
#: The index's table of contents, in reading order. Pages marked optional are written in other
#: parts of the project and are listed once they exist.
PAGES = [
    ("quickstart", False),
    ("migrating", False),
    ("launching", True),
    ("backends", True),
    ("ddp", True),
    ("fsdp", True),
    ("sagemaker", True),
    ("integrations", True),
    ("troubleshooting", True),
    ("performance", False),
    ("tools", False),
    ("api", False),
]
_TOC_MARKER = "<!-- smddp:toctree -->"


def _exists(docname: str) -> bool:
    return any((DOCS / f"{docname}{suffix}").exists() for suffix in source_suffix)


def _toctree() -> str:
    listed = [name for name, optional in PAGES if not optional or _exists(name)]
    known = {name for name, _ in PAGES} | {"index"}
    others = sorted(
        str(p.relative_to(DOCS).with_suffix("")) for suffix in source_suffix for p in DOCS.rglob(f"*{suffix}")
        if p.relative_to(DOCS).parts[0] not in ("_build",) and p.name != "README.md"
        and str(p.relative_to(DOCS).with_suffix("")) not in known
    )
    body = "\n".join(listed + others)
    return f"```{{toctree}}\n:maxdepth: 2\n:caption: Contents\n\n{body}\n```\n"


def _fill_toctree(app, docname, source):
    if docname == root_doc and _TOC_MARKER in source[0]:
        source[0] = source[0].replace(_TOC_MARKER, _toctree())


# ------------------------------------------------------------------------------ directives
class OptionalAutomodule(SphinxDirective):
    """``.. optional-automodule:: smddp.x``: ``automodule`` when the module exists, else a note.

    A module that exists but fails to import still fails the build (autodoc warns).
    """

    required_arguments = 1
    option_spec = {"no-members": directives.flag}

    def run(self):
        name = self.arguments[0]
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:
            found = False
        if not found:
            para = nodes.paragraph(text=f"{name} is not part of this version of smddp.")
            return [nodes.note("", para)]
        lines = [f".. automodule:: {name}"]
        if "no-members" in self.options:
            lines.append("   :no-members:")
        self.state_machine.insert_input(lines, self.state_machine.document.current_source)
        return []


class CliHelp(SphinxDirective):
    """``.. cli-help:: smddp.bench:build_parser``: a command's ``--help``, current at build time."""

    required_arguments = 1

    def run(self):
        module_name, func = self.arguments[0].split(":")
        parser = getattr(importlib.import_module(module_name), func)()
        previous = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: make it reproducible
        try:
            text = parser.format_help()
        finally:
            if previous is None:
                os.environ.pop("COLUMNS", None)
            else:
                os.environ["COLUMNS"] = previous
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def setup(app):
    app.connect("source-read", _fill_toctree)
    app.add_directive("optional-automodule", OptionalAutomodule)
    app.add_directive("cli-help", CliHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
