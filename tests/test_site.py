"""The built book in a browser: math is typeset offline and every figure loads.

The tests marked ``site`` check the HTML that ``make html`` writes to ``_build/html``. Without a build they are
skipped (or fail, when ``AT_REQUIRE_SITE=1`` is set, as ``make site`` does). The browser checks need headless
Chromium and are skipped without it.

How the browser check works: a small HTTP server on the loopback interface serves the site together with a harness
page. Chromium opens the harness, which loads each chapter in turn in a same-origin ``<iframe>``, waits for MathJax
to finish and for the images to load, and posts what it found back to the server. Chromium may reach only the
loopback address, so a page that needs a CDN for its math fails here as it would for an offline reader.

The tests without the ``site`` mark run the same harness on a tiny synthetic site, to show that it catches a missing
image, a corrupt image, a page that takes MathJax from a CDN (so its math is never typeset), a TeX error and an
undefined macro. They need Chromium, but no book build.
"""
from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from annotated_transformer.tangle import chapter_paths

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_build" / "html"
NO_CHROMIUM = "headless Chromium is not installed; apt-get install chromium"

HARNESS_PATH = "/__site_check__/harness.html"
RESULT_PATH = "/__site_check__/result"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--mute-audio",
    "--window-size=1280,2000",
    "--enable-logging=stderr",  # console messages (a harness error, say) go to the log
    # Offline: every host name fails to resolve, so only the loopback server can be reached.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]
TIMEOUT_S = 120  # wall-clock limit for one Chromium run over all pages


# ----------------------------------------------------------------------------------------------------------------
# Reading the built HTML (no browser)


@dataclass
class PageScan:
    images: list[str] = field(default_factory=list)
    scripts: list[str] = field(default_factory=list)  # src of <script> and href of <link>
    links: list[str] = field(default_factory=list)  # href of <a>
    ids: set[str] = field(default_factory=set)  # the page's anchors: every id, and <a name>


