"""Tests of annotated_transformer.embeddings (book/embeddings.md) and of weight tying in make_model."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from annotated_transformer.embeddings import Embeddings, Generator
from annotated_transformer.masks import padding_mask, target_mask
from annotated_transformer.model import make_model

SMALL = dict(N=1, d_model=16, d_ff=32, h=2, dropout=0.0)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def test_embeddings_look_up_rows_scaled_by_sqrt_d_model():
    torch.manual_seed(0)
    emb = Embeddings(d_model=16, vocab=11)
    tokens = torch.tensor([[1, 2, 3, 10], [0, 0, 5, 7]])
    out = emb(tokens)
    assert out.shape == (2, 4, 16)
    assert torch.equal(out, emb.lut.weight[tokens] * math.sqrt(16))
    assert torch.equal(emb(tokens.int()), out)  # int32 ids work too


def test_embeddings_refuse_out_of_range_ids_with_the_vocabulary_size():
    emb = Embeddings(d_model=8, vocab=11)
    for bad in (torch.tensor([[0, 11]]), torch.tensor([[-1, 3]])):
        with pytest.raises(ValueError, match="vocab=11"):
            emb(bad)
    emb(torch.tensor([[0, 10]]))  # the edges are fine


def test_embeddings_refuse_non_integer_ids():
    with pytest.raises(TypeError, match="integer"):
        Embeddings(d_model=8, vocab=11)(torch.tensor([[1.0, 2.0]]))


@pytest.mark.parametrize("args", [(0, 5), (8, 0), (8, 2.5), (True, 5)])
def test_embeddings_and_generator_refuse_bad_sizes(args):
    with pytest.raises(ValueError, match="positive int"):
        Embeddings(*args)
    with pytest.raises(ValueError, match="positive int"):
        Generator(*args)


def test_generator_returns_log_softmax_of_the_projection():
    torch.manual_seed(0)
    gen = Generator(d_model=16, vocab=11).double()
    h = torch.randn(3, 5, 16, dtype=torch.float64)
    logp = gen(h)
    assert logp.shape == (3, 5, 11)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(3, 5, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(logp, F.log_softmax(gen.proj(h), dim=-1), rtol=0, atol=1e-12)
    assert (logp <= 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_modules_keep_their_dtype(dtype):
    emb = Embeddings(d_model=16, vocab=11).to(dtype)
    gen = Generator(d_model=16, vocab=11).to(dtype)
    x = emb(torch.tensor([[1, 2, 3]]))
    assert x.dtype == dtype
    assert gen(x).dtype == dtype


def test_share_embeddings_ties_one_tensor_three_ways():
    model = make_model(11, 11, **SMALL, share_embeddings=True)
    src = model.src_embed.embeddings.lut.weight
    tgt = model.tgt_embed.embeddings.lut.weight
    out = model.generator.proj.weight
    assert src is tgt is out
    assert src.data_ptr() == tgt.data_ptr() == out.data_ptr()
    untied = make_model(11, 11, **SMALL)
    assert untied.src_embed.embeddings.lut.weight is not untied.generator.proj.weight


@pytest.mark.parametrize("vocab, d_model", [(11, 16), (1000, 64)])
def test_tying_saves_two_embedding_matrices(vocab, d_model):
    sizes = dict(N=1, d_model=d_model, d_ff=2 * d_model, h=2)
    untied = make_model(vocab, vocab, **sizes)
    tied = make_model(vocab, vocab, **sizes, share_embeddings=True)
    assert count_parameters(untied) - count_parameters(tied) == 2 * vocab * d_model


def test_tying_different_vocabularies_is_refused():
    with pytest.raises(ValueError, match="vocab"):
        make_model(11, 13, **SMALL, share_embeddings=True)


def test_tied_gradient_is_the_sum_of_the_three_roles_and_a_step_moves_all(small_model):
    tied = small_model(11, share_embeddings=True, **SMALL)
    untied = small_model(11, **SMALL)
    untied.load_state_dict(tied.state_dict())
    src = torch.tensor([[1, 4, 5, 9, 2], [3, 3, 7, 2, 0]])
    tgt_in = torch.tensor([[1, 6, 8, 10], [1, 5, 2, 0]])
    tgt_out = torch.tensor([[6, 8, 10, 2], [5, 2, 0, 0]])
    for model in (tied, untied):
        logp = model.generator(model(src, tgt_in, padding_mask(src, 0), target_mask(tgt_in, 0)))
        F.nll_loss(logp.reshape(-1, 11), tgt_out.reshape(-1), ignore_index=0).backward()
    shared = tied.generator.proj.weight
    roles = [untied.src_embed.embeddings.lut.weight, untied.tgt_embed.embeddings.lut.weight,
             untied.generator.proj.weight]
    assert all(w.grad.abs().sum() > 0 for w in roles)
    assert torch.allclose(shared.grad, sum(w.grad for w in roles), rtol=0, atol=1e-12)

    before = shared.detach().clone()
    with torch.no_grad():  # one plain gradient-descent step over model.parameters(), which lists the shared tensor once
        for p in tied.parameters():
            p -= 0.1 * p.grad
    assert torch.allclose(shared, before - 0.1 * sum(w.grad for w in roles), rtol=0, atol=1e-12)
    assert tied.src_embed.embeddings.lut.weight is shared and tied.tgt_embed.embeddings.lut.weight is shared


def test_tie_survives_dtype_conversion_and_deepcopy():
    model = copy.deepcopy(make_model(11, 11, **SMALL, share_embeddings=True).to(torch.float64))
    assert model.src_embed.embeddings.lut.weight is model.generator.proj.weight
    assert model.tgt_embed.embeddings.lut.weight is model.generator.proj.weight
    assert model.generator.proj.weight.dtype == torch.float64


@pytest.mark.cuda
def test_embeddings_generator_and_tied_model_on_cuda():
    torch.manual_seed(0)
    emb, gen = Embeddings(16, 11), Generator(16, 11)
    tokens = torch.tensor([[1, 2, 3, 10], [0, 0, 5, 7]])
    expected = gen(emb(tokens))
    emb_cuda, gen_cuda = copy.deepcopy(emb).cuda(), copy.deepcopy(gen).cuda()
    got = gen_cuda(emb_cuda(tokens.cuda()))
    assert got.device.type == "cuda"
    assert torch.allclose(got.cpu(), expected, atol=1e-5)

    model = make_model(11, 11, **SMALL, share_embeddings=True).eval()
    src, tgt = tokens, tokens[:, :3]
    expected = model.generator(model(src, tgt, padding_mask(src, 0), target_mask(tgt, 0)))
    model = model.cuda()
    assert model.src_embed.embeddings.lut.weight is model.generator.proj.weight  # the tie survives .cuda()
    src, tgt = src.cuda(), tgt.cuda()
    got = model.generator(model(src, tgt, padding_mask(src, 0), target_mask(tgt, 0)))
    assert torch.allclose(got.cpu(), expected, atol=1e-4)
