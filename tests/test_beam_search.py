"""Beam search, the length penalties and the translate command (book/beam_search.md)."""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from annotated_transformer.beam_search import (
    Hypothesis,
    TokenIds,
    beam_search,
    length_penalty_factor,
    strip_special,
    translate,
    translate_ids,
)
from annotated_transformer.beam_search import positional_limits, translate_lines
from annotated_transformer.cli import main
from annotated_transformer.decoder import DecoderCache, StaticDecoderCache
from annotated_transformer.decoding import greedy_decode
from annotated_transformer.masks import padding_mask, subsequent_mask
from annotated_transformer.model import make_model
# The decoder's caches, each checked against the exhaustive search, and the (autouse) fixture that makes a compiled
# case fail rather than fall back to eager code: the decoding tests'.
from test_decoding import CACHES, compiled_code_or_failure  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
PAD, START, END = 0, 1, 2
PENALTIES = [("none", 0.0), ("gnmt", 0.6), ("simple", 0.7), ("gnmt", 1.5)]


def tiny_model(seed, vocab=5, end_bias=-1.0, norm_first=False):
    """A random float64 model, biased away from the end symbol so that the search is not trivial."""
    torch.manual_seed(seed)
    model = make_model(vocab, vocab, N=2, d_model=16, d_ff=32, h=2, dropout=0.0, norm_first=norm_first)
    model = model.double().eval()
    with torch.no_grad():
        model.generator.proj.bias[END] += end_bias
    return model


SRC = torch.tensor([[3, 4, 4, 3, 1]])
SRC_MASK = padding_mask(SRC, PAD)


def enumerate_outputs(model, src, src_mask, max_len, vocab):
    """Every output of at most max_len tokens (start included), its length |Y| and log-probability."""
    others = [v for v in range(vocab) if v != END]
    outputs = [[START, *mid, END] for n in range(max_len - 1) for mid in itertools.product(others, repeat=n)]
    outputs += [[START, *mid] for mid in itertools.product(others, repeat=max_len - 1)]
    lengths = torch.tensor([len(y) - 1 for y in outputs])
    tgt = torch.tensor([y + [PAD] * (max_len - len(y)) for y in outputs])
    n = len(outputs)
    with torch.no_grad():
        log_probs = model.generator(model(src.expand(n, -1), tgt[:, :-1], src_mask.expand(n, -1, -1),
                                          subsequent_mask(max_len - 1)))
    token_lp = log_probs.gather(-1, tgt[:, 1:].unsqueeze(-1)).squeeze(-1)
    token_lp = token_lp.masked_fill(torch.arange(max_len - 1) >= lengths.unsqueeze(1), 0.0)
    return tgt, lengths, token_lp.sum(1)


def penalised(log_p, lengths, kind, alpha):
    lp = torch.tensor([length_penalty_factor(n, alpha, kind) for n in lengths.tolist()], dtype=torch.float64)
    return log_p / lp


# --- the length penalty -----------------------------------------------------------------------------------------

def test_length_penalty_values():
    assert length_penalty_factor(1, 0.6, "gnmt") == 1.0
    assert length_penalty_factor(7, 0.6, "gnmt") == pytest.approx(2.0 ** 0.6)
    assert length_penalty_factor(8, 0.7, "simple") == pytest.approx(8 ** 0.7)
    assert length_penalty_factor(30, 0.6, "none") == 1.0
    assert length_penalty_factor(30, 0.0, "gnmt") == 1.0
    with pytest.raises(ValueError, match="length penalty kind"):
        length_penalty_factor(3, 0.6, "average")
    assert length_penalty_factor(7, np.float32(0.6)) == pytest.approx(2.0 ** 0.6)  # any real alpha
    for length in (0, -7, True, "3", 2.0):  # |Y| counts generated tokens: at least 1 (0 or -7: 0 or complex)
        with pytest.raises(ValueError, match="length must be an int >= 1"):
            length_penalty_factor(length)
    for alpha in (-0.1, float("nan"), 1000.0, True, "0.6"):  # 1000: an OverflowError; nan: nan
        with pytest.raises(ValueError, match=r"length_penalty must be in \[0, 10\]"):
            length_penalty_factor(100, alpha)


