"""Every chapter runs where a reader runs it, not only inside the book build (README, "Reading a chapter as a
notebook").

A plain GPU machine, Colab or a downloaded notebook has the package and what it depends on, but not the notebook
build tools (myst-nb, jupytext, nbformat, nbval, ...). Here each chapter runs as a plain Python script
(`scripts/chapter_scripts.py`) with those tools made unimportable (`scripts/no_build_tools/sitecustomize.py`), in
the profile of this run (CI: quick); and the CUDA tests must collect in the same setting, as
`scripts/record_gpu.sh checks` runs them on a GPU machine. The chapters whose notebooks run under "Run All" in a
kernel without the build tools (tests/test_notebooks.py, the same cells in a reader's setting) are not run a
second time here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from chapter_scripts import NO_BUILD_TOOLS, chapter_env, run_one, write  # noqa: E402

from test_notebooks import RUN_ALL  # noqa: E402

from annotated_transformer.tangle import chapter_paths  # noqa: E402

CHAPTERS = [path.stem for path in chapter_paths(ROOT) if path.read_text(encoding="utf-8").startswith("---")]
PLAIN = [name for name in CHAPTERS if name not in RUN_ALL]
# Over 10 s each as scripts in a CI run (2 workers): about five minutes of work, which nbval has just done with the
# build tools. `make test` runs the others (the same glue and imports without the build tools), and
# `make test-everywhere` (a step of the workflow) these, with the long notebooks of tests/test_notebooks.py.
LONG = ["questions", "recipe", "performance", "decoding", "copy_task", "sublayers", "trainer", "data", "training",
        "model"]


def test_the_long_chapters_are_chapters_run_as_scripts():
    assert set(LONG) < set(PLAIN)


def test_the_build_tools_are_unimportable_in_such_a_run():
    names = ("myst_nb", "jupytext", "nbformat", "nbval")
    code = ("import importlib\n"
            f"for name in {names!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError:\n"
            "        print(name, 'missing')\n"
            "import torch, annotated_transformer.runtime\n")
    done = subprocess.run([sys.executable, "-c", code], env=chapter_env(without_build_tools=True),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == [f"{name} missing" for name in names]


@pytest.mark.slow
@pytest.mark.parametrize("chapter", [pytest.param(name, marks=pytest.mark.everywhere) if name in LONG else name
                                     for name in PLAIN])
def test_chapter_runs_as_plain_python_without_the_build_tools(chapter, tmp_path):
    pytest.importorskip("jupytext")  # writing the script needs it; running it does not
    [script] = write(tmp_path, [chapter])
    row = run_one(script, timeout=int(os.environ.get("AT_CHAPTER_TIMEOUT", "900")),
                  env=chapter_env(without_build_tools=True))
    assert row["status"] == "passed", f"{chapter}: {row['status']}\n{row['tail']}"


def test_the_cuda_tests_collect_without_the_build_tools():
    """`pytest -m cuda` on a machine without the notebook tools (nbval, whose pytest plugin imports nbformat,
    is then not installed either: `-p no:nbval` stands for that)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(NO_BUILD_TOOLS),
                                                                      os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "pytest", "tests", "-m", "cuda", "--collect-only", "-q",
                           "-p", "no:nbval", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "error" not in summary and " collected" in summary, summary
    assert int(summary.split("/")[0]) >= 30, summary  # the CUDA tests are there, not skipped at collection


def test_glue_prints_outside_a_build_and_glues_inside_one(capsys, monkeypatch):
    from annotated_transformer.runtime import glue

    glue("speed_ratio", 1.25)
    assert capsys.readouterr().out == "speed_ratio = 1.25\n"
    myst_nb = pytest.importorskip("myst_nb")
    IPython = pytest.importorskip("IPython")
    glued = []
    monkeypatch.setattr(myst_nb, "glue", lambda *args, **kwargs: glued.append((args, kwargs)))
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Shell", (), {"kernel": object()})())
    monkeypatch.delenv("AT_BOOK_BUILD", raising=False)
    glue("speed_ratio", 1.25)  # a kernel with myst-nb, but no build (JupyterLab, Binder): Jupyter shows a print
    assert glued == [] and capsys.readouterr().out == "speed_ratio = 1.25\n"
    monkeypatch.setenv("AT_BOOK_BUILD", "1")
    glue("speed_ratio", 1.25)
    assert glued == [(("speed_ratio", 1.25), {"display": False})]
    assert capsys.readouterr().out == ""


def test_every_chapter_runs_without_the_build_tools_here_or_under_run_all():
    assert set(RUN_ALL) <= set(CHAPTERS) and PLAIN  # a Run-All name that is no chapter would leave one unchecked
