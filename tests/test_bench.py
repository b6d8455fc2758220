"""The measuring tools (book/measuring.md), the layers of Table 1 (book/why_attention.md), the performance
measurements (book/performance.md) and the benchmark harness, `python -m annotated_transformer bench`
(book/appendix_bench.md).

Timings are never asserted (they are noise on a shared machine); the tests check the command line and its tables,
the FLOP and MFU arithmetic, the memory measurements, the online softmax, the decoding benchmark and the layers of
Table 1.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from annotated_transformer.attention import attention
from annotated_transformer.bench import DEFAULT_SECTIONS, SECTIONS, TABLES, format_tables, run_benchmarks
from annotated_transformer.layer_types import (
    LAYER_KINDS,
    RestrictedSelfAttention,
    SelfAttentionCore,
    layer_flops,
    make_layer,
)
from annotated_transformer.measure import format_table, largest_tensor_bytes, saved_tensor_bytes, time_side_by_side
from annotated_transformer.performance import (
    DECODING_METHODS,
    TorchTransformer,
    decoding_throughput,
    mfu,
    model_sizes,
    online_softmax_attention,
    peak_flops,
    teacher_forced,
    train_step_flops,
    training_throughput,
)
from annotated_transformer.masks import padding_mask, target_mask
from annotated_transformer.model import make_model
from annotated_transformer.runtime import choose_precision

ROOT = Path(__file__).resolve().parents[1]


def headers(section: str) -> list[str]:
    return [column[0] for column in TABLES[section][1]]


def assert_header_printed(lines: list[str], section: str) -> int:
    """That ``section``'s table is among the printed ``lines``, under its title with its column headers; the index
    of the title."""
    title = TABLES[section][0]
    assert title in lines, section
    assert lines[lines.index(title) + 1].split() == " ".join(headers(section)).split(), section
    return lines.index(title)


# The sections that the command below runs: the decoding section compiles its step for each batch size and length
# (about 40 s of the smoke sizes on one thread here), which the tests of decoding_throughput below do in-process
CHEAP_SECTIONS = ("training", "attention", "layers")


def test_smoke_command_prints_every_table_and_saves_json(tmp_path) -> None:
    out = tmp_path / "results" / "smoke.json"
    result = subprocess.run(
        [sys.executable, "-m", "annotated_transformer", "bench", "--smoke", "--device", "cpu", "--threads", "1",
         "--clock", "cpu", "--only", *CHEAP_SECTIONS, "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("device: cpu") and "dtype: float32" in lines[0] and torch.__version__ in lines[0]
    assert "cpu clock" in lines[0] and "smoke sizes" in lines[0]
    for section in CHEAP_SECTIONS:
        assert_header_printed(lines, section)
    assert TABLES["decoding"][0] not in lines
    saved = json.loads(out.read_text())
    assert saved["meta"]["smoke"] is True and saved["meta"]["device"] == "cpu"
    assert saved["meta"]["threads"] == 1 and saved["meta"]["clock"] == "cpu"
    assert saved["meta"]["command"] == ("python -m annotated_transformer bench --smoke --device cpu --threads 1 "
                                        f"--clock cpu --only {' '.join(CHEAP_SECTIONS)} --json {out}")
    assert set(saved) == {"meta", *CHEAP_SECTIONS}
    assert {row["kind"] for row in saved["layers"]} == set(LAYER_KINDS)
    row = saved["training"][0]
    assert row["ours_mfu"] is None and row["torch_mfu"] is None  # no peak is known for a CPU
    assert row["tokens"] == row["batch"] * row["tgt_len"]


def test_a_table_timed_in_another_dtype_than_the_runs_says_so_in_its_title() -> None:
    """The GPU record's layers ran in float16 under a header that said bfloat16 for every table."""
    root = Path(__file__).resolve().parents[1] / "book" / "results"
    gpu = format_tables(json.loads((root / "bench_gpu.json").read_text()))
    assert "dtype: bfloat16" in gpu.splitlines()[0]
    titles = [line for line in gpu.splitlines() if line in {title for title, _ in TABLES.values()}
              or line.startswith(TABLES["layers"][0])]
    assert f"{TABLES['layers'][0]} [float16]" in titles and TABLES["training"][0] in titles
    cpu = format_tables(json.loads((root / "bench_cpu.json").read_text()))
    assert "[float" not in cpu  # one dtype throughout: no mark


