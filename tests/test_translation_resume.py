"""A Multi30k run folder is one run's (book/translation.md, issue 21): a resume must repeat the settings that shaped
its checkpoints, every checkpoint names its task and its tokenizer, the tokenizer file and valid.json stay exact,
and the options that would fail late are refused before anything is trained or made.

Tiny runs (a 32-wide model, a few dozen steps on a slice of the data, on the CPU); data from the
folder that tests/local_data.py finds, tokenizers in a temporary cache.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from annotated_transformer import data
from annotated_transformer.checkpoints import load_checkpoint, write_state
from annotated_transformer.folders import list_checkpoints
from annotated_transformer.cli import main
from annotated_transformer.data import checkpoint_tokenizer, tokenizer_digest
from annotated_transformer.records import record_experiment
from annotated_transformer.translation import load_translator, run_settings, train_translator, translation_config

from local_data import FOLDER, ROOT, needs_data  # noqa: F401
from test_translation import environment  # noqa: F401 (a fixture: the data and a fresh cache)

pytestmark = needs_data

TINY = dict(vocab_size=500, train_limit=2000, max_len=20, N=1, d_model=32, d_ff=64, h=2, dropout=0.0,
            max_tokens=600, steps=20, warmup=10, factor=0.5, checkpoint_every=5, average=2, eval_every=10,
            valid_limit=30, test_limit=4, beam_size=2)
QUIET = dict(device="cpu", progress=False, log=lambda message: None)


@pytest.fixture(scope="module")
def finished(environment, tmp_path_factory):
    """A finished tiny run of 20 steps: (its folder, what train_translator returned)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("finished") / "run"
    return folder, train_translator(translation_config("quick", **TINY), folder, **QUIET)


def copy_of(finished, tmp_path) -> Path:
    shutil.copytree(finished[0], tmp_path / "run")
    return tmp_path / "run"


def untouched(folder: Path):
    return {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}


# 2: resume with other settings ------------------------------------------------------------------------------------

def test_step_checkpoints_record_the_settings_task_and_tokenizer(finished):
    folder, trained = finished
    digest = tokenizer_digest(folder / "tokenizer.model")
    for path in [*list_checkpoints(folder), folder / "average.pt"]:
        extra = load_checkpoint(path)["extra"]
        assert extra["task"] == "multi30k" and extra["tokenizer_sha256"] == digest, path.name
    settings = load_checkpoint(list_checkpoints(folder)[-1])["extra"]["settings"]
    assert settings == run_settings(translation_config("quick", **TINY))
    assert {"factor", "warmup", "smoothing", "max_tokens", "seed", "train_limit", "vocab_size", "d_model",
            "N", "valid_limit"} <= set(settings)
    assert "steps" not in settings and "beam_size" not in settings        # a resume may raise steps, evaluate anew
    assert settings["decay"] == "inverse_sqrt"
    assert digest == tokenizer_digest(trained["tokenizer"].processor)


@pytest.mark.parametrize("changes", [dict(factor=1.0), dict(warmup=5), dict(smoothing=0.2), dict(max_tokens=700),
                                     dict(seed=1), dict(train_limit=1500), dict(vocab_size=400),
                                     dict(d_ff=128, valid_limit=20), dict(decay="linear")])
def test_a_resume_with_other_settings_is_refused_naming_each_difference(finished, tmp_path, monkeypatch, changes):
    from annotated_transformer import translation

    folder = copy_of(finished, tmp_path)
    before = untouched(folder)
    monkeypatch.setattr(translation, "train", lambda *args, **kwargs: pytest.fail("trained with other settings"))
    config = translation_config("quick", **dict(TINY, steps=30, **changes))
    with pytest.raises(ValueError, match="holds a run with other settings") as error:
        train_translator(config, folder, resume=True, **QUIET)
    before_settings = run_settings(translation_config("quick", **TINY))
    for key, value in changes.items():
        assert f"{key} (checkpoint {before_settings[key]!r}, this run {value!r})" in str(error.value)
    assert untouched(folder) == before


