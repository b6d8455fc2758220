"""Training, evaluating and using a Multi30k translator (book/translation.md).

A tiny end-to-end run (a few dozen steps of a 32-wide model on a slice of the data, on the CPU) goes through the
whole pipeline once per module: train, average, evaluate, write the results, reload, translate, and the `evaluate`
command. Resuming is checked against an uninterrupted run. The data come from the folder that tests/local_data.py
finds; tokenizers go to a temporary cache.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dataclasses import asdict, replace

from annotated_transformer.beam_search import strip_special, translate, translate_ids
from annotated_transformer.checkpoints import load_checkpoint, save_checkpoint
from annotated_transformer.folders import latest_checkpoint
from annotated_transformer.cli import build_parser, translation_config_from_args
from annotated_transformer.data import BOS_ID, EOS_ID
from annotated_transformer.download import DATA_ENV
from annotated_transformer.model import make_model
from annotated_transformer.records import bleu_bootstrap, record_experiment, thin
from annotated_transformer.translation import (
    PROFILES, SentencePieces, TranslationConfig, bleu, checkpoint_tokenizer, laptop_hint, load_translator,
    train_translator, run_settings, translation_config,
)
from annotated_transformer.runtime import Precision

from local_data import FOLDER, ROOT, needs_data

pytestmark = needs_data

TINY = dict(vocab_size=500, train_limit=3000, max_len=20, N=1, d_model=32, d_ff=64, h=2, dropout=0.0,
            max_tokens=600, steps=30, warmup=10, factor=0.5, checkpoint_every=5, average=2, eval_every=10,
            valid_limit=40, test_limit=12, beam_size=2)


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ANNOTATED_TRANSFORMER_CACHE", str(cache))
        patch.setenv(DATA_ENV, str(FOLDER))
        yield cache


@pytest.fixture(scope="module")
def run(environment, tmp_path_factory):
    """One tiny end-to-end run: (results, trained, checkpoint folder, results file)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("run")
    results_file = folder / "results.json"
    config = translation_config("quick", **TINY)
    results, trained = record_experiment(config, folder / "checkpoints", results_path=results_file, device="cpu",
                                         progress=False, log=lambda message: None)
    return results, trained, folder / "checkpoints", results_file


def test_config_profiles_and_overrides():
    quick, full, laptop = translation_config("quick"), translation_config("full"), translation_config("laptop")
    assert quick.profile == "quick" and full.profile == "full" and laptop.profile == "laptop"
    assert full.d_model == 512 and full.N == 3 and full.vocab_size == 8000 and full.smoothing == 0.1
    assert laptop.d_model == 256 and laptop.N == 3 and laptop.max_tokens == 2048
    assert set(asdict(PROFILES["quick"])) == set(asdict(PROFILES["full"])) == set(asdict(PROFILES["laptop"]))
    assert all(isinstance(c, TranslationConfig) for c in (quick, laptop, full))
    # one recipe: pre-norm and N(0, 1/d_model) embeddings everywhere
    assert all(c.norm_first and c.embedding_init == "normal" for c in (quick, laptop, full))
    assert translation_config("laptop", norm_first=False).norm_first is False
    with pytest.raises(TypeError, match="norm_first must be True or False"):
        translation_config("quick", norm_first="yes")
    with pytest.raises(ValueError, match="embedding_init"):
        translation_config("quick", embedding_init="uniform")
    with pytest.raises(ValueError, match="attention_dropout"):
        translation_config("quick", attention_dropout=1.0)
    assert translation_config("quick", steps=7, N=None).steps == 7  # None keeps the profile's value
    assert translation_config("quick", steps=7, N=None).N == PROFILES["quick"].N
    with pytest.raises(ValueError, match="unknown setting 'layers'"):
        translation_config("quick", layers=2)
    # validation happens inside the training loop: it need not fall on a checkpoint
    assert translation_config("quick", eval_every=30, checkpoint_every=20).eval_every == 30
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        translation_config("quick", steps=0)
    with pytest.raises(ValueError, match="dropout"):
        translation_config("quick", dropout=1.5)
    # checked once, when made: by the profiles' constructor and by any other
    with pytest.raises(ValueError, match="divisible by h"):
        translation_config("quick", d_model=66)
    with pytest.raises(ValueError, match="train_limit must be a positive integer"):
        translation_config("quick", train_limit=0)
    for alpha in (-0.1, 10.5, 1000.0, 1e308, float("nan"), float("inf")):  # 1000 overflowed in beam search
        with pytest.raises(ValueError, match=r"length_penalty must lie in \[0, 10\]"):
            translation_config("quick", length_penalty=alpha)
    assert translation_config("quick", length_penalty=10.0).length_penalty == 10.0
    with pytest.raises(ValueError, match="smoothing must be a probability in"):
        TranslationConfig(**dict(asdict(PROFILES["quick"]), smoothing=1.0))
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        translation_config("quick", max_tokens=1000.0)
    # the schedule after the warm-up: equation (3) in every profile, or a line to zero at steps
    assert all(c.decay == "inverse_sqrt" for c in (quick, laptop, full))
    assert translation_config("quick", decay="linear").decay == "linear"
    with pytest.raises(ValueError, match=r"decay must be one of \('inverse_sqrt', 'linear'\), got 'cosine'"):
        translation_config("quick", decay="cosine")
    with pytest.raises(ValueError, match=r"a linear decay needs steps \(60\) above warmup \(60\)"):
        translation_config("quick", decay="linear", steps=60)
    assert translation_config("quick", steps=60).steps == 60  # equation (3) has no end
    assert translation_config("quick", minutes=2.5).minutes == 2.5 and translation_config("quick").minutes is None
    for bad in (0, -1.0, float("nan"), float("inf"), True, "40"):
        with pytest.raises(ValueError, match="minutes must be a positive finite number, got "):
            translation_config("quick", minutes=bad)
    with pytest.raises(ValueError, match="minutes must be at most 100,000,000, got 1e"):
        translation_config("quick", minutes=1e307)  # 6e308 seconds: infinite
    for bad in (True, "0.5", float("nan"), 0):  # the check that minutes shares with factor
        with pytest.raises(ValueError, match="factor must be a positive finite number, got "):
            translation_config("quick", factor=bad)
    assert "minutes" not in run_settings(translation_config("quick", minutes=1.0))  # a resume may change it
    # the laptop profile trains by the clock, with its steps as a cap; the other profiles by their steps
    assert (laptop.minutes, laptop.steps) == (38.0, 5000) and quick.minutes is None and full.minutes is None
    # the records keep the configuration as a dict with the same keys, in the same order: the headline record is
    # the profile's own run
    recorded = json.loads((ROOT / "book" / "results" / "multi30k-laptop.json").read_text())["config"]
    assert list(asdict(laptop)) == list(recorded) and asdict(laptop) == recorded
    # the record it replaced is older than the decay and minutes settings, and trained 3,200 steps of equation (3)
    older = json.loads((ROOT / "book" / "results" / "earlier" / "3200-steps" / "multi30k-laptop.json").read_text())
    expected = {key: value for key, value in asdict(laptop).items() if key not in ("decay", "minutes")}
    assert older["config"] == {**expected, "steps": 3200}
    assert translation_config("laptop", steps=400, average=1).changed() == ["average", "steps"]


