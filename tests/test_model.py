"""Tests of annotated_transformer.model: make_model's validation, initialisation, tying, config and parameter
count, and the assembled model's shapes, causality, padding invariance and cached decoding."""
import json
import math

import pytest
import torch
from torch import nn

from annotated_transformer.decoder import DecoderCache
from annotated_transformer.masks import padding_mask, subsequent_mask, target_mask
from annotated_transformer.model import Embed, EncoderDecoder, make_model
from annotated_transformer.positional import sinusoid_table

PAD = 0
SMALL = dict(N=2, d_model=32, d_ff=64, h=4)


@pytest.fixture
def small_model(small_model):
    """The shared small model (tests/conftest.py, the sizes of SMALL) with this file's defaults: 23 tokens, tied."""

    def build(vocab=23, norm_first=False, share=True, dropout=0.0, dtype=torch.float64, seed=0):
        return small_model(vocab, seed=seed, norm_first=norm_first, share_embeddings=share, dropout=dropout,
                           dtype=dtype, **SMALL)

    return build


def batch(vocab=23, seed=1):
    torch.manual_seed(seed)
    src = torch.randint(1, vocab, (2, 7))
    src[1, 4:] = PAD
    tgt = torch.randint(1, vocab, (2, 6))
    tgt[1, 3:] = PAD
    return src, tgt


def expected_count(N, d_model, d_ff, src_vocab, tgt_vocab, norm_first=False, share=False):
    """The parameter count derived by hand (see book/model.md)."""
    attention = 4 * (d_model * d_model + d_model)
    feed_forward = 2 * d_model * d_ff + d_ff + d_model
    layer_norm = 2 * d_model
    encoder = N * (attention + feed_forward + 2 * layer_norm) + (layer_norm if norm_first else 0)
    decoder = N * (2 * attention + feed_forward + 3 * layer_norm) + (layer_norm if norm_first else 0)
    if share:
        embeddings = src_vocab * d_model                       # one matrix for source, target and generator
    else:
        embeddings = src_vocab * d_model + tgt_vocab * d_model + tgt_vocab * d_model
    return encoder + decoder + embeddings + tgt_vocab          # + the generator's bias


def count(model):
    return sum(p.numel() for p in model.parameters())


# --- validation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["src_vocab", "tgt_vocab", "N", "d_model", "d_ff", "h"])
@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_sizes_are_refused(name, value):
    kwargs = dict(src_vocab=10, tgt_vocab=10, **SMALL)
    kwargs[name] = value
    with pytest.raises(ValueError, match=name):
        make_model(**kwargs)


@pytest.mark.parametrize("name, value", [("d_model", 32.0), ("N", "6"), ("src_vocab", True), ("h", None)])
def test_sizes_of_the_wrong_type_are_refused(name, value):
    kwargs = dict(src_vocab=10, tgt_vocab=10, **SMALL)
    kwargs[name] = value
    with pytest.raises(TypeError, match=name):
        make_model(**kwargs)


def test_d_model_must_be_divisible_by_h():
    with pytest.raises(ValueError, match=r"d_model \(30\).*h \(4\)"):
        make_model(10, 10, N=1, d_model=30, d_ff=64, h=4)


@pytest.mark.parametrize("dropout, error", [(-0.1, ValueError), (1.0, ValueError), (1.5, ValueError),
                                            ("0.1", TypeError), (None, TypeError)])
def test_dropout_must_be_a_probability(dropout, error):
    with pytest.raises(error, match="dropout"):
        make_model(10, 10, **SMALL, dropout=dropout)


def test_sharing_needs_one_vocabulary_and_names_both_sizes():
    with pytest.raises(ValueError, match=r"src_vocab=100.*tgt_vocab=120"):
        make_model(100, 120, **SMALL, share_embeddings=True)
    make_model(100, 120, **SMALL)                              # without sharing, different sizes are fine


# --- structure, tying, config -------------------------------------------------------------------------------


def test_config_is_a_plain_dict_of_the_arguments():
    model = make_model(30, 40, N=1, d_model=16, d_ff=32, h=2, dropout=0.2, norm_first=True)
    assert type(model.config) is dict
    assert model.config == dict(src_vocab=30, tgt_vocab=40, N=1, d_model=16, d_ff=32, h=2, dropout=0.2,
                                norm_first=True, share_embeddings=False, embedding_init="normal",
                                attention_dropout=0.2, activation_dropout=0.2)
    assert json.loads(json.dumps(model.config)) == model.config
    assert make_model(**model.config).config == model.config   # the config rebuilds the same model


