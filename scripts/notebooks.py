"""The chapters as Jupyter notebooks, for the launch and download buttons of the built book.

The chapters are MyST Markdown (`book/*.md`); Colab opens only `.ipynb` files, and only from GitHub. This script
writes, from each chapter of `_toc.yml`:

- `write` (after `scripts/execute_chapters.py`, before `jupyter-book build`): `book/<chapter>.ipynb` next to the
  chapter (git-ignored; the build's `exclude_patterns` leave it out of the site). Its presence makes the theme's
  Binder and Colab buttons point at the `.ipynb`; the book workflow publishes these files on the launch branch
  (`repository.branch` in `_config.yml`), which is main plus them.
- `downloads` (after `jupyter-book build`): the same for the site's downloadable `.ipynb` (the executed chapter).

Either way the notebook starts with one install cell (`INSTALL_CELL`). Outside the book's own `book/` folder
(Colab, a notebook downloaded anywhere) it fetches the repository named in `_config.yml` at the commit the notebook
was built from and moves into its `book/` folder, so that the chapter finds its neighbours (records, data) as it
does in the repository, and runs against the code and records it was built with (a folder of that name fetched
for another notebook is moved to this one's commit); it installs the package with the `notebook` extra
(matplotlib) where the package is missing, matplotlib alone where only that is (an editable install stays), and
puts the book's own package first on the path (and on PYTHONPATH, for the commands a chapter runs), so that another
installed version never stands in for it. On a CPU
the chapters then run in the quick profile (`AT_PROFILE=auto`).

And the Markdown cells read well in Jupyter, which renders no MyST: glued numbers are the values of the executed
chapter in the build's jupyter-cache (a pointer to the cell that prints them where the chapter has not been
executed), citations are "Vaswani et al. (2017)" with the chapter's references in a last cell, cross-references
are links to the other notebooks, admonitions and solutions are a bold title and a blockquote, labels are anchors.

    python scripts/execute_chapters.py       # fills the jupyter-cache
    python scripts/notebooks.py write        # before the build
    python scripts/notebooks.py downloads    # after it
"""
from __future__ import annotations

import argparse
import copy
import functools
import posixpath
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

ROOT = Path(__file__).resolve().parent.parent
INSTALL_TAG = "install-package"

INSTALL_CELL = '''\
# Run this cell first. Outside the book's own book/ folder (Colab, a downloaded notebook) it fetches the book, at the
# commit this notebook was built from, and moves into its book/ folder; the chapter's code and records then match.
# It installs the package with what the chapters use (matplotlib) where either is missing, and puts the book's own
# package first on the path. Run again, it does nothing new.
import importlib, importlib.util, os, shutil, subprocess, sys
if not (os.path.isfile("../_toc.yml") and os.path.isdir("../annotated_transformer")):
    if shutil.which("git") is None:
        raise RuntimeError("this cell fetches the book with git, which is not installed here: install git")
    git = ["git", "-C", "{folder}"]
    if not os.path.isdir("{folder}/.git"):
        subprocess.run(["git", "init", "--quiet", "{folder}"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not head or "{commit}" not in ("", head):  # new, or fetched for another notebook
        for ref in filter(None, ("{commit}", "{branch}")):  # the commit; the launch branch if it is gone
            if subprocess.run(git + ["fetch", "--quiet", "--depth", "1", "{url}", ref]).returncode == 0:
                break
            print(f"could not fetch {{ref}} of the book")
        subprocess.run(git + ["checkout", "--quiet", "FETCH_HEAD"], check=True)
    os.chdir("{folder}/book")  # the chapters read the files next to them
if importlib.util.find_spec("annotated_transformer") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", os.path.abspath("..") + "[notebook]"],
                   check=True)
elif importlib.util.find_spec("matplotlib") is None:  # the package stays as installed (editable, say)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "matplotlib>=3.8"], check=True)
book = os.path.abspath("..")  # this book's package first, whatever else is installed
if sys.path[:1] != [book]:
    sys.path.insert(0, book)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [book, os.environ.get("PYTHONPATH")]))
importlib.invalidate_caches()'''