def test_a_laptop_run_in_fp32_says_what_the_chapter_found(monkeypatch, tmp_path):
    import annotated_transformer.translation as translation
    laptop, fp32 = PROFILES["laptop"], Precision("cpu")
    recipe = "--max-tokens 1024 --dropout 0.1 --average 10"
    # nothing asked for: --amp where the CPU computes bfloat16 natively (PyTorch's kernels and the CPU's
    # instructions), else the fp32 recipe: an AVX-512 CPU without BF16 has the kernels but not the instructions
    cases = {(True, True): "--amp (bf16 autocast)", (True, False): recipe, (True, None): recipe,
             (False, True): recipe, (None, True): recipe, (False, False): recipe}
    for (kernels, instructions), expected in cases.items():
        monkeypatch.setattr(translation, "cpu_has_bf16_kernels", lambda: kernels)
        monkeypatch.setattr(translation, "cpu_has_bf16_instructions", lambda: instructions)
        assert expected in laptop_hint(laptop, fp32)
    monkeypatch.setattr(translation, "cpu_has_bf16_kernels", lambda: True)
    monkeypatch.setattr(translation, "cpu_has_bf16_instructions", lambda: True)
    for asked in (False, "fp32"):  # fp32 asked for, on a CPU that has the kernels: the fp32 recipe
        assert laptop_hint(laptop, fp32, asked).endswith(recipe)
    # a run that sets one of the recipe's options, another profile, bf16, a GPU: no hint
    for config in (replace(laptop, average=10), replace(laptop, max_tokens=1024), PROFILES["full"]):
        assert laptop_hint(config, fp32, False) is None
    assert laptop_hint(laptop, Precision("cpu", torch.bfloat16), True) is None
    assert laptop_hint(laptop, Precision("cuda"), None) is None
    # the run says it before any work: here the data step stops it, and no folder is made

    class Stopped(Exception):
        pass

    def stop(config):
        raise Stopped

    monkeypatch.setattr(translation, "prepare_data", stop)
    lines = []
    with pytest.raises(Stopped):
        train_translator(laptop, tmp_path / "run", device="cpu", log=lines.append)
    assert lines[1] == laptop_hint(laptop, fp32) and lines[1].startswith("hint: this CPU computes bfloat16")
    assert not (tmp_path / "run").exists()


