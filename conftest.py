"""Let nbval collect the book's MyST Markdown chapters (book/*.md) as notebooks.

nbval 0.11 only collects ``.ipynb`` files and reads them with ``nbformat.read``. For a ``.md`` file whose front
matter says ``format_name: myst`` we return nbval's own collector, with that one read done by jupytext instead.
Run with ``pytest --nbval-lax book`` (the Makefile does); the checks are the ``assert``s in the chapters' cells.

With ``--save-executed DIR`` each chapter whose cells all passed is also written to ``DIR/<chapter>.ipynb`` with the
outputs its cells printed, for `scripts/execute_chapters.py --executed DIR`: `make test` then builds the book from
the very runs it checked instead of running every chapter a second time.
"""
from __future__ import annotations

import os
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
            self.cell_items = []
            original = nbformat.read

            def read(path, *args, **kwargs):
                if str(path).endswith(".md"):
                    return jupytext.read(path)
                return original(path, *args, **kwargs)

            with mock.patch.object(nbformat, "read", read):
                for item in super().collect():
                    self.cell_items.append(item)
                    yield item

        def teardown(self):
            folder = self.config.getoption("save_executed")
            if folder is not None:
                save_executed(self.nb, self.cell_items, Path(folder) / f"{self.path.stem}.ipynb")
            super().teardown()


def save_executed(notebook, items, target: Path) -> None:
    """Write the notebook with the outputs its cells printed under nbval, if every cell ran without an error."""
    for item in items:
        outputs = item.test_outputs
        if outputs is None or any(out.get("output_type") == "error" for out in outputs):
            return
    for count, item in enumerate(items, start=1):
        item.cell.outputs, item.cell.execution_count = item.test_outputs, count
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, target)


def pytest_configure(config):
    """With pytest-xdist's ``-n``, one math thread per worker unless OMP_NUM_THREADS says otherwise, as `make test`
    sets it: workers (and the chapters' kernels) that each start a thread per core fight over the cores, and the
    book's many small models then run several times more slowly."""
    if getattr(config.option, "numprocesses", None) and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the workers, started after this
    # keep the order of pytest_collection_modifyitems below (pytest-xdist would sort the files by their size)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if config.getoption("save_executed", None):  # the book shows these runs: glue into the page
        os.environ["AT_BOOK_BUILD"] = "1"  # inherited by the chapters' kernels


def pytest_collection_modifyitems(config, items):
    """In pytest-xdist's workers (``-n``) the files are handed out in this order: first the files of slow tests
    (most slow tests first: the chapters run without the build tools), then the chapters (most cells first), then
    the rest as collected. pytest-xdist's own order under ``--dist loadfile`` (most items first) sent the five
    notebooks that run under Run All, 2.5 minutes of work in five items, near the end, where one worker ran them
    alone."""
    if not hasattr(config, "workerinput"):  # not a worker: the order does not matter
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def heavy_first(name):
        slow = sum(item.get_closest_marker("slow") is not None for item in files[name])
        chapter = IPyNbFile is not None and isinstance(files[name][0].parent, MystNotebookFile)
        return (0, -slow) if slow else (1, -len(files[name])) if chapter else (2, 0)

    items[:] = [item for name in sorted(files, key=heavy_first) for item in files[name]]


def pytest_addoption(parser):
    parser.addoption("--save-executed", metavar="DIR", default=None,
                     help="write each chapter that passed, with its outputs, to DIR/<chapter>.ipynb")


def pytest_collect_file(file_path: Path, parent):
    option = parent.config.option
    if IPyNbFile is None or not (getattr(option, "nbval", False) or getattr(option, "nbval_lax", False)):
        return None
    if "_build" in file_path.parts or not is_myst_notebook(file_path):
        return None
    return MystNotebookFile.from_parent(parent, path=file_path)