class RepositoryError(ValueError):
    """`_config.yml` names no usable GitHub repository."""


PLACEHOLDER_OWNER = "OWNER"  # of the example address in comments and messages, never a real one


def repository(root: Path = ROOT) -> dict[str, str] | None:
    """The repository settings of `_config.yml`, and what derives from them; None while `repository.url` is empty
    (no repository publishes the book yet).

    Returns ``url``, ``branch`` (the launch branch), ``owner``, ``name`` and ``pages`` (the GitHub Pages address
    of the published book).
    """
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))
    settings = config.get("repository") or {}
    url = str(settings.get("url") or "").strip().rstrip("/")
    if not url:
        return None
    parts = urlsplit(url)
    path = [part for part in parts.path.split("/") if part]
    if parts.scheme != "https" or parts.netloc != "github.com" or len(path) != 2:
        raise RepositoryError(f"_config.yml: repository.url must be https://github.com/OWNER/NAME, got {url!r}")
    if path[0] == PLACEHOLDER_OWNER:
        raise RepositoryError(f"_config.yml: repository.url is a placeholder ({url}): name your repository, or "
                              "leave it empty")
    branch = str(settings.get("branch", "")).strip()
    if not branch:
        raise RepositoryError("_config.yml: repository.branch (the branch the launch buttons open) is missing")
    owner, name = path
    return {"url": url, "branch": branch, "owner": owner, "name": name,
            "pages": f"https://{owner.lower()}.github.io/{name}/"}


NO_REPOSITORY = ("note: _config.yml names no repository (repository.url is empty), so the book is built without "
                 "launch (Binder, Colab) and repository buttons and its notebooks without the install cell; set "
                 "repository.url to https://github.com/OWNER/NAME to turn them on (the book workflow does it for "
                 "the repository it runs in)")
# the keys of `_config.yml` that point at the repository, and the switches of the theme's buttons that use them
REPOSITORY_SWITCHES = ("use_repository_button", "use_issues_button", "use_edit_page_button")


def build_config(root: Path = ROOT) -> dict:
    """The configuration the build uses: `_config.yml`, less everything that points at the repository when none
    is set."""
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))
    sphinx = config.get("sphinx") or {}
    if sphinx.get("local_extensions"):  # folders, which the build finds from the config file's own folder
        sphinx["local_extensions"] = {name: str((root / folder).resolve())
                                      for name, folder in sphinx["local_extensions"].items()}
    if repository(root) is None:
        config.pop("repository", None)
        config.pop("launch_buttons", None)
        config["html"] = {**(config.get("html") or {}), **{switch: False for switch in REPOSITORY_SWITCHES}}
    return config


def write_build_config(root: Path = ROOT) -> Path:
    """Write `build_config` next to `_config.yml` as `_build/_config.yml`, saying once what is left out."""
    if repository(root) is None:
        print(NO_REPOSITORY, file=sys.stderr)
    target = root / "_build" / "_config.yml"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("# Written by scripts/notebooks.py config from _config.yml: edit that one.\n"
                      + yaml.safe_dump(build_config(root), sort_keys=False, allow_unicode=True), encoding="utf-8")
    return target


def set_repository(root: Path, url: str) -> bool:
    """Write ``url`` as `repository.url` of `_config.yml` if it names none (the book workflow, for the repository
    it runs in); True if it was written."""
    if repository(root) is not None:
        return False
    config_file = root / "_config.yml"
    text = config_file.read_text(encoding="utf-8")
    new, count = re.subn(r'(?m)^(repository:\n(?:[ \t]*#.*\n)*[ \t]+url:)[^\n]*$', rf'\1 "{url}"', text)
    if count != 1:
        raise RepositoryError("_config.yml: no `url:` line right under `repository:` to write the address in")
    config_file.write_text(new, encoding="utf-8")
    if repository(root) is None:  # validates the address too
        raise RepositoryError(f"_config.yml: could not set repository.url to {url!r}")
    return True


