"""Turn the book's chapters into plain Python scripts, or run them, without Jupyter.

A GPU machine often has PyTorch but no Jupyter. This script writes each chapter of `_toc.yml` as a Python script
(jupytext's `py:percent` format: every code cell, in order) into a folder, and can run such scripts one after
another, each in its own process, from `book/` (where the chapters read `results/` and write their figures), with
a time limit per chapter. Running a chapter as a script executes the same cells, so its `assert`s check the same
claims; only the rich display of outputs is lost. It needs jupytext only to write the scripts, not to run them:

    python scripts/chapter_scripts.py write .gpu/chapters          # here, where jupytext is installed
    AT_PROFILE=full python3 scripts/chapter_scripts.py run .gpu/chapters --timeout 600   # there

`run --without-build-tools` makes the notebook build tools (myst-nb, jupytext, nbformat, nbval, ...) unimportable
in the chapters' processes (scripts/no_build_tools/sitecustomize.py), to check here that a chapter needs only the
package and what it depends on; `--jobs N` runs N chapters at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUTURE = "from __future__ import annotations"
NO_BUILD_TOOLS = ROOT / "scripts" / "no_build_tools"  # its sitecustomize.py blocks the notebook build tools


def write(folder: Path, names: list[str]) -> list[Path]:
    """Write the chapters (all of `_toc.yml`'s, or those in ``names``) as scripts into ``folder``."""
    import jupytext
    import nbformat

    sys.path.insert(0, str(ROOT))
    from annotated_transformer.tangle import chapter_paths

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for index, path in enumerate(chapter_paths(ROOT)):
        if names and path.stem not in names:
            continue
        if not path.read_text(encoding="utf-8").startswith("---"):
            continue  # a page without code
        script = folder / f"{index:02d}_{path.stem}.py"
        notebook = jupytext.read(path)
        # a notebook compiles each cell on its own; a script may have __future__ imports only at its top
        future = False
        for cell in notebook.cells:
            if cell.cell_type == "code" and FUTURE in cell.source.splitlines():
                cell.source = "\n".join(line for line in cell.source.splitlines() if line != FUTURE)
                future = True
        if future:
            notebook.cells.insert(0, nbformat.v4.new_code_cell(FUTURE))
        jupytext.write(notebook, script, fmt="py:percent")
        written.append(script)
    if not written:
        raise SystemExit(f"no chapter matched {names}")
    return written


def chapter_env(without_build_tools: bool = False) -> dict[str, str]:
    """The environment of a chapter's process: the checkout first on the path, figures drawn off-screen, and
    with ``without_build_tools`` the notebook build tools unimportable."""
    first = [str(NO_BUILD_TOOLS)] if without_build_tools else []
    path = os.pathsep.join(filter(None, [*first, str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, MPLBACKEND=os.environ.get("MPLBACKEND", "Agg"), PYTHONPATH=path)


def run_one(script: Path, timeout: int, env: dict[str, str]) -> dict:
    """Run one chapter script from book/; its row: chapter, status ("passed" or why not), seconds, output tail."""
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(script.resolve())], cwd=ROOT / "book", env=env,
                              timeout=timeout, capture_output=True, text=True)
        code = done.returncode
        status = "passed" if code == 0 else f"killed by signal {-code}" if code < 0 else f"failed (exit {code})"
        tail = (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired as error:
        output = error.stdout or b""  # bytes here, even with text=True
        status = f"timed out after {timeout} s"
        tail = (output.decode(errors="replace") if isinstance(output, bytes) else output)[-3000:]
    return dict(chapter=script.stem.split("_", 1)[1], status=status,
                seconds=round(time.perf_counter() - started, 1), tail=tail)


def run(folder: Path, names: list[str], timeout: int, report: Path | None, jobs: int = 1,
        without_build_tools: bool = False) -> int:
    """Run the scripts in ``folder`` (all, or those whose chapter is in ``names``) from book/, ``jobs`` at a
    time; 1 if any failed."""
    scripts = sorted(folder.glob("*.py"))
    if names:
        scripts = [s for s in scripts if s.stem.split("_", 1)[1] in names]
    if not scripts:
        raise SystemExit(f"no chapter script in {folder} matches {names or 'anything'}")
    env = chapter_env(without_build_tools)
    meta = dict(profile=os.environ.get("AT_PROFILE", ""), device=os.environ.get("AT_DEVICE", ""),
                python=sys.version.split()[0], without_build_tools=without_build_tools)
    rows = []
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        running = [pool.submit(run_one, script, timeout, env) for script in scripts]
        for finished in as_completed(running):  # each as it ends, not behind a slow one
            row = finished.result()
            print(f"{row['chapter']:16s} {row['status']:24s} {row['seconds']:7.1f} s", flush=True)
            if row["status"] != "passed":
                print("    " + row["tail"].replace("\n", "\n    "), flush=True)
            rows.append({key: row[key] for key in ("chapter", "status", "seconds")})
            if report is not None:  # after each chapter: a run stopped from outside keeps these
                report.write_text(json.dumps(dict(meta=meta, chapters=rows), indent=1) + "\n",
                                  encoding="utf-8")
    return 0 if all(row["status"] == "passed" for row in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["write", "run"])
    parser.add_argument("folder", type=Path, help="where the chapter scripts are written, or read from")
    parser.add_argument("chapters", nargs="*", help="chapter names (e.g. attention training); default: all")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per chapter when running (default: 900)")
    parser.add_argument("--report", type=Path, help="also write a JSON report of the run here")
    parser.add_argument("--jobs", type=int, default=1, help="chapters run at a time (default: 1)")
    parser.add_argument("--without-build-tools", action="store_true",
                        help="make myst-nb, jupytext, nbformat, nbval, ... unimportable in the chapters")
    args = parser.parse_args(argv)
    if args.action == "write":
        for script in write(args.folder, args.chapters):
            print(script)
        return 0
    return run(args.folder, args.chapters, args.timeout, args.report, args.jobs, args.without_build_tools)


if __name__ == "__main__":
    sys.exit(main())
