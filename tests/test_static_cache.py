"""The static key/value cache and the compiled decoding step (book/attention.md, book/decoder.md,
book/decoding.md): fixed shapes and addresses, exact equality with the growing cache, one graph without a break,
and no recompilation as the position advances. The decoding paths are also compared in tests/test_decoding.py
and tests/test_beam_search.py."""
from __future__ import annotations

import pytest
import torch

import annotated_transformer.decoding as decoding
from annotated_transformer.attention import KVCache, MultiHeadedAttention, StaticKVCache
from annotated_transformer.beam_search import beam_search
from annotated_transformer.decoder import DecoderCache, StaticDecoderCache
from annotated_transformer.decoding import decode_step, greedy_decode
from annotated_transformer.masks import padding_mask
from annotated_transformer.positional import LearnedPositionalEmbedding, PositionalEncoding

PAD, START, END = 0, 1, 2


def padded_batch():
    torch.manual_seed(7)
    src = torch.randint(3, 10, (3, 6))
    src[1, 3:] = PAD
    return src, padding_mask(src, PAD)


# ---------------------------------------------------------------- the position as a tensor

@pytest.mark.parametrize("module", [PositionalEncoding(16, 0.0, max_len=40),
                                    LearnedPositionalEmbedding(16, 0.0, max_len=40)])
def test_a_position_tensor_gives_the_rows_of_the_int_offset(module):
    x = torch.randn(2, 3, 16)
    for offset in (0, 5, 37):
        assert torch.equal(module(x, torch.tensor(offset)), module(x, offset))
    with pytest.raises(ValueError, match="offset"):
        module(x, torch.tensor([1, 2]))            # not a single position
    with pytest.raises(ValueError, match="offset"):
        module(x, torch.tensor(1.0))               # not an integer


# ---------------------------------------------------------------- StaticKVCache

def test_static_kv_cache_writes_in_place_at_the_position():
    position = torch.tensor(0)
    cache = StaticKVCache(2, 3, 6, 4, position, dtype=torch.float64)
    key_address, value_address = cache.key.data_ptr(), cache.value.data_ptr()
    assert not cache.static and len(cache) == 6 and (cache.key == 0).all()
    k1, v1 = torch.randn(2, 3, 2, 4, dtype=torch.float64), torch.randn(2, 3, 2, 4, dtype=torch.float64)
    key, value = cache.update(k1, v1)                 # positions 0 and 1
    assert key is cache.key and value is cache.value and key.shape == (2, 3, 6, 4)
    position += 2
    k2, v2 = torch.randn(2, 3, 1, 4, dtype=torch.float64), torch.randn(2, 3, 1, 4, dtype=torch.float64)
    cache.update(k2, v2)                              # position 2
    assert torch.equal(cache.key[:, :, :3], torch.cat([k1, k2], dim=2))
    assert torch.equal(cache.value[:, :, :3], torch.cat([v1, v2], dim=2))
    assert (cache.key[:, :, 3:] == 0).all()
    index = torch.tensor([1, 0])
    first_slots, rest = cache.key[index, :, :2].clone(), cache.key[:, :, 2:].clone()
    cache.reorder(index, 2)                            # only the 2 slots named are reordered
    assert torch.equal(cache.key[:, :, :2], first_slots) and torch.equal(cache.key[:, :, 2:], rest)
    index = torch.tensor([1, 1])
    expected = cache.key[index].clone()
    cache.reorder(index)                              # all slots
    assert torch.equal(cache.key, expected)
    assert (cache.key.data_ptr(), cache.value.data_ptr()) == (key_address, value_address)