def test_the_command_runs_every_section_but_shapes_and_profile_unless_told(monkeypatch) -> None:
    import annotated_transformer.bench as bench
    from annotated_transformer.cli import main

    asked = []
    monkeypatch.setattr(bench, "run", lambda **kwargs: asked.append(kwargs) or 0)
    assert main(["bench", "--smoke"]) == 0 and main(["bench", "--only", "decoding", "shapes"]) == 0
    assert [tuple(kwargs["sections"]) for kwargs in asked] == [DEFAULT_SECTIONS, ("decoding", "shapes")]
    assert set(SECTIONS) - set(DEFAULT_SECTIONS) == {"shapes", "profile"}


def test_command_line_refuses_a_missing_device_and_unknown_sections(capsys) -> None:
    from annotated_transformer.cli import main

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_info:  # argparse's refusal of the option
            main(["bench", "--smoke", "--device", "cuda"])
        assert exit_info.value.code == 2 and "CUDA is not available" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--only", "nonsense"])
    assert exit_info.value.code == 2
    with pytest.raises(ValueError, match="unknown sections"):
        run_benchmarks("cpu", smoke=True, sections=("training", "speed"))
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "--smoke", "--clock", "cpu", "--threads", "2"]) == 2
        assert "one thread" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_json_never_replaces_another_kind_of_record(tmp_path, capsys) -> None:
    """`--json` replaces an earlier benchmark's record, but never a translation run's record or any other file."""
    from annotated_transformer.cli import main

    record = tmp_path / "run.json"
    record.write_text(json.dumps({"task": "multi30k", "command": "python -m annotated_transformer train"}))
    before = record.read_text()
    assert main(["bench", "--smoke", "--only", "layers", "--device", "cpu", "--json", str(record)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {record} (--json) is a results record") and err.count("\n") == 1
    assert record.read_text() == before
    earlier = tmp_path / "bench.json"
    assert main(["bench", "--smoke", "--only", "layers", "--device", "cpu", "--json", str(earlier)]) == 0
    assert main(["bench", "--smoke", "--only", "layers", "--device", "cpu", "--json", str(earlier)]) == 0


def test_module_script_hands_its_arguments_to_the_command_line() -> None:
    result = subprocess.run([sys.executable, "-m", "annotated_transformer.bench", "--help"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m annotated_transformer bench")
    for option in ("--smoke", "--device", "--only", "--json", "--threads", "--compile", "--clock",
                   "--batch-sizes"):
        assert option in result.stdout, option


@pytest.mark.parametrize("argv0, expected", [
    ("/x/annotated_transformer/__main__.py", "python -m annotated_transformer bench --smoke"),
    ("/x/annotated_transformer/bench.py", "python -m annotated_transformer bench --smoke"),
    ("C:\\venv\\Scripts\\annotated-transformer.exe", "python -m annotated_transformer bench --smoke"),
    ("/x/other.py", None),
    ("", None),
])
def test_a_record_names_the_command_that_made_it(monkeypatch, argv0, expected) -> None:
    """`python -m annotated_transformer.bench` is the same command as the `bench` subcommand; a console script
    is recognised by its name, with or without Windows's .exe."""
    from annotated_transformer.records import command_line

    arguments = ["--smoke"] if "bench.py" in argv0 else ["bench", "--smoke"]
    monkeypatch.setattr(sys, "argv", [argv0, *arguments])
    assert command_line() == expected


def test_decoding_benchmark_reports_every_method_batch_and_length() -> None:
    """Every method decodes at every batch size and output length, at positive rates, and each row gives its
    speed-up over greedy decoding without the cache. The compiled methods, which compile again for each batch size
    and length (seconds each here), at one of them; the benchmark appendix runs them at four."""
    config = dict(N=1, d_model=32, d_ff=64, h=2, vocab=50)
    eager = tuple(method for method in DECODING_METHODS if not method.endswith("compiled"))
    grid = decoding_throughput(config, batch_sizes=(1, 4), output_tokens=(3, 6), src_len=5, repeat=1, methods=eager)
    assert [(row["method"], row["batch"], row["tokens"]) for row in grid] == [
        (method, batch, tokens) for batch in (1, 4) for tokens in (3, 6) for method in eager]
    every = decoding_throughput(config, batch_sizes=(4,), output_tokens=(3,), src_len=5, repeat=1)
    assert [(row["method"], row["batch"], row["tokens"]) for row in every] == [
        (method, 4, 3) for method in DECODING_METHODS]
    rows = grid + every
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["ms_per_step"] > 0 and row["max_len"] == row["tokens"] + 1
        assert row["speedup"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 1e3 / row["ms_per_step"])
    assert all(row["speedup"] == 1.0 for row in rows if row["method"] == "greedy, no cache")
    meta = dict(device="cpu", device_name="cpu", dtype="float32", torch=torch.__version__, date="today")
    lines = format_tables(dict(meta=meta, decoding=rows)).splitlines()  # the command's table of them
    title = assert_header_printed(lines, "decoding")
    assert len(lines) == title + 3 + len(rows)  # title, header, rule, a line per row


def test_batch_sizes_replace_the_decoding_sections(monkeypatch) -> None:
    """`--batch-sizes` (one at a time, where a GPU loan is short) measures those batch sizes only. The decoding
    section itself is stood in for: the test above decodes at every batch size it is given."""
    import annotated_transformer.bench as bench

    asked = []
    monkeypatch.setattr(bench, "decoding_throughput", lambda *args, **kwargs: asked.append(kwargs) or ["rows"])
    for given, expected in (((3,), (3,)), (None, (1, 4))):  # without it, the smoke sizes (the smoke test too)
        results = run_benchmarks("cpu", smoke=True, sections=("decoding",), batch_sizes=given)
        assert asked.pop()["batch_sizes"] == expected and results["decoding"] == ["rows"]


def test_train_step_flops_is_six_times_weights_times_tokens() -> None:
    config = dict(N=3, d_model=48, d_ff=96, h=4, src_vocab=50, tgt_vocab=50)
    model = make_model(**config)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    for batch, length in [(1, 1), (4, 7), (16, 33)]:
        assert train_step_flops(config, batch, length, length, attention_products=False) == 6 * weights * batch * length
    # the attention products: Q Kᵀ and the weighted sum, in the encoder, the decoder's self- and cross-attention
    B, S, T, N, d = 2, 5, 7, 3, 48
    products = train_step_flops(config, B, S, T) - train_step_flops(config, B, S, T, attention_products=False)
    assert products == 3 * 2 * B * N * (2 * S * S * d + 2 * T * T * d + 2 * T * S * d)
    with pytest.raises(ValueError, match="d_ff"):
        train_step_flops(dict(N=1, d_model=8, tgt_vocab=10), 1, 1, 1)


def test_peak_table_and_mfu_arithmetic() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756.5e12
    assert peak_flops("NVIDIA H200") == 989.4e12 and peak_flops("NVIDIA GH200 480GB") == 989.4e12
    assert peak_flops("NVIDIA A100-SXM4-40GB") == 312e12 and peak_flops("NVIDIA A100 80GB PCIe") == 312e12
    assert peak_flops("NVIDIA A10") == 125e12 and peak_flops("NVIDIA L4") == 121e12
    # the NVL parts run at lower clocks than the SXM ones: no peak rather than the SXM's (it had been 989.4e12)
    assert peak_flops("NVIDIA H100 NVL") is None and peak_flops("NVIDIA H200 NVL") is None
    assert peak_flops("NVIDIA L40S") == 362.1e12
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float16) == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float32) is None
    assert peak_flops("NVIDIA GeForce GTX 1080") is None
    assert mfu(1e12, 1.0, 2e12) == 0.5
    assert mfu(6e12, 0.02, 1e15) == pytest.approx(0.3)
    assert mfu(1e12, 1.0, None) is None
    with pytest.raises(ValueError, match="seconds_per_step"):
        mfu(1e12, 0.0, 1e15)


def test_online_softmax_attention_equals_equation_one() -> None:
    torch.manual_seed(0)
    q = torch.randn(3, 2, 9, 8, dtype=torch.float64)
    k, v = torch.randn(2, 3, 2, 13, 8, dtype=torch.float64).unbind(0)
    expected, _ = attention(q, k, v)
    for block in (1, 2, 5, 13, 100):
        torch.testing.assert_close(online_softmax_attention(q, k, v, block), expected, rtol=0, atol=1e-12)
    # large scores: the running maximum keeps the exponentials finite
    big = online_softmax_attention(q * 300, k, v, block_size=4)
    assert torch.isfinite(big).all()
    torch.testing.assert_close(big, attention(q * 300, k, v)[0], rtol=0, atol=1e-10)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="block_size"):
            online_softmax_attention(q, k, v, bad)


def test_memory_measurements_match_the_shapes() -> None:
    q, k, v = torch.randn(3, 2, 4, 64, 16).unbind(0)
    assert largest_tensor_bytes(lambda: attention(q, k, v)) == 2 * 4 * 64 * 64 * 4
    assert largest_tensor_bytes(lambda: F.scaled_dot_product_attention(q, k, v)) == 2 * 4 * 64 * 16 * 4
    assert largest_tensor_bytes(lambda: q.transpose(-2, -1)) == 0
    x = torch.randn(3, 32, 8, requires_grad=True)
    assert saved_tensor_bytes(lambda: attention(x, x, x)[0], [x]) == 3 * 32 * 32 * 4
    w = torch.randn(8, 8, requires_grad=True)
    assert saved_tensor_bytes(lambda: torch.tanh(x @ w), [x, w]) == 3 * 32 * 8 * 4


def test_time_side_by_side_alternates_and_validates() -> None:
    calls = []
    times = time_side_by_side({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeat=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert len(times["a"]) == len(times["b"]) == 3 and all(t >= 0 for t in times["a"])
    with pytest.raises(ValueError, match="repeat"):
        time_side_by_side({"a": lambda: None}, repeat=0)
    with pytest.raises(ValueError, match="clock"):
        time_side_by_side({"a": lambda: None}, clock="sundial")
    with pytest.raises(ValueError, match="cpu clock"):
        time_side_by_side({"a": lambda: None}, device="cuda", clock="cpu")
    spin = lambda: sum(range(200_000))
    assert all(t > 0 for t in time_side_by_side({"spin": spin}, repeat=2, clock="cpu")["spin"])


def test_layers_of_table_one() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 24, 8, dtype=torch.float64)
    for kind in LAYER_KINDS:
        assert make_layer(kind, 8, r=6).double()(x).shape == x.shape
    torch.testing.assert_close(RestrictedSelfAttention(24)(x), SelfAttentionCore()(x))
    # a block of r positions sees its own block and the two neighbouring ones, nothing further
    x.requires_grad_(True)
    RestrictedSelfAttention(4)(x)[0, 12].sum().backward()  # position 12 is in block 3 (positions 12 ... 15)
    reached = (x.grad[0].abs().sum(-1) > 0).nonzero().flatten().tolist()
    assert reached == list(range(8, 20))
    with pytest.raises(ValueError, match="multiple of r"):
        RestrictedSelfAttention(5)(x)
    with pytest.raises(ValueError, match="kind"):
        make_layer("lstm", 8)
    assert layer_flops("self-attention", 64, 64) == layer_flops("recurrent", 64, 64)
    assert layer_flops("self-attention", 32, 64) * 2 == layer_flops("recurrent", 32, 64)
    assert layer_flops("convolutional", 10, 4, batch=3, k=5) == 2 * 3 * 5 * 10 * 16


def test_torch_reference_has_the_same_parameters_and_outputs_log_probabilities() -> None:
    sizes = dict(N=2, d_model=32, d_ff=64, h=4, dropout=0.0)
    ours, theirs = make_model(60, 60, **sizes), TorchTransformer(60, 60, **sizes).eval()
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert theirs.transformer.encoder.norm is None and theirs.transformer.decoder.norm is None
    src, tgt = torch.randint(1, 60, (3, 7)), torch.randint(1, 60, (3, 5))
    log_probs = theirs(src, tgt)
    assert log_probs.shape == (3, 5, 60)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(3, 5))


def test_teacher_forced_masks_the_padding_and_returns_the_generators_log_probabilities() -> None:
    config = dict(N=1, d_model=16, d_ff=32, h=2, vocab=30, dropout=0.0, name="ignored")
    assert model_sizes(config) == dict(N=1, d_model=16, d_ff=32, h=2, dropout=0.0)
    assert model_sizes({k: v for k, v in config.items() if k != "dropout"})["dropout"] == 0.1
    torch.manual_seed(0)
    model = make_model(30, 30, **model_sizes(config)).eval()
    src = torch.tensor([[5, 6, 7, 8], [8, 9, 3, 3]])  # the second padded with id 3
    tgt = torch.tensor([[1, 4, 5], [1, 6, 3]])
    masks = padding_mask(src, 3), target_mask(tgt, 3)
    expected = model.generator(model(src, tgt, *masks))
    torch.testing.assert_close(teacher_forced(model, pad=3)(src, tgt), expected)
    # with another padding id the masks differ, and so does the second sentence
    other = teacher_forced(model, pad=0)(src, tgt)
    torch.testing.assert_close(other[0], expected[0])
    assert not torch.allclose(other[1], expected[1])


def test_format_table_marks_missing_values() -> None:
    text = format_table([dict(a="x", b=None), dict(a="yy", b=2.0)], [("A", "a", "{}"), ("B", "b", "{:.1f}")])
    assert text.splitlines() == ["A     B", "--  ---", "x   n/a", "yy  2.0"]


@pytest.mark.cuda
def test_gpu_path_bf16_training_mfu_and_memory() -> None:
    device = torch.device("cuda")
    row = training_throughput(dict(N=1, d_model=64, d_ff=128, h=4, vocab=500), batch=8, src_len=16, tgt_len=16,
                              device=device, dtype=torch.bfloat16, steps=2, warmup=1)
    assert row["ours_ms"] > 0 and row["torch_ms"] > 0
    if peak_flops(torch.cuda.get_device_name(device)) is not None:
        assert 0 < row["ours_mfu"] < 1 and 0 < row["torch_mfu"] < 1
    results = run_benchmarks(device, smoke=True)
    assert results["meta"]["dtype"] == str(choose_precision(device).dtype).removeprefix("torch.")
    for r in results["attention"]:
        assert r["explicit_peak_bytes"] >= r["scores_bytes"]
        assert r["fused_peak_bytes"] < r["explicit_peak_bytes"]
    assert all(r["peak_bytes"] is not None for r in results["layers"])
    assert math.isfinite(results["training"][0]["ratio"])


def test_the_compiled_training_rows_are_timed_beside_the_eager_ones() -> None:
    """compile=True: the four variants in the same rounds, with the three ratios (compiling takes seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        row = training_throughput(dict(N=1, d_model=16, d_ff=32, h=2, vocab=50), 2, 6, 6, steps=2, warmup=1,
                                  compile=True)
    finally:
        torch.set_num_threads(threads)
    for name in ("ours", "torch", "ours_compiled", "torch_compiled"):
        assert row[f"{name}_ms"] > 0 and row[f"{name}_mfu"] is None
        assert row[f"{name}_tokens_per_s"] == pytest.approx(row["tokens"] / row[f"{name}_ms"] * 1e3)
    assert all(row[key] > 0 for key in ("ratio", "compiled_ratio", "compile_speedup")) and row["compiled"]


def test_the_shapes_section_runs_on_request_in_four_passes(tmp_path) -> None:
    """`bench --only shapes`: a training step per shape, without cuDNN's attention twice, then PyTorch's
    default twice (on a CPU the same kernels: a check that it runs)."""
    out = tmp_path / "shapes.json"
    result = subprocess.run(
        [sys.executable, "-m", "annotated_transformer", "bench", "--smoke", "--device", "cpu", "--only", "shapes",
         "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert TABLES["shapes"][0] in result.stdout.splitlines()
    rows = json.loads(out.read_text())["shapes"]
    assert [(row["attention"], row["number"], row["shapes"]) for row in rows] == [
        ("without cuDNN", 1, 3), ("without cuDNN", 2, 3), ("default", 1, 3), ("default", 2, 3)]
    assert all(row["ms"] > 0 and row["seconds"] == pytest.approx(row["ms"] * 3 / 1e3) for row in rows)


def test_precision_overrules_the_devices_by_the_runtimes_rules(tmp_path, monkeypatch, capsys) -> None:
    """`bench --precision bf16` times bf16 autocast on a CPU (warning where it has no fast bf16 kernels); fp16 there
    is refused in one line, as for training."""
    from annotated_transformer import runtime
    from annotated_transformer.cli import main

    monkeypatch.setattr(runtime, "cpu_has_bf16_kernels", lambda: False)
    out = tmp_path / "bf16.json"
    base = ["bench", "--smoke", "--device", "cpu", "--only", "training", "--json"]
    assert main(base + [str(out), "--precision", "bf16"]) == 0
    assert json.loads(out.read_text())["meta"]["dtype"] == "bfloat16"
    assert "warning: bf16 was asked for, but this CPU has no fast bfloat16 kernels" in capsys.readouterr().err
    assert main(base + [str(out), "--precision", "fp32"]) == 0
    assert json.loads(out.read_text())["meta"]["dtype"] == "float32"
    assert main(base + [str(tmp_path / "fp16.json"), "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: fp16 on a CPU is refused") and err.count("\n") == 1, err
    assert "--precision bf16 or fp32" in err  # the options of the command that was run
    assert not (tmp_path / "fp16.json").exists()


@pytest.mark.parametrize("name, kind", [
    ("aten::addmm", "matrix products"), ("aten::mm", "matrix products"), ("aten::bmm", "matrix products"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matrix products"),
    ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT", "matrix products"),          # cuBLASLt on an H100
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "matrix products"),
    ("triton_tem_fused_mm_0", "matrix products"),                              # a compiled product
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention (fused)"),         # not a product: attention first
    ("aten::_scaled_dot_product_efficient_attention", "attention (fused)"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float>", "softmax and loss"),
    ("triton_red_fused__log_softmax_nll_loss_forward_3", "softmax and loss"),
    ("aten::nll_loss2d_forward", "softmax and loss"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimiser"),
    ("Optimizer.step#Adam.step", "optimiser"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>", "layer norm"),
    ("triton_poi_fused_add_native_dropout_1", "compiled code"),               # fused: no single kind
    ("## Call CompiledFxGraph fuqa2vw35mih7z2i3p5jnjijh5vc6p3txokseapj7mjlkils62kg ##", "compiled code"),
    ("aten::bernoulli_", "dropout masks"), ("aten::native_dropout", "dropout masks"),
    ("Memcpy HtoD (Pageable -> Device)", "copies and fills"), ("aten::copy_", "copies and fills"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "copies and fills"),
    ("aten::mul", "other element-wise and framework"), ("aten::view", "other element-wise and framework"),
    # an autograd node's own time is the framework's; its product is the aten::mm below it (it counted as a product)
    ("autograd::engine::evaluate_function: AddmmBackward0", "other element-wise and framework"),
    ("AddmmBackward0", "other element-wise and framework"), ("BmmBackward0", "other element-wise and framework"),
])
def test_step_kind_names_the_work_of_cpu_operations_and_gpu_kernels(name, kind) -> None:
    from annotated_transformer.performance import step_kind
    assert step_kind(name) == kind


def test_kinds_of_work_sums_gpu_kernels_or_cpu_self_times_per_step() -> None:
    from types import SimpleNamespace
    from torch.autograd import DeviceType
    from annotated_transformer.performance import kinds_of_work

    def event(name, device, own_cpu_us, device_us):
        return SimpleNamespace(name=name, device_type=device, self_cpu_time_total=own_cpu_us,
                               device_time_total=device_us)

    events = [event("aten::addmm", DeviceType.CPU, 30.0, 900.0),            # the op: its kernels are counted apart
              event("nvjet_hsh_128x256", DeviceType.CUDA, 0.0, 800.0),
              event("sm90_xmma_gemm_bf16", DeviceType.CUDA, 0.0, 400.0),
              event("Memset (Device)", DeviceType.CUDA, 0.0, 100.0),
              event("aten::mul", DeviceType.CPU, 500.0, 0.0)]
    # two steps: microseconds over 2, in seconds
    assert kinds_of_work(events, on_gpu=True, steps=2) == pytest.approx(
        {"matrix products": 600e-6, "copies and fills": 50e-6})
    on_cpu = kinds_of_work(events, on_gpu=False, steps=2)
    assert on_cpu == pytest.approx({"other element-wise and framework": 250e-6, "matrix products": 15e-6})
    assert list(on_cpu) == ["other element-wise and framework", "matrix products"]  # largest first


def test_step_profile_accounts_for_a_cpu_step_by_kinds_of_work() -> None:
    """The rows (largest first, then the rest of the wall time) add up to the step (compiled: the next test)."""
    compile = False
    from annotated_transformer.performance import step_profile
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = step_profile(dict(name="tiny", N=1, d_model=16, d_ff=32, h=2, vocab=50), 4, 6, 6, steps=2,
                            warmup=1, compile=compile)
    finally:
        torch.set_num_threads(threads)
    kinds = [row["kind"] for row in rows]
    assert kinds[-1] == "outside the operations" and len(set(kinds)) == len(kinds)
    assert all(row["config"] == "tiny" and row["compiled"] == compile and row["ms"] >= 0 for row in rows)
    assert [row["ms"] for row in rows[:-1]] == sorted((row["ms"] for row in rows[:-1]), reverse=True)
    step_ms = sum(row["ms"] for row in rows)
    assert sum(row["share"] for row in rows) == pytest.approx(1, abs=0.05)
    assert all(row["share"] == pytest.approx(row["ms"] / step_ms, rel=0.05, abs=1e-3) for row in rows)
    assert {"matrix products", "optimiser"} <= set(kinds)
    assert ("compiled code" in kinds) == compile


def test_the_profile_section_runs_on_request_eager_and_compiled(tmp_path) -> None:
    out = tmp_path / "profile.json"
    result = subprocess.run(
        [sys.executable, "-m", "annotated_transformer", "bench", "--smoke", "--device", "cpu", "--threads", "1",
         "--only", "profile", "--compile", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert TABLES["profile"][0] in result.stdout.splitlines()
    rows = json.loads(out.read_text())["profile"]
    assert {row["compiled"] for row in rows} == {False, True}
    for compiled in (False, True):
        kinds = [row["kind"] for row in rows if row["compiled"] == compiled]
        assert kinds[-1] == "outside the operations" and ("compiled code" in kinds) == compiled


@pytest.mark.cuda
def test_step_profile_reads_a_gpus_kernels() -> None:
    from annotated_transformer.performance import step_profile
    rows = step_profile(dict(N=1, d_model=64, d_ff=128, h=4, vocab=500), 8, 16, 16, device="cuda",
                        dtype=torch.bfloat16, steps=2, warmup=1)
    shares = {row["kind"]: row["share"] for row in rows}
    assert rows[-1]["kind"] == "device idle" and shares["matrix products"] > 0 and shares["optimiser"] > 0
    assert sum(shares.values()) == pytest.approx(1, abs=0.05)


def test_steady_clock_is_the_cpu_clock_on_one_cpu_thread_only() -> None:
    from annotated_transformer.measure import steady_clock

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert steady_clock("cpu") == "cpu" and steady_clock(torch.device("cuda")) == "wall"
        torch.set_num_threads(2)
        assert steady_clock("cpu") == "wall"
    finally:
        torch.set_num_threads(threads)