def test_a_model_that_cannot_be_built_is_refused_before_its_folder_is_made(environment, tmp_path):
    """An odd d_model (sinusoidal positions come in pairs) is refused before the run folder and its tokenizer file
    exist: the same command, corrected, then starts a new run instead of being told to resume one. The settings
    refuse it first, when made; a model that make_model refuses (here the same one, let past the settings' check)
    is refused before the folder too."""
    with pytest.raises(ValueError, match="d_model must be even, got 33"):
        translation_config("quick", **dict(TINY, d_model=33, h=3))
    config = translation_config("quick", **dict(TINY, d_model=32, h=4))
    object.__setattr__(config, "d_model", 33)  # past the settings' own check (a frozen dataclass)
    object.__setattr__(config, "h", 3)
    with pytest.raises(ValueError, match="d_model must be even"):
        train_translator(config, tmp_path / "run", **QUIET)
    assert not (tmp_path / "run").exists()


def test_a_resume_in_a_folder_that_does_not_exist_is_refused_before_the_data_work(tmp_path, monkeypatch):
    """A mistyped --resume folder is refused at once, not after the data is read, encoded and the model built."""
    import annotated_transformer.translation as translation

    def no_data(config):
        raise AssertionError("the data was prepared although the resume should have been refused")

    monkeypatch.setattr(translation, "prepare_data", no_data)
    with pytest.raises(FileNotFoundError, match="/typo holds no checkpoint to resume: no such folder"):
        train_translator(translation_config("quick", **TINY), tmp_path / "typo", resume=True, **QUIET)
    assert main(["train", "--task", "multi30k", "--profile", "quick", "--device", "cpu", "--no-progress",
                 "--resume", "--checkpoint-dir", str(tmp_path / "typo")]) == 2
    assert not (tmp_path / "typo").exists()


def test_a_linear_decay_resumes_only_to_the_steps_it_decays_over(environment, tmp_path):
    """A linear decay reaches zero at its ``steps``: a resume with more steps would restart the decay from near
    zero under a schedule that neither part followed, so it is refused, naming both; equation (3) has no end."""
    torch.set_num_threads(1)
    config = translation_config("quick", **dict(TINY, decay="linear"))
    train_translator(config, tmp_path / "run", **QUIET)
    before = untouched(tmp_path / "run")
    with pytest.raises(ValueError, match=r"holds a run with other settings .*steps \(checkpoint 20, this run 30\)"):
        train_translator(replace(config, steps=30), tmp_path / "run", resume=True, **QUIET)
    assert untouched(tmp_path / "run") == before
    assert "steps" in run_settings(config) and "steps" not in run_settings(replace(config, decay="inverse_sqrt"))


def test_a_folder_without_a_decay_setting_resumes_as_equation_3_and_refuses_a_linear_decay(finished, tmp_path):
    folder = copy_of(finished, tmp_path)
    for path in list_checkpoints(folder):  # as in the folders of runs from before the setting
        checkpoint = load_checkpoint(path)
        del checkpoint["extra"]["settings"]["decay"], checkpoint["checksum"]
        write_state(path, checkpoint)
    before = untouched(folder)
    config = translation_config("quick", **dict(TINY, steps=30, decay="linear"))
    with pytest.raises(ValueError, match=r"holds a run with other settings \(step_00000020.pt\): decay "
                                         r"\(checkpoint 'inverse_sqrt', this run 'linear'\)"):
        train_translator(config, folder, resume=True, **QUIET)
    assert untouched(folder) == before
    again = train_translator(translation_config("quick", **dict(TINY, steps=25)), folder, resume=True, **QUIET)
    assert again["history"]["step"][-1] == 25


def test_a_resume_with_fewer_steps_than_reached_is_refused(finished, tmp_path):
    folder = copy_of(finished, tmp_path)
    before = untouched(folder)
    with pytest.raises(ValueError, match=r"steps \(15\) is below the step that the run in .* reached \(20\)"):
        train_translator(translation_config("quick", **dict(TINY, steps=15)), folder, resume=True, **QUIET)
    assert untouched(folder) == before


def test_a_resume_may_change_the_evaluation_and_raise_steps(finished, tmp_path):
    folder = copy_of(finished, tmp_path)
    again = train_translator(translation_config("quick", **dict(TINY, steps=30, beam_size=3, length_penalty=1.0)),
                             folder, resume=True, **QUIET)
    assert again["valid"]["step"] == [10, 20, 30] and again["history"]["step"][-1] == 30


