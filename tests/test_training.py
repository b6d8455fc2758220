"""Tests of annotated_transformer.training, .trainer and .checkpoints: batches, label smoothing, the schedule,
checkpoints (atomic, exact resume, averaging), the copy task and the `train` command."""
from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from annotated_transformer import checkpoints, folders, trainer
from annotated_transformer.checkpoints import (
    average_checkpoints, load_checkpoint, model_from_checkpoint, save_checkpoint,
)
from annotated_transformer.folders import latest_checkpoint, list_checkpoints
from annotated_transformer.cli import main
from annotated_transformer.decoding import copy_accuracy, greedy_decode
from annotated_transformer.masks import padding_mask, subsequent_mask
from annotated_transformer.model import make_model
from annotated_transformer.copy_task import CopyConfig, copy_batches, copy_config, train_copy_task
from annotated_transformer.trainer import train
from annotated_transformer.training import (
    Batch,
    LabelSmoothing,
    make_optimizer,
    make_scheduler,
    padding_fraction,
    rate,
    token_batches,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(src_vocab=11, tgt_vocab=11, N=1, d_model=16, d_ff=32, h=2)


def tiny_model(seed=0, dropout=0.0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    return make_model(**{**TINY, "dropout": dropout, **overrides}).to(dtype)


def padded_batches(n, batch_size=6, length=7, vocab=11, seed=0):
    """Batches whose rows end in different amounts of padding, so micro-batches hold different token counts."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randint(2, vocab, (batch_size, length), generator=generator)
        data[:, 0] = 1
        for row in range(batch_size):
            keep = int(torch.randint(2, length + 1, (1,), generator=generator))
            data[row, keep:] = 0
        out.append(Batch(data, data.clone(), pad=0))
    return out


def concatenate(batches):
    return Batch(torch.cat([b.src for b in batches]), torch.cat([torch.cat([b.tgt, b.tgt_y[:, -1:]], 1)
                                                                for b in batches]), pad=0)


# Batches ----------------------------------------------------------------------------------------------------

def test_batch_shifts_target_and_builds_masks():
    src = torch.tensor([[1, 5, 6, 0], [1, 7, 0, 0]])
    tgt = torch.tensor([[1, 8, 9, 2, 0], [1, 3, 2, 0, 0]])
    batch = Batch(src, tgt, pad=0)
    assert torch.equal(batch.tgt, tgt[:, :-1]) and torch.equal(batch.tgt_y, tgt[:, 1:])
    assert batch.src_mask.shape == (2, 1, 4) and batch.src_mask.dtype == torch.bool
    assert torch.equal(batch.src_mask[:, 0], src != 0)
    assert batch.tgt_mask.shape == (2, 4, 4)
    expected = (batch.tgt != 0).unsqueeze(1) & subsequent_mask(4)
    assert torch.equal(batch.tgt_mask, expected)
    assert batch.ntokens == 3 + 2
    only_source = Batch(src)
    assert only_source.tgt is None and only_source.ntokens == 0


def test_batch_select_and_bad_input():
    batch = padded_batches(1)[0]
    part = batch.select(slice(1, 3))
    assert torch.equal(part.src, batch.src[1:3]) and torch.equal(part.tgt_mask, batch.tgt_mask[1:3])
    assert part.ntokens == int((batch.tgt_y[1:3] != 0).sum())
    with pytest.raises(ValueError, match="src"):
        Batch(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="tgt"):
        Batch(torch.ones(2, 3, dtype=torch.long), torch.ones(3, 3, dtype=torch.long))


def test_token_batches_cover_every_example_within_budget():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 60, (500,), generator=generator).tolist()
    for bucket in (True, False):
        batches = token_batches(lengths, 400, bucket=bucket, generator=generator)
        assert sorted(i for b in batches for i in b) == list(range(500))
        assert all(len(b) * max(lengths[i] for i in b) <= 400 for b in batches)
    bucketed = padding_fraction(lengths, token_batches(lengths, 400, generator=generator))
    shuffled = padding_fraction(lengths, token_batches(lengths, 400, bucket=False, generator=generator))
    assert bucketed < 0.05 < 0.3 < shuffled


def test_token_batches_pairs_and_errors():
    pairs = [(3, 9), (4, 4), (9, 2), (5, 5)]
    batches = token_batches(pairs, 10, shuffle=False)
    for b in batches:
        assert len(b) * max(pairs[i][0] for i in b) <= 10 and len(b) * max(pairs[i][1] for i in b) <= 10
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="example 1"):
        token_batches([3, 11], 10)
    with pytest.raises(ValueError, match="max_tokens"):
        token_batches([3], 0)


def test_padding_fraction_by_hand():
    # Batches {0, 1} (lengths 2 and 4: 8 padded, 6 real) and {2} (length 3: no padding).
    assert padding_fraction([2, 4, 3], [[0, 1], [2]]) == 1 - 9 / 11


def test_shard_rows_split_a_batch_between_processes():
    for n, world in ((6, 2), (7, 3), (2, 2)):
        shards = [trainer.shard_rows(n, rank, world) for rank in range(world)]
        rows = [i for shard in shards for i in range(n)[shard]]
        assert rows == list(range(n))
        assert max(s.stop - s.start for s in shards) - min(s.stop - s.start for s in shards) <= 1


# Label smoothing --------------------------------------------------------------------------------------------

def smoothed(target, size, pad, eps):
    q = torch.full((len(target), size), eps / (size - 2), dtype=torch.float64)
    q[torch.arange(len(target)), target] = 1 - eps
    q[:, pad] = 0
    q[target == pad] = 0
    return q


def test_label_smoothing_is_kl_to_the_smoothed_distribution():
    torch.manual_seed(0)
    V, pad, eps = 7, 0, 0.2
    log_probs = torch.randn(9, V, dtype=torch.float64).log_softmax(-1)
    target = torch.tensor([1, 2, 0, 6, 3, 0, 5, 4, 2])
    q = smoothed(target, V, pad, eps)
    assert torch.allclose(LabelSmoothing(V, pad, eps).target_distribution(target, torch.float64), q)
    expected = F.kl_div(log_probs, q, reduction="sum")  # no -inf here, so PyTorch's own KL is finite
    assert torch.allclose(LabelSmoothing(V, pad, eps)(log_probs, target), expected, atol=1e-12)
    rows = target != pad
    assert torch.allclose(q[rows].sum(1), torch.ones(int(rows.sum()), dtype=torch.float64))
    assert q[~rows].abs().sum() == 0 and q[:, pad].abs().sum() == 0


def test_label_smoothing_without_smoothing_is_nll():
    torch.manual_seed(1)
    log_probs = torch.randn(6, 5, dtype=torch.float64).log_softmax(-1)
    target = torch.tensor([1, 0, 4, 2, 0, 3])
    expected = F.nll_loss(log_probs, target, ignore_index=0, reduction="sum")
    assert torch.allclose(LabelSmoothing(5, 0, 0.0)(log_probs, target), expected, atol=1e-12)


def test_label_smoothing_is_finite_where_the_2022_demo_was_not():
    # The 2022 demo: predictions with probability 0 on the padding column, passed through .log().
    crit = LabelSmoothing(5, 0, 0.1)
    for x in range(1, 100):
        d = x + 3
        predict = torch.tensor([[0, x / d, 1 / d, 1 / d, 1 / d]], requires_grad=True)
        loss = crit(predict.log(), torch.tensor([1]))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(predict.grad[:, 1:]).all()
    old = torch.nn.KLDivLoss(reduction="sum")(predict.log(), crit.target_distribution(torch.tensor([1])))
    assert not torch.isfinite(old)  # what the 2022 code computed


def test_label_smoothing_versus_cross_entropy_label_smoothing():
    torch.manual_seed(2)
    V, pad, eps = 8, 0, 0.1
    logits = torch.randn(10, V, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, V, (10,))
    ours = LabelSmoothing(V, pad, eps)(logits.log_softmax(-1), target)
    (ours_grad,) = torch.autograd.grad(ours, logits)
    theirs = F.cross_entropy(logits, target, label_smoothing=eps, reduction="sum", ignore_index=pad)
    (theirs_grad,) = torch.autograd.grad(theirs, logits)
    p = logits.detach().softmax(-1)
    q = smoothed(target, V, pad, eps)
    q_uniform = (1 - eps) * F.one_hot(target, V).double() + eps / V  # PyTorch's: all V classes, padding too
    # Each is the cross-entropy against its target distribution; ours subtracts that distribution's entropy.
    entropy = -torch.xlogy(q, q).sum()
    assert torch.allclose(ours + entropy, -(q * logits.log_softmax(-1)).sum())
    assert torch.allclose(theirs, -(q_uniform * logits.log_softmax(-1)).sum())
    # Gradients with respect to the logits are p - target distribution: different targets.
    assert torch.allclose(ours_grad, p - q) and torch.allclose(theirs_grad, p - q_uniform)
    assert (ours_grad - theirs_grad).abs().max() > 1e-3


def test_label_smoothing_bad_arguments():
    with pytest.raises(ValueError, match="size"):
        LabelSmoothing(2, 0, 0.1)
    with pytest.raises(ValueError, match="padding_idx"):
        LabelSmoothing(5, 5, 0.1)
    with pytest.raises(ValueError, match="smoothing"):
        LabelSmoothing(5, 0, 1.0)
    with pytest.raises(ValueError, match=r"log_probs must have shape \(N, 5\)"):
        LabelSmoothing(5, 0, 0.1)(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="target"):
        LabelSmoothing(5, 0, 0.1)(torch.zeros(3, 5), torch.zeros(2, dtype=torch.long))



@pytest.mark.parametrize("target, message", [
    (torch.tensor([1, 5, 0]), r"target holds token id 5; ids must lie in 0\.\.4 \(size 5, padding id 0"),
    (torch.tensor([1, -2, 0]), r"target holds token id -2; ids must lie in 0\.\.4"),
])
def test_label_smoothing_refuses_out_of_range_target_ids(target, message):
    crit = LabelSmoothing(5, 0, 0.1)
    log_probs = torch.randn(3, 5).log_softmax(-1)
    with pytest.raises(ValueError, match=message):
        crit(log_probs, target)
    with pytest.raises(ValueError, match=message):
        crit.target_distribution(target)


@pytest.mark.parametrize("target, kind", [(torch.tensor([1.0, 2.0, 0.0]), "dtype torch.float32"),
                                          (torch.tensor([True, False, True]), "dtype torch.bool"),
                                          ([1, 2, 0], "list")])
def test_label_smoothing_refuses_targets_that_are_not_integer_ids(target, kind):
    with pytest.raises(TypeError, match=f"target must be a tensor of integer token ids, got {kind}"):
        LabelSmoothing(5, 0, 0.1)(torch.randn(3, 5).log_softmax(-1), target)


@pytest.mark.parametrize("scores, error, message", [
    (torch.randn(3, 5).softmax(-1), ValueError, r"log_probs holds 0\.\d+ > 0: the loss takes log-probabilities"),
    (torch.tensor([[2.0, -1, 0, 0, 0]] * 3), ValueError, r"log_probs holds 2 > 0: .*not probabilities or logits"),
    (torch.zeros(3, 5, dtype=torch.long), TypeError, "log_probs must be a floating-point tensor, got dtype torch.int64"),
    ([[0.0] * 5] * 3, TypeError, "log_probs must be a floating-point tensor, got list"),
])
def test_label_smoothing_refuses_what_cannot_be_log_probabilities(scores, error, message):
    # probabilities and logits gave a finite, wrong loss; integers even trained (their gather works)
    with pytest.raises(error, match=message):
        LabelSmoothing(5, 0, 0.1)(scores, torch.tensor([1, 2, 0]))
    log_probs = torch.tensor([[0.0, -math.inf, -math.inf, -math.inf, -math.inf]] * 3)
    assert LabelSmoothing(5, 0, 0.0)(log_probs, torch.tensor([0, 0, 0])).item() == 0  # 0 itself is a log-probability


def test_label_smoothing_accepts_padding_and_any_integer_dtype():
    crit = LabelSmoothing(5, 0, 0.1)
    log_probs = torch.randn(4, 5, dtype=torch.float64).log_softmax(-1)
    target = torch.tensor([0, 4, 1, 0])                    # padding (0) and the last id (4) are both in range
    expected = crit(log_probs, target)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        torch.testing.assert_close(crit(log_probs, target.to(dtype)), expected)
    assert crit(log_probs[:0], target[:0]).item() == 0     # an empty batch needs no check

# The schedule -----------------------------------------------------------------------------------------------

def test_rate_matches_the_formula_and_peaks_at_warmup():
    for d, warmup in ((512, 4000), (256, 4000), (512, 8000)):
        steps = range(1, 3 * warmup)
        rates = [rate(s, d, 1.0, warmup) for s in steps]
        for s in (1, 10, warmup // 2, warmup, 2 * warmup):
            assert math.isclose(rate(s, d, 2.0, warmup), 2.0 * d ** -0.5 * min(s ** -0.5, s * warmup ** -1.5))
        assert max(range(len(rates)), key=rates.__getitem__) + 1 == warmup
        assert math.isclose(max(rates), (d * warmup) ** -0.5)
    assert rate(0, 512, 1.0, 4000) == rate(1, 512, 1.0, 4000)
    with pytest.raises(ValueError, match="step"):
        rate(-1, 512, 1.0, 4000)
    with pytest.raises(ValueError, match="warmup"):
        rate(1, 512, 1.0, 0)


def test_a_linear_decay_falls_from_the_same_peak_to_zero_after_the_last_step():
    d, warmup, total = 256, 40, 200
    for s in (1, 10, warmup):  # the warm-up is equation (3)'s
        assert rate(s, d, 0.5, warmup, total=total) == rate(s, d, 0.5, warmup)
    line = [rate(s, d, 0.5, warmup, total=total) for s in range(warmup, total + 2)]
    assert all(b < a for a, b in zip(line, line[1:]))  # falling at every step
    steps = [b - a for a, b in zip(line, line[1:])]
    assert max(steps) == pytest.approx(min(steps))  # by the same amount: a line
    assert line[-2] == pytest.approx(line[0] / (total + 1 - warmup)) and line[-2] > 0
    assert line[-1] == 0.0 == rate(total + 50, d, 0.5, warmup, total=total)
    with pytest.raises(ValueError, match=r"total \(40\) must be above warmup \(40\)"):
        rate(1, d, 0.5, warmup, total=warmup)
    with pytest.raises(ValueError, match="must be above warmup"):
        make_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), d,
                       warmup=warmup, total=warmup - 1)


def test_fused_adam_is_adam():
    results = []
    for fused in (True, False):
        model = tiny_model(seed=4)
        optimizer = make_optimizer(model) if fused else torch.optim.Adam(model.parameters(), lr=1.0,
                                                                         betas=(0.9, 0.98), eps=1e-9)
        assert optimizer.defaults["fused"] is (True if fused else None)
        scheduler = make_scheduler(optimizer, 16, warmup=2)
        train(model, padded_batches(3), steps=3, optimizer=optimizer, scheduler=scheduler,
              loss_fn=LabelSmoothing(11, 0, 0.1), progress=False)
        results.append(model.state_dict())
    for key, value in results[0].items():
        if key.endswith("w_k.bias"):
            # Softmax ignores a shift shared by all keys, so these gradients are zero up to rounding noise,
            # which Adam's division by the gradient's own size turns into arbitrary full-size steps.
            continue
        assert torch.allclose(value, results[1][key], atol=1e-5), key
    groups = make_optimizer([{"params": [torch.nn.Parameter(torch.zeros(2))]}])  # parameter groups work too
    assert groups.defaults["betas"] == (0.9, 0.98)


def test_label_smoothing_closed_form_equals_the_matrix_form():
    torch.manual_seed(3)
    for size, pad, eps in ((7, 0, 0.1), (9, 4, 0.3), (50, 49, 0.0), (12, 0, 0.9)):
        log_probs = torch.randn(20, size, dtype=torch.float64).log_softmax(-1)
        target = torch.randint(0, size, (20,))
        crit = LabelSmoothing(size, pad, eps)
        q = crit.target_distribution(target, torch.float64)
        dense = (torch.xlogy(q, q) - q * log_probs.masked_fill(q == 0, 0.0)).sum()
        torch.testing.assert_close(crit(log_probs, target), dense)
    # a zero probability on the label: the loss is infinite (not nan) with smoothing as without
    log_probs = torch.randn(3, 7).log_softmax(-1)
    log_probs[0, 2] = -math.inf
    for eps in (0.0, 0.1):
        assert LabelSmoothing(7, 0, eps)(log_probs, torch.tensor([2, 3, 0])).item() == math.inf


def test_a_compiled_run_compiles_each_function_twice_and_once_more_for_a_batch_of_one(monkeypatch):
    """The trainer chapter's claim: the first shape compiles as it is, the second compiles one graph with symbolic
    sizes that serves every later shape (eight shapes here, hundreds in a translation run), except a batch of one
    sentence: a size of 1 is never a symbol, so the first such batch compiles once more, for all batches of one.
    Three graphs for the model, three for the loss. A backend that only counts the graphs stands in for inductor."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, backend=backend, **options))
    torch._dynamo.reset()
    shapes = [(6, 7), (4, 9), (8, 5), (3, 11), (5, 6), (7, 8)]
    batches = [padded_batches(1, batch_size=b, length=t, seed=i)[0] for i, (b, t) in enumerate(shapes)]
    model = tiny_model(seed=6)

    def run(batches):
        return train(model, batches, steps=len(batches), optimizer=make_optimizer(model),
                     loss_fn=LabelSmoothing(11, 0, 0.1), compile=True, progress=False)

    try:
        assert len({tuple(batch.src.shape) for batch in batches}) == 6
        history = run(batches)
        assert len(graphs) == 4, [graph.graph for graph in graphs]
        assert len(history["seconds"]) == 6 and history["seconds"] == sorted(history["seconds"])
        ones = [padded_batches(1, batch_size=1, length=t, seed=9 + t)[0] for t in (9, 6)]
        run(batches[:1] + ones)  # the code compiled for the shapes above is kept
        assert len(graphs) == 6, [graph.graph for graph in graphs[4:]]  # one more each, for both batches of one
    finally:
        torch._dynamo.reset()


def test_a_compiled_run_on_a_cpu_draws_the_dropout_masks_of_an_eager_run(monkeypatch):
    """The trainer chapter's claim: in compile_settings, compiled dropout on a CPU draws its masks with PyTorch's own
    kernels, so a compiled run with dropout follows the eager run from the same seed; with the compiler's own random
    numbers (compile_settings replaced by a context that changes nothing) the losses part at the first step."""

    def losses(compile):
        torch._dynamo.reset()
        model = tiny_model(seed=7, dropout=0.3)
        torch.manual_seed(8)
        history = train(model, padded_batches(3, seed=4), steps=3, optimizer=make_optimizer(model),
                        loss_fn=LabelSmoothing(11, 0, 0.1), compile=compile, progress=False)
        torch._dynamo.reset()
        return torch.tensor(history["loss"])

    eager = losses(False)
    torch.testing.assert_close(losses(True), eager, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(trainer, "compile_settings", lambda device: contextlib.nullcontext())
    assert (losses(True) - eager).abs()[0] > 1e-3


def test_a_nan_gradient_behind_a_finite_loss_stops_the_run_without_clipping(tmp_path):
    """The trainer chapter's claim: the gradient norm is checked at every step, with or without clip_norm, so a
    NaN gradient whose loss is finite stops the run before its update, and no checkpoint of it is written."""

    class NanGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * float("nan")

    smoothing, calls = LabelSmoothing(11, 0, 0.1), []

    def loss_fn(log_probs, labels):
        calls.append(1)
        loss = smoothing(log_probs, labels)
        return NanGradient.apply(loss) if len(calls) == 3 else loss  # step 3: finite loss, nan gradient

    model = tiny_model(seed=9)
    with pytest.raises(trainer.NonFiniteLossError, match="step 3: the gradient norm is nan"):
        train(model, padded_batches(6), steps=6, optimizer=make_optimizer(model), loss_fn=loss_fn,
              checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)
    assert [path.name for path in folders.list_checkpoints(tmp_path)] == ["step_00000001.pt", "step_00000002.pt"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_each_step_reads_the_device_once(monkeypatch):
    """The trainer chapter's claim: the loop reads the loss, the cross-entropy and the gradient norm together, in
    one transfer a step (a wait for a GPU). Counts every way a tensor's value reaches Python from the trainer's
    code. (The checks of the ids in the embeddings and the loss read values only of tensors on a CPU.)"""
    import inspect

    reads = []
    for name in ("tolist", "item", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if inspect.stack(context=0)[1].filename == trainer.__file__:
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    model = tiny_model(seed=3)
    optimizer = make_optimizer(model)
    batches = padded_batches(4)
    reads.clear()
    train(model, batches, steps=5, optimizer=optimizer, loss_fn=LabelSmoothing(11, 0, 0.1), progress=False)
    assert reads == ["tolist"] * 5, reads


def test_an_error_making_a_batch_comes_at_its_step_after_the_step_before_is_saved(tmp_path):
    """The loop makes step k+1's batches during step k; a batch function that fails for step 3 still lets
    step 2 finish and be saved, and the error is the function's own."""
    batches = padded_batches(4)

    def get_batch(index):
        if index == 2:  # step 3's batch
            raise RuntimeError("no batch 2")
        return batches[index]

    model = tiny_model(seed=4)
    with pytest.raises(RuntimeError, match="no batch 2"):
        train(model, get_batch, steps=4, optimizer=make_optimizer(model), loss_fn=LabelSmoothing(11, 0, 0.1),
              checkpoint_dir=tmp_path, checkpoint_every=2, progress=False)
    assert [path.name for path in folders.list_checkpoints(tmp_path)] == ["step_00000002.pt"]


def test_the_norm_without_clipping_leaves_the_gradients_as_they_are():
    model = tiny_model(seed=6)
    batch = padded_batches(1)[0]
    loss = LabelSmoothing(11, 0, 0.1)(model.generator(model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask))
                                      .reshape(-1, 11), batch.tgt_y.reshape(-1))
    loss.backward()
    before = [p.grad.clone() for p in model.parameters()]
    precision = trainer.choose_precision(torch.device("cpu"), None)
    norm = trainer.gradient_norm(model, None, precision)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before]))
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)
    clipped = trainer.gradient_norm(model, 1e-3, precision)
    assert float(clipped) == pytest.approx(float(expected), rel=1e-6)
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert float(after) == pytest.approx(1e-3, rel=1e-3)