@functools.cache
def built_commit(root: Path = ROOT) -> str:
    """The commit the book is built from ("" outside a git checkout): the install cell fetches the book at it."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def install_cell(root: Path = ROOT):
    """The first cell of a notebook, which gets the package where it is missing; None without a repository."""
    import nbformat

    repo = repository(root)
    if repo is None:
        return None
    source = INSTALL_CELL.format(url=repo["url"] + ".git", folder=repo["name"], commit=built_commit(root),
                                 branch=repo["branch"])
    return nbformat.v4.new_code_cell(source, metadata={"tags": [INSTALL_TAG]})


def with_install_cell(notebook, root: Path = ROOT):
    """`notebook` with the install cell first (once: an existing one is replaced), if a repository is set."""
    cell = install_cell(root)
    notebook.cells = ([cell] if cell is not None else []) + [
        cell for cell in notebook.cells if INSTALL_TAG not in cell.get("metadata", {}).get("tags", [])
    ]
    return notebook


def chapters(root: Path) -> list[Path]:
    """The chapters of `_toc.yml` that are notebooks (front matter and code); the references page is not."""
    from annotated_transformer.tangle import chapter_paths

    return [path for path in chapter_paths(root) if path.read_text(encoding="utf-8").startswith("---")]


# ----------------------------------------------------------------------------------------------------------------
# MyST Markdown to the Markdown that Jupyter renders
#
# Jupyter (JupyterLab, Colab, the classic notebook) renders CommonMark with math, and nothing of MyST: its roles
# ({glue:text}`name`, {cite}`key`, {ref}`label`, {doc}`chapter`), directives (```{admonition} ...```), and labels
# (`(name)=`). markdown-it-py with myst-parser's plugins finds them (so that code spans and code blocks are left
# alone); the mapping below writes each as plain Markdown: glued numbers as the values the page shows (taken from
# the executed chapter in the build's jupyter-cache), citations as "Vaswani et al. (2017)" with a list of references
# at the end (pybtex reads book/references.bib), cross-references as links to the other notebooks, admonitions as a
# bold title and their body.

MYST_EXTENSIONS = {"dollarmath", "amsmath", "colon_fence", "deflist", "substitution"}
REFERENCES_TAG = "references"
ADMONITIONS = {"admonition", "note", "warning", "tip", "hint", "important", "caution", "attention", "danger",
               "error", "seealso", "dropdown", "topic", "sidebar", "margin", "card", "epigraph", "pull-quote"}
TITLED = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)  # "text <target>" in a role
ROLE = re.compile(r"\{(?P<name>[a-zA-Z][\w:+-]*)\}`(?P<content>[^`]*)`")
OPTION = re.compile(r"^:(?P<key>[\w-]+):\s*(?P<value>.*)$")
GLUE_CALL = re.compile(r"""\bglue\(\s*f?["'](?P<name>[^"'{]+)["']""")


@functools.lru_cache(maxsize=None)
def markdown_parser():
    """markdown-it with the MyST syntax the book enables (`_config.yml`: parse: myst_enable_extensions)."""
    from markdown_it.renderer import RendererHTML
    from myst_parser.config.main import MdParserConfig
    from myst_parser.parsers.mdit import create_md_parser

    return create_md_parser(MdParserConfig(enable_extensions=MYST_EXTENSIONS), RendererHTML)


@dataclass
class Book:
    """What converting one chapter needs to know about the others."""

    root: Path
    titles: dict[str, str] = field(default_factory=dict)  # "book/attention" -> "Attention"
    labels: dict[str, tuple[str, str]] = field(default_factory=dict)  # label -> (document, its heading)
    notebooks: set[str] = field(default_factory=set)  # the documents written as notebooks
    bibliography: object = None  # pybtex's BibliographyData, or None without a .bib


def read_book(root: Path = ROOT) -> Book:
    """The titles and labels of every page of `_toc.yml`, and the bibliography of `_config.yml`."""
    from annotated_transformer.tangle import chapter_paths

    book = Book(root)
    parser = markdown_parser()
    notebooks = set(chapters(root))
    for path in chapter_paths(root):
        document = path.relative_to(root).with_suffix("").as_posix()
        if path in notebooks:
            book.notebooks.add(document)
        tokens = parser.parse(path.read_text(encoding="utf-8"))
        for index, token in enumerate(tokens):
            heading = index + 2 < len(tokens) and tokens[index + 1].type == "heading_open"
            if token.type == "heading_open" and token.tag == "h1" and document not in book.titles:
                book.titles[document] = tokens[index + 1].content
            elif token.type == "myst_target":
                book.labels[token.content] = (document, tokens[index + 2].content if heading else token.content)
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))
    bibfiles = [root / name for name in config.get("bibtex_bibfiles") or []]
    if bibfiles:
        from pybtex.database import BibliographyData, parse_file

        book.bibliography = BibliographyData()
        for bibfile in bibfiles:
            book.bibliography.add_entries(parse_file(bibfile).entries.items())
    return book


def glue_values(notebook, root: Path = ROOT) -> dict[str, dict] | None:
    """The glued values of the executed ``notebook``, by name, from the build's jupyter-cache (None if absent).

    myst-nb's ``glue(name, value, display=False)`` leaves a display_data output whose metadata has
    ``scrapbook: {name, mime_prefix}`` and whose MIME types carry that prefix.
    """
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))
    cache_dir = root / str((config.get("execute") or {}).get("cache") or "_build/.jupyter_cache")
    if not (cache_dir / "global.db").is_file():
        return None
    from jupyter_cache import get_cache

    notebook = copy.deepcopy(notebook)  # without what this script adds, for the cache matches the chapter's cells
    notebook.cells = [cell for cell in notebook.cells
                      if not {INSTALL_TAG, REFERENCES_TAG} & set(cell.get("metadata", {}).get("tags", []))]
    try:
        _, executed = get_cache(cache_dir).merge_match_into_notebook(notebook)
    except KeyError:  # the chapter changed since, or failed to execute
        return None
    values = {}
    for cell in executed.cells:
        for output in cell.get("outputs", []):
            scrapbook = output.get("metadata", {}).get("scrapbook")
            if scrapbook:
                prefix = len(scrapbook.get("mime_prefix", ""))
                values[scrapbook["name"]] = {mime[prefix:]: data for mime, data in output.get("data", {}).items()}
    return values


@dataclass
class Chapter:
    """One chapter being converted: where it is, its glued values, and what it cites."""

    book: Book
    document: str  # "book/attention"
    values: dict[str, dict] | None = None  # glued values; None: not executed, point at the cells instead
    glued_in: dict[str, int] = field(default_factory=dict)  # glue name -> index of the cell that glues it
    cell: int = 0  # the index of the cell being converted
    cited: list[str] = field(default_factory=list)

    def href(self, document: str, anchor: str = "") -> str:
        """A link from this chapter's notebook to ``document`` (a notebook if it is one), at ``anchor``."""
        if document == self.document:
            return f"#{anchor}" if anchor else "#"
        relative = posixpath.relpath(document, posixpath.dirname(self.document))
        suffix = ".ipynb" if document in self.book.notebooks else ".md"
        return relative + suffix + (f"#{anchor}" if anchor else "")


def glue_text(chapter: Chapter, key: str, fmt: str = "") -> str:
    """{glue:text}`key:fmt` as the page shows it, or a pointer to the cell that prints it (``name = value``)."""
    from myst_nb.core.variables import format_plain_text  # the page's own formatting: quotes off, then fmt

    if "::" in key:  # another document's value: {glue:text}`other::key`; not used, shown as a pointer
        key = key.split("::", 1)[1]
    data = (chapter.values or {}).get(key)
    if data is not None and "text/plain" in data:
        try:
            return format_plain_text(data["text/plain"], fmt)
        except ValueError:
            return format_plain_text(data["text/plain"], "")
    where = chapter.glued_in.get(key)
    place = "when the chapter runs" if where is None else "below" if where > chapter.cell else "above"
    return f"`{key}` (printed {place})"


def cite_text(chapter: Chapter, role: str, keys: str) -> str:
    """{cite}`key1,key2` as "(Vaswani et al., 2017; ...)", {cite:t} as "Vaswani et al. (2017)"."""
    variant = role.partition(":")[2] or "p"
    parts = []
    for key in (key.strip() for key in keys.split(",")):
        entry = chapter.book.bibliography.entries.get(key) if chapter.book.bibliography else None
        if entry is None:
            parts.append((key, ""))
            continue
        if key not in chapter.cited:
            chapter.cited.append(key)
        parts.append((authors(entry), entry.fields.get("year", "")))
    if variant.startswith("t"):
        return ", ".join(f"{who} ({year})" if year else who for who, year in parts)
    if variant.startswith("author"):
        return ", ".join(who for who, _ in parts)
    if variant.startswith("year"):
        return ", ".join(year for _, year in parts)
    text = "; ".join(f"{who}, {year}" if year else who for who, year in parts)
    return text if variant.startswith("al") else f"({text})"


def authors(entry) -> str:
    """"Vaswani et al.", "Press and Wolf" or "Knuth", as sphinxcontrib-bibtex's author_year style writes them."""
    from pybtex.backends.plaintext import Backend
    from pybtex.richtext import Text

    text = Backend()  # render_as("text") would look the backend up among the entry points each time: slow
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    names = [Text.from_latex(" ".join(person.prelast_names + person.last_names)).render(text)
             for person in people]
    if not names:
        return Text.from_latex(entry.fields.get("title", entry.key)).render(text)
    return names[0] if len(names) == 1 else " and ".join(names) if len(names) == 2 else f"{names[0]} et al."


def role_text(chapter: Chapter, name: str, content: str) -> str:
    """A MyST role as Markdown."""
    titled = TITLED.match(content)
    title, target = (titled["title"], titled["target"]) if titled else (None, content)
    if name in ("glue", "glue:", "glue:any", "glue:text", "glue:md"):
        key, _, fmt = content.rpartition(":") if name == "glue:text" and ":" in content.replace("::", "") \
            else (content, "", "")
        return glue_text(chapter, key, fmt)
    if name == "cite" or name.startswith("cite:"):
        return cite_text(chapter, name, content)
    if name == "doc":
        base = posixpath.dirname(chapter.document)
        document = posixpath.normpath(target.lstrip("/") if target.startswith("/") else posixpath.join(base, target))
        document = document.removesuffix(".md").removesuffix(".ipynb")
        return f"[{title or chapter.book.titles.get(document, target)}]({chapter.href(document)})"
    if name in ("ref", "numref"):
        document, heading = chapter.book.labels.get(target, (None, target))
        text = (title or heading).replace("{number}", "").replace("%s", "").strip()
        return f"[{text}]({chapter.href(document, target)})" if document else text
    if name == "eq":
        return f"({target})"
    if name == "math":
        return f"${content}$"
    if name in ("sub", "sup"):
        return f"<{name}>{content}</{name}>"
    if name in ("code", "literal", "kbd", "file", "samp", "command", "py:func", "py:class", "func", "class",
                "mod", "meth", "attr", "data", "obj", "module"):
        return f"`{title or target}`"
    if name == "download":
        return f"[{title or target}]({target})"
    return title or target  # {term}, {abbr}, and anything else: its text


def directive_markdown(chapter: Chapter, name: str, argument: str, body: str) -> list[str]:
    """A MyST directive (```{name} argument ...``` or :::{name}) as Markdown lines."""
    lines = body.splitlines()
    options: dict[str, str] = {}
    if lines and lines[0].strip() == "---":  # options as a YAML block
        end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), 0)
        options = yaml.safe_load("\n".join(lines[1:end])) or {} if end else {}
        lines = lines[end + 1:]
    else:
        while lines and OPTION.match(lines[0]):
            option = OPTION.match(lines[0])
            options[option["key"]] = option["value"]
            lines = lines[1:]
    content = convert_markdown(chapter, "\n".join(lines).strip("\n")).splitlines()
    if name in ADMONITIONS:
        title = argument or name.replace("seealso", "see also").capitalize()
        if name != "admonition" and argument and name not in ("dropdown", "topic", "card"):
            title = f"{name.capitalize()}: {argument}"
        head = [f"**{convert_markdown(chapter, title)}**", ""]
        if any(line.lstrip().startswith(("$$", "\\begin")) for line in content):
            return head + content  # Jupyter finds display math before Markdown: no "> " inside it
        return ["> " + line if line else ">" for line in head + content]
    if name == "math":
        return ["$$", *content, "$$"]
    if name in ("code", "code-block", "sourcecode"):
        return [f"```{argument}", *lines, "```"]
    if name in ("figure", "image"):
        alt = options.get("alt") or (content[0] if content else "")
        return [f"![{alt}]({argument})"] + (["", f"*{' '.join(content)}*"] if name == "figure" and content else [])
    if name == "bibliography":
        return references_markdown(chapter, all_entries=True)
    if name.startswith("glue"):
        return [glue_text(chapter, argument)]
    if name in ("toctree", "tableofcontents", "contents"):
        return []
    return ([f"**{argument}**", ""] if argument else []) + content


