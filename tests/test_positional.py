"""Tests of annotated_transformer.positional (book/positional.md)."""
import math

import pytest
import torch

from annotated_transformer.attention import MultiHeadedAttention
from annotated_transformer.positional import LearnedPositionalEmbedding, PositionalEncoding, sinusoid_table


def rotation(k, d_model):
    """Block-diagonal R_k with PE[p + k] = R_k @ PE[p]."""
    omega = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    c, s = torch.cos(k * omega), torch.sin(k * omega)
    R = torch.zeros(d_model, d_model, dtype=torch.float64)
    R[0::2, 0::2], R[0::2, 1::2] = torch.diag(c), torch.diag(s)
    R[1::2, 0::2], R[1::2, 1::2] = torch.diag(-s), torch.diag(c)
    return R


@pytest.mark.parametrize("pos, i", [(0, 0), (1, 0), (3, 1), (17, 5), (42, 100), (999, 255)])
def test_table_matches_the_formula_of_section_3_5(pos, i):
    d_model = 512
    table = sinusoid_table(1000, d_model, dtype=torch.float64)
    angle = pos / 10000 ** (2 * i / d_model)
    assert math.isclose(table[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-13)
    assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-13)


def test_regression_blog_exponent_column_2_turns_at_10000_to_minus_2_over_d():
    # The widely copied blog code uses 10000**(2*i/d) with i already even, i.e. 10000**(-4/d) in column 2,
    # and a different exponent 2*(i+1)/d for the cosine of the pair.
    d_model = 64
    table = sinusoid_table(50, d_model, dtype=torch.float64)
    p = torch.arange(50, dtype=torch.float64)
    assert torch.allclose(table[:, 2], torch.sin(p * 10000 ** (-2 / d_model)), rtol=0, atol=1e-13)
    assert torch.allclose(table[:, 3], torch.cos(p * 10000 ** (-2 / d_model)), rtol=0, atol=1e-13)
    assert not torch.allclose(table[:, 2], torch.sin(p * 10000 ** (-4 / d_model)), atol=1e-3)