def test_train_advances_a_callers_progress_bar_and_records_cross_entropy():
    import io

    from tqdm import tqdm

    model = tiny_model(seed=5)
    optimizer = make_optimizer(model)
    bar = tqdm(total=6, file=io.StringIO(), mininterval=0)
    kwargs = dict(optimizer=optimizer, loss_fn=LabelSmoothing(11, 0, 0.0), progress=bar)
    history = train(model, padded_batches(6), steps=3, **kwargs)
    assert bar.n == 3
    train(model, padded_batches(6), steps=3, **kwargs)
    assert bar.n == 6 and not bar.disable      # the same bar, advanced by both calls and left open
    bar.close()
    # without smoothing the loss is the cross-entropy of the labels, which `nll` records whatever the loss
    assert history["nll"] == pytest.approx(history["loss"], rel=1e-5)


def test_scheduler_gives_rate_k_to_the_kth_step():
    model = torch.nn.Linear(2, 2)
    optimizer = make_optimizer(model)
    assert optimizer.defaults["betas"] == (0.9, 0.98) and optimizer.defaults["eps"] == 1e-9
    scheduler = make_scheduler(optimizer, 64, factor=2.0, warmup=10)
    for k in range(1, 30):
        assert math.isclose(optimizer.param_groups[0]["lr"], rate(k, 64, 2.0, 10))
        optimizer.step()
        scheduler.step()
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, 64, factor=2.0, warmup=10, total=29)
    for k in range(1, 31):
        assert math.isclose(optimizer.param_groups[0]["lr"], rate(k, 64, 2.0, 10, total=29))
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.0  # after the 29 steps and one more