def references_markdown(chapter: Chapter, all_entries: bool = False) -> list[str]:
    """The works the chapter cites (or all of them), formatted by pybtex's plain style, as a Markdown list."""
    from pybtex.backends.markdown import Backend
    from pybtex.style.formatting.plain import Style

    bibliography = chapter.book.bibliography
    if bibliography is None:
        return []
    keys = list(bibliography.entries) if all_entries else chapter.cited
    formatted = Style().format_bibliography(bibliography, citations=keys)
    markdown = Backend()
    return ["- " + entry.text.render(markdown).replace("\n", " ") for entry in formatted.entries]


def convert_markdown(chapter: Chapter, text: str) -> str:
    """MyST Markdown ``text`` as the Markdown that Jupyter renders."""
    lines = text.splitlines()
    tokens = markdown_parser().parse(text)
    edits: dict[int, tuple[int, list[str]]] = {}  # first line -> (end line, replacement)
    roles: dict[tuple[int, int], list[tuple[str, str]]] = {}  # line range -> the roles in it, in order

    for index, token in enumerate(tokens):
        if token.map is None:
            continue
        start, end = token.map
        if any(first <= start < stop for first, (stop, _) in edits.items()):
            continue  # inside a directive already converted
        if token.type in ("fence", "colon_fence") and token.info.strip().startswith("{"):
            name, _, argument = token.info.strip()[1:].partition("}")
            opener = lines[start]
            prefix = opener[: len(opener) - len(opener.lstrip(" >"))]
            converted = directive_markdown(chapter, name.strip(), argument.strip(), token.content)
            edits[start] = (end, [prefix + line if line else prefix.rstrip() for line in converted])
        elif token.type == "myst_target":
            nxt = tokens[index + 1] if index + 1 < len(tokens) else None
            blank = [""] if nxt is not None and nxt.map and nxt.map[0] == end else []
            edits[start] = (end, [f'<a id="{token.content}"></a>', *blank])
        elif token.type in ("myst_line_comment", "myst_block_break"):
            edits[start] = (end, [])
        elif token.type == "inline":
            found = [(child.meta.get("name", ""), " ".join(child.content.split()))
                     for child in token.children or [] if child.type == "myst_role"]
            if found:
                roles.setdefault((start, end), []).extend(found)

    for (start, end), found in roles.items():
        if any(first <= start < stop for first, (stop, _) in edits.items()):
            continue
        source, pieces, position = "\n".join(lines[start:end]), [], 0
        while found and (match := ROLE.search(source, position)):
            content = " ".join(match["content"].split())  # markdown-it joins a role's lines
            if found[0] == (match["name"], content):
                found.pop(0)
                pieces += [source[position:match.start()], role_text(chapter, match["name"], content)]
                position = match.end()
            else:  # not a role (in a code span, say): look again from the next character
                pieces.append(source[position:match.start() + 1])
                position = match.start() + 1
        edits[start] = (end, "".join([*pieces, source[position:]]).split("\n"))

    out, line = [], 0
    for start in sorted(edits):
        end, replacement = edits[start]
        out += lines[line:start] + replacement
        line = end
    out += lines[line:]
    return "\n".join(out)


