"""The command line keeps what must be kept (book/appendix_data.md, book/checkpoints.md, book/cli.md): an output never
replaces an input of the same command, a file of a training run or a Multi30k file; a run that stopped before its
first checkpoint can be resumed; a resume below the step reached is refused; a warning is one line."""
from __future__ import annotations

import argparse
import shutil

import pytest
import torch

from annotated_transformer.checkpoints import save_checkpoint
from annotated_transformer.folders import latest_checkpoint
from annotated_transformer.cli import main
from annotated_transformer.download import DATA_ENV, check_places
from annotated_transformer.model import make_model

from local_data import FOLDER, needs_data

COPY = ["train", "--task", "copy", "--profile", "quick", "--d-model", "16", "--layers", "1", "--batch-size", "8", "--warmup", "1",
        "--no-progress", "--device", "cpu"]


def refused(argv, capsys) -> str:
    """The one line that ``main(argv)`` refuses with (status 2, no traceback, nothing on standard output)."""
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert "error" not in captured.out and "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A German and an English file, a finished run's folder, and a data folder of its own."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "de.txt").write_text("Ein Hund.\n")
    (tmp_path / "en.txt").write_text("A dog.\n")
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint(run / "average.pt", model=make_model(11, 11, N=1, d_model=16, d_ff=32, h=2))
    save_checkpoint(run / "step_00000002.pt", model=make_model(11, 11, N=1, d_model=16, d_ff=32, h=2))
    shutil.copy(run / "average.pt", tmp_path / "model.pt")  # a checkpoint by its contents, not its name
    (tmp_path / "record.json").write_text('{"command": "python -m annotated_transformer train", "test": {}}')
    (tmp_path / "bench.json").write_text('{"meta": {"command": "python -m annotated_transformer bench", '
                                         '"device_name": "cpu (2 threads)"}, "training": []}')
    data = tmp_path / "data"
    data.mkdir()
    (data / "val.en.gz").write_bytes(b"corpus")
    monkeypatch.setenv(DATA_ENV, str(data))
    return tmp_path


@pytest.mark.parametrize("argv, expected", [
    (["evaluate", "--checkpoint", "run/average.pt", "--source", "de.txt", "--reference", "en.txt",
      "--output", "de.txt"], "de.txt (--output) is the file given to --source: writing it would destroy it"),
    (["evaluate", "--checkpoint", "run/average.pt", "--source", "de.txt", "--reference", "en.txt",
      "--output", "en.txt"], "en.txt (--output) is the file given to --reference"),
    (["evaluate", "--checkpoint", "run/average.pt", "--source", "de.txt", "--reference", "en.txt",
      "--output", "run/average.pt"], "is the file given to --checkpoint"),
    (["bench", "--smoke", "--json", "run/step_00000002.pt"], "would replace step_00000002.pt, a file of a training run"),
    ([*COPY, "--steps", "1", "--results", "run/average.pt"], "would replace average.pt, a file of a training run"),
    (["evaluate", "--checkpoint", "run/average.pt", "--source", "de.txt", "--reference", "en.txt",
      "--output", "model.pt"], "model.pt (--output) is a PyTorch checkpoint: writing it would destroy it"),
    (["bench", "--smoke", "--json", "model.pt"], "model.pt (--json) is a PyTorch checkpoint"),
    (["evaluate", "--checkpoint", "run/average.pt", "--source", "de.txt", "--reference", "en.txt",
      "--output", "record.json"], "record.json (--output) is a results record: writing it would destroy it"),
    (["evaluate", "--checkpoint", "run/average.pt", "--source", "de.txt", "--reference", "en.txt",
      "--output", "bench.json"], "bench.json (--output) is a benchmark record: writing it would destroy it"),
    (["bench", "--smoke", "--json", "record.json"], "record.json (--json) is a results record"),
    (["evaluate", "--checkpoint", "run/average.pt", "--split", "valid", "--output", "data/val.en.gz"],
     "data/val.en.gz (--output) is in a folder of the Multi30k files"),
])
def test_an_output_never_replaces_a_file_that_must_be_kept(files, capsys, argv, expected) -> None:
    before = {path: path.read_bytes() for path in files.rglob("*") if path.is_file()}
    assert expected in refused(argv, capsys)
    assert {path: path.read_bytes() for path in files.rglob("*") if path.is_file()} == before


def test_an_ordinary_existing_output_may_be_replaced(files) -> None:
    (files / "results.json").write_text("{}")
    check_places(argparse.Namespace(json="results.json", output="new/out.txt", checkpoint="run/average.pt"))
    check_places(argparse.Namespace(json="bench.json"))  # a benchmark's record: bench --json replaces it


def test_a_run_stopped_before_its_first_checkpoint_is_resumed_with_a_one_line_warning(tmp_path, capsys) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(b"written before the run stopped")
    argv = [*COPY, "--steps", "2", "--checkpoint-dir", str(folder)]
    assert "already holds tokenizer.model" in refused(argv, capsys)  # a new run is still refused
    assert main([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {folder} holds no checkpoint, only tokenizer.model: the run stopped before" in err
    assert "UserWarning" not in err and "warnings.warn" not in err  # one line, not Python's two
    assert latest_checkpoint(folder).name == "step_00000002.pt"


def test_a_resume_below_the_step_reached_is_refused(tmp_path, capsys) -> None:
    argv = [*COPY, "--checkpoint-dir", str(tmp_path / "run")]
    assert main([*argv, "--steps", "2"]) == 0
    capsys.readouterr()
    line = refused([*argv, "--steps", "1", "--resume"], capsys)
    assert "steps (1) is below the step that the checkpoint reached (2)" in line


@needs_data
def test_a_batch_budget_smaller_than_a_sentence_is_refused_before_a_folder_is_made(tmp_path, monkeypatch,
                                                                                   capsys) -> None:
    monkeypatch.setenv(DATA_ENV, str(FOLDER))
    monkeypatch.setenv("ANNOTATED_TRANSFORMER_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    line = refused(["train", "--task", "multi30k", "--profile", "quick", "--steps", "2", "--train-limit", "200",
                    "--vocab-size", "500", "--no-progress", "--max-tokens", "1", "--device", "cpu",
                    "--checkpoint-dir", str(tmp_path / "run")], capsys)
    assert "--max-tokens must be at least 30, got 1" in line  # by the configuration: before the data is read
    assert not (tmp_path / "run").exists()
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_a_dangling_link_is_named_as_one(tmp_path, capsys) -> None:
    (tmp_path / "dangling").symlink_to(tmp_path / "does_not_exist")
    line = refused([*COPY, "--steps", "1", "--checkpoint-dir", str(tmp_path / "dangling")], capsys)
    assert f"(--checkpoint-dir) links to {tmp_path / 'does_not_exist'}, which does not exist" in line
