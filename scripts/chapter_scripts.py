"""Turn the book's chapters into plain Python scripts, or run them, without Jupyter.

A GPU machine often has PyTorch but no Jupyter. This script writes each chapter of `_toc.yml` as a Python script
(jupytext's `py:percent` format: every code cell, in order) into a folder, and can run such scripts one after
another, each in its own process, from `book/` (where the chapters read `results/` and write their figures), with
a time limit per chapter. Running a chapter as a script executes the same cells, so its `assert`s check the same
claims; only the rich display of outputs is lost. It needs jupytext only to write the scripts, not to run them:

    python scripts/chapter_scripts.py write .gpu/chapters          # here, where jupytext is installed
    AT_PROFILE=full python3 scripts/chapter_scripts.py run .gpu/chapters --timeout 600   # there
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUTURE = "from __future__ import annotations"


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


def run(folder: Path, names: list[str], timeout: int, report: Path | None) -> int:
    """Run the scripts in ``folder`` (all, or those whose chapter is in ``names``) from book/; 1 if any failed."""
    scripts = sorted(folder.glob("*.py"))
    if names:
        scripts = [s for s in scripts if s.stem.split("_", 1)[1] in names]
    if not scripts:
        raise SystemExit(f"no chapter script in {folder} matches {names or 'anything'}")
    env = dict(os.environ, MPLBACKEND=os.environ.get("MPLBACKEND", "Agg"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    rows = []
    for script in scripts:
        chapter = script.stem.split("_", 1)[1]
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
        seconds = time.perf_counter() - started
        rows.append(dict(chapter=chapter, status=status, seconds=round(seconds, 1)))
        print(f"{chapter:16s} {status:24s} {seconds:7.1f} s", flush=True)
        if status != "passed":
            print("    " + tail.replace("\n", "\n    "), flush=True)
    if report is not None:
        meta = dict(profile=os.environ.get("AT_PROFILE", ""), device=os.environ.get("AT_DEVICE", ""),
                    python=sys.version.split()[0])
        report.write_text(json.dumps(dict(meta=meta, chapters=rows), indent=1) + "\n", encoding="utf-8")
    return 0 if all(row["status"] == "passed" for row in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["write", "run"])
    parser.add_argument("folder", type=Path, help="where the chapter scripts are written, or read from")
    parser.add_argument("chapters", nargs="*", help="chapter names (e.g. attention training); default: all")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per chapter when running (default: 900)")
    parser.add_argument("--report", type=Path, help="also write a JSON report of the run here")
    args = parser.parse_args(argv)
    if args.action == "write":
        for script in write(args.folder, args.chapters):
            print(script)
        return 0
    return run(args.folder, args.chapters, args.timeout, args.report)


if __name__ == "__main__":
    sys.exit(main())