def test_embedding_init_and_dropout_places():
    torch.manual_seed(0)
    model = make_model(2000, 2000, N=1, d_model=64, d_ff=128, h=4, dropout=0.3, attention_dropout=0.0,
                       activation_dropout=0.1, share_embeddings=True)
    table = model.src_embed.embeddings.lut.weight
    assert abs(table.std().item() * 64 ** 0.5 - 1) < 0.05                 # N(0, 1/d_model)
    xavier = make_model(2000, 2000, N=1, d_model=64, d_ff=128, h=4, embedding_init="xavier")
    assert abs(xavier.src_embed.embeddings.lut.weight.std().item() / (2 / 2064) ** 0.5 - 1) < 0.05
    assert model.encoder.layers[0].self_attn.dropout.p == 0.0
    assert model.encoder.layers[0].feed_forward.dropout.p == 0.1
    assert model.src_embed.position.dropout.p == 0.3
    with pytest.raises(ValueError, match="embedding_init"):
        make_model(10, 10, N=1, d_model=16, d_ff=32, h=2, embedding_init="uniform")
    with pytest.raises(ValueError, match="attention_dropout"):
        make_model(10, 10, N=1, d_model=16, d_ff=32, h=2, attention_dropout=1.0)


def test_hand_built_model_has_no_config():
    model = make_model(10, 10, **SMALL)
    rebuilt = EncoderDecoder(model.encoder, model.decoder, model.src_embed, model.tgt_embed, model.generator)
    assert rebuilt.config is None


def test_share_embeddings_ties_three_matrices_to_one_parameter(small_model):
    model = small_model(share=True)
    shared = model.tgt_embed.embeddings.lut.weight
    assert model.src_embed.embeddings.lut.weight is shared
    assert model.generator.proj.weight is shared
    assert sum(1 for p in model.parameters() if p is shared) == 1
    # The gradient of the shared matrix collects all three uses.
    src, tgt = batch()
    model.generator(model(src, tgt, padding_mask(src, PAD), target_mask(tgt, PAD))).sum().backward()
    assert shared.grad is not None and shared.grad.abs().sum() > 0


def test_without_sharing_the_three_matrices_are_independent(small_model):
    model = small_model(share=False)
    weights = [model.src_embed.embeddings.lut.weight, model.tgt_embed.embeddings.lut.weight,
               model.generator.proj.weight]
    assert len({id(w) for w in weights}) == 3
    assert not torch.equal(weights[0], weights[1])


def test_no_sublayer_shares_weights_with_another(small_model):
    model = small_model(share=False)
    pointers = [p.data_ptr() for p in model.parameters()]
    assert len(pointers) == len(set(pointers))
    layer = model.decoder.layers[0]
    assert layer.self_attn is not layer.src_attn
    assert model.encoder.layers[0].self_attn is not model.decoder.layers[0].self_attn


# --- parameter counts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("share", [False, True])
def test_parameter_count_matches_the_formula(norm_first, share):
    vocab = (50, 50) if share else (50, 70)
    model = make_model(*vocab, N=3, d_model=24, d_ff=40, h=3, norm_first=norm_first, share_embeddings=share)
    assert count(model) == expected_count(3, 24, 40, *vocab, norm_first=norm_first, share=share)


def test_paper_configurations_on_the_meta_device():
    with torch.device("meta"):
        base = make_model(37000, 37000, share_embeddings=True)
        big = make_model(37000, 37000, N=6, d_model=1024, d_ff=4096, h=16, share_embeddings=True)
    assert all(p.is_meta for p in base.parameters())
    assert count(base) == expected_count(6, 512, 2048, 37000, 37000, share=True) == 63_119_496
    assert count(big) == expected_count(6, 1024, 4096, 37000, 37000, share=True) == 214_282_376
    # Within 3% of the paper's 65M and 213M (Table 3); book/model.md explains the gap.
    assert abs(count(base) / 65e6 - 1) < 0.03 and abs(count(big) / 213e6 - 1) < 0.01


def test_the_number_of_heads_does_not_change_the_count():
    counts = {h: count(make_model(20, 20, N=1, d_model=32, d_ff=16, h=h)) for h in (1, 2, 4, 8)}
    assert len(set(counts.values())) == 1


