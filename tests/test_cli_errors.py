"""Bad input on the command line (book/cli.md): a table of cases, each run as a user runs it, in its own process
(`python -m annotated_transformer ...` in a folder of its own, with ANNOTATED_TRANSFORMER_DATA passed through).

Every case must exit with a non-zero status, print no traceback, and name what is wrong: each has a substring that
its standard error must hold (the option, the file or the line). Nothing here trains: a case that would train must be
refused before training starts, and the working folder is checked at the end for anything a case wrote.

Speed: a refusal that argparse makes, and a place to write that `main` refuses, need no PyTorch and take a fraction
of a second, so a case's bad options come first and the options that follow give no `--device` (its check loads
PyTorch). A case that reaches a command's run starts PyTorch, which takes seconds on a busy machine: the table has a
few of those, and a second table runs more of them through `main` in this process, with the same checks.
"""
from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from annotated_transformer.checkpoints import load_checkpoint, save_checkpoint
from annotated_transformer.cli import main
from annotated_transformer.model import make_model

PROC = Path("/proc/self").is_dir()  # Linux's process folder: no file can be made there, not even by root
ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0  # root writes in folders without write permission

# The options after a case's own; --steps 1 keeps short a run that a broken check would let start.
COPY = ["--task", "copy", "--profile", "quick", "--d-model", "16", "--layers", "1", "--batch-size", "8",
        "--no-progress", "--steps", "1"]
MULTI30K = ["--task", "multi30k", "--profile", "quick", "--no-progress", "--steps", "1", "--checkpoint-dir", "run"]


def train(*bad: str) -> list[str]:
    return ["train", *bad, *COPY]


def multi30k(*bad: str) -> list[str]:
    return ["train", *bad, *MULTI30K]


def translate(*bad: str) -> list[str]:
    return ["translate", *bad, "--checkpoint", "copy.pt"]  # an untrained copy-task model (the fixture below)


def evaluate(*bad: str) -> list[str]:
    return ["evaluate", *bad, "--checkpoint", "copy.pt"]


def bench(*bad: str) -> list[str]:
    return ["bench", *bad, "--smoke"]


def usage(option: str, value: str, expected: str) -> str:
    """argparse's refusal of a bad value, in the words of the command line's types."""
    return f"argument {option}: expected {expected}, got {value!r}"


POSITIVE, PROBABILITY = "a positive integer", "a probability in [0, 1)"
FINITE, ALPHA = "a positive finite number", "a length penalty in [0, 10]"
THREADS = f"a thread count from 1 to {4 * (os.cpu_count() or 1)} (4 per CPU)"
STEP_COUNT = "a positive integer up to 1,000,000,000"

