"""Bad input to the Python API gets a one-line error that names the problem, before any work, where it used to be
taken silently (a wrong result) or to fail late with an error that named something else."""
from __future__ import annotations

import random

import pytest

from annotated_transformer import bench
from annotated_transformer.bench import run_benchmarks
from annotated_transformer.data import SentencePieces, collate, encode_pairs, load_tokenizer, train_tokenizer
from annotated_transformer.records import thin
from annotated_transformer.translation import (
    TranslationConfig,
    bleu,
    bleu_bootstrap,
    load_translator,
    save_translator,
    translation_config,
    validation_loss,
)
from annotated_transformer.model import make_model


def made_up_pairs(n=300, seed=0):
    words = ["Hund", "Katze", "läuft", "springt", "über", "die", "Wiese", "ein", "der", "rote", "Ball", "Mann"]
    rng = random.Random(seed)
    return [(" ".join(rng.choices(words, k=6)), " ".join(rng.choices(words, k=5)).lower()) for _ in range(n)]


def test_train_tokenizer_refuses_sentences_that_are_not_pairs(tmp_path):
    pairs = made_up_pairs()
    with pytest.raises(TypeError, match=r"pairs must be \(source, target\) pairs of str"):
        train_tokenizer([source for source, _ in pairs], vocab_size=40, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []  # no character-level tokenizer cached under the name of a real one


def test_the_translators_tokenizer_works_where_its_processor_does(tmp_path):
    pairs = made_up_pairs()
    processor = load_tokenizer(train_tokenizer(pairs, vocab_size=40, directory=tmp_path))
    tokenizer = SentencePieces(processor)
    assert encode_pairs(pairs[:3], tokenizer) == encode_pairs(pairs[:3], processor)
    with pytest.raises(TypeError, match=r"encode takes one sentence \(a str\), got list"):
        tokenizer.encode(["Ein Hund.", "Eine Katze."])  # its ids came back with one </s> among the lists
    model = make_model(processor.get_piece_size(), processor.get_piece_size(), N=1, d_model=16, d_ff=32, h=2)
    saved = [save_translator(tmp_path / f"{name}.pt", model, given)
             for name, given in (("wrapper", tokenizer), ("processor", processor))]
    loaded = [load_translator(path)[1] for path in saved]  # the same tokenizer either way
    assert [t.encode("Ein Hund läuft") for t in loaded] == [tokenizer.encode("Ein Hund läuft")] * 2
    examples = encode_pairs(pairs[:2], tokenizer)
    for multiple, error in [(0, ValueError), (-2, ValueError), (1.5, TypeError)]:
        with pytest.raises(error, match="multiple must be"):
            collate(examples, multiple=multiple)
    with pytest.raises(ValueError, match="a batch needs at least one example"):
        collate([])
    with pytest.raises(ValueError, match="examples is empty: there is no loss to measure"):
        validation_loss(model, [])  # max() of an empty sequence, or a division by zero


def test_bleu_and_its_bootstrap_refuse_what_they_would_miscount():
    sentence = "A dog runs across the green field."
    with pytest.raises(TypeError, match="lists of sentences, not a str"):
        bleu(sentence, sentence)  # scored 0.00 on its characters
    assert bleu([sentence], [sentence])[0].score == pytest.approx(100.0)
    pairs = [(f"s{i}", f"a dog runs number {i} .") for i in range(5)]
    outputs = {"greedy": [target for _, target in pairs]}
    with pytest.raises(ValueError, match="the baseline 'beam' is not one of the translations"):
        bleu_bootstrap(pairs, outputs, baseline="beam")
    for samples, error in [(0, ValueError), (-5, ValueError), (10.0, TypeError)]:  # 0 or less: sacreBLEU's 1,000
        with pytest.raises(error, match="samples must be"):
            bleu_bootstrap(pairs, outputs, baseline="greedy", samples=samples)
    with pytest.raises(ValueError, match="points must be a positive integer, got 0"):
        thin({"step": [1, 2], "loss": [1.0, 0.5]}, points=0)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(max_len=2), ValueError, "max_len must be at least 3, got 2"),
    (dict(vocab_size=5), ValueError, "vocab_size must be at least 8, got 5"),
    (dict(d_model=15, h=3), ValueError, "d_model must be even, got 15"),
    (dict(dropout="0.1"), ValueError, r"dropout must lie in \[0, 1\), got '0.1'"),
    (dict(dropout=False), ValueError, r"dropout must lie in \[0, 1\), got False"),
    (dict(length_penalty="0.6"), ValueError, r"length_penalty must lie in \[0, .*\], got '0.6'"),
    (dict(length_penalty=True), ValueError, r"length_penalty must lie in \[0, .*\], got True"),
])
def test_a_translation_config_refuses_what_the_run_would_refuse_later(overrides, error, match):
    with pytest.raises(error, match=match):
        translation_config("quick", **overrides)


def test_profile_names_are_checked_as_profile_names():
    assert translation_config("Laptop").profile == translation_config("LAPTOP").profile == "laptop"
    assert translation_config("QUICK").profile == "quick"
    with pytest.raises(ValueError, match="profile must be 'quick', 'laptop', 'full' or 'auto', got 'fast'"):
        translation_config("fast")
    assert isinstance(translation_config("quick"), TranslationConfig)


def test_the_benchmark_refuses_a_folder_as_its_record_and_empty_batches_before_it_runs(tmp_path, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran although its arguments should have been refused")

    monkeypatch.setattr(bench, "run_benchmarks", no_run)
    with pytest.raises(ValueError, match="is a folder: name a file in it"):
        bench.run(smoke=True, device="cpu", sections=("layers",), json_path=tmp_path)
    with pytest.raises(ValueError, match="--threads must be from 1 to"):
        bench.run(smoke=True, device="cpu", sections=("layers",), threads=True)
    monkeypatch.undo()
    for sizes, error in [((0,), ValueError), ((-3,), ValueError), ((2.0,), TypeError)]:
        with pytest.raises(error, match="each of batch_sizes must be"):
            run_benchmarks("cpu", smoke=True, sections=("decoding",), batch_sizes=sizes)
