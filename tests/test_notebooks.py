"""The chapters as Jupyter notebooks (scripts/notebooks.py): they read well and run where they are opened.

Jupyter renders no MyST, so the notebooks that the launch and download buttons give carry plain Markdown: checked on
a small synthetic book (every construct the mapping knows) and on every chapter of the real one (nothing of MyST
left). And a notebook must run from top to bottom in a fresh kernel that has the package but none of the tools that
build the book, as in Colab or a bare Jupyter: the notebooks of a few chapters run so, in the quick profile, with
myst-nb, jupytext, nbformat and the others made unimportable in the kernel (scripts/no_build_tools).
"""
from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from annotated_transformer.tangle import chapter_paths
from scripts.notebooks import (
    INSTALL_TAG,
    MYST_EXTENSIONS,
    REFERENCES_TAG,
    chapters,
    glue_values,
    jupyter_notebook,
    myst_leftovers,
    read_book,
)

ROOT = Path(__file__).resolve().parents[1]
NO_BUILD_TOOLS = ROOT / "scripts" / "no_build_tools"
BUILD_TOOLS = ["myst_nb", "jupytext", "nbformat", "nbval", "jupyter_book", "jupyter_cache", "sphinx",
               "myst_parser"]
# The chapters whose notebooks run in a fresh kernel: the first teaching chapter, the two that decode and train with
# real data, and the two appendices whose module also runs as a script (`python -m ...`), whose last cell must not
# raise under "Run All". 70 to 90 s together on this 2-core machine in the quick profile.
RUN_ALL = ["attention", "beam_search", "translation", "appendix_tangle", "appendix_bench"]

FRONT = """\
---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3 (ipykernel)
  language: python
  name: python3
---
"""
CHAPTER = FRONT + """
(chapter-one)=
# One

As {cite}`vaswani2017attention` and {cite:t}`press2017using` say, and {cite}`vaswani2017attention,knuth1984literate`
write, the loss is {glue:text}`loss:.2f`, the share {glue:text}`share:.0%`, the word {glue:text}`word` and the
count {glue:text}`count:,`; `{glue:text}` in a code span stays, and {glue:text}`later` is printed by a cell.
See {doc}`two`, {doc}`the second chapter <two>`, {ref}`two-section`, {ref}`this one <one-part>`, and
{ref}`a role over
<two-section>` two lines. Math: {math}`x^2`, $y$.

```{code-cell} ipython3
from annotated_transformer.runtime import glue

glue("loss", 0.123456, display=False)
```

(one-part)=
## A part

````{admonition} Solutions
:class: dropdown

1. An answer with $a$ and {cite:t}`knuth1984literate`.
2. Code:

   ```python
   print(1)
   ```
````

```{note}
A note with display math:

$$
x = 1
$$
```

:::{warning} Mind the gap
Careful.
:::

- a list item with a directive:

  ```{admonition} Nested
  Inside.
  ```

```python
{cite}`not-a-role` in a code block
```

% a comment

```{code-cell} ipython3
glue("later", 1, display=False)
```
"""
OTHER = FRONT + """
# Two

(two-section)=
## The second section

Text.

```{code-cell} ipython3
x = 1
```
"""
BIB = """
@inproceedings{vaswani2017attention,
  title = {Attention Is All You Need}, year = {2017},
  author = {Vaswani, Ashish and Shazeer, Noam and Parmar, Niki and Kaiser, {\\L}ukasz},
  booktitle = {Advances in Neural Information Processing Systems 30}
}
@article{knuth1984literate,
  title = {Literate Programming}, author = {Knuth, Donald E.}, journal = {The Computer Journal}, year = {1984}
}
@inproceedings{press2017using,
  title = {Using the Output Embedding to Improve Language Models}, author = {Press, Ofir and Wolf, Lior},
  booktitle = {EACL}, year = {2017}
}
"""


@pytest.fixture
def small_book(tmp_path: Path) -> Path:
    """A book of two chapters, a bibliography and the configuration that scripts/notebooks.py reads."""
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "one.md").write_text(CHAPTER, encoding="utf-8")
    (tmp_path / "book" / "two.md").write_text(OTHER, encoding="utf-8")
    (tmp_path / "book" / "refs.bib").write_text(BIB, encoding="utf-8")
    (tmp_path / "_toc.yml").write_text("format: jb-book\nroot: book/one\nchapters:\n  - file: book/two\n")
    (tmp_path / "_config.yml").write_text(yaml.safe_dump({
        "bibtex_bibfiles": ["book/refs.bib"], "execute": {"cache": "_build/.jupyter_cache"},
        "repository": {"url": "https://github.com/someone/small-book", "branch": "notebooks"}}))
    return tmp_path


def glued(text: str) -> dict:
    """What myst-nb's glue(name, value, display=False) leaves in a cell, prefix removed: the value's repr."""
    return {"text/plain": text}