def test_the_command_line_refuses_a_resume_with_another_factor(finished, tmp_path, capsys):
    folder = copy_of(finished, tmp_path)
    options = ["--profile", "quick", "--vocab-size", "500", "--train-limit", "2000", "--max-len", "20", "--layers",
               "1", "--d-model", "32", "--d-ff", "64", "--heads", "2", "--max-tokens", "600", "--warmup", "10",
               "--checkpoint-every", "5", "--average", "2", "--eval-every", "10", "--valid-limit", "30",
               "--dropout", "0", "--steps", "20", "--no-progress", "--device", "cpu"]
    code = main(["train", "--task", "multi30k", *options, "--factor", "0.9", "--resume",
                 "--checkpoint-dir", str(folder)])
    err = capsys.readouterr().err
    assert code != 0 and "factor (checkpoint 0.5, this run 0.9)" in err and "Traceback" not in err


# 10: a checkpoint without its tokenizer, or with another ---------------------------------------------------------

def test_a_step_checkpoint_moved_away_from_its_tokenizer_is_refused_not_taken_for_the_copy_task(finished, tmp_path,
                                                                                               capsys):
    folder, _ = finished
    moved = tmp_path / "step.pt"
    shutil.copy(list_checkpoints(folder)[-1], moved)
    with pytest.raises(ValueError, match="holds no tokenizer and there is no tokenizer.model beside it"):
        checkpoint_tokenizer(load_checkpoint(moved), moved)
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_translator(moved, device="cpu")
    (tmp_path / "in.txt").write_text("5 17 300\n", encoding="utf-8")
    code = main(["translate", "--checkpoint", str(moved), "--input", str(tmp_path / "in.txt"), "--device", "cpu"])
    captured = capsys.readouterr()
    assert code != 0 and captured.out == "" and "holds no tokenizer" in captured.err