class _Scanner(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.scan = PageScan()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if attributes.get(key):
                self.scan.ids.add(attributes[key])
        if tag == "a" and attributes.get("href"):
            self.scan.links.append(attributes["href"])
        if tag == "img" and attributes.get("src") is not None:
            self.scan.images.append(attributes["src"])
        elif tag == "script" and attributes.get("src"):
            self.scan.scripts.append(attributes["src"])
        elif tag == "link" and attributes.get("href"):
            self.scan.scripts.append(attributes["href"])


def scan_page(path: Path) -> PageScan:
    scanner = _Scanner()
    scanner.feed(path.read_text(encoding="utf-8"))
    scanner.close()
    return scanner.scan


def is_remote(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.scheme and parts.scheme not in ("file", "data")) or bool(parts.netloc)


def local_file(site: Path, page: str, url: str) -> Path:
    """The file a relative or site-absolute URL of `page` points to."""
    path = unquote(urlsplit(url).path)
    base = site if path.startswith("/") else (site / page).parent
    return (base / path.lstrip("/")).resolve()


def static_problems(site: Path, page: str) -> list[str]:
    """What is wrong with one built page, read as a file: missing images, MathJax from a CDN."""
    scan = scan_page(site / page)
    problems = []
    for src in scan.images:
        if src.startswith("data:"):
            continue
        if is_remote(src):
            problems.append(f"{page}: <img src={src!r}> is not part of the book (it needs the network)")
            continue
        target = local_file(site, page, src)
        if not target.is_relative_to(site.resolve()):
            problems.append(f"{page}: <img src={src!r}> points outside the site")
        elif not target.is_file():
            problems.append(f"{page}: <img src={src!r}> points to a file that does not exist")
    for src in scan.scripts:
        if "mathjax" not in src.lower():
            continue
        if is_remote(src):
            problems.append(f"{page}: MathJax comes from {src}, not from the book's own copy: it fails offline")
        elif not local_file(site, page, src).is_file():
            problems.append(f"{page}: MathJax script {src!r} does not exist")
    return problems


# The example address of `_config.yml`'s comments; a link to it (or to its Pages site) is a dead link.
PLACEHOLDER_LINK = re.compile(r"github\.com/OWNER/|//owner\.github\.io/", re.IGNORECASE)


def link_problems(site: Path, page: str, anchors) -> list[str]:
    """Dead links of one built page: to a file of the site that does not exist, to an anchor that its page does not
    have, or to the placeholder repository. ``anchors(path)`` gives the ids of a page of the site."""
    problems = []
    for href in scan_page(site / page).links:
        if PLACEHOLDER_LINK.search(href):
            problems.append(f"{page}: a link to the placeholder repository: {href}")
            continue
        parts = urlsplit(href)
        if is_remote(href) or parts.scheme in ("mailto", "javascript"):
            continue
        target = local_file(site, page, href) if parts.path else (site / page).resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.is_relative_to(site.resolve()) or not target.is_file():
            problems.append(f"{page}: a link to {href}, which is not a file of the site")
        elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in anchors(target):
            problems.append(f"{page}: a link to {href}, whose page has no anchor {parts.fragment!r}")
    return problems


def site_pages(site: Path) -> list[str]:
    """Every HTML page of the site but the theme's own files (under `_static/` and the like)."""
    return sorted(path.relative_to(site).as_posix() for path in site.rglob("*.html")
                  if not path.relative_to(site).parts[0].startswith("_"))


def check_links(site: Path) -> list[str]:
    anchors = functools.lru_cache(maxsize=None)(lambda path: frozenset(scan_page(path).ids))
    return [problem for page in site_pages(site) for problem in link_problems(site, page, anchors)]


# Inline math as dollarmath reads it: no space after the opening $, none before the closing $.
DOLLAR_MATH = re.compile(r"\$\$.+?\$\$|(?<![\\$])\$(?![\s$])[^$\n]*?(?<![\s\\])\$(?!\d)", re.DOTALL)
CODE_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


def source_has_math(chapter: Path) -> bool:
    """Whether a chapter's Markdown has `$...$` or `$$...$$` outside code, in which case its page must show math."""
    import jupytext  # only the site checks need it: the CUDA tests run where the notebook tools are missing

    text = []
    for cell in jupytext.read(chapter).cells:
        if cell.cell_type != "markdown":
            continue
        fence = None
        for line in cell.source.splitlines():
            match = CODE_FENCE.match(line.strip())
            if fence is None and match:
                info = match.group(2).strip()
                # Directives such as {admonition} hold Markdown; code blocks do not.
                if not info.startswith("{") or info.startswith(("{code", "{literalinclude")):
                    fence = match.group(1)
                continue
            if fence is not None:
                if line.strip().startswith(fence):
                    fence = None
                continue
            text.append(re.sub(r"`[^`]*`", "", line))
    return bool(DOLLAR_MATH.search("\n".join(text)))


# ----------------------------------------------------------------------------------------------------------------
# The browser harness

HARNESS = """<!doctype html>
<html><head><meta charset="utf-8"><title>site check</title></head>
<body>
<pre id="progress">running</pre>
<script>
const PAGES = __PAGES__;
const LOAD_MS = 30000, MATHJAX_MS = 30000, IMAGES_MS = 15000, CHART_MS = 15000;
const sleep = ms => new Promise(resolve => setTimeout(resolve, ms));
const limit = (promise, ms, what) => Promise.race([
  promise, sleep(ms).then(() => { throw new Error(what + " did not finish within " + ms + " ms"); })]);
const post = data => fetch("__RESULT__", {method: "POST", body: JSON.stringify(data)});

async function inspect(page) {
  const result = {};
  const frame = document.createElement("iframe");
  frame.style.width = "1280px";
  frame.style.height = "2000px";
  const loaded = new Promise(resolve => frame.addEventListener("load", resolve, {once: true}));
  frame.src = "/" + page;
  document.body.appendChild(frame);
  try {
    await limit(loaded, LOAD_MS, "loading the page");
    const win = frame.contentWindow, doc = frame.contentDocument;
    result.title = doc.title;
    result.mathjax_scripts = Array.from(doc.querySelectorAll("script[src]"))
      .map(script => script.getAttribute("src")).filter(src => /mathjax/i.test(src));
    for (const img of doc.images) img.loading = "eager";
    // Deferred scripts have run by the load event: a MathJax without `startup` never loaded.
    const mathjax = win.MathJax;
    if (mathjax && mathjax.startup && mathjax.startup.promise) {
      try {
        await limit(mathjax.startup.promise, MATHJAX_MS, "MathJax");
        result.mathjax = "typeset";
      } catch (error) {
        result.mathjax = "failed: " + error;
      }
    } else {
      result.mathjax = result.mathjax_scripts.length ? "did not load" : "absent";
    }
    const images = Array.from(doc.images);
    const start = Date.now();
    while (images.some(img => !img.complete) && Date.now() - start < IMAGES_MS) await sleep(50);
    result.images = images.map(img => ({src: img.getAttribute("src"), complete: img.complete,
                                        width: img.naturalWidth}));
    const math = Array.from(doc.querySelectorAll(".math"));
    result.math_elements = math.length;
    result.containers = doc.querySelectorAll("mjx-container").length;
    result.untypeset = math.filter(element => !element.querySelector("mjx-container"))
      .map(element => element.textContent.trim().slice(0, 80));
    result.tex_errors = Array.from(doc.querySelectorAll("mjx-merror"))
      .map(element => element.getAttribute("data-mjx-error") || element.textContent.slice(0, 80));
    // MathJax shows an undefined macro as its name in red instead of failing.
    result.undefined_macros = Array.from(doc.querySelectorAll('mjx-assistive-mml mtext[mathcolor="red"]'))
      .map(element => element.textContent).filter(text => text.startsWith("\\\\"));
    // The launch (Binder, Colab) and download (.ipynb, .md) buttons in the page's header, and whether each
    // download link loads.
    result.buttons = [];
    for (const a of doc.querySelectorAll(".dropdown-launch-buttons a, .dropdown-download-buttons a")) {
      const button = {text: a.textContent.trim(), href: a.getAttribute("href")};
      if (a.closest(".dropdown-download-buttons") && !button.href.startsWith("javascript")) {
        try {
          const response = await fetch(new URL(button.href, doc.baseURI));
          button.status = response.status;
        } catch (error) {
          button.status = String(error);
        }
      }
      result.buttons.push(button);
    }
    // Interactive charts (vega-embed, drawn as SVG): the marks they draw, their menus, and whether choosing
    // another entry of the last menu redraws them.
    result.charts = [];
    for (const chart of doc.querySelectorAll(".vega-embed")) {
      const marks = () => Array.from(chart.querySelectorAll(".mark-rect path"))
        .map(path => path.getAttribute("fill")).join(",");
      let start = Date.now();
      while (!marks() && Date.now() - start < CHART_MS) await sleep(50);
      const menus = Array.from(chart.querySelectorAll(".vega-bindings select"));
      const found = {marks: chart.querySelectorAll(".mark-rect path").length, menus: menus.length,
                     reacts: false};
      const menu = menus[menus.length - 1], before = marks();
      if (menu && menu.options.length > 1) {
        menu.selectedIndex = (menu.selectedIndex + 1) % menu.options.length;
        menu.dispatchEvent(new Event("change", {bubbles: true}));
        menu.dispatchEvent(new Event("input", {bubbles: true}));
        start = Date.now();
        while (marks() === before && Date.now() - start < CHART_MS) await sleep(50);
        found.reacts = marks() !== before;
      }
      result.charts.push(found);
    }
  } catch (error) {
    result.error = String(error);
  }
  frame.remove();
  return result;
}

(async () => {
  for (const page of PAGES) {
    document.getElementById("progress").textContent = "checking " + page;
    await post({page: page, result: await inspect(page)});
  }
  document.getElementById("progress").textContent = "done";
  await post({done: true});
})();
</script>
</body></html>
"""


class _Handler(SimpleHTTPRequestHandler):
    """Serves the site, the harness page, and receives the harness's results."""

    def do_GET(self) -> None:
        if urlsplit(self.path).path == HARNESS_PATH:
            body = self.server.harness.encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            super().do_GET()

    def do_POST(self) -> None:
        if urlsplit(self.path).path != RESULT_PATH:
            self.send_error(404)
            return
        data = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.server.receive(data)
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args) -> None:  # keep the test output quiet
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, directory: Path, harness: str) -> None:
        super().__init__(("127.0.0.1", 0), functools.partial(_Handler, directory=str(directory)))
        self.harness = harness
        self.results: dict[str, dict] = {}
        self.done = threading.Event()

    def receive(self, data: dict) -> None:
        if "page" in data:
            self.results[data["page"]] = data["result"]
        if data.get("done"):
            self.done.set()


