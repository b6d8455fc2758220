"""Execute the book's chapters in parallel into a fresh jupyter-cache, before `jupyter-book build`.

Jupyter Book 1 runs notebooks one at a time. With `execute_notebooks: cache`, it takes each chapter's outputs
from the cache named in `_config.yml` when the chapter's source matches. This script empties that cache and fills
it by running every chapter of `_toc.yml` with jupyter-cache's parallel executor, one kernel per core. The cache
keys on cell sources only, so it must never outlive a build: `make html` always runs this script first. A chapter
that fails here is not cached, and the book build then runs it again and reports the error.

`--executed DIR` first caches the executed chapters that `pytest --save-executed DIR` wrote (every cell passed
under nbval; `make test` does this), where a chapter's cells are still those of its source, and runs only the
others: the book then shows the outputs of the runs its tests checked, and no chapter runs twice with the tools.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from jupyter_cache import get_cache
from jupyter_cache.executors import load_executor

from notebooks import chapters  # scripts/notebooks.py: the chapters that are notebooks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd())
    parser.add_argument("--cache", type=Path, default=Path("_build/.jupyter_cache"))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--executed", type=Path, default=None, metavar="DIR",
                        help="cache the chapters executed in DIR (pytest --save-executed) instead of running them")
    args = parser.parse_args(argv)
    os.environ["AT_BOOK_BUILD"] = "1"  # the chapters glue their numbers into the page (the runtime's glue)
    root = args.root.resolve()
    cache_path = (root / args.cache).resolve()
    shutil.rmtree(cache_path, ignore_errors=True)
    cache = get_cache(cache_path)
    taken = {}
    for path in chapters(root):
        cache.add_nb_to_project(str(path), read_data={"name": "jupytext", "type": "plugin"})
        executed = args.executed / f"{path.stem}.ipynb" if args.executed else None
        if executed is not None and executed.is_file():
            taken[str(path)] = cache.cache_notebook_file(str(executed), uri=str(path)).pk
    for record in cache.list_unexecuted():  # a chapter whose cells changed since that run: run it
        if record.uri in taken:
            cache.remove_cache(taken.pop(record.uri))
    if args.executed:
        print(f"took {len(taken)} chapters as pytest executed them ({args.executed})")
    executor = load_executor("local-parallel", cache)
    result = executor.run_and_cache(timeout=args.timeout)
    failed = [Path(uri).name for uri in [*result.excepted, *result.errored]]
    print(f"executed {len(result.succeeded)} chapters; failed: {', '.join(failed) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