# --- initialisation -----------------------------------------------------------------------------------------


def test_matrices_are_xavier_uniform_and_vectors_keep_their_defaults():
    torch.manual_seed(0)
    model = make_model(300, 300, N=1, d_model=128, d_ff=512, h=4)
    for name, p in model.named_parameters():
        if "embeddings.lut" in name:
            assert abs(p.std().item() * math.sqrt(128) - 1) < 0.05, name   # N(0, 1/d_model)
        elif p.dim() > 1:
            fan_out, fan_in = p.shape
            bound = math.sqrt(6 / (fan_in + fan_out))
            assert p.abs().max() <= bound, name
            assert abs(p.std().item() / (bound / math.sqrt(3)) - 1) < 0.05, name
        elif ".norm." in name and name.endswith("weight"):
            assert torch.all(p == 1), name                     # LayerNorm gains start at 1
        elif ".norm." in name:
            assert torch.all(p == 0), name                     # LayerNorm shifts start at 0
    # Biases keep nn.Linear's default U(-1/sqrt(fan_in), 1/sqrt(fan_in)), not zero and not Xavier.
    bias = model.encoder.layers[0].feed_forward.w_2.bias
    assert 0 < bias.abs().max() <= 1 / math.sqrt(512)


def test_two_models_with_different_seeds_differ_and_same_seed_agree(small_model):
    a, b, c = small_model(seed=0), small_model(seed=0), small_model(seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.encoder.layers[0].self_attn.w_q.weight, c.encoder.layers[0].self_attn.w_q.weight)


# --- forward ------------------------------------------------------------------------------------------------


def test_forward_shapes_and_log_probabilities(small_model):
    model = small_model()
    src, tgt = batch()
    src_mask, tgt_mask = padding_mask(src, PAD), target_mask(tgt, PAD)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        states = model(src, tgt, src_mask, tgt_mask)
        log_probs = model.generator(states)
    assert memory.shape == (2, 7, 32)
    assert states.shape == (2, 6, 32)
    assert log_probs.shape == (2, 6, 23)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(2, 6, dtype=torch.float64))
    torch.testing.assert_close(states, model.decode(memory, src_mask, tgt, tgt_mask))


def test_untrained_predictions_are_nearly_uniform(small_model):
    vocab = 500
    model = small_model(vocab, dtype=torch.float32)
    src, tgt = batch(vocab)
    with torch.no_grad():
        log_probs = model.generator(model(src, tgt, padding_mask(src, PAD), target_mask(tgt, PAD)))
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    # The tied N(0, 1/d_model) table gives logits of variance about 1: entropy about log V - 1/2.
    variance = model.generator.proj(model(src, tgt, padding_mask(src, PAD), target_mask(tgt, PAD))).var(-1).mean()
    assert 0.5 < variance.item() < 2.0
    assert (entropy.mean() - (math.log(vocab) - variance.item() / 2)).abs() < 0.1
    assert entropy.min() > math.log(vocab) - 1.5


def test_embed_offset_shifts_the_positions(small_model):
    model = small_model()
    tokens = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        at_zero = model.tgt_embed(tokens)
        at_four = model.tgt_embed(tokens, offset=4)
        table = sinusoid_table(10, 32).double()
    torch.testing.assert_close(at_four - at_zero, (table[4:7] - table[0:3]).unsqueeze(0))
    assert isinstance(model.tgt_embed, Embed)


@pytest.mark.parametrize("norm_first", [False, True])
def test_future_target_tokens_do_not_change_earlier_predictions(norm_first, small_model):
    model = small_model(norm_first=norm_first)
    src, tgt = batch()
    src, tgt = src[:1], tgt[:1]
    src_mask, tgt_mask = padding_mask(src, PAD), subsequent_mask(tgt.size(1))
    with torch.no_grad():
        base = model.generator(model(src, tgt, src_mask, tgt_mask))
        for t in range(tgt.size(1)):
            changed = tgt.clone()
            changed[0, t] = changed[0, t] % 22 + 1              # another real token
            out = model.generator(model(src, changed, src_mask, tgt_mask))
            assert torch.equal(out[:, :t], base[:, :t]), t
            assert not torch.allclose(out[:, t], base[:, t]), t