def test_the_markdown_of_a_small_book_reads_well_in_jupyter(small_book: Path) -> None:
    import jupytext

    path = small_book / "book" / "one.md"
    values = {"loss": glued("0.123456"), "share": glued("0.4567"), "word": glued("'Kampf + kunst'"),
              "count": glued("12345")}
    notebook = jupyter_notebook(jupytext.read(path), path, read_book(small_book), values)
    cells = notebook.cells
    assert INSTALL_TAG in cells[0].metadata["tags"] and REFERENCES_TAG in cells[-1].metadata["tags"]
    text = "\n\n".join(cell.source for cell in cells if cell.cell_type == "markdown")

    assert myst_leftovers(text) == [], text
    expected = [
        '<a id="chapter-one"></a>\n\n# One',  # a label is an anchor, and the heading stays a heading
        "As (Vaswani et al., 2017) and Press and Wolf (2017) say, and (Vaswani et al., 2017; Knuth, 1984)",
        "the loss is 0.12, the share 46%, the word Kampf + kunst and the\ncount 12,345;",  # as the page formats
        "`{glue:text}` in a code span stays",
        "`later` (printed below)",  # not executed: a pointer to the cell that prints it
        "See [Two](two.ipynb), [the second chapter](two.ipynb), [The second section](two.ipynb#two-section), "
        "[this one](#one-part), and\n[a role over](two.ipynb#two-section) two lines. Math: $x^2$, $y$.",
        "> **Solutions**\n>\n> 1. An answer with $a$ and Knuth (1984).",  # a dropdown: title and blockquote
        ">    ```python\n>    print(1)\n>    ```",
        "**Note**\n\nA note with display math:\n\n$$\nx = 1\n$$",  # display math stays out of a blockquote
        "> **Warning: Mind the gap**\n>\n> Careful.",
        "  > **Nested**\n  >\n  > Inside.",  # inside a list item, indented as the list
        "```python\n{cite}`not-a-role` in a code block\n```",
        "## References\n\n- Donald E\\. Knuth\\. Literate programming\\.",
    ]
    for snippet in expected:
        assert snippet in text, f"{snippet!r} not in:\n{text}"
    assert "% a comment" not in text and "Łukasz Kaiser" in text
    assert cells[-1].source.count("\n- ") == 3  # the three works cited, once each

    code = [cell.source for cell in cells if cell.cell_type == "code"]
    assert code[1:] == [cell.source for cell in jupytext.read(path).cells if cell.cell_type == "code"]


def test_the_cited_works_follow_the_bibliography_and_unknown_keys_stay_readable(small_book: Path) -> None:
    import jupytext
    import nbformat

    path = small_book / "book" / "two.md"
    notebook = jupytext.read(path)
    notebook.cells.append(nbformat.v4.new_markdown_cell("{cite}`nobody2020` and {cite:p}`knuth1984literate`"))
    converted = jupyter_notebook(notebook, path, read_book(small_book), None)
    assert converted.cells[-2].source == "(nobody2020) and (Knuth, 1984)"
    assert converted.cells[-1].source.count("\n- ") == 1
    again = jupyter_notebook(converted, path, read_book(small_book), None)  # idempotent: `downloads` twice
    assert [cell.source for cell in again.cells] == [cell.source for cell in converted.cells]


def test_the_conversion_parses_the_myst_that_the_book_enables() -> None:
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    assert set(config["parse"]["myst_enable_extensions"]) == MYST_EXTENSIONS


def test_no_myst_is_left_in_any_chapters_notebook() -> None:
    """Every chapter's notebook, as `write` makes it (with the glued values if the chapters have been executed)."""
    import jupytext

    book = read_book(ROOT)
    problems = []
    for path in chapters(ROOT):
        notebook = jupytext.read(path)
        notebook = jupyter_notebook(notebook, path, book, glue_values(notebook, ROOT))  # it copies the notebook
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type == "markdown":
                problems += [f"{path.name}, cell {index}: {leftover}" for leftover in myst_leftovers(cell.source)]
    assert problems == [], "\n".join(problems)
    assert {path.stem for path in chapter_paths(ROOT)} >= set(RUN_ALL)


# ----------------------------------------------------------------------------------------------------------------
# Run All in a fresh kernel without the build tools

PROBE = textwrap.dedent(f"""\
    # the test's probe: this kernel must not have the tools that build the book
    import importlib
    for name in {BUILD_TOOLS!r}:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        raise AssertionError(name + " is importable in this kernel")
    """)


@pytest.fixture(scope="module")
def kernel_env() -> dict[str, str]:
    """The kernel's environment: the build tools blocked by scripts/no_build_tools/sitecustomize.py, the quick
    profile, one math thread; the rest (ANNOTATED_TRANSFORMER_DATA among it) passed through."""
    if not (NO_BUILD_TOOLS / "sitecustomize.py").is_file():
        pytest.fail(f"{NO_BUILD_TOOLS.relative_to(ROOT)}/sitecustomize.py is missing", pytrace=False)
    path = os.pathsep.join(filter(None, [str(NO_BUILD_TOOLS), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, AT_PROFILE="quick", OMP_NUM_THREADS="1")


# Over 30 s each in a CI run: `make test-everywhere` runs these (a step of the workflow), `make test` the others.
LONG = ["beam_search", "translation", "appendix_bench"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.everywhere) if name in LONG else name
                                  for name in RUN_ALL])
def test_a_chapters_notebook_runs_all_in_a_kernel_without_the_build_tools(name: str, kernel_env) -> None:
    import jupytext
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = ROOT / "book" / f"{name}.md"
    notebook = jupyter_notebook(jupytext.read(path), path, read_book(ROOT), None)
    notebook.cells.insert(1, nbformat.v4.new_code_cell(PROBE))  # after the install cell
    # Jupyter's "Run All" runs every cell: unlike nbclient's default, skip none (not even `skip-execution` ones).
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", skip_cells_with_tag="run-all-skips-none",
                            resources={"metadata": {"path": str(ROOT / "book")}})
    started = time.perf_counter()
    try:
        client.execute(env=kernel_env)
    except CellExecutionError as error:
        pytest.fail(f"{name}.ipynb fails under Run All without the build tools:\n{error}", pytrace=False)
    print(f"{name}: {time.perf_counter() - started:.1f} s")
    ran = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.get("execution_count") for cell in ran), "a cell did not run"