@contextlib.contextmanager
def serve(directory: Path, harness: str):
    """An HTTP server on 127.0.0.1 (a free port) for the duration of the `with` block."""
    server = _Server(directory, harness)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def find_chromium() -> str | None:
    """Chromium, or the browser named by $AT_CHROMIUM (GitHub's runners have Google Chrome)."""
    named = os.environ.get("AT_CHROMIUM")
    if named:
        return shutil.which(named)
    return shutil.which("chromium") or shutil.which("chromium-browser")


def stop(process: subprocess.Popen) -> None:
    """Stop Chromium and the processes it started (it runs in a process group of its own)."""
    if process.poll() is not None:
        return

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if hasattr(os, "killpg"):
                os.killpg(process.pid, sig)
            else:
                process.kill()

    send(signal.SIGTERM)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        send(getattr(signal, "SIGKILL", signal.SIGTERM))
        process.wait(timeout=5)


def check_in_browser(site: Path, pages: list[str], chromium: str, scratch: Path) -> dict[str, dict]:
    """Load every page of `site` in headless Chromium; return what the harness found, page by page."""
    harness = HARNESS.replace("__PAGES__", json.dumps(pages)).replace("__RESULT__", RESULT_PATH)
    log = scratch / "chromium.log"
    with serve(site, harness) as server:
        url = f"http://127.0.0.1:{server.server_port}{HARNESS_PATH}"
        command = [
            chromium, *CHROMIUM_FLAGS, f"--user-data-dir={scratch / 'profile'}",
            # Virtual time runs the harness's timers without real waiting; Chromium quits when it runs out.
            f"--virtual-time-budget={60_000 + 60_000 * len(pages)}", "--dump-dom", url,
        ]
        with open(log, "wb") as stderr:
            process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
            )
            try:
                deadline = time.monotonic() + TIMEOUT_S
                while not server.done.wait(0.1):
                    if process.poll() is not None or time.monotonic() > deadline:
                        break
            finally:
                stop(process)
                shutil.rmtree(scratch / "profile", ignore_errors=True)
        results = dict(server.results)
        finished = server.done.is_set()
    if not finished:
        unchecked = [page for page in pages if page not in results]
        # Chromium logs harmless D-Bus errors on machines without a session bus; leave them out.
        lines = [line for line in log.read_text(errors="replace").splitlines() if "dbus" not in line.lower()]
        tail = "\n".join(lines[-20:])
        raise AssertionError(
            f"the browser check did not finish (exit status {process.returncode}); not checked: {unchecked}\n"
            f"Chromium's log ends with:\n{tail}"
        )
    return results