# Gradient accumulation --------------------------------------------------------------------------------------

def test_accumulation_equals_one_large_batch():
    micro = padded_batches(6, batch_size=4)
    assert len({b.ntokens for b in micro}) > 1  # micro-batches of different sizes: tokens must be counted
    big = [concatenate(micro[0:3]), concatenate(micro[3:6])]
    results = []
    for batches, k in ((micro, 3), (big, 1)):
        model = tiny_model(dtype=torch.float64)
        # Plain SGD: the update is the gradient times the rate, so equal updates mean equal gradients. (Adam
        # divides by the gradient's size, which blows rounding noise in gradients that are zero in theory,
        # such as those of the attention's key biases, up to full-size steps.)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = make_scheduler(optimizer, 16, warmup=4)
        history = train(model, batches, steps=2, optimizer=optimizer, scheduler=scheduler,
                        loss_fn=LabelSmoothing(11, 0, 0.1), accumulation_steps=k, progress=False)
        assert scheduler.last_epoch == 2  # stepped once per optimiser step, not per micro-batch
        results.append((model.state_dict(), history))
    (state_a, history_a), (state_b, history_b) = results
    for key in state_a:
        assert torch.allclose(state_a[key], state_b[key], rtol=0, atol=1e-12), key
    assert history_a["tokens"] == history_b["tokens"]
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(history_a["loss"], history_b["loss"]))


