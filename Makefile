# The two commands of the README: `make book` and `make test`. Each sets itself up on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
export PATH := $(abspath $(VENV))/bin:$(PATH)
export PYTHONUNBUFFERED := 1
# No MPLBACKEND here: a Jupyter kernel shows figures only with its own inline backend, which an exported
# MPLBACKEND (such as Agg) replaces, and then the book's pages have no figures. Outside Jupyter, on a machine without
# a display, matplotlib picks Agg by itself.
# Chapters and tests run JOBS at a time; one math thread each keeps them from fighting over the cores.
export OMP_NUM_THREADS ?= 1

.PHONY: all setup lab book html test test-everywhere unit chapters site tangle check data bench clean

all: test

# A virtual environment with the locked versions and the package (editable). Redone only when the lock or
# pyproject.toml change.
$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

setup: $(STAMP)

# JupyterLab with jupytext in the same environment (requirements-lab.lock), set to open the chapters' Markdown as
# notebooks; `make lab` opens the book's first chapter (LAB_ARGS="--no-browser --port 8890", say, adds options).
LAB_STAMP := $(VENV)/.lab-installed
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings
$(LAB_STAMP): $(STAMP) requirements-lab.lock scripts/jupyterlab_overrides.json
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-lab.lock
	mkdir -p $(LAB_SETTINGS)
	cp scripts/jupyterlab_overrides.json $(LAB_SETTINGS)/overrides.json
	touch $@

# Jupyter refuses to run as root without --allow-root (a container, a cloud machine): pass it only there.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
lab: $(LAB_STAMP)
	$(VENV)/bin/jupyter lab $(ALLOW_ROOT) $(LAB_ARGS) book/intro.md

tangle: $(STAMP)
	$(PY) -m annotated_transformer.tangle

check: $(STAMP)
	$(PY) -m annotated_transformer.tangle --check

# Every chapter executed (JOBS at a time, into a fresh cache), warnings are errors, a failing cell fails the build.
# The chapters are also written as notebooks (book/*.ipynb, git-ignored) for the launch and download buttons, after
# the execution: their text shows the numbers that the executed chapters glued (scripts/notebooks.py). The build
# reads _config.yml through scripts/notebooks.py config, which leaves out the buttons that need a repository until
# one is named.
# EXECUTED: a folder of chapters as pytest --save-executed ran them, taken instead of running them again
html: $(STAMP)
	$(PY) scripts/execute_chapters.py $(if $(EXECUTED),--executed $(EXECUTED))
	$(PY) scripts/notebooks.py config
	$(PY) scripts/notebooks.py write
	AT_BOOK_BUILD=1 $(VENV)/bin/jupyter-book build . --config _build/_config.yml --all -W -n --keep-going
	$(PY) scripts/notebooks.py downloads

book: check html
	@echo "The book is in _build/html/index.html"

# The Multi30k files, each checked by its SHA-256: in the folder named by ANNOTATED_TRANSFORMER_DATA, else in the
# cache (~/.cache/annotated_transformer), downloaded there if missing. The tests that read them run only where they
# are: AT_REQUIRE_DATA=1 makes a missing file a failure of `make test`, never a silent skip.
data: $(STAMP)
	$(PY) -c "from annotated_transformer.download import MULTI30K_FILES, fetch; [fetch(n) for n in MULTI30K_FILES]"

unit: $(STAMP) data
	AT_REQUIRE_DATA=1 $(PY) -m pytest tests -n $(JOBS) -m "not site"

chapters: $(STAMP)
	$(PY) -m pytest book -n $(JOBS) --dist loadfile --nbval-lax --nbval-current-env

site: $(STAMP)
	AT_REQUIRE_SITE=1 $(PY) -m pytest tests -m site

# Unit tests and every chapter through nbval in one pytest run, the tangle check, the book build from the chapters
# as that run executed them (none runs twice with the build tools), the site check.
test: check data
	rm -rf _build/executed
	AT_REQUIRE_DATA=1 $(PY) -m pytest tests book -n $(JOBS) --dist loadfile --nbval-lax --nbval-current-env \
		-m "not site and not everywhere" --save-executed _build/executed
	$(MAKE) --no-print-directory html EXECUTED=_build/executed
	$(MAKE) --no-print-directory site

# The long chapters that `make test` runs with the build tools only, again without them (as scripts or notebooks).
test-everywhere: check data
	AT_REQUIRE_DATA=1 $(PY) -m pytest tests -n $(JOBS) -m everywhere

bench: $(STAMP)
	$(PY) -m annotated_transformer bench

clean:
	rm -rf _build