def browser_problems(page: str, result: dict, expects_math: bool = False) -> list[str]:
    """What the harness's findings for one page say is wrong."""
    if "error" in result:
        return [f"{page}: {result['error']}"]
    problems = []
    for image in result["images"]:
        if not image["complete"] or image["width"] == 0:
            problems.append(f"{page}: the image {image['src']!r} does not load in the browser")
    if expects_math and not result["math_elements"]:
        problems.append(
            f"{page}: its chapter has $...$ math but the page has none "
            "(is the build older than the chapter? is dollarmath switched off?)"
        )
    elif result["math_elements"]:
        if not result["mathjax_scripts"]:
            problems.append(f"{page}: the page has math but loads no MathJax")
        elif result["mathjax"] != "typeset":
            problems.append(f"{page}: MathJax {result['mathjax']} ({', '.join(result['mathjax_scripts'])})")
        if result["containers"] == 0:
            problems.append(f"{page}: no math was typeset (no mjx-container elements)")
        if result["untypeset"]:
            problems.append(
                f"{page}: {len(result['untypeset'])} formulas were not typeset, first: {result['untypeset'][0]!r}"
            )
        for error in result["tex_errors"]:
            problems.append(f"{page}: MathJax reports a TeX error: {error}")
        for macro in result["undefined_macros"]:
            problems.append(f"{page}: MathJax does not know the macro {macro} (it shows it in red)")
    return problems


# ----------------------------------------------------------------------------------------------------------------
# The built book (`make html`)


def chapter_pages() -> list[str]:
    """The HTML page of every chapter in `_toc.yml`, relative to the site."""
    return [path.relative_to(ROOT).with_suffix(".html").as_posix() for path in chapter_paths(ROOT)]


PAGES = chapter_pages()


