"""Greedy decoding and the key/value cache (book/decoding.md). The decoding benchmark is tested in
tests/test_bench.py."""
from __future__ import annotations

import pytest
import torch

from annotated_transformer.decoder import DecoderCache
from annotated_transformer.decoding import greedy_decode
from annotated_transformer.masks import padding_mask, subsequent_mask

PAD, START, END = 0, 1, 2
# The cached ways of decoding, each compared with the recomputing one (use_cache=False): the growing cache, the
# static cache, and the static cache with its step compiled (on a CPU: the default mode of torch.compile).
CACHES = {"growing": {}, "static": dict(static=True), "compiled": dict(static=True, compile=True)}


@pytest.fixture(autouse=True)
def compiled_code_or_failure():
    """The "compiled" cases compile one graph per model and shape: allow more than dynamo's default of 8, and fail
    rather than fall back to eager code at the limit, so that a compiled case really runs compiled code."""
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        yield


@pytest.fixture
def small_model(small_model):
    """The shared small model (tests/conftest.py), seed first, with its output bias raised for the end symbol."""

    def build(seed=0, norm_first=False, end_bias=1.0, vocab=10, dtype=torch.float64, dropout=0.0):
        model = small_model(vocab, seed=seed, norm_first=norm_first, dtype=dtype, dropout=dropout)
        with torch.no_grad():
            model.generator.proj.bias[END] += end_bias
        return model

    return build


def padded_batch(device="cpu"):
    torch.manual_seed(123)
    src = torch.randint(3, 10, (6, 9))
    src[1, 4:] = PAD
    src[3, 2:] = PAD
    src[5, 7:] = PAD
    return src.to(device), padding_mask(src, PAD).to(device)


def end_positions(tokens):
    return [(row == END).nonzero()[0].item() if (row == END).any() else None for row in tokens]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("norm_first", [False, True])
