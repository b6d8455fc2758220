"""A Sphinx extension of the book's build: every chapter's page offers its executed notebook for download.

The theme (sphinx-book-theme) copies a page's executed notebook to `_sources/` and adds the `.ipynb` download
button only where launch buttons are configured, and the build leaves those out while `_config.yml` names no
repository (scripts/notebooks.py config). This does the copy itself, before the theme builds its buttons, so the
download is there either way. `_config.yml` loads it (`sphinx.local_extensions`).
"""
from __future__ import annotations

import shutil
from pathlib import Path


def add_notebook_download(app, pagename, templatename, context, doctree) -> None:
    if context.get("ipynb_source") or not str(context.get("sourcename", "")).endswith((".md", ".md.txt")):
        return
    executed = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    if not executed.is_file():  # not a notebook (the references page)
        return
    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(executed, target)
    context["ipynb_source"] = f"{pagename}.ipynb"


def setup(app):
    # before the theme's launch and header buttons (priority 501), which read `ipynb_source`
    app.connect("html-page-context", add_notebook_download, priority=500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