@pytest.fixture(scope="module")
def site() -> Path:
    if not (SITE / "index.html").is_file():
        message = f"no built book: {SITE.relative_to(ROOT)}/index.html is missing (run `make html` first)"
        if os.environ.get("AT_REQUIRE_SITE") == "1":
            pytest.fail(message + "; AT_REQUIRE_SITE=1 requires it", pytrace=False)
        pytest.skip(message)
    return SITE


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip(NO_CHROMIUM)
    return path


@pytest.fixture(scope="module")
def browser_results(site: Path, chromium: str, tmp_path_factory) -> dict[str, dict]:
    pages = [page for page in PAGES if (site / page).is_file()]
    return check_in_browser(site, pages, chromium, tmp_path_factory.mktemp("chromium"))


@pytest.mark.site
def test_every_chapter_has_a_page(site: Path) -> None:
    missing = [page for page in PAGES if not (site / page).is_file()]
    assert missing == [], f"chapters in _toc.yml without a built page: {missing}"


@pytest.mark.site
def test_pages_use_local_files_only(site: Path) -> None:
    """Every <img src> is a file of the site, and MathJax comes from the site, never from a CDN."""
    pages = sorted(
        path.relative_to(site).as_posix() for path in site.rglob("*.html")
        if not path.relative_to(site).parts[0].startswith("_")
    )
    problems = [problem for page in pages for problem in static_problems(site, page)]
    assert problems == [], "\n".join(problems)


@pytest.mark.site
def test_no_dead_links_within_the_site(site: Path) -> None:
    """Every link of every page leads to a file of the site (and to an anchor that its page has); none leads to
    the placeholder repository."""
    problems = check_links(site)
    assert problems == [], f"{len(problems)} dead links:\n" + "\n".join(problems[:50])


@pytest.mark.site
def test_links_to_other_sites_answer(site: Path) -> None:
    """The links to other sites, followed: only where AT_CHECK_EXTERNAL_LINKS=1 (the weekly scheduled run), since
    they fail for reasons of their own and need the network."""
    if os.environ.get("AT_CHECK_EXTERNAL_LINKS") != "1":
        pytest.skip("external links are followed only with AT_CHECK_EXTERNAL_LINKS=1 (the scheduled run)")
    import urllib.error
    import urllib.request

    urls = sorted({href.split("#")[0] for page in site_pages(site) for href in scan_page(site / page).links
                   if urlsplit(href).scheme in ("http", "https")})
    problems = []
    for url in urls:
        request = urllib.request.Request(url, headers={"User-Agent": "Mozilla/5.0 (link check)"})
        try:
            with urllib.request.urlopen(request, timeout=30):
                pass
        except urllib.error.HTTPError as error:
            if error.code not in (401, 403, 429):  # sites that refuse robots are not dead
                problems.append(f"{url}: HTTP {error.code}")
        except (urllib.error.URLError, TimeoutError, OSError) as error:
            problems.append(f"{url}: {error}")
    assert problems == [], f"{len(problems)} of {len(urls)} external links fail:\n" + "\n".join(problems)


@pytest.mark.site
def test_the_attention_explorer_draws_and_reacts(site: Path, browser_results: dict[str, dict]) -> None:
    """The translation chapter's attention explorer, offline in Chromium: drawn (with its four menus), and redrawn
    when another head is chosen."""
    page = "book/translation.html"
    result = browser_results.get(page, {})
    assert "error" not in result, result.get("error")
    charts = result.get("charts", [])
    assert len(charts) == 1, f"{page}: {len(charts)} interactive charts, expected the attention explorer"
    [chart] = charts
    assert chart["marks"] > 0, f"{page}: the explorer draws nothing (does its JavaScript load offline?)"
    assert chart["menus"] == 4 and chart["reacts"], f"{page}: the explorer does not react to its menus: {chart}"


@pytest.mark.site
@pytest.mark.parametrize("page", PAGES)
def test_figures_are_on_the_page(page: str, site: Path) -> None:
    """A chapter that draws figures (plt.show()) has images on its page: an exported MPLBACKEND such as Agg would
    silently replace the kernel's inline backend, and the book would build without a single figure."""
    source = (ROOT / Path(page).with_suffix(".md")).read_text(encoding="utf-8")
    shows = source.count("plt.show()")
    if not shows:
        pytest.skip(f"{page} draws no figures")
    if not (site / page).is_file():
        pytest.fail(f"{page} was not built", pytrace=False)
    images = (site / page).read_text(encoding="utf-8").count("<img")
    assert images >= 1, f"{page}: its chapter calls plt.show() {shows} times, but the page has no image"