def test_train_rejects_bad_arguments(tmp_path):
    model = tiny_model()
    optimizer = make_optimizer(model)
    kwargs = dict(optimizer=optimizer, loss_fn=LabelSmoothing(11, 0, 0.0), progress=False)
    with pytest.raises(ValueError, match="accumulation_steps"):
        train(model, padded_batches(1), steps=1, accumulation_steps=0, **kwargs)
    with pytest.raises(ValueError, match="steps"):
        train(model, padded_batches(1), steps=-1, **kwargs)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(model, padded_batches(1), steps=1, checkpoint_dir=tmp_path, resume=True, **kwargs)
    for bad in (-1.0, float("nan"), True, "60"):
        with pytest.raises(ValueError, match=r"time_limit must be seconds >= 0 or None, got "):
            train(model, padded_batches(1), steps=1, time_limit=bad, **kwargs)


# Checkpoints ------------------------------------------------------------------------------------------------

def copy_data(seed=0, batch_size=8, seq_len=6):
    def batch(index):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return next(copy_batches(11, batch_size, seq_len, 1, generator=generator))
    return batch


def run(steps, checkpoint_dir=None, resume=False, crash_at=None, seed=0, time_limit=None, evaluate=None,
        sleep=0.0):
    model = tiny_model(seed=seed, dropout=0.1)  # dropout: the random number generators must be restored too
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, 16, warmup=3)
    data = copy_data()

    def batches(index):
        if crash_at is not None and index == crash_at:
            raise KeyboardInterrupt("simulated crash")
        time.sleep(sleep)
        return data(index)

    history = train(model, batches, steps=steps, optimizer=optimizer, scheduler=scheduler,
                    loss_fn=LabelSmoothing(11, 0, 0.1), accumulation_steps=2, checkpoint_dir=checkpoint_dir,
                    checkpoint_every=2, resume=resume, progress=False, time_limit=time_limit,
                    evaluate=evaluate, eval_every=2)
    return model, history


