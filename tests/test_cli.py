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


def test_a_length_penalty_is_refused_where_the_search_would_not_use_it() -> None:
    """Greedy search has no length penalty, and --penalty none no alpha: an option given in vain is refused, one
    left out gets its default (gnmt, alpha 0.6), and every use that beam search reads is kept."""
    from annotated_transformer.cli import build_parser, length_penalty

    parser = build_parser()

    def chosen(command: str, *options: str) -> tuple[float, str]:
        return length_penalty(parser.parse_args([command, *options, "--checkpoint", "x.pt"]))

    assert chosen("translate") == chosen("translate", "--beam-size", "1") == (0.6, "gnmt")
    assert chosen("translate", "--penalty", "none") == (0.6, "none")
    assert chosen("translate", "--penalty", "simple", "--length-penalty", "1") == (1.0, "simple")
    assert chosen("translate", "--beam-size", "2", "--length-penalty", "0") == (0.0, "gnmt")
    assert chosen("evaluate") == (0.6, "gnmt")
    assert chosen("evaluate", "--beam-size", "4", "--length-penalty", "1") == (1.0, "gnmt")
    greedy = r"greedy search \(--beam-size 1\) uses no length penalty: leave out "
    for options, message in [
        (["translate", "--beam-size", "1", "--length-penalty", "10"], greedy + "--length-penalty, or"),
        (["translate", "--beam-size", "1", "--length-penalty", "0"], greedy + "--length-penalty, or"),
        (["translate", "--beam-size", "1", "--penalty", "simple"], greedy + "--penalty, or"),
        (["translate", "--beam-size", "1", "--penalty", "none", "--length-penalty", "1"],
         greedy + "--length-penalty and --penalty, or"),
        (["translate", "--penalty", "none", "--length-penalty", "10"], "--penalty none uses no alpha"),
        (["evaluate", "--length-penalty", "10"], greedy + "--length-penalty"),
    ]:
        with pytest.raises(ValueError, match=message):
            chosen(*options)


def test_evaluate_names_the_line_and_the_file_of_a_sentence_too_long(tmp_path, monkeypatch, capsys) -> None:
    """As translate does: the line, counted from 1, of --source or of the split, before anything is decoded."""
    import torch

    import annotated_transformer.data as data
    import annotated_transformer.translation as translation
    from annotated_transformer.beam_search import TokenIds
    from annotated_transformer.model import make_model

    torch.manual_seed(0)
    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)  # a table of 5000 positions
    monkeypatch.setattr(model, "encode", lambda *args: pytest.fail("decoding started"))
    monkeypatch.setattr(translation, "load_translator", lambda *args: (model, TokenIds(11), {}))
    pairs = [("3 4", "3 4"), (" ".join(["3"] * 5000), "3")]  # the start symbol makes 5001
    monkeypatch.setattr(data, "load_split", lambda name: pairs)
    (tmp_path / "src.txt").write_text("".join(source + "\n" for source, _ in pairs))
    (tmp_path / "ref.txt").write_text("".join(reference + "\n" for _, reference in pairs))
    for options, where in [
        (["--source", str(tmp_path / "src.txt"), "--reference", str(tmp_path / "ref.txt")],
         f"{tmp_path / 'src.txt'} (--source)"),
        (["--split", "valid"], "the valid split"),
        ([], "the test split"),
    ]:
        assert main(["evaluate", "--checkpoint", "x.pt", "--device", "cpu", *options]) == 2
        assert capsys.readouterr().err == (f"error: line 2 of {where} has 5001 tokens; this model reads at most "
                                           "5000: shorten or split it\n")


def test_train_help_lists_the_options_of_the_translation_task(capsys) -> None:
    out = help_of(capsys, "train")
    assert "settings of --task multi30k; left out: the profile's values" in out
    for option in ("--vocab-size", "--train-limit", "--max-len", "--d-ff", "--heads", "--dropout",
                   "--attention-dropout", "--activation-dropout", "--norm-first, --no-norm-first",
                   "--embedding-init {normal,xavier}", "--decay {inverse_sqrt,linear}", "--no-clock", "--max-tokens", "--average", "--eval-every", "--valid-limit",
                   "--test-limit", "--beam-size", "--length-penalty", "--sweep, --no-sweep", "--results"):
        assert option in out, option


