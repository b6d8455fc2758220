"""The operator-level memory tool (book/measuring.md), the attention sweep's memory checks on CUDA
(book/performance.md), and the recorded GPU results in book/results/ (book/appendix_results.md,
book/performance.md, book/translation.md).

No notebook tool is needed here: the CUDA test runs on a plain GPU machine.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from annotated_transformer.attention import attention
from annotated_transformer.measure import largest_tensor_bytes
from annotated_transformer.performance import attention_sweep

RESULTS = Path(__file__).resolve().parent.parent / "book" / "results"


def test_largest_tensor_sees_inside_composite_functions() -> None:
    q, k, v = torch.randn(3, 2, 4, 96, 16).unbind(0)
    scores, output = 2 * 4 * 96 * 96 * 4, 2 * 4 * 96 * 16 * 4
    with torch.no_grad():
        assert largest_tensor_bytes(lambda: F.scaled_dot_product_attention(q, k, v)) == output
        with sdpa_kernel(SDPBackend.MATH):  # built from several operators: the scores are seen
            assert largest_tensor_bytes(lambda: F.scaled_dot_product_attention(q, k, v)) == scores
    # in place, views and out= arguments allocate nothing new
    x, buffer = torch.randn(64, 32), torch.empty(64, 32)
    assert largest_tensor_bytes(lambda: x.add_(1)) == 0
    assert largest_tensor_bytes(lambda: x.view(32, 64)) == 0
    assert largest_tensor_bytes(lambda: torch.mul(x, 2, out=buffer)) == 0
    assert largest_tensor_bytes(lambda: torch.mul(x, 2)) == 64 * 32 * 4
    # 16-bit inputs: the explicit path scores in float32, so its largest tensor is twice the bf16 scores
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    assert largest_tensor_bytes(lambda: attention(qb, kb, vb)) == 2 * 4 * 96 * 96 * 4


def test_sweep_rows_on_cpu_have_no_peak() -> None:
    (row,) = attention_sweep([32], batch=1, heads=2, d_k=8, repeat=1)
    assert row["explicit_largest_bytes"] == row["scores_bytes"] == 2 * 32 * 32 * 4
    assert row["explicit_peak_bytes"] is None and row["fused_peak_bytes"] is None


@pytest.mark.cuda
def test_cuda_sweep_memory_is_what_the_performance_chapter_checks() -> None:
    for n in (64, 512):
        (row,) = attention_sweep([n], batch=1, heads=8, d_k=64, device="cuda", dtype=torch.bfloat16,
                                 repeat=1)
        entries = 8 * n * n
        output = 8 * n * 64 * 2
        assert row["scores_bytes"] == entries * 2
        assert row["explicit_largest_bytes"] == entries * 4  # float32 scores of bf16 inputs
        assert row["fused_largest_bytes"] == output
        assert row["explicit_peak_bytes"] >= 2 * row["explicit_largest_bytes"]
        assert row["fused_peak_bytes"] < 2 * output


def test_gpu_records_say_how_they_were_made() -> None:
    bench = json.loads((RESULTS / "bench_gpu.json").read_text(encoding="utf-8"))
    meta = bench["meta"]
    assert meta["device"] == "cuda" and meta["device_name"].startswith("cuda (NVIDIA H100")
    assert meta["command"].endswith("--device cuda --json book/results/bench_gpu.json")
    for row in bench["attention"]:  # bf16 inputs: float32 scores, twice the bf16 score matrix
        assert row["explicit_largest_bytes"] == 2 * row["scores_bytes"]
        assert row["explicit_peak_bytes"] >= 2 * row["explicit_largest_bytes"]
        assert row["fused_peak_bytes"] < 2 * row["fused_largest_bytes"]
    full = json.loads((RESULTS / "multi30k-full.json").read_text(encoding="utf-8"))
    arguments = shlex.split(full["command"])
    assert arguments[arguments.index("--profile") + 1] == full["profile"] == "full"
    assert arguments[arguments.index("--results") + 1] == "book/results/multi30k-full.json"
    assert full["device"].startswith("cuda (NVIDIA H100") and full["test"]["beam"]["sentences"] == 1000
    seed1 = json.loads((RESULTS / "full-seed1.json").read_text(encoding="utf-8"))
    assert seed1["changed"] == ["seed"] and {**seed1["config"], "seed": 0} == full["config"]
    assert Path(shlex.split(seed1["command"])[-1]).name == "full-seed1.json"