def test_table_dtype_and_shape():
    assert sinusoid_table(10, 8).dtype == torch.float32
    assert sinusoid_table(10, 8).shape == (10, 8)
    assert torch.equal(sinusoid_table(10, 8), sinusoid_table(10, 8, dtype=torch.float64).float())
    assert sinusoid_table(10, 8, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("k", [1, 3, 64, 900])
def test_shift_by_k_is_one_rotation_for_every_position(k):
    d_model = 128
    table = sinusoid_table(1000, d_model, dtype=torch.float64)
    R = rotation(k, d_model)
    assert torch.allclose(table[:-k] @ R.T, table[k:], rtol=0, atol=1e-10)
    assert torch.allclose(R @ R.T, torch.eye(d_model, dtype=torch.float64), rtol=0, atol=1e-12)


def test_dot_product_of_encodings_depends_only_on_the_offset():
    table = sinusoid_table(300, 64, dtype=torch.float64)
    for k in (1, 5, 40):
        dots = (table[:-k] * table[k:]).sum(-1)
        assert torch.allclose(dots, dots[0].expand_as(dots), rtol=0, atol=1e-10)


def test_self_attention_is_permutation_equivariant_without_positions_and_not_with_them():
    torch.manual_seed(0)
    d_model, length = 16, 7
    mha = MultiHeadedAttention(h=2, d_model=d_model).double().eval()
    x = torch.randn(2, length, d_model, dtype=torch.float64)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    out = mha(x, x, x)
    xp = x[:, perm]
    assert torch.allclose(mha(xp, xp, xp), out[:, perm], rtol=0, atol=1e-12)

    pe = sinusoid_table(length, d_model, dtype=torch.float64)
    y, yp = x + pe, xp + pe
    assert (mha(yp, yp, yp) - mha(y, y, y)[:, perm]).abs().max() > 1e-2


@pytest.mark.parametrize("module_class", [PositionalEncoding, LearnedPositionalEmbedding])
def test_offset_k_adds_the_rows_k_onwards(module_class):
    torch.manual_seed(0)
    module = module_class(16, 0.0, max_len=40)
    table = module.pe[0] if module_class is PositionalEncoding else module.weight
    x = torch.randn(3, 5, 16)
    assert torch.equal(module(x), x + table[:5])
    for offset in (1, 7, 35):
        assert torch.equal(module(x, offset=offset), x + table[offset: offset + 5])


def test_positional_encoding_equals_the_table():
    pe = PositionalEncoding(16, 0.0, max_len=30)
    assert torch.equal(pe(torch.zeros(1, 30, 16))[0], sinusoid_table(30, 16))


@pytest.mark.parametrize("module_class", [PositionalEncoding, LearnedPositionalEmbedding])
def test_too_long_sequences_raise_a_clear_error(module_class):
    module = module_class(16, 0.0, max_len=20)
    module(torch.zeros(1, 20, 16))  # exactly max_len is fine
    with pytest.raises(ValueError, match="max_len=20"):
        module(torch.zeros(1, 21, 16))
    with pytest.raises(ValueError, match="max_len=20"):
        module(torch.zeros(1, 5, 16), offset=16)
    # a position tensor (the compiled decoding step's) is read and checked in eager mode on the CPU; past the
    # table it had stopped in index_select with "IndexError: index out of range in self"
    x = torch.zeros(1, 5, 16)
    assert torch.equal(module(x, offset=torch.tensor(15)), module(x, offset=15))
    with pytest.raises(ValueError, match=r"positions 16\.\.20 exceed the positional table \(max_len=20\)"):
        module(x, offset=torch.tensor(16))
    with pytest.raises(ValueError, match="offset must be a non-negative int .* got -1"):
        module(x, offset=torch.tensor(-1, dtype=torch.int32))


def test_odd_d_model_raises():
    with pytest.raises(ValueError, match="even"):
        sinusoid_table(10, 15)
    with pytest.raises(ValueError, match="even"):
        PositionalEncoding(15, 0.1)


@pytest.mark.parametrize("call", [
    lambda: sinusoid_table(0, 8),
    lambda: sinusoid_table(10, 0),
    lambda: LearnedPositionalEmbedding(8, 0.1, max_len=0),
    lambda: PositionalEncoding(8, 0.0, max_len=10)(torch.zeros(10, 8)),  # unbatched
    lambda: PositionalEncoding(8, 0.0, max_len=10)(torch.zeros(1, 4, 6)),  # wrong width
    lambda: PositionalEncoding(8, 0.0, max_len=10)(torch.zeros(1, 4, 8), offset=-1),
    lambda: PositionalEncoding(8, 0.0, max_len=10)(torch.zeros(1, 4, 8), offset=1.5),
])
def test_bad_arguments_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("call", [lambda: sinusoid_table(10.0, 8), lambda: sinusoid_table(10, True),
                                  lambda: LearnedPositionalEmbedding(8, 0.1, max_len="5")])
def test_sizes_of_the_wrong_type_raise_type_error(call):
    with pytest.raises(TypeError, match="must be an int"):
        call()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("module_class", [PositionalEncoding, LearnedPositionalEmbedding])
def test_low_precision_input_keeps_its_dtype(module_class, dtype):
    module = module_class(16, 0.0, max_len=3000)
    x = torch.zeros(2, 3000, 16, dtype=dtype)
    y = module(x)
    assert y.dtype == dtype
    if module_class is PositionalEncoding:
        assert torch.allclose(y[0].float(), sinusoid_table(3000, 16), rtol=0, atol=1e-2)


def test_dropout_acts_in_training_only():
    torch.manual_seed(0)
    pe = PositionalEncoding(16, 0.5, max_len=10)
    x = torch.ones(4, 10, 16)
    assert (pe.train()(x) == 0).any()
    assert torch.equal(pe.eval()(x), x + sinusoid_table(10, 16))


def test_table_is_a_non_persistent_buffer_that_follows_the_module():
    pe = PositionalEncoding(16, 0.1, max_len=10)
    assert "pe" not in pe.state_dict()
    assert pe.double().pe.dtype == torch.float64
    longer = PositionalEncoding(16, 0.1, max_len=50)
    assert torch.equal(longer.pe[:, :10].float(), PositionalEncoding(16, 0.1, max_len=10).pe)


def test_learned_positions_are_trainable_and_only_used_rows_get_gradients():
    torch.manual_seed(0)
    learned = LearnedPositionalEmbedding(8, 0.0, max_len=12)
    assert [name for name, _ in learned.named_parameters()] == ["weight"]
    assert learned.weight.shape == (12, 8)
    learned(torch.randn(2, 4, 8), offset=3).sum().backward()
    grad = learned.weight.grad
    assert (grad[3:7] != 0).all()
    assert (grad[:3] == 0).all() and (grad[7:] == 0).all()
    assert "weight" in learned.state_dict()


@pytest.mark.cuda
@pytest.mark.parametrize("module_class", [PositionalEncoding, LearnedPositionalEmbedding])
def test_positions_on_cuda(module_class):
    torch.manual_seed(0)
    module = module_class(16, 0.0, max_len=40)
    x = torch.randn(2, 9, 16)
    expected = module(x, offset=5)
    module = module.cuda()
    got = module(x.cuda(), offset=5)
    assert got.device.type == "cuda"
    assert torch.allclose(got.cpu(), expected, atol=1e-6)
    half = module(x.cuda().to(torch.bfloat16), offset=5)
    assert half.dtype == torch.bfloat16 and half.device.type == "cuda"
    with pytest.raises(ValueError, match="max_len=40"):
        module(torch.zeros(1, 41, 16, device="cuda"))
