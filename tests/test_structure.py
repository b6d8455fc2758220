"""The shape of the book and its package (the book's style): chapters use only what earlier chapters built, modules
form layers without cycles, argument parsing stays in cli.py, and modules and cells stay small enough to read.

Each test collects every offence and fails once, listing them as `file:line: what is wrong`.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml

from annotated_transformer.tangle import EXPORT_TAG, PACKAGE, chapter_paths, read_chapter

ROOT = Path(__file__).resolve().parents[1]
INTRO = "book/intro.md"          # its preview may use the whole package
APPENDICES = "Appendices"        # the caption of the part of _toc.yml that holds the plumbing
CLI = "cli"                      # the command line is on top of the layers and may import anything
# Sizes count lines of content (content_lines): wrapping a long line to fit the page adds none. At the widths
# of the book before its code fitted 88 columns, the largest module held 343 such lines in 420 lines of text.
MAX_MODULE_LINES = 350
MAX_CELL_LINES = 60
MAX_EXPORT_BEFORE_USE = 100      # lines of exported code a teaching chapter may show before it runs anything
MAX_COLUMNS = 88                 # the site's code column
MAX_PROSE_COLUMNS = 120          # the chapters' prose source, wrapped at 118: a diff or an editor shows it whole

# These tests read the chapters with jupytext, a build tool: where it is missing (a plain GPU machine running
# `pytest -m cuda`), the module is skipped rather than stopping the collection of every other test.
jupytext = pytest.importorskip("jupytext")


@dataclass
class Cell:
    line: int                    # where the cell's source starts in the chapter's file (1-based)
    source: str
    tags: list[str]


@dataclass
class Owner:
    index: int                   # the chapter's place in _toc.yml
    chapter: str                 # book/x.md
    appendix: bool


@cache
def chapters() -> list[str]:
    """The chapters in reading order, as paths relative to the repository."""
    return [path.relative_to(ROOT).as_posix() for path in chapter_paths(ROOT)]


@cache
def appendix_chapters() -> frozenset[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    return frozenset(
        f"{entry['file']}.md" if not entry["file"].endswith(".md") else entry["file"]
        for part in toc.get("parts", []) if part.get("caption") == APPENDICES
        for entry in part.get("chapters", []) if "file" in entry
    )


@cache
def owners() -> dict[str, Owner]:
    """{module name: the chapter that tangles it}."""
    found = {}
    for index, chapter in enumerate(chapters()):
        module = read_chapter(ROOT / chapter, ROOT).module
        if module:
            found[Path(module).stem] = Owner(index, chapter, chapter in appendix_chapters())
    return found


@cache
def public_names() -> dict[str, str]:
    """{public name: its module}, from the chapters' 'api:' lists."""
    names = {}
    for chapter in chapters():
        read = read_chapter(ROOT / chapter, ROOT)
        names.update((name, read.module_name) for name in read.api)
    return names


@cache
def code_cells(chapter: str) -> list[Cell]:
    """The chapter's code cells, read by jupytext, each with the line of the file where its source starts."""
    text = (ROOT / chapter).read_text(encoding="utf-8")
    cells, position = [], 0
    for cell in jupytext.read(ROOT / chapter).cells:
        if cell.cell_type != "code":
            continue
        found = text.find(cell.source, position) if cell.source else -1
        position = found if found >= 0 else position
        cells.append(Cell(text.count("\n", 0, position) + 1, cell.source, list(cell.metadata.get("tags", []))))
    return cells


