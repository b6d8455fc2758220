"""Tests of annotated_transformer.runtime: profiles, devices and seeds (book/intro.md)."""
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from annotated_transformer.runtime import PROFILES, by_profile, get_device, get_profile, seed_everything


@pytest.fixture
def no_accelerator(monkeypatch):
    """Pretend that this machine has neither CUDA nor Apple MPS."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend that this machine has one CUDA device (only torch.device objects are made, no CUDA work)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def clean_environment(monkeypatch):
    monkeypatch.delenv("AT_PROFILE", raising=False)
    monkeypatch.delenv("AT_DEVICE", raising=False)


# Profiles


def test_profiles_are_quick_and_full():
    assert PROFILES == ("quick", "full")


@pytest.mark.parametrize(
    "value, cuda, expected",
    [
        ("quick", False, "quick"),
        ("quick", True, "quick"),
        ("full", False, "full"),
        ("full", True, "full"),
        ("auto", False, "quick"),
        ("auto", True, "full"),
    ],
)
def test_profile_from_environment(monkeypatch, value, cuda, expected):
    monkeypatch.setenv("AT_PROFILE", value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert get_profile() == expected


@pytest.mark.parametrize("cuda, expected", [(False, "quick"), (True, "full")])
@pytest.mark.parametrize("unset", [True, False])
def test_profile_unset_or_empty_means_auto(monkeypatch, cuda, expected, unset):
    if unset:
        monkeypatch.delenv("AT_PROFILE", raising=False)
    else:
        monkeypatch.setenv("AT_PROFILE", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert get_profile() == expected


@pytest.mark.parametrize("value, expected", [("QUICK", "quick"), ("Full", "full"), (" quick\n", "quick")])
def test_profile_is_case_insensitive(monkeypatch, value, expected):
    monkeypatch.setenv("AT_PROFILE", value)
    assert get_profile() == expected
    monkeypatch.delenv("AT_PROFILE")
    assert get_profile(value) == expected


def test_profile_auto_in_any_case(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("AT_PROFILE", "AUTO")
    assert get_profile() == "full"


def test_explicit_profile_wins_over_environment(monkeypatch):
    monkeypatch.setenv("AT_PROFILE", "full")
    assert get_profile("quick") == "quick"
    monkeypatch.setenv("AT_PROFILE", "quick")
    assert get_profile("full") == "full"


@pytest.mark.parametrize("bad", ["fast", "ful", "gpu", "quick,full", "0"])
def test_bad_profile_in_environment_raises(monkeypatch, bad):
    monkeypatch.setenv("AT_PROFILE", bad)
    with pytest.raises(ValueError, match="AT_PROFILE") as error:
        get_profile()
    assert repr(bad) in str(error.value)


@pytest.mark.parametrize("bad", ["", "fast", 3])
def test_bad_explicit_profile_raises(clean_environment, bad):
    with pytest.raises(ValueError, match="^profile must be .quick., .full. or .auto."):
        get_profile(bad)


def test_by_profile_picks_the_matching_value(monkeypatch):
    quick, full = object(), object()
    assert by_profile(quick, full, profile="quick") is quick
    assert by_profile(quick, full, profile="full") is full
    assert by_profile(quick=200, full=20_000, profile="FULL") == 20_000
    monkeypatch.setenv("AT_PROFILE", "quick")
    assert by_profile(quick=200, full=20_000) == 200
    monkeypatch.setenv("AT_PROFILE", "full")
    assert by_profile(quick=200, full=20_000) == 20_000


def test_by_profile_follows_auto(monkeypatch):
    monkeypatch.setenv("AT_PROFILE", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert by_profile(1, 2) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert by_profile(1, 2) == 2


def test_by_profile_rejects_bad_profile(monkeypatch):
    monkeypatch.setenv("AT_PROFILE", "medium")
    with pytest.raises(ValueError, match="^AT_PROFILE must be"):
        by_profile(1, 2)
    with pytest.raises(ValueError, match="^profile must be"):
        by_profile(1, 2, profile="medium")


# Devices


def test_device_defaults_to_cpu_without_accelerators(clean_environment, no_accelerator):
    assert get_device() == torch.device("cpu")


@pytest.mark.parametrize("value", ["", "auto", " AUTO "])
def test_empty_or_auto_device_means_default(monkeypatch, no_accelerator, value):
    monkeypatch.setenv("AT_DEVICE", value)
    assert get_device() == torch.device("cpu")
    assert get_device(value) == torch.device("cpu")


def test_device_prefers_cuda_then_mps(clean_environment, monkeypatch, fake_cuda):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert get_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert get_device() == torch.device("mps")


def test_at_device_overrides_the_default(monkeypatch, fake_cuda):
    monkeypatch.setenv("AT_DEVICE", "cpu")
    assert get_device() == torch.device("cpu")
    monkeypatch.setenv("AT_DEVICE", "cuda:0")
    assert get_device() == torch.device("cuda", 0)


def test_explicit_device_wins_over_environment(monkeypatch, no_accelerator):
    monkeypatch.setenv("AT_DEVICE", "cuda")  # would raise here; the argument takes precedence
    assert get_device("cpu") == torch.device("cpu")
    assert get_device(torch.device("cpu")) == torch.device("cpu")


# ids: a parameter id "cuda" would become a keyword, which tests/conftest.py reads as the cuda marker
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "CUDA:1"], ids=["no-index", "index-0", "upper-case"])
def test_cuda_without_cuda_raises(monkeypatch, no_accelerator, name):
    monkeypatch.delenv("AT_DEVICE", raising=False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        get_device(name)
    monkeypatch.setenv("AT_DEVICE", name)
    with pytest.raises(ValueError, match="CUDA is not available"):
        get_device()


def test_cuda_index_beyond_the_devices_raises(clean_environment, fake_cuda):
    assert get_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="1 CUDA device"):
        get_device("cuda:3")


def test_mps_without_mps_raises(clean_environment, no_accelerator):
    with pytest.raises(ValueError, match="MPS is not available"):
        get_device("mps")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu0"])
def test_bad_device_string_raises(monkeypatch, no_accelerator, bad):
    monkeypatch.setenv("AT_DEVICE", bad)
    with pytest.raises(ValueError, match="AT_DEVICE") as error:
        get_device()
    assert repr(bad) in str(error.value)


# Seeds


def test_seed_makes_torch_randn_reproducible():
    seed_everything(1234)
    first = torch.randn(5, 7)
    seed_everything(1234)
    assert torch.equal(first, torch.randn(5, 7))
    seed_everything(1235)
    assert not torch.equal(first, torch.randn(5, 7))


def test_seed_covers_python_and_numpy():
    seed_everything(7)
    first = (random.random(), np.random.rand(3))
    seed_everything(7)
    second = (random.random(), np.random.rand(3))
    assert first[0] == second[0]
    np.testing.assert_array_equal(first[1], second[1])


def test_seed_makes_module_initialisation_reproducible():
    seed_everything(0)
    first = torch.nn.Linear(4, 3).weight.detach().clone()
    seed_everything(0)
    assert torch.equal(first, torch.nn.Linear(4, 3).weight)


@pytest.mark.parametrize("bad, error", [(1.5, TypeError), ("1", TypeError), (True, TypeError),
                                        (-1, ValueError), (2**32, ValueError)])
def test_bad_seed_raises(bad, error):
    with pytest.raises(error, match="seed"):
        seed_everything(bad)


def test_deterministic_only_when_asked(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        seed_everything(0)
        assert not torch.are_deterministic_algorithms_enabled()
        seed_everything(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark is False
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before)


# On a CUDA machine


@pytest.mark.cuda
def test_cuda_machine_defaults(clean_environment):
    device = get_device()
    assert device.type == "cuda"
    assert get_profile() == "full"
    assert by_profile(quick=200, full=20_000) == 20_000
    assert torch.ones(2, device=device).is_cuda


@pytest.mark.cuda
def test_seed_makes_cuda_randn_reproducible(clean_environment):
    seed_everything(3)
    first = torch.randn(1000, device="cuda")
    seed_everything(3)
    assert torch.equal(first, torch.randn(1000, device="cuda"))


@pytest.mark.parametrize("other", ["meta", "xpu", "hpu", "XPU:0"])
def test_devices_this_book_does_not_run_on_are_refused(monkeypatch, no_accelerator, other):
    """Issue 21 (defect 11): PyTorch knows these device types, but the book cannot train or decode on them."""
    with pytest.raises(ValueError, match="not one this book runs on"):
        get_device(other)
    monkeypatch.setenv("AT_DEVICE", other)
    with pytest.raises(ValueError, match="AT_DEVICE"):
        get_device()


# Attention kernels for batches of changing shapes


def test_attention_settings_leave_cudnn_out_on_a_gpu_only(monkeypatch):
    """On CUDA the context disables cuDNN's attention (a plan per new shape) and keeps the other fused kernels;
    it restores the flags afterwards; on a CPU it changes nothing."""
    from annotated_transformer.attention import attention_settings

    backends = torch.backends.cuda
    flags = lambda: (backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(),  # noqa: E731
                     backends.mem_efficient_sdp_enabled(), backends.math_sdp_enabled())
    before = flags()
    with attention_settings("cpu"):
        assert flags() == before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with attention_settings("cuda"):
        assert flags() == (False, True, True, True)
    assert flags() == before


@pytest.mark.cuda
def test_training_on_cuda_runs_attention_without_cudnn(monkeypatch):
    """The training loop's steps and its validation run in attention_settings: no attention call sees cuDNN."""
    import torch.nn.functional as F

    from annotated_transformer import attention
    from annotated_transformer.model import make_model
    from annotated_transformer.trainer import train
    from annotated_transformer.training import Batch, LabelSmoothing, make_optimizer

    seen, before = [], torch.backends.cuda.cudnn_sdp_enabled()
    original = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    torch.manual_seed(0)
    model = make_model(11, 11, N=1, d_model=64, d_ff=128, h=2).cuda()
    data = torch.randint(1, 11, (4, 9))
    batches = [Batch(data[:, :length], data[:, :length]) for length in (5, 7, 9)]
    evaluations = []
    train(model, batches, steps=3, optimizer=make_optimizer(model), loss_fn=LabelSmoothing(11, 0, 0.1),
          progress=False, evaluate=lambda step: evaluations.append(model(
              *(t.cuda() for t in (batches[0].src, batches[0].tgt, batches[0].src_mask, batches[0].tgt_mask)))),
          eval_every=1)
    assert seen and not any(seen) and len(evaluations) == 3
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # given back as it was



