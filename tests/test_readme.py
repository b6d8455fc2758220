"""The README's commands, as a newcomer types them after the two commands of its set-up.

Every command of its `bash` blocks must start with something that exists on a fresh machine after `make setup`
(`make`, `python3 -m venv`, the environment's `.venv/bin/...`, the repository's `scripts/`), never a bare `python`;
each `make` target and each step of `scripts/record_gpu.sh` must exist; every command line of the package is parsed
by the command line's own parser (a renamed option or a value it refuses fails here). The ones that need no trained
model and take seconds run for real.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from annotated_transformer.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_COMMAND = [".venv/bin/python", "-m", "annotated_transformer"]
RUN_FOR_REAL = [["--version"], ["tangle", "--check"]]


def readme_commands() -> list[list[str]]:
    """The commands of the README's bash blocks: continuation lines joined, comments dropped, each split into words
    (a pipe's right-hand side is the command that matters)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"(?ms)^```bash\n(.*?)^```$", text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "|" in words:
                words = words[words.index("|") + 1:]
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VARIABLE=value before the command
                words = words[1:]
            if words:
                commands.append(words)
    return commands


def test_the_readme_has_commands_to_check():
    commands = readme_commands()
    assert len(commands) >= 10
    assert any(words[:3] == PACKAGE_COMMAND for words in commands)


@pytest.mark.parametrize("words", readme_commands(), ids=lambda words: " ".join(words)[:60])
def test_a_readme_command_works_as_written(words: list[str]):
    program = words[0]
    if program == "make":
        phony = re.search(r"(?m)^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(encoding="utf-8")).group(1).split()
        assert all(target in phony for target in words[1:]), f"make has no target {words[1:]}"
    elif words[:3] == ["python3", "-m", "venv"]:
        assert words[3:] == [".venv"]
    elif program == "scripts/record_gpu.sh":
        script = (ROOT / program).read_text(encoding="utf-8")
        assert re.search(rf"(?m)^{re.escape(words[1])}\)", script), f"{program} has no step {words[1]!r}"
    elif words[:3] == PACKAGE_COMMAND:
        arguments = words[3:]
        command = next((word for word in arguments if not word.startswith("-")), "")
        try:
            build_parser(only=command).parse_args(arguments)
        except SystemExit as exit_:  # --version and --help exit with 0; a refused option with 2
            assert exit_.code == 0, f"the command line refuses {' '.join(arguments)}"
    elif words[:4] == [".venv/bin/python", "-m", "pip", "install"]:
        assert "torch==" in " ".join(words)
    else:
        raise AssertionError(f"a README command starts with {program!r}, which a fresh machine may not have")


@pytest.mark.parametrize("arguments", RUN_FOR_REAL, ids=" ".join)
def test_the_quick_readme_commands_run(arguments: list[str]):
    assert PACKAGE_COMMAND + arguments in readme_commands()
    done = subprocess.run([sys.executable, "-m", "annotated_transformer", *arguments], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
