"""Tests of annotated_transformer.attention: attention, check_mask, KVCache, MultiHeadedAttention."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from annotated_transformer.attention import KVCache, MultiHeadedAttention, attention, check_mask

B, T, S, D, H = 2, 5, 7, 16, 4


def make_mha(h=H, d_model=D, dropout=0.0, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return MultiHeadedAttention(h, d_model, dropout=dropout).to(dtype).eval()


def randn(*shape, dtype=torch.float64, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return torch.randn(*shape, dtype=dtype)


def padding(batch=B, length=S, lengths=(S, S - 3)):
    mask = torch.zeros(batch, 1, length, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, 0, :n] = True
    return mask


def causal(length):
    return torch.ones(1, length, length, dtype=torch.bool).tril()


def torch_mha_from(mha):
    ref = nn.MultiheadAttention(mha.d_model, mha.h, dropout=0.0, batch_first=True)
    ref = ref.to(mha.w_q.weight.dtype).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([mha.w_q.weight, mha.w_k.weight, mha.w_v.weight]))
        ref.in_proj_bias.copy_(torch.cat([mha.w_q.bias, mha.w_k.bias, mha.w_v.bias]))
        ref.out_proj.weight.copy_(mha.w_o.weight)
        ref.out_proj.bias.copy_(mha.w_o.bias)
    return ref


def per_head_loop(mha, query, key, value, mask=None):
    mask = check_mask(mask, query.size(0), query.size(1), key.size(1))
    mask = None if mask is None else mask[:, 0]
    heads = []
    for i in range(mha.h):
        rows = slice(i * mha.d_k, (i + 1) * mha.d_k)
        q = query @ mha.w_q.weight[rows].T + mha.w_q.bias[rows]
        k = key @ mha.w_k.weight[rows].T + mha.w_k.bias[rows]
        v = value @ mha.w_v.weight[rows].T + mha.w_v.bias[rows]
        scores = q @ k.transpose(-2, -1) / math.sqrt(mha.d_k)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(scores.softmax(-1) @ v)
    return mha.w_o(torch.cat(heads, dim=-1))


# ---------------------------------------------------------------- attention()

def random_mask_with_empty_row(seed=1):
    torch.manual_seed(seed)
    mask = torch.rand(B, 1, T, S) > 0.4
    mask[..., 0] = True               # every other row has something to attend to
    mask[1, 0, 3] = False             # one row with nothing allowed
    return mask


def test_attention_equals_sdpa_without_mask():
    q, k, v = randn(B, H, T, 8, seed=0), randn(B, H, S, 8), randn(B, H, S, 3)
    out, weights = attention(q, k, v)
    assert out.shape == (B, H, T, 3) and weights.shape == (B, H, T, S)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-12, rtol=0)
    expected = (q @ k.transpose(-2, -1) / math.sqrt(8)).softmax(-1)
    torch.testing.assert_close(weights, expected, atol=1e-12, rtol=0)


def test_attention_equals_sdpa_with_mask_and_fully_masked_row():
    q, k, v = randn(B, H, T, 8, seed=0), randn(B, H, S, 8), randn(B, H, S, 8)
    mask = random_mask_with_empty_row()
    out, weights = attention(q, k, v, mask)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert not reference.isnan().any()
    torch.testing.assert_close(out, reference, atol=1e-12, rtol=0)


def test_attention_weights_rows_sum_to_one_and_masked_positions_get_zero():
    q, k, v = randn(B, H, T, 8, seed=0), randn(B, H, S, 8), randn(B, H, S, 8)
    mask = random_mask_with_empty_row()
    _, weights = attention(q, k, v, mask)
    assert (weights.masked_select(~mask) == 0).all()
    sums = weights.sum(-1)
    allowed = mask.any(-1).expand_as(sums)
    torch.testing.assert_close(sums[allowed], torch.ones_like(sums[allowed]), atol=1e-12, rtol=0)
    assert (sums[~allowed] == 0).all()


def test_fully_masked_rows_give_zeros_not_nan():
    q, k, v = randn(1, 1, 3, 4, seed=0), randn(1, 1, 3, 4), randn(1, 1, 3, 4)
    mask = torch.tensor([[[[True, False, False], [False, False, False], [True, True, True]]]])
    out, weights = attention(q, k, v, mask)
    assert not out.isnan().any() and not weights.isnan().any()
    assert (out[0, 0, 1] == 0).all() and (weights[0, 0, 1] == 0).all()
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])    # one allowed key: its value, exactly


def test_fully_masked_rows_have_finite_gradients():
    q, k, v = (randn(1, 1, 3, 4, seed=i).requires_grad_() for i in range(3))
    mask = torch.tensor([[[[True, True, False], [False, False, False], [True, True, True]]]])
    out, _ = attention(q, k, v, mask)
    out.sum().backward()
    for tensor in (q, k, v):
        assert torch.isfinite(tensor.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_in_16_bit_does_not_overflow(dtype):
    # -1e9 cannot be stored in float16: the reason for torch.finfo(dtype).min.
    assert torch.tensor(-1e9, dtype=torch.float16).isinf()
    with pytest.raises(RuntimeError):
        torch.zeros(2, dtype=torch.float16).masked_fill(torch.tensor([True, False]), -1e9)
    q, k, v = (randn(B, H, n, 8, seed=i).to(dtype) for i, n in enumerate((T, S, S)))
    mask = random_mask_with_empty_row()
    out, weights = attention(q, k, v, mask)
    assert out.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    assert (out[1, :, 3] == 0).all()
    expected, _ = attention(q.double(), k.double(), v.double(), mask)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_attention_rejects_non_bool_mask():
    q = randn(1, 2, 4)
    with pytest.raises(TypeError, match="bool"):
        attention(q, q, q, torch.ones(1, 2, 2))
    with pytest.raises(TypeError, match="bool"):
        attention(q, q, q, torch.ones(1, 2, 2, dtype=torch.long))


def test_attention_applies_dropout_to_the_weights():
    q, k, v = randn(1, 1, 50, 8, seed=0), randn(1, 1, 50, 8), randn(1, 1, 50, 8)
    _, clean = attention(q, k, v)
    torch.manual_seed(0)
    out, dropped = attention(q, k, v, dropout=nn.Dropout(0.5))
    kept = dropped != 0
    assert 0.3 < kept.double().mean() < 0.7
    torch.testing.assert_close(dropped[kept], 2 * clean[kept])         # survivors scaled by 1 / (1 - p)
    torch.testing.assert_close(out, dropped @ v)
    _, evaluated = attention(q, k, v, dropout=nn.Dropout(0.5).eval())
    torch.testing.assert_close(evaluated, clean)


# ---------------------------------------------------------------- check_mask()

def test_check_mask_adds_the_head_axis():
    assert check_mask(None, B, T, S) is None
    assert check_mask(torch.ones(B, 1, S, dtype=torch.bool), B, T, S).shape == (B, 1, 1, S)
    assert check_mask(torch.ones(B, T, S, dtype=torch.bool), B, T, S).shape == (B, 1, T, S)
    assert check_mask(torch.ones(1, T, S, dtype=torch.bool), B, T, S).shape == (1, 1, T, S)


@pytest.mark.parametrize("shape", [(B, S), (B, 1, 1, S), (B + 1, 1, S), (B, T + 1, S), (B, 1, S + 1), (S,)])
def test_check_mask_rejects_wrong_shapes(shape):
    with pytest.raises(ValueError, match="mask has shape"):
        check_mask(torch.ones(shape, dtype=torch.bool), B, T, S)


@pytest.mark.parametrize("mask", [torch.ones(B, 1, S), torch.ones(B, 1, S, dtype=torch.uint8), [[True] * S]])
def test_check_mask_rejects_non_bool(mask):
    with pytest.raises(TypeError, match="bool"):
        check_mask(mask, B, T, S)


# ---------------------------------------------------------------- KVCache

def test_kv_cache_update_appends_and_len_counts_positions():
    cache = KVCache()
    assert len(cache) == 0 and not cache.static
    k1, v1 = randn(B, H, 3, 4, seed=0), randn(B, H, 3, 4)
    k2, v2 = randn(B, H, 1, 4), randn(B, H, 1, 4)
    assert cache.update(k1, v1) == (k1, v1)
    k, v = cache.update(k2, v2)
    assert len(cache) == 4
    torch.testing.assert_close(k, torch.cat([k1, k2], dim=2))
    torch.testing.assert_close(v, torch.cat([v1, v2], dim=2))


def test_static_kv_cache_stores_once():
    cache = KVCache(static=True)
    k1, v1 = randn(B, H, 6, 4, seed=0), randn(B, H, 6, 4)
    cache.update(k1, v1)
    assert len(cache) == 6 and cache.key is k1 and cache.value is v1
    k2, v2 = randn(B, H, 6, 4), randn(B, H, 6, 4)
    cache.update(k2, v2)                     # a static cache replaces, never appends
    assert len(cache) == 6 and cache.key is k2


def test_kv_cache_reorder_selects_batch_entries():
    cache = KVCache()
    cache.reorder(torch.tensor([0]))        # empty: nothing to do
    assert len(cache) == 0
    k, v = randn(3, H, 2, 4, seed=0), randn(3, H, 2, 4)
    cache.update(k, v)
    index = torch.tensor([2, 2, 0])
    cache.reorder(index)
    torch.testing.assert_close(cache.key, k[index])
    torch.testing.assert_close(cache.value, v[index])


def test_incremental_self_attention_equals_full_causal_attention():
    mha = make_mha()
    x = randn(B, 6, D, seed=1)
    with torch.no_grad():
        full = mha(x, x, x, causal(6))
        cache = KVCache()
        steps = [mha(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], cache=cache) for t in range(6)]
    assert len(cache) == 6
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)


def test_incremental_self_attention_in_chunks_with_mask():
    mha = make_mha()
    x = randn(B, 6, D, seed=1)
    with torch.no_grad():
        full = mha(x, x, x, causal(6))
        cache = KVCache()
        first = mha(x[:, :4], x[:, :4], x[:, :4], causal(4), cache=cache)
        chunk_mask = causal(6)[:, 4:]       # queries 4 and 5 against all 6 keys
        second = mha(x[:, 4:], x[:, 4:], x[:, 4:], chunk_mask, cache=cache)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-12, rtol=0)


def test_cached_cross_attention_equals_full_cross_attention():
    mha = make_mha()
    x, memory = randn(B, T, D, seed=1), randn(B, S, D)
    pad = padding()
    with torch.no_grad():
        full = mha(x, memory, memory, pad)
        cache = KVCache(static=True)
        steps = [mha(x[:, t:t + 1], memory, memory, pad, cache=cache) for t in range(T)]
        stored = cache.key
        # once filled, the static cache is used and the key/value arguments are not projected again
        again = mha(x[:, :1], torch.zeros_like(memory), torch.zeros_like(memory), pad, cache=cache)
    assert len(cache) == S and cache.key is stored
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)
    torch.testing.assert_close(again, full[:, :1], atol=1e-12, rtol=0)


# ---------------------------------------------------------------- MultiHeadedAttention

def test_mha_sizes_and_parameters():
    mha = MultiHeadedAttention(8, 512)
    assert (mha.h, mha.d_model, mha.d_k) == (8, 512, 64)
    assert mha.dropout.p == 0.1 and mha.record_attention is False and mha.attention_weights is None
    assert sorted(name for name, _ in mha.named_children()) == ["dropout", "w_k", "w_o", "w_q", "w_v"]
    assert sum(p.numel() for p in mha.parameters()) == 4 * (512 * 512 + 512)


def test_mha_split_heads():
    mha = make_mha()
    x = randn(B, T, D, seed=0)
    heads = mha.split_heads(x)
    assert heads.shape == (B, H, T, D // H)
    torch.testing.assert_close(heads[1, 2, 3], x[1, 3, 2 * 4:3 * 4])    # head 2 = features 8..11 of each position


@pytest.mark.parametrize("h, d_model", [(3, 512), (0, 16), (5, 16)])
def test_mha_rejects_d_model_not_divisible_by_h(h, d_model):
    with pytest.raises(ValueError, match=rf"d_model \({d_model}\).*h \({h}\)"):
        MultiHeadedAttention(h, d_model)


@pytest.mark.parametrize("mask_name", ["none", "padding", "causal", "padding+causal"])
def test_mha_equals_per_head_loop(mask_name):
    mha = make_mha()
    x = randn(B, S, D, seed=1)
    mask = {"none": None, "padding": padding(), "causal": causal(S), "padding+causal": padding() & causal(S)}[mask_name]
    with torch.no_grad():
        torch.testing.assert_close(mha(x, x, x, mask), per_head_loop(mha, x, x, x, mask), atol=1e-12, rtol=0)


def test_mha_cross_attention_equals_per_head_loop():
    mha = make_mha()
    q, kv = randn(B, T, D, seed=1), randn(B, S, D)
    with torch.no_grad():
        ours = mha(q, kv, kv, padding())
        loop = per_head_loop(mha, q, kv, kv, padding())
    torch.testing.assert_close(ours, loop, atol=1e-12, rtol=0)


def test_mha_equals_nn_multihead_attention_without_mask():
    mha = make_mha()
    ref = torch_mha_from(mha)
    q, kv = randn(B, T, D, seed=1), randn(B, S, D)
    with torch.no_grad():
        torch.testing.assert_close(mha(q, kv, kv), ref(q, kv, kv, need_weights=False)[0], atol=1e-12, rtol=0)


def test_mha_equals_nn_multihead_attention_with_key_padding_mask():
    mha = make_mha()
    ref = torch_mha_from(mha)
    q, kv = randn(B, T, D, seed=1), randn(B, S, D)
    pad = padding()
    with torch.no_grad():
        ours = mha(q, kv, kv, pad)
        theirs = ref(q, kv, kv, key_padding_mask=~pad[:, 0], need_weights=False)[0]   # True = NOT allowed
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)


def test_mha_equals_nn_multihead_attention_with_causal_mask():
    mha = make_mha()
    ref = torch_mha_from(mha)
    x = randn(B, S, D, seed=1)
    with torch.no_grad():
        ours = mha(x, x, x, causal(S))
        theirs = ref(x, x, x, attn_mask=~causal(S)[0], need_weights=False)[0]
        theirs_flag = ref(x, x, x, attn_mask=~causal(S)[0], is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
    torch.testing.assert_close(ours, theirs_flag, atol=1e-12, rtol=0)


def test_mha_equals_nn_multihead_attention_with_padding_and_causal_masks():
    mha = make_mha()
    ref = torch_mha_from(mha)
    x = randn(B, S, D, seed=1)
    pad = padding()
    both = pad & causal(S)
    with torch.no_grad():
        ours = mha(x, x, x, both)
        separate = ref(x, x, x, key_padding_mask=~pad[:, 0], attn_mask=~causal(S)[0], need_weights=False)[0]
        per_head = ref(x, x, x, attn_mask=~both.repeat_interleave(H, dim=0), need_weights=False)[0]
    torch.testing.assert_close(ours, separate, atol=1e-12, rtol=0)
    torch.testing.assert_close(ours, per_head, atol=1e-12, rtol=0)


def test_nn_multihead_attention_mask_convention_is_inverted():
    """Passing our mask (True = may attend) to nn.MultiheadAttention unchanged gives a different answer."""
    mha = make_mha()
    ref = torch_mha_from(mha)
    x = randn(B, S, D, seed=1)
    with torch.no_grad():
        ours = mha(x, x, x, padding())
        wrong = ref(x, x, x, key_padding_mask=padding()[:, 0], need_weights=False)[0]
    assert not torch.allclose(ours, wrong, atol=1e-6)


def test_mha_equals_sdpa_on_projected_heads():
    mha = make_mha()
    q, kv = randn(B, T, D, seed=1), randn(B, S, D)
    mask = padding() & torch.ones(1, T, S, dtype=torch.bool).tril(diagonal=2)
    with torch.no_grad():
        heads = [mha.split_heads(linear(x)) for linear, x in ((mha.w_q, q), (mha.w_k, kv), (mha.w_v, kv))]
        x = F.scaled_dot_product_attention(*heads, attn_mask=mask.unsqueeze(1))
        expected = mha.w_o(x.transpose(1, 2).reshape(B, T, D))
        torch.testing.assert_close(mha(q, kv, kv, mask), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mask_name", ["none", "padding", "padding+causal", "fully masked row"])
def test_record_attention_path_equals_fast_path(mask_name):
    mha = make_mha()
    x = randn(B, S, D, seed=1)
    mask = {"none": None, "padding": padding(), "padding+causal": padding() & causal(S),
            "fully masked row": causal(S).repeat(B, 1, 1)}[mask_name]
    if mask_name == "fully masked row":
        mask[1, 2] = False
    with torch.no_grad():
        fast = mha(x, x, x, mask)
        assert mha.attention_weights is None
        mha.record_attention = True
        explicit = mha(x, x, x, mask)
    torch.testing.assert_close(fast, explicit, atol=1e-12, rtol=0)
    weights = mha.attention_weights
    assert weights.shape == (B, H, S, S) and not weights.requires_grad
    if mask is not None:
        assert (weights.masked_select(~mask.unsqueeze(1)) == 0).all()
        rows = mask.any(-1).unsqueeze(1).expand(B, H, S)
    else:
        rows = torch.ones(B, H, S, dtype=torch.bool)
    torch.testing.assert_close(weights.sum(-1)[rows], torch.ones_like(weights.sum(-1)[rows]))
    assert (weights.sum(-1)[~rows] == 0).all()


def test_record_attention_path_has_the_same_gradients():
    x = randn(B, S, D, seed=1)
    mask = padding() & causal(S)
    grads = []
    for record in (False, True):
        mha = make_mha()
        mha.record_attention = record
        inp = x.clone().requires_grad_()
        mha(inp, inp, inp, mask).square().sum().backward()
        grads.append([inp.grad] + [p.grad for p in mha.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_mha_fully_masked_query_gives_output_bias_and_no_nan():
    mha = make_mha()
    x = randn(1, 3, D, seed=1)
    mask = torch.tensor([[[True, False, False], [False, False, False], [True, True, True]]])
    for record in (False, True):
        mha.record_attention = record
        with torch.no_grad():
            out = mha(x, x, x, mask)
        assert not out.isnan().any()
        torch.testing.assert_close(out[0, 1], mha.w_o.bias)    # zero attention output, then W^O


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("record", [False, True])
def test_mha_in_16_bit_does_not_overflow(dtype, record):
    mha = make_mha(dtype=torch.float32)
    x = randn(B, S, D, dtype=torch.float32, seed=1)
    mask = padding() & causal(S)
    with torch.no_grad():
        expected = mha(x, x, x, mask)
        mha = mha.to(dtype)
        mha.record_attention = record
        out = mha(x.to(dtype), x.to(dtype), x.to(dtype), mask)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("record", [False, True])
def test_dropout_only_in_training_mode(record):
    mha = make_mha(dropout=0.5)
    mha.record_attention = record
    x = randn(B, S, D, seed=1)
    reference = make_mha(dropout=0.0)
    with torch.no_grad():
        evaluation = mha(x, x, x)
        torch.testing.assert_close(evaluation, mha(x, x, x))               # deterministic in eval()
        torch.testing.assert_close(evaluation, reference(x, x, x))         # and equal to no dropout
        mha.train()
        torch.manual_seed(0)
        first = mha(x, x, x)
        second = mha(x, x, x)
    assert not torch.allclose(first, evaluation) and not torch.allclose(first, second)
    if record:
        weights = mha.attention_weights
        assert (weights == 0).any()                                         # dropout acts on the weights


@pytest.mark.parametrize("shapes", [
    ((B, T, D + 1), (B, S, D), (B, S, D)),      # wrong d_model of the query
    ((B, T, D), (B, S, D + 1), (B, S, D)),      # of the key
    ((B, T, D), (B, S, D), (B, S, D - 1)),      # of the value
    ((T, D), (S, D), (S, D)),                   # no batch axis
    ((B, T, D), (B, S, D), (B, S + 1, D)),      # key and value of different lengths
    ((B, T, D), (B + 1, S, D), (B + 1, S, D)),  # query and key of different batch sizes
])
def test_mha_rejects_inputs_of_the_wrong_shape(shapes):
    mha = make_mha()
    q, k, v = (torch.zeros(shape, dtype=torch.float64) for shape in shapes)
    with pytest.raises(ValueError, match="d_model|batch size"):
        mha(q, k, v)


def test_mha_rejects_a_cache_of_another_batch_size():
    mha = make_mha()
    memory = randn(3, S, D, seed=1)
    cache = KVCache(static=True)
    with torch.no_grad():
        mha(randn(3, 1, D), memory, memory, cache=cache)
        with pytest.raises(ValueError, match="batch size"):
            mha(randn(2, 1, D), memory, memory, cache=cache)


@pytest.mark.parametrize("shape", [(B, S), (B, 1, S + 1), (B, T + 1, S), (B + 1, 1, S), (B, 1, 1, S)])
def test_mha_rejects_masks_of_the_wrong_shape(shape):
    mha = make_mha()
    q, kv = randn(B, T, D, seed=1), randn(B, S, D)
    with pytest.raises(ValueError, match="mask has shape"):
        mha(q, kv, kv, torch.ones(shape, dtype=torch.bool))


def test_mha_accepts_a_mask_shared_by_the_batch():
    mha = make_mha()
    x = randn(B, S, D, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(mha(x, x, x, causal(S)), mha(x, x, x, causal(S).expand(B, S, S)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.long, torch.uint8])
def test_mha_rejects_non_bool_masks(dtype):
    mha = make_mha()
    x = randn(B, S, D, seed=1)
    with pytest.raises(TypeError, match="bool"):
        mha(x, x, x, torch.ones(B, 1, S, dtype=dtype))


def test_padding_keys_do_not_change_the_output():
    """Whatever sits at a masked key position, the output is the same."""
    mha = make_mha()
    q, kv = randn(B, T, D, seed=1), randn(B, S, D)
    pad = padding()
    changed = kv.clone()
    changed[1, S - 3:] = 1e3 * torch.randn(3, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mha(q, kv, kv, pad), mha(q, changed, changed, pad), atol=1e-12, rtol=0)


def test_self_attention_with_causal_mask_does_not_look_ahead():
    mha = make_mha()
    x = randn(1, S, D, seed=1)
    changed = x.clone()
    changed[0, -1] += 1.0
    with torch.no_grad():
        a, b = mha(x, x, x, causal(S)), mha(changed, changed, changed, causal(S))
    torch.testing.assert_close(a[:, :-1], b[:, :-1], atol=1e-12, rtol=0)
    assert not torch.allclose(a[:, -1], b[:, -1])


# ---------------------------------------------------------------- CUDA

def cuda_inputs():
    torch.manual_seed(0)
    mha = MultiHeadedAttention(8, 512, dropout=0.0).eval()
    x = torch.randn(4, 33, 512)
    pad = torch.ones(4, 1, 33, dtype=torch.bool)
    pad[1, 0, 20:] = False
    pad[3, 0, 5:] = False
    return mha, x, pad


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("mask_name", ["none", "padding", "padding+causal"])
def test_cuda_fast_path_equals_explicit_path(dtype, tol, mask_name, full_float32_precision):
    mha, x, pad = cuda_inputs()
    mask = {"none": None, "padding": pad, "padding+causal": pad & causal(33)}[mask_name]
    with torch.no_grad():
        expected = mha.double()(x.double(), x.double(), x.double(), mask)   # float64 on the CPU
        mha = mha.to("cuda", dtype)
        xc = x.to("cuda", dtype)
        mc = None if mask is None else mask.cuda()
        fast = mha(xc, xc, xc, mc)
        mha.record_attention = True
        explicit = mha(xc, xc, xc, mc)
    assert fast.dtype == dtype and torch.isfinite(fast).all()
    torch.testing.assert_close(fast.double().cpu(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(explicit.double().cpu(), expected, atol=tol, rtol=tol)


def fully_masked_inputs(device="cpu", dtype=torch.float32):
    """A module, inputs and a (2, 16, 16) causal mask whose query 5 of example 1 may attend to nothing."""
    torch.manual_seed(0)
    mha = MultiHeadedAttention(8, 64, dropout=0.0).eval().to(device, dtype)
    x = torch.randn(2, 16, 64, device=device, dtype=dtype)
    mask = torch.ones(2, 16, 16, dtype=torch.bool, device=device).tril()
    mask[1, 5] = False
    return mha, x, mask


def test_fast_path_zeroes_fully_masked_rows_whatever_the_kernel_returns(monkeypatch):
    """On an H100, in float16 and bfloat16, F.scaled_dot_product_attention returned the plain average of the
    values for a fully masked row (the CPU kernels return zeros). Stand in such a kernel: the module's fast
    path must still give zeros there, and the kernel's output everywhere else."""
    kernel = F.scaled_dot_product_attention

    def averaging_kernel(q, k, v, attn_mask=None, dropout_p=0.0):
        out = kernel(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
        empty = ~attn_mask.any(dim=-1, keepdim=True)
        return torch.where(empty, v.mean(dim=-2, keepdim=True).expand_as(out), out)

    mha, x, mask = fully_masked_inputs()
    with torch.no_grad():
        expected = mha(x, x, x, mask)
        monkeypatch.setattr(F, "scaled_dot_product_attention", averaging_kernel)
        out = mha(x, x, x, mask)
    heads = (out - mha.w_o.bias)[1, 5]                  # a zero row of heads gives w_o(0) = the bias
    assert (heads == 0).all()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_fully_masked_rows_give_zeros(dtype, full_float32_precision):
    """Both paths of the module, and `attention`, give zeros for a fully masked row on CUDA in every dtype."""
    mha, x, mask = fully_masked_inputs("cuda", dtype)
    q = k = v = mha.split_heads(x)
    explicit, _ = attention(q, k, v, mask.unsqueeze(1))
    expected, _ = attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask.unsqueeze(1).cpu())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(explicit).all() and (explicit[1, :, 5] == 0).all()
    torch.testing.assert_close(explicit.double().cpu(), expected, atol=tol, rtol=tol)
    outputs = []
    with torch.no_grad():
        for record in (False, True):
            mha.record_attention = record
            outputs.append(mha(x, x, x, mask))
    reference = mha.double().cpu()(x.double().cpu(), x.double().cpu(), x.double().cpu(), mask.cpu())
    for out in outputs:
        assert torch.isfinite(out).all()
        assert ((out - mha.w_o.bias.to(out))[1, 5] == 0).all()
        torch.testing.assert_close(out.double().cpu(), reference, atol=tol, rtol=tol)


