"""Tests of annotated_transformer.encoder and .decoder: equivalence with nn.TransformerEncoder/Decoder,
causality, padding invariance, cached (step-by-step) decoding, and bad inputs."""
import pytest
import torch
from torch import nn

from annotated_transformer.attention import MultiHeadedAttention
from annotated_transformer.decoder import Decoder, DecoderCache, DecoderLayer
from annotated_transformer.encoder import Encoder, EncoderLayer
from annotated_transformer.feed_forward import PositionwiseFeedForward
from annotated_transformer.masks import padding_mask, subsequent_mask, target_mask

D, H, FF, N = 16, 4, 32, 3
PAD = 0
# Source and target lengths differ, so that a mix-up of the two cannot pass silently.
SRC = torch.tensor([[4, 9, 3, 7, 5, 8, 2], [6, 3, 8, 2, PAD, PAD, PAD]])
TGT = torch.tensor([[1, 5, 8, 3, 6], [1, 7, 4, PAD, PAD]])


def make_encoder(norm_first, dropout=0.0, n=N, seed=0):
    torch.manual_seed(seed)
    layer = EncoderLayer(D, MultiHeadedAttention(H, D, dropout), PositionwiseFeedForward(D, FF, dropout), dropout,
                         norm_first)
    encoder = Encoder(layer, n, norm_first).double().eval()
    randomise(encoder)
    return encoder


def make_decoder(norm_first, dropout=0.0, n=N, seed=0):
    torch.manual_seed(seed)
    layer = DecoderLayer(D, MultiHeadedAttention(H, D, dropout), MultiHeadedAttention(H, D, dropout),
                         PositionwiseFeedForward(D, FF, dropout), dropout, norm_first)
    decoder = Decoder(layer, n, norm_first).double().eval()
    randomise(decoder)
    return decoder


@torch.no_grad()
def randomise(module):
    """Random values for every parameter, LayerNorm gains and shifts included, so a mis-copied one shows."""
    for p in module.parameters():
        p.normal_(0.0, 0.5)


def inputs(seed=1):
    torch.manual_seed(seed)
    memory = torch.randn(2, SRC.size(1), D, dtype=torch.float64)
    y = torch.randn(2, TGT.size(1), D, dtype=torch.float64)
    return memory, y


def copy_attention(ours, theirs):
    theirs.in_proj_weight.copy_(torch.cat([ours.w_q.weight, ours.w_k.weight, ours.w_v.weight]))
    theirs.in_proj_bias.copy_(torch.cat([ours.w_q.bias, ours.w_k.bias, ours.w_v.bias]))
    theirs.out_proj.weight.copy_(ours.w_o.weight)
    theirs.out_proj.bias.copy_(ours.w_o.bias)


@torch.no_grad()
def torch_encoder_from(encoder, norm_first):
    layer = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first,
                                       layer_norm_eps=1e-6)
    norm = nn.LayerNorm(D, eps=1e-6) if norm_first else None
    ref = nn.TransformerEncoder(layer, len(encoder.layers), norm=norm, enable_nested_tensor=False).double().eval()
    for ours, theirs in zip(encoder.layers, ref.layers):
        copy_attention(ours.self_attn, theirs.self_attn)
        theirs.linear1.load_state_dict(ours.feed_forward.w_1.state_dict())
        theirs.linear2.load_state_dict(ours.feed_forward.w_2.state_dict())
        theirs.norm1.load_state_dict(ours.sublayer[0].norm.state_dict())
        theirs.norm2.load_state_dict(ours.sublayer[1].norm.state_dict())
    if norm_first:
        ref.norm.load_state_dict(encoder.norm.state_dict())
    return ref


@torch.no_grad()
def torch_decoder_from(decoder, norm_first):
    layer = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first,
                                       layer_norm_eps=1e-6)
    norm = nn.LayerNorm(D, eps=1e-6) if norm_first else None
    ref = nn.TransformerDecoder(layer, len(decoder.layers), norm=norm).double().eval()
    for ours, theirs in zip(decoder.layers, ref.layers):
        copy_attention(ours.self_attn, theirs.self_attn)
        copy_attention(ours.src_attn, theirs.multihead_attn)
        theirs.linear1.load_state_dict(ours.feed_forward.w_1.state_dict())
        theirs.linear2.load_state_dict(ours.feed_forward.w_2.state_dict())
        for i, n in enumerate((theirs.norm1, theirs.norm2, theirs.norm3)):
            n.load_state_dict(ours.sublayer[i].norm.state_dict())
    if norm_first:
        ref.norm.load_state_dict(decoder.norm.state_dict())
    return ref