def test_a_progress_bar_takes_the_total_a_clocked_run_gives_it(capsys):
    """The training loop gives the bar of a run with a time limit the steps its clock allows, its own bar or a
    caller's (the translation task's bar spans its validations too)."""
    from tqdm import tqdm

    from annotated_transformer.runtime import Progress

    bar = Progress(True, total=5000, initial=0)  # its own bar, drawn on stderr
    bar.update(2.0, 1e-3, 100, last=False, total=300)
    assert bar.bar.total == 300 and bar.bar.n == 1
    bar.update(2.0, 1e-3, 100, last=False)  # no total: kept
    assert bar.bar.total == 300
    bar.close()
    with tqdm(total=50, disable=True) as own:
        theirs = Progress(own, total=5000, initial=0)
        theirs.update(2.0, 1e-3, 100, last=False)
        assert own.total == 50  # no clock: the caller's total stays
        theirs.update(2.0, 1e-3, 100, last=False, total=300)
        assert own.total == 300


@pytest.mark.parametrize("kernels, flags, named", [
    (True, "fpu avx512f avx512_bf16", True),   # both: bf16 in the name
    (True, "fpu avx512f avx512bw", False),     # AVX-512 without BF16: the kernels, not the speed
    (True, None, True),                        # no flags to read (not Linux): the kernels say
    (False, "fpu avx512_bf16", False),         # no kernels
    (None, "fpu avx512_bf16", False),          # a PyTorch that cannot say
])
def test_the_device_name_says_bf16_only_where_the_cpu_computes_it_natively(monkeypatch, kernels, flags, named):
    from annotated_transformer import runtime
    monkeypatch.setattr(runtime, "cpu_has_bf16_kernels", lambda: kernels)
    info = {"model name": "A CPU"} if flags is None else {"model name": "A CPU", "flags": flags}
    monkeypatch.setattr(runtime, "cpu_info", lambda: info)
    name = runtime.describe_device("cpu")
    assert name.startswith("cpu (A CPU, ") and name.endswith(", bf16)") == named, name


