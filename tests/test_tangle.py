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
    """Copy what the tangler reads and writes: `_toc.yml`, `pyproject.toml` (the version), `book/` and the
    package."""
    destination.mkdir()
    shutil.copy2(ROOT / "_toc.yml", destination / "_toc.yml")
    shutil.copy2(ROOT / "pyproject.toml", destination / "pyproject.toml")
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
    # the advice tangles the same book that was checked
    assert f"run `python -m annotated_transformer.tangle --root {synced}`" in result.stderr


def test_stray_module_is_an_orphan(synced: Path, pristine_modules: dict[str, str]) -> None:
    (synced / PACKAGE / "stray.py").write_text("x = 1\n", encoding="utf-8")
    problems = compare(synced, pristine_modules)  # the chapters did not change
    assert problems == [f"orphan: {PACKAGE}/stray.py (no chapter produces it)"]
    result = run_check(synced)  # tangling would not help: the advice says what would
    assert result.returncode == 1 and "delete it, or name it in a chapter" in result.stderr
    assert "run `python -m annotated_transformer.tangle" not in result.stderr


def test_deleted_module_is_missing(synced: Path, pristine_modules: dict[str, str]) -> None:
    (synced / MODULE).unlink()
    problems = compare(synced, pristine_modules)  # the chapters did not change
    assert len(problems) == 1 and problems[0].startswith(f"missing: {MODULE}"), problems


def test_the_check_is_byte_for_byte_and_tangling_repairs_any_module(synced: Path, pristine_modules) -> None:
    """A module saved with CRLF line ends passed the check (text comparison reads CRLF as LF) and was never rewritten;
    one saved in Latin-1 stopped the check and the tangle with a UnicodeDecodeError naming no file. A stub or a
    subpackage written by hand was not an orphan. An empty _toc.yml emptied the package's public names."""
    crlf, latin = synced / MODULE, synced / PACKAGE / "encoder.py"
    crlf.write_bytes(crlf.read_bytes().replace(b"\n", b"\r\n"))
    latin.write_bytes(latin.read_bytes() + b"# caf\xe9\n")
    (synced / PACKAGE / "attention.pyi").write_text("def attention(*a): ...\n", encoding="utf-8")
    (synced / PACKAGE / "extra").mkdir()
    (synced / PACKAGE / "extra" / "helpers.py").write_text("x = 1\n", encoding="utf-8")
    assert compare(synced, pristine_modules) == [
        f"stale: {PACKAGE}/encoder.py (differs from what the book produces)",
        f"stale: {MODULE} (differs from what the book produces)",
        f"orphan: {PACKAGE}/attention.pyi (no chapter produces it)",
        f"orphan: {PACKAGE}/extra/helpers.py (no chapter produces it)",
    ]
    assert sorted(write_package(synced, pristine_modules)) == [f"{PACKAGE}/encoder.py", MODULE]
    assert crlf.read_bytes() == pristine_modules[MODULE].encode("utf-8")
    assert latin.read_bytes() == pristine_modules[f"{PACKAGE}/encoder.py"].encode("utf-8")


