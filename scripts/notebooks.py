"""The chapters as Jupyter notebooks, for the launch and download buttons of the built book.

The chapters are MyST Markdown (`book/*.md`); Colab opens only `.ipynb` files, and only from GitHub. This script
writes, from each chapter of `_toc.yml`:

- `write`: `book/<chapter>.ipynb` next to the chapter (git-ignored; the build's `exclude_patterns` leave it out of
  the site). Its presence makes the theme's Binder and Colab buttons point at the `.ipynb`; the book workflow
  publishes these files on the launch branch (`repository.branch` in `_config.yml`), which is main plus them.
- `downloads` (after `jupyter-book build`): the site's downloadable `.ipynb` (the executed chapter) gets the same
  first cell.

Either way the notebook starts with one install cell: where the package is missing (Colab, a bare Jupyter) it
clones the repository named in `_config.yml`, installs the package from it and moves into the clone's `book/`
folder, so that the chapter finds its neighbours as it does in the repository; where the package is installed it
does nothing. On a CPU the chapters then run in the quick profile (`AT_PROFILE=auto`).

    python scripts/notebooks.py write        # before the build
    python scripts/notebooks.py downloads    # after it
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from urllib.parse import urlsplit

import yaml

ROOT = Path(__file__).resolve().parent.parent
INSTALL_TAG = "install-package"

INSTALL_CELL = '''\
# Colab, or a Jupyter without the book's package: get the book and install its package. Does nothing otherwise.
import importlib, importlib.util, os, subprocess, sys
if importlib.util.find_spec("annotated_transformer") is None:
    if not os.path.isdir("{folder}"):
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", "{url}", "{folder}"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "./{folder}"], check=True)
    importlib.invalidate_caches()
if os.path.isdir("{folder}/book"):
    os.chdir("{folder}/book")  # the chapters read the files next to them'''


class RepositoryError(ValueError):
    """`_config.yml` names no usable GitHub repository."""


def repository(root: Path = ROOT) -> dict[str, str]:
    """The repository settings of `_config.yml`, and what derives from them.

    Returns ``url``, ``branch`` (the launch branch), ``owner``, ``name`` and ``pages`` (the GitHub Pages address
    of the published book).
    """
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))
    settings = config.get("repository") or {}
    url = str(settings.get("url", "")).rstrip("/")
    parts = urlsplit(url)
    path = [part for part in parts.path.split("/") if part]
    if parts.scheme != "https" or parts.netloc != "github.com" or len(path) != 2:
        raise RepositoryError(f"_config.yml: repository.url must be https://github.com/OWNER/NAME, got {url!r}")
    branch = str(settings.get("branch", "")).strip()
    if not branch:
        raise RepositoryError("_config.yml: repository.branch (the branch the launch buttons open) is missing")
    owner, name = path
    return {"url": url, "branch": branch, "owner": owner, "name": name,
            "pages": f"https://{owner.lower()}.github.io/{name}/"}


def install_cell(root: Path = ROOT):
    import nbformat

    repo = repository(root)
    source = INSTALL_CELL.format(url=repo["url"] + ".git", folder=repo["name"])
    return nbformat.v4.new_code_cell(source, metadata={"tags": [INSTALL_TAG]})


def with_install_cell(notebook, root: Path = ROOT):
    """`notebook` with the install cell first (once: an existing one is replaced)."""
    notebook.cells = [install_cell(root)] + [
        cell for cell in notebook.cells if INSTALL_TAG not in cell.get("metadata", {}).get("tags", [])
    ]
    return notebook


def chapters(root: Path) -> list[Path]:
    """The chapters of `_toc.yml` that are notebooks (front matter and code); the references page is not."""
    from annotated_transformer.tangle import chapter_paths

    return [path for path in chapter_paths(root) if path.read_text(encoding="utf-8").startswith("---")]


def write(root: Path) -> list[Path]:
    """Write `book/<chapter>.ipynb` for every chapter; return the paths."""
    import jupytext

    written = []
    for path in chapters(root):
        notebook = with_install_cell(jupytext.read(path), root)
        target = path.with_suffix(".ipynb")
        jupytext.write(notebook, target, fmt="ipynb")
        written.append(target)
    return written


def downloads(root: Path, site: Path) -> list[Path]:
    """Give the site's downloadable notebooks the install cell; return the paths."""
    import nbformat

    patched = []
    for path in chapters(root):
        target = site / "_sources" / path.relative_to(root).with_suffix(".ipynb")
        if not target.is_file():
            raise FileNotFoundError(f"{target} is missing: build the book first (are the launch buttons set?)")
        notebook = with_install_cell(nbformat.read(target, as_version=4), root)
        nbformat.write(notebook, target)
        patched.append(target)
    return patched


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["write", "downloads", "repository"])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--site", type=Path, default=None, help="the built site (default: ROOT/_build/html)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.step == "repository":
            for key, value in repository(root).items():
                print(f"{key}={value}")
            return 0
        done = write(root) if args.step == "write" else downloads(root, args.site or root / "_build" / "html")
    except (RepositoryError, FileNotFoundError, OSError) as error:
        print(f"notebooks: {error}", file=sys.stderr)
        return 1
    print(f"{args.step}: {len(done)} notebooks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