def test_end_to_end_results(run):
    results, trained, folder, results_file = run
    assert results["profile"] == "quick" and "steps" in results["changed"]
    assert results["test"]["greedy"]["sentences"] == results["test"]["beam"]["sentences"] == 12
    for scores in (results["test"]["greedy"], results["test"]["beam"]):
        assert 0.0 <= scores["bleu"] <= scores["bleu_lowercase"] <= 100.0
        assert "case:mixed" in scores["signature"] and "tok:13a" in scores["signature"]
        assert "case:lc" in scores["signature_lowercase"]
        assert len(scores["hypotheses"]) == 12
    assert results["test"]["beam"]["beam_size"] == 2 and results["test"]["greedy"]["length_penalty"] is None
    assert results["valid"]["step"] == [10, 20, 30]
    assert results["valid"]["loss"][-1] < results["valid"]["loss"][0]
    assert trained["history"]["step"] == list(range(1, 31))
    assert trained["averaged"] == ["step_00000025.pt", "step_00000030.pt"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "average.pt", "step_00000025.pt", "step_00000030.pt", "tokenizer.model", "valid.json"]
    written = json.loads(results_file.read_text())
    assert written["config"]["d_model"] == 32 and written["device"].startswith("cpu")
    assert "hypotheses" not in written["test"]["greedy"] and len(written["examples"]) == 10
    assert written["test"]["beam"]["bleu"] == results["test"]["beam"]["bleu"]
    assert written["config"]["norm_first"] is True and written["config"]["embedding_init"] == "normal"
    assert len(written["history"]["nll"]) == len(written["history"]["step"])
    assert all(0 < n < 10 for n in written["history"]["nll"])        # nats per token, near log(500) at first
    assert written["averaging"]["checkpoints"] == [1, 2]
    assert written["averaging"]["loss"][0] == pytest.approx(written["valid_loss_last"])
    assert written["averaging"]["loss"][-1] == pytest.approx(written["valid_loss_averaged"])
    assert isinstance(written["valid_loss_shuffled_sources"], float)
    assert [a["sentence"] for a in written["attention"]] == [results["examples"][i]["source"] for i in (3, 7)]
    assert "sweep" not in written and "beam_tuned" not in written["test"]   # the quick profile does not sweep
    assert set(written["translations"]) == set(written["protocol"]) == set(written["bootstrap"]) == {"greedy", "beam"}
    assert written["translations"]["beam"][:10] == [example["beam"] for example in written["examples"]]
    assert written["bootstrap"]["beam"]["p_value"] is None and 0 <= written["bootstrap"]["greedy"]["p_value"] <= 1
    assert written["bootstrap"]["beam"]["bleu"] == pytest.approx(written["test"]["beam"]["bleu"], abs=0.01)


def test_averaged_checkpoint_is_the_mean_of_the_last_ones(run):
    _, trained, folder, _ = run
    a = torch.load(folder / "step_00000025.pt", weights_only=True)["model"]
    b = torch.load(folder / "step_00000030.pt", weights_only=True)["model"]
    averaged = torch.load(folder / "average.pt", weights_only=True)
    for key, value in averaged["model"].items():
        if value.is_floating_point():
            torch.testing.assert_close(value, (a[key] + b[key]) / 2)
    assert averaged["extra"]["task"] == "multi30k" and averaged["extra"]["tokenizer"].dtype == torch.uint8


def test_checkpoint_translates_on_its_own(run):
    _, trained, folder, _ = run
    sentences = ["Ein Hund läuft über eine Wiese.", "Zwei Männer spielen Fußball."]
    expected = translate(trained["model"], trained["tokenizer"], sentences)
    model, tokenizer, checkpoint = load_translator(folder / "average.pt", device="cpu")
    assert translate(model, tokenizer, sentences) == expected
    assert all(isinstance(s, str) for s in expected)
    # The intermediate checkpoints find the tokenizer beside them.
    model, tokenizer, _ = load_translator(folder / "step_00000030.pt", device="cpu")
    assert tokenizer.vocab_size == 500 and tokenizer.processor.get_piece_size() == 500


def test_translate_refuses_bad_input(run):
    _, trained, _, _ = run
    with pytest.raises(ValueError, match="sentence 1 is empty"):
        translate(trained["model"], trained["tokenizer"], ["Ein Hund.", "  "])
    with pytest.raises(TypeError, match="must be strings"):
        translate(trained["model"], trained["tokenizer"], [3])


def test_translate_ids_returns_pieces_without_special_symbols(run):
    _, trained, _, _ = run
    sentences = ["Eine Frau liest ein Buch auf einer Bank im Park.", "Ein Hund.", "Zwei Kinder spielen.",
                 "Ein Mann in einem roten Hemd fährt mit dem Fahrrad durch die Stadt."]
    tokenizer = trained["tokenizer"]
    sources = [ids + [EOS_ID] for ids in tokenizer.processor.encode(sentences)]
    assert sources == [tokenizer.encode(sentence) for sentence in sentences]
    for beam_size in (1, 2):
        batched = translate_ids(trained["model"], tokenizer, sources, beam_size=beam_size, batch_size=3)
        assert all(EOS_ID not in ids and BOS_ID not in ids for ids in batched)
        # Sorting by length into batches does not change the results or their order.
        assert batched == [translate_ids(trained["model"], tokenizer, [source], beam_size=beam_size)[0]
                           for source in sources]