def test_static_self_attention_step_by_step_equals_the_growing_cache():
    torch.manual_seed(0)
    mha = MultiHeadedAttention(4, 16, dropout=0.0).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    position = torch.tensor(0)
    fixed, growing = StaticKVCache(2, 4, 8, 4, position, torch.float64), KVCache()
    with torch.no_grad():
        for t in range(5):
            step = x[:, t:t + 1]
            visible = (torch.arange(8) <= position).view(1, 1, 8)
            torch.testing.assert_close(mha(step, step, step, visible, cache=fixed),
                                       mha(step, step, step, cache=growing), rtol=0, atol=1e-12)
            position += 1


# ---------------------------------------------------------------- StaticDecoderCache

def test_cross_attention_is_projected_once_per_sentence_and_shared_by_its_rows(small_model):
    model = small_model()
    src, mask = padded_batch()
    calls = []
    hooks = [layer.src_attn.w_k.register_forward_hook(lambda m, args, out: calls.append(args[0].size(0)))
             for layer in model.decoder.layers]
    with torch.no_grad():
        memory = model.encode(src, mask)
        cache = StaticDecoderCache(model.decoder, memory, 9, rows_per_sentence=4)
    for hook in hooks:
        hook.remove()
    assert calls == [3] * len(model.decoder.layers)   # 3 sentences, not 12 rows
    for layer, (own, cross) in zip(model.decoder.layers, cache.layers):
        attention = layer.src_attn
        assert own.key.shape == (12, attention.h, 9, attention.d_k) and own.position is cache.position
        once = attention.split_heads(attention.w_k(memory)).detach()
        assert cross.static and torch.equal(cross.key, once.repeat_interleave(4, dim=0))


def test_mask_lets_each_new_position_see_the_slots_up_to_itself(small_model):
    model = small_model()
    src, mask = padded_batch()
    cache = StaticDecoderCache(model.decoder, model.encode(src, mask), 6)
    cache.position += 2
    expected = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(cache.mask(2), expected.unsqueeze(0))


@pytest.mark.parametrize("norm_first", [False, True])
def test_decode_step_equals_the_growing_cache_and_keeps_shapes(norm_first, small_model):
    model = small_model(norm_first=norm_first)
    src, mask = padded_batch()
    tokens = torch.randint(3, 10, (3, 7))
    with torch.no_grad():
        memory = model.encode(src, mask)
        fixed, growing = StaticDecoderCache(model.decoder, memory, 7), DecoderCache(len(model.decoder.layers))
        addresses = [own.key.data_ptr() for own, _ in fixed.layers]
        for t in range(7):
            step = tokens[:, t:t + 1]
            expected = model.generator(model.decode(memory, mask, step, None, cache=growing)[:, -1])
            torch.testing.assert_close(decode_step(model, memory, mask, fixed, step), expected, rtol=0, atol=1e-12)
            assert fixed.position.item() == t + 1
    assert [own.key.data_ptr() for own, _ in fixed.layers] == addresses


def test_a_static_cache_without_its_mask_is_refused_even_for_one_position(small_model):
    """Its unwritten slots (zeros) would be attended to: the outputs were silently wrong, not an error."""
    model = small_model()
    src, mask = padded_batch()
    with torch.no_grad():
        memory = model.encode(src, mask)
        fixed = StaticDecoderCache(model.decoder, memory, 5)
        step = model.tgt_embed(torch.full((src.size(0), 1), 1))
        with pytest.raises(ValueError, match=r"a static cache needs its mask\(T\) as tgt_mask"):
            model.decoder(step, memory, mask, None, cache=fixed)
        model.decoder(step, memory, mask, fixed.mask(1), cache=fixed)  # with it: runs


def test_bad_static_cache_arguments_are_refused(small_model):
    model = small_model()
    memory = torch.zeros(2, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="max_len"):
        StaticDecoderCache(model.decoder, memory, 0)
    with pytest.raises(TypeError, match="rows_per_sentence"):
        StaticDecoderCache(model.decoder, memory, 4, rows_per_sentence=2.0)