def test_the_version_is_read_from_a_project_table_on_the_first_line(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "1.2"\n\n[tool.x]\nversion = "9"\n')
    assert tangle.project_version(tmp_path) == "1.2"


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


def test_a_tangled_module_is_readable_by_all_as_open_would_make_it(synced: Path) -> None:
    """mkstemp makes its file 0600; a module that the tangler rewrote must not become unreadable to others."""
    edit_chapter(synced)
    umask = os.umask(0o022)
    os.umask(umask)
    assert write_package(synced, tangle_book(synced)) == [MODULE]
    assert (synced / MODULE).stat().st_mode & 0o777 == 0o666 & ~umask


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


# --- the public API: `api:` in the chapters' front matter, loaded lazily by the generated __init__.py ---------

# The names of the public API that the project's design fixes: users, tests and the command line rely on them.
DESIGN_API = [
    "attention", "MultiHeadedAttention", "subsequent_mask", "PositionalEncoding", "Embeddings", "LayerNorm",
    "PositionwiseFeedForward", "make_model", "EncoderDecoder", "LabelSmoothing", "rate", "Batch", "greedy_decode",
    "beam_search",
]


def listed_api() -> list[tuple[str, str, str]]:
    """(name, module, chapter) for every name in the chapters' 'api:' lists, in reading order."""
    return [
        (name, chapter.module_name, chapter.path.relative_to(ROOT).as_posix())
        for chapter in (tangle.read_chapter(path, ROOT) for path in tangle.chapter_paths(ROOT))
        for name in chapter.api
    ]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_every_listed_name_is_defined_by_its_module_and_exported_in_order() -> None:
    import importlib

    import annotated_transformer

    listed = listed_api()
    for name, module, chapter in listed:
        defined = importlib.import_module(f"{PACKAGE}.{module}")
        assert hasattr(defined, name), f"{chapter} lists {name!r} in 'api:', but {PACKAGE}/{module}.py lacks it"
        assert getattr(annotated_transformer, name) is getattr(defined, name), name
    assert annotated_transformer.__all__ == [name for name, _, _ in listed]
    assert sorted(dir(annotated_transformer)) == sorted(annotated_transformer.__all__)


def test_no_name_is_listed_twice() -> None:
    chapters_of: dict[str, list[str]] = {}
    for name, _, chapter in listed_api():
        chapters_of.setdefault(name, []).append(chapter)
    twice = {name: where for name, where in chapters_of.items() if len(where) > 1}
    assert twice == {}, f"names in the 'api:' of more than one chapter (or twice in one): {twice}"


def test_every_name_of_the_design_is_public() -> None:
    listed = {name for name, _, _ in listed_api()}
    missing = [name for name in DESIGN_API if name not in listed]
    assert missing == [], f"names of the design's public API that no chapter lists in 'api:': {missing}"


def test_importing_the_package_imports_no_torch() -> None:
    done = run_python(
        "import sys\n"
        "import annotated_transformer\n"
        "names = dir(annotated_transformer), annotated_transformer.__all__\n"
        "import annotated_transformer.tangle\n"
        "print('torch' in sys.modules)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False\n", "`import annotated_transformer` (or its tangler) imported torch"


def test_from_the_package_import_make_model() -> None:
    from annotated_transformer import EncoderDecoder, make_model

    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    assert isinstance(model, EncoderDecoder)


def test_a_public_name_is_not_replaced_by_its_module() -> None:
    """`attention` and `beam_search` name both a module and its function: at the top level they are the function,
    whichever was imported first."""
    done = run_python(
        "import sys, types\n"
        "import annotated_transformer.attention\n"
        "from annotated_transformer.beam_search import length_penalty_factor\n"
        "from annotated_transformer import attention, beam_search\n"
        "import annotated_transformer as package\n"
        "print(type(attention).__name__, type(beam_search).__name__, type(package.attention).__name__)\n"
        "print(type(sys.modules['annotated_transformer.attention']).__name__)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["function function function", "module"]


def test_unknown_names_raise_attribute_error() -> None:
    import annotated_transformer

    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        annotated_transformer.no_such_name  # noqa: B018
    with pytest.raises(ImportError, match="no_such_name"):
        exec("from annotated_transformer import no_such_name", {})


def write_chapter(root: Path, name: str, front_matter: str) -> None:
    (root / "book" / f"{name}.md").write_text(
        FRONT_MATTER.format(extra=front_matter, title=name.title()), encoding="utf-8"
    )
    add_to_toc(root, name)


def test_the_generated_init_lists_a_new_chapters_names(book: Path) -> None:
    write_chapter(book, "extra", f"tangle: {PACKAGE}/extra.py\napi: [VALUE]\n")
    init = tangle_book(book)[f"{PACKAGE}/__init__.py"]
    assert '    "VALUE": "extra",\n}' in init  # the last chapter's names come last
    assert f"- ``{PACKAGE}.extra``: Extra (book/extra.md)" in init


@pytest.mark.parametrize("front_matter, message", [
    (f"tangle: {PACKAGE}/extra.py\napi: [make_model]\n",
     r"'make_model' is in the 'api:' of both book/model\.md and book/extra\.md"),
    (f"tangle: {PACKAGE}/extra.py\napi: [VALUE, VALUE]\n", r"'VALUE' is in the 'api:' of both book/extra\.md"),
    (f"tangle: {PACKAGE}/extra.py\napi: [missing]\n",
     rf"book/extra\.md lists 'missing' in 'api:', but {PACKAGE}/extra\.py does not define it"),
    (f"tangle: {PACKAGE}/extra.py\napi: VALUE\n", r"book/extra\.md: 'api:' must be a list of public names"),
    (f"tangle: {PACKAGE}/extra.py\napi: [_VALUE]\n", r"book/extra\.md: 'api:' must be a list of public names"),
    ("api: [VALUE]\n", r"book/extra\.md has cells tagged 'export' but no 'tangle:'"),
])
def test_bad_api_lists_are_refused_naming_the_chapter(book: Path, front_matter: str, message: str) -> None:
    write_chapter(book, "extra", front_matter)
    with pytest.raises(ValueError, match=message):
        tangle_book(book)


def test_an_api_name_may_not_hide_another_module(book: Path) -> None:
    text = FRONT_MATTER.format(extra=f"tangle: {PACKAGE}/extra.py\napi: [training]\n", title="Extra")
    (book / "book" / "extra.md").write_text(text.replace("VALUE = 1", "training = 1"), encoding="utf-8")
    add_to_toc(book, "extra")
    with pytest.raises(ValueError, match=r"book/extra\.md lists 'training' in 'api:', but that is the name of "
                                         r"another module"):
        tangle_book(book)


def test_api_without_a_module_is_refused(book: Path) -> None:
    text = FRONT_MATTER.format(extra="api: [VALUE]\n", title="Extra").replace(":tags: [export]\n", "")
    (book / "book" / "extra.md").write_text(text, encoding="utf-8")
    add_to_toc(book, "extra")
    with pytest.raises(ValueError, match=r"book/extra\.md lists 'api:' names but has no 'tangle:' module"):
        tangle_book(book)


def test_the_tangler_parses_no_arguments_itself_and_its_script_still_works(synced: Path, tmp_path: Path) -> None:
    assert not hasattr(tangle, "argparse") and not hasattr(tangle, "build_parser")
    result = subprocess.run([sys.executable, "-m", "annotated_transformer.tangle", "--help"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "--check" in result.stdout and "--root" in result.stdout
    result = subprocess.run([sys.executable, "-m", "annotated_transformer.tangle", "--check", "--root", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "does not hold the book" in result.stderr
    assert tangle.run(check=True, root=synced) == 0  # the function the command calls, with plain arguments


# --- a broken book: one line naming the file (issue 21, defect 21) --------------------------------------------


@pytest.mark.parametrize("breakage, expected", [
    (lambda root: (root / "_toc.yml").write_text("parts: [\n", encoding="utf-8"), "_toc.yml is no table of contents"),
    (lambda root: (root / "_toc.yml").write_bytes(b"root: book/intro\n# \xe4\n"), "_toc.yml is no table of contents"),
    (lambda root: (root / "book/model.md").write_text("---\ntangle: [a\n---\n# x\n", encoding="utf-8"),
     "book/model.md: its front matter is not valid YAML"),
    (lambda root: (root / "book/model.md").write_bytes(b"---\ntangle: a\n---\n# \xe4\n"),
     "book/model.md is not UTF-8 text"),
    (lambda root: (root / "book/model.md").unlink(), "_toc.yml lists book/model, but there is no"),
    (lambda root: (root / "_toc.yml").write_text("", encoding="utf-8"), "_toc.yml names no chapter"),
], ids=["toc-yaml", "toc-not-utf8", "front-matter-yaml", "chapter-not-utf8", "chapter-deleted", "toc-empty"])
def test_a_broken_book_is_one_line_naming_the_file(synced: Path, breakage, expected: str) -> None:
    breakage(synced)
    result = run_check(synced)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and expected in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "stale" not in result.stderr and "orphan" not in result.stderr


def test_a_broken_cli_does_not_lock_the_tangler_out(synced: Path) -> None:
    """A typo tangled into cli.py: `python -m annotated_transformer.tangle` still runs (from its own module),
    says why it runs without the command line, and writes cli.py back from the chapter."""
    cli = synced / PACKAGE / "cli.py"
    good = cli.read_text(encoding="utf-8")
    cli.write_text(good + "\ndef typo(:\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "annotated_transformer.tangle"],
                          capture_output=True, text=True, timeout=120, cwd=synced)
    assert done.returncode == 0, done.stderr
    assert "cli.py does not import (SyntaxError" in done.stderr
    assert cli.read_text(encoding="utf-8") == good
    assert run_check(synced).returncode == 0


def test_the_version_is_pyprojects() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    done = run_python("import annotated_transformer as a; print(a.__version__)")
    assert done.stdout.strip() == project["version"], done.stderr
    version = subprocess.run([sys.executable, "-m", "annotated_transformer", "--version"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert version.returncode == 0 and version.stdout.split() == ["python", "-m", PACKAGE, project["version"]]


def test_the_tangler_run_as_a_file_refuses_instead_of_passing_silently() -> None:
    """`python annotated_transformer/tangle.py --check` did nothing and exited 0, which a CI job takes for a pass."""
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, str(root / "annotated_transformer" / "tangle.py"), "--check"],
                            cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "python -m annotated_transformer.tangle" in result.stderr, result