def test_translate_command_interface_matches_translate(run, tmp_path, monkeypatch, capsys):
    """translate_lines and the `translate` command, with this chapter's tokenizer interface, found by the
    checkpoint's task (no registration at run time)."""
    from annotated_transformer.beam_search import translate_lines
    from annotated_transformer.cli import main

    _, trained, folder, _ = run
    sentences = ["Ein Hund läuft über eine Wiese.", "Zwei Männer spielen Fußball.", "Eine Frau liest."]
    checkpoint = torch.load(folder / "average.pt", weights_only=True)
    pieces = checkpoint_tokenizer(checkpoint)
    assert isinstance(pieces, SentencePieces) and pieces.encode("Ein Hund.")[-1] == EOS_ID
    for beam_size in (1, 2):
        expected = translate(trained["model"], trained["tokenizer"], sentences, beam_size=beam_size)
        lines = translate_lines(trained["model"], pieces, sentences, beam_size=beam_size)
        assert lines == expected
    (tmp_path / "de.txt").write_text("\n".join(sentences[:2] + [""] + sentences[2:]) + "\n", encoding="utf-8")
    code = main(["translate", "--checkpoint", str(folder / "average.pt"), "--input", str(tmp_path / "de.txt"),
                 "--beam-size", "2", "--device", "cpu"])
    assert code == 0
    assert capsys.readouterr().out.splitlines() == expected[:2] + [""] + expected[2:]
    # an intermediate checkpoint holds no tokenizer: a Multi30k one found without its folder is refused, and in its
    # folder it finds tokenizer.model beside it (also when it names no task, as the training loop writes them)
    step = torch.load(folder / "step_00000030.pt", weights_only=True)
    with pytest.raises(ValueError, match="holds no tokenizer"):
        checkpoint_tokenizer(dict(step, extra=dict(step["extra"], task="multi30k")))
    assert checkpoint_tokenizer(step, folder / "step_00000030.pt").vocab_size == 500
    code = main(["translate", "--checkpoint", str(folder / "step_00000030.pt"), "--input", str(tmp_path / "de.txt"),
                 "--beam-size", "1", "--device", "cpu"])
    assert code == 0 and len(capsys.readouterr().out.splitlines()) == 4


def test_load_translator_refuses_a_checkpoint_without_tokenizer(tmp_path):
    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    save_checkpoint(tmp_path / "copy.pt", model=model)
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_translator(tmp_path / "copy.pt", device="cpu")


def test_resume_continues_exactly(environment, tmp_path):
    torch.set_num_threads(1)
    quiet = dict(device="cpu", progress=False, log=lambda message: None)
    settings = dict(TINY, steps=20, test_limit=None)
    whole = train_translator(translation_config("quick", **settings), tmp_path / "whole", **quiet)
    part = train_translator(translation_config("quick", **dict(settings, steps=10)), tmp_path / "parts", **quiet)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train_translator(translation_config("quick", **settings), tmp_path / "parts", **quiet)
    began = time.perf_counter()
    resumed = train_translator(translation_config("quick", **settings), tmp_path / "parts", resume=True, **quiet)
    resuming = time.perf_counter() - began
    for key, value in whole["model"].state_dict().items():
        torch.testing.assert_close(resumed["model"].state_dict()[key], value, rtol=0, atol=0)
    assert resumed["history"]["loss"] == whole["history"]["loss"]
    assert resumed["valid"]["step"] == [10, 20]
    # the training time adds up over the two runs: the second starts from the seconds that the first one's last
    # checkpoint recorded (its history's last point), not from the first run's own clock, which also counts setting
    # up and writing that checkpoint (up to a second on a busy CI machine, more than the second run's steps take)
    assert resumed["history"]["seconds"][:10] == part["history"]["seconds"]
    assert 0 < part["history"]["seconds"][-1] < resumed["history"]["seconds"][-1]
    # as the checkpoints count it; the run's own clock also counts setting up and the last checkpoint's write, which
    # take from milliseconds to a second (a busy CI machine), and no more than the second run took
    recorded = load_checkpoint(latest_checkpoint(tmp_path / "parts"))["extra"]["train_seconds"]
    assert recorded <= resumed["train_seconds"] <= recorded + resuming
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        train_translator(translation_config("quick", **settings), tmp_path / "empty", resume=True, **quiet)


def test_bleu():
    references = ["A dog runs in the park.", "Two men are talking."]
    perfect, signature = bleu(references, references)
    assert perfect.score == pytest.approx(100.0) and "case:mixed" in signature
    shouting = [r.upper() for r in references]
    assert bleu(shouting, references)[0].score < 10
    lower, lower_signature = bleu(shouting, references, lowercase=True)
    assert lower.score == pytest.approx(100.0) and "case:lc" in lower_signature
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        bleu(references, references[:1])


def test_paired_bootstrap_of_bleu():
    pairs = [(f"s{i}", f"A dog number {i} runs across the green park .") for i in range(60)]
    good = [reference for _, reference in pairs]
    worse = [reference if i % 3 else "A cat sleeps ." for i, (_, reference) in enumerate(pairs)]
    found = bleu_bootstrap(pairs, {"worse": worse, "good": good, "same": list(good)}, baseline="good", samples=200)
    assert list(found) == ["good", "worse", "same"] and found["good"]["p_value"] is None
    assert found["good"]["bleu"] == found["same"]["bleu"] == pytest.approx(100.0)
    assert found["worse"]["bleu"] < 80 and found["worse"]["p_value"] < 0.05 and found["worse"]["ci95"] > 0
    with pytest.raises(ValueError, match="one output per pair"):
        bleu_bootstrap(pairs, {"good": good, "short": good[:-1]}, baseline="good")


def test_strip_special_and_thin():
    assert strip_special([BOS_ID, 7, 8, EOS_ID, EOS_ID], BOS_ID, EOS_ID) == [7, 8]
    assert strip_special([BOS_ID, 7, 8], BOS_ID, EOS_ID) == [7, 8]
    history = {"step": list(range(1, 1001)), "loss": [float(i) for i in range(1000)]}
    small = thin(history, points=100)
    assert len(small["step"]) == len(small["loss"]) == 100 and small["step"][-1] == 1000
    assert small["loss"][0] == pytest.approx(4.5) and small["nll"] == [] and "seconds" not in small
    timed = thin({**history, "seconds": [0.5 * i for i in range(1, 1001)]}, points=100)
    assert timed["seconds"][:2] == [5.0, 10.0] and timed["seconds"][-1] == 500.0  # each window's last