def test_translation_options_become_a_checked_configuration(capsys, tmp_path: Path) -> None:
    from annotated_transformer.cli import build_parser, translation_config_from_args

    parser = build_parser(only="train")
    config = translation_config_from_args(parser.parse_args(["train", "--task", "multi30k", "--profile", "laptop",
                                                             "--heads", "8", "--no-sweep"]))
    assert config.h == 8 and config.sweep is False and config.changed() == ["h", "sweep"]
    # the laptop profile's clock: on unless switched off
    laptop = ["train", "--task", "multi30k", "--profile", "laptop"]
    assert translation_config_from_args(parser.parse_args(laptop)).minutes == 38.0
    clockless = translation_config_from_args(parser.parse_args([*laptop, "--no-clock", "--steps", "3200"]))
    assert clockless.minutes is None and clockless.changed() == ["minutes", "steps"]
    # a bad value is refused, naming the option, as it is parsed: before anything runs
    err = usage_error(capsys, "train", "--task", "multi30k", "--profile", "quick", "--dropout", "1.5",
                      "--checkpoint-dir", str(tmp_path / "run"))
    assert "argument --dropout: expected a probability in [0, 1), got '1.5'" in err
    assert not (tmp_path / "run").exists()


# --- what the command line checks, and how it reports ----------------------------------------------------------------

def test_the_copy_task_honours_the_shared_model_options(tmp_path: Path, capsys) -> None:
    """--heads, --d-ff and --dropout are settings of CopyConfig too; --checkpoint-every and --keep-last reach the
    training loop."""
    from annotated_transformer.checkpoints import load_checkpoint
    from annotated_transformer.folders import list_checkpoints

    assert main(["train", "--task", "copy", "--profile", "quick", "--steps", "3", "--d-model", "16", "--layers", "1",
                 "--heads", "2", "--d-ff", "24", "--dropout", "0.25", "--batch-size", "8", "--device", "cpu",
                 "--checkpoint-every", "1", "--keep-last", "2", "--checkpoint-dir", str(tmp_path),
                 "--no-progress"]) == 0
    assert "copy exact-match" in capsys.readouterr().out
    kept = list_checkpoints(tmp_path)
    assert [path.name for path in kept] == ["step_00000002.pt", "step_00000003.pt"]
    config = load_checkpoint(kept[-1])["config"]
    assert (config["h"], config["d_ff"], config["dropout"], config["d_model"]) == (2, 24, 0.25, 16)


def test_each_task_refuses_the_options_it_would_not_use(capsys) -> None:
    from annotated_transformer.cli import build_parser, translation_config_from_args

    assert main(["train", "--task", "copy", "--max-tokens", "500", "--no-sweep", "--keep-last", "2"]) == 2
    err = capsys.readouterr().err
    # named either way it may have been typed: --sweep or --no-sweep
    assert err.startswith("error: --task copy does not use --max-tokens, --sweep/--no-sweep: leave them out"), err
    assert "--keep-last" not in err
    args = build_parser(only="train").parse_args(["train", "--task", "multi30k", "--keep-last", "2"])
    with pytest.raises(ValueError, match="--task multi30k does not use --keep-last"):
        translation_config_from_args(args)
    # every option of train is a setting of one task at least, or one that every task has
    from annotated_transformer.cli import EVERY_TASK, OPTION_OF
    from annotated_transformer.copy_task import CopyConfig
    from annotated_transformer.translation import SETTINGS

    dests = set(vars(build_parser(only="train").parse_args(["train"])))
    known = {OPTION_OF.get(name, name) for name in [*CopyConfig.__dataclass_fields__, *SETTINGS]}
    assert dests - known - EVERY_TASK == {"keep_last", "results", "no_clock"}  # no_clock: minutes=None


def test_numbers_are_checked_as_they_are_parsed() -> None:
    import argparse

    from annotated_transformer.cli import (non_negative_int, non_negative_number, positive_int, positive_number,
                                           probability, seed_int)

    good = [(positive_int, "3", 3), (non_negative_int, "0", 0), (positive_number, "1e-3", 1e-3),
            (non_negative_number, "0", 0.0), (probability, "0", 0.0), (probability, "0.999", 0.999),
            (seed_int, "4294967295", 2**32 - 1)]
    for check, text, value in good:
        assert check(text) == value and type(check(text)) is type(value)
    bad = [(positive_int, "0"), (positive_int, "-1"), (positive_int, "2.5"), (positive_int, "1e3"),
           (positive_int, ""), (non_negative_int, "-1"), (positive_number, "0"), (positive_number, "nan"),
           (positive_number, "inf"), (positive_number, "-inf"), (non_negative_number, "-0.1"),
           (non_negative_number, "nan"), (probability, "1"), (probability, "-0.0001"), (probability, "nan"),
           (seed_int, "-1"), (seed_int, str(2**32))]
    for check, text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=f"got {text!r}"):
            check(text)