# --- equivalences ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache", ["growing", "static"])
def test_beam_size_one_without_penalty_is_greedy(cache):
    src = torch.tensor([[3, 4, 4, 3, 1], [4, 3, PAD, PAD, PAD], [3, 3, 3, PAD, PAD]])
    mask = padding_mask(src, PAD)
    for seed in range(6):
        model = tiny_model(seed, end_bias=0.0)
        greedy, greedy_lp = greedy_decode(model, src, mask, 8, START, END, return_log_probs=True)
        found = beam_search(model, src, mask, 8, START, END, beam_size=1, penalty="none", **CACHES[cache])
        for i, (best,) in enumerate(found):
            tokens = greedy[i]
            if (tokens == END).any():
                tokens = tokens[: (tokens == END).nonzero()[0].item() + 1]
            assert torch.equal(best.tokens, tokens)
            assert best.score == pytest.approx(greedy_lp[i].sum().item(), abs=1e-12)


def test_beam_size_one_without_end_symbol_is_greedy():
    model = tiny_model(3, vocab=7)
    src = torch.tensor([[3, 4, 5, 6], [6, 5, PAD, PAD]])
    mask = padding_mask(src, PAD)
    greedy, greedy_lp = greedy_decode(model, src, mask, 9, START, return_log_probs=True)
    found = beam_search(model, src, mask, 9, START, None, beam_size=1)
    for i, (best,) in enumerate(found):
        assert torch.equal(best.tokens, greedy[i])
        assert best.score == pytest.approx(greedy_lp[i].sum().item(), abs=1e-12)


# The eager caches here. The compiled step (which compiles again for every width and, its weights frozen in, for
# every model: several seconds each on a CPU) is checked by the beam-search chapter, which CI runs twice (nbval and
# Run All): for one model and beams of 4 and 341 (the exhaustive one) under each penalty, it finds the hypotheses of
# the growing cache, and the widest finds the best output of the enumeration.
WIDEST_BEAM_CASES = [(kind, alpha, cache) for kind, alpha in PENALTIES for cache in CACHES if cache != "compiled"]


@pytest.mark.parametrize("kind,alpha,cache", WIDEST_BEAM_CASES)
def test_widest_beam_equals_exhaustive_search(kind, alpha, cache):
    max_len = 5
    for seed in (0, 1):
        model = tiny_model(seed)
        outputs, lengths, log_p = enumerate_outputs(model, SRC, SRC_MASK, max_len, vocab=5)
        assert len(outputs) == 341
        scores = penalised(log_p, lengths, kind, alpha)
        best = scores.argmax().item()
        found = {k: beam_search(model, SRC, SRC_MASK, max_len, START, END, beam_size=k, length_penalty=alpha,
                                penalty=kind, **CACHES[cache])[0][0] for k in (1, 2, 4, 16, 341)}
        exact = found[len(outputs)]
        assert torch.equal(exact.tokens, outputs[best, : lengths[best] + 1])
        assert exact.score == pytest.approx(log_p[best].item(), abs=1e-12)
        assert exact.penalised == pytest.approx(scores[best].item(), abs=1e-12)
        for k, hyp in found.items():  # no narrower beam beats the exhaustive one
            assert hyp.penalised <= exact.penalised + 1e-12, k


@pytest.mark.parametrize("cache", ["growing", "static"])
def test_n_best_of_the_widest_beam_are_the_n_best_outputs(cache):
    model = tiny_model(0)
    outputs, lengths, log_p = enumerate_outputs(model, SRC, SRC_MASK, 5, vocab=5)
    scores = penalised(log_p, lengths, "gnmt", 0.6)
    top = scores.topk(6)
    hyps = beam_search(model, SRC, SRC_MASK, 5, START, END, beam_size=len(outputs), n_best=6, **CACHES[cache])[0]
    assert len(hyps) == 6
    torch.testing.assert_close(torch.tensor([h.penalised for h in hyps], dtype=torch.float64), top.values,
                               rtol=0, atol=1e-12)
    for hyp, index in zip(hyps, top.indices.tolist()):
        assert torch.equal(hyp.tokens, outputs[index, : lengths[index] + 1])