def test_command_line_train_and_evaluate(environment, tmp_path, capsys):
    torch.set_num_threads(1)
    parser = build_parser()
    options = ["--vocab-size", "500", "--train-limit", "2000", "--max-len", "20", "--layers", "1", "--d-model", "32",
               "--d-ff", "64", "--heads", "2", "--max-tokens", "600", "--steps", "10", "--warmup", "5",
               "--checkpoint-every", "5", "--eval-every", "10", "--average", "2", "--valid-limit", "20",
               "--test-limit", "8", "--beam-size", "2", "--smoothing", "0.1", "--no-progress"]
    args = parser.parse_args(["train", "--task", "multi30k", "--profile", "quick", *options,
                              "--checkpoint-dir", str(tmp_path / "run"), "--results", str(tmp_path / "r.json")])
    assert translation_config_from_args(args).N == 1 and translation_config_from_args(args).smoothing == 0.1
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "test2016 BLEU (greedy)" in out and "nrefs:1|case:mixed" in out and "average.pt" in out
    assert "by the clock" not in out  # the quick profile has no time limit
    assert json.loads((tmp_path / "r.json").read_text())["config"]["steps"] == 10
    # a time limit that the first step reaches: the run ends there, evaluated and averaged (the one checkpoint)
    args = parser.parse_args(["train", "--task", "multi30k", "--profile", "quick", *options, "--no-norm-first",
                              "--embedding-init", "xavier", "--attention-dropout", "0.1", "--activation-dropout", "0.05",
                              "--minutes", "1e-6",
                              "--checkpoint-dir", str(tmp_path / "post"), "--results", str(tmp_path / "post.json")])
    config = translation_config_from_args(args)
    assert config.norm_first is False and config.embedding_init == "xavier"
    assert args.run(args) == 0
    assert "training: 1e-06 minutes by the clock, at most 10 steps" in capsys.readouterr().out
    recorded = json.loads((tmp_path / "post.json").read_text())
    assert recorded["config"]["norm_first"] is False and "norm_first" in recorded["changed"]
    assert recorded["config"]["minutes"] == 1e-6 and "minutes" in recorded["changed"]
    assert recorded["history"]["step"] == [1] and recorded["valid"]["step"] == [1]
    assert recorded["averaged"] == ["step_00000001.pt"]
    assert load_checkpoint(tmp_path / "post" / "average.pt")["step"] == 1
    model_config = load_checkpoint(tmp_path / "post" / "average.pt")["config"]
    assert model_config["norm_first"] is False and model_config["embedding_init"] == "xavier"
    assert model_config["attention_dropout"] == 0.1 and model_config["activation_dropout"] == 0.05

    args = parser.parse_args(["evaluate", "--checkpoint", str(tmp_path / "run" / "average.pt"), "--split", "valid",
                              "--limit", "8", "--beam-size", "2", "--device", "cpu",
                              "--output", str(tmp_path / "hyp.txt")])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "valid (8 sentences, beam 2, alpha 0.6): BLEU" in out and "case:lc" in out
    assert len((tmp_path / "hyp.txt").read_text().splitlines()) == 8

    # any parallel test set: plain or gzip-compressed files, one sentence a line
    import gzip

    from annotated_transformer.data import load_split

    pairs = load_split("valid")[:6]
    (tmp_path / "src.de").write_text("".join(de + "\n" for de, _ in pairs), encoding="utf-8")
    with gzip.open(tmp_path / "ref.en.gz", "wt", encoding="utf-8") as stream:
        stream.write("".join(en + "\n" for _, en in pairs))
    checkpoint = str(tmp_path / "run" / "average.pt")
    args = parser.parse_args(["evaluate", "--checkpoint", checkpoint, "--source", str(tmp_path / "src.de"),
                              "--reference", str(tmp_path / "ref.en.gz"), "--device", "cpu"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "src.de (6 sentences, greedy): BLEU" in out and "nrefs:1|case:mixed" in out
    split_args = parser.parse_args(["evaluate", "--checkpoint", checkpoint, "--split", "valid", "--limit", "6",
                                    "--device", "cpu"])
    assert split_args.run(split_args) == 0
    assert capsys.readouterr().out.split("BLEU")[1] == out.split("BLEU")[1]   # the same six pairs, the same score
    (tmp_path / "short.en").write_text("one line\n", encoding="utf-8")
    (tmp_path / "gap.en").write_text("".join(("" if i == 2 else en) + "\n" for i, (_, en) in enumerate(pairs)))
    for extra, message in (([ "--source", str(tmp_path / "src.de")], "go together"),
                           (["--source", str(tmp_path / "src.de"), "--reference", str(tmp_path / "short.en")],
                            "has 6 lines but"),
                           (["--source", str(tmp_path / "src.de"), "--reference", str(tmp_path / "gap.en")],
                            "line 3 of"),
                           (["--source", str(tmp_path / "none.de"), "--reference", str(tmp_path / "short.en")],
                            "no file at"),
                           (["--source", str(tmp_path / "src.de"), "--reference", str(tmp_path / "ref.en.gz"),
                             "--split", "test"], "not both")):
        args = parser.parse_args(["evaluate", "--checkpoint", checkpoint, *extra])
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            args.run(args)

    no_folder = parser.parse_args(["train", "--task", "multi30k", *options])
    with pytest.raises(ValueError, match="needs --checkpoint-dir"):
        no_folder.run(no_folder)
    sentences = parser.parse_args(["train", "--task", "multi30k", "--batch-size", "32", *options,
                                   "--checkpoint-dir", str(tmp_path / "other")])
    with pytest.raises(ValueError, match="use --max-tokens"):
        sentences.run(sentences)


def test_python_dash_m_where_wired(environment, tmp_path, capsys):
    """Through `python -m annotated_transformer`, once the CLI chapter registers evaluate and the multi30k task."""
    from annotated_transformer.cli import build_parser

    parser = build_parser()
    try:
        parser.parse_args(["evaluate", "--checkpoint", "x.pt"])
        parser.parse_args(["train", "--task", "multi30k", "--max-tokens", "600"])
    except SystemExit:
        pytest.skip("the CLI does not register `evaluate` and `train --task multi30k` yet")
    command = [sys.executable, "-m", "annotated_transformer", "train", "--task", "multi30k", "--profile", "quick",
               "--vocab-size", "500", "--train-limit", "2000", "--max-len", "20", "--layers", "1", "--d-model", "32",
               "--d-ff", "64", "--heads", "2", "--max-tokens", "600", "--steps", "10", "--warmup", "5",
               "--checkpoint-every", "5", "--eval-every", "10", "--average", "2", "--valid-limit", "20",
               "--test-limit", "8", "--beam-size", "2", "--no-progress", "--device", "cpu",
               "--checkpoint-dir", str(tmp_path / "run"), "--results", str(tmp_path / "r.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["command"].startswith(
        "python -m annotated_transformer train --task multi30k")
    result = subprocess.run([sys.executable, "-m", "annotated_transformer", "evaluate", "--checkpoint",
                             str(tmp_path / "run" / "average.pt"), "--limit", "8", "--device", "cpu"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "test (8 sentences, greedy): BLEU" in result.stdout and "nrefs:1|case:mixed" in result.stdout


def test_the_recipe_reads_its_source(environment, tmp_path):
    """The collapse of post-norm with Xavier embeddings on Multi30k: a model that learns the English side alone and ignores the
    German. Its validation loss is the same whether each target gets its own source or its neighbour's. The
    quick profile's recipe, trained for a few seconds, must already do clearly better with the true sources;
    and the check fails for a model that cannot read its source (cross-attention outputs cut off)."""
    torch.set_num_threads(1)
    config = translation_config("quick", steps=250, valid_limit=200, eval_every=250, checkpoint_every=250, average=1)
    trained = train_translator(config, tmp_path / "run", device="cpu", progress=False, log=lambda message: None)
    true_loss, shuffled_loss = trained["averaged_valid_loss"], trained["shuffled_valid_loss"]
    print(f"validation loss {true_loss:.3f}, with shuffled sources {shuffled_loss:.3f}")
    assert shuffled_loss > true_loss + 0.25, (true_loss, shuffled_loss)

    from annotated_transformer.data import encode_pairs, load_split
    from annotated_transformer.translation import validation_loss

    model, tokenizer = trained["model"], trained["tokenizer"]
    examples = encode_pairs(load_split("valid")[:200], tokenizer.processor)
    with torch.no_grad():
        for layer in model.decoder.layers:              # the decoder no longer sees the encoder's output
            layer.src_attn.w_o.weight.zero_()
            layer.src_attn.w_o.bias.zero_()
    blind, blind_shuffled = validation_loss(model, examples), validation_loss(model, examples, shuffle_sources=True)
    assert abs(blind - blind_shuffled) < 1e-4         # the check cannot tell sources apart: it would fail


def test_a_results_path_that_cannot_be_written_is_refused_before_training(environment, tmp_path):
    config = translation_config("quick", **TINY)
    with pytest.raises(ValueError, match="is a folder"):
        record_experiment(config, tmp_path / "run", results_path=tmp_path, device="cpu", log=lambda message: None)
    assert not (tmp_path / "run").exists()


def test_a_results_file_of_another_run_is_never_replaced(tmp_path, monkeypatch):
    """A record was taken as this run's own when its command named a folder of the same name, read from here: a new
    run in a folder of the same name (a reader's runs/laptop, say) replaced it. Now only a resumed run whose folder's
    validation curve is the record's may rewrite it."""
    from annotated_transformer.records import check_results_path

    monkeypatch.chdir(tmp_path)
    curve = {"step": [5, 10], "loss": [2.5, 2.0]}
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"command": "python -m annotated_transformer train --task multi30k "
                                             "--checkpoint-dir 'runs/my run' --results record.json", "valid": curve}))
    (tmp_path / "runs" / "my run").mkdir(parents=True)
    (tmp_path / "runs" / "my run" / "valid.json").write_text(json.dumps({"step": [5, 10, 15], "loss": [2.5, 2.0, 1.9]}))
    assert check_results_path(record, "runs/my run", resume=True) == record  # its own run, resumed
    with pytest.raises(ValueError, match="exists and is the record of an earlier run in this folder, or of another "
                                         "run in a folder of the same name"):
        check_results_path(record, "runs/my run")  # a new run: never over the record of the last one
    for folder in ("runs/other", None):
        with pytest.raises(ValueError, match=r"exists and is the record of another run \(its folder: runs/my run\)"):
            check_results_path(record, folder, resume=True)
    elsewhere = tmp_path / "elsewhere" / "runs" / "my run"  # another run, in a folder of the same name elsewhere
    elsewhere.mkdir(parents=True)
    (elsewhere / "valid.json").write_text(json.dumps({"step": [5, 10], "loss": [2.6, 2.1]}))
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="its validation curve is not this folder's"):
        check_results_path(record, "runs/my run", resume=True)
    (elsewhere / "valid.json").unlink()  # a folder without a curve proves nothing either
    with pytest.raises(ValueError, match="its validation curve is not this folder's"):
        check_results_path(record, "runs/my run", resume=True)
    absolute = tmp_path / "absolute.json"  # a run named by an absolute folder resumes from anywhere
    absolute.write_text(json.dumps({"command": f"python -m annotated_transformer train --checkpoint-dir "
                                               f"{shlex.quote(str(tmp_path / 'runs' / 'my run'))} "
                                               "--results absolute.json", "valid": curve}))
    assert check_results_path(absolute, tmp_path / "runs" / "my run", resume=True) == absolute
    (tmp_path / "notes.txt").write_text("my notes")
    with pytest.raises(ValueError, match="exists and is a file that is not a record of this run"):
        check_results_path(tmp_path / "notes.txt", "runs/my run", resume=True)
    assert (tmp_path / "notes.txt").read_text() == "my notes"


def test_a_record_written_meanwhile_by_another_run_is_kept_and_ours_goes_beside_it(environment, tmp_path,
                                                                                  monkeypatch):
    """Two runs started side by side with one --results both passed the check before training, and the later one
    replaced the earlier one's record when it finished."""
    from annotated_transformer import records

    target, real = tmp_path / "results.json", records.run_experiment
    other = {"command": "python -m annotated_transformer train --checkpoint-dir other --results results.json"}

    def meanwhile(*args, **kwargs):  # the other run finishes while this one trains
        target.write_text(json.dumps(other))
        return real(*args, **kwargs)

    monkeypatch.setattr(records, "run_experiment", meanwhile)
    taken = tmp_path / f"results-{os.getpid()}.json"  # the first name beside it: taken too
    taken.write_text("someone's notes")
    said = []
    config = translation_config("quick", **{**TINY, "steps": 10, "eval_every": 5})
    record_experiment(config, tmp_path / "run", results_path=target, device="cpu", log=said.append)
    assert json.loads(target.read_text()) == other  # the other run's record: kept
    assert taken.read_text() == "someone's notes"
    ours = tmp_path / f"results-{os.getpid() + 1}.json"
    assert json.loads(ours.read_text())["config"]["steps"] == 10
    assert any(f"this run's record goes to {ours}" in line for line in said)


def test_a_record_is_never_renamed_over_a_file_made_after_the_last_check(environment, tmp_path, monkeypatch):
    """Between the last check and the rename, another run could write the results file, and os.replace put this
    run's record over it. A new record is now linked into place, which refuses a path that exists."""
    from annotated_transformer import records
    from annotated_transformer.checkpoints import write_atomically

    target, real, paths = tmp_path / "results.json", records.unclaimed, []
    other = {"command": "python -m annotated_transformer train --checkpoint-dir other --results results.json"}

    def late(*args, **kwargs):
        paths.append(real(*args, **kwargs))
        if len(paths) == 1:  # the other run writes it just after this run's last check
            target.write_text(json.dumps(other))
        return paths[-1]

    monkeypatch.setattr(records, "unclaimed", late)
    config = translation_config("quick", **{**TINY, "steps": 10, "eval_every": 5})
    record_experiment(config, tmp_path / "run", results_path=target, device="cpu", log=lambda message: None)
    assert json.loads(target.read_text()) == other  # kept
    assert paths[0] == target and paths[1] == tmp_path / f"results-{os.getpid()}.json"
    assert json.loads(paths[1].read_text())["config"]["steps"] == 10
    with pytest.raises(FileExistsError):
        write_atomically(target, lambda stream: stream.write(b"{}"), new=True)
    assert json.loads(target.read_text()) == other and not list(tmp_path.glob(".*.tmp"))


def test_a_records_run_folder_is_read_from_either_form_of_the_option_and_never_from_stdin(tmp_path, monkeypatch):
    """`--checkpoint-dir=PATH` is the same run as `--checkpoint-dir PATH`; a record without a command (one made
    from Python) names no run, without reading standard input (shlex.split(None) does on Python 3.11)."""
    import io

    from annotated_transformer.records import check_results_path, recorded_folder

    monkeypatch.chdir(tmp_path)
    record = tmp_path / "record.json"
    curve = {"step": [5], "loss": [2.5]}
    record.write_text(json.dumps({"command": "python -m annotated_transformer train "
                                             "--checkpoint-dir=runs/mine --results record.json", "valid": curve}))
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    (tmp_path / "runs" / "mine" / "valid.json").write_text(json.dumps(curve))
    assert recorded_folder(record) == Path("runs/mine")  # as named: relative to where the run started
    assert check_results_path(record, "runs/mine", resume=True) == record
    monkeypatch.setattr("sys.stdin", io.StringIO("--checkpoint-dir runs/mine"))  # must not be read
    record.write_text(json.dumps({"command": None}))
    assert recorded_folder(record) is None
    with pytest.raises(ValueError, match="exists and is a file that is not a record of this run"):
        check_results_path(record, "runs/mine", resume=True)


# valid.json: written atomically, and a damaged one is reported by name ---------------------------------------------

def run_validation_chunks(folder, *, done, steps=30, monkeypatch):
    """train_with_validation with training and validation replaced by stand-ins: only valid.json is real."""
    from annotated_transformer import translation

    def stand_in_train(*args, steps, evaluate, eval_every, **kwargs):  # the callbacks only
        for step in range(done + 1, steps + 1):
            if translation.due(step, eval_every, steps):
                evaluate(step)
        return {}

    monkeypatch.setattr(translation, "train", stand_in_train)
    losses = iter([4.0, 3.0, 2.0])
    monkeypatch.setattr(translation, "validation_loss", lambda model, examples: next(losses))
    config = translation_config("quick", **dict(TINY, steps=steps, eval_every=10))
    return translation.train_with_validation(None, None, None, config, folder, checkpoint={"step": done, "extra": {}}
                                             if done else None, device="cpu", amp=False, progress=False,
                                             log=lambda message: None)[1]


@pytest.mark.parametrize("content", ['{"step": [10, 20], "loss": [4.1', "", '{"step": [10, 20], "loss": [4.1]}',
                                     '{"step": [10]}', '[1, 2]', '{"step": ["ten"], "loss": [4.0]}', "\udcff"])
def test_a_damaged_valid_json_is_refused_by_name_before_training(tmp_path, monkeypatch, content):
    from annotated_transformer import translation

    (tmp_path / "valid.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    monkeypatch.setattr(translation, "train", lambda *args, **kwargs: pytest.fail("trained on a damaged history"))
    config = translation_config("quick", **TINY)
    with pytest.raises(ValueError, match=r"valid\.json is damaged .*delete it") as error:
        translation.train_with_validation(None, None, None, config, tmp_path, checkpoint={"step": 20, "extra": {}},
                                          device="cpu", amp=False, progress=False, log=lambda message: None)
    assert str(tmp_path / "valid.json") in str(error.value)


def test_valid_json_is_read_back_and_continued(tmp_path, monkeypatch):
    (tmp_path / "valid.json").write_text(json.dumps({"step": [10], "loss": [4.5]}))
    valid = run_validation_chunks(tmp_path, done=10, monkeypatch=monkeypatch)
    assert valid == {"step": [10, 20, 30], "loss": [4.5, 4.0, 3.0]}
    assert json.loads((tmp_path / "valid.json").read_text()) == valid
    assert sorted(p.name for p in tmp_path.iterdir()) == ["valid.json"]         # no temporary file is left


def test_valid_json_is_written_atomically(tmp_path, monkeypatch):
    """A run killed while writing valid.json leaves the previous history intact, and no temporary file."""
    from annotated_transformer import checkpoints, translation

    calls = []

    def killed_on_the_second_write(path, write, **kwargs):
        calls.append(Path(path).name)
        if len(calls) < 2:
            return checkpoints.write_atomically(path, write, **kwargs)

        def half_then_killed(stream):
            write(stream)
            stream.seek(stream.tell() // 2)
            stream.truncate()
            raise KeyboardInterrupt                                              # as if killed mid-write
        return checkpoints.write_atomically(path, half_then_killed, **kwargs)

    monkeypatch.setattr(translation, "write_atomically", killed_on_the_second_write)
    with pytest.raises(KeyboardInterrupt):
        run_validation_chunks(tmp_path, done=0, monkeypatch=monkeypatch)
    assert calls == ["valid.json", "valid.json"]
    assert json.loads((tmp_path / "valid.json").read_text()) == {"step": [10], "loss": [4.0]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["valid.json"]


def test_validation_happens_inside_one_training_loop_without_loading_a_checkpoint(environment, tmp_path,
                                                                                   monkeypatch):
    """Validation every 4 steps, checkpoints every 5: ``train`` is called once, restores no state, and reads
    each checkpoint only once, right after writing it (the check that it reads back)."""
    from annotated_transformer import trainer, translation

    calls, loads, restores, real_train, real_load = [], [], [], translation.train, torch.load

    def counting_train(*args, **kwargs):
        calls.append(kwargs["steps"])
        with monkeypatch.context() as inside:
            inside.setattr(torch, "load", lambda *a, **k: loads.append(Path(a[0]).name) or real_load(*a, **k))
            for name in ("resume_training", "load_model_state", "set_rng_state"):
                inside.setattr(trainer, name, lambda *a, name=name, **k: restores.append(name))
            return real_train(*args, **kwargs)

    monkeypatch.setattr(translation, "train", counting_train)
    config = translation_config("quick", **dict(TINY, steps=12, eval_every=4, checkpoint_every=5))
    trained = train_translator(config, tmp_path / "run", device="cpu", progress=False, log=lambda message: None)
    assert calls == [12] and restores == []
    assert loads == ["step_00000005.pt", "step_00000010.pt", "step_00000012.pt"]
    assert trained["valid"]["step"] == [4, 8, 12]
    assert json.loads((tmp_path / "run" / "valid.json").read_text())["step"] == [4, 8, 12]
    stored = load_checkpoint(tmp_path / "run" / "step_00000010.pt")["extra"]["valid"]
    assert stored["step"] == [4, 8]  # the curve so far, in each checkpoint
    assert len(trained["history"]["loss"]) == 12 and trained["train_seconds"] > 0