@pytest.mark.cuda
def test_cuda_autocast_gradients_match_explicit_path(full_float32_precision):
    mha, x, pad = cuda_inputs()
    mha = mha.cuda().train()
    xc, mask = x.cuda(), (pad & causal(33)).cuda()
    grads = []
    for record in (False, True):
        mha.zero_grad()
        mha.record_attention = record
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = mha(xc, xc, xc, mask)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        out.float().square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in mha.parameters()]))
    fast, explicit = grads
    assert fast.norm() > 0
    assert (fast - explicit).norm() < 0.05 * fast.norm()


# ---------------------------------------------------------------- regressions: "Nothing lost, nothing silent"

@pytest.mark.parametrize("h, d_model, name", [(2.0, 16, "h"), (True, 16, "h"), (4, 16.0, "d_model"),
                                              (4, False, "d_model")])
def test_mha_rejects_float_and_bool_sizes_naming_the_argument(h, d_model, name):
    with pytest.raises(TypeError, match=rf"^{name} must be an integer"):
        MultiHeadedAttention(h, d_model)


@pytest.mark.parametrize("mask_name", ["none", "causal"])
def test_attention_in_float16_with_large_scores_matches_the_fused_kernel(mask_name):
    torch.manual_seed(0)
    q, k = (100 * torch.randn(2, 2, 6, 64) for _ in range(2))           # |q·k| far above 65504
    q, k, v = q.half(), k.half(), torch.randn(2, 2, 6, 64).half()
    assert torch.isinf(q @ k.transpose(-2, -1)).any()                    # the float16 product overflows
    mask = None if mask_name == "none" else causal(6).unsqueeze(1)
    out, weights = attention(q, k, v, mask)
    assert out.dtype == weights.dtype == torch.float16
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    torch.testing.assert_close(out.float(), fused.float(), atol=2e-3, rtol=0)
    torch.testing.assert_close(out.double(), exact, atol=2e-3, rtol=0)