def myst_leftovers(text: str) -> list[str]:
    """The MyST syntax in ``text`` that Jupyter would show raw: roles, directives, labels, comments, breaks."""
    found = []
    for token in markdown_parser().parse(text):
        if token.type in ("myst_target", "myst_line_comment", "myst_block_break"):
            found.append(f"{token.type}: {token.content}")
        elif token.type in ("fence", "colon_fence") and token.info.strip().startswith("{"):
            found.append(f"directive: {token.info}")
        found += [f"role: {{{child.meta.get('name')}}}`{child.content}`" for child in token.children or []
                  if child.type == "myst_role"]
    return found


def jupyter_notebook(notebook, path: Path, book: Book, values: dict[str, dict] | None):
    """``notebook`` (the chapter at ``path``, executed or not) with Jupyter Markdown, references and install cell."""
    import nbformat

    chapter = Chapter(book, path.relative_to(book.root).with_suffix("").as_posix(), values)
    cells = [cell for cell in notebook.cells if REFERENCES_TAG not in cell.get("metadata", {}).get("tags", [])]
    for index, cell in enumerate(cells):
        if cell.cell_type == "code":
            for match in GLUE_CALL.finditer(cell.source):
                chapter.glued_in.setdefault(match["name"], index)
    for index, cell in enumerate(cells):
        if cell.cell_type == "markdown":
            chapter.cell = index
            cell.source = convert_markdown(chapter, cell.source)
    if chapter.cited:
        cells.append(nbformat.v4.new_markdown_cell(
            "\n".join(["## References", "", *references_markdown(chapter)]), metadata={"tags": [REFERENCES_TAG]}))
    notebook.cells = cells
    return with_install_cell(notebook, book.root)


