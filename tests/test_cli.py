"""The command line, `python -m annotated_transformer` (book/cli.md).

The entry point itself is run as a user runs it (a subprocess); the error cases call `main` in-process, which is
faster and goes through the same parser. The tests name only what they check, so adding subcommands (train,
translate, evaluate) keeps them valid.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from annotated_transformer.cli import main

ROOT = Path(__file__).resolve().parents[1]
PROG = "python -m annotated_transformer"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "annotated_transformer", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )


def usage_error(capsys, *args: str) -> str:
    """Run `main(args)`, expect argparse to exit with status 2, and return what it printed on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_help_lists_the_tangle_command() -> None:
    result = cli("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {PROG}")
    assert "tangle" in result.stdout
    assert "regenerate (or --check) the package from the book" in result.stdout


def test_tangle_check_passes_from_the_repository() -> None:
    result = cli("tangle", "--check")
    assert result.returncode == 0, result.stderr
    assert "The package matches the book" in result.stdout


def test_unknown_command_is_a_usage_error(capsys) -> None:
    err = usage_error(capsys, "no-such-command")
    assert err.startswith(f"usage: {PROG}")
    assert "invalid choice: 'no-such-command'" in err
    assert "choose from" in err and "tangle" in err.split("choose from", 1)[1]  # it lists the valid commands


def test_missing_command_is_a_usage_error(capsys) -> None:
    err = usage_error(capsys)
    assert err.startswith(f"usage: {PROG}")
    assert "the following arguments are required: COMMAND" in err


def test_unknown_option_of_tangle_is_a_usage_error(capsys) -> None:
    err = usage_error(capsys, "tangle", "--no-such-option")
    assert "unrecognized arguments: --no-such-option" in err


def test_tangle_help_documents_its_options(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["tangle", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {PROG} tangle")
    assert "--check" in out and "stale, missing or orphan" in out
    assert "--root" in out


def test_tangle_finds_no_book_outside_the_repository(tmp_path: Path, capsys, monkeypatch) -> None:
    """From a folder that holds no book and without --root, the tangler falls back to the installed package's
    repository (editable installs), so the check still runs against this book."""
    import annotated_transformer

    if Path(annotated_transformer.__file__).resolve().parents[1] != ROOT:
        pytest.skip("the package is not installed from this repository (not an editable install)")
    monkeypatch.chdir(tmp_path)
    assert main(["tangle", "--check"]) == 0
    assert "The package matches the book" in capsys.readouterr().out


def test_tangle_with_a_root_that_holds_no_book_fails_clearly(tmp_path: Path, capsys) -> None:
    assert main(["tangle", "--check", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "_toc.yml" in err


def test_command_line_works_without_the_notebook_tools():
    """A GPU server may have PyTorch but not jupytext: only `tangle` itself needs it."""
    code = ("import sys; sys.modules['jupytext'] = None\n"  # makes `import jupytext` fail
            "from annotated_transformer.cli import build_parser\n"
            "args = build_parser().parse_args(['train', '--task', 'multi30k', '--steps', '3'])\n"
            "print(args.task, args.steps)\n"
            "from annotated_transformer import tangle\n"
            "try:\n"
            "    tangle.read_chapter(tangle.chapter_paths(tangle.Path('.'))[0], tangle.Path('.'))\n"
            "except ImportError:\n"
            "    print('tangle needs jupytext')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["multi30k 3", "tangle needs jupytext"]


# --- translate, evaluate and train --task multi30k ---------------------------------------------------------------

def help_of(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_translate_and_evaluate_help_list_every_option(capsys) -> None:
    out = help_of(capsys, "translate")
    assert out.startswith(f"usage: {PROG} translate")
    for option in ("--checkpoint", "--beam-size", "--input", "--max-len", "--batch-size", "--length-penalty",
                   "--penalty {gnmt,simple,none}", "--device"):
        assert option in out, option
    out = help_of(capsys, "evaluate")
    assert out.startswith(f"usage: {PROG} evaluate")
    for option in ("--checkpoint", "--split {test,train,valid}", "--source", "--reference", "--beam-size",
                   "--length-penalty", "--limit", "--batch-size", "--device", "--output"):
        assert option in out, option


def test_train_help_lists_the_options_of_the_translation_task(capsys) -> None:
    out = help_of(capsys, "train")
    assert "settings of --task multi30k; left out: the profile's values" in out
    for option in ("--vocab-size", "--train-limit", "--max-len", "--d-ff", "--heads", "--dropout",
                   "--attention-dropout", "--activation-dropout", "--norm-first, --no-norm-first",
                   "--embedding-init {normal,xavier}", "--max-tokens", "--average", "--eval-every", "--valid-limit",
                   "--test-limit", "--beam-size", "--length-penalty", "--sweep, --no-sweep", "--results"):
        assert option in out, option


def test_translation_options_become_a_checked_configuration(capsys, tmp_path: Path) -> None:
    from annotated_transformer.cli import build_parser, translation_config_from_args

    parser = build_parser(only="train")
    config = translation_config_from_args(parser.parse_args(["train", "--task", "multi30k", "--profile", "laptop",
                                                             "--heads", "8", "--no-sweep"]))
    assert config.h == 8 and config.sweep is False and config.changed() == ["h", "sweep"]
    # a bad value is refused, naming the setting, before anything runs
    assert main(["train", "--task", "multi30k", "--profile", "quick", "--dropout", "1.5", "--checkpoint-dir",
                 str(tmp_path / "run")]) == 2
    assert "dropout must lie in [0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