@pytest.mark.parametrize("cache", ["growing", "static"])
def test_hypotheses_scores_are_the_model_log_probabilities(cache):
    """Raw scores of returned hypotheses (n-best, narrow beam) equal a teacher-forced rescoring."""
    model = tiny_model(4, vocab=7, end_bias=-0.5)
    src = torch.tensor([[3, 4, 5, 6, 3]])
    mask = padding_mask(src, PAD)
    for hyp in beam_search(model, src, mask, 8, START, END, beam_size=4, n_best=4, **CACHES[cache])[0]:
        tgt = hyp.tokens.unsqueeze(0)
        with torch.no_grad():
            log_probs = model.generator(model(src, tgt[:, :-1], mask, subsequent_mask(tgt.size(1) - 1)))
        rescored = log_probs.gather(-1, tgt[:, 1:].unsqueeze(-1)).sum().item()
        assert hyp.score == pytest.approx(rescored, abs=1e-12)
        assert hyp.penalised == pytest.approx(hyp.score / length_penalty_factor(tgt.size(1) - 1), abs=1e-12)


def test_chosen_length_grows_with_the_penalty():
    chosen = {kind: [] for kind in ("none", "gnmt", "simple")}
    for seed in range(8):
        model = tiny_model(seed)
        _, lengths, log_p = enumerate_outputs(model, SRC, SRC_MASK, 5, vocab=5)
        for kind, alpha in (("none", 0.0), ("gnmt", 0.6), ("simple", 0.7)):
            hyp = beam_search(model, SRC, SRC_MASK, 5, START, END, beam_size=341, length_penalty=alpha,
                              penalty=kind)[0][0]
            chosen[kind].append(len(hyp.tokens) - 1)
    assert all(a <= b <= c for a, b, c in zip(chosen["none"], chosen["gnmt"], chosen["simple"]))
    assert sum(chosen["none"]) < sum(chosen["simple"])


# --- stopping --------------------------------------------------------------------------------------------------

def test_a_finished_hypothesis_can_be_overtaken_and_the_search_waits_for_it():
    overtaken = 0
    for seed in range(20):
        firsts = []

        def record(step, tokens, scores, finished):
            if finished[0] and not firsts:
                firsts.append(max(finished[0], key=lambda h: h.penalised))

        result = beam_search(tiny_model(seed), SRC, SRC_MASK, 5, START, END, beam_size=4, on_step=record)[0][0]
        if firsts and not torch.equal(firsts[0].tokens, result.tokens):
            assert result.penalised > firsts[0].penalised
            assert len(result.tokens) > len(firsts[0].tokens)
            overtaken += 1
            break
    assert overtaken > 0


def test_search_stops_early_when_no_open_beam_can_win():
    model = tiny_model(0, end_bias=4.0)  # the end symbol is very likely at the first step
    steps = []
    found = beam_search(model, SRC, SRC_MASK, 30, START, END, beam_size=4, penalty="none",
                        on_step=lambda step, *rest: steps.append(step))[0][0]
    assert found.tokens.tolist() == [START, END]
    assert len(steps) < 29


def test_on_step_reports_shapes():
    model = tiny_model(1, vocab=7)
    src = torch.tensor([[3, 4, 5], [6, 5, PAD]])
    seen = []

    def record(step, tokens, scores, finished):
        seen.append((step, tuple(tokens.shape), tuple(scores.shape), len(finished)))

    beam_search(model, src, padding_mask(src, PAD), 6, START, None, beam_size=3, on_step=record)
    assert seen == [(s, (2, 3, s + 1), (2, 3), 2) for s in range(1, 6)]