def test_a_time_limit_ends_the_run_at_the_step_that_reaches_it(tmp_path):
    evaluated = []
    torch.manual_seed(123)
    # each step makes its two micro-batches, each after a sleep of 0.06 s: the third step reaches 0.25 s at the latest
    limited, history = run(6, tmp_path, time_limit=0.25, evaluate=evaluated.append, sleep=0.06)
    reached, seconds = history["step"][-1], history["seconds"]
    assert reached <= 3 and seconds[-1] >= 0.25 and all(s < 0.25 for s in seconds[:-1])
    assert evaluated == sorted({*[2][:reached // 2], reached})  # due every 2 steps, and at the last
    assert list_checkpoints(tmp_path)[-1].name == f"step_{reached:08d}.pt"  # saved, although not due
    torch.manual_seed(123)
    reference, _ = run(reached)
    for (name, a), b in zip(reference.state_dict().items(), limited.state_dict().values()):
        assert torch.equal(a, b), name  # the longer run cut short
    # resumed with its time spent, it takes no step; with more time, it goes on to the end
    _, spent = run(6, tmp_path, resume=True, time_limit=0.25)
    assert spent["step"] == history["step"]
    _, more = run(6, tmp_path, resume=True, time_limit=100.0)
    assert more["step"] == [1, 2, 3, 4, 5, 6]


def test_resume_after_a_crash_is_bit_for_bit(tmp_path):
    torch.manual_seed(123)
    reference, reference_history = run(6)
    torch.manual_seed(123)
    with pytest.raises(KeyboardInterrupt):
        run(6, tmp_path, crash_at=2 * 5)  # dies during step 6, after the checkpoints of steps 2 and 4
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002.pt", "step_00000004.pt"]
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
    before = load_checkpoint(latest_checkpoint(tmp_path))["extra"]["train_seconds"]
    assert before > 0
    torch.manual_seed(999)  # a different state: the checkpoint must restore everything that matters
    resumed, resumed_history = run(6, tmp_path, resume=True, seed=7)
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    seconds = resumed_history.pop("seconds"), reference_history.pop("seconds")
    assert resumed_history == reference_history                               # all but the clock
    assert all(len(s) == 6 and s == sorted(s) for s in seconds) and seconds[0][3] == before
    final = load_checkpoint(latest_checkpoint(tmp_path))
    assert final["step"] == 6 and final["extra"]["train_seconds"] > before  # counted on from the checkpoint


def test_resuming_a_history_saved_without_seconds_pads_it(tmp_path, monkeypatch):
    """A run saved before the history had its seconds resumes, with no value for the steps it had done."""
    run(4, tmp_path)
    real = trainer.resume_training

    def resume_without_seconds(*args, **kwargs):
        start, history, seconds = real(*args, **kwargs)
        del history["seconds"]
        return start, history, seconds

    monkeypatch.setattr(trainer, "resume_training", resume_without_seconds)
    _, history = run(6, tmp_path, resume=True)
    assert history["step"] == [1, 2, 3, 4, 5, 6] and history["seconds"][:4] == [None] * 4
    assert history["seconds"][4] < history["seconds"][5]


def test_checkpoint_contents_and_weights_only(tmp_path):
    model = tiny_model()
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, 16)
    path = save_checkpoint(tmp_path / "a.pt", model=model, optimizer=optimizer, scheduler=scheduler, step=3)
    checkpoint = load_checkpoint(path)
    assert checkpoint["step"] == 3 and checkpoint["config"] == model.config
    assert set(checkpoint["rng"][0]) >= {"python", "torch"}
    torch.save({"format": 1, "payload": Path("x")}, tmp_path / "evil.pt")  # an arbitrary object: refused
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        load_checkpoint(tmp_path / "evil.pt")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    model = tiny_model()
    path = save_checkpoint(tmp_path / "c.pt", model=model)
    before = path.read_bytes()

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, model=tiny_model(seed=1))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_model_from_checkpoint_and_other_configuration(tmp_path):
    model = tiny_model(seed=3).eval()
    path = save_checkpoint(tmp_path / "m.pt", model=model)
    rebuilt, checkpoint = model_from_checkpoint(path, device="cpu")
    assert not rebuilt.training and rebuilt.config == model.config
    src = torch.tensor([[1, 4, 5, 6]])
    batch = Batch(src, src.clone())
    with torch.no_grad():
        a = model(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
        b = rebuilt(batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    assert torch.equal(a, b)
    other = tiny_model(d_model=32, h=4)
    with pytest.raises(ValueError, match=r"d_model \(checkpoint 16, model 32\)"):
        checkpoints.load_model_state(other, checkpoint)
    optimizer = make_optimizer(other)
    run = save_checkpoint(tmp_path / "run.pt", model=model, optimizer=make_optimizer(model))  # one to resume
    with pytest.raises(ValueError, match=r"d_model \(checkpoint 16, model 32\), h \(checkpoint 2, model 4\)"):
        train(other, padded_batches(1), steps=1, optimizer=optimizer, loss_fn=LabelSmoothing(11, 0, 0.0),
              resume=run, progress=False)


def test_average_checkpoints(tmp_path):
    models = [tiny_model(seed=s) for s in range(3)]
    paths = [save_checkpoint(tmp_path / f"{s}.pt", model=m) for s, m in enumerate(models)]
    average = average_checkpoints(paths)
    for key, value in average.items():
        expected = sum(m.state_dict()[key].double() for m in models) / 3
        assert value.dtype == models[0].state_dict()[key].dtype
        assert torch.allclose(value.double(), expected, atol=1e-7), key
    model = tiny_model()
    model.load_state_dict(average)
    assert all(torch.equal(a, b) for a, b in zip(average_checkpoints(paths[:1]).values(),
                                                 models[0].state_dict().values()))
    odd = save_checkpoint(tmp_path / "odd.pt", model=tiny_model(d_model=32, h=4))
    with pytest.raises(ValueError, match="d_model"):
        average_checkpoints([paths[0], odd])
    with pytest.raises(ValueError, match="paths"):
        average_checkpoints([])


# The copy task ----------------------------------------------------------------------------------------------

def test_copy_batches():
    generator = torch.Generator().manual_seed(0)
    batches = list(copy_batches(11, 5, 8, 3, generator=generator))
    assert len(batches) == 3
    for batch in batches:
        assert torch.equal(batch.src[:, 1:], batch.tgt_y) and (batch.src[:, 0] == 1).all()
        assert batch.src[:, 1:].min() >= 2 and batch.src.max() <= 10 and batch.ntokens == 5 * 7
    with pytest.raises(ValueError, match="vocab"):
        next(copy_batches(2, 1, 3, 1))


def test_copy_decoding_starts_with_the_start_symbol():
    model = tiny_model().eval()
    src = torch.tensor([[1, 3, 4, 5], [1, 6, 7, 8]])
    out = greedy_decode(model, src, padding_mask(src, 0), src.size(1), 1)
    assert out.shape == (2, 4) and (out[:, 0] == 1).all()


@pytest.mark.parametrize("field, value, message", [
    ("factor", -1.0, "factor"), ("factor", float("nan"), "factor"), ("dropout", 1.5, "dropout"),
    ("d_model", 30, "divisible"), ("steps", 0, "steps"), ("clip_norm", -1.0, "clip_norm"), ("vocab", 2, "vocab"),
])
def test_copy_config_refuses_bad_settings(field, value, message):
    with pytest.raises(ValueError, match=message):
        CopyConfig(**{field: value})
    with pytest.raises(TypeError, match="unknown"):
        copy_config("quick", layers=2)
    assert copy_config("full", steps=5) == CopyConfig(N=2, d_model=512, d_ff=2048, h=8, steps=5, warmup=400)


def test_copy_task_loss_falls():
    # The full run (at least 99% exact match) is in the chapter; here only a few steps of a tiny model.
    model, history = train_copy_task(steps=40, d_model=16, d_ff=32, h=2, batch_size=32, warmup=10, factor=1.0,
                                     device="cpu", progress=False, profile="quick")
    assert len(history["loss"]) == 40 and not model.training
    assert sum(history["loss"][-5:]) / 5 < sum(history["loss"][:5]) / 5 - 0.2
    assert isinstance(copy_accuracy(model, vocab=11, seq_len=10, n=50), float)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bf16_autocast_trains_the_copy_task(device):
    """The GPU's training path (bfloat16 autocast, float32 weights), also run under the CPU's autocast."""
    torch.manual_seed(0)
    model = make_model(11, 11, N=1, d_model=32, d_ff=64, h=4, dropout=0.1).to(device)  # the quick copy model
    dtypes = set()
    model.generator.proj.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype))
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer, 32, factor=0.5, warmup=100)
    steps = 250 if device == "cpu" else 400  # the CPU's bfloat16 is emulated and slow; 250 steps suffice here
    history = train(model, copy_data(batch_size=128, seq_len=10), steps=steps, optimizer=optimizer,
                    scheduler=scheduler, loss_fn=LabelSmoothing(11, 0, 0.0), device=device,
                    amp=True, progress=False)
    assert dtypes == {torch.bfloat16}  # the forward pass ran under bfloat16 autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stayed float32
    assert history["loss"][-1] < 0.2
    assert copy_accuracy(model, vocab=11, seq_len=10) >= 0.99


