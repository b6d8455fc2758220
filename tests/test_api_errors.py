"""Bad input to the Python API gets a one-line error that names the problem, before any work, where it used to be
taken silently (a wrong result) or to fail late with an error that named something else."""
from __future__ import annotations

import random

import pytest

from annotated_transformer import bench
from annotated_transformer.bench import run_benchmarks
from annotated_transformer.data import SentencePieces, collate, encode_pairs, load_tokenizer, train_tokenizer
from annotated_transformer.records import thin
from annotated_transformer.translation import (
    TranslationConfig,
    bleu,
    bleu_bootstrap,
    load_translator,
    save_translator,
    translation_config,
    validation_loss,
)
from annotated_transformer.model import make_model
from annotated_transformer import evaluate_bleu, translate


def made_up_pairs(n=300, seed=0):
    words = ["Hund", "Katze", "läuft", "springt", "über", "die", "Wiese", "ein", "der", "rote", "Ball", "Mann"]
    rng = random.Random(seed)
    return [(" ".join(rng.choices(words, k=6)), " ".join(rng.choices(words, k=5)).lower()) for _ in range(n)]


def test_train_tokenizer_refuses_sentences_that_are_not_pairs(tmp_path):
    pairs = made_up_pairs()
    with pytest.raises(TypeError, match=r"pairs must be \(source, target\) pairs of str"):
        train_tokenizer([source for source, _ in pairs], vocab_size=40, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []  # no character-level tokenizer cached under the name of a real one


def test_the_translators_tokenizer_works_where_its_processor_does(tmp_path):
    pairs = made_up_pairs()
    processor = load_tokenizer(train_tokenizer(pairs, vocab_size=40, directory=tmp_path))
    tokenizer = SentencePieces(processor)
    assert encode_pairs(pairs[:3], tokenizer) == encode_pairs(pairs[:3], processor)
    with pytest.raises(TypeError, match=r"encode takes one sentence \(a str\), got list"):
        tokenizer.encode(["Ein Hund.", "Eine Katze."])  # its ids came back with one </s> among the lists
    model = make_model(processor.get_piece_size(), processor.get_piece_size(), N=1, d_model=16, d_ff=32, h=2)
    saved = [save_translator(tmp_path / f"{name}.pt", model, given)
             for name, given in (("wrapper", tokenizer), ("processor", processor))]
    loaded = [load_translator(path)[1] for path in saved]  # the same tokenizer either way
    assert [t.encode("Ein Hund läuft") for t in loaded] == [tokenizer.encode("Ein Hund läuft")] * 2
    examples = encode_pairs(pairs[:2], tokenizer)
    for multiple, error in [(0, ValueError), (-2, ValueError), (1.5, TypeError)]:
        with pytest.raises(error, match="multiple must be"):
            collate(examples, multiple=multiple)
    with pytest.raises(ValueError, match="a batch needs at least one example"):
        collate([])
    with pytest.raises(ValueError, match="examples is empty: there is no loss to measure"):
        validation_loss(model, [])  # max() of an empty sequence, or a division by zero
    # the bare processor encodes and decodes, but has no pad, start, end or max_len: an AttributeError had come
    # from deep inside the decoding, or (encode_pairs took it) from the middle of evaluate_bleu
    for call in (lambda: translate(model, processor, ["Ein Hund läuft"]),
                 lambda: evaluate_bleu(model, processor, pairs[:2])):
        with pytest.raises(TypeError, match=r"tokenizer must have pad, start, end, encode, decode and max_len \(a "
                                            r"Tokenizer\), got SentencePieceProcessor; wrap a SentencePiece model"):
            call()
    assert len(translate(model, tokenizer, ["Ein Hund läuft"], beam_size=1, max_len=3)) == 1


def test_bleu_and_its_bootstrap_refuse_what_they_would_miscount():
    sentence = "A dog runs across the green field."
    with pytest.raises(TypeError, match="lists of sentences, not a str"):
        bleu(sentence, sentence)  # scored 0.00 on its characters
    assert bleu([sentence], [sentence])[0].score == pytest.approx(100.0)
    pairs = [(f"s{i}", f"a dog runs number {i} .") for i in range(5)]
    outputs = {"greedy": [target for _, target in pairs]}
    with pytest.raises(ValueError, match="the baseline 'beam' is not one of the translations"):
        bleu_bootstrap(pairs, outputs, baseline="beam")
    for samples, error in [(0, ValueError), (-5, ValueError), (10.0, TypeError)]:  # 0 or less: sacreBLEU's 1,000
        with pytest.raises(error, match="samples must be"):
            bleu_bootstrap(pairs, outputs, baseline="greedy", samples=samples)
    with pytest.raises(ValueError, match="points must be a positive integer, got 0"):
        thin({"step": [1, 2], "loss": [1.0, 0.5]}, points=0)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(max_len=2), ValueError, "max_len must be at least 3, got 2"),
    (dict(vocab_size=5), ValueError, "vocab_size must be at least 8, got 5"),
    (dict(d_model=15, h=3), ValueError, "d_model must be even, got 15"),
    (dict(dropout="0.1"), ValueError, r"dropout must be a probability in \[0, 1\), got '0.1'"),
    (dict(dropout=False), ValueError, r"dropout must be a probability in \[0, 1\), got False"),
    (dict(length_penalty="0.6"), ValueError, r"length_penalty must lie in \[0, .*\], got '0.6'"),
    (dict(length_penalty=True), ValueError, r"length_penalty must lie in \[0, .*\], got True"),
])
def test_a_translation_config_refuses_what_the_run_would_refuse_later(overrides, error, match):
    with pytest.raises(error, match=match):
        translation_config("quick", **overrides)