# --- batches -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache", ["growing", "static"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_beams_do_not_leak_between_sentences(norm_first, cache):
    model = tiny_model(1, vocab=7, end_bias=-0.5, norm_first=norm_first)
    src = torch.tensor([[3, 4, 5, 6, 3, 4], [6, 5, PAD, PAD, PAD, PAD], [4, 4, 6, 3, PAD, PAD]])
    together = beam_search(model, src, padding_mask(src, PAD), 9, START, END, beam_size=3, n_best=3, **CACHES[cache])
    for i in range(3):
        alone_src = src[i:i + 1, : int((src[i] != PAD).sum())]
        alone = beam_search(model, alone_src, padding_mask(alone_src, PAD), 9, START, END, beam_size=3, n_best=3,
                            **CACHES[cache])[0]
        assert len(alone) == len(together[i]) == 3
        for a, t in zip(alone, together[i]):
            assert torch.equal(a.tokens, t.tokens)
            assert a.score == pytest.approx(t.score, abs=1e-12)


@pytest.mark.parametrize("cache_class", [DecoderCache, StaticDecoderCache])
def test_reorder_is_needed(cache_class, monkeypatch):
    """Without reordering the cache, the full-width search no longer matches the enumeration."""
    model = tiny_model(0)
    outputs, lengths, log_p = enumerate_outputs(model, SRC, SRC_MASK, 5, vocab=5)
    top = penalised(log_p, lengths, "gnmt", 0.6).topk(5).values
    static = cache_class is StaticDecoderCache
    right = beam_search(model, SRC, SRC_MASK, 5, START, END, beam_size=len(outputs), n_best=5, static=static)[0]
    torch.testing.assert_close(torch.tensor([h.penalised for h in right], dtype=torch.float64), top, rtol=0,
                               atol=1e-12)
    monkeypatch.setattr(cache_class, "reorder", lambda self, index: None)
    hyps = beam_search(model, SRC, SRC_MASK, 5, START, END, beam_size=len(outputs), n_best=5, static=static)[0]
    assert not torch.allclose(torch.tensor([h.penalised for h in hyps], dtype=torch.float64), top, atol=1e-9)


