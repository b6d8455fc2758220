"""Tests of annotated_transformer.feed_forward: PositionwiseFeedForward (book/feed_forward.md)."""
import pytest
import torch
from torch import nn

from annotated_transformer.feed_forward import PositionwiseFeedForward

D_MODEL, D_FF = 16, 64


def make_ffn(d_model=D_MODEL, d_ff=D_FF, dropout=0.1, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return PositionwiseFeedForward(d_model, d_ff, dropout).to(dtype).eval()


def randn(*shape, seed=1, dtype=torch.float64):
    torch.manual_seed(seed)
    return torch.randn(*shape, dtype=dtype)


def test_equation_2():
    ffn = make_ffn()
    x = randn(3, 7, D_MODEL)
    W1, b1 = ffn.w_1.weight.T, ffn.w_1.bias
    W2, b2 = ffn.w_2.weight.T, ffn.w_2.bias
    expected = torch.clamp(x @ W1 + b1, min=0) @ W2 + b2
    torch.testing.assert_close(ffn(x), expected, rtol=0, atol=1e-12)


def test_equals_two_convolutions_with_kernel_size_1():
    ffn = make_ffn()
    conv_1 = nn.Conv1d(D_MODEL, D_FF, kernel_size=1).double()
    conv_2 = nn.Conv1d(D_FF, D_MODEL, kernel_size=1).double()
    with torch.no_grad():
        conv_1.weight.copy_(ffn.w_1.weight.unsqueeze(-1))
        conv_1.bias.copy_(ffn.w_1.bias)
        conv_2.weight.copy_(ffn.w_2.weight.unsqueeze(-1))
        conv_2.bias.copy_(ffn.w_2.bias)
    x = randn(2, 9, D_MODEL)
    expected = conv_2(conv_1(x.transpose(1, 2)).relu()).transpose(1, 2)
    torch.testing.assert_close(ffn(x), expected, rtol=0, atol=1e-12)


def test_position_wise_each_position_alone_equals_the_sequence():
    ffn = make_ffn()
    x = randn(2, 6, D_MODEL)
    separately = torch.stack([ffn(x[:, t]) for t in range(x.size(1))], dim=1)
    torch.testing.assert_close(ffn(x), separately, rtol=0, atol=1e-12)


def test_position_wise_commutes_with_permutations_and_does_not_mix_positions():
    ffn = make_ffn()
    x = randn(2, 6, D_MODEL)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    torch.testing.assert_close(ffn(x[:, perm]), ffn(x)[:, perm], rtol=0, atol=1e-12)
    changed = x.clone()
    changed[:, 2] += 1.0
    difference = (ffn(changed) - ffn(x)).abs().amax(dim=(0, 2))
    assert difference[2] > 0
    assert torch.all(difference[torch.arange(6) != 2] == 0)


@pytest.mark.parametrize("shape", [(D_MODEL,), (5, D_MODEL), (2, 3, D_MODEL), (2, 3, 4, D_MODEL)])
def test_shapes(shape):
    ffn = make_ffn()
    assert ffn(randn(*shape)).shape == shape
    assert ffn.w_1.weight.shape == (D_FF, D_MODEL) and ffn.w_2.weight.shape == (D_MODEL, D_FF)


def test_parameter_count_of_the_base_model():
    ffn = PositionwiseFeedForward(512, 2048)
    assert sum(p.numel() for p in ffn.parameters()) == 2 * 512 * 2048 + 2048 + 512 == 2_099_712
    assert set(ffn.state_dict()) == {"w_1.weight", "w_1.bias", "w_2.weight", "w_2.bias"}


def test_dropout_only_in_training():
    ffn = make_ffn(dropout=0.5)
    x = randn(4, 5, D_MODEL)
    ffn.train()
    torch.manual_seed(2)
    first = ffn(x)
    torch.manual_seed(3)
    second = ffn(x)
    assert not torch.allclose(first, second)
    ffn.eval()
    torch.testing.assert_close(ffn(x), ffn(x), rtol=0, atol=0)


def test_dropout_acts_on_the_hidden_activations():
    """With p = 1 every hidden unit is dropped, so the output is w_2's bias at every position."""
    ffn = make_ffn(dropout=1.0).train()
    x = randn(2, 3, D_MODEL)
    torch.testing.assert_close(ffn(x), ffn.w_2.bias.detach().expand(2, 3, D_MODEL), rtol=0, atol=0)


def test_has_a_non_linearity():
    """Without the ReLU the map would be affine: f(a + b) + f(0) == f(a) + f(b). With it, it is not."""
    ffn = make_ffn()
    a, b = randn(10, D_MODEL, seed=4), randn(10, D_MODEL, seed=5)
    zero = torch.zeros(10, D_MODEL, dtype=torch.float64)
    assert not torch.allclose(ffn(a + b) + ffn(zero), ffn(a) + ffn(b))


@pytest.mark.parametrize("d_model, d_ff, name", [(0, 8, "d_model"), (8, -1, "d_ff"), (8.0, 8, "d_model"),
                                                 (8, True, "d_ff")])
def test_rejects_bad_sizes(d_model, d_ff, name):
    with pytest.raises(ValueError, match=name):
        PositionwiseFeedForward(d_model, d_ff)


def test_rejects_wrong_last_dimension():
    with pytest.raises(ValueError, match="d_model=16"):
        make_ffn()(randn(2, 3, 15))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_on_cuda_matches_cpu(dtype, tolerance):
    ffn = make_ffn(dtype=dtype)
    x = randn(3, 11, D_MODEL, dtype=dtype)
    expected = ffn(x)
    got = ffn.to("cuda")(x.to("cuda"))
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.cuda
def test_on_cuda_under_bf16_autocast():
    ffn = make_ffn(dtype=torch.float32).to("cuda")
    x = randn(3, 11, D_MODEL, dtype=torch.float32).to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = ffn(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ffn(x), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_relu_gives_torch_relus_values_and_gradients(dtype):
    """The sign-of-the-output backward is torch.relu's gradient, exactly, including at 0 and -0."""
    from annotated_transformer.feed_forward import relu

    z = torch.cat([torch.tensor([-1.0, -0.0, 0.0, 2.0], dtype=dtype), randn(500, dtype=dtype)])
    upstream = randn(504, seed=2, dtype=dtype)
    results = []
    for function in (relu, torch.relu):
        leaf = z.clone().requires_grad_()
        out = function(leaf)
        out.backward(upstream)
        results.append((out.detach(), leaf.grad))
    (ours, our_grad), (theirs, their_grad) = results
    assert torch.equal(ours, theirs) and torch.equal(our_grad, their_grad)
    assert our_grad[1] == 0 and our_grad[2] == 0  # 0 at the kink, as PyTorch's


def test_compiled_training_step_writes_no_boolean_mask_for_relu():
    """On a CPU the compiled forward and backward of the network (dropout on, in compile_settings) write no tensor
    of booleans from the compiler's own code: with torch.relu the compiler writes ReLU's mask (this test fails)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from annotated_transformer.runtime import compile_settings

    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(8, 32, dropout=0.1).train()
    x = torch.randn(4, 8, requires_grad=True)

    def step(x):
        ffn(x).sum().backward()

    torch._dynamo.reset()
    with compile_settings("cpu"):
        _, code = run_and_get_code(torch.compile(step), x)
    torch._dynamo.reset()
    assert code and all("cpp_fused" in part for part in code)  # the compiler's C++ kernels
    written = [found for part in code for found in re.findall(r"(?<!const )\bbool\* \w+", part)]
    assert written == []


def test_compiled_relu_gives_the_eager_gradients():
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(8, 32, dropout=0.0)
    x = torch.randn(4, 8)
    grads = []
    torch._dynamo.reset()
    for run in (ffn, torch.compile(ffn)):
        ffn.zero_grad()
        run(x).sum().backward()
        grads.append(ffn.w_1.weight.grad.clone())
    torch._dynamo.reset()
    torch.testing.assert_close(grads[0], grads[1])
