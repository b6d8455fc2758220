"""`make test` runs each chapter once with the build tools: the book is built from the runs nbval checked.

`pytest --save-executed DIR` (conftest.py) writes each chapter whose cells all passed, with their outputs, to
`DIR/<chapter>.ipynb`; `scripts/execute_chapters.py --executed DIR` caches those for the book build and runs only
the chapters that are missing there, failed, or whose cells changed since.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_notebooks import FRONT

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = FRONT + """
# {title}

```{{code-cell}} ipython3
{code}
```
"""
CHAPTERS = {
    "one": "from annotated_transformer.runtime import glue\n\nprint('one ran')\nglue('answer', 42)",
    "two": "print('two ran')",
    "three": "assert 1 + 1 == 3, 'a failing check'",
}


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_the_book_build_takes_the_chapters_that_passed_under_nbval_and_runs_only_the_rest(tmp_path):
    pytest.importorskip("nbval")
    pytest.importorskip("jupyter_cache")
    import nbformat

    (tmp_path / "book").mkdir()
    for name, code in CHAPTERS.items():
        (tmp_path / "book" / f"{name}.md").write_text(CHAPTER.format(title=name, code=code), encoding="utf-8")
    (tmp_path / "_toc.yml").write_text("format: jb-book\nroot: book/one\nchapters:\n  - file: book/two\n"
                                       "  - file: book/three\n")
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    executed = tmp_path / "executed"

    tested = run(["-m", "pytest", "book", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
                  "--save-executed", str(executed)], cwd=tmp_path)
    assert "1 failed, 2 passed" in tested.stdout, tested.stdout[-3000:] + tested.stderr[-3000:]
    assert sorted(path.name for path in executed.iterdir()) == ["one.ipynb", "two.ipynb"]  # not the failed one
    [cell] = [cell for cell in nbformat.read(executed / "one.ipynb", 4).cells if cell.cell_type == "code"]
    assert cell.execution_count == 1
    assert [out.output_type for out in cell.outputs] == ["stream", "display_data"]
    assert cell.outputs[0].text == "one ran\n"
    assert cell.outputs[1].metadata["scrapbook"]["name"] == "answer"  # the glued value, for the page

    # chapter two changes after the test run: its saved run is stale, so the build runs it again
    two = tmp_path / "book" / "two.md"
    two.write_text(two.read_text(encoding="utf-8").replace("two ran", "two changed"), encoding="utf-8")
    built = run([str(ROOT / "scripts" / "execute_chapters.py"), "--root", str(tmp_path), "--executed",
                 str(executed)], cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "took 1 chapters as pytest executed them" in built.stdout, built.stdout
    assert "executed 1 chapters; failed: three.md" in built.stdout, built.stdout

    from jupyter_cache import get_cache

    cache = get_cache(tmp_path / "_build" / ".jupyter_cache")
    outputs = []
    for record in cache.list_cache_records():
        notebook = cache.get_cache_bundle(record.pk).nb
        [cell] = [cell for cell in notebook.cells if cell.cell_type == "code"]
        outputs.append((Path(record.uri).stem, cell.outputs[0].text))
    assert sorted(outputs) == [("one", "one ran\n"), ("two", "two changed\n")]  # the stale run is not kept