def test_results_are_sorted_and_typed():
    model = tiny_model(2, vocab=7, end_bias=0.0)
    src = torch.tensor([[3, 4, 5], [6, 5, PAD]])
    for hyps in beam_search(model, src, padding_mask(src, PAD), 8, START, END, beam_size=4, n_best=3):
        assert len(hyps) == 3 and all(isinstance(h, Hypothesis) for h in hyps)
        assert [h.penalised for h in hyps] == sorted((h.penalised for h in hyps), reverse=True)
        for h in hyps:
            assert h.tokens[0] == START and h.tokens.dtype == torch.long and len(h.tokens) <= 8
            assert (h.tokens[1:-1] != END).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_size=0), "n_best"),
    (dict(beam_size=2, n_best=3), "n_best"),
    (dict(max_len=1), "max_len"),
    (dict(length_penalty=-0.5), "length_penalty must be in"),
    (dict(length_penalty=float("nan")), "length_penalty must be in"),  # issue 21: NaN and inf made ranking
    (dict(length_penalty=float("inf")), "length_penalty must be in"),  # meaningless
    (dict(length_penalty=1000.0), "length_penalty must be in"),  # and 1000 overflowed a float
    (dict(length_penalty="0.6"), "length_penalty must be in"),
    (dict(penalty="average"), "length penalty kind"),
])
def test_bad_arguments_are_refused(kwargs, match):
    model = tiny_model(0)
    args = dict(max_len=5, beam_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        beam_search(model, SRC, SRC_MASK, args.pop("max_len"), START, END, **args)


def test_an_empty_batch_gives_an_empty_result():
    """Issue 21 (defect 22): a batch of no sentences used to raise ZeroDivisionError."""
    model = tiny_model(0)
    src = torch.zeros((0, 5), dtype=torch.long)
    assert beam_search(model, src, padding_mask(src, PAD), 5, START, END) == []
    assert beam_search(model, src, None, 5, START, END, beam_size=2, n_best=2) == []


def test_the_largest_length_penalty_stays_finite():
    model = tiny_model(0)
    hyps = beam_search(model, SRC, SRC_MASK, 8, START, END, length_penalty=10.0)
    assert len(hyps) == 1 and all(torch.isfinite(torch.tensor(h.penalised)) for h in hyps[0])


@pytest.mark.parametrize("static", [False, True])
def test_a_sentence_of_padding_only_is_refused(static):
    src = torch.cat([SRC, torch.full_like(SRC, PAD)])
    with pytest.raises(ValueError, match=r"src_mask hides every token of sentence\(s\) \[1\]"):
        beam_search(tiny_model(0), src, padding_mask(src, PAD), 5, START, END, static=static)


def test_empty_source_is_refused():
    model = tiny_model(0)
    src = torch.zeros((1, 0), dtype=torch.long)
    with pytest.raises(ValueError, match="src must have shape"):
        beam_search(model, src, padding_mask(src, PAD), 5, START, END)


# --- the tokenizer and the translate command ----------------------------------------------------------------------

def test_token_ids_tokenizer():
    tok = TokenIds(11)
    assert tok.encode(" 3  4 5 ") == [1, 3, 4, 5]
    assert tok.decode([3, 4, 5]) == "3 4 5"
    # a decoder's output: the start symbol goes, and everything from the end symbol on
    assert strip_special([1, 3, 4, 5], 1) == [3, 4, 5]
    assert tok.decode(strip_special([1, 3, 4, 5], tok.start, tok.end)) == "3 4 5"
    assert strip_special([1, 3, 2, 4], 1, 2) == [3]
    assert tok.max_len(4) == 4
    for bad in ("3 x 5", "3 11", "-1", "0 3"):
        with pytest.raises(ValueError):
            tok.encode(bad)
    # the start symbol is the task's to put first: in a source it would be copied wrongly without a word
    symbols = r"is not a symbol of this task: use 2\.\.10 \(0 is padding, 1 is the start symbol\)"
    for bad, value in (("1 2 3", 1), ("3 1", 1), ("0 3", 0), ("3 11", 11)):
        with pytest.raises(ValueError, match=rf"^token id {value} {symbols}$"):
            tok.encode(bad)
    assert TokenIds(11, source_start=False).encode("1 3") == [1, 3]  # no start symbol put first: 1 is a symbol
    with pytest.raises(ValueError, match=r"use 1\.\.10 \(0 is padding\)$"):
        TokenIds(11, source_start=False).encode("0 3")


def test_tokenizer_from_checkpoint():
    from annotated_transformer.translation import checkpoint_tokenizer

    assert isinstance(checkpoint_tokenizer({"config": {"tgt_vocab": 11}, "extra": {}}), TokenIds)
    assert checkpoint_tokenizer({"config": {"tgt_vocab": 11}, "extra": {"task": "copy"}}).vocab == 11
    with pytest.raises(ValueError, match="no tokenizer"):
        checkpoint_tokenizer({"config": {"tgt_vocab": 11}, "extra": {"task": "klingon"}})


def copy_model(vocab=11, seed=0):
    torch.manual_seed(seed)
    return make_model(vocab, vocab, N=1, d_model=16, d_ff=32, h=2, dropout=0.0).eval()


def test_translate_lines_keeps_order_and_empty_lines():
    model = copy_model()
    lines = ["3 4 5", "", "6 7 8 9 10", "   ", "4 4", "3 4 5"]
    for beam_size in (1, 3):
        out = translate_lines(model, TokenIds(11), lines, beam_size=beam_size, batch_size=1)
        assert len(out) == len(lines)
        assert out[1] == "" and out[3] == ""
        assert [len(o.split()) for o in out] == [3, 0, 5, 0, 2, 3]
        assert out[0] == out[5]
        assert out == translate_lines(model, TokenIds(11), lines, beam_size=beam_size, batch_size=32)


def test_translate_lines_greedy_matches_greedy_decode():
    model = copy_model(seed=1)
    out = translate_lines(model, TokenIds(11), ["3 9 4 7"], beam_size=1)
    src = torch.tensor([[1, 3, 9, 4, 7]])
    expected = greedy_decode(model, src, padding_mask(src, PAD), 5, START)
    assert out == [" ".join(str(t) for t in expected[0, 1:].tolist())]
    assert translate(model, TokenIds(11), ["3 9 4 7"], beam_size=1) == out
    assert translate_ids(model, TokenIds(11), [[1, 3, 9, 4, 7]], beam_size=1) == [expected[0, 1:].tolist()]


def test_translate_lines_names_a_line_too_long_before_decoding(monkeypatch):
    model = copy_model()
    limit = positional_limits(model)[0]
    assert limit == 5000  # make_model's default table
    monkeypatch.setattr(model, "encode", lambda *args: pytest.fail("decoding started"))
    long_line = " ".join(["3"] * limit)
    tokens = len(TokenIds(11).encode(long_line))  # the end symbol included
    assert tokens > limit
    with pytest.raises(ValueError, match=rf"line 3 has {tokens} tokens; this model reads at most {limit}"):
        translate_lines(model, TokenIds(11), ["3 4", "", long_line])


def test_translate_lines_names_a_bad_line():
    with pytest.raises(ValueError, match="line 2"):
        translate_lines(copy_model(), TokenIds(11), ["3 4", "3 x"])


def test_translate_ids_beam_matches_beam_search_in_any_batch():
    """One entry point: beam sizes > 1 are beam_search's best hypothesis, whatever the batch and the order."""
    model = copy_model(seed=2).double()
    sources = [[1, 3, 4, 5], [1, 6, 7], [1, 8, 9, 10], [1, 4, 4]]
    tok = TokenIds(11)
    outputs = translate_ids(model, tok, sources, beam_size=3, batch_size=2)
    for source, output in zip(sources, outputs):
        src = torch.tensor([source])
        best = beam_search(model, src, padding_mask(src, PAD), len(source), START, None, beam_size=3)[0][0]
        assert output == best.tokens[1:].tolist()
    assert outputs == translate_ids(model, tok, sources[::-1], beam_size=3, batch_size=1)[::-1]
    assert outputs == translate_ids(model, tok, sources, beam_size=3, batch_size=1)


def test_translate_ids_and_translate_refuse_bad_input():
    model, tok = copy_model(), TokenIds(11)
    with pytest.raises(ValueError, match="beam_size and batch_size"):
        translate_ids(model, tok, [[1, 3]], beam_size=0)
    with pytest.raises(ValueError, match="length_penalty must be in"):  # greedy too: never silently ignored
        translate_ids(model, tok, [[1, 3]], beam_size=1, length_penalty=-3.0)
    with pytest.raises(ValueError, match="length penalty kind"):
        translate_ids(model, tok, [[1, 3]], beam_size=1, penalty="gmnt")
    with pytest.raises(ValueError, match="at least one token"):
        translate_ids(model, tok, [[1, 3], []])
    with pytest.raises(ValueError, match="sentence 1 is empty"):
        translate(model, tok, ["3 4", " "])
    with pytest.raises(ValueError, match="sentence 1: expected token ids"):
        translate(model, tok, ["3 4", "3 x"])
    with pytest.raises(TypeError, match="must be strings"):
        translate(model, tok, [[3, 4]])



def test_beam_search_accepts_src_mask_none_like_greedy_decode():
    model = tiny_model(0)
    src = torch.tensor([[3, 4, 4, 3, 1], [4, 3, 3, 1, 4]])
    everything = torch.ones(2, 1, 5, dtype=torch.bool)
    for n_best in (1, 3):
        ours = beam_search(model, src, None, 6, START, END, beam_size=3, n_best=n_best)
        masked = beam_search(model, src, everything, 6, START, END, beam_size=3, n_best=n_best)
        assert [[h.tokens.tolist() for h in hyps] for hyps in ours] == \
            [[h.tokens.tolist() for h in hyps] for hyps in masked]
        assert [[h.score for h in hyps] for hyps in ours] == [[h.score for h in hyps] for hyps in masked]
    # a beam of one without a mask is greedy decoding without a mask
    greedy = greedy_decode(model, src, None, 6, START, END)
    single = beam_search(model, src, None, 6, START, END, beam_size=1, length_penalty=0.0)
    for row, hyps in zip(greedy.tolist(), single):
        assert strip_special(row, START, END) == strip_special(hyps[0].tokens.tolist(), START, END)


@pytest.mark.parametrize("kwargs, name", [(dict(beam_size=2.5), "beam_size"), (dict(beam_size=True), "beam_size"),
                                          (dict(n_best=1.0), "n_best")])
def test_beam_search_refuses_non_integer_sizes_naming_them(kwargs, name):
    with pytest.raises(TypeError, match=rf"^{name} must be an integer"):
        beam_search(tiny_model(0), SRC, SRC_MASK, 5, START, END, **kwargs)


@pytest.mark.parametrize("kwargs, name", [(dict(beam_size=2.5), "beam_size"), (dict(batch_size=8.0), "batch_size"),
                                          (dict(max_len=7.5), "max_len")])
def test_translate_ids_refuses_non_integer_sizes_naming_them(kwargs, name):
    with pytest.raises(TypeError, match=rf"^{name} must be an integer"):
        translate_ids(copy_model(), TokenIds(11), [[1, 3, 4]], **kwargs)


def count_encodes(model):
    calls = []
    original = model.encode
    model.encode = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    return calls


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_source_longer_than_the_positional_table_is_refused_before_decoding(beam_size):
    model = copy_model()
    table = model.src_embed.position.max_len
    calls = count_encodes(model)
    sources = [[1, 3, 4], [1, 5, 6], [1, 7], [1] + [3] * table, [1, 4]]       # sentence 3 has table + 1 tokens
    with pytest.raises(ValueError, match=rf"^sentence 3 \(counting from 0\) has {table + 1} tokens; "
                                         rf"this model reads at most {table}"):
        translate_ids(model, TokenIds(11), sources, beam_size=beam_size, batch_size=1)
    with pytest.raises(ValueError, match=rf"sentence 1 \(counting from 0\) has {table + 1} tokens"):
        translate(model, TokenIds(11), ["3 4", " ".join(["3"] * table)], beam_size=beam_size)
    assert calls == []                                                         # nothing was decoded
    calls.clear()
    (out,) = translate_ids(model, TokenIds(11), [[1] + [3] * (table - 1)], beam_size=beam_size, max_len=3)
    assert len(calls) == 1 and len(out) == 2                                   # exactly the table's length is read


def test_max_len_beyond_the_target_table_is_refused_and_the_default_is_cut_to_it():
    model = copy_model()
    table = model.tgt_embed.position.max_len
    calls = count_encodes(model)
    with pytest.raises(ValueError, match=rf"max_len is {table + 1}, but this model's target positional table has {table} positions"):
        translate_ids(model, TokenIds(11), [[1, 3, 4]], max_len=table + 1)
    with pytest.raises(ValueError, match="max_len must be at least 2"):
        translate_ids(model, TokenIds(11), [[1, 3, 4]], max_len=1)
    assert calls == []

    class Generous(TokenIds):                       # a default limit beyond the table is cut to the table
        def max_len(self, source_length):
            return 10 ** 6

    small = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2, dropout=0.0).eval()
    for embed in (small.src_embed, small.tgt_embed):
        embed.position.max_len = 6                  # pretend a table of 6 positions (the buffer is longer)
    (out,) = translate_ids(small, Generous(11), [[1, 3, 4]], beam_size=1)
    assert len(out) == 5                            # 6 tokens with the start symbol, no end symbol


