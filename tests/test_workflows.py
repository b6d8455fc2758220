"""The GitHub workflows, the repository's address and the notebooks that the launch buttons open.

- Both workflows pass actionlint (with shellcheck on their scripts), offline, so a broken workflow fails here.
- Their commands are the README's: the test workflow runs `make test`, the book workflow `make book`.
- The repository's address is written once, in `_config.yml`; the README's link to the published book derives
  from it, and no other file names it.
- The install cell that starts every generated notebook really installs the package where it is missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import yaml

from scripts.notebooks import (INSTALL_CELL, REPOSITORY_SWITCHES, RepositoryError, build_config, built_commit,
                               repository, set_repository, with_install_cell, write_build_config)

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"


def actionlint() -> str:
    path = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which("actionlint")
    if path is None:
        pytest.fail("actionlint is not installed: it comes with the test dependencies (make setup)", pytrace=False)
    return path


def test_the_workflows_pass_actionlint():
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert [path.name for path in files] == ["book.yml", "release.yml", "test.yml"]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run([actionlint(), "-verbose", *map(str, files)], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # shellcheck must be found, or actionlint silently skips the scripts in `run:` steps.
    assert 'Rule "shellcheck" was disabled' not in done.stderr, done.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    broken = tmp_path / ".github" / "workflows" / "broken.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(
        "on: push\njobs:\n  test:\n    runs-on: ubuntu-24.04\n    steps:\n"
        "      - uses: actions/checkout@v4\n      - run: echo ${{ matrix.missing }}\n"
    )
    done = subprocess.run([actionlint(), str(broken)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "matrix" in done.stdout


def steps(workflow: str) -> list[dict]:
    jobs = yaml.safe_load((WORKFLOWS / workflow).read_text(encoding="utf-8"))["jobs"]
    return [step for job in jobs.values() for step in job.get("steps", [])]


def readme_commands() -> list[str]:
    """The `make ...` commands of the README's "Two commands" block."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^(make \w+)", readme, flags=re.MULTILINE)


def test_the_workflows_run_the_readmes_commands():
    commands = readme_commands()
    assert "make test" in commands and "make book" in commands
    runs = {workflow: [step.get("run", "") for step in steps(workflow)] for workflow in ("test.yml", "book.yml")}
    assert any(run.startswith("make test") for run in runs["test.yml"]), runs["test.yml"]
    assert any(run.startswith("make book") for run in runs["book.yml"]), runs["book.yml"]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^make test$", ci, flags=re.MULTILINE), "`.ci/run` no longer calls `make test`"


def test_the_test_workflow_covers_three_pythons_and_caches_pip():
    job = yaml.safe_load((WORKFLOWS / "test.yml").read_text(encoding="utf-8"))["jobs"]["test"]
    assert job["strategy"]["matrix"]["python-version"] == ["3.11", "3.12", "3.13"]
    setup = next(step for step in job["steps"] if step.get("uses", "").startswith("actions/setup-python"))
    assert setup["with"]["cache"] == "pip"


def test_the_book_workflow_deploys_with_the_pages_actions():
    uses = [step.get("uses", "").split("@")[0] for step in steps("book.yml")]
    for action in ("actions/configure-pages", "actions/upload-pages-artifact", "actions/deploy-pages"):
        assert action in uses