def test_mha_record_path_in_float16_with_large_inputs_matches_the_fast_path():
    mha = make_mha(dtype=torch.float16)
    x = (300 * randn(B, S, D, seed=3)).half()
    with torch.no_grad():
        fast = mha(x, x, x, causal(S))
        mha.record_attention = True
        explicit = mha(x, x, x, causal(S))
    assert torch.isfinite(explicit).all() and torch.isfinite(mha.attention_weights).all()
    torch.testing.assert_close(explicit.float(), fast.float(), atol=5e-2, rtol=1e-2)


def test_attention_in_float16_keeps_gradients_finite():
    torch.manual_seed(0)
    q, k, v = ((100 * torch.randn(1, 1, 4, 64)).half().requires_grad_() for _ in range(3))
    out, _ = attention(q, k, v)
    out.float().sum().backward()
    for tensor in (q, k, v):
        assert tensor.grad.dtype == torch.float16 and torch.isfinite(tensor.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_under_cpu_autocast_keeps_large_scores_finite(dtype):
    torch.manual_seed(0)
    q, k = ((100 * torch.randn(1, 2, 6, 64)).to(dtype) for _ in range(2))
    v = torch.randn(1, 2, 6, 64).to(dtype)
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isinf(q @ k.transpose(-2, -1)).any()                # autocast's float16 product overflows
        out, weights = attention(q, k, v)
    assert weights.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(weights).all()
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), exact, atol=2e-3, rtol=0)