# (name, command line, what standard error must hold, standard input)
CASES = [
    ("no-command", [], "the following arguments are required: COMMAND", None),
    ("unknown-command", ["no-such-command"], "invalid choice: 'no-such-command'", None),
    ("unknown-option", ["train", "--no-such-option"], "unrecognized arguments: --no-such-option", None),
    # train: every number is checked as it is parsed
    ("factor-nan", train("--factor", "nan"), usage("--factor", "nan", FINITE), None),
    ("factor-negative", train("--factor", "-1"), usage("--factor", "-1", FINITE), None),
    ("factor-infinite", train("--factor", "inf"), usage("--factor", "inf", FINITE), None),
    ("factor-zero", train("--factor", "0"), usage("--factor", "0", FINITE), None),
    ("clip-norm-negative", train("--clip-norm", "-1"), usage("--clip-norm", "-1", FINITE), None),
    ("clip-norm-nan", train("--clip-norm", "nan"), usage("--clip-norm", "nan", FINITE), None),
    ("smoothing-one", train("--smoothing", "1"), usage("--smoothing", "1", PROBABILITY), None),
    ("smoothing-negative", train("--smoothing", "-0.1"), usage("--smoothing", "-0.1", PROBABILITY), None),
    ("dropout-above-one", train("--dropout", "1.5"), usage("--dropout", "1.5", PROBABILITY), None),
    ("dropout-nan", train("--dropout", "nan"), usage("--dropout", "nan", PROBABILITY), None),
    ("steps-negative", train("--steps", "-1"), usage("--steps", "-1", STEP_COUNT), None),
    ("steps-zero", train("--steps", "0"), usage("--steps", "0", STEP_COUNT), None),
    ("steps-fraction", train("--steps", "2.5"), usage("--steps", "2.5", STEP_COUNT), None),
    ("batch-size-zero", train("--batch-size", "0"), usage("--batch-size", "0", POSITIVE), None),
    ("vocab-too-small", train("--vocab", "2"), usage("--vocab", "2", "an integer >= 3"), None),
    ("seq-len-too-short", train("--seq-len", "1"), usage("--seq-len", "1", "an integer >= 2"), None),
    ("layers-zero", train("--layers", "0"), usage("--layers", "0", POSITIVE), None),
    ("d-model-negative", train("--d-model", "-16"), usage("--d-model", "-16", POSITIVE), None),
    ("d-ff-zero", train("--d-ff", "0"), usage("--d-ff", "0", POSITIVE), None),
    ("heads-zero", train("--heads", "0"), usage("--heads", "0", POSITIVE), None),
    ("warmup-zero", train("--warmup", "0"), usage("--warmup", "0", STEP_COUNT), None),
    ("accumulation-zero", train("--accumulation-steps", "0"),
     usage("--accumulation-steps", "0", "an integer from 1 to 1,024"), None),
    # a million micro-batches were all made before the first step: memory ran out, and no signal stopped it
    ("accumulation-huge", train("--accumulation-steps", "1000000"),
     usage("--accumulation-steps", "1000000", "an integer from 1 to 1,024"), None),
    ("seed-negative", train("--seed", "-1"), usage("--seed", "-1", "an integer in [0, 2**32)"), None),
    ("seed-word", train("--seed", "abc"), usage("--seed", "abc", "an integer in [0, 2**32)"), None),
    ("checkpoint-every-zero", train("--checkpoint-every", "0"), usage("--checkpoint-every", "0", POSITIVE), None),
    ("keep-last-negative", train("--keep-last", "-1"), usage("--keep-last", "-1", "an integer >= 0"), None),
    ("task-unknown", train("--task", "translate"), "argument --task: invalid choice: 'translate'", None),
    ("profile-unknown", train("--profile", "huge"), "argument --profile: invalid choice: 'huge'", None),
    # train --task multi30k: its own settings
    ("train-limit-negative", multi30k("--train-limit", "-5"), usage("--train-limit", "-5", POSITIVE), None),
    ("train-limit-zero", multi30k("--train-limit", "0"), usage("--train-limit", "0", POSITIVE), None),
    ("length-penalty-negative", multi30k("--length-penalty", "-1"), usage("--length-penalty", "-1", ALPHA),
     None),
    ("length-penalty-nan", multi30k("--length-penalty", "nan"), usage("--length-penalty", "nan", ALPHA), None),
    ("beam-size-zero", multi30k("--beam-size", "0"), usage("--beam-size", "0", POSITIVE), None),
    ("beam-size-fraction", multi30k("--beam-size", "2.5"), usage("--beam-size", "2.5", POSITIVE), None),
    ("vocab-size-zero", multi30k("--vocab-size", "0"), usage("--vocab-size", "0", POSITIVE), None),
    ("max-len-zero", multi30k("--max-len", "0"), usage("--max-len", "0", POSITIVE), None),
    ("attention-dropout-one", multi30k("--attention-dropout", "1"), usage("--attention-dropout", "1", PROBABILITY),
     None),
    ("activation-dropout-negative", multi30k("--activation-dropout", "-0.5"),
     usage("--activation-dropout", "-0.5", PROBABILITY), None),
    ("max-tokens-zero", multi30k("--max-tokens", "0"), usage("--max-tokens", "0", POSITIVE), None),
    ("average-zero", multi30k("--average", "0"), usage("--average", "0", POSITIVE), None),
    ("eval-every-zero", multi30k("--eval-every", "0"), usage("--eval-every", "0", POSITIVE), None),
    ("valid-limit-zero", multi30k("--valid-limit", "0"), usage("--valid-limit", "0", POSITIVE), None),
    ("test-limit-negative", multi30k("--test-limit", "-1"), usage("--test-limit", "-1", POSITIVE), None),
    # train: the places to write are checked before anything runs
    ("checkpoint-dir-a-file", train("--checkpoint-dir", "a_file.txt"),
     "error: a_file.txt is a file, not a folder (--checkpoint-dir)", None),
    ("checkpoint-dir-under-a-file", train("--checkpoint-dir", "a_file.txt/run"),
     "error: cannot write checkpoints to a_file.txt/run (--checkpoint-dir): a_file.txt is a file", None),
    ("checkpoint-dir-system-folder", train("--checkpoint-dir", "/proc/run"),
     "error: cannot write checkpoints to /proc/run (--checkpoint-dir): no file can be made in /proc", None),
    ("checkpoint-dir-read-only", train("--checkpoint-dir", "read_only/run"),
     "(--checkpoint-dir): no file can be made in read_only", None),
    ("results-a-folder", multi30k("--results", "a_folder"), "error: a_folder is not a file (--results)", None),
    ("results-system-folder", multi30k("--results", "/proc/results.json"),
     "(--results): no file can be made in /proc", None),
    ("results-under-a-file", multi30k("--results", "a_file.txt/results.json"),
     "(--results): a_file.txt is a file", None),
    # train: an option the task would not use is refused, not ignored; what depends on two options, by the config
    ("copy-refuses-translation-options", train("--vocab-size", "100", "--sweep", "--results", "r.json"),
     "--task copy does not use --vocab-size, --sweep/--no-sweep, --results", None),
    ("multi30k-refuses-copy-options", multi30k("--batch-size", "8", "--seq-len", "5", "--keep-last", "2"),
     "--task multi30k does not use --keep-last (it keeps --average), --batch-size (use --max-tokens), --seq-len", None),
    # translate
    ("translate-without-checkpoint", ["translate"], "the following arguments are required: --checkpoint", None),
    ("translate-beam-size-zero", translate("--beam-size", "0"), usage("--beam-size", "0", POSITIVE), None),
    ("translate-beam-size-fraction", translate("--beam-size", "2.5"), usage("--beam-size", "2.5", POSITIVE), None),
    ("translate-batch-size-zero", translate("--batch-size", "0"), usage("--batch-size", "0", POSITIVE), None),
    ("translate-max-len-one", translate("--max-len", "1"), usage("--max-len", "1", "an integer >= 2"), None),
    ("translate-length-penalty-negative", translate("--length-penalty", "-1"),
     usage("--length-penalty", "-1", ALPHA), None),
    ("translate-length-penalty-infinite", translate("--length-penalty", "inf"),
     usage("--length-penalty", "inf", ALPHA), None),
    ("translate-missing-checkpoint", ["translate", "--checkpoint", "missing.pt"], "no checkpoint at missing.pt", b""),
    ("translate-input-a-folder", translate("--input", "a_folder"), "a_folder is a folder", None),
    ("translate-stdin-not-utf8", translate(), "line 2 of standard input is not UTF-8", b"3 4\n\xe4 5\n"),
    # evaluate
    ("evaluate-beam-size-zero", evaluate("--beam-size", "0"), usage("--beam-size", "0", POSITIVE), None),
    ("evaluate-limit-zero", evaluate("--limit", "0"), usage("--limit", "0", POSITIVE), None),
    ("evaluate-limit-negative", evaluate("--limit", "-1"), usage("--limit", "-1", POSITIVE), None),
    ("evaluate-length-penalty-negative", evaluate("--length-penalty", "-1"),
     usage("--length-penalty", "-1", ALPHA), None),
    ("evaluate-batch-size-zero", evaluate("--batch-size", "0"), usage("--batch-size", "0", POSITIVE), None),
    ("evaluate-output-under-a-file", evaluate("--output", "a_file.txt/out.txt"),
     "error: cannot write the translations to a_file.txt/out.txt (--output): a_file.txt is a file", None),
    ("evaluate-output-a-folder", evaluate("--output", "a_folder"), "error: a_folder is not a file (--output)", None),
    ("evaluate-output-system-folder", evaluate("--output", "/proc/out.txt"),
     "(--output): no file can be made in /proc", None),
    ("evaluate-copy-checkpoint", evaluate(), "copy.pt holds no tokenizer", None),
    # bench
    ("bench-threads-zero", bench("--threads", "0"), usage("--threads", "0", THREADS), None),
    ("bench-json-under-a-file", bench("--json", "a_file.txt/bench.json"),
     "error: cannot write the results to a_file.txt/bench.json (--json): a_file.txt is a file", None),
    ("bench-json-a-folder", bench("--json", "a_folder"), "error: a_folder is not a file (--json)", None),
    ("bench-batch-sizes-zero", bench("--batch-sizes", "1", "0"), usage("--batch-sizes", "0", POSITIVE), None),
    # tangle
    ("tangle-root-not-a-book", ["tangle", "--check", "--root", "a_folder"], "a_folder does not hold the book", None),
    ("tangle-root-missing", ["tangle", "--check", "--root", "missing"], "missing does not hold the book", None),
    ("tangle-unknown-option", ["tangle", "--dry-run"], "unrecognized arguments: --dry-run", None),
    # issue 21: empty paths are refused by name (`--checkpoint-dir ''` used to write here, others named `.`)
    ("checkpoint-dir-empty", train("--checkpoint-dir", ""), "error: --checkpoint-dir is an empty path", None),
    ("results-empty", multi30k("--results", ""), "error: --results is an empty path", None),
    ("evaluate-output-empty", evaluate("--output", ""), "error: --output is an empty path", None),
    ("bench-json-empty", bench("--json", ""), "error: --json is an empty path", None),
    ("translate-checkpoint-empty", ["translate", "--checkpoint", ""], "error: --checkpoint is an empty path", None),
    ("translate-input-empty-path", translate("--input", ""), "error: --input is an empty path", None),
    ("evaluate-source-empty-path", evaluate("--source", "", "--reference", "en.txt"),
     "error: --source is an empty path", None),
    ("evaluate-reference-empty-path", evaluate("--source", "de.txt", "--reference", ""),
     "error: --reference is an empty path", None),
    ("tangle-root-empty", ["tangle", "--check", "--root", ""], "error: --root is an empty path", None),
    # issue 21: a length penalty that overflows (1000, 1e308) or is not a number; threads that crash PyTorch
    ("translate-length-penalty-huge", translate("--length-penalty", "1000"),
     usage("--length-penalty", "1000", ALPHA), None),
    ("length-penalty-huge", multi30k("--length-penalty", "1e308"), usage("--length-penalty", "1e308", ALPHA), None),
    ("evaluate-length-penalty-nan", evaluate("--length-penalty", "nan"), usage("--length-penalty", "nan", ALPHA),
     None),
    ("bench-threads-too-many", bench("--threads", "100000"),
     usage("--threads", "100000", THREADS), None),
    # issue 21: devices that PyTorch knows but this book cannot use
    ("device-meta", train("--device", "meta"), "is not one this book runs on", None),
    ("translate-device-xpu", translate("--device", "xpu"), "is not one this book runs on", None),
    ("evaluate-device-hpu", evaluate("--device", "hpu"), "is not one this book runs on", None),
    # issue 21: refused before training, leaving no run folder (the fixture checks that nothing was written)
    ("copy-seq-len-beyond-the-table", train("--seq-len", "5001", "--checkpoint-dir", "run"),
     "--seq-len 5001 is beyond the positional table (5000 positions)", None),
    ("copy-vocab-beyond-memory", train("--vocab", "1000000000000"), "(src_vocab=1000000000000, tgt_vocab", None),
    ("copy-batch-beyond-memory", ["train", "--batch-size", "1000000000000", "--profile", "quick", "--d-model", "16",
                                  "--layers", "1", "--no-progress", "--steps", "1"],
     "error: out of memory for the sizes asked for", None),
    ("translate-input-unreadable", translate("--input", "/proc/self/mem"), "/proc/self/mem (--input))", None),
]
SKIP = {  # the cases this machine cannot pose (they are not run: each would train), with the reason
    **{name: "no /proc here" for name in ("checkpoint-dir-system-folder", "results-system-folder",
                                          "evaluate-output-system-folder") if not PROC},
    **({"checkpoint-dir-read-only": "root may write in a folder without write permission"} if ROOT_USER else {}),
    **({} if PROC else {"translate-input-unreadable": "no /proc here"}),
}