def test_the_readme_says_where_the_book_is_published_without_a_dead_address():
    """With a repository named, the README's first lines link the published book; without one, they link nothing
    and say how to publish it. Either way no link leads to the placeholder."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    opening = "\n".join(readme.splitlines()[:6])
    repo = repository(ROOT)
    if repo is None:
        assert "github.io" not in opening.replace("<owner>.github.io/<name>", "")
        assert "repository.url" in opening and "_config.yml" in opening
    else:
        assert repo["pages"] in opening
    assert not re.search(r"github\.com/OWNER/|owner\.github\.io", readme, re.IGNORECASE)


def test_the_repository_address_is_written_once():
    """Only `_config.yml` names the repository; the README quotes the derived addresses."""
    repo = repository(ROOT)
    if repo is None:
        pytest.skip("_config.yml names no repository")
    address = f"github.com/{repo['owner']}/{repo['name']}"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    named = []
    for name in tracked.stdout.splitlines():
        path = ROOT / name
        if name in ("_config.yml", "README.md") or not path.is_file() or path.suffix in (".json", ".png"):
            continue
        if address.lower() in path.read_text(encoding="utf-8", errors="replace").lower():
            named.append(name)
    assert named == [], f"these files write the repository's address instead of reading _config.yml: {named}"


@pytest.mark.parametrize("url", ["https://gitlab.com/a/b", "http://github.com/a/b", "https://github.com/a",
                                 "https://github.com/OWNER/annotated-transformer-book"])
def test_a_bad_repository_setting_is_named(tmp_path, url):
    (tmp_path / "_config.yml").write_text(yaml.safe_dump({"repository": {"url": url, "branch": "notebooks"}}))
    with pytest.raises(RepositoryError, match="repository.url"):
        repository(tmp_path)


def test_an_empty_repository_setting_leaves_out_what_would_point_at_it(tmp_path, capsys):
    """No repository named: the build's configuration has no launch, repository or issue buttons, the notebooks
    no install cell, and the build says once how to turn them on. `set-repository` (the book workflow) names one,
    and then everything is back."""
    import nbformat

    shutil.copy(ROOT / "_config.yml", tmp_path / "_config.yml")
    assert repository(tmp_path) is None
    config = build_config(tmp_path)
    assert "launch_buttons" not in config and "repository" not in config
    assert not any(config["html"][switch] for switch in REPOSITORY_SWITCHES)
    write_build_config(tmp_path)
    assert "repository.url" in capsys.readouterr().err
    assert with_install_cell(nbformat.v4.new_notebook(), tmp_path).cells == []
    assert set_repository(tmp_path, "https://github.com/someone/the-book")
    repo = repository(tmp_path)
    assert repo["pages"] == "https://someone.github.io/the-book/" and repo["branch"] == "notebooks"
    assert build_config(tmp_path)["launch_buttons"] == yaml.safe_load(
        (ROOT / "_config.yml").read_text(encoding="utf-8"))["launch_buttons"]
    [cell] = with_install_cell(nbformat.v4.new_notebook(), tmp_path).cells
    assert "https://github.com/someone/the-book.git" in cell.source
    assert not set_repository(tmp_path, "https://github.com/another/one")  # never replaces a named one
    assert repository(tmp_path)["owner"] == "someone"


def test_the_lab_settings_open_markdown_as_notebooks():
    settings = json.loads((ROOT / "scripts" / "jupyterlab_overrides.json").read_text(encoding="utf-8"))
    viewers = settings["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]
    assert viewers == {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}
    lab_lock = (ROOT / "requirements-lab.lock").read_text(encoding="utf-8").splitlines()
    assert "-r requirements.lock" in lab_lock
    assert any(line.startswith("jupyterlab==") for line in lab_lock)


@pytest.mark.slow
def test_the_install_cell_fetches_the_built_commit_and_installs_what_is_missing(tmp_path):
    """The first cell of a notebook opened in Colab or downloaded anywhere: fetch the book at the commit it was built
    from, install the package (and matplotlib) where missing, put the book's package first, move into book/; run
    again, nothing new. And in the book's own book/ folder it fetches nothing.

    It runs in a fresh virtual environment without the package (pip is told not to fetch the dependencies: the
    package itself imports no torch), against this repository instead of GitHub.
    """
    commit = built_commit(ROOT)
    if not commit:
        pytest.skip("not a git checkout")
    environment = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(environment)
    python = environment / "bin" / "python"
    work = tmp_path / "work"
    work.mkdir()
    cell = INSTALL_CELL.format(url=ROOT.as_uri(), folder="book-clone", commit=commit, branch="no-such-branch")
    program = cell + ("\nimport annotated_transformer, subprocess, sys\nprint(annotated_transformer.__file__)\n"
                      "print(os.getcwd(), flush=True)\nsubprocess.run([sys.executable, '-c', "
                      "'import annotated_transformer; print(annotated_transformer.__file__)'], check=True)\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PIP_NO_DEPS="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    first = subprocess.run([str(python), "-c", program], cwd=work, env=env, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr
    module, cwd, in_a_command = first.stdout.split()[-3:]
    clone = work / "book-clone"
    assert Path(cwd) == clone / "book" and (Path(cwd) / "intro.md").is_file()
    assert Path(module) == Path(in_a_command) == clone / "annotated_transformer" / "__init__.py"  # the book's own
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip() \
        == commit                                                          # the commit the notebook was built from
    installed = subprocess.run([str(python), "-m", "pip", "show", "annotated-transformer"], env=env,
                               capture_output=True, text=True)
    assert installed.returncode == 0, "the package was not installed into the fresh environment"
    # Again, in a new kernel, with matplotlib there (a stand-in): nothing is missing, so nothing is installed (pip
    # would need the network and an index; here it gets neither) and nothing fetched; the cell moves into book/.
    site_packages = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        capture_output=True, text=True, check=True).stdout.strip())
    (site_packages / "matplotlib").mkdir()
    (site_packages / "matplotlib" / "__init__.py").write_text("")
    env.update(PIP_INDEX_URL="http://127.0.0.1:9/", PIP_NO_INDEX="1")
    second = subprocess.run([str(python), "-c", program], cwd=work, env=env, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 0, second.stderr
    assert Path(second.stdout.split()[-2]) == clone / "book"
    # In the book's own book/ folder: nothing fetched, its package first.
    third = subprocess.run([str(python), "-c", program], cwd=clone / "book", env=env, capture_output=True, text=True,
                           timeout=120)
    assert third.returncode == 0, third.stderr
    assert not (clone / "book" / "book-clone").exists()
    assert Path(third.stdout.split()[-3]) == clone / "annotated_transformer" / "__init__.py"
    # A folder of that name left at another commit (an older notebook's fetch): moved to this notebook's commit.
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "--allow-empty", "-m",
                    "elsewhere"], cwd=clone, check=True)
    fourth = subprocess.run([str(python), "-c", program], cwd=work, env=env, capture_output=True, text=True,
                            timeout=120)
    assert fourth.returncode == 0, fourth.stderr
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip() \
        == commit


def test_the_release_trains_in_fp32_with_the_settings_that_the_hint_names():
    """A hosted runner's CPU may lack native bfloat16, so the release trains in fp32 (no --amp) with the fp32
    settings that a laptop run in fp32 names in its hint (the translation chapter's FP32_RECIPE)."""
    from annotated_transformer.translation import FP32_RECIPE, laptop_hint, translation_config
    from annotated_transformer.cli import build_parser, translation_config_from_args
    from annotated_transformer.runtime import Precision

    steps = yaml.safe_load((WORKFLOWS / "release.yml").read_text(encoding="utf-8"))["jobs"]["release"]["steps"]
    command = next(step["run"] for step in steps if step.get("name") == "Train the laptop translator").split()
    assert command[:3] == [".venv/bin/python", "-m", "annotated_transformer"] and "--amp" not in command
    options = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in FP32_RECIPE.items())
    assert options in " ".join(command)
    assert laptop_hint(translation_config("laptop"), Precision("cpu"), False).endswith(options)
    config = translation_config_from_args(build_parser().parse_args(command[3:]))
    assert config.profile == "laptop" and sorted(config.changed()) == sorted(FP32_RECIPE)