def test_profile_names_are_checked_as_profile_names():
    assert translation_config("Laptop").profile == translation_config("LAPTOP").profile == "laptop"
    assert translation_config("QUICK").profile == "quick"
    with pytest.raises(ValueError, match="profile must be 'quick', 'laptop', 'full' or 'auto', got 'fast'"):
        translation_config("fast")
    assert isinstance(translation_config("quick"), TranslationConfig)


def test_the_benchmark_refuses_a_folder_as_its_record_and_empty_batches_before_it_runs(tmp_path, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("the benchmark ran although its arguments should have been refused")

    monkeypatch.setattr(bench, "run_benchmarks", no_run)
    with pytest.raises(ValueError, match="is a folder: name a file in it"):
        bench.run(smoke=True, device="cpu", sections=("layers",), json_path=tmp_path)
    with pytest.raises(ValueError, match="--threads must be from 1 to"):
        bench.run(smoke=True, device="cpu", sections=("layers",), threads=True)
    monkeypatch.undo()
    for sizes, error in [((0,), ValueError), ((-3,), ValueError), ((2.0,), TypeError)]:
        with pytest.raises(error, match="each of batch_sizes must be"):
            run_benchmarks("cpu", smoke=True, sections=("decoding",), batch_sizes=sizes)


# --- the library read as an adversarial user: arguments taken silently, or errors that named something else ---------

def test_train_and_batch_refuse_pairs_and_lists_in_one_line(tmp_path):
    """A list of (src, tgt) pairs, or a Batch of Python lists, stopped with AttributeError ('tuple' object has no
    attribute 'ntokens'; 'list' object has no attribute 'dim')."""
    import torch

    from annotated_transformer.trainer import train
    from annotated_transformer.training import Batch, LabelSmoothing, make_optimizer

    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    src, tgt = torch.randint(2, 11, (2, 5)), torch.randint(2, 11, (2, 6))
    common = dict(steps=1, optimizer=make_optimizer(model), loss_fn=LabelSmoothing(11, 0), progress=False)
    for batches in ([(src, tgt)], lambda index: (src, tgt)):
        with pytest.raises(TypeError, match=r"batches must give Batch objects \(Batch\(src, tgt\)\), got tuple"):
            train(model, batches, checkpoint_dir=tmp_path / "run", **common)
        assert list((tmp_path / "run").iterdir()) == []  # no checkpoint of a step that did not run
    for args, name in [(([[2, 3]], tgt), "src"), ((src, [[1, 2, 3], [1, 4, 3]]), "tgt")]:
        with pytest.raises(TypeError, match=f"{name} must be a tensor of token ids, got list: torch.tensor"):
            Batch(*args)
    assert len(train(model, [Batch(src, tgt)], **common)["loss"]) == 1


def test_train_refuses_what_it_would_miscount_and_warns_of_the_placeholder_rate(tmp_path):
    """A loss with another padding id was divided by tokens it never counted; a generator of batches stopped with
    "object of type 'generator' has no len()"; steps=True ran one step; a batch without a target was reported as
    "hold no target tokens"; no scheduler trained Adam at make_optimizer's placeholder rate of 1.0 without a word;
    label_accuracy of a batch without labels gave an AttributeError, or nan."""
    import warnings

    import torch

    from annotated_transformer.copy_task import copy_batches, label_accuracy
    from annotated_transformer.trainer import train
    from annotated_transformer.training import Batch, LabelSmoothing, make_optimizer, make_scheduler

    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    batches = list(copy_batches(11, 8, 5, 2, generator=torch.Generator().manual_seed(0)))
    optimizer = make_optimizer(model)
    common = dict(optimizer=optimizer, scheduler=make_scheduler(optimizer, 16, warmup=4), progress=False)
    with pytest.raises(ValueError, match=r"the loss's padding id \(3\) is not the batches' \(0\)"):
        train(model, batches, steps=1, loss_fn=LabelSmoothing(11, 3), **common)
    with pytest.raises(TypeError, match="batches must be a sequence of batches or a function of the index, got "
                                        r"generator: list\(...\) makes one"):
        train(model, copy_batches(11, 8, 5, 2), steps=1, loss_fn=LabelSmoothing(11, 0), **common)
    with pytest.raises(ValueError, match="steps must be a non-negative integer, got True"):
        train(model, batches, steps=True, loss_fn=LabelSmoothing(11, 0), **common)
    with pytest.raises(ValueError, match="a batch to train on needs a target"):
        train(model, [Batch(batches[0].src)], steps=1, loss_fn=LabelSmoothing(11, 0), **common)
    with pytest.warns(UserWarning, match=r"no scheduler: the optimizer's rate stays at 1\.0"):
        train(model, batches, steps=1, optimizer=make_optimizer(model), loss_fn=LabelSmoothing(11, 0), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a schedule, or a rate of one's own: no warning
        train(model, batches, steps=1, loss_fn=LabelSmoothing(11, 0), **common)
        own = torch.optim.Adam(model.parameters(), lr=1e-3)
        train(model, batches, steps=1, optimizer=own, loss_fn=LabelSmoothing(11, 0), progress=False)
    padding = batches[0].src.new_zeros(batches[0].src.shape)
    for batch in (Batch(batches[0].src), Batch(batches[0].src, torch.cat([padding[:, :1] + 1, padding], 1))):
        with pytest.raises(ValueError, match="label_accuracy needs a batch with labels"):
            label_accuracy(model, batch)
    assert 0 <= label_accuracy(model, batches[0]) <= 1


def test_train_refuses_an_optimizer_or_a_schedule_of_another_model():
    """The optimiser of another model trained nothing (a normal history, the weights unchanged); a schedule of another
    optimiser left the run at make_optimizer's placeholder rate of 1.0."""
    import torch

    from annotated_transformer.copy_task import copy_batches
    from annotated_transformer.trainer import train
    from annotated_transformer.training import LabelSmoothing, make_optimizer, make_scheduler

    model, other = (make_model(11, 11, N=1, d_model=16, d_ff=32, h=2) for _ in range(2))
    batches = list(copy_batches(11, 8, 5, 2, generator=torch.Generator().manual_seed(0)))
    common = dict(steps=2, loss_fn=LabelSmoothing(11, 0), progress=False)
    foreign = make_optimizer(other)
    with pytest.raises(ValueError, match="the optimizer does not hold all of the model's trainable parameters"):
        train(model, batches, optimizer=foreign, scheduler=make_scheduler(foreign, 16, warmup=10), **common)
    with pytest.raises(ValueError, match="the scheduler drives another optimizer"):
        train(model, batches, optimizer=make_optimizer(model), scheduler=make_scheduler(foreign, 16, warmup=10),
              **common)
    for parameter in model.encoder.parameters():  # frozen parameters need not be in the optimiser
        parameter.requires_grad_(False)
    trainable = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    assert len(train(model, batches, optimizer=trainable, **common)["loss"]) == 2


@pytest.mark.parametrize("args, kwargs, match", [
    ((10, 512), dict(factor=-1.0), "factor must be positive and finite, got -1.0"),
    ((10, 512), dict(factor=float("nan")), "factor must be positive and finite, got nan"),
    ((10, 512), dict(factor=float("inf")), "factor must be positive and finite, got inf"),
    ((float("nan"), 512), {}, "step must be >= 0, got nan"),
    ((10, float("nan")), {}, "model_size and warmup must be positive"),
])
def test_the_rate_refuses_numbers_that_would_train_silently_wrong(args, kwargs, match):
    """factor=-1 trained with negative rates (gradient ascent, the loss climbing from 2.6 to 6.2); NaN gave NaN rates."""
    import torch

    from annotated_transformer.training import make_optimizer, make_scheduler, rate

    with pytest.raises(ValueError, match=match):
        rate(*args, **kwargs)
    if args[0] == 10 and args[1] == 512:
        with pytest.raises(ValueError, match=match):
            make_scheduler(make_optimizer(torch.nn.Linear(2, 2)), 512, **kwargs)


def test_the_layers_refuse_a_norm_first_that_is_not_a_bool():
    """'False' is a true string: EncoderLayer(..., 'False') built a pre-norm layer, Encoder(..., norm_first='no') a
    final LayerNorm. make_model refused it already; the layers did not."""
    from annotated_transformer.attention import MultiHeadedAttention
    from annotated_transformer.encoder import Encoder, EncoderLayer
    from annotated_transformer.feed_forward import PositionwiseFeedForward
    from annotated_transformer.sublayers import SublayerConnection

    with pytest.raises(TypeError, match="norm_first must be True or False, got str 'False'"):
        SublayerConnection(16, 0.1, "False")
    with pytest.raises(TypeError, match="norm_first must be True or False, got str 'False'"):
        EncoderLayer(16, MultiHeadedAttention(2, 16, 0.0), PositionwiseFeedForward(16, 32, 0.0), 0.0, "False")
    layer = EncoderLayer(16, MultiHeadedAttention(2, 16, 0.0), PositionwiseFeedForward(16, 32, 0.0), 0.0, True)
    with pytest.raises(TypeError, match="norm_first must be True or False, got str 'no'"):
        Encoder(layer, 1, norm_first="no")


def test_a_bad_map_location_is_named_and_not_taken_for_damaged_checkpoints(tmp_path):
    """A wrong device for map_location was reported as 'truncated, damaged or not a PyTorch file', and through
    load_latest_checkpoint as 'none of the 2 checkpoint(s) is intact': a user could delete good checkpoints."""
    import torch

    from annotated_transformer.checkpoints import load_checkpoint, save_checkpoint
    from annotated_transformer.folders import load_latest_checkpoint

    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    for step in (1, 2):
        save_checkpoint(tmp_path / f"step_{step:08d}.pt", model=model, step=step)
    with pytest.raises(ValueError, match="must be a PyTorch device such as 'cpu'.*got 'gpu'"):
        load_checkpoint(tmp_path / "step_00000002.pt", map_location="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available on this machine"):
            load_latest_checkpoint(tmp_path, map_location="cuda")
    assert load_latest_checkpoint(tmp_path, map_location=torch.device("cpu"))[1]["step"] == 2


def test_save_checkpoint_refuses_what_load_checkpoint_would_refuse(tmp_path):
    """A config key that make_model does not know was written, and the file could never be loaded again; step=2.7 was
    stored as 2, and a string, a bool or a negative step were taken."""
    from annotated_transformer.checkpoints import CheckpointError, model_from_checkpoint, save_checkpoint

    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    with pytest.raises(ValueError, match="this checkpoint would not load again: .*make_model does not know.*: lr"):
        save_checkpoint(tmp_path / "a.pt", model=model, config={**model.config, "lr": 0.5})
    for step in (2.7, "7", True, -5):
        with pytest.raises(ValueError, match="step must be an integer >= 0"):
            save_checkpoint(tmp_path / "b.pt", model=model, step=step)
    assert not list(tmp_path.iterdir())  # nothing written
    partial = save_checkpoint(tmp_path / "c.pt", model=model, config={"N": 1})
    with pytest.raises(CheckpointError, match="c.pt: its model configuration does not make a model"):
        model_from_checkpoint(partial)


def test_average_checkpoints_refuses_tensors_of_other_shapes_or_dtypes(tmp_path):
    """Without a configuration to compare, a (4, 1) and a (1, 1) weight were broadcast into a 'mean'; other shapes failed
    inside PyTorch; the result took the last file's dtype."""
    import torch

    from annotated_transformer.checkpoints import average_checkpoints, save_checkpoint

    wide = save_checkpoint(tmp_path / "wide.pt", model=torch.nn.Linear(1, 4))
    narrow = save_checkpoint(tmp_path / "narrow.pt", model=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"narrow.pt: weight is torch.float32 of shape \(1, 1\), in .*wide.pt"):
        average_checkpoints([wide, narrow])
    half = save_checkpoint(tmp_path / "half.pt", model=torch.nn.Linear(1, 4).half())
    with pytest.raises(ValueError, match="half.pt: weight is torch.float16"):
        average_checkpoints([wide, half])


def test_arguments_that_went_unread_are_refused(tmp_path):
    """train_copy_task(config, profile=...) never read the profile; load_split(directory='') skipped the argument and
    the data variable, and downloaded."""
    from annotated_transformer.copy_task import CopyConfig, train_copy_task
    from annotated_transformer.data import load_split

    with pytest.raises(ValueError, match="give a config or a profile, not both"):
        train_copy_task(CopyConfig(steps=1), profile="no-such-profile", progress=False)
    with pytest.raises(ValueError, match="directory must name a folder, got ''"):
        load_split("valid", directory="")


@pytest.mark.parametrize("pairs", [[], [("", "")], [("  ", " ")] * 5])
def test_train_tokenizer_refuses_pairs_without_text(tmp_path, pairs):
    """Empty or blank sentences reached SentencePiece, whose RuntimeError ('INTERNAL: ... all_chars_count > 0') named no
    argument."""
    with pytest.raises(ValueError, match="train_tokenizer needs at least one sentence with text"):
        train_tokenizer(pairs, vocab_size=8, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("shapes, mask, match", [
    (((4,), (4,), (4,)), None, "query, key and value need 2 dimensions or more"),
    (((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3, 4)), None, "query and key must have one width d_k >= 1, got 4 and 5"),
    (((1, 3, 0), (1, 3, 0), (1, 3, 2)), None, "one width d_k >= 1, got 0 and 0"),
    (((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 7, 4)), None, "key and value must have one length S, got 3 and 7"),
    (((1, 2, 3, 4),) * 3, (5, 5), r"a mask of shape \(5, 5\) does not broadcast to the scores' \(\.\.\., T, S\)"),
])
def test_attention_names_shapes_that_equation_1_cannot_take(shapes, mask, match):
    """The public attention checked only dtypes: PyTorch's RuntimeError or IndexError came from inside, and d_k = 0
    returned NaN."""
    import torch

    from annotated_transformer.attention import attention

    query, key, value = (torch.randn(*shape) for shape in shapes)
    with pytest.raises(ValueError, match=match):
        attention(query, key, value, None if mask is None else torch.ones(*mask, dtype=torch.bool))


def test_decoding_checks_every_source_before_it_decodes_any_and_takes_int_like_lengths():
    """translate_ids had checked only the lengths up front: a source of padding only, an id outside the vocabulary or
    a number for a source failed after the shorter sources were decoded (a padding-only one named by its row in its
    chunk, an id by no sentence, a number as "object of type 'int' has no len()"). greedy_decode and beam_search
    refused max_len=np.int64(4), which translate_ids' own check took; a list as src, copy_accuracy's n=0 and
    beam_search's on_step=3 failed inside PyTorch or after a step."""
    import numpy as np
    import torch

    from annotated_transformer.beam_search import TokenIds, beam_search, translate_ids
    from annotated_transformer.decoding import copy_accuracy, greedy_decode

    torch.manual_seed(0)
    model = make_model(7, 7, N=1, d_model=16, d_ff=32, h=2).eval()
    encoded = []
    model.encoder.register_forward_hook(lambda module, args, output: encoded.append(1))
    for sources, error, match in [
        ([[1, 3], [1, 4], [0, 0, 0]], ValueError, r"sentence 2 \(counting from 0\) is padding only"),
        ([[1, 3], [1, 4, 9]], ValueError, r"sentence 1 \(counting from 0\) holds token id 9; this model's ids lie in "
                                          r"0\.\.6"),
        ([[1, 3], 5], TypeError, r"sentence 1 \(counting from 0\) must be a list of int token ids, got int 5"),
        ([[1, 3], [1, 2.0]], TypeError, "sentence 1 .* must be a list of int token ids"),
    ]:
        with pytest.raises(error, match=match):
            translate_ids(model, TokenIds(7), sources, beam_size=1)
        assert encoded == []  # nothing was decoded
    with pytest.raises(ValueError, match="max_len is 5001, but this model's target positional table has 5000 "
                                         "positions: use a max_len of at most 5000"):
        translate_ids(model, TokenIds(7), [[1, 3]], max_len=5001)
    src = torch.tensor([[1, 3, 4]])
    same = [greedy_decode(model, src, None, length, 1) for length in (4, np.int64(4), torch.tensor(4))]
    assert all(torch.equal(tokens, same[0]) for tokens in same)
    assert len(beam_search(model, src, None, np.int64(4), 1, None, beam_size=2)[0]) == 1
    assert translate_ids(model, TokenIds(7), [[1, 3]], beam_size=1, max_len=np.int64(4))
    with pytest.raises(TypeError, match="src must be a tensor of token ids, got list"):
        greedy_decode(model, [[1, 3, 4]], None, 4, 1)
    with pytest.raises(TypeError, match="on_step must be a function, got int"):
        beam_search(model, src, None, 4, 1, None, on_step=3)
    with pytest.raises(ValueError, match="n must be a positive integer, got 0"):
        copy_accuracy(model, vocab=7, seq_len=5, n=0)


def test_the_tokenizer_side_keeps_the_users_files_and_reads_pairs_once(tmp_path):
    """train_tokenizer's cleaning of leftovers deleted a user's own old files named tmp*, an empty tmp* folder and any
    .*.model.*.tmp file of the folder it was given; directory='' wrote into the working folder and a file as the
    folder failed after training. encode_pairs returned [] for an iterator (read twice) and read a list of str as pairs
    of letters; SentencePieces.decode took a str as pieces and failed on a tensor of ids."""
    import os
    import time

    import torch

    folder = tmp_path / "mine"
    folder.mkdir()
    theirs = [folder / "tmp_notes.txt", folder / "tmpdir_empty", folder / ".my.model.v2.tmp", folder / "tmp_results"]
    theirs[0].write_text("notes")
    theirs[1].mkdir()
    theirs[2].write_text("a file of another program")
    theirs[3].mkdir()
    (theirs[3] / "corpus.txt").write_text("the user's corpus")
    (theirs[3] / "results.csv").write_text("1,2")
    leftover = folder / ".joint-bpe-40-0123456789abcdef.model.x1y2z3w4.tmp"
    leftover.write_bytes(b"half a model")
    hour_ago = time.time() - 3700
    for path in [*theirs, leftover]:
        os.utime(path, (hour_ago, hour_ago))
    pairs = made_up_pairs()
    with pytest.warns(UserWarning, match="removed 1 leftover"):
        model = train_tokenizer(pairs, vocab_size=40, directory=folder)
    assert all(path.exists() for path in theirs) and not leftover.exists()
    for directory, match in [("", "directory is an empty path: name a folder"),
                             (theirs[0], r"tmp_notes\.txt is a file, not a folder \(directory\)")]:
        with pytest.raises(ValueError, match=match):
            train_tokenizer(made_up_pairs(seed=1), vocab_size=40, directory=directory)
    assert not list(tmp_path.glob("*.model"))
    processor = load_tokenizer(model)
    assert encode_pairs(iter(pairs[:3]), processor) == encode_pairs(pairs[:3], processor) != []
    with pytest.raises(TypeError, match=r"pairs must be \(source, target\) pairs of str, got 'Ein Hund' at index 0"):
        encode_pairs(["Ein Hund", "Eine Katze"], processor)
    tokenizer = SentencePieces(processor)
    ids = processor.encode("Hund Katze")
    assert tokenizer.decode(torch.tensor(ids)) == tokenizer.decode(ids) == processor.decode(ids)
    with pytest.raises(TypeError, match="decode takes token ids, got a str"):
        tokenizer.decode("Hund")


def test_batching_and_masks_refuse_what_they_would_read_wrongly():
    """token_batches truncated 3.7 to 3, parsed "3" as 3, dropped a side of mixed lengths through zip, took True as a
    budget of 1 and "False" as a true flag; padding_mask compared a pad that does not fit the tokens' dtype after
    wrapping around (261 masked the token 5 of a uint8 batch)."""
    import numpy as np
    import torch

    from annotated_transformer.masks import padding_mask, target_mask
    from annotated_transformer.training import token_batches

    for lengths, error, match in [([3.7, 2.2], TypeError, "lengths must hold int lengths"),
                                  (["3", "4"], TypeError, "lengths must hold int lengths"),
                                  ([(1, 2), (3,)], ValueError, "lengths must be all single lengths or all")]:
        with pytest.raises(error, match=match):
            token_batches(lengths, 10)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer, got True"):
        token_batches([1, 2], True)
    for flag in ("bucket", "shuffle"):
        with pytest.raises(TypeError, match=f"{flag} must be True or False, got 'False'"):
            token_batches([1, 2], 10, **{flag: "False"})
    assert token_batches([np.int64(3), 4], 10, shuffle=False) == [[0, 1]]
    tokens = torch.tensor([[5, 6, 0, 0]], dtype=torch.uint8)
    for pad in (261, -1):
        with pytest.raises(ValueError, match=rf"pad {pad} does not fit the tokens' dtype torch.uint8 \(0\.\.255\)"):
            padding_mask(tokens, pad)
        with pytest.raises(ValueError, match="does not fit the tokens' dtype"):
            target_mask(tokens, pad)
    assert padding_mask(tokens, 0).tolist() == [[[True, True, False, False]]]


def test_a_tokenizer_tensor_or_a_split_that_cannot_be_read_is_named():
    """tokenizer_from_tensor took an empty tensor (a model of no pieces, whose encode then failed with "INTERNAL: Model
    is not initialized") and passed SentencePiece's RuntimeError through for garbage; load_split(["train"]) stopped
    with "unhashable type: 'list'"."""
    import torch

    from annotated_transformer.data import load_split, tokenizer_from_tensor

    for data in (torch.zeros(0, dtype=torch.uint8), torch.arange(100, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="data is not a SentencePiece model: empty or damaged"):
            tokenizer_from_tensor(data)
    with pytest.raises(ValueError, match=r"split must be one of \['test', 'train', 'valid'\], got \['train'\]"):
        load_split(["train"])


def test_collate_epochs_and_lengths_refuse_what_they_would_misread(tmp_path):
    """collate read a bool mask as the indices 1 and 0 and a negative index from the end; EpochBatches took a seed of
    0.5 to a RuntimeError of manual_seed; SentencePieces.max_len(-100) gave -110."""
    import numpy as np

    from annotated_transformer.data import EpochBatches

    examples = [([5, 3], [2, 5, 3]), ([6, 7, 3], [2, 6, 3])]
    for indices in ([True, False], [-1], [0.0]):
        with pytest.raises(TypeError, match="indices must be example indices, ints >= 0"):
            collate(examples, indices)
    assert collate(examples, [np.int64(1)]).src.tolist() == [[6, 7, 3]]
    for seed in (0.5, -1, True, 2**32):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\)"):
            EpochBatches(examples, 100, seed=seed)
    tokenizer = SentencePieces(load_tokenizer(train_tokenizer(made_up_pairs(), vocab_size=40, directory=tmp_path)))
    with pytest.raises(ValueError, match="source_length must be a positive integer, got -100"):
        tokenizer.max_len(-100)
    assert tokenizer.max_len(10) > 10


@pytest.mark.parametrize("dropout", [float("nan"), "0.1", None, 1.5, -0.1])
def test_every_layer_with_dropout_refuses_a_rate_that_is_no_probability_when_it_is_made(dropout):
    """nn.Dropout takes NaN (it is neither below 0 nor above 1): a layer made with it failed at its first step, the
    attention with "Currently do not support dropout > 0"; a str or None failed inside nn.Dropout with a comparison
    error that named no argument."""
    from annotated_transformer.attention import MultiHeadedAttention
    from annotated_transformer.feed_forward import PositionwiseFeedForward
    from annotated_transformer.positional import LearnedPositionalEmbedding, PositionalEncoding
    from annotated_transformer.sublayers import SublayerConnection

    for make in (lambda: PositionalEncoding(8, dropout), lambda: LearnedPositionalEmbedding(8, dropout, 10),
                 lambda: PositionwiseFeedForward(8, 16, dropout), lambda: SublayerConnection(8, dropout),
                 lambda: MultiHeadedAttention(2, 8, dropout)):
        with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\], got "):
            make()


def test_the_generator_embeddings_and_layer_norm_name_what_they_cannot_take():
    """Generator of another width failed inside nn.Linear ("mat1 and mat2 shapes cannot be multiplied"); Embeddings
    of a list stopped with "'list' object has no attribute 'dtype'"; LayerNorm(8, eps="1e-6") with a comparison error
    that named no argument."""
    import torch

    from annotated_transformer.embeddings import Embeddings, Generator
    from annotated_transformer.sublayers import LayerNorm

    with pytest.raises(ValueError, match=r"the input's last dimension must be d_model=16, got shape \(2, 3, 8\)"):
        Generator(16, 11)(torch.randn(2, 3, 8))
    assert Generator(16, 11)(torch.randn(2, 3, 16)).shape == (2, 3, 11)
    with pytest.raises(TypeError, match="tokens must be a tensor, got list"):
        Embeddings(8, 11)([[1, 2]])
    with pytest.raises(ValueError, match="eps must be a non-negative float, got '1e-6'"):
        LayerNorm(8, eps="1e-6")


def test_the_benchmark_never_replaces_another_devices_record(tmp_path):
    """bench --json replaced any benchmark record, a GPU's included, from any machine; now only one of the same device,
    which this machine can make again. The record is written before the tables are printed, so that a closed standard
    output (bench ... | head) no longer loses it."""
    import json

    from annotated_transformer.runtime import describe_device

    path = tmp_path / "bench_gpu.json"
    gpu = {"meta": {"device_name": "cuda (NVIDIA H100 80GB HBM3)"}, "training": []}
    path.write_text(json.dumps(gpu))
    with pytest.raises(ValueError, match=r"is the benchmark record of another device or thread count \(cuda \(NVIDIA H100"):
        bench.run(smoke=True, device="cpu", sections=("layers",), json_path=path)
    assert json.loads(path.read_text()) == gpu
    mine = tmp_path / "bench_cpu.json"
    mine.write_text(json.dumps({"meta": {"device_name": describe_device("cpu"), "smoke": True}, "layers": []}))
    assert bench.run(smoke=True, device="cpu", sections=("layers",), json_path=mine) == 0  # its own device: again
    assert json.loads(mine.read_text())["layers"]


@pytest.mark.parametrize("smoke, sections, why", [
    (True, ("attention", "layers"), "a record of full sizes, which --smoke would replace"),
    (False, ("layers",), "a record of attention too, which this run does not measure"),
])
def test_the_benchmark_never_replaces_what_it_would_not_measure_again(tmp_path, smoke, sections, why):
    """A --smoke run replaced a full record of the same device, and an --only run dropped the record's other
    sections: `bench --smoke --json book/results/bench_cpu.json` lost the book's measurements. Both are refused, before
    anything is measured."""
    import json

    from annotated_transformer.runtime import describe_device

    path = tmp_path / "bench_cpu.json"
    full = {"meta": {"device_name": describe_device("cpu"), "smoke": False}, "attention": [{"ms": 1.0}],
            "layers": [{"ms": 2.0}]}
    path.write_text(json.dumps(full))
    with pytest.raises(ValueError, match=f"is {why}: name a new file"):
        bench.run(smoke=smoke, device="cpu", sections=sections, json_path=path)
    assert json.loads(path.read_text()) == full


def test_records_hold_json_only_and_a_data_folder_that_is_a_file_is_named(tmp_path):
    """A diverged run's NaN loss was written as NaN, which JSON parsers other than Python's refuse; a data 'folder'
    that is a file got the advice to put the Multi30k file in it."""
    import json
    import math

    from annotated_transformer.download import fetch
    from annotated_transformer.records import write_results

    path = write_results(tmp_path / "run.json", {"history": {"loss": [2.5, math.nan]}, "test": {"bleu": math.inf}})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"history": {"loss": [2.5, None]}, "test": {"bleu": None}}
    (tmp_path / "data").write_text("not a folder")
    with pytest.raises(ValueError, match=r"data \(set by the directory argument\) is a file, not a folder"):
        fetch("val.de.gz", directory=tmp_path / "data")


def test_decoder_caches_refuse_memory_of_another_shape_and_a_batch_that_changed():
    """StaticDecoderCache took memory of any shape (an unpacking error, or a matrix product's); a growing cache whose
    batch changed without a reorder failed inside torch.cat."""
    import torch

    from annotated_transformer.decoder import DecoderCache, StaticDecoderCache

    model = make_model(11, 11, N=1, d_model=16, d_ff=32, h=2).eval()
    memory = torch.randn(2, 5, 16)
    for bad in (memory[0], memory[..., :8]):
        with pytest.raises(ValueError, match=r"memory must have shape \(batch, length, 16\), got"):
            StaticDecoderCache(model.decoder, bad, max_len=8)
    cache, y = DecoderCache(1), torch.randn(2, 3, 16)
    with torch.no_grad():
        model.decoder(y[:, :1], memory, None, None, cache)
        with pytest.raises(ValueError, match="the cache holds 2 rows, this step 1: reorder it"):
            model.decoder(y[:1, 1:2], memory[:1], None, None, cache)


def test_only_scratch_folders_named_by_mkdtemp_count_as_leftovers(tmp_path):
    """A reader's own folder `tmp` holding a SentencePiece model (model.model, model.vocab: SentencePiece's usual
    names) was deleted as a leftover of a killed training once an hour old."""
    import os
    import time

    from annotated_transformer.data import remove_stale_scratch

    mine, scratch = tmp_path / "tmp", tmp_path / "tmpab12cd_4"
    for folder in (mine, scratch):
        folder.mkdir()
        (folder / "model.model").write_bytes(b"a SentencePiece model")
        (folder / "model.vocab").write_text("x\t0\n")
        os.utime(folder, (time.time() - 7200,) * 2)
    with pytest.warns(UserWarning, match="removed 1 leftover"):
        assert remove_stale_scratch(tmp_path) == [scratch]
    assert (mine / "model.model").read_bytes() == b"a SentencePiece model"


def test_a_results_path_that_is_no_file_is_refused_before_the_run(tmp_path):
    """A link to nothing passed the check before training, and after it the record's exclusive write failed on it
    again and again: the run never ended."""
    import os

    from annotated_transformer.records import check_results_path, unclaimed

    dangling = tmp_path / "run.json"
    dangling.symlink_to(tmp_path / "gone.json")
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    for path in (dangling, fifo):
        with pytest.raises(ValueError, match=f"the results path {path} is not a file"):
            check_results_path(path)
        assert unclaimed(path, None, log=lambda line: None) != path  # after a run: beside it


def test_an_exclusive_write_without_hard_links_still_refuses_a_file_that_appeared(tmp_path, monkeypatch):
    """Where a file system has no hard links, write_atomically(new=True) fell back to a rename, which replaced
    another run's record that appeared meanwhile."""
    import os

    from annotated_transformer.checkpoints import write_atomically

    def no_links(*args):
        raise PermissionError("no hard links here")

    monkeypatch.setattr(os, "link", no_links)
    theirs = tmp_path / "r.json"
    theirs.write_text('{"other": 1}')
    with pytest.raises(FileExistsError):
        write_atomically(theirs, lambda stream: stream.write(b'{"mine": 2}'), new=True)
    assert theirs.read_text() == '{"other": 1}' and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    mine = tmp_path / "new.json"
    write_atomically(mine, lambda stream: stream.write(b'{"mine": 2}'), new=True)
    assert mine.read_bytes() == b'{"mine": 2}'


def test_collate_takes_indices_from_an_iterator_or_a_tensor():
    """An iterator of indices was used up by the check, and the batch then held no example; a tensor's indices were
    refused as not indices."""
    import torch

    examples = [([5, 3], [2, 7, 3]), ([6, 4, 3], [2, 8, 3]), ([9, 3], [2, 3])]
    expected = collate(examples, [2, 0])
    for indices in (iter([2, 0]), (i for i in (2, 0)), torch.tensor([2, 0])):
        batch = collate(examples, indices)
        assert torch.equal(batch.src, expected.src) and torch.equal(batch.tgt, expected.tgt)
    with pytest.raises(TypeError, match="indices must be example indices"):
        collate(examples, torch.tensor([True, False, True]))