# The same checks through `main` in this process, for more refusals that come from a command's run.
IN_PROCESS = [
    ("device-unknown", train("--device", "nonsense"), "argument --device: ", None),
    ("embedding-init-unknown", multi30k("--embedding-init", "zeros"), "argument --embedding-init: invalid choice",
     None),
    ("decay-unknown", multi30k("--decay", "cosine"), "argument --decay: invalid choice: 'cosine'", None),
    ("copy-heads-do-not-divide", train("--heads", "3"), "--d-model (16) must be divisible by --heads (3)", None),
    ("copy-laptop-profile", ["train", "--profile", "laptop", "--steps", "1", "--no-progress"],
     "--profile laptop is a profile of --task multi30k", None),
    ("copy-refuses-norm-first", train("--no-norm-first"), "--task copy does not use --norm-first", None),
    ("copy-refuses-decay", train("--decay", "linear"), "--task copy does not use --decay", None),
    ("copy-refuses-no-clock", train("--no-clock"), "--task copy does not use --no-clock", None),
    ("minutes-beyond-190-years", multi30k("--minutes", "1e307"), "minutes must be at most 100,000,000", None),
    ("no-clock-and-minutes", multi30k("--no-clock", "--minutes", "5"),
     "--minutes and --no-clock contradict each other: give one", None),
    ("copy-resume-without-folder", train("--resume"), "--resume needs --checkpoint-dir", None),
    ("copy-checkpoint-every-without-folder", train("--checkpoint-every", "5"),
     "--checkpoint-every needs --checkpoint-dir, the folder", None),
    ("copy-keep-last-without-folder", train("--checkpoint-every", "5", "--keep-last", "2"),
     "--checkpoint-every and --keep-last need --checkpoint-dir", None),
    ("copy-resume-nothing", train("--resume", "--checkpoint-dir", "a_folder"), "a_folder holds no checkpoint", None),
    ("multi30k-without-folder", ["train", "--task", "multi30k", "--profile", "quick"],
     "--task multi30k needs --checkpoint-dir", None),
    ("steps-beyond-a-billion", train("--steps", "1000000001"), usage("--steps", "1000000001", STEP_COUNT), None),
    ("warmup-beyond-a-billion", train("--warmup", "1" + "0" * 23), usage("--warmup", "1" + "0" * 23, STEP_COUNT),
     None),
    ("translate-penalty-unknown", translate("--penalty", "cubic"), "argument --penalty: invalid choice: 'cubic'",
     None),
    ("translate-checkpoint-a-folder", ["translate", "--checkpoint", "a_folder"],
     "no checkpoint at a_folder: it is a folder, and holds no checkpoint", b""),
    ("translate-checkpoint-not-a-checkpoint", ["translate", "--checkpoint", "a_file.txt"], "a_file.txt", b""),
    ("translate-input-missing", translate("--input", "missing.txt"), "no file at missing.txt", None),
    ("translate-input-empty", translate("--input", "empty.txt"), "empty.txt is empty", None),
    ("translate-input-not-utf8", translate("--input", "latin1.txt"), "line 2 of latin1.txt is not UTF-8", None),
    ("translate-stdin-empty", translate(), "standard input is empty", b""),
    ("translate-stdin-not-ids", translate(), "line 2: expected token ids", b"3 4\nhello\n"),
    ("translate-stdin-id-out-of-range", translate(), "line 1: token id 99 is not a symbol of this task: use 2..10",
     b"3 99\n"),
    ("translate-stdin-start-symbol", translate(),
     "line 1: token id 1 is not a symbol of this task: use 2..10 (0 is padding, 1 is the start symbol)", b"1 2 3\n"),
    ("evaluate-split-unknown", evaluate("--split", "dev"), "argument --split: invalid choice: 'dev'", None),
    ("evaluate-source-alone", evaluate("--source", "de.txt"), "--source and --reference go together", None),
    ("evaluate-split-and-source", evaluate("--split", "test", "--source", "de.txt", "--reference", "en.txt"),
     "give either --split or --source and --reference", None),
    ("evaluate-lines-differ", evaluate("--source", "de.txt", "--reference", "en.txt"),
     "de.txt has 1 lines but en.txt has 2", None),
    ("evaluate-source-a-folder", evaluate("--source", "a_folder", "--reference", "en.txt"), "a_folder is a folder",
     None),
    ("evaluate-source-is-reference", evaluate("--source", "de.txt", "--reference", "./de.txt"),
     "de.txt is both the source and the reference", None),
    ("evaluate-missing-checkpoint", ["evaluate", "--checkpoint", "missing.pt"], "no checkpoint at missing.pt", None),
    ("bench-section-unknown", bench("--only", "speed"), "argument --only: invalid choice: 'speed'", None),
    ("bench-device-unknown", bench("--device", "nonsense"), "got 'nonsense'", None),
    ("bench-cpu-clock-threads", bench("--device", "cpu", "--clock", "cpu", "--threads", "2"), "--clock cpu needs",
     None),
    ("bench-batch-sizes-without-decoding", bench("--only", "training", "--batch-sizes", "4"),
     "--batch-sizes sets the decoding section's batches", None),
    ("bench-compile-without-training", bench("--only", "decoding", "--compile"),
     "--compile compiles the training step", None),
    # a length penalty that the search would not use is refused, not ignored
    ("translate-greedy-length-penalty", translate("--beam-size", "1", "--penalty", "simple", "--length-penalty", "10"),
     "greedy search (--beam-size 1) uses no length penalty: leave out --length-penalty and --penalty", b"3 4\n"),
    ("translate-penalty-none-length-penalty", translate("--penalty", "none", "--length-penalty", "10"),
     "--penalty none uses no alpha: leave out --length-penalty", b"3 4\n"),
    ("evaluate-greedy-length-penalty", evaluate("--length-penalty", "10"),
     "greedy search (--beam-size 1) uses no length penalty: leave out --length-penalty", None),
    # an abbreviated option is refused: a run's record must name its --checkpoint-dir in full (for --resume)
    ("train-abbreviated-option", train("--checkpoint-d", "run"), "unrecognized arguments: --checkpoint-d run", None),
    ("translate-abbreviated-option", translate("--beam", "2"), "unrecognized arguments: --beam 2", b"3 4\n"),
    ("evaluate-abbreviated-option", evaluate("--length-pen", "1"), "unrecognized arguments: --length-pen 1", None),
    ("bench-abbreviated-option", bench("--only", "training", "--batch-s", "4"),
     "unrecognized arguments: --batch-s 4", None),
    ("version-abbreviated", ["--vers", "tangle", "--check"], "unrecognized arguments: --vers", None),
]


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """The cases' working folder: a copy-task checkpoint and the files and folders that the cases name."""
    folder = tmp_path_factory.mktemp("cli_errors")
    torch.manual_seed(0)
    save_checkpoint(folder / "copy.pt", model=make_model(11, 11, N=1, d_model=16, d_ff=32, h=2),
                    extra={"task": "copy"})
    (folder / "a_file.txt").write_text("3 4 5\n")
    (folder / "empty.txt").write_text("")
    (folder / "latin1.txt").write_bytes("3 4\nä 5\n".encode("latin-1"))
    (folder / "de.txt").write_text("Ein Hund.\n")
    (folder / "en.txt").write_text("A dog.\nTwo dogs.\n")
    (folder / "a_folder").mkdir()
    (folder / "read_only").mkdir(mode=0o555)
    listing = sorted(folder.rglob("*"))
    yield folder
    assert sorted(folder.rglob("*")) == listing, "a case wrote in its working folder"


