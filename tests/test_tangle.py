"""The tangler (book/appendix_tangle.md): the package is what the book produces, and drift is caught.

Every test works on a copy of the book in a temporary folder, so nothing here touches the repository.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from annotated_transformer import tangle
from annotated_transformer.tangle import compare, tangle_book, write_package

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "annotated_transformer"
CHAPTER = "book/appendix_tangle.md"
MODULE = f"{PACKAGE}/tangle.py"
# A line of an export cell of the tangler's own chapter; the edits below change it.
EXPORTED_LINE = 'EXPORT_TAG = "export"'

FRONT_MATTER = """---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
{extra}---

# {title}

```{{code-cell}} ipython3
:tags: [export]

VALUE = 1
```
"""


def copy_repository(destination: Path) -> Path:
    """Copy what the tangler reads and writes: `_toc.yml`, `book/` and the package."""
    destination.mkdir()
    shutil.copy2(ROOT / "_toc.yml", destination / "_toc.yml")
    ignore = shutil.ignore_patterns(".ipynb_checkpoints", "_build", "__pycache__")
    shutil.copytree(ROOT / "book", destination / "book", ignore=ignore)
    shutil.copytree(ROOT / PACKAGE, destination / PACKAGE, ignore=ignore)
    return destination


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A copy of the repository as it is (read-only for the tests)."""
    return copy_repository(tmp_path_factory.mktemp("pristine") / "repo")


@pytest.fixture(scope="module")
def pristine_modules(pristine: Path) -> dict[str, str]:
    return tangle_book(pristine)


@pytest.fixture(scope="module")
def synced_template(pristine: Path, pristine_modules: dict[str, str], tmp_path_factory) -> Path:
    """The copy, tangled: the drift tests start from a package in step with the book, whatever state the
    repository's working tree is in."""
    copy = tmp_path_factory.mktemp("synced") / "repo"
    shutil.copytree(pristine, copy)
    write_package(copy, pristine_modules)
    for path in (copy / PACKAGE).glob("*.py"):
        if f"{PACKAGE}/{path.name}" not in pristine_modules:
            path.unlink()
    assert compare(copy, pristine_modules) == []
    return copy


@pytest.fixture
def book(pristine: Path, tmp_path: Path) -> Path:
    """A copy of the repository that a test may change."""
    return shutil.copytree(pristine, tmp_path / "repo")


@pytest.fixture
def synced(synced_template: Path, tmp_path: Path) -> Path:
    """A tangled copy that a test may change."""
    return shutil.copytree(synced_template, tmp_path / "repo")


def edit_chapter(root: Path) -> None:
    """Change one exported line of the tangler's chapter (a comment: the code still works)."""
    chapter = root / CHAPTER
    text = chapter.read_text(encoding="utf-8")
    line = f"\n{EXPORTED_LINE}\n"
    assert text.count(line) == 1, f"{CHAPTER} no longer has the line {EXPORTED_LINE!r}"
    chapter.write_text(text.replace(line, f"\n{EXPORTED_LINE}  # edited\n"), encoding="utf-8")


def add_to_toc(root: Path, *names: str) -> None:
    """Add chapters at the end of the copy's table of contents (as one more part, if it has parts)."""
    toc_file = root / "_toc.yml"
    toc = yaml.safe_load(toc_file.read_text(encoding="utf-8"))
    chapters = [{"file": f"book/{name}"} for name in names]
    if "parts" in toc:
        toc["parts"].append({"caption": "Added by a test", "chapters": chapters})
    else:
        toc.setdefault("chapters", []).extend(chapters)
    toc_file.write_text(yaml.safe_dump(toc, sort_keys=False), encoding="utf-8")


def run_check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "annotated_transformer.tangle", "--check", "--root", str(root)],
        capture_output=True, text=True, timeout=120, cwd=root,
    )


def test_committed_package_matches_the_book(pristine: Path, pristine_modules: dict[str, str]) -> None:
    assert MODULE in pristine_modules and f"{PACKAGE}/__init__.py" in pristine_modules
    assert compare(pristine, pristine_modules) == []