@pytest.mark.site
@pytest.mark.parametrize("page", PAGES)
def test_page_in_browser(page: str, site: Path, browser_results: dict[str, dict]) -> None:
    """In Chromium, offline: every formula is typeset by the site's own MathJax and every image loads."""
    if not (site / page).is_file():
        pytest.fail(f"{page} was not built", pytrace=False)
    expects_math = source_has_math(ROOT / Path(page).with_suffix(".md"))
    problems = browser_problems(page, browser_results[page], expects_math)
    assert problems == [], "\n".join(problems)


def is_notebook(page: str) -> bool:
    """Whether a page's chapter is a notebook (has code); the references page, say, is not."""
    from scripts.notebooks import chapters

    return ROOT / Path(page).with_suffix(".md") in chapters(ROOT)


def expected_buttons(page: str) -> dict[str, str]:
    """The launch and download links a chapter's page must have, derived from `_config.yml`'s repository."""
    from scripts.notebooks import repository

    repo = repository(ROOT)
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    launch = config["launch_buttons"]
    chapter = Path(page).with_suffix("").as_posix()           # book/attention
    up = "../" * (len(Path(page).parts) - 1)
    downloads = {".ipynb": f"{up}_sources/{chapter}.ipynb", ".md": f"{up}_sources/{chapter}.md"}
    if repo is None:  # no repository named: no launch buttons (button_problems checks that there are none)
        return downloads
    return {
        "Binder": f"{launch['binderhub_url']}/v2/gh/{repo['owner']}/{repo['name']}/{repo['branch']}"
                            f"?urlpath=lab/tree/{chapter}.ipynb",
        "Colab": f"{launch['colab_url']}/github/{repo['owner']}/{repo['name']}/blob/{repo['branch']}/"
                           f"{chapter}.ipynb",
        **downloads,
    }


def button_problems(page: str, result: dict) -> list[str]:
    """What is wrong with the launch and download buttons the harness found on one page."""
    if "error" in result:
        return [f"{page}: {result['error']}"]
    found = {button["text"]: button for button in result["buttons"]}
    expected = expected_buttons(page)
    problems = [f"{page}: a {text!r} button, although _config.yml names no repository"
                for text in ("Binder", "Colab") if text in found and text not in expected]
    for text, href in expected.items():
        button = found.get(text)
        if button is None:
            problems.append(f"{page}: no {text!r} button")
        elif button["href"] != href:
            problems.append(f"{page}: the {text!r} button points at {button['href']!r}, expected {href!r}")
        elif text.startswith(".") and button.get("status") != 200:
            problems.append(f"{page}: the {text!r} download ({href}) does not load: {button.get('status')}")
    return problems


@pytest.mark.site
@pytest.mark.parametrize("page", PAGES)
def test_launch_and_download_buttons(page: str, site: Path, browser_results: dict[str, dict]) -> None:
    """Every chapter opens on Binder and Colab (its own notebook) and downloads as .ipynb and .md."""
    if not is_notebook(page):
        pytest.skip(f"{page} is not a notebook")
    if not (site / page).is_file():
        pytest.fail(f"{page} was not built", pytrace=False)
    problems = button_problems(page, browser_results[page])
    assert problems == [], "\n".join(problems)