def test_output_places_are_checked_before_a_command_starts(tmp_path: Path) -> None:
    from annotated_transformer.download import check_output

    (tmp_path / "a_file").write_text("")
    refused = [(tmp_path, False, "is not a file (--x)"),
               (tmp_path / "a_file" / "out.txt", False, "a_file is a file"),
               (tmp_path / "a_file", True, "a_file is a file, not a folder (--x)"),
               (tmp_path / "a_file" / "run" / "deeper", True, "a_file is a file")]
    if Path("/proc/self").is_dir():
        refused += [(Path("/proc/out.txt"), False, "no file can be made in /proc"),
                    (Path("/proc/run"), True, "no file can be made in /proc")]
    for path, folder, reason in refused:
        with pytest.raises(ValueError, match="--x") as error:
            check_output(path, "--x", "the output", folder=folder)
        assert reason in str(error.value) and str(path) in str(error.value)
    for path, folder in [(tmp_path / "a_file", False), (tmp_path / "new.txt", False), (tmp_path, True),
                         (tmp_path / "new" / "deeper", True), (tmp_path / "missing" / "out.txt", False)]:
        check_output(path, "--x", "the output", folder=folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the checks made nothing


def test_main_reports_file_errors_and_interrupts_in_one_line(monkeypatch, capsys) -> None:
    import annotated_transformer.cli as cli

    def fails(error):
        def run(args):
            raise error
        return run

    monkeypatch.setattr(cli, "run_tangle", fails(IsADirectoryError(21, "Is a directory", "data/train.de.gz")))
    assert main(["tangle"]) == 2
    assert capsys.readouterr().err == "error: data/train.de.gz: Is a directory\n"
    monkeypatch.setattr(cli, "run_tangle", fails(KeyboardInterrupt()))
    assert main(["tangle"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_refusals_and_help_need_no_pytorch() -> None:
    """Building every parser, printing the listing and refusing a bad option import no PyTorch, so they answer at
    once; --help of a subcommand lists the choices, which come from the modules that define them."""
    code = ("import sys\nfrom annotated_transformer.cli import build_parser, main\nbuild_parser()\n"
            "for argv in (['--help'], ['train', '--factor', 'nan'], ['translate', '--checkpoint', 'x', '--beam-size',"
            " '0'], ['evaluate', '--checkpoint', 'x', '--limit', '0'], ['bench', '--threads', '0']):\n"
            "    try:\n        main(argv)\n    except SystemExit as exit_:\n        print(exit_.code)\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.split()[-6:] == ["0", "2", "2", "2", "2", "False"], done.stdout + done.stderr
    for option in ("--factor", "--beam-size", "--limit"):
        assert f"error: argument {option}: expected a positive" in done.stderr
    assert "error: argument --threads: expected a thread count from 1 to" in done.stderr
    assert "--split {test,train,valid}" in cli("evaluate", "--help").stdout


@pytest.mark.parametrize("options, expected", [
    (["--task", "copy", "--heads", "3"], "error: --d-model (32) must be divisible by --heads (3)"),
    (["--task", "multi30k", "--vocab-size", "5"], "error: --vocab-size must be at least 8, got 5"),
    (["--task", "multi30k", "--max-len", "2"], "error: --max-len must be at least 3, got 2"),
    (["--task", "multi30k", "--max-tokens", "20"], "error: --max-tokens must be at least 30, got 20"),
    (["--task", "multi30k", "--beam-size", "1", "--length-penalty", "2"],
     "error: greedy search (--beam-size 1) uses no length penalty: leave out --length-penalty"),
    (["--task", "copy", "--steps", "2", "--warmup", "1", "--batch-size", str(10**18)],
     "error: out of memory for the sizes asked for (Storage size calculation overflowed"),
])
def test_train_refuses_in_one_line_naming_the_options_typed(tmp_path, capsys, options, expected) -> None:
    """The configuration's refusals named its settings (h, vocab_size, max_len), not the options the user typed;
    --max-tokens below --max-len passed until the batches were made, after the tokenizer; the final evaluation took a
    length penalty that greedy search ignores; a batch too large for a tensor ended in a traceback."""
    run = tmp_path / "run"
    assert main(["train", "--profile", "quick", "--device", "cpu", "--no-progress", "--checkpoint-dir", str(run),
                 *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert not list(run.glob("step_*.pt"))


def test_tangle_without_jupytext_says_so_in_one_line() -> None:
    code = ("import sys; sys.modules['jupytext'] = None\n"  # makes `import jupytext` fail
            "from annotated_transformer.cli import main\nprint(main(['tangle', '--check']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.strip() == "2", done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and "jupytext" in done.stderr and done.stderr.count("\n") == 1