def write(root: Path) -> list[Path]:
    """Write `book/<chapter>.ipynb` for every chapter; return the paths."""
    import jupytext

    book = read_book(root)
    written = []
    for path in chapters(root):
        notebook = jupytext.read(path)
        notebook = jupyter_notebook(notebook, path, book, executed_values(notebook, path, root))
        target = path.with_suffix(".ipynb")
        jupytext.write(notebook, target, fmt="ipynb")
        written.append(target)
    return written


def downloads(root: Path, site: Path) -> list[Path]:
    """Give the site's downloadable notebooks Jupyter Markdown and the install cell; return the paths."""
    import nbformat

    book = read_book(root)
    patched = []
    for path in chapters(root):
        target = site / "_sources" / path.relative_to(root).with_suffix(".ipynb")
        if not target.is_file():
            raise FileNotFoundError(f"{target} is missing: build the book first (are the launch buttons set?)")
        notebook = nbformat.read(target, as_version=4)  # the chapter as it was built, even if edited since
        notebook = jupyter_notebook(notebook, path, book, executed_values(notebook, path, root))
        nbformat.write(notebook, target)
        patched.append(target)
    return patched


def executed_values(notebook, path: Path, root: Path) -> dict[str, dict] | None:
    """`glue_values`, saying on stderr when a chapter that glues has no executed copy in the cache."""
    values = glue_values(notebook, root)
    if values is None and "{glue" in path.read_text(encoding="utf-8"):
        print(f"notebooks: {path.relative_to(root)} has no executed copy in the jupyter-cache (run "
              "scripts/execute_chapters.py first): its glued numbers point at the cells that print them",
              file=sys.stderr)
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["config", "write", "downloads", "repository", "set-repository"])
    parser.add_argument("url", nargs="?", help="set-repository: the address to write where _config.yml has none")
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--site", type=Path, default=None, help="the built site (default: ROOT/_build/html)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.step == "repository":
            for key, value in (repository(root) or {}).items():
                print(f"{key}={value}")
            return 0
        if args.step == "config":
            print(f"config: {write_build_config(root).relative_to(root)}")
            return 0
        if args.step == "set-repository":
            if not args.url:
                parser.error("set-repository needs the address, https://github.com/OWNER/NAME")
            written = set_repository(root, args.url)
            print(f"repository.url: {repository(root)['url']}{'' if written else ' (already set)'}")
            return 0
        done = write(root) if args.step == "write" else downloads(root, args.site or root / "_build" / "html")
    except (RepositoryError, FileNotFoundError, OSError) as error:
        print(f"notebooks: {error}", file=sys.stderr)
        return 1
    print(f"{args.step}: {len(done)} notebooks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