def test_attention_in_16_bit_on_the_meta_device_keeps_shapes_and_dtype():
    q = torch.empty(2, 3, 5, 8, device="meta", dtype=torch.float16)
    out, weights = attention(q, q, q)
    assert out.shape == (2, 3, 5, 8) and weights.shape == (2, 3, 5, 5)
    assert out.dtype == weights.dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool])
@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_attention_rejects_integer_tensors(dtype, which):
    """Issue 21 (defect 22): integer inputs used to give integer weights, rounded down to zeros."""
    tensors = {"query": randn(1, 2, 4), "key": randn(1, 2, 4), "value": randn(1, 2, 4)}
    tensors[which] = torch.ones(1, 2, 4, dtype=dtype)
    with pytest.raises(TypeError, match=f"{which} must be floating point"):
        attention(tensors["query"], tensors["key"], tensors["value"])


def test_fused_attention_computes_16_bits_on_a_cpu_in_float32_and_returns_16_bits():
    """On a CPU, bf16 (and fp16) inputs go to the fused kernel as float32, outside autocast, and the output comes
    back in the inputs' dtype; float32 inputs take PyTorch's own call unchanged."""
    from annotated_transformer.attention import fused_attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.equal(fused_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    for dtype in (torch.bfloat16, torch.float16):
        low = [x.to(dtype) for x in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as in a bf16 training step: autocast is switched off
            out = fused_attention(*low, mask)
        exact = F.scaled_dot_product_attention(*(x.float() for x in low), attn_mask=mask)
        assert out.dtype == dtype and torch.equal(out, exact.to(dtype))


def test_fused_attention_passes_gradients_and_dropout_in_16_bits():
    from annotated_transformer.attention import fused_attention
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fused_attention(q, k, v).float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 for x in (q, k, v))
    torch.manual_seed(1)
    dropped = fused_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(1)
    again = fused_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(dropped, again) and not torch.equal(dropped, fused_attention(q, k, v))


def test_the_module_in_bf16_autocast_on_a_cpu_matches_float32_attention():
    """A bf16 training step's attention: the module's output equals the explicit path computed in float32 on the
    same bf16 projections, to bf16's precision."""
    from annotated_transformer.attention import MultiHeadedAttention
    torch.manual_seed(0)
    module = MultiHeadedAttention(4, 32, dropout=0.0)
    x = torch.randn(3, 7, 32)
    mask = torch.ones(3, 7, 7, dtype=torch.bool).tril()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = module(x, x, x, mask)
        module.record_attention = True
        explicit = module(x, x, x, mask)
    assert fast.dtype == explicit.dtype == torch.bfloat16
    assert torch.allclose(fast.float(), explicit.float(), atol=3e-2)
