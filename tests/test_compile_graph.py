"""A training step's forward pass and loss compile to one graph: no graph break, no host sync.

``torch._dynamo.explain`` traces a call the way ``torch.compile`` does and reports how many graphs it made
and why it cut between them. A Python ``if`` on a tensor's value (``int(t.min())``, ``.tolist()``,
``.item()``) is such a cut, and it is also a host synchronisation on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from annotated_transformer.embeddings import Embeddings
from annotated_transformer.model import make_model
from annotated_transformer.trainer import LogProbs
from annotated_transformer.training import Batch, LabelSmoothing

pytestmark = pytest.mark.skipif(not hasattr(torch, "_dynamo"), reason="torch._dynamo is not available")

V, PAD = 37, 0


def explain(fn, *args):
    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(fn)(*args)
    finally:
        torch._dynamo.reset()


def padded_batch(generator: torch.Generator) -> Batch:
    """Three sentence pairs with padding on both sides (the masks are not all True)."""
    src = torch.randint(1, V, (3, 9), generator=generator)
    tgt = torch.randint(1, V, (3, 7), generator=generator)
    src[1, 6:], src[2, 4:] = PAD, PAD
    tgt[0, 5:], tgt[2, 3:] = PAD, PAD
    return Batch(src, tgt, PAD)


def describe(explanation) -> str:
    return "; ".join(reason.reason.splitlines()[0] for reason in explanation.break_reasons)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("N", [1, 2])
def test_the_forward_pass_of_a_training_step_is_one_graph(N, norm_first):
    torch.manual_seed(0)
    model = make_model(V, V, N=N, d_model=32, d_ff=64, h=4, norm_first=norm_first,
                       share_embeddings=N == 2).train()
    net = LogProbs(model)  # what the training loop calls: the model followed by its generator
    batch = padded_batch(torch.Generator().manual_seed(N))
    assert not batch.src_mask.all() and not batch.tgt_mask[:, -1].all()
    explanation = explain(net, batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    assert explanation.graph_break_count == 0, describe(explanation)
    assert explanation.graph_count == 1


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_loss_is_one_graph(smoothing):
    generator = torch.Generator().manual_seed(0)
    batch = padded_batch(generator)
    target = batch.tgt_y.reshape(-1)
    assert (target == PAD).any()
    log_probs = torch.randn(target.numel(), V, generator=generator).log_softmax(-1)
    explanation = explain(LabelSmoothing(V, PAD, smoothing), log_probs, target)
    assert explanation.graph_break_count == 0, describe(explanation)
    assert explanation.graph_count == 1


def test_the_eager_checks_still_refuse_bad_ids_on_the_cpu():
    """Skipping the checks while compiling did not switch them off in eager mode."""
    model = make_model(V, V, N=1, d_model=32, d_ff=64, h=4)
    batch = padded_batch(torch.Generator().manual_seed(0))
    bad = batch.src.clone()
    bad[0, 0] = V
    with pytest.raises(ValueError, match=f"vocab={V}"):
        LogProbs(model)(bad, batch.tgt, batch.src_mask, batch.tgt_mask)
    log_probs = torch.randn(batch.tgt_y.numel(), V).log_softmax(-1)
    with pytest.raises(ValueError, match=f"token id {V}; ids must lie in 0..{V - 1}"):
        LabelSmoothing(V, PAD, 0.1)(log_probs, torch.full((batch.tgt_y.numel(),), V))


class OldEmbeddings(Embeddings):
    """The check as it was before: it read the ids' range in every forward pass on the CPU."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.device.type == "cpu" and tokens.numel() > 0:
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.vocab:
                raise ValueError(f"token ids must lie in [0, {self.vocab - 1}], got {low}..{high}")
        return self.lut(tokens) * math.sqrt(self.d_model)


def test_explain_sees_the_graph_breaks_of_the_old_check():
    """The tests above can fail: the old check, put back into a model, cuts its graph."""
    torch.manual_seed(0)
    model = make_model(V, V, N=1, d_model=32, d_ff=64, h=4)
    for embed in (model.src_embed, model.tgt_embed):
        old = OldEmbeddings(32, V)
        old.lut = embed.embeddings.lut
        embed.embeddings = old
    batch = padded_batch(torch.Generator().manual_seed(0))
    explanation = explain(LogProbs(model), batch.src, batch.tgt, batch.src_mask, batch.tgt_mask)
    assert explanation.graph_break_count > 0 and explanation.graph_count > 1


def test_explain_sees_the_graph_break_of_a_host_read_in_a_loss():
    class SyncingLoss(nn.Module):
        def forward(self, log_probs, target):
            if int(target.max()) >= log_probs.size(1):  # a host read of a tensor's value
                raise ValueError("bad target")
            return -log_probs.gather(1, target.unsqueeze(1)).sum()

    explanation = explain(SyncingLoss(), torch.randn(4, V).log_softmax(-1), torch.tensor([1, 2, 3, 0]))
    assert explanation.graph_break_count > 0


def skip_unless_inductor_compiles():
    """Skip where torch.compile cannot build CPU code at all (no C++ compiler, say), tried on a function of no
    code of ours: a failure of our own code under compilation then fails the test instead of skipping it."""
    try:
        torch.compile(lambda x: x.sin() + 1)(torch.ones(3))
    except Exception as error:
        pytest.skip(f"torch.compile does not work here: {type(error).__name__}: {error}")
    finally:
        torch._dynamo.reset()


def test_compiled_code_still_stops_an_out_of_range_id_on_the_cpu():
    """Where the Python check stands aside (while compiling), the generated kernel's bounds check remains."""
    torch.manual_seed(0)
    embed = Embeddings(8, V)
    skip_unless_inductor_compiles()
    compiled = torch.compile(embed)
    good = compiled(torch.tensor([[1, V - 1]]))
    torch.testing.assert_close(good, embed(torch.tensor([[1, V - 1]])))
    with pytest.raises((RuntimeError, IndexError), match="out of (bounds|range)"):
        compiled(torch.tensor([[1, V]]))
    torch._dynamo.reset()


def test_the_compiled_loss_still_stops_an_out_of_range_target_on_the_cpu():
    skip_unless_inductor_compiles()
    crit = LabelSmoothing(V, PAD, 0.1)
    compiled = torch.compile(crit)
    log_probs = torch.randn(4, V).log_softmax(-1)
    good = compiled(log_probs, torch.tensor([1, 2, PAD, V - 1]))
    torch.testing.assert_close(good, crit(log_probs, torch.tensor([1, 2, PAD, V - 1])))
    with pytest.raises((RuntimeError, IndexError), match="out of (bounds|range)"):
        compiled(log_probs, torch.tensor([1, 2, PAD, V]))
    torch._dynamo.reset()