# The command line -------------------------------------------------------------------------------------------

def test_train_command_and_resume(tmp_path, capsys):
    args = ["train", "--task", "copy", "--profile", "quick", "--steps", "3", "--d-model", "16", "--layers", "1",
            "--batch-size", "8", "--device", "cpu", "--checkpoint-dir", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    assert "copy exact-match" in capsys.readouterr().out
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 3
    args[args.index("--steps") + 1] = "5"
    assert main(args + ["--resume"]) == 0
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path))
    assert checkpoint["step"] == 5 and checkpoint["extra"]["history"]["step"] == [1, 2, 3, 4, 5]
    assert main(["train", "--resume", "--steps", "1", "--no-progress"]) == 2  # --resume needs --checkpoint-dir


def test_train_help_documents_every_option():
    result = subprocess.run([sys.executable, "-m", "annotated_transformer", "train", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    from annotated_transformer.cli import build_parser
    parser = build_parser()
    train_parser = parser._subparsers._group_actions[0].choices["train"]
    for action in train_parser._actions:
        assert action.help, action.dest
        for option in action.option_strings:
            assert option in result.stdout, option


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_make_optimizer_uses_the_fused_kernel_on_the_cpu_and_matches_the_plain_loop(dtype):
    torch.manual_seed(0)
    model = make_model(23, 23, N=1, d_model=16, d_ff=32, h=2, share_embeddings=True).to(dtype)
    fused_params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    loop_params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    fused = make_optimizer(fused_params)
    loop = torch.optim.Adam(loop_params, lr=1.0, betas=(0.9, 0.98), eps=1e-9, foreach=False)
    if torch.__version__ >= (2, 4):  # PyTorch's fused Adam runs on the CPU from 2.4 on
        assert fused.defaults["fused"]
    assert not loop.defaults["fused"]
    for optimizer in (fused, loop):
        optimizer.param_groups[0]["lr"] = 1e-3
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(fused_params, loop_params):
            a.grad = torch.randn(a.shape, generator=generator, dtype=dtype)
            b.grad = a.grad.clone()
        fused.step()
        loop.step()
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    for a, b, start in zip(fused_params, loop_params, model.parameters()):
        assert not torch.equal(a, start)
        torch.testing.assert_close(a, b, atol=tolerance, rtol=0)


def test_a_clocked_run_s_progress_bar_counts_the_steps_its_clock_allows():
    """The bar's total for a run with a time limit: the steps its pace so far reaches in the limit, at most the
    run's steps, and the step it ends at; a run without a limit keeps its steps."""
    from annotated_transformer.trainer import clock_steps

    assert clock_steps(10, 2.0, None, 5000, last=False) is None  # no clock: the bar keeps its total
    assert clock_steps(10, 2.0, 60.0, 5000, last=False) == 300  # 10 steps in 2 s: 300 fit in the minute
    assert clock_steps(10, 0.002, 60.0, 5000, last=False) == 5000  # fast: the run's steps cap it
    assert clock_steps(10, 2.0, float("inf"), 5000, last=False) == 5000  # no end by the clock (no OverflowError)
    assert clock_steps(400, 60.0, 60.0, 5000, last=True) == 400  # the clock ended it: a full bar
    assert clock_steps(10, 0.0, 60.0, 5000, last=False) == 5000  # no pace yet
    assert clock_steps(299, 59.9, 60.0, 5000, last=False) == 300  # never below the steps done