def test_translate_refuses_a_single_string_and_returns_a_list_for_no_sentences():
    model, tok = copy_model(), TokenIds(11)
    for single in ("3 4 5", b"3 4 5"):
        with pytest.raises(TypeError, match=r"list of sentences.*pass \[sentence\]"):
            translate(model, tok, single)
    with pytest.raises(TypeError, match="sources must be a list"):
        translate_ids(model, tok, "3 4 5")
    assert translate(model, tok, []) == [] and translate(model, tok, ()) == []
    assert translate_ids(model, tok, []) == []

def test_translate_ids_decodes_in_evaluation_mode():
    model = copy_model()
    model.train()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.9
    once = translate_ids(model, TokenIds(11), [[1, 3, 4, 5, 6]] * 4, beam_size=1)
    assert all(out == once[0] for out in once) and model.training   # no dropout, and the mode is restored


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from annotated_transformer.checkpoints import save_checkpoint

    model = copy_model()
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "copy.pt", model=model, config=model.config,
                           extra={"task": "copy"})


def test_translate_command_from_a_file(checkpoint, tmp_path, capsys):
    text = tmp_path / "in.txt"
    text.write_text("3 4 5\n\n7 8\n")
    assert main(["translate", "--checkpoint", str(checkpoint), "--input", str(text), "--beam-size", "2",
                 "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1] == ""
    assert [len(line.split()) for line in lines] == [3, 0, 2]


def test_translate_command_reads_standard_input(checkpoint):
    result = subprocess.run([sys.executable, "-m", "annotated_transformer", "translate", "--checkpoint",
                             str(checkpoint), "--beam-size", "1", "--device", "cpu"],
                            input="3 4 5\n\n", capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1] == "" and len(result.stdout.splitlines()) == 2
    assert len(result.stdout.splitlines()[0].split()) == 3


def test_translate_command_errors(checkpoint, tmp_path, capsys):
    assert main(["translate", "--checkpoint", str(tmp_path / "missing.pt"), "--device", "cpu"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    text = tmp_path / "bad.txt"
    text.write_text("3 4\nhello\n")
    assert main(["translate", "--checkpoint", str(checkpoint), "--input", str(text), "--device", "cpu"]) == 2
    assert "line 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # refused while parsing, naming the option
        main(["translate", "--checkpoint", str(checkpoint), "--beam-size", "0", "--device", "cpu"])
    assert refused.value.code == 2


def test_translate_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["translate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--checkpoint", "--beam-size", "--input", "--max-len", "--device", "--penalty"):
        assert option in out


# --- CUDA -----------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("cache", CACHES)  # compiled: CUDA graphs (mode "reduce-overhead")
@pytest.mark.parametrize("kind,alpha", PENALTIES[:3])
def test_beam_search_on_cuda_equals_cpu_and_exhaustive(kind, alpha, cache):
    model = tiny_model(0)
    outputs, lengths, log_p = enumerate_outputs(model, SRC, SRC_MASK, 5, vocab=5)
    best = penalised(log_p, lengths, kind, alpha).argmax().item()
    src = torch.tensor([[3, 4, 4, 3, 1], [4, 3, PAD, PAD, PAD]])
    mask = padding_mask(src, PAD)
    cpu = beam_search(model, src, mask, 5, START, END, beam_size=341, length_penalty=alpha, penalty=kind, n_best=3)
    gpu = beam_search(model.cuda(), src.cuda(), mask.cuda(), 5, START, END, beam_size=341, length_penalty=alpha,
                      penalty=kind, n_best=3, **CACHES[cache])
    assert torch.equal(gpu[0][0].tokens.cpu(), outputs[best, : lengths[best] + 1])
    for c_hyps, g_hyps in zip(cpu, gpu):
        for c, g in zip(c_hyps, g_hyps):
            assert g.tokens.is_cuda and torch.equal(c.tokens, g.tokens.cpu())
            assert g.score == pytest.approx(c.score, abs=1e-10)


@pytest.mark.cuda
def test_translate_lines_on_cuda():
    model = copy_model().double().cuda()
    lines = ["3 4 5", "", "6 7 8 9 10"]
    assert translate_lines(model, TokenIds(11), lines, beam_size=3) == \
        translate_lines(model.cpu(), TokenIds(11), lines, beam_size=3)