def imported_modules(tree: ast.AST, module: str | None = None) -> list[tuple[str, int]]:
    """(module name, line) for each import of a module of the package, at any depth, except inside an
    `if __name__ == "__main__":` block (which runs only when the file is the program, a different module object).
    ``from annotated_transformer import make_model`` counts as an import of the module that defines make_model."""
    found = []
    for node in walk_outside_main(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE and len(parts) > 1:
                    found.append((parts[1], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:                      # relative: from . import x, from .x import y
                base = [PACKAGE] if node.level == 1 and module else []
                parts = base + (node.module.split(".") if node.module else [])
            else:
                parts = (node.module or "").split(".")
            if parts[:1] != [PACKAGE]:
                continue
            if len(parts) > 1:
                found.append((parts[1], node.lineno))
            else:
                for alias in node.names:
                    name = alias.name if alias.name in owners() else public_names().get(alias.name)
                    if name:
                        found.append((name, node.lineno))
    return found


def walk_outside_main(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and is_main_test(node.test):
            continue
        yield node
        yield from walk_outside_main(node)


def is_main_test(test: ast.expr) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def parse_cell(source: str) -> ast.Module:
    """A code cell's syntax tree; IPython's `%magic` and `!shell` lines become blank lines."""
    return ast.parse(re.sub(r"(?m)^[%!].*$", "", source))


def package_modules() -> list[Path]:
    return sorted(path for path in (ROOT / PACKAGE).glob("*.py"))


def module_imports() -> dict[str, list[tuple[str, int]]]:
    """{module: [(imported module, line)]} for the generated modules (not __init__ and __main__)."""
    graph = {}
    for path in package_modules():
        if path.stem in ("__init__", "__main__"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[path.stem] = [(name, line) for name, line in imported_modules(tree, path.stem) if name != path.stem]
    return graph


def content_lines(source: str) -> int:
    """The lines of ``source`` that are not blank and do not continue a bracketed expression: a call wrapped
    over five lines to fit the page counts as one line, a comment or a docstring line as one each."""
    continued, depth, start = set(), 0, 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.OP and token.string in "([{":
                start = token.start[0] if depth == 0 else start
                depth += 1
            elif token.type == tokenize.OP and token.string in ")]}":
                depth -= 1
                if depth == 0:
                    continued.update(range(start + 1, token.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):  # not Python: count every line
        continued = set()
    return sum(1 for number, line in enumerate(source.splitlines(), 1) if line.strip() and number not in continued)


def report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n" + "\n".join(problems)


# --- a. chapter order and module layers ---------------------------------------------------------------------


def test_no_chapter_imports_a_module_of_a_later_chapter():
    """A reader meets each module before a chapter uses it, except the plumbing that an appendix tangles (the
    checkpoint files, the records, the download), which a chapter may use as a tool, linking to the appendix for
    how it works; the same rule as the modules' below."""
    problems = []
    for index, chapter in enumerate(chapters()):
        if chapter == INTRO:
            continue
        for cell in code_cells(chapter):
            try:
                tree = parse_cell(cell.source)
            except SyntaxError as error:
                problems.append(f"{chapter}:{cell.line + (error.lineno or 1) - 1}: a code cell that does not parse")
                continue
            for module, line in imported_modules(tree):
                owner = owners().get(module)
                if owner is not None and owner.index > index and not owner.appendix:
                    problems.append(f"{chapter}:{cell.line + line - 1}: imports {PACKAGE}.{module}, which only "
                                    f"{owner.chapter} (later in _toc.yml) tangles")
    assert not problems, report(problems, "imports of modules that a later chapter tangles")


def test_modules_import_each_other_without_cycles():
    graph = module_imports()
    lines = {(module, name): line for module, edges in graph.items() for name, line in edges}
    cycles, seen = [], set()

    def visit(module: str, path: list[str]) -> None:
        for name, _ in graph.get(module, []):
            if name in path:
                cycle = path[path.index(name):] + [name]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    cycles.append(cycle)
            elif name in graph and name not in done:
                visit(name, path + [name])
        done.add(module)

    done: set[str] = set()
    for module in graph:
        if module not in done:
            visit(module, [module])
    problems = [
        "import cycle " + " -> ".join(cycle) + ": "
        + ", ".join(f"{PACKAGE}/{a}.py:{lines[a, b]} imports {b}" for a, b in zip(cycle, cycle[1:]))
        for cycle in cycles
    ]
    assert not problems, report(problems, "import cycles among the package's modules")


def test_modules_import_only_earlier_chapters_or_appendices():
    problems = []
    for module, edges in module_imports().items():
        owner = owners().get(module)
        if module == CLI or owner is None:
            continue
        for name, line in edges:
            target = owners().get(name)
            if target is not None and target.index > owner.index and not target.appendix:
                problems.append(f"{PACKAGE}/{module}.py:{line}: imports {PACKAGE}.{name}, which {target.chapter} "
                                f"tangles after {owner.chapter} (only appendix modules may come later)")
    assert not problems, report(problems, "imports of a later chapter's module")


# --- b. argument parsing lives in cli.py --------------------------------------------------------------------


def test_argparse_is_imported_only_by_the_command_line():
    problems = []
    for path in package_modules():
        if path.stem == CLI:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.split(".")[0] == "argparse" for name in names):
                problems.append(f"{PACKAGE}/{path.name}:{node.lineno}: imports argparse; argument parsing belongs "
                                f"in {PACKAGE}/{CLI}.py (book/cli.md)")
    assert not problems, report(problems, "imports of argparse outside the command line")


# --- c. small modules ---------------------------------------------------------------------------------------


def test_modules_are_small():
    problems = []
    for path in package_modules():
        count = content_lines(path.read_text(encoding="utf-8"))
        if count > MAX_MODULE_LINES:
            problems.append(f"{PACKAGE}/{path.name}:1: {count} lines of content, more than "
                            f"{MAX_MODULE_LINES}; split its chapter's code into smaller modules")
    assert not problems, report(problems, "modules that are too long")


# --- d. readable chapters -----------------------------------------------------------------------------------


def test_code_cells_are_short():
    problems = []
    for chapter in chapters():
        for cell in code_cells(chapter):
            count = content_lines(re.sub(r"(?m)^[%!].*$", "", cell.source))
            if count > MAX_CELL_LINES:
                problems.append(f"{chapter}:{cell.line}: a code cell of {count} lines, more than {MAX_CELL_LINES}")
    assert not problems, report(problems, "code cells that are too long")


def test_chapter_code_fits_the_page():
    """No line of a code cell is wider than the site's code column, so nothing a reader needs scrolls."""
    problems = []
    for chapter in chapters():
        for cell in code_cells(chapter):
            for offset, line in enumerate(cell.source.splitlines()):
                if len(line) > MAX_COLUMNS:
                    problems.append(f"{chapter}:{cell.line + offset}: {len(line)} columns, more than {MAX_COLUMNS}")
    assert not problems, report(problems, "lines of chapter code too wide for the page")


def prose_lines(chapter: str):
    """(line number, line) for each line of the chapter's text outside its front matter, its fenced blocks (code
    cells, directives, display listings) and its tables, whose rows Markdown cannot wrap."""
    lines = (ROOT / chapter).read_text(encoding="utf-8").splitlines()
    fence, start = None, 0
    if lines and lines[0] == "---":
        start = lines.index("---", 1) + 1
    for number, line in enumerate(lines[start:], start + 1):
        marker = re.match(r"(`{3,}|~{3,}|:{3,})", line.strip())
        if marker:
            fence = marker.group(1) if fence is None else (None if line.strip() == fence else fence)
        elif fence is None and not line.lstrip().startswith("|"):
            yield number, line


def test_chapter_prose_is_wrapped():
    """Prose lines stay within MAX_PROSE_COLUMNS, so that a review reads a changed paragraph without scrolling;
    only line breaks are at stake (Markdown joins a paragraph's lines), so rewrapping never changes the page."""
    problems = [f"{chapter}:{number}: {len(line)} columns, more than {MAX_PROSE_COLUMNS}"
                for chapter in chapters() for number, line in prose_lines(chapter)
                if len(line) > MAX_PROSE_COLUMNS]
    assert not problems, report(problems, "lines of prose to rewrap")


def test_teaching_chapters_run_something_before_much_exported_code():
    problems = []
    for chapter in chapters():
        if chapter == INTRO or chapter in appendix_chapters():
            continue
        cells = code_cells(chapter)
        first_use = next((i for i, cell in enumerate(cells) if EXPORT_TAG not in cell.tags), len(cells))
        exported = sum(content_lines(cell.source) for cell in cells[:first_use])
        if exported > MAX_EXPORT_BEFORE_USE:
            where = cells[first_use].line if first_use < len(cells) else cells[-1].line
            problems.append(f"{chapter}:{where}: {exported} lines of exported code in the {first_use} cells before "
                            f"the first code cell that is not exported (at most {MAX_EXPORT_BEFORE_USE})")
    assert not problems, report(problems, "chapters that show too much code before running any")