@pytest.fixture(scope="module")
def outcomes(place) -> dict:
    """{case: its finished process}: every case of the table, a few at a time, each in its own interpreter."""

    def run(case):
        _, argv, _, stdin = case
        return subprocess.run([sys.executable, "-m", "annotated_transformer", *argv], cwd=place, input=stdin or b"",
                              capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})

    cases = [case for case in CASES if case[0] not in SKIP]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip((case[0] for case in cases), pool.map(run, cases)))


def check_refusal(status, stdout: str, stderr: str, expected: str) -> None:
    assert status == 2, stderr  # the status of a user's error, also argparse's
    assert "Traceback" not in stderr, stderr
    assert expected in stderr, stderr
    assert "error: " in stderr.strip().splitlines()[-1], stderr  # the last line says what is wrong
    assert stdout == ""


def test_the_table_is_broad() -> None:
    assert len(CASES) >= 40 and len({case[0] for case in CASES + IN_PROCESS}) == len(CASES) + len(IN_PROCESS)
    assert {case[1][0] for case in CASES if case[1]} >= {"train", "translate", "evaluate", "bench", "tangle"}


@pytest.mark.parametrize("name, expected", [
    pytest.param(name, expected, id=name, marks=[pytest.mark.skip(reason=SKIP[name])] if name in SKIP else [])
    for name, _, expected, _ in CASES])