@pytest.mark.site
@pytest.mark.parametrize("page", PAGES)
def test_notebooks_start_with_the_install_cell(page: str, site: Path) -> None:
    """The notebook Colab opens and the downloadable one: the chapter's cells, after one install cell where a
    repository is named (none without), with Markdown
    that Jupyter renders (no MyST left) and the glued numbers of the executed chapter in it (no pointers)."""
    if not is_notebook(page):
        pytest.skip(f"{page} is not a notebook")
    import jupytext
    import nbformat

    from scripts.notebooks import INSTALL_TAG, myst_leftovers, repository

    chapter = ROOT / Path(page).with_suffix(".md")
    code = [cell.source for cell in jupytext.read(chapter).cells if cell.cell_type == "code"]
    install = repository(ROOT) is not None  # without a repository there is nothing to clone
    for path in (chapter.with_suffix(".ipynb"), site / "_sources" / Path(page).with_suffix(".ipynb")):
        if not path.is_file():
            pytest.fail(f"{path.relative_to(ROOT)} is missing (make html writes it)", pytrace=False)
        cells = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
        tagged = [cell for cell in cells if INSTALL_TAG in cell.metadata.get("tags", [])]
        assert tagged == cells[:install], f"{path}: the install cell is not (only) the first cell"
        assert [cell.source for cell in cells[install:]] == code, f"{path}: its cells are not the chapter's"
        markdown = "\n\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells
                                if cell.cell_type == "markdown")
        assert myst_leftovers(markdown) == [], f"{path}: MyST that Jupyter shows raw"
        pointers = re.findall(r"`[^`]+` \(printed (?:below|above|when the chapter runs)\)", markdown)
        assert pointers == [], f"{path}: glued numbers missing (was the chapter executed first?): {pointers}"


# ----------------------------------------------------------------------------------------------------------------
# The harness itself, on a tiny synthetic site (no book build needed)