def test_edited_chapter_without_tangling_is_stale(synced: Path) -> None:
    edit_chapter(synced)
    problems = compare(synced, tangle_book(synced))
    assert len(problems) == 1 and problems[0].startswith(f"stale: {MODULE}"), problems

    result = run_check(synced)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"stale: {MODULE}" in result.stderr


def test_stray_module_is_an_orphan(synced: Path, pristine_modules: dict[str, str]) -> None:
    (synced / PACKAGE / "stray.py").write_text("x = 1\n", encoding="utf-8")
    problems = compare(synced, pristine_modules)  # the chapters did not change
    assert problems == [f"orphan: {PACKAGE}/stray.py (no chapter produces it)"]


def test_deleted_module_is_missing(synced: Path, pristine_modules: dict[str, str]) -> None:
    (synced / MODULE).unlink()
    problems = compare(synced, pristine_modules)  # the chapters did not change
    assert len(problems) == 1 and problems[0].startswith(f"missing: {MODULE}"), problems


def test_tangler_is_a_fixed_point(pristine: Path, pristine_modules: dict[str, str]) -> None:
    assert pristine_modules[MODULE].encode("utf-8") == (pristine / MODULE).read_bytes()


def test_tangling_after_an_edit_writes_the_module_and_the_check_passes(synced: Path) -> None:
    edit_chapter(synced)
    modules = tangle_book(synced)
    assert write_package(synced, modules) == [MODULE]
    assert EXPORTED_LINE + "  # edited" in (synced / MODULE).read_text(encoding="utf-8")
    assert compare(synced, tangle_book(synced)) == []


def test_export_cells_without_a_tangle_key_are_an_error(book: Path) -> None:
    (book / "book" / "untangled.md").write_text(
        FRONT_MATTER.format(extra="", title="Untangled"), encoding="utf-8"
    )
    add_to_toc(book, "untangled")
    with pytest.raises(ValueError, match=r"book/untangled\.md.*no 'tangle:'"):
        tangle_book(book)


def test_two_chapters_naming_one_module_are_an_error(book: Path) -> None:
    for name in ("first", "second"):
        (book / "book" / f"{name}.md").write_text(
            FRONT_MATTER.format(extra=f"tangle: {PACKAGE}/shared.py\n", title=name.title()), encoding="utf-8"
        )
    add_to_toc(book, "first", "second")
    with pytest.raises(ValueError, match=rf"{PACKAGE}/shared\.py.*first\.md.*second\.md"):
        tangle_book(book)


def test_write_package_rewrites_only_changed_files(synced: Path, pristine_modules: dict[str, str]) -> None:
    package = synced / PACKAGE
    old = 1_000_000_000  # 2001: any write now would change it
    for path in package.glob("*.py"):
        os.utime(path, (old, old))
    names = {path.name for path in package.glob("*.py")}

    assert write_package(synced, pristine_modules) == []  # nothing changed, nothing written
    assert {path.name for path in package.glob("*.py") if path.stat().st_mtime == old} == names

    edit_chapter(synced)
    assert write_package(synced, tangle_book(synced)) == [MODULE]
    assert {path.name for path in package.glob("*.py") if path.stat().st_mtime == old} == names - {"tangle.py"}
    assert [path.name for path in package.iterdir() if path.name.endswith(".tmp")] == []


def test_interrupted_write_keeps_the_old_module(synced: Path, monkeypatch) -> None:
    """The new text goes to a temporary file that replaces the module only when complete."""
    before = (synced / MODULE).read_bytes()
    edit_chapter(synced)
    modules = tangle_book(synced)

    class InterruptedOs:
        """The os module, except that the final rename fails."""

        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def replace(source, destination):
            raise OSError("disk full")

    monkeypatch.setattr(tangle, "os", InterruptedOs())
    with pytest.raises(OSError, match="disk full"):
        write_package(synced, modules)
    assert (synced / MODULE).read_bytes() == before
    assert [path.name for path in (synced / PACKAGE).iterdir() if path.name.endswith(".tmp")] == []
