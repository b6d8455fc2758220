"""Opening and saving a chapter in JupyterLab (`make lab`) leaves it valid (README, "Reading a chapter as a notebook").

JupyterLab opens a chapter through jupytext's contents manager: it reads the MyST file as a notebook, the kernel
adds its own metadata, and every save writes the notebook back as MyST with the project's jupytext settings. The
chapters' front matter carries a `notebook_metadata_filter` that keeps `tangle:` and `api:` (jupytext drops
metadata it does not know), and names the kernel as the kernel names itself, so that the round trip changes nothing
and `tangle --check` stays green.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from annotated_transformer.tangle import chapter_paths, run

jupytext = pytest.importorskip("jupytext")
from jupytext.config import find_jupytext_configuration_file, load_jupytext_configuration_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNEL = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}  # ipykernel's own
LANGUAGE_INFO = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python", "file_extension": ".py"}


def saved_by_jupyterlab(path: Path) -> str:
    """The text jupytext writes when JupyterLab saves ``path`` after opening it and starting its kernel."""
    notebook = jupytext.read(path)
    notebook.metadata["kernelspec"] = dict(KERNEL)          # what the running kernel reports
    notebook.metadata["language_info"] = dict(LANGUAGE_INFO)
    found = find_jupytext_configuration_file(str(path.parent))
    config = load_jupytext_configuration_file(found) if found else None
    return jupytext.writes(notebook, fmt="md:myst", config=config)


def notebook_chapters() -> list[Path]:
    return [path for path in chapter_paths(ROOT) if path.read_text(encoding="utf-8").startswith("---")]


def test_saving_a_chapter_in_jupyterlab_changes_nothing():
    changed = [str(path.relative_to(ROOT)) for path in notebook_chapters()
               if saved_by_jupyterlab(path) != path.read_text(encoding="utf-8")]
    assert not changed, f"a save in JupyterLab would rewrite these chapters: {changed}"


def test_the_tangle_check_passes_after_every_chapter_is_saved(tmp_path, capsys):
    for name in ("_toc.yml", "pyproject.toml", "book", "annotated_transformer"):
        source = ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)
    for path in notebook_chapters():
        copy = tmp_path / path.relative_to(ROOT)
        copy.write_text(saved_by_jupyterlab(path), encoding="utf-8")
        assert "\ntangle:" in copy.read_text(encoding="utf-8") or "tangle:" not in path.read_text(encoding="utf-8")
    assert run(root=tmp_path, check=True) == 0, capsys.readouterr()


def test_make_lab_allows_root_only_as_root():
    done = subprocess.run(["make", "-n", "--no-print-directory", "lab"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    [command] = [line for line in done.stdout.splitlines() if "jupyter lab" in line]
    assert ("--allow-root" in command) == (os.getuid() == 0), command