# --- equivalence with PyTorch -------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("masks", ["none", "padding", "padding+causal"])
def test_encoder_equals_torch_transformer_encoder(norm_first, masks):
    encoder = make_encoder(norm_first)
    ref = torch_encoder_from(encoder, norm_first)
    memory, _ = inputs()
    length = SRC.size(1)
    ours_mask = {"none": None, "padding": padding_mask(SRC, PAD),
                 "padding+causal": padding_mask(SRC, PAD) & subsequent_mask(length)}[masks]
    kwargs = {}
    if masks != "none":
        kwargs["src_key_padding_mask"] = SRC == PAD              # PyTorch: True = ignore
    if masks == "padding+causal":
        kwargs["mask"] = ~subsequent_mask(length)[0]
    with torch.no_grad():
        ours = encoder(memory, ours_mask)
        theirs = ref(memory, **kwargs)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("masks", ["causal", "padding+causal"])
def test_decoder_equals_torch_transformer_decoder(norm_first, masks):
    decoder = make_decoder(norm_first)
    ref = torch_decoder_from(decoder, norm_first)
    memory, y = inputs()
    T = TGT.size(1)
    if masks == "causal":
        src_mask, tgt_mask, kwargs = None, subsequent_mask(T), {}
    else:
        src_mask, tgt_mask = padding_mask(SRC, PAD), target_mask(TGT, PAD)
        kwargs = dict(tgt_key_padding_mask=TGT == PAD, memory_key_padding_mask=SRC == PAD)
    with torch.no_grad():
        ours = decoder(y, memory, src_mask, tgt_mask)
        theirs = ref(y, memory, tgt_mask=~subsequent_mask(T)[0], **kwargs)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)


def test_post_norm_stacks_have_no_final_norm_and_pre_norm_stacks_have_one():
    for norm_first in (False, True):
        for stack in (make_encoder(norm_first), make_decoder(norm_first)):
            has_norm = any(name.startswith("norm.") for name, _ in stack.named_parameters())
            assert has_norm == norm_first
            assert not isinstance(stack.norm, nn.Identity) == norm_first


def test_layers_are_independent_copies():
    for stack in (make_encoder(False), make_decoder(False)):
        first, second = stack.layers[0], stack.layers[1]
        assert first is not second
        assert first.self_attn.w_q.weight.data_ptr() != second.self_attn.w_q.weight.data_ptr()
        one = sum(p.numel() for p in first.parameters())
        assert sum(p.numel() for p in stack.layers.parameters()) == N * one


# --- properties ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_padding_does_not_reach_real_positions(norm_first):
    encoder = make_encoder(norm_first)
    memory, _ = inputs()
    real = SRC != PAD
    noisy = memory.clone()
    noisy[~real] = 100 * torch.randn_like(noisy[~real])
    mask = padding_mask(SRC, PAD)
    with torch.no_grad():
        assert torch.equal(encoder(memory, mask)[real], encoder(noisy, mask)[real])


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_is_causal(norm_first):
    decoder = make_decoder(norm_first)
    memory, y = inputs()
    src_mask, tgt_mask = padding_mask(SRC, PAD), subsequent_mask(TGT.size(1))
    with torch.no_grad():
        base = decoder(y, memory, src_mask, tgt_mask)
        for t in range(TGT.size(1)):
            changed = y.clone()
            changed[:, t] = torch.randn(2, D, dtype=torch.float64)
            out = decoder(changed, memory, src_mask, tgt_mask)
            assert torch.equal(out[:, :t], base[:, :t]), t
            assert not torch.allclose(out[:, t], base[:, t]), t      # the check can fail


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_ignores_padded_source_and_padded_target(norm_first):
    decoder = make_decoder(norm_first)
    memory, y = inputs()
    src_mask, tgt_mask = padding_mask(SRC, PAD), target_mask(TGT, PAD)
    real_src, real_tgt = SRC != PAD, TGT != PAD
    with torch.no_grad():
        base = decoder(y, memory, src_mask, tgt_mask)
        noisy_memory = memory.clone()
        noisy_memory[~real_src] = 100 * torch.randn_like(noisy_memory[~real_src])
        assert torch.equal(decoder(y, noisy_memory, src_mask, tgt_mask), base)
        noisy_y = y.clone()
        noisy_y[~real_tgt] = 100 * torch.randn_like(noisy_y[~real_tgt])
        assert torch.equal(decoder(noisy_y, memory, src_mask, tgt_mask)[real_tgt], base[real_tgt])
        # Without the source mask, the padded memory does change the output: the mask is what protects it.
        assert not torch.allclose(decoder(y, noisy_memory, None, tgt_mask), decoder(y, memory, None, tgt_mask))


def test_cross_attention_takes_queries_from_the_decoder():
    """The output has one row per target position, and it depends on the memory through the cross-attention."""
    decoder = make_decoder(False)
    memory, y = inputs()
    with torch.no_grad():
        out = decoder(y, memory, None, subsequent_mask(TGT.size(1)))
        other = decoder(y, memory + 1.0, None, subsequent_mask(TGT.size(1)))
    assert out.shape == y.shape
    assert not torch.allclose(out, other)