def test_bf16_instructions_are_read_from_the_cpus_flags(monkeypatch, tmp_path):
    from annotated_transformer import runtime
    from annotated_transformer.runtime import cpu_has_bf16_instructions, cpu_info
    assert cpu_has_bf16_instructions({"flags": "fpu avx2 avx512f avx512_bf16 amx_tile"})
    assert cpu_has_bf16_instructions({"flags": "fpu avx2 amx_bf16"})                   # AMX
    assert cpu_has_bf16_instructions({"flags": "fpu avx2 avx512f avx512bw"}) is False  # AVX-512 without BF16
    assert cpu_has_bf16_instructions({"Features": "fp asimd bf16 i8mm"})               # Arm (Linux)
    assert cpu_has_bf16_instructions({"Features": "fp asimd"}) is False
    assert cpu_has_bf16_instructions({}) is None and cpu_has_bf16_instructions({"model name": "x"}) is None
    # the file: the first value of each field (one block per processor), stripped; {} where there is none
    text = "processor\t: 0\nmodel name\t: A CPU\nflags\t\t: fpu avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu\n"
    (tmp_path / "cpuinfo").write_text(text)
    real = Path

    def files(name, *args):
        return real(tmp_path / "cpuinfo") if str(name) == "/proc/cpuinfo" else real(name, *args)

    monkeypatch.setattr(runtime, "Path", files)
    assert cpu_info() == {"processor": "0", "model name": "A CPU", "flags": "fpu avx512_bf16"}
    assert cpu_has_bf16_instructions() is True
    assert runtime.describe_device("cpu").startswith("cpu (A CPU, ")
    (tmp_path / "cpuinfo").unlink()
    assert cpu_info() == {} and cpu_has_bf16_instructions() is None