def test_a_max_len_beyond_the_positional_table_is_refused_before_decoding(small_model):
    model = small_model()
    src, mask = padded_batch()
    table = model.tgt_embed.position.max_len
    with pytest.raises(ValueError, match=f"max_len is {table + 1}.*{table} positions"):
        greedy_decode(model, src, mask, table + 1, START, END, static=True)
    with pytest.raises(ValueError, match=f"max_len is {table + 1}"):
        beam_search(model, src, mask, table + 1, START, END, beam_size=2, static=True)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(compile=True), ValueError, "static=True"),
    (dict(static=True, use_cache=False), ValueError, "use_cache=True"),
    (dict(static="yes"), TypeError, "static must be True or False"),
    (dict(compile=1, static=True), TypeError, "compile must be True or False"),
])
def test_inconsistent_cache_flags_are_refused(kwargs, error, match, small_model):
    model = small_model()
    src, mask = padded_batch()
    with pytest.raises(error, match=match):
        greedy_decode(model, src, mask, 5, START, END, **kwargs)
    if "use_cache" not in kwargs:
        with pytest.raises(error, match=match):
            beam_search(model, src, mask, 5, START, END, **kwargs)


def test_the_static_loop_cuts_the_steps_taken_after_every_sentence_ended(small_model, monkeypatch):
    """With a check every 5 steps (what a GPU does), the output is still cut where the last sentence ended."""
    model = small_model(seed=2)
    with torch.no_grad():
        model.generator.proj.bias[END] += 1.5
    src, mask = padded_batch()
    expected, expected_lp = greedy_decode(model, src, mask, 30, START, END, return_log_probs=True)
    assert expected.size(1) < 30 and expected.size(1) % 5 != 1      # it ended between two checks
    monkeypatch.setitem(decoding.STOP_CHECK_EVERY, "cpu", 5)
    tokens, log_probs = greedy_decode(model, src, mask, 30, START, END, return_log_probs=True, static=True)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(log_probs, expected_lp, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- compiling the step

@pytest.fixture
def counted_compile(monkeypatch):
    """Make compile=True use decode_step compiled with a backend that counts the graphs it is given."""
    torch._dynamo.reset()
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(decode_step, backend=backend, fullgraph=True)
    monkeypatch.setitem(decoding.COMPILED_STEPS, "cpu", compiled)
    yield graphs
    torch._dynamo.reset()


def test_decode_step_is_one_graph_without_a_break(small_model):
    model = small_model()
    src, mask = padded_batch()
    torch._dynamo.reset()
    with torch.no_grad():
        memory = model.encode(src, mask)
        cache = StaticDecoderCache(model.decoder, memory, 10)
        explained = torch._dynamo.explain(decode_step)(model, memory, mask, cache, torch.ones(3, 1, dtype=torch.long))
    torch._dynamo.reset()
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


def test_the_compiled_step_is_not_recompiled_as_the_position_advances(small_model, counted_compile):
    model = small_model()
    with torch.no_grad():
        model.generator.proj.bias[END] -= 100.0       # never ends: every one of the 11 steps is taken
    src, mask = padded_batch()
    expected = greedy_decode(model, src, mask, 12, START, END)
    tokens = greedy_decode(model, src, mask, 12, START, END, static=True, compile=True)
    assert torch.equal(tokens, expected) and tokens.size(1) == 12
    assert len(counted_compile) == 1                  # one graph for 11 positions
    greedy_decode(model, src.flip(0), mask.flip(0), 12, START, END, static=True, compile=True)
    assert len(counted_compile) == 1                  # and for another decode of the same shapes


def test_the_compiled_beam_step_is_one_graph_for_every_step(small_model, counted_compile):
    model = small_model()
    src, mask = padded_batch()
    expected = beam_search(model, src, mask, 9, START, END, beam_size=3, n_best=2)
    found = beam_search(model, src, mask, 9, START, END, beam_size=3, n_best=2, static=True, compile=True)
    for hyps, expected_hyps in zip(found, expected):
        for hyp, other in zip(hyps, expected_hyps):
            assert torch.equal(hyp.tokens, other.tokens)
            assert hyp.score == pytest.approx(other.score, abs=1e-12)
    assert len(counted_compile) == 1


def test_the_compiled_step_gets_masks_that_view_no_other_tensor(small_model, monkeypatch):
    """Dynamo guards on the tensor a view views: a greedy mask made by unsqueeze (a view) and a beam's repeated
    mask (none) gave two graphs of one shape, and a GPU ran out of its 8 graphs (2026-11-26). The step gets a copy."""
    seen = []

    def recording_step(model, memory, src_mask, cache, tokens):
        seen.append(src_mask._base is None)
        return decode_step(model, memory, src_mask, cache, tokens)

    monkeypatch.setitem(decoding.COMPILED_STEPS, "cpu", recording_step)
    model = small_model()
    src, mask = padded_batch()
    assert mask._base is not None                                 # padding_mask gives a view
    expected = greedy_decode(model, src, mask, 6, START, END)
    assert torch.equal(greedy_decode(model, src, mask, 6, START, END, static=True, compile=True), expected)
    beam_search(model, src, mask, 6, START, END, beam_size=2, static=True, compile=True)
    assert seen and all(seen)


def test_every_compiled_step_raises_the_graph_limit_again():
    """A limit patched around the first call (tests do) falls back to dynamo's default when the patch ends; the
    next call must raise it again, or the next shapes fail at 8 graphs (seen on a GPU, 2026-11-26)."""
    limits = torch._dynamo.config
    with limits.patch(recompile_limit=8):
        with limits.patch(recompile_limit=8):
            decoding.compiled_decode_step("cpu")
            assert limits.recompile_limit >= decoding.MAX_STEP_GRAPHS
        assert limits.recompile_limit == 8                        # the patch is undone
        decoding.compiled_decode_step("cpu")
        assert limits.recompile_limit >= decoding.MAX_STEP_GRAPHS


def test_the_compiled_cpu_step_freezes_the_weights_and_compiles_again_when_they_change(small_model):
    """On a CPU the compiled step bakes the weights in (inductor's freezing): after an in-place change of the
    weights, and after load_state_dict, it must decode with the new weights, not the frozen copy."""
    model = small_model(30, dtype=torch.float32)
    src, mask = padded_batch()
    torch._dynamo.reset()

    def decoded(**kwargs):
        return greedy_decode(model, src, mask, 8, START, END, **kwargs)

    first = decoded()
    assert torch.equal(decoded(static=True, compile=True), first)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.5)
    assert not torch.equal(decoded(), first)                 # new weights, other tokens
    assert torch.equal(decoded(static=True, compile=True), decoded())
    model.load_state_dict(before)
    assert torch.equal(decoded(static=True, compile=True), first)
    torch._dynamo.reset()