# --- the cache ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_stepwise_decoding_with_a_cache_equals_full_decoding(norm_first):
    decoder = make_decoder(norm_first)
    memory, y = inputs()
    src_mask, tgt_mask = padding_mask(SRC, PAD), target_mask(TGT, PAD)
    with torch.no_grad():
        full = decoder(y, memory, src_mask, tgt_mask)
        cache = DecoderCache(len(decoder.layers))
        steps = []
        for t in range(y.size(1)):
            assert len(cache) == t
            steps.append(decoder(y[:, t:t + 1], memory, src_mask, None, cache))
    stepwise = torch.cat(steps, dim=1)
    real = TGT != PAD
    torch.testing.assert_close(stepwise[real], full[real], atol=1e-12, rtol=0)
    assert len(cache) == y.size(1)
    self_cache, cross_cache = cache.layers[0]
    assert self_cache.key.shape == (2, H, y.size(1), D // H)
    assert cross_cache.static and cross_cache.key.shape == (2, H, SRC.size(1), D // H)


def test_several_new_positions_with_a_cache_and_no_mask_are_refused():
    """Without a mask, two new positions would attend to each other (the first to its future): refused."""
    decoder = make_decoder(False)
    memory, y = inputs()
    src_mask = padding_mask(SRC, PAD)
    with torch.no_grad():
        cache = DecoderCache(len(decoder.layers))
        decoder(y[:, :1], memory, src_mask, None, cache)            # one new position: nothing to hide
        with pytest.raises(ValueError, match="2 new positions with a cache need a tgt_mask"):
            decoder(y[:, 1:3], memory, src_mask, None, cache)


def test_cache_reorder_selects_batch_rows():
    decoder = make_decoder(False)
    memory, y = inputs()
    src_mask = padding_mask(SRC, PAD)
    with torch.no_grad():
        cache = DecoderCache(N)
        for t in range(3):
            decoder(y[:, t:t + 1], memory, src_mask, None, cache)
        index = torch.tensor([1, 1, 0])
        cache.reorder(index)
        out = decoder(y[index, 3:4], memory[index], src_mask[index], None, cache)
        fresh = DecoderCache(N)
        expected = [decoder(y[index, t:t + 1], memory[index], src_mask[index], None, fresh) for t in range(4)][-1]
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


# --- bad inputs ---------------------------------------------------------------------------------------------


def test_bad_constructor_arguments_are_refused():
    attn, ff = MultiHeadedAttention(H, D, 0.0), PositionwiseFeedForward(D, FF, 0.0)
    with pytest.raises(ValueError, match="size"):
        EncoderLayer(0, attn, ff, 0.0)
    with pytest.raises(TypeError, match="self_attn"):
        EncoderLayer(D, lambda x: x, ff, 0.0)
    layer = EncoderLayer(D, attn, ff, 0.0)
    with pytest.raises(ValueError, match="N"):
        Encoder(layer, 0)
    with pytest.raises(TypeError, match="layer"):
        Encoder(ff, 2)
    with pytest.raises(ValueError, match="norm_first"):
        Encoder(layer, 2, norm_first=True)
    with pytest.raises(ValueError, match="different modules"):
        DecoderLayer(D, attn, attn, ff, 0.0)
    dec_layer = DecoderLayer(D, attn, MultiHeadedAttention(H, D, 0.0), ff, 0.0, norm_first=True)
    with pytest.raises(ValueError, match="norm_first"):
        Decoder(dec_layer, 2)
    with pytest.raises(TypeError, match="DecoderLayer"):
        Decoder(layer, 2)
    with pytest.raises(ValueError, match="num_layers"):
        DecoderCache(0)


def test_bad_forward_arguments_are_refused():
    encoder, decoder = make_encoder(False), make_decoder(False)
    memory, y = inputs()
    with pytest.raises(ValueError, match="x must have shape"):
        encoder(memory[..., :-1], None)
    with pytest.raises(ValueError, match="memory must have shape"):
        decoder(y, memory[0], None, None)
    with pytest.raises(ValueError, match="cache has 2 layers"):
        decoder(y, memory, None, None, DecoderCache(2))
    with pytest.raises(TypeError, match="DecoderCache"):
        decoder(y, memory, None, None, cache=[None] * N)
    with pytest.raises(ValueError):                           # a (B, T, T) target mask on S source keys
        decoder(y, memory, target_mask(TGT, PAD), target_mask(TGT, PAD))


# --- CUDA ---------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("norm_first", [False, True])
def test_cuda_decoder_matches_cpu(norm_first):
    encoder, decoder = make_encoder(norm_first), make_decoder(norm_first)
    memory, y = inputs()
    src_mask, tgt_mask = padding_mask(SRC, PAD), target_mask(TGT, PAD)
    with torch.no_grad():
        expected = decoder(y, encoder(memory, src_mask), src_mask, tgt_mask)
        encoder, decoder = encoder.cuda(), decoder.cuda()
        src_mask, tgt_mask = src_mask.cuda(), tgt_mask.cuda()
        out = decoder(y.cuda(), encoder(memory.cuda(), src_mask), src_mask, tgt_mask)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-10, rtol=1e-10)
