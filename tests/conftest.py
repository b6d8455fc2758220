"""Shared test set-up: CUDA-marked tests are skipped, with the reason, where CUDA is absent; the small model that
many tests build."""
import pytest
import torch

# The sizes of the tests' small model: big enough for every code path (two layers, several heads), fast on a CPU.
SMALL_SIZES = dict(N=2, d_model=32, d_ff=64, h=4)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available here")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def full_float32_precision():
    """Full float32 matrix products: TF32 (if another test switched it on) would need far looser tolerances."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.fixture
def small_model():
    """Build the tests' small model: ``small_model(vocab, seed=0, norm_first=False, share_embeddings=False,
    dropout=0.0, dtype=torch.float64, **sizes)`` seeds torch, calls make_model with SMALL_SIZES (``sizes`` overrides
    them) and returns the model in eval mode, in float64 unless ``dtype`` says otherwise."""

    def build(vocab=10, *, seed=0, norm_first=False, share_embeddings=False, dropout=0.0, dtype=torch.float64,
              **sizes):
        from annotated_transformer import make_model

        torch.manual_seed(seed)
        model = make_model(vocab, vocab, **{**SMALL_SIZES, **sizes}, dropout=dropout, norm_first=norm_first,
                           share_embeddings=share_embeddings)
        return model.to(dtype).eval()

    return build
