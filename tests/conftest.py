"""Shared test set-up: CUDA-marked tests are skipped, with the reason, where CUDA is absent."""
import pytest
import torch


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
