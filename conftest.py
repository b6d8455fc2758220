"""Let nbval collect the book's MyST Markdown chapters (book/*.md) as notebooks.

nbval 0.11 only collects ``.ipynb`` files and reads them with ``nbformat.read``. For a ``.md`` file whose front
matter says ``format_name: myst`` we return nbval's own collector, with that one read done by jupytext instead.
Run with ``pytest --nbval-lax book`` (the Makefile does); the checks are the ``assert``s in the chapters' cells.
"""
from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

# `make html` writes each chapter as a notebook next to it, for the launch buttons (scripts/notebooks.py). Those
# copies carry an install cell and are not the chapters: nbval must not collect them.
collect_ignore_glob = ["book/*.ipynb"]

try:
    import jupytext
    import nbformat
    from nbval.plugin import IPyNbFile
except ImportError:  # the notebook tools are not installed: only the unit tests run
    IPyNbFile = None


def is_myst_notebook(path: Path) -> bool:
    if path.suffix != ".md":
        return False
    head = path.read_text(encoding="utf-8")[:1000]
    return head.startswith("---") and "format_name: myst" in head


if IPyNbFile is not None:

    class MystNotebookFile(IPyNbFile):
        """nbval's collector, reading the chapter through jupytext."""

        def collect(self):
            original = nbformat.read

            def read(path, *args, **kwargs):
                if str(path).endswith(".md"):
                    return jupytext.read(path)
                return original(path, *args, **kwargs)

            with mock.patch.object(nbformat, "read", read):
                yield from super().collect()


def pytest_collect_file(file_path: Path, parent):
    option = parent.config.option
    if IPyNbFile is None or not (getattr(option, "nbval", False) or getattr(option, "nbval_lax", False)):
        return None
    if "_build" in file_path.parts or not is_myst_notebook(file_path):
        return None
    return MystNotebookFile.from_parent(parent, path=file_path)