@pytest.mark.parametrize("norm_first", [False, True])
def test_padded_tokens_change_nothing_they_must_not(norm_first, small_model):
    model = small_model(norm_first=norm_first)
    src, tgt = batch()
    src_mask, tgt_mask = padding_mask(src, PAD), target_mask(tgt, PAD)
    with torch.no_grad():
        base = model(src, tgt, src_mask, tgt_mask)
        # The ids under the padding change, the masks (computed from the original batch) do not.
        other_src = src.clone()
        other_src[src == PAD] = 9
        assert torch.equal(model(other_src, tgt, src_mask, tgt_mask), base)
        other_tgt = tgt.clone()
        other_tgt[tgt == PAD] = 9
        real = tgt != PAD
        assert torch.equal(model(src, other_tgt, src_mask, tgt_mask)[real], base[real])


@pytest.mark.parametrize("norm_first", [False, True])
def test_decode_with_a_cache_equals_full_decode(norm_first, small_model):
    model = small_model(norm_first=norm_first)
    src, tgt = batch()
    src_mask, tgt_mask = padding_mask(src, PAD), target_mask(tgt, PAD)
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        full = model.decode(memory, src_mask, tgt, tgt_mask)
        cache = DecoderCache(len(model.decoder.layers))
        steps = [model.decode(memory, src_mask, tgt[:, t:t + 1], None, cache) for t in range(tgt.size(1))]
    real = tgt != PAD
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], atol=1e-12, rtol=0)


def test_dropout_is_active_in_training_mode_only(small_model):
    model = small_model(dropout=0.3)
    src, tgt = batch()
    src_mask, tgt_mask = padding_mask(src, PAD), target_mask(tgt, PAD)
    with torch.no_grad():
        assert torch.equal(model(src, tgt, src_mask, tgt_mask), model(src, tgt, src_mask, tgt_mask))
        model.train()
        assert not torch.equal(model(src, tgt, src_mask, tgt_mask), model(src, tgt, src_mask, tgt_mask))


# --- CUDA ---------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("norm_first", [False, True])
def test_cuda_forward_matches_cpu(norm_first, full_float32_precision, small_model):
    model = small_model(vocab=100, norm_first=norm_first, dtype=torch.float32)
    src, tgt = batch(100)
    src_mask, tgt_mask = padding_mask(src, PAD), target_mask(tgt, PAD)
    with torch.no_grad():
        expected = model.generator(model(src, tgt, src_mask, tgt_mask))
        model = model.cuda()
        out = model.generator(model(src.cuda(), tgt.cuda(), src_mask.cuda(), tgt_mask.cuda()))
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
def test_cuda_bf16_autocast_forward_runs():
    torch.manual_seed(0)
    model = make_model(1000, 1000, N=2, d_model=128, d_ff=256, h=4, dropout=0.0, share_embeddings=True)
    model = model.cuda().eval()
    src, tgt = batch(1000)
    src, tgt = src.cuda(), tgt.cuda()
    src_mask, tgt_mask = padding_mask(src, PAD), target_mask(tgt, PAD)
    with torch.no_grad():
        reference = model.generator(model(src, tgt, src_mask, tgt_mask))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            log_probs = model.generator(model(src, tgt, src_mask, tgt_mask))
    assert log_probs.shape == (2, 6, 1000)
    assert torch.isfinite(log_probs).all()
    torch.testing.assert_close(log_probs.float().exp().sum(-1), torch.ones(2, 6, device="cuda"), atol=1e-2, rtol=0)
    assert (log_probs.float() - reference).abs().max() < 0.1


@pytest.mark.parametrize("name", ["norm_first", "share_embeddings"])
@pytest.mark.parametrize("value", ["False", "True", 0, 1, None])
def test_make_model_flags_must_be_bools(name, value):
    """Issue 21 (defect 22): norm_first="False" used to build a pre-norm model (a non-empty string is true)."""
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        make_model(11, 11, N=1, d_model=16, d_ff=32, h=2, **{name: value})


def test_make_model_refuses_sizes_beyond_memory_naming_them():
    """Issue 21 (defect 17): a vocabulary of 10**12 used to end in the allocator's RuntimeError."""
    import os

    if not (hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names):
        pytest.skip("this system does not tell its memory")
    with pytest.raises(MemoryError, match=r"src_vocab=1000000000000, tgt_vocab=11, N=1, d_model=16"):
        make_model(10**12, 11, N=1, d_model=16, d_ff=32, h=2)