@pytest.mark.parametrize("kind", ["another run's", "damaged"])
def test_a_step_checkpoint_beside_another_or_a_damaged_tokenizer_is_refused(finished, environment, tmp_path, kind):
    folder, _ = finished
    shutil.copy(list_checkpoints(folder)[-1], tmp_path / "step.pt")
    if kind == "damaged":
        model = (folder / "tokenizer.model").read_bytes()
        (tmp_path / "tokenizer.model").write_bytes(model[: len(model) // 2])
    else:  # a tokenizer of the same size, trained on other text
        pairs = data.load_split("train")[:1000]
        shutil.copy(data.train_tokenizer(pairs, vocab_size=500, directory=tmp_path / "other"),
                    tmp_path / "tokenizer.model")
    with pytest.raises(ValueError, match=r"tokenizer.model is not the tokenizer .*step.pt was trained with .*"
                                         r"put that run's tokenizer.model beside it, or use its average.pt"):
        load_translator(tmp_path / "step.pt", device="cpu")


# 5, 12: the tokenizer file beside the checkpoints ----------------------------------------------------------------

def test_a_damaged_tokenizer_file_of_a_run_is_written_again_on_resume(finished, tmp_path, monkeypatch):
    folder = copy_of(finished, tmp_path)
    good = (folder / "tokenizer.model").read_bytes()
    (folder / "tokenizer.model").write_bytes(good[:100])
    written, messages = [], []
    original = data.write_atomically
    monkeypatch.setattr(data, "write_atomically", lambda path, *a, **k: written.append(Path(path).name)
                        or original(path, *a, **k))
    train_translator(translation_config("quick", **TINY), folder, resume=True,
                     **dict(QUIET, log=messages.append))
    assert (folder / "tokenizer.model").read_bytes() == good
    assert written == ["tokenizer.model"]                           # atomically, with the checkpoints' helper
    assert any("tokenizer.model was damaged: it is written again" in m for m in messages)


# 4: vocabulary sizes that SentencePiece cannot make ---------------------------------------------------------------

@pytest.mark.parametrize("size, message", [(9, r"vocab_size must be at least \d+ for this text"),
                                           (100_000, r"vocab_size must be at most \d+ for this text")])
def test_a_vocabulary_size_out_of_sentencepieces_limits_is_refused_and_makes_no_folder(environment, tmp_path, size,
                                                                                       message):
    config = translation_config("quick", **dict(TINY, vocab_size=size))
    with pytest.raises(ValueError, match=message + r".*got " + str(size)):
        train_translator(config, tmp_path / "run", **QUIET)
    assert not (tmp_path / "run").exists()


# 8: the results file in the run folder ----------------------------------------------------------------------------

@pytest.mark.parametrize("place", ["run", "run/results.json", "run/sub/results.json"])
def test_a_results_file_in_the_run_folder_is_refused_before_anything(environment, tmp_path, place):
    with pytest.raises(ValueError, match="would lie in the run folder"):
        record_experiment(translation_config("quick", **TINY), tmp_path / "run", results_path=tmp_path / place,
                          **QUIET)
    assert not (tmp_path / "run").exists()


# 3: a length penalty that would overflow --------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", ["1000", "1e308", "nan", "inf"])
def test_the_command_line_refuses_an_overflowing_length_penalty_before_training(tmp_path, capsys, alpha):
    try:
        code = main(["train", "--task", "multi30k", "--profile", "quick", "--length-penalty", alpha,
                     "--checkpoint-dir", str(tmp_path / "run"), "--no-progress"])
    except SystemExit as exit:  # refused by the parser (nan, inf)
        code = exit.code
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and "length" in err
    assert not (tmp_path / "run").exists()


# 13: valid.json after a resume ------------------------------------------------------------------------------------

def test_valid_json_after_a_fall_back_past_a_damaged_checkpoint_has_no_duplicate(finished, tmp_path):
    folder = copy_of(finished, tmp_path)
    last = list_checkpoints(folder)[-1]
    last.write_bytes(last.read_bytes()[:1000])                         # step 20 damaged: resume from step 15
    with pytest.warns(UserWarning, match="skipped 1 damaged checkpoint"):
        again = train_translator(translation_config("quick", **TINY), folder, resume=True, **QUIET)
    assert again["valid"]["step"] == [10, 20]
    assert json.loads((folder / "valid.json").read_text())["step"] == [10, 20]


def test_valid_json_missing_its_last_point_is_measured_again(finished, tmp_path):
    folder, trained = finished
    folder = copy_of(finished, tmp_path)
    (folder / "valid.json").write_text(json.dumps({"step": [10], "loss": [trained["valid"]["loss"][0]]}))
    again = train_translator(translation_config("quick", **TINY), folder, resume=True, **QUIET)
    assert again["valid"]["step"] == [10, 20]
    assert again["valid"]["loss"] == pytest.approx(trained["valid"]["loss"], abs=1e-6)


def test_a_deleted_valid_json_is_rebuilt_from_the_checkpoints(finished, tmp_path):
    folder, trained = finished
    folder = copy_of(finished, tmp_path)
    (folder / "valid.json").unlink()
    again = train_translator(translation_config("quick", **dict(TINY, steps=30)), folder, resume=True, **QUIET)
    assert again["valid"]["step"] == [10, 20, 30]
    assert again["valid"]["loss"][:2] == pytest.approx(trained["valid"]["loss"], abs=1e-6)


def test_a_copy_task_folder_resumed_as_a_translation_is_refused_before_any_write(environment, tmp_path, capsys):
    """A copy-task run's folder, resumed as a Multi30k run with options that match the settings the two tasks share:
    the refusal (another model configuration) came after the tokenizer had been written into the folder, and the copy
    run's checkpoints then read as a translator's (translate failed on them). Refused now before any write."""
    torch.set_num_threads(1)
    folder = tmp_path / "copy"
    assert main(["train", "--profile", "quick", "--steps", "4", "--checkpoint-dir", str(folder), "--device", "cpu",
                 "--no-progress", "--checkpoint-every", "2"]) == 0
    before = untouched(folder)
    status = main(["train", "--task", "multi30k", "--profile", "quick", "--steps", "8", "--resume",
                   "--checkpoint-dir", str(folder), "--device", "cpu", "--no-progress", "--no-norm-first",
                   "--d-model", "32", "--d-ff", "64", "--dropout", "0.1", "--attention-dropout", "0.1",
                   "--activation-dropout", "0.1", "--factor", "0.5", "--smoothing", "0", "--warmup", "100",
                   "--train-limit", "2000", "--valid-limit", "30", "--checkpoint-every", "2"])
    assert status != 0 and "another model configuration" in capsys.readouterr().err
    assert untouched(folder) == before and not (folder / "tokenizer.model").exists()