def test_cache_equals_no_cache_with_padding(norm_first, cache, small_model):
    # the compiled step compiles again for every model (its weights are frozen in): one model is enough for it
    for seed in range(1 if cache == "compiled" else 3):
        model = small_model(seed, norm_first)
        src, mask = padded_batch()
        cached, cached_lp = greedy_decode(model, src, mask, 20, START, END, return_log_probs=True, **CACHES[cache])
        full, full_lp = greedy_decode(model, src, mask, 20, START, END, use_cache=False, return_log_probs=True)
        assert torch.equal(cached, full)
        assert cached_lp.dtype == torch.float64
        torch.testing.assert_close(cached_lp, full_lp, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cache", CACHES)
def test_cache_equals_no_cache_without_end_symbol(cache, small_model):
    model = small_model(1, end_bias=0.0)
    src, mask = padded_batch()
    cached, cached_lp = greedy_decode(model, src, mask, 16, START, return_log_probs=True, **CACHES[cache])
    full, full_lp = greedy_decode(model, src, mask, 16, START, use_cache=False, return_log_probs=True)
    assert cached.shape == (6, 16) and torch.equal(cached, full)
    torch.testing.assert_close(cached_lp, full_lp, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cache", ["growing", "static"])
def test_each_sentence_stops_at_its_end_symbol(cache, small_model):
    model = small_model(2, end_bias=1.25)
    src, mask = padded_batch()
    out, log_probs = greedy_decode(model, src, mask, 25, START, END, return_log_probs=True, **CACHES[cache])
    ends = end_positions(out)
    assert out[:, 0].eq(START).all()
    assert any(e is not None for e in ends)
    for i, e in enumerate(ends):
        if e is not None:
            assert out[i, e:].eq(END).all() and log_probs[i, e:].eq(0).all()
            assert log_probs[i, : e - 1].lt(0).all()
    if all(e is not None for e in ends):  # stopped as soon as the last sentence ended
        assert out.size(1) == max(ends) + 1
    else:
        assert out.size(1) == 25


@pytest.mark.parametrize("cache", ["growing", "static"])
def test_decoding_stops_early_when_all_sentences_end(cache, small_model):
    model = small_model(0, end_bias=6.0)  # the end symbol is by far the most likely token
    src, mask = padded_batch()
    out = greedy_decode(model, src, mask, 30, START, END, **CACHES[cache])
    assert out.tolist() == [[START, END]] * 6


@pytest.mark.parametrize("cache", ["growing", "static"])
def test_sentence_alone_equals_sentence_in_padded_batch(cache, small_model):
    model = small_model(3)
    src, mask = padded_batch()
    out, log_probs = greedy_decode(model, src, mask, 15, START, END, return_log_probs=True, **CACHES[cache])
    for i in range(src.size(0)):
        alone = src[i:i + 1, : int((src[i] != PAD).sum())]
        tokens, lp = greedy_decode(model, alone, padding_mask(alone, PAD), 15, START, END, return_log_probs=True,
                                   **CACHES[cache])
        assert torch.equal(tokens[0], out[i, : tokens.size(1)])
        torch.testing.assert_close(lp[0], log_probs[i, : lp.size(1)], rtol=0, atol=1e-12)


def test_teacher_forced_replay_reproduces_greedy_choices(small_model):
    model = small_model(4)
    src, mask = padded_batch()
    out, log_probs = greedy_decode(model, src, mask, 12, START, END, return_log_probs=True)
    with torch.no_grad():
        replay = model.generator(model(src, out[:, :-1], mask, subsequent_mask(out.size(1) - 1)))
    live = torch.ones_like(out[:, 1:], dtype=torch.bool)
    for i, e in enumerate(end_positions(out)):
        if e is not None:
            live[i, e:] = False
    assert torch.equal(replay.argmax(-1)[live], out[:, 1:][live])
    torch.testing.assert_close(replay.max(-1).values[live], log_probs[live], rtol=0, atol=1e-12)


def test_cached_step_uses_the_true_position(small_model):
    """Regression test for the cache trap: a new token embedded at position 0 changes the outputs."""
    model = small_model(5, end_bias=0.0)
    src, mask = padded_batch()
    with torch.no_grad():
        memory = model.encode(src, mask)
        good, bad = DecoderCache(2), DecoderCache(2)
        ys = torch.full((6, 1), START)
        for step in range(4):
            right = model.decode(memory, mask, ys[:, -1:], None, cache=good)
            wrong = model.decoder(model.tgt_embed(ys[:, -1:], 0), memory, mask, None, bad)
            if step == 0:
                assert torch.equal(right, wrong)
            else:
                assert (right - wrong).abs().max() > 1e-3
            ys = torch.cat([ys, model.generator(right[:, -1]).argmax(-1, keepdim=True)], dim=1)
    assert len(good) == 4


@pytest.mark.parametrize("cache", ["growing", "static"])
def test_max_len_one_returns_the_start_symbol(cache, small_model):
    model = small_model()
    src, mask = padded_batch()
    out, log_probs = greedy_decode(model, src, mask, 1, START, END, return_log_probs=True, **CACHES[cache])
    assert out.tolist() == [[START]] * 6 and log_probs.shape == (6, 0)


@pytest.mark.parametrize("max_len, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)])
def test_bad_max_len_is_refused(max_len, error, small_model):
    model = small_model()
    src, mask = padded_batch()
    with pytest.raises(error, match="max_len"):  # a number that is not an int: a TypeError, as for start_symbol
        greedy_decode(model, src, mask, max_len, START, END)


@pytest.mark.parametrize("src", [torch.tensor([3, 4, 5]), torch.zeros((2, 0), dtype=torch.long)])
def test_one_dimensional_or_empty_source_is_refused(src, small_model):
    model = small_model()
    with pytest.raises(ValueError, match="src must have shape"):
        greedy_decode(model, src, None, 5, START, END)


@pytest.mark.parametrize("way", [dict(use_cache=False), dict(), dict(static=True)])
def test_a_sentence_of_padding_only_is_refused(way, small_model):
    """It decoded, silently, to the translation of no source (attention gives a fully masked row zeros)."""
    src, _ = padded_batch()
    src[1] = PAD
    with pytest.raises(ValueError, match=r"src_mask hides every token of sentence\(s\) \[1\] \(padding only\)"):
        greedy_decode(small_model(), src, padding_mask(src, PAD), 5, START, END, **way)
    greedy_decode(small_model(), src, None, 5, START, END, **way)  # no mask: every position is seen


@pytest.mark.parametrize("mask", [torch.ones(9, dtype=torch.bool), torch.ones((), dtype=torch.bool)])
def test_a_mask_of_another_shape_is_still_one_clear_error(mask, small_model):
    """The padding-only check must leave a mask it cannot read to the attention's own check, not crash on it."""
    src, _ = padded_batch()
    with pytest.raises((ValueError, TypeError), match="mask"):
        greedy_decode(small_model(), src, mask, 5, START, END)


def test_training_mode_dropout_makes_decoding_random_and_eval_fixes_it(small_model):
    model = small_model(dropout=0.3).train()
    src, mask = padded_batch()
    torch.manual_seed(0)
    runs = [greedy_decode(model, src, mask, 10, START, return_log_probs=True)[1] for _ in range(2)]
    assert not torch.allclose(runs[0], runs[1])
    model.eval()
    runs = [greedy_decode(model, src, mask, 10, START, return_log_probs=True)[1] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("cache", ["growing", "static"])
def test_float32_model_gives_float32_log_probs(cache, small_model):
    model = small_model(dtype=torch.float32)
    src, mask = padded_batch()
    out, log_probs = greedy_decode(model, src, mask, 6, START, END, return_log_probs=True, **CACHES[cache])
    assert out.dtype == torch.long and log_probs.dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.parametrize("cache", CACHES)  # compiled: CUDA graphs (mode "reduce-overhead")
@pytest.mark.parametrize("norm_first", [False, True])
def test_cache_equals_no_cache_on_cuda(norm_first, cache, small_model):
    model = small_model(0, norm_first).cuda()
    src, mask = padded_batch("cuda")
    cached, cached_lp = greedy_decode(model, src, mask, 20, START, END, return_log_probs=True, **CACHES[cache])
    full, full_lp = greedy_decode(model, src, mask, 20, START, END, use_cache=False, return_log_probs=True)
    assert cached.is_cuda and torch.equal(cached, full)
    torch.testing.assert_close(cached_lp, full_lp, rtol=0, atol=1e-10)
    cpu, cpu_lp = greedy_decode(model.cpu(), src.cpu(), mask.cpu(), 20, START, END, return_log_probs=True)
    assert torch.equal(cpu, cached.cpu())
    torch.testing.assert_close(cpu_lp, cached_lp.cpu(), rtol=0, atol=1e-10)