def test_bad_input_is_refused_clearly(outcomes, name: str, expected: str) -> None:
    result = outcomes[name]
    check_refusal(result.returncode, result.stdout.decode("utf-8", "replace"), result.stderr.decode("utf-8", "replace"),
                  expected)


@pytest.mark.parametrize("argv, expected, stdin", [pytest.param(*case[1:], id=case[0]) for case in IN_PROCESS])
def test_bad_input_is_refused_clearly_in_process(place, monkeypatch, capsys, argv, expected, stdin) -> None:
    monkeypatch.chdir(place)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8"))
    threads = torch.get_num_threads()
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's refusals, and the benchmark harness's
        status = exit_.code
        if isinstance(status, str):  # as the interpreter does with it
            print(status, file=sys.stderr)
            status = 1
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    check_refusal(status, captured.out, captured.err, expected)


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)] + (
    [(signal.SIGHUP, 129)] if hasattr(signal, "SIGHUP") else []))
def test_a_signal_stops_a_run_after_its_step_saving_it(tmp_path, signum, status) -> None:
    """Ctrl-C or SIGTERM: the step ends, its checkpoint is written, one line names it, the exit status is the
    shell's for that signal, and the run resumes from there."""
    command = ["train", "--profile", "quick", "--d-model", "16", "--layers", "1", "--device", "cpu",
               "--checkpoint-dir", "run"]
    process = subprocess.Popen([sys.executable, "-m", "annotated_transformer", *command, "--steps", "100000"],
                               cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1"},
                               # A shell's background job (`make test &`) ignores SIGINT, and a child inherits that:
                               # give the run the default disposition, as a terminal would.
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        process.stderr.read(1)  # the progress bar has appeared: training runs
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    text = stderr.decode()
    assert process.returncode == status, text
    assert "Traceback" not in text
    stopped = re.search(rf"interrupted: stopped by {signal.Signals(signum).name} after step (\d+); its "
                        r"checkpoint is (\S+) \(resume from it\)", text)
    assert stopped, text
    step = int(stopped[1])
    assert (tmp_path / stopped[2]).is_file() and stopped[2].endswith(f"{step:08d}.pt")
    assert not (tmp_path / "run" / ".run.lock").exists()  # the folder is released
    resumed = subprocess.run([sys.executable, "-m", "annotated_transformer", *command, "--resume",
                              "--steps", str(step + 1), "--no-progress"], cwd=tmp_path, capture_output=True,
                             timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr.decode()
    assert f"steps: {step + 1}," in resumed.stdout.decode()


SLOW_WRITE = """
import sys, time
from annotated_transformer import cli, trainer
real_write, real_steps = trainer.write_state, trainer.accumulate_gradients

real_copy = trainer.cpu_copy

def slow_write(path, state):  # a large checkpoint on a slow disk
    print("writing", file=sys.stderr, flush=True)
    time.sleep(2)
    return real_write(path, state)

def slow_copy(value):  # a large model copied from a GPU, before the writer's thread
    if isinstance(value, dict) and "rng" in value:  # the state (not its parts: recursive)
        print("writing", file=sys.stderr, flush=True)
        time.sleep(2)
    return real_copy(value)

def first_step(*args, **kwargs):
    trainer.accumulate_gradients = real_steps
    print("training", file=sys.stderr, flush=True)
    return real_steps(*args, **kwargs)

trainer.accumulate_gradients = first_step
if sys.argv[1] == "write":
    trainer.write_state = slow_write
else:
    trainer.cpu_copy = slow_copy
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("slow", ["write", "copy"])
def test_a_second_signal_during_the_interrupt_checkpoint_waits_for_its_write(tmp_path, slow) -> None:
    """SIGTERM, then SIGTERM again while the stopped run writes its checkpoint: the run used to abort from inside
    PyTorch (exit 134, 'terminate called without an active exception'), leaving a temporary file and no checkpoint.
    The write now ends first; the message names the checkpoint, which reads back, and no temporary file is left."""
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITE, slow, "train", "--profile", "quick", "--d-model", "16", "--layers", "1",
         "--device", "cpu", "--checkpoint-dir", "run", "--checkpoint-every", "100000", "--steps", "100000",
         "--no-progress"],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert process.stderr.readline().strip() == b"training"
        process.send_signal(signal.SIGTERM)
        assert process.stderr.readline().strip() == b"writing"  # the interrupt's checkpoint
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)  # again, while it writes
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    text = stderr.decode()
    assert process.returncode == 143, text
    assert "Traceback" not in text and "terminate called" not in text
    assert slow == "write" or "stopping: once the checkpoint is written" in text  # the second signal is answered
    stopped = re.search(r"its checkpoint is (\S+) \(resume from it\)", text)
    assert stopped, text
    assert load_checkpoint(tmp_path / stopped[1])["step"] >= 1
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [Path(stopped[1]).name]


# --- issue 21: the environment, closed streams, pipes, and the line between a user's error and a bug ------------


def shell(place: Path, argv: list[str], redirect: str = "", env: dict | None = None, stdin: bytes = b"",
          ) -> subprocess.CompletedProcess:
    """Run the command line as a shell would, with a ``redirect`` such as ``<&-`` (standard input closed)."""
    command = f'exec "$@" {redirect}'
    return subprocess.run(["sh", "-c", command, "sh", sys.executable, "-m", "annotated_transformer", *argv],
                          cwd=place, input=stdin, capture_output=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "RANK", "LOCAL_RANK"])
def test_a_bad_torchrun_variable_is_named(place, variable) -> None:
    result = shell(place, train(), env={variable: "abc"})
    check_refusal(result.returncode, result.stdout.decode(), result.stderr.decode(),
                  f"${variable} must be a whole number: 'abc'")


def test_the_translation_task_under_torchrun_is_refused_before_any_work(place) -> None:
    """Only the copy task trains with DistributedDataParallel: every rank of a translation run would prepare the data
    and train alone, on one device, into one folder."""
    result = shell(place, multi30k(), env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    check_refusal(result.returncode, result.stdout.decode(), result.stderr.decode(),
                  "--task multi30k trains on one device: run it without torchrun")
    assert not (place / "run").exists()


def test_a_resume_of_a_folder_that_does_not_exist_makes_no_folder(place) -> None:
    result = shell(place, train("--resume", "--checkpoint-dir", "typo/run"))
    check_refusal(result.returncode, result.stdout.decode(), result.stderr.decode(),
                  "typo/run holds no checkpoint to resume: no such folder")
    assert not (place / "typo").exists()  # a mistyped path leaves nothing behind


def test_at_device_meta_is_one_line(place) -> None:
    result = shell(place, translate(), env={"AT_DEVICE": "meta"}, stdin=b"3 4\n")
    check_refusal(result.returncode, result.stdout.decode(), result.stderr.decode(), "is not one this book runs on")


def test_a_closed_standard_input_is_one_line(place) -> None:
    result = shell(place, translate(), redirect="<&-")
    check_refusal(result.returncode, result.stdout.decode(), result.stderr.decode(), "standard input is closed")


def test_a_closed_standard_output_is_one_line(place) -> None:
    result = shell(place, translate("--input", "a_file.txt"), redirect=">&-")
    assert result.returncode == 2 and result.stdout == b""
    assert result.stderr.decode().strip() == "error: standard output is closed"


def test_a_closed_standard_error_is_named_on_standard_output(place) -> None:
    """It was reported as "standard output is closed", on the standard output that was open."""
    result = shell(place, translate("--input", "a_file.txt"), redirect="2>&-")
    assert result.returncode == 2 and result.stdout.decode().strip() == "error: standard error is closed"


def test_a_closed_pipe_is_one_line(place) -> None:
    """`translate ... | head -0`: the reader has gone; one line, and no second complaint at exit."""
    lines = b"".join(b"3 4 5\n" for _ in range(20000))
    result = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -c 0', "sh", sys.executable, "-m",
                             "annotated_transformer", *translate("--beam-size", "1", "--batch-size", "1000")],
                            cwd=place, input=lines, capture_output=True, timeout=300)
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert stderr == "" or stderr.strip() == "error: Broken pipe, writing standard output", stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_pipes_fifos_and_dev_stdin_are_read(place, tmp_path) -> None:
    """Issue 21 (defect 7): `--input <(...)`, a FIFO and /dev/stdin used to be refused as "no file at"."""
    substitution = subprocess.run(
        ["bash", "-c", 'exec "$@" --input <(printf "3 4 5\\n")', "sh", sys.executable, "-m", "annotated_transformer",
         *translate("--beam-size", "1")], cwd=place, capture_output=True, timeout=300)
    assert substitution.returncode == 0, substitution.stderr.decode()
    assert len(substitution.stdout.decode().split()) == 3
    piped = shell(place, translate("--beam-size", "1", "--input", "/dev/stdin"), stdin=b"3 4\n5 6 7\n")
    assert piped.returncode == 0, piped.stderr.decode()
    assert [len(line.split()) for line in piped.stdout.decode().splitlines()] == [2, 3]
    marked = shell(place, translate("--beam-size", "1"), stdin=b"\xef\xbb\xbf3 4\n")  # a byte-order mark
    assert marked.returncode == 0 and len(marked.stdout.split()) == 2, marked.stderr.decode()
    fifo = tmp_path / "sentences"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(b"3 4\n5 6 7 8\n"))
    writer.start()
    result = shell(place, translate("--beam-size", "1", "--input", str(fifo)))
    writer.join()
    assert result.returncode == 0, result.stderr.decode()
    assert [len(line.split()) for line in result.stdout.decode().splitlines()] == [2, 4]
    missing = shell(place, translate("--input", "/dev/fd/99"))
    check_refusal(missing.returncode, missing.stdout.decode(), missing.stderr.decode(), "no file at /dev/fd/99")


@pytest.mark.parametrize("bug", [KeyError("config"), TypeError("unsupported operand"), AttributeError("x"),
                                 RuntimeError("expected scalar type Float but found Double"), ZeroDivisionError()])
def test_a_bug_of_ours_keeps_its_traceback(monkeypatch, bug) -> None:
    """What a user's input or environment causes is one line; anything else is a bug, which must not be hidden."""
    import annotated_transformer.cli as cli

    def broken(args):
        raise bug

    monkeypatch.setattr(cli, "run_tangle", broken)
    with pytest.raises(type(bug)):
        main(["tangle", "--check"])


@pytest.mark.parametrize("error, expected", [
    (ValueError("bad value\nsecond line"), "error: bad value second line"),
    (MemoryError("the model (src_vocab=9) has about"), "error: the model (src_vocab=9) has about"),
    (MemoryError(), "error: out of memory for the sizes asked for (MemoryError)"),  # Python's own: no text
    (OSError(28, "No space left on device"), "error: No space left on device, writing standard output"),
    (OSError(28, "No space left on device", "run/.average.pt.ab12cd.tmp"),
     "error: run/average.pt: No space left on device"),
    (OSError(5, "Input/output error"), "error: Input/output error (with no file named)"),
    (FileNotFoundError("no file at x.txt"), "error: no file at x.txt"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 80000000000000 bytes."),
     "error: out of memory for the sizes asked for ([enforce fail at alloc_cpu.cpp:127] err == 0. "
     "DefaultCPUAllocator: can't allocate memory: you tried to allocate 80000000000000 bytes.)"),
])
def test_a_users_error_is_one_line_naming_the_place(monkeypatch, capsys, error, expected) -> None:
    import annotated_transformer.cli as cli

    def failing(args):
        raise error

    monkeypatch.setattr(cli, "run_tangle", failing)
    assert main(["tangle", "--check"]) == 2
    assert capsys.readouterr().err == expected + "\n"


def test_a_full_disk_without_a_file_names_the_places_written(monkeypatch, capsys, tmp_path) -> None:
    import annotated_transformer.cli as cli

    def full(args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "run_bench", full)
    assert main(["bench", "--smoke", "--json", str(tmp_path / "b.json")]) == 2
    assert capsys.readouterr().err == f"error: No space left on device, writing {tmp_path / 'b.json'} (--json)\n"