def test_the_readmes_figures_come_from_the_record():
    """The README quotes the laptop run's beam BLEU and training time: they must be the record's."""
    record = json.loads((ROOT / "book" / "results" / "multi30k-laptop.json").read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    claim = re.search(r"([\d.]+) BLEU \(95% interval \+-([\d.]+)\) on Multi30k test2016 with beam search after "
                      r"(\d+) minutes", readme)
    assert claim, "the README no longer quotes the laptop run"
    assert float(claim.group(1)) == record["test"]["beam_tuned"]["bleu"]      # chosen on validation
    assert float(claim.group(2)) == record["bootstrap"]["beam_tuned"]["ci95"]
    assert int(claim.group(3)) == round(record["train_seconds"] / 60)
    full = json.loads((ROOT / "book" / "results" / "multi30k-full.json").read_text(encoding="utf-8"))
    claim = re.search(r"([\d.]+) BLEU on Multi30k test2016 with\s+beam search by the same protocol \(([\d.]+) at the "
                      r"paper's setting\) after ([\d.]+) minutes of training on one (NVIDIA [\w ]+?)\s", readme)
    assert claim, "the README no longer quotes the GPU run by the protocol"
    assert float(claim.group(1)) == full["test"]["beam_tuned"]["bleu"]
    assert float(claim.group(2)) == full["test"]["beam"]["bleu"]
    assert float(claim.group(3)) == round(full["train_seconds"] / 60, 1)
    assert claim.group(4) in full["device"]
    seeded = json.loads((ROOT / "book" / "results" / "multi30k-laptop-clocked-seed1.json").read_text("utf-8"))
    claim = re.search(r"with `--seed 1` scored ([\d.]+)\s+\(`book/results/multi30k-laptop-clocked-seed1.json`\)",
                      readme)
    assert claim, "the README no longer quotes the laptop command's second seed"
    assert float(claim.group(1)) == seeded["test"]["beam_tuned"]["bleu"]
    assert seeded["changed"] == ["seed"] and seeded["config"]["seed"] == 1
    faster = json.loads((ROOT / "book" / "results" / "multi30k-laptop-clocked-attention.json").read_text("utf-8"))
    claim = re.search(r"the same command ran ([\d,]+) steps in the (\d+) minutes and\s+scored ([\d.]+)\s+"
                      r"\(`book/results/multi30k-laptop-clocked-attention.json`\)", readme)
    assert claim, "the README no longer quotes the command's run with the attention in float32"
    assert int(claim.group(1).replace(",", "")) == faster["history"]["step"][-1]
    assert int(claim.group(2)) == round(faster["train_seconds"] / 60) and faster["changed"] == []
    assert float(claim.group(3)) == faster["test"]["beam_tuned"]["bleu"]
    faster_seeded = json.loads(
        (ROOT / "book" / "results" / "multi30k-laptop-clocked-attention-seed1.json").read_text("utf-8"))
    claim = re.search(r"with `--seed 1`, ([\d,]+) steps and ([\d.]+)\s+"
                      r"\(`book/results/multi30k-laptop-clocked-attention-seed1.json`\)", readme)
    assert claim, "the README no longer quotes the second seed with the attention in float32"
    assert int(claim.group(1).replace(",", "")) == faster_seeded["history"]["step"][-1]
    assert float(claim.group(2)) == faster_seeded["test"]["beam_tuned"]["bleu"]
    assert faster_seeded["changed"] == ["seed"] and faster_seeded["config"]["seed"] == 1
    assert faster_seeded["valid_loss_averaged"] < seeded["valid_loss_averaged"]  # "a lower validation loss"
    assert (ROOT / "docs" / "translator.png").is_file()

