"""Tests of annotated_transformer.masks (book/masking.md) and of masks inside MultiHeadedAttention."""
import pytest
import torch
from torch import nn

from annotated_transformer import masks
from annotated_transformer.attention import MultiHeadedAttention, attention
from annotated_transformer.masks import padding_mask, subsequent_mask, target_mask

PAD = 0
D_MODEL, HEADS = 16, 4
# right padding, as in training: lengths 6, 3, 2 and 5, 4, 2
SRC = torch.tensor([[4, 7, 2, 9, 3, 5], [6, 2, 8, PAD, PAD, PAD], [3, 3, PAD, PAD, PAD, PAD]])
TGT = torch.tensor([[1, 4, 4, 2, 5], [1, 9, 2, 6, PAD], [1, 5, PAD, PAD, PAD]])


def assert_close(actual, expected, atol):
    """Max-abs-difference check (torch.testing.assert_close imports torch.distributed, seconds on a small CPU)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    difference = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert difference <= atol, f"max difference {difference:.3g} > {atol:.3g}"


def make_attention(seed, dtype=torch.float64, device="cpu", record=False):
    torch.manual_seed(seed)
    mha = MultiHeadedAttention(HEADS, D_MODEL, dropout=0.0).to(device=device, dtype=dtype).eval()
    mha.record_attention = record
    return mha


# ---------------------------------------------------------------- shapes, dtypes, values


@pytest.mark.parametrize("size", [0, 1, 2, 5, 17])
def test_subsequent_mask_is_lower_triangular(size):
    mask = subsequent_mask(size)
    assert mask.shape == (1, size, size) and mask.dtype == torch.bool
    i, j = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    assert torch.equal(mask[0], j <= i)  # the diagonal is allowed: a position sees itself
    assert torch.equal(mask[0], nn.Transformer.generate_square_subsequent_mask(size) == 0)


def test_subsequent_mask_accepts_integer_like_sizes():
    assert torch.equal(subsequent_mask(torch.tensor(4)), subsequent_mask(4))
    np = pytest.importorskip("numpy")
    assert torch.equal(subsequent_mask(np.int64(3)), subsequent_mask(3))


def test_subsequent_mask_agrees_with_is_causal():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 3, 7, 8, dtype=torch.float64).unbind(0)
    flag = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    masked = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=subsequent_mask(7))
    assert_close(flag, masked, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.int16, torch.uint8])
@pytest.mark.parametrize("pad", [0, 3])
def test_padding_mask_marks_real_tokens_as_keys(dtype, pad):
    tokens = torch.tensor([[5, 1, pad, pad], [pad, 2, 7, 4], [pad, pad, pad, pad]], dtype=dtype)
    mask = padding_mask(tokens, pad)
    assert mask.shape == (3, 1, 4) and mask.dtype == torch.bool  # keys on the last axis, not (B, S, 1)
    assert torch.equal(mask[:, 0], tokens != pad)


def test_padding_mask_accepts_integer_like_pad():
    assert torch.equal(padding_mask(SRC, torch.tensor(PAD)), padding_mask(SRC, PAD))


def test_target_mask_is_padding_and_causal():
    mask = target_mask(TGT, PAD)
    B, T = TGT.shape
    assert mask.shape == (B, T, T) and mask.dtype == torch.bool
    assert torch.equal(mask, padding_mask(TGT, PAD) & subsequent_mask(T))
    lengths = (TGT != PAD).sum(-1)
    i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    for b in range(B):
        assert torch.equal(mask[b], (j <= i) & (j < lengths[b]))
    # with right padding no row is empty: every query sees at least position 0
    assert mask.any(-1).all()


def test_masks_match_nn_multihead_attention_in_the_opposite_sense():
    mha = make_attention(0)
    ref = nn.MultiheadAttention(D_MODEL, HEADS, dropout=0.0, batch_first=True, dtype=torch.float64).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([mha.w_q.weight, mha.w_k.weight, mha.w_v.weight]))
        ref.in_proj_bias.copy_(torch.cat([mha.w_q.bias, mha.w_k.bias, mha.w_v.bias]))
        ref.out_proj.weight.copy_(mha.w_o.weight)
        ref.out_proj.bias.copy_(mha.w_o.bias)
    B, T = TGT.shape
    y = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    ours = mha(y, y, y, mask=target_mask(TGT, PAD))
    theirs, _ = ref(y, y, y, key_padding_mask=TGT == PAD, attn_mask=~subsequent_mask(T)[0], need_weights=False)
    assert_close(ours, theirs, atol=1e-12)
    x = torch.randn(*SRC.shape, D_MODEL, dtype=torch.float64)
    ours = mha(y, x, x, mask=padding_mask(SRC, PAD))
    theirs, _ = ref(y, x, x, key_padding_mask=SRC == PAD, need_weights=False)
    assert_close(ours, theirs, atol=1e-12)


# ---------------------------------------------------------------- devices


def test_masks_are_built_on_the_tokens_device(monkeypatch):
    # target_mask asks for the causal part on the tokens' device (the CUDA test below checks it for real;
    # a "meta" tensor would do it here but costs seconds of imports on first use)
    seen = []

    def spy(size, device=None):
        seen.append(device)
        return original(size, device=device)

    original = masks.subsequent_mask
    monkeypatch.setattr(masks, "subsequent_mask", spy)
    assert masks.target_mask(TGT, PAD).device == TGT.device
    assert seen == [TGT.device]


def test_subsequent_mask_device_argument():
    assert subsequent_mask(4).device.type == "cpu"
    assert torch.equal(subsequent_mask(4, device="cpu"), subsequent_mask(4, device=torch.device("cpu")))


# ---------------------------------------------------------------- properties on MultiHeadedAttention


def check_padding_invariance(mha, device, dtype, atol):
    """Changing padded source positions changes no real output of self-attention and no output of cross-attention."""
    src, tgt = SRC.to(device), TGT.to(device)
    src_mask, is_pad = padding_mask(src, PAD), src == PAD
    x = torch.randn(*src.shape, D_MODEL, device=device, dtype=dtype)
    y = torch.randn(*tgt.shape, D_MODEL, device=device, dtype=dtype)
    x2 = torch.where(is_pad[..., None], 10 * torch.randn_like(x), x)
    self_change = (mha(x, x, x, mask=src_mask) - mha(x2, x2, x2, mask=src_mask)).abs()
    assert self_change[~is_pad].max().item() <= atol
    assert self_change[is_pad].max().item() > 1e-3  # the padded positions themselves did change
    cross_change = (mha(y, x, x, mask=src_mask) - mha(y, x2, x2, mask=src_mask)).abs()
    assert cross_change.max().item() <= atol
    return x, x2, is_pad


def check_causality(mha, device, dtype, atol):
    """Changing target position t changes no output before t under the target mask."""
    tgt = TGT.to(device)
    mask = target_mask(tgt, PAD)
    y = torch.randn(*tgt.shape, D_MODEL, device=device, dtype=dtype)
    out = mha(y, y, y, mask=mask)
    for t in range(1, tgt.size(1)):
        y2 = y.clone()
        y2[:, t:] = 10 * torch.randn_like(y2[:, t:])
        out2 = mha(y2, y2, y2, mask=mask)
        assert (out - out2)[:, :t].abs().max().item() <= atol
        assert (out - out2)[:, t:].abs().max().item() > 1e-3


@pytest.mark.parametrize("record", [False, True], ids=["fast", "record_attention"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padding_invariance(seed, record):
    check_padding_invariance(make_attention(seed, record=record), "cpu", torch.float64, atol=1e-12)


@pytest.mark.parametrize("record", [False, True], ids=["fast", "record_attention"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_causality(seed, record):
    check_causality(make_attention(seed, record=record), "cpu", torch.float64, atol=1e-12)


def test_padding_invariance_through_two_layers():
    """Padded query rows of layer 1 are garbage but never reach real positions of layer 2."""
    layers = [make_attention(seed) for seed in (5, 6)]
    src_mask, is_pad = padding_mask(SRC, PAD), SRC == PAD

    def encode(x):
        for layer in layers:
            x = layer(x, x, x, mask=src_mask)
        return x

    torch.manual_seed(0)
    x = torch.randn(*SRC.shape, D_MODEL, dtype=torch.float64)
    x2 = torch.where(is_pad[..., None], 10 * torch.randn_like(x), x)
    assert (encode(x) - encode(x2))[~is_pad].abs().max().item() <= 1e-12


def test_property_checks_fail_without_masks():
    """The checks above can fail: the same changes do reach protected positions when nothing is masked."""
    mha = make_attention(0)
    torch.manual_seed(0)
    is_pad = SRC == PAD
    x = torch.randn(*SRC.shape, D_MODEL, dtype=torch.float64)
    x2 = torch.where(is_pad[..., None], 10 * torch.randn_like(x), x)
    assert (mha(x, x, x) - mha(x2, x2, x2))[~is_pad].abs().max().item() > 1e-3
    y = torch.randn(*TGT.shape, D_MODEL, dtype=torch.float64)
    y2 = y.clone()
    y2[:, 3:] = 0
    assert (mha(y, y, y) - mha(y2, y2, y2))[:, :3].abs().max().item() > 1e-3
    # and masking queries instead of keys (the (B, S, 1) "fix") lets padding leak into real tokens
    query_mask = (SRC != PAD).unsqueeze(-1).expand(-1, -1, SRC.size(1))  # (B, S, S), rows not columns
    leaked = mha(x, x, x, mask=query_mask) - mha(x2, x2, x2, mask=query_mask)
    assert leaked[~is_pad].abs().max().item() > 1e-3


# ---------------------------------------------------------------- no NaN: padded query rows and fully masked rows


@pytest.mark.parametrize("record", [False, True], ids=["fast", "record_attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_padded_query_rows_are_finite(record, dtype):
    mha = make_attention(0, dtype=dtype, record=record)
    x = torch.randn(*SRC.shape, D_MODEL, dtype=dtype, requires_grad=True)
    y = torch.randn(*TGT.shape, D_MODEL, dtype=dtype, requires_grad=True)
    enc = mha(x, x, x, mask=padding_mask(SRC, PAD))  # encoder self-attention
    cross = mha(y, x, x, mask=padding_mask(SRC, PAD))  # decoder cross-attention
    dec = mha(y, y, y, mask=target_mask(TGT, PAD))  # decoder self-attention
    assert torch.isfinite(enc).all() and torch.isfinite(cross).all() and torch.isfinite(dec).all()
    (enc.sum() + cross.sum() + dec.sum()).backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(y.grad).all()
    if record:
        weights = mha.attention_weights  # of the decoder call: (B, h, T, T)
        assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)), atol=1e-5)
        assert (weights.masked_select(~target_mask(TGT, PAD)[:, None]) == 0).all()


@pytest.mark.parametrize("record", [False, True], ids=["fast", "record_attention"])
def test_fully_masked_rows_give_zeros(record):
    # left padding makes the first causal rows empty; an all-padding sentence makes every row empty
    tgt = torch.tensor([[PAD, PAD, 5, 6, 7], [1, 2, 3, 4, 5], [PAD] * 5])
    mask = target_mask(tgt, PAD)
    empty = ~mask.any(-1)
    assert empty.sum().item() == 2 + 0 + 5
    mha = make_attention(0, record=record)
    y = torch.randn(3, 5, D_MODEL, dtype=torch.float64, requires_grad=True)
    out = mha(y, y, y, mask=mask)
    assert torch.isfinite(out).all()
    assert ((out - mha.w_o.bias)[empty] == 0).all()  # zero attention output, then W^O's bias
    out.sum().backward()
    assert torch.isfinite(y.grad).all()
    # the real rows are untouched by the empty ones: sentence 1 alone gives the same result
    alone = mha(y[1:2], y[1:2], y[1:2], mask=mask[1:2])
    assert_close(out[1:2], alone, atol=1e-12)


def test_attention_function_zeroes_fully_masked_rows():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 4, 8, dtype=torch.float64).unbind(0)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)[None, None]
    out, weights = attention(q, k, v, mask)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    assert (out[..., [1, 3], :] == 0).all() and (weights[..., [1, 3], :] == 0).all()
    assert_close(weights[..., [0, 2], :].sum(-1), torch.ones(1, 2, 2, dtype=torch.float64), atol=1e-12)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: subsequent_mask(-1), ValueError, "size must be >= 0"),
        (lambda: subsequent_mask(2.0), TypeError, "size must be an integer"),
        (lambda: subsequent_mask(True), TypeError, "size must be an integer"),
        (lambda: padding_mask(torch.tensor([1, 2, PAD]), PAD), ValueError, r"tokens must have shape \(batch, length\)"),
        (lambda: padding_mask(torch.zeros(2, 3, 4, dtype=torch.long), PAD), ValueError, "tokens must have shape"),
        (lambda: padding_mask(torch.randn(2, 3), PAD), TypeError, "tokens must hold integer token ids"),
        (lambda: padding_mask(torch.ones(2, 3, dtype=torch.bool), PAD), TypeError, "integer token ids"),
        (lambda: padding_mask([[1, 2, PAD]], PAD), TypeError, "tokens must be a torch.Tensor"),
        (lambda: padding_mask(SRC, "<pad>"), TypeError, "pad must be an integer"),
        (lambda: padding_mask(SRC, 0.0), TypeError, "pad must be an integer"),
        (lambda: target_mask(torch.tensor([1, 2, PAD]), PAD), ValueError, "tgt must have shape"),
        (lambda: target_mask([[1, 2]], PAD), TypeError, "tgt must be a torch.Tensor"),
        (lambda: target_mask(TGT, None), TypeError, "pad must be an integer"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    "make_mask",
    [
        lambda src, queries: (src != PAD).unsqueeze(-1),  # (B, S, 1): queries instead of keys
        lambda src, queries: (src != PAD),  # (B, S): no query axis
        lambda src, queries: padding_mask(src, PAD).expand(-1, src.size(1), -1),  # (B, S, S) for T != S queries
        lambda src, queries: padding_mask(src, PAD)[:, :, :-1],  # one key short
        lambda src, queries: padding_mask(src, PAD)[None],  # 4-D
    ],
    ids=["B,S,1", "B,S", "B,S,S", "short", "4d"],
)
def test_wrongly_shaped_masks_are_refused(make_mask):
    mha = make_attention(0)
    memory = torch.randn(*SRC.shape, D_MODEL, dtype=torch.float64)
    queries = torch.randn(3, 4, D_MODEL, dtype=torch.float64)  # T = 4 != S = 6
    with pytest.raises(ValueError, match="mask has shape"):
        mha(queries, memory, memory, mask=make_mask(SRC, queries))


def test_non_bool_masks_are_refused():
    mha = make_attention(0)
    x = torch.randn(*SRC.shape, D_MODEL, dtype=torch.float64)
    with pytest.raises(TypeError, match="bool"):
        mha(x, x, x, mask=padding_mask(SRC, PAD).long())


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("record", [False, True], ids=["fast", "record_attention"])
def test_properties_on_cuda(record):
    device = torch.device("cuda")
    assert target_mask(TGT.to(device), PAD).device.type == "cuda"
    assert padding_mask(SRC.to(device), PAD).device.type == "cuda"
    assert subsequent_mask(5, device=device).device.type == "cuda"
    assert torch.equal(target_mask(TGT.to(device), PAD).cpu(), target_mask(TGT, PAD))
    for seed in range(3):
        for dtype, atol in [(torch.float32, 1e-5), (torch.float64, 1e-12)]:
            mha = make_attention(seed, dtype=dtype, device=device, record=record)
            with torch.no_grad():
                check_padding_invariance(mha, device, dtype, atol)
                check_causality(mha, device, dtype, atol)
            y = torch.randn(*TGT.shape, D_MODEL, device=device, dtype=dtype)
            out = mha(y, y, y, mask=target_mask(TGT.to(device), PAD))  # padded query rows: finite
            assert torch.isfinite(out).all()


@pytest.mark.parametrize("record", [False, True], ids=["fast", "record_attention"])
def test_padded_batch_equals_each_sentence_alone(record):
    mha = make_attention(7, record=record)
    x = torch.randn(*SRC.shape, D_MODEL, dtype=torch.float64)
    y = torch.randn(*TGT.shape, D_MODEL, dtype=torch.float64)
    enc = mha(x, x, x, mask=padding_mask(SRC, PAD))
    dec = mha(y, y, y, mask=target_mask(TGT, PAD))
    cross = mha(y, x, x, mask=padding_mask(SRC, PAD))
    for b in range(SRC.size(0)):
        n, m = int((SRC[b] != PAD).sum()), int((TGT[b] != PAD).sum())
        xb, yb = x[b:b + 1, :n], y[b:b + 1, :m]
        assert_close(enc[b:b + 1, :n], mha(xb, xb, xb), atol=1e-12)
        assert_close(dec[b:b + 1, :m], mha(yb, yb, yb, mask=subsequent_mask(m)), atol=1e-12)
        assert_close(cross[b:b + 1, :m], mha(yb, xb, xb), atol=1e-12)