PNG = base64.b64decode(  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
PAGE = """<!doctype html>
<!-- What Sphinx writes for a page with math: a MathJax configuration, the script, and math in class "math". -->
<html><head><meta charset="utf-8"><title>{title}</title>
<script>
window.MathJax = {{"options": {{"processHtmlClass": "tex2jax_process|mathjax_process|math|output_area"}}}}
</script>
<script defer="defer" src="{mathjax}"></script></head>
<body><section class="tex2jax_ignore mathjax_ignore">
<p>Inline <span class="math notranslate nohighlight">\\({inline}\\)</span> and display</p>
<div class="math notranslate nohighlight">\\[\\mathrm{{softmax}}(QK^\\top / \\sqrt{{d_k}}) V\\]</div>
{images}
</section></body></html>
"""


def mathjax_copy() -> Path | None:
    """The MathJax that the book's sphinx-mathjax-offline extension copies into `_static/mathjax`."""
    try:
        distribution = metadata.distribution("sphinx-mathjax-offline")
    except metadata.PackageNotFoundError:
        return None
    path = Path(distribution.locate_file("sphinx-mathjax-offline/static/mathjax"))
    return path if (path / "tex-chtml.js").is_file() else None


@pytest.fixture(scope="module")
def synthetic_site(tmp_path_factory) -> Path:
    mathjax = mathjax_copy()
    if mathjax is None:
        pytest.skip("sphinx-mathjax-offline (which ships MathJax) is not installed")
    site = tmp_path_factory.mktemp("site")
    (site / "_static").mkdir()
    (site / "_static" / "mathjax").symlink_to(mathjax, target_is_directory=True)
    (site / "_images").mkdir()
    (site / "_images" / "good.png").write_bytes(PNG)
    (site / "_images" / "corrupt.png").write_bytes(b"not a PNG at all")
    (site / "book").mkdir()
    local = "../_static/mathjax/tex-chtml.js"
    pages = {
        "good": dict(mathjax=local, inline="a^2 + b^2", images='<img alt="ok" src="../_images/good.png" />'),
        "broken_image": dict(mathjax=local, inline="x", images='<img alt="gone" src="../_images/missing.png" />'),
        "corrupt_image": dict(mathjax=local, inline="x", images='<img alt="bad" src="../_images/corrupt.png" />'),
        "tex_error": dict(mathjax=local, inline="\\frac{1}", images=""),
        "undefined_macro": dict(mathjax=local, inline="\\softmax(x) + \\color{red}{y}", images=""),
        "cdn_mathjax": dict(mathjax="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js", inline="x", images=""),
        "no_mathjax": dict(mathjax="../_static/other.js", inline="x", images=""),
    }
    (site / "_static" / "other.js").write_text("// not MathJax\n")
    for name, fields in pages.items():
        (site / "book" / f"{name}.html").write_text(PAGE.format(title=name, **fields), encoding="utf-8")
    return site


@pytest.fixture(scope="module")
def synthetic_results(synthetic_site: Path, chromium: str, tmp_path_factory) -> dict[str, dict]:
    pages = sorted(path.relative_to(synthetic_site).as_posix() for path in synthetic_site.glob("book/*.html"))
    return check_in_browser(synthetic_site, pages, chromium, tmp_path_factory.mktemp("chromium"))


def test_harness_passes_a_good_page(synthetic_site: Path, synthetic_results: dict[str, dict]) -> None:
    result = synthetic_results["book/good.html"]
    assert browser_problems("book/good.html", result) == []
    assert result["mathjax"] == "typeset" and result["containers"] == 2 and result["math_elements"] == 2
    assert result["images"] == [{"src": "../_images/good.png", "complete": True, "width": 1}]
    assert static_problems(synthetic_site, "book/good.html") == []


@pytest.mark.parametrize(
    "page, expected",
    [
        ("broken_image", "the image '../_images/missing.png' does not load"),
        ("corrupt_image", "the image '../_images/corrupt.png' does not load"),
        ("tex_error", "MathJax reports a TeX error: Missing argument for \\frac"),
        ("undefined_macro", "MathJax does not know the macro \\softmax"),
        ("cdn_mathjax", "MathJax did not load (https://cdn.jsdelivr.net/"),
        ("no_mathjax", "the page has math but loads no MathJax"),
    ],
)
def test_harness_catches(page: str, expected: str, synthetic_results: dict[str, dict]) -> None:
    name = f"book/{page}.html"
    problems = browser_problems(name, synthetic_results[name])
    assert any(expected in problem for problem in problems), problems


def test_harness_names_only_undefined_macros(synthetic_results: dict[str, dict]) -> None:
    # \color{red} also makes red math, but it is not an undefined macro.
    assert synthetic_results["book/undefined_macro.html"]["undefined_macros"] == ["\\softmax"]


def test_harness_catches_untypeset_math(synthetic_results: dict[str, dict]) -> None:
    problems = browser_problems("book/cdn_mathjax.html", synthetic_results["book/cdn_mathjax.html"])
    assert any("no math was typeset" in problem for problem in problems), problems
    assert any("2 formulas were not typeset" in problem for problem in problems), problems


def test_static_check_catches_missing_images_and_cdn_mathjax(synthetic_site: Path) -> None:
    assert static_problems(synthetic_site, "book/broken_image.html") == [
        "book/broken_image.html: <img src='../_images/missing.png'> points to a file that does not exist"
    ]
    assert static_problems(synthetic_site, "book/corrupt_image.html") == []  # only the browser sees this one
    [problem] = static_problems(synthetic_site, "book/cdn_mathjax.html")
    assert "MathJax comes from https://cdn.jsdelivr.net/" in problem


def test_link_check_catches_dead_and_placeholder_links(tmp_path: Path) -> None:
    """The link check on a two-page site: a good link, a link to a missing page, to an anchor its page lacks, and
    to the placeholder repository; links to other sites are not followed here."""
    (tmp_path / "book").mkdir()
    (tmp_path / "index.html").write_text('<p id="top">home</p>', encoding="utf-8")
    (tmp_path / "book" / "a.html").write_text(
        '<h1 id="title">A</h1><a href="../index.html#top">good</a> <a href="#title">good</a> '
        '<a href="../">good</a> <a href="b.html">missing page</a> <a href="../index.html#nowhere">missing anchor</a> '
        '<a href="https://github.com/OWNER/annotated-transformer-book">placeholder</a> '
        '<a href="https://example.org/x">elsewhere</a> <a href="mailto:a@b.c">mail</a>', encoding="utf-8")
    assert check_links(tmp_path) == [
        "book/a.html: a link to b.html, which is not a file of the site",
        "book/a.html: a link to ../index.html#nowhere, whose page has no anchor 'nowhere'",
        "book/a.html: a link to the placeholder repository: https://github.com/OWNER/annotated-transformer-book",
    ]


def test_source_math_detection(tmp_path: Path) -> None:
    chapter = tmp_path / "chapter.md"
    header = "---\njupytext:\n  text_representation:\n    format_name: myst\n---\n\n"

    def has_math(body: str) -> bool:
        chapter.write_text(header + body, encoding="utf-8")
        return source_has_math(chapter)

    assert has_math("The scale $1/\\sqrt{d_k}$ matters.\n")
    assert has_math("$$\nQK^\\top\n$$\n")
    assert not has_math("No math, only `$x$` in code and prices like $5 and $10.\n")
    assert not has_math("```bash\necho $HOME $PATH\n```\n")
    assert has_math("```{admonition} Note\nThe sum $a + b$.\n```\n")
