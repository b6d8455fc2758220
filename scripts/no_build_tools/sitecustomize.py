"""Make the notebook build tools unimportable, as on a plain GPU machine, in Colab or in a bare Jupyter.

Put this folder first on ``PYTHONPATH`` and Python imports this file at start-up (the ``site`` module looks for a
``sitecustomize`` module). It installs a finder, first on ``sys.meta_path``, that refuses the tools a chapter may
use only while the book is built: ``import myst_nb`` (or jupytext, nbformat, ...) then raises
``ModuleNotFoundError``, exactly as where they are not installed. The tests run every chapter as a plain script,
and collect the CUDA tests, this way (`tests/test_plain_python.py`).
"""
from __future__ import annotations

import sys

BLOCKED = ("myst_nb", "myst_parser", "jupytext", "nbformat", "nbval", "nbclient", "jupyter_book",
           "jupyter_cache", "sphinx")


class NoBuildTools:
    """A meta-path finder that refuses the modules in ``BLOCKED`` and their submodules."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".", 1)[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (a build tool, blocked for this run)", name=name)
        return None


sys.meta_path.insert(0, NoBuildTools())
