"""Tests of annotated_transformer.sublayers: LayerNorm, SublayerConnection, clones (book/sublayers.md)."""
import pytest
import torch
from torch import nn

from annotated_transformer.sublayers import LayerNorm, SublayerConnection, clones

SHAPES = [(7,), (3, 16), (2, 5, 32), (2, 3, 4, 512)]


def layer_norm_equation(x, gamma, beta, eps=1e-6):
    """The equation: biased variance, eps inside the square root."""
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return gamma * (x - mu) / torch.sqrt(var + eps) + beta


def layer_norm_2022(x, gamma, beta, eps=1e-6):
    """The 2022 Annotated Transformer's version: unbiased std, eps outside the root."""
    mean = x.mean(-1, keepdim=True)
    std = x.std(-1, keepdim=True)
    return gamma * (x - mean) / (std + eps) + beta


def random_layer_norm(d, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    norm = LayerNorm(d).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    return norm


# --- LayerNorm ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_equals_torch_layer_norm(shape):
    d = shape[-1]
    ours = random_layer_norm(d)
    reference = nn.LayerNorm(d, eps=1e-6).double()
    with torch.no_grad():
        reference.weight.copy_(ours.weight)
        reference.bias.copy_(ours.bias)
    x = torch.randn(shape, dtype=torch.float64) * 4 - 3
    torch.testing.assert_close(ours(x), reference(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_equals_the_equation(shape):
    ours = random_layer_norm(shape[-1], seed=1)
    x = torch.randn(shape, dtype=torch.float64) * 10 + 5
    torch.testing.assert_close(ours(x), layer_norm_equation(x, ours.weight, ours.bias), rtol=0, atol=1e-12)


def test_layer_norm_gradients_equal_torch():
    ours = random_layer_norm(24, seed=2)
    reference = nn.LayerNorm(24, eps=1e-6).double()
    with torch.no_grad():
        reference.weight.copy_(ours.weight)
        reference.bias.copy_(ours.bias)
    x = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 5, 24, dtype=torch.float64)
    (grad_ours,) = torch.autograd.grad((ours(x) * upstream).sum(), x)
    (grad_ref,) = torch.autograd.grad((reference(x) * upstream).sum(), x)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=0, atol=1e-12)


def test_layer_norm_standardises_each_position():
    x = torch.randn(4, 6, 64, dtype=torch.float64) * 30 + 100
    y = LayerNorm(64).double()(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(4, 6, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(4, 6, dtype=torch.float64), rtol=0, atol=1e-6)


def test_layer_norm_is_not_the_2022_unbiased_std_version():
    """Regression: biased variance and eps inside the root, unlike the 2022 Annotated Transformer."""
    d = 16
    norm = LayerNorm(d).double()
    x = torch.randn(200, d, dtype=torch.float64)
    ours, old = norm(x), layer_norm_2022(x, norm.weight, norm.bias)
    # ordinary vectors: the 2022 output is ours scaled by sqrt((d - 1) / d), up to eps
    torch.testing.assert_close(old, ours * ((d - 1) / d) ** 0.5, rtol=1e-4, atol=1e-4)
    assert (ours - old).abs().max() > 1e-2
    # a nearly constant vector: eps inside the root shrinks it, eps outside blows the noise up
    flat = 3.0 + 1e-6 * torch.randn(1, 512, dtype=torch.float64)
    norm512 = LayerNorm(512).double()
    assert norm512(flat).std() < 0.01
    assert layer_norm_2022(flat, norm512.weight, norm512.bias).std() > 0.3


def test_layer_norm_eps_is_used_inside_the_root():
    x = torch.tensor([[1.0, -1.0]], dtype=torch.float64)  # mean 0, biased variance 1
    y = LayerNorm(2, eps=3.0).double()(x)
    torch.testing.assert_close(y, x / 2.0, rtol=0, atol=1e-12)  # 1 / sqrt(1 + 3)


def test_layer_norm_constant_input_gives_the_bias():
    norm = random_layer_norm(8)
    y = norm(torch.full((2, 8), 5.0, dtype=torch.float64))
    torch.testing.assert_close(y, norm.bias.detach().expand(2, 8), rtol=0, atol=1e-12)


def test_layer_norm_state_dict_and_repr():
    norm = LayerNorm(10)
    assert set(norm.state_dict()) == {"weight", "bias"}
    norm = random_layer_norm(10, dtype=torch.float32)  # loaded weights that are not the defaults
    theirs = nn.LayerNorm(10, eps=1e-6)
    loaded = theirs.load_state_dict(norm.state_dict())
    assert not loaded.missing_keys and not loaded.unexpected_keys
    x = torch.randn(3, 10)
    torch.testing.assert_close(theirs(x), norm(x))
    assert "10" in repr(norm) and "eps=1e-06" in repr(norm)


@pytest.mark.parametrize("features", [0, -3, 2.5, True, "8"])
def test_layer_norm_rejects_bad_features(features):
    with pytest.raises(ValueError, match="features"):
        LayerNorm(features)


def test_layer_norm_rejects_negative_eps():
    with pytest.raises(ValueError, match="eps"):
        LayerNorm(8, eps=-1e-6)


def test_layer_norm_rejects_wrong_last_dimension():
    with pytest.raises(ValueError, match="last dimension is 8"):
        LayerNorm(8)(torch.randn(2, 3, 9))


# --- SublayerConnection -----------------------------------------------------------------------------------------

def block_and_sublayer(norm_first, dropout=0.0, d=16, seed=0):
    torch.manual_seed(seed)
    block = SublayerConnection(d, dropout, norm_first=norm_first).double()
    with torch.no_grad():
        block.norm.weight.normal_()
        block.norm.bias.normal_()
    sublayer = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d)).double()
    return block, sublayer


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_post_norm_formula_in_eval_mode(dropout):
    block, sublayer = block_and_sublayer(norm_first=False, dropout=dropout)
    block.eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    expected = layer_norm_equation(x + sublayer(x), block.norm.weight, block.norm.bias)
    torch.testing.assert_close(block(x, sublayer), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_pre_norm_formula_in_eval_mode(dropout):
    block, sublayer = block_and_sublayer(norm_first=True, dropout=dropout)
    block.eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    expected = x + sublayer(layer_norm_equation(x, block.norm.weight, block.norm.bias))
    torch.testing.assert_close(block(x, sublayer), expected, rtol=0, atol=1e-12)


def test_default_is_post_norm():
    assert SublayerConnection(8, 0.1).norm_first is False
    assert "norm_first=False" in repr(SublayerConnection(8, 0.1))


@pytest.mark.parametrize("norm_first", [False, True])
def test_dropout_only_in_training(norm_first):
    block, sublayer = block_and_sublayer(norm_first, dropout=0.5)
    x = torch.randn(4, 6, 16, dtype=torch.float64)
    block.train()
    torch.manual_seed(1)
    first = block(x, sublayer)
    torch.manual_seed(2)
    second = block(x, sublayer)
    assert not torch.allclose(first, second)
    block.eval()
    torch.testing.assert_close(block(x, sublayer), block(x, sublayer), rtol=0, atol=0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_dropout_acts_on_the_sublayer_output_only(norm_first):
    """With p = 1 every sublayer output is dropped: post-norm gives LayerNorm(x), pre-norm gives x."""
    block, sublayer = block_and_sublayer(norm_first, dropout=1.0)
    block.train()
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    expected = x if norm_first else layer_norm_equation(x, block.norm.weight, block.norm.bias)
    torch.testing.assert_close(block(x, sublayer), expected, rtol=0, atol=1e-12)


def test_pre_norm_and_post_norm_differ():
    post, sublayer = block_and_sublayer(norm_first=False)
    pre, _ = block_and_sublayer(norm_first=True)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    assert not torch.allclose(post(x, sublayer), pre(x, sublayer))


# --- clones -------------------------------------------------------------------------------------------------------

def test_clones_gives_independent_equal_copies():
    torch.manual_seed(0)
    layer = nn.Linear(5, 5)
    copies = clones(layer, 3)
    assert isinstance(copies, nn.ModuleList) and len(copies) == 3
    pointers = {p.data_ptr() for c in copies for p in c.parameters()} | {p.data_ptr() for p in layer.parameters()}
    assert len(pointers) == 4 * 2  # weight and bias of the prototype and of each copy, all distinct
    for c in copies:
        assert c is not layer
        torch.testing.assert_close(c.weight, layer.weight, rtol=0, atol=0)
    with torch.no_grad():
        copies[0].weight.add_(1.0)
    assert not torch.equal(copies[0].weight, copies[1].weight)
    assert torch.equal(copies[1].weight, layer.weight)


def test_clones_registers_parameters():
    holder = nn.Module()
    holder.layers = clones(nn.Linear(4, 4), 6)
    assert sum(p.numel() for p in holder.parameters()) == 6 * (16 + 4)
    assert len(holder.state_dict()) == 12


def test_clones_gradients_are_independent():
    copies = clones(nn.Linear(3, 3), 2)
    copies[0](torch.randn(2, 3)).sum().backward()
    assert copies[0].weight.grad is not None and copies[1].weight.grad is None


@pytest.mark.parametrize("n, error", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)])
def test_clones_rejects_bad_n(n, error):
    with pytest.raises(error, match="n must be"):
        clones(nn.Linear(2, 2), n)


# --- CUDA ---------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_norm_on_cuda_matches_cpu(dtype):
    norm = random_layer_norm(64, dtype=dtype)
    x = torch.randn(4, 10, 64, dtype=dtype)
    expected = norm(x)
    got = norm.to("cuda")(x.to("cuda"))
    assert got.device.type == "cuda"
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.cpu(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.cuda
def test_layer_norm_runs_in_float32_under_cuda_autocast():
    norm = LayerNorm(64).to("cuda")
    x = torch.randn(4, 10, 64, device="cuda").to(torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, norm(x.float()), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("norm_first", [False, True])
def test_sublayer_connection_on_cuda_matches_cpu(norm_first):
    block, sublayer = block_and_sublayer(norm_first, dropout=0.1)
    block.eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    expected = block(x, sublayer)
    block, sublayer = block.to("cuda"), sublayer.to("cuda")
    got = block(x.to("cuda"), sublayer)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-12, atol=1e-12)