def test_the_compiled_cpu_step_compiles_with_frozen_weights_and_restores_the_setting(small_model):
    """Freezing is switched on around each call of the compiled CPU step, by hand (entering config.patch at every
    call slowed the step): the step must run the packed matrix products that freezing makes, and leave the setting
    as it was, so that no other compiled code of the user's freezes its weights."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("freezing packs weights for oneDNN/MKL only")
    model = small_model(30, dtype=torch.float32)
    src, mask = padded_batch()
    torch._dynamo.reset()
    config = torch._inductor.config
    assert config.freezing is False
    greedy_decode(model, src, mask, 8, START, END, static=True, compile=True)   # compiles
    assert config.freezing is False
    with torch.profiler.profile() as profile:
        greedy_decode(model, src, mask, 8, START, END, static=True, compile=True)
    names = {event.key for event in profile.key_averages()}
    assert any("mkl" in name for name in names), sorted(names)           # packed, not addmm
    assert config.freezing is False
    torch._dynamo.reset()


@pytest.mark.parametrize("fused", [False, True])
def test_an_optimiser_step_and_load_state_dict_change_the_weights_fingerprint(small_model, fused):
    """Fused Adam (make_optimizer's, on a CPU) leaves the version counters as they were: the fingerprint
    still sees its step (it counts optimiser steps)."""
    from annotated_transformer.decoding import weights_version

    model = small_model(30)
    start = weights_version(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    model.generator.proj.weight.sum().backward()
    optimizer.step()
    stepped = weights_version(model)
    model.load_state_dict(model.state_dict())
    assert stepped != start and weights_version(model) != stepped


def test_the_compiled_cpu_step_decodes_with_the_weights_after_a_make_optimizer_step():
    """The step frozen before training must not decode with the old weights after a fused Adam step (it did while the
    check read version counters only: this test failed then)."""
    from annotated_transformer.model import make_model
    from annotated_transformer.training import make_optimizer

    torch.manual_seed(0)
    model = make_model(30, 30, N=1, d_model=16, d_ff=32, h=2, dropout=0.0).eval()
    src = torch.randint(3, 30, (2, 5))
    mask = padding_mask(src, PAD)
    torch._dynamo.reset()
    greedy_decode(model, src, mask, 8, START, END, static=True, compile=True)  # freezes the weights
    optimizer = make_optimizer(model)
    for group in optimizer.param_groups:
        group["lr"] = 0.5  # a large step, so that the decode changes
    model.generator(model(src, src, mask, None)).sum().backward()  # in eval mode: no new graph
    optimizer.step()
    eager = greedy_decode(model, src, mask, 8, START, END, return_log_probs=True)
    compiled = greedy_decode(model, src, mask, 8, START, END, static=True, compile=True, return_log_probs=True)
    torch._dynamo.reset()
    assert torch.equal(eager[0], compiled[0])
    torch.testing.assert_close(eager[1], compiled[1], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the decoding benchmark's methods

def test_every_benchmark_method_decodes_the_same_and_a_bad_method_is_refused():
    from annotated_transformer.performance import DECODING_METHODS, decode_with, decoding_throughput
    from annotated_transformer.model import make_model

    torch.manual_seed(0)
    model = make_model(30, 30, N=1, d_model=16, d_ff=32, h=2, dropout=0.0).eval()
    with torch.no_grad():
        model.generator.proj.bias[END] = -1e4
    src = torch.randint(3, 30, (2, 5))
    decoded = {method: decode_with(method, model, src, padding_mask(src, PAD), 6, START, END)
               for method in DECODING_METHODS}
    greedy = [out for method, out in decoded.items() if method.startswith("greedy")]
    beams = [[hyps[0].tokens.tolist() for hyps in out] for method, out in decoded.items()
             if method.startswith("beam")]
    assert (len(greedy), len(beams)) == (4, 3)  # greedy also without a cache
    assert all(torch.equal(out, greedy[0]) for out in greedy) and greedy[0].shape == (2, 6)
    assert all(found == beams[0] for found in beams)
    with pytest.raises(ValueError, match="method must be one of"):
        decode_with("greedy, cached", model, src, None, 6, START, END)
    with pytest.raises(ValueError, match="must start with 'greedy, no cache'"):
        decoding_throughput(dict(N=1, d_model=16, d_ff=32, h=2, vocab=30), methods=("greedy, cache",))


# ---------------------------------------------------------------- arguments every cache kind shares

CACHES = [dict(use_cache=False), dict(), dict(static=True)]


def test_a_max_len_beyond_the_table_is_refused_by_every_cache_kind_before_any_work(small_model, monkeypatch):
    model = small_model()
    src, mask = padded_batch()
    monkeypatch.setattr(model, "encode", lambda *args: pytest.fail("encoded before the check"))
    table = model.tgt_embed.position.max_len
    for kind in CACHES:
        with pytest.raises(ValueError, match=f"max_len is {table + 1}, but the model's positional table"):
            greedy_decode(model, src, mask, table + 1, START, END, **kind)
    for static in (False, True):
        with pytest.raises(ValueError, match=f"max_len is {table + 1}"):
            beam_search(model, src, mask, table + 1, START, END, beam_size=2, static=static)


@pytest.mark.parametrize("symbols, error, match", [
    ((10, END), ValueError, r"start_symbol must be a token id in \[0, 10\), got 10"),
    ((-1, END), ValueError, r"start_symbol must be a token id in \[0, 10\), got -1"),
    ((START, 10), ValueError, r"end_symbol must be a token id in \[0, 10\), got 10"),
    ((True, END), TypeError, "start_symbol must be an integer, got a bool"),
    ((START, 2.0), TypeError, "end_symbol must be an integer, got float"),
])
def test_a_symbol_outside_the_vocabulary_is_refused_by_name(small_model, symbols, error, match):
    model = small_model()  # a vocabulary of 10
    src, mask = padded_batch()
    for kind in CACHES:
        with pytest.raises(error, match=match):
            greedy_decode(model, src, mask, 5, *symbols, **kind)
    with pytest.raises(error, match=match):
        beam_search(model, src, mask, 5, *symbols, beam_size=2)


def test_an_empty_batch_decodes_to_an_empty_batch_with_every_cache_kind(small_model):
    model = small_model()
    src = torch.zeros((0, 5), dtype=torch.long)
    for kind in CACHES:
        tokens, scores = greedy_decode(model, src, padding_mask(src, PAD), 6, START, END, return_log_probs=True,
                                       **kind)
        assert tokens.shape == (0, 1) and scores.shape == (0, 0)
    assert beam_search(model, src, padding_mask(src, PAD), 6, START, END, beam_size=2, static=True) == []


def test_one_mask_row_for_the_whole_batch_is_broadcast_to_every_beam(small_model):
    """A (1, 1, S) mask, which the encoder and greedy_decode accept for a batch, also serves beam search's B k rows."""
    model = small_model()
    src = torch.randint(3, 10, (2, 6), generator=torch.Generator().manual_seed(3))
    one_row = torch.ones(1, 1, 6, dtype=torch.bool)
    for static in (False, True):
        found = beam_search(model, src, one_row, 7, START, END, beam_size=3, static=static)
        full = beam_search(model, src, one_row.expand(2, 1, 6), 7, START, END, beam_size=3, static=static)
        assert [[h.tokens.tolist() for h in hyps] for hyps in found] == [[h.tokens.tolist() for h in hyps]
                                                                            for hyps in full]


def test_the_compiled_step_decodes_without_a_mask(small_model, counted_compile):
    """src_mask=None (every source position visible) is valid for the compiled step, as for the others."""
    model = small_model()
    src, _ = padded_batch()
    expected = greedy_decode(model, src, None, 8, START, END)
    assert torch.equal(greedy_decode(model, src, None, 8, START, END, static=True, compile=True), expected)
    found = beam_search(model, src, None, 8, START, END, beam_size=2, static=True, compile=True)
    assert [hyps[0].tokens.tolist() for hyps in found] == [
        hyps[0].tokens.tolist() for hyps in beam_search(model, src, None, 8, START, END, beam_size=2)]


def test_a_source_on_another_device_than_the_model_is_refused_by_name(small_model):
    """Checked before the encoder runs, instead of PyTorch's error from deep inside the embedding (here with the
    meta device, which every machine has, standing in for a GPU)."""
    model = small_model()
    src = torch.ones((2, 4), dtype=torch.long, device="meta")
    for kind in CACHES:
        with pytest.raises(ValueError, match="src is on meta but the model on cpu"):
            greedy_decode(model, src, None, 5, START, END, **kind)
    with pytest.raises(ValueError, match="src is on meta but the model on cpu"):
        beam_search(model, src, None, 5, START, END, beam_size=2)
