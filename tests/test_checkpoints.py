"""Tests of checkpoint integrity ("nothing lost, nothing silent"): the checksum and the one clear error for every
way a file can fail to be a checkpoint, resuming from the newest intact checkpoint, rotation that never deletes an
intact checkpoint for a damaged one, the stop on a loss that is not finite, leftovers of killed saves, the check of a
run's folder, and a run killed with SIGKILL."""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from annotated_transformer import checkpoints, copy_task, trainer
from annotated_transformer.checkpoints import (
    CheckpointError, average_checkpoints, content_digest, load_checkpoint, model_from_checkpoint, save_checkpoint,
)
from annotated_transformer.folders import (
    check_run_folder, checkpoint_path, checkpoint_problem, clean_leftovers, latest_checkpoint, list_checkpoints,
    load_latest_checkpoint, rotate_checkpoints, run_folder,
)
from annotated_transformer.cli import main
from annotated_transformer.model import make_model
from annotated_transformer.copy_task import copy_batches, train_copy_task
from annotated_transformer.trainer import NonFiniteLossError, train
from annotated_transformer.training import LabelSmoothing, make_optimizer, make_scheduler

ROOT = Path(__file__).resolve().parents[1]
COPY = dict(profile="quick", d_model=16, N=1, batch_size=8, device="cpu", progress=False)  # the issue's copy model


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return make_model(**{**dict(src_vocab=11, tgt_vocab=11, N=1, d_model=16, d_ff=32, h=2, dropout=0.1), **overrides})


def tiny_batch(index):
    return next(copy_batches(11, 8, 6, 1, generator=torch.Generator().manual_seed(index)))


def flip_bytes(path, offset, count=4):
    with open(path, "r+b") as stream:
        stream.seek(offset)
        data = stream.read(count)
        stream.seek(offset)
        stream.write(bytes(byte ^ 0xFF for byte in data))


def tensor_offset(path, tensor):
    """Where ``tensor``'s bytes lie in the file (so that a flip there changes a weight, not the container)."""
    offset = Path(path).read_bytes().find(tensor.numpy().tobytes())
    assert offset > 0
    return offset


def saved(tmp_path, name="c.pt", step=1, seed=0):
    model = tiny_model(seed)
    optimizer = make_optimizer(model)
    return save_checkpoint(tmp_path / name, model=model, optimizer=optimizer, step=step), model


def train_tiny(folder, steps, *, resume=False, loss_fn=None, keep_last=5, every=2, seed=0, clip_norm=None):
    model = tiny_model(seed)
    optimizer = make_optimizer(model)
    history = train(model, tiny_batch, steps=steps, optimizer=optimizer,
                    scheduler=make_scheduler(optimizer, 16, warmup=3), loss_fn=loss_fn or LabelSmoothing(11, 0, 0.1),
                    checkpoint_dir=folder, checkpoint_every=every, keep_last=keep_last, resume=resume,
                    clip_norm=clip_norm, progress=False)
    return model, history


# The checksum and the clear error ---------------------------------------------------------------------------

def test_content_digest_sees_every_bit_and_nothing_else():
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": [1, 2.5, "x", None, True, (3, b"y")], "c": {0: 1}}
    again = {"a": torch.arange(6.0).reshape(2, 3).clone(), "b": [1, 2.5, "x", None, True, (3, b"y")], "c": {0: 1}}
    assert content_digest(state) == content_digest(again)
    flipped = {**again, "a": again["a"].clone()}
    flipped["a"].view(torch.int32)[1, 2] ^= 1
    for changed in (flipped, {**state, "a": state["a"].reshape(3, 2)}, {**state, "a": state["a"].double()},
                    {**state, "b": [1, 2.5, "x", None, 1, (3, b"y")]},  # True is not 1
                    {**state, "b": [1, 2.5000000000000004, "x", None, True, (3, b"y")]},
                    {**state, "b": [1, 2.5, "x", None, True, [3, b"y"]]},  # a list is not a tuple
                    {**state, "c": {"0": 1}}, {"c": state["c"], "b": state["b"], "a": state["a"]}):
        assert content_digest(changed) != content_digest(state)
    with pytest.raises(TypeError, match="Path"):
        content_digest({"p": Path("x")})


def test_checksum_round_trips_through_the_file(tmp_path):
    path, model = saved(tmp_path)
    checkpoint = load_checkpoint(path)
    assert checkpoint["format"] == checkpoints.CHECKPOINT_FORMAT == 2 and len(checkpoint["checksum"]) == 64
    assert checkpoint["checksum"] == content_digest({k: v for k, v in checkpoint.items() if k != "checksum"})
    assert all(torch.equal(a, b) for a, b in zip(checkpoint["model"].values(), model.state_dict().values()))


def write_fault(tmp_path, kind) -> tuple[Path, str]:
    """A file of one kind of fault, and the phrase its CheckpointError must contain."""
    path, model = saved(tmp_path, "source.pt")
    data = path.read_bytes()
    bad = tmp_path / f"{kind}.pt"
    if kind == "flipped weight":
        bad.write_bytes(data)
        flip_bytes(bad, tensor_offset(bad, model.state_dict()["generator.proj.weight"]) + 8)
        return bad, "checksum mismatch: the file was changed or damaged after it was written"
    if kind == "flipped step":  # a plain value, not a tensor: the pickle's integer for the step
        state = torch.load(path, weights_only=True)
        state["step"] = 7  # written by hand, without a new checksum: as if a byte of the pickle had changed
        torch.save(state, bad)
        return bad, "checksum mismatch"
    if kind.startswith("truncated"):
        bad.write_bytes(data[: {"truncated 10": 10, "truncated 1000": 1000, "truncated half": len(data) // 2,
                                "truncated by 1": len(data) - 1}[kind]])
        return bad, "truncated, damaged or not a PyTorch file"
    if kind == "empty":
        bad.write_bytes(b"")
        return bad, "is empty (0 bytes)"
    if kind == "a list":
        torch.save([1, 2, 3], bad)
        return bad, "not a checkpoint of this book: it holds a list"
    if kind == "another format":
        torch.save({"format": 99, "model": {}}, bad)
        return bad, "not a checkpoint of this book: it holds format 99"
    if kind in ("text", "hello"):
        bad.write_text("epoch 1: loss 2.31\n" if kind == "text" else "hello world\n")
        return bad, "truncated, damaged or not a PyTorch file"
    if kind == "foreign object":
        torch.save({"format": 2, "payload": Path("x")}, bad)
        return bad, "weights_only refuses"
    if kind == "no checksum":
        state = torch.load(path, weights_only=True)
        del state["checksum"]
        torch.save(state, bad)
        return bad, "checksum mismatch"
    raise AssertionError(kind)


FAULTS = ["flipped weight", "flipped step", "truncated 10", "truncated 1000", "truncated half", "truncated by 1",
          "empty", "a list", "another format", "text", "hello", "foreign object", "no checksum"]


@pytest.mark.parametrize("kind", FAULTS)
def test_every_fault_is_one_clear_error_naming_the_file(tmp_path, kind):
    bad, phrase = write_fault(tmp_path, kind)
    for load in (load_checkpoint, lambda p: model_from_checkpoint(p, device="cpu"),
                 lambda p: average_checkpoints([tmp_path / "source.pt", p])):
        with pytest.raises(CheckpointError) as caught:
            load(bad)
        assert isinstance(caught.value, ValueError)
        assert str(bad) in str(caught.value) and phrase in str(caught.value)
        assert "\n" not in str(caught.value)  # one line, not PyTorch's page of advice
    assert checkpoint_problem(bad) == str(caught.value)


def test_no_byte_flip_changes_what_loads_silently(tmp_path):
    """Four bytes inverted anywhere in a checkpoint: either a CheckpointError or exactly the saved content."""
    path, _ = saved(tmp_path)
    data, digest = path.read_bytes(), load_checkpoint(path)["checksum"]
    bad, errors = tmp_path / "flipped.pt", 0
    for offset in range(0, len(data) - 4, max(1, len(data) // 120)):
        bad.write_bytes(data)
        flip_bytes(bad, offset)
        try:
            checkpoint = load_checkpoint(bad)
        except CheckpointError as error:
            errors += 1
            assert str(bad) in str(error)
        else:
            assert checkpoint["checksum"] == digest
            assert content_digest({k: v for k, v in checkpoint.items() if k != "checksum"}) == digest
    assert errors > 60  # most of the file is tensors and the pickle


def test_the_command_line_reports_a_damaged_checkpoint_in_one_line(tmp_path, capsys):
    bad, _ = write_fault(tmp_path, "flipped weight")
    (tmp_path / "input.txt").write_text("3 4 5\n")
    assert main(["translate", "--checkpoint", str(bad), "--device", "cpu", "--input", str(tmp_path / "input.txt")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and str(bad) in error and "checksum mismatch" in error
    assert "Traceback" not in error


def test_format_1_checkpoints_load_with_a_warning(tmp_path):
    path, model = saved(tmp_path)
    state = torch.load(path, weights_only=True)
    del state["checksum"]
    state["format"] = 1
    torch.save(state, tmp_path / "old.pt")
    with pytest.warns(UserWarning, match=r"old\.pt was written before checkpoints carried a checksum"):
        checkpoint = load_checkpoint(tmp_path / "old.pt")
    assert all(torch.equal(a, b) for a, b in zip(checkpoint["model"].values(), model.state_dict().values()))


def test_a_file_changed_after_verification_is_read_again(tmp_path):
    path, model = saved(tmp_path)
    assert checkpoint_problem(path) is None and path.resolve() in checkpoints.VERIFIED
    flip_bytes(path, tensor_offset(path, model.state_dict()["generator.proj.weight"]))
    assert "checksum mismatch" in checkpoint_problem(path)
    assert path.resolve() not in checkpoints.VERIFIED


def without_clock(history):
    """A training history without its seconds, which no two runs share."""
    return {key: values for key, values in history.items() if key != "seconds"}


# Resuming from the newest intact checkpoint -----------------------------------------------------------------

def test_resume_falls_back_to_the_newest_intact_checkpoint_and_warns(tmp_path):
    reference, reference_history = train_tiny(None, 8)
    train_tiny(tmp_path, 6)  # checkpoints 2, 4, 6
    newest = latest_checkpoint(tmp_path)
    flip_bytes(newest, tensor_offset(newest, load_checkpoint(newest)["model"]["generator.proj.weight"]))
    with pytest.warns(UserWarning, match="skipped 1 damaged checkpoint") as caught:
        resumed, history = train_tiny(tmp_path, 8, resume=True, seed=5)
    message = str(next(w.message for w in caught if "damaged" in str(w.message)))
    assert str(newest) in message and str(checkpoint_path(tmp_path, 4)) in message and "checksum mismatch" in message
    assert without_clock(history) == without_clock(reference_history)  # continued exactly from step 4
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), resumed.state_dict().values()))
    assert [load_checkpoint(p)["step"] for p in list_checkpoints(tmp_path)] == [2, 4, 6, 8]  # 6 written again


def test_issue_reproducer_byte_flip_at_120000_of_a_copy_checkpoint(tmp_path):
    """The issue's reproducer: 4 bytes flipped at offset 120000 of the newest copy-task checkpoint (d_model 16,
    one layer); resuming trained on into nan. Now the load fails clearly and resuming continues from step 2. The
    flip hits the tensor nearest that offset (the container's layout moves as the checkpoint's contents change, and
    a flip in a zip header's padding changes no content)."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    train_copy_task(steps=4, checkpoint_dir=run, checkpoint_every=2, **COPY)
    newest = latest_checkpoint(run)
    assert newest.stat().st_size > 120_004
    stored = load_checkpoint(newest)
    tensors = [*stored["model"].values(), *(t for state in stored["optimizer"]["state"].values()
                                            for t in state.values() if t.numel() > 1)]
    flip_bytes(newest, min((tensor_offset(newest, t) for t in tensors), key=lambda at: abs(at - 120_000)))
    with pytest.raises(CheckpointError, match="step_00000004.pt"):
        load_checkpoint(newest)
    with pytest.warns(UserWarning, match="step_00000002.pt instead"):
        model, history = train_copy_task(steps=6, checkpoint_dir=run, checkpoint_every=2, resume=True, **COPY)
    assert all(math.isfinite(loss) for loss in history["loss"]) and history["step"] == [1, 2, 3, 4, 5, 6]
    reference, reference_history = train_copy_task(steps=6, checkpoint_dir=straight, **COPY)
    assert without_clock(history) == without_clock(reference_history)
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))


def test_resume_when_every_checkpoint_is_damaged_names_them_all(tmp_path):
    train_tiny(tmp_path, 4)
    for path in list_checkpoints(tmp_path):
        path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(CheckpointError, match="none of the 2 checkpoint") as caught:
        train_tiny(tmp_path, 6, resume=True)
    assert all(str(p) in str(caught.value) for p in list_checkpoints(tmp_path))
    with pytest.raises(CheckpointError, match="none of the 2"):
        check_run_folder(tmp_path, {}, resume=True)


# Rotation ---------------------------------------------------------------------------------------------------

def test_rotation_never_counts_a_damaged_checkpoint_as_kept(tmp_path):
    model = tiny_model()
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(checkpoint_path(tmp_path, step), model=model, step=step)
    for step in (4, 5):
        path = checkpoint_path(tmp_path, step)
        flip_bytes(path, tensor_offset(path, model.state_dict()["generator.proj.weight"]))
    removed = rotate_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step_00000001.pt"]
    assert [load_latest_checkpoint(tmp_path, warn=False)[1]["step"]] == [3]
    assert [p.name for p in list_checkpoints(tmp_path)] == [checkpoint_path(tmp_path, s).name for s in (2, 3, 4, 5)]
    assert rotate_checkpoints(tmp_path, keep_last=0) == []  # keeps all, reads nothing
    for path in list_checkpoints(tmp_path):
        path.write_bytes(b"")
    assert rotate_checkpoints(tmp_path, keep_last=1) == []  # nothing intact: nothing deleted


def test_a_checkpoint_that_does_not_read_back_stops_the_run_and_deletes_nothing(tmp_path, monkeypatch):
    train_tiny(tmp_path, 4, keep_last=1, every=1)  # keeps step 4
    real_write = checkpoints.write_state

    def write_then_damage(path, state):
        real_write(path, state)
        Path(path).write_bytes(Path(path).read_bytes()[:-100])  # as a failing disk would
        return Path(path)

    # the write runs in the writer's thread; its error stops the run at the next step or write
    monkeypatch.setattr(trainer, "write_state", write_then_damage)
    with pytest.raises(CheckpointError, match="does not read back, so no older one was deleted"):
        train_tiny(tmp_path, 6, resume=True, keep_last=1, every=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004.pt", "step_00000005.pt"]
    assert load_checkpoint(checkpoint_path(tmp_path, 4))["step"] == 4


def test_checkpoints_are_written_while_training_goes_on_and_hold_their_own_step(tmp_path, monkeypatch):
    """The trainer chapter's claims about CheckpointWriter: a write runs in its own thread while the next steps
    train; it writes the state of its step (a snapshot), not a later one; train() returns once it is written."""
    import threading

    real_write, steps_during_write, writing = checkpoints.write_state, [], threading.Event()
    loss_calls = []

    def slow_write(path, state):
        writing.set()
        time.sleep(0.5)  # a slow disk
        steps_during_write.append(len(loss_calls))
        return real_write(path, state)

    def counting_loss(log_probs, labels):
        loss_calls.append(1)
        return LabelSmoothing(11, 0, 0.1)(log_probs, labels)

    monkeypatch.setattr(trainer, "write_state", slow_write)
    _, history = train_tiny(tmp_path, 4, every=2, loss_fn=counting_loss)
    assert writing.is_set() and steps_during_write[0] > 2  # steps 3 and on ran during step 2's write
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002.pt", "step_00000004.pt"]
    monkeypatch.setattr(trainer, "write_state", real_write)
    straight, _ = train_tiny(tmp_path / "straight", 2, every=2)
    saved = load_checkpoint(checkpoint_path(tmp_path, 2))
    assert all(torch.equal(saved["model"][key], value) for key, value in straight.state_dict().items())
    assert saved["extra"]["history"]["step"] == [1, 2]  # the history as it was at step 2


def test_a_failed_background_write_stops_the_run_at_the_next_step(tmp_path, monkeypatch):
    def failing_write(path, state):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer, "write_state", failing_write)
    loss_calls = []

    def counting_loss(log_probs, labels):
        loss_calls.append(1)
        time.sleep(0.05)  # the write fails meanwhile
        return LabelSmoothing(11, 0, 0.1)(log_probs, labels)

    with pytest.raises(OSError, match="No space left"):
        train_tiny(tmp_path, 10, every=2, loss_fn=counting_loss)
    assert len(loss_calls) < 10 and list_checkpoints(tmp_path) == []


# A loss that is not finite ----------------------------------------------------------------------------------

def bad_at_call(n, value):
    calls, smoothing = 0, LabelSmoothing(11, 0, 0.1)

    def loss_fn(log_probs, labels):
        nonlocal calls
        calls += 1
        loss = smoothing(log_probs, labels)
        return loss * value if calls == n else loss
    return loss_fn


@pytest.mark.parametrize("value, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf")])
def test_a_loss_that_is_not_finite_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, value, shown):
    torch.manual_seed(0)
    model = tiny_model()
    optimizer = make_optimizer(model)
    with pytest.raises(NonFiniteLossError) as caught:
        train(model, tiny_batch, steps=6, optimizer=optimizer, loss_fn=bad_at_call(3, value), checkpoint_dir=tmp_path,
              checkpoint_every=1, progress=False)
    message = str(caught.value)
    assert "step 3" in message and f"is {shown}," in message and str(checkpoint_path(tmp_path, 2)) in message
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, FloatingPointError)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt", "step_00000002.pt"]
    last = load_checkpoint(checkpoint_path(tmp_path, 2))
    assert all(torch.equal(last["model"][k], v) for k, v in model.state_dict().items())  # no update was made
    assert all(math.isfinite(loss) for loss in last["extra"]["history"]["loss"])


def test_a_gradient_norm_that_is_not_finite_stops_the_run_when_clipping(tmp_path):
    model = tiny_model()
    optimizer = make_optimizer(model)
    calls = []
    model.generator.proj.weight.register_hook(lambda grad: grad * float("inf") if len(calls) == 2 else grad)

    def loss_fn(log_probs, labels):
        calls.append(1)
        return LabelSmoothing(11, 0, 0.1)(log_probs, labels)

    with pytest.raises(NonFiniteLossError, match="step 2: the gradient norm is (inf|nan)"):
        train(model, tiny_batch, steps=4, optimizer=optimizer, loss_fn=loss_fn, clip_norm=1.0,
              checkpoint_dir=tmp_path, checkpoint_every=1, progress=False)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt"]


def test_the_command_line_stops_on_a_diverging_run(tmp_path, capsys):
    args = ["train", "--task", "copy", "--profile", "quick", "--steps", "5", "--d-model", "16", "--layers", "1",
            "--batch-size", "8", "--device", "cpu", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1",
            "--factor", "1e30", "--no-progress"]
    assert main(args) == 2
    error = capsys.readouterr().err
    error = error.splitlines()[-1]  # after the warning that the warm-up outlasts the run
    assert error.startswith("error: training stopped at step ") and "not a finite number" in error
    assert "Traceback" not in error
    saved = list_checkpoints(tmp_path)
    assert saved, "no checkpoint before the divergence: the test checks nothing"
    stopped = int(error.removeprefix("error: training stopped at step ").split(":")[0])
    assert load_checkpoint(saved[-1])["step"] < stopped and f"newest checkpoint, {saved[-1]}," in error
    for path in saved:
        assert all(torch.isfinite(v).all() for v in load_checkpoint(path)["model"].values())


# Leftovers of killed saves ----------------------------------------------------------------------------------

def test_leftovers_of_killed_saves_are_removed_and_reported(tmp_path):
    handle, leftover = tempfile.mkstemp(dir=tmp_path, prefix=".step_00000003.pt.", suffix=".tmp")
    os.write(handle, b"half a checkpoint")
    os.close(handle)
    others = [tmp_path / name for name in (".notes.tmp", "step_00000003.pt.tmp", ".valid.json.abc.tmp", "a.txt")]
    for path in others:
        path.write_text("not ours to delete")
    with pytest.warns(UserWarning, match=r"removed 1 temporary file\(s\) .*\.step_00000003\.pt\.\w+\.tmp"):
        train_copy_task(steps=2, checkpoint_dir=tmp_path, **COPY)  # the run removes them
    assert not Path(leftover).exists() and all(path.exists() for path in others)
    assert clean_leftovers(tmp_path) == [] and clean_leftovers(tmp_path / "missing") == []


def test_a_resume_short_of_the_runs_goal_says_so(tmp_path):
    """A checkpoint did not keep its run's goal, so a resume that left out --steps trained to the profile's count and
    could end short of the run's goal, with exit status 0 and no word. Extending a run on purpose says nothing."""
    with pytest.raises(NonFiniteLossError):  # a run of 6 steps that stops after its checkpoint of step 4
        train_tiny(tmp_path, 6, loss_fn=bad_at_call(5, float("nan")))
    assert load_checkpoint(checkpoint_path(tmp_path, 4))["extra"]["steps"] == 6
    with pytest.warns(UserWarning, match=r"the run was started for 6 steps; this one stops at 4 \(give its steps"):
        train_tiny(tmp_path, 4, resume=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_tiny(tmp_path, 8, resume=True)  # beyond its goal: an extension, asked for


def test_a_folder_named_as_a_checkpoint_is_told_which_file_it_holds(tmp_path):
    """The hint named average.pt for every folder, which only a finished translation run holds."""
    with pytest.raises(FileNotFoundError, match="it is a folder, and holds no checkpoint$"):
        load_checkpoint(tmp_path)
    for step in (2, 4):
        save_checkpoint(checkpoint_path(tmp_path, step), model=tiny_model(), step=step)
    with pytest.raises(FileNotFoundError, match="such as .*step_00000004.pt$"):
        load_checkpoint(tmp_path)  # its newest step
    save_checkpoint(tmp_path / "average.pt", model=tiny_model())
    with pytest.raises(FileNotFoundError, match="such as .*average.pt$"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="^no checkpoint at .*missing.pt$"):
        load_checkpoint(tmp_path / "missing.pt")


# One run per folder -----------------------------------------------------------------------------------------

def test_check_run_folder(tmp_path, monkeypatch):
    config = tiny_model().config
    new = tmp_path / "a" / "b"
    missing = "/a/b holds no checkpoint to resume: no such folder"
    with pytest.raises(FileNotFoundError, match=missing):  # a mistyped folder: none is made
        check_run_folder(new, config, resume=True)
    with pytest.raises(FileNotFoundError, match=missing), run_folder(new, config, resume=True):
        pass
    with pytest.raises(FileNotFoundError, match=missing):
        train_copy_task(steps=2, checkpoint_dir=new, resume=True, **COPY)
    assert not (tmp_path / "a").exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*typo.pt$"):
        train_tiny(new, 2, resume=tmp_path / "typo.pt")  # a mistyped checkpoint: no folder made either
    assert not (tmp_path / "a").exists()
    assert check_run_folder(new, config, resume=False) == new and new.is_dir() and not list(new.iterdir())
    with pytest.raises(FileNotFoundError, match="holds no checkpoint to resume$"):
        check_run_folder(new, config, resume=True)
    elsewhere = tmp_path / "elsewhere.pt"
    save_checkpoint(elsewhere, model=tiny_model(), extra={"settings": {"seed": 0}})
    assert check_run_folder(new, {**config, "seed": 0}, resume=str(elsewhere)) == new  # a path: may be empty
    with pytest.raises(ValueError, match=r"holds a run with other settings \(elsewhere.pt\): seed \(checkpoint 0, "
                                         r"this run 1\)"):  # but its settings are compared, as resume=True's are
        check_run_folder(new, {**config, "seed": 1}, resume=str(elsewhere))
    save_checkpoint(checkpoint_path(new, 3), model=tiny_model(), extra={"settings": {"seed": 0}})
    with pytest.raises(ValueError, match=r"already holds checkpoints \(the newest is step_00000003.pt\): the "
                                         r"files of a run; resume that run \(--resume\), or use another folder"):
        check_run_folder(new, config, resume=False)
    assert check_run_folder(new, {**config, "seed": 0, "steps": 10}, resume=True) == new
    with pytest.raises(ValueError, match=r"other settings .*d_model \(checkpoint 16, this run 32\), "
                                         r"seed \(checkpoint 0, this run 1\)"):
        check_run_folder(new, {**config, "d_model": 32, "seed": 1}, resume=True)
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_run_folder(afile, config, resume=False)
    with pytest.raises(ValueError, match="cannot write checkpoints to .*file/sub"):
        check_run_folder(afile / "sub", config, resume=False)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoints.tempfile, "mkstemp", read_only)
    with pytest.raises(ValueError, match=r"cannot write checkpoints to .*\(Permission denied\)"):
        check_run_folder(tmp_path / "c", config, resume=False)


def test_the_copy_task_refuses_a_bad_folder_before_any_training(tmp_path, monkeypatch):
    train_copy_task(steps=2, checkpoint_dir=tmp_path, **COPY)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}

    def no_training(*args, **kwargs):
        raise AssertionError("trained although the folder should have been refused")

    monkeypatch.setattr(copy_task, "train", no_training)
    with pytest.raises(ValueError, match="already holds checkpoints"):  # another run in the folder
        train_copy_task(steps=4, checkpoint_dir=tmp_path, **COPY)
    with pytest.raises(ValueError, match=r"batch_size \(checkpoint 8, this run 16\)"):  # resumed with other settings
        train_copy_task(steps=4, checkpoint_dir=tmp_path, resume=True, **{**COPY, "batch_size": 16})
    with pytest.raises(ValueError, match=r"d_model \(checkpoint 16, this run 32\)"):
        train_copy_task(steps=4, checkpoint_dir=tmp_path, resume=True, **{**COPY, "d_model": 32})
    with pytest.raises(ValueError, match=r"batch_size \(checkpoint 8, this run 16\)"):  # named by its path too
        train_copy_task(steps=4, checkpoint_dir=tmp_path.parent / f"{tmp_path.name}-b",
                        resume=str(latest_checkpoint(tmp_path)), **{**COPY, "batch_size": 16})
    with pytest.raises(ValueError, match="is a file, not a folder"):
        train_copy_task(steps=4, checkpoint_dir=latest_checkpoint(tmp_path), **COPY)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    assert load_checkpoint(latest_checkpoint(tmp_path))["extra"]["settings"]["batch_size"] == 8


def test_the_command_line_refuses_a_bad_checkpoint_dir_at_once(tmp_path, capsys):
    afile = tmp_path / "file"
    afile.write_text("x")
    args = ["train", "--task", "copy", "--profile", "quick", "--steps", "2", "--d-model", "16", "--layers", "1",
            "--batch-size", "8", "--device", "cpu", "--no-progress", "--checkpoint-dir"]
    for folder in (afile, afile / "sub"):  # refused by the option's own check, or by check_run_folder
        assert exit_status(main, args + [str(folder)]) == 2
        error = capsys.readouterr().err
        assert "error: " in error and str(afile) in error and "Traceback" not in error
    assert main(args + [str(tmp_path / "run")]) == 0
    assert main(args + [str(tmp_path / "run")]) == 2  # another run in the folder
    assert "already holds checkpoints" in capsys.readouterr().err


def exit_status(function, argv) -> int:
    """``function(argv)``'s return value, or the status of the SystemExit with which argparse refuses an option."""
    try:
        return function(argv)
    except SystemExit as exit:
        return exit.code


# A run killed with SIGKILL ----------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_run_killed_with_sigkill_leaves_loadable_checkpoints_and_resumes(tmp_path, capsys):
    folder = tmp_path / "run"
    args = ["train", "--task", "copy", "--profile", "quick", "--steps", "100000", "--d-model", "16", "--layers", "1",
            "--batch-size", "8", "--device", "cpu", "--checkpoint-dir", str(folder), "--checkpoint-every", "1",
            "--keep-last", "3", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "annotated_transformer", *args], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, enough = time.monotonic() + 120, None
        while time.monotonic() < deadline and process.poll() is None:
            names = os.listdir(folder) if folder.is_dir() else []
            if sum(name.startswith("step_") for name in names) >= 3:
                enough = enough or time.monotonic()
                # Kill while a save is under way if we catch one (within 5 s), so that one may be cut short.
                if any(name.endswith(".tmp") for name in names) or time.monotonic() > enough + 5:
                    break
            else:
                time.sleep(0.01)
        assert process.poll() is None, process.stderr.read().decode()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    remaining = list_checkpoints(folder)
    assert remaining and all(load_checkpoint(path)["step"] >= 1 for path in remaining)  # every one loads
    killed_saves = [name for name in os.listdir(folder) if name.endswith(".tmp")]  # usually one, cut short
    step = load_checkpoint(remaining[-1])["step"]
    args[args.index("--steps") + 1] = str(step + 2)
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    leftovers = [name for name in os.listdir(folder) if name.endswith(".tmp")]
    assert leftovers == [], leftovers
    assert not [line for line in said if "damaged" in line]  # nothing was damaged by the kill
    if killed_saves:  # and it said so, in one line
        assert any(all(name in line for name in killed_saves) for line in said), said
    assert load_checkpoint(latest_checkpoint(folder))["step"] == step + 2


def test_written_files_get_the_mode_that_open_would_give(tmp_path):
    import os
    import stat

    from annotated_transformer.checkpoints import write_atomically

    umask = os.umask(0o027)
    try:
        path = write_atomically(tmp_path / "results.json", lambda stream: stream.write("{}"), mode="w")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.read_text() == "{}"


def test_the_average_of_one_path_is_that_checkpoint_not_its_letters(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "one.pt", model=make_model(11, 11, N=1, d_model=16, d_ff=32, h=2))
    expected = average_checkpoints([tmp_path / "one.pt"])  # the state dict
    for one in (tmp_path / "one.pt", str(tmp_path / "one.pt")):  # list() of a str would be its letters
        averaged = average_checkpoints(one)
        assert averaged.keys() == expected.keys()
        assert all(torch.equal(averaged[key], expected[key]) for key in expected)


def test_train_refuses_a_new_run_among_another_runs_checkpoints_and_loses_none(tmp_path):
    train_tiny(tmp_path, 5, every=1)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"already holds checkpoints \(the newest is step_00000005.pt\).*"
                                         r"resume that run \(resume=True\)"):
        train_tiny(tmp_path, 2, every=1, keep_last=2, seed=1)  # its rotation would have deleted the first run's
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    other = tmp_path.parent / f"{tmp_path.name}-other"
    train_tiny(other, 1, every=1, seed=1)
    with pytest.raises(ValueError, match=r"already holds checkpoints \(the newest is step_00000005.pt\)"):
        train_tiny(tmp_path, 3, every=1, keep_last=2, resume=str(other / "step_00000001.pt"))  # another run's file
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # its own earlier step: the run would go on beside the later checkpoints it abandons, which the rotation then
    # counts as its own (deleting the new ones), and which a later resume=True would take up
    with pytest.raises(ValueError, match=r"step_00000004.pt is not the newest checkpoint of .* \(step_00000005.pt\)"):
        train_tiny(tmp_path, 6, every=1, resume=str(tmp_path / "step_00000004.pt"))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    train_tiny(tmp_path, 6, every=1, resume=str(tmp_path / "step_00000005.pt"))  # the newest, named: the same run
    train_tiny(tmp_path, 7, every=1, resume=True)  # resuming it is the way in


def test_a_checkpoint_without_optimiser_state_resumes_nothing(tmp_path):
    """A model's weights alone (average.pt, or save_checkpoint without an optimiser) were taken as a run to resume:
    the step count went on while Adam's moments and the warm-up started again, without a word."""
    model, history = train_tiny(tmp_path / "run", 4)
    save_checkpoint(tmp_path / "weights.pt", model=model, step=4, extra={"history": history})
    with pytest.raises(ValueError, match=r"weights.pt: the checkpoint holds no optimiser state"):
        train_tiny(tmp_path / "new", 8, resume=str(tmp_path / "weights.pt"))
    assert not list((tmp_path / "new").glob("step_*.pt"))


def test_numpy_values_are_refused_before_training_not_after_it(tmp_path):
    """A NumPy float passed as a float, and the checkpoint holding it could not be read back (weights_only)."""
    import numpy as np

    with pytest.raises(TypeError, match="a checkpoint holds tensors and plain values only, not float64"):
        content_digest({"best": np.float64(1.5)})
    assert content_digest({"best": 1.5}) != content_digest({"best": 1.25})


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(keep_last=-1), ValueError, r"keep_last must be an integer >= 0, got -1"),
    (dict(keep_last="2"), ValueError, r"keep_last must be an integer >= 0, got '2'"),
    (dict(clip_norm=-1.0), ValueError, r"clip_norm must be a positive finite number, got -1.0"),
    (dict(clip_norm=0), ValueError, r"clip_norm must be a positive finite number, got 0"),
    (dict(clip_norm=float("nan")), ValueError, r"clip_norm must be a positive finite number, got nan"),
    (dict(clip_norm=True), ValueError, r"clip_norm must be a positive finite number, got True"),
    (dict(clip_norm=float("inf")), ValueError, r"clip_norm must be a positive finite number, got inf"),
    (dict(extra={"data": Path("x")}), TypeError, r"extra: a checkpoint holds tensors and plain values only, not "),
    (dict(checkpoint_dir=""), ValueError, r"a run's folder must have a name, got ''"),
    (dict(checkpoint_dir="FILE"), ValueError, r"is a file, not a folder"),
])
def test_train_refuses_bad_arguments_before_any_step_or_folder(tmp_path, monkeypatch, kwargs, error, match):
    (tmp_path / "file").write_text("x")
    kwargs = {"checkpoint_dir": tmp_path / "run", **kwargs}
    kwargs["checkpoint_dir"] = tmp_path / "file" if kwargs["checkpoint_dir"] == "FILE" else kwargs["checkpoint_dir"]
    monkeypatch.chdir(tmp_path)
    model = tiny_model()
    optimizer = make_optimizer(model)

    def no_batch(index):
        raise AssertionError("a step began although the arguments should have been refused")

    with pytest.raises(error, match=match):
        train(model, no_batch, steps=2, optimizer=optimizer, loss_fn=LabelSmoothing(11, 0, 0.1), progress=False,
              **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no folder made, nothing written


def test_the_copy_task_refuses_bad_arguments_before_making_its_folder(tmp_path):
    new = tmp_path / "new" / "run"
    for kwargs, match in [(dict(checkpoint_every=-1), "checkpoint_every must be an integer >= 0, got -1"),
                          (dict(keep_last=-1), "keep_last must be an integer >= 0, got -1")]:
        with pytest.raises(ValueError, match=match):
            train_copy_task(steps=2, checkpoint_dir=new, **kwargs, **COPY)
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match=r"resume=True needs checkpoint_dir"):
        train_copy_task(steps=2, resume=True, **COPY)


LIMITED_DISK = """
import resource, signal, subprocess, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the limit kills the process: a write fails instead
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.exit(subprocess.run(sys.argv[2:]).returncode)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file-size limits")
def test_a_disk_that_refuses_a_checkpoint_is_named_in_one_line(tmp_path):
    """A full disk (here a file-size limit, EFBIG) made torch.save's zip writer fail while closing, and its
    RuntimeError ('unexpected pos') replaced the disk's OSError: the command line showed a traceback. Now one line
    names the checkpoint and the disk's reason, and no temporary file is left."""
    command = [sys.executable, "-c", LIMITED_DISK, "100000", sys.executable, "-m", "annotated_transformer", "train",
               "--profile", "quick", "--d-model", "128", "--d-ff", "512", "--layers", "1", "--device", "cpu",
               "--steps", "2", "--checkpoint-dir", "run", "--no-progress"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    line = [text for text in result.stderr.splitlines() if text.startswith("error:")]
    assert len(line) == 1 and re.fullmatch(r"error: run/step_\d{8}\.pt: File too large", line[0]), result.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []
    # the library: the disk's OSError, naming the file
    script = ("import sys; from annotated_transformer.checkpoints import save_checkpoint; "
              "from annotated_transformer.model import make_model\n"
              "try:\n    save_checkpoint(sys.argv[1], model=make_model(11, 11, N=1, d_model=128, d_ff=512))\n"
              "except OSError as error:\n    print(type(error).__name__, error.errno, error.filename)")
    result = subprocess.run([sys.executable, "-c", LIMITED_DISK, "100000", sys.executable, "-c", script,
                             str(tmp_path / "small.pt")], capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["OSError", "27", str(tmp_path / "small.pt")], result.stderr


@pytest.mark.parametrize("every", [2, 0])  # 0: a checkpoint at the end only, the copy task's default
def test_a_run_stopped_off_its_cadence_and_resumed_ends_with_the_files_of_a_run_never_stopped(tmp_path, every):
    """A stopped run's checkpoint (step 3 of a run that writes every 2) used to count among the kept ones: it pushed a
    regular checkpoint out, and was averaged at the end, so the model depended on when the run was stopped."""
    train_tiny(tmp_path / "straight", 4, keep_last=2, every=every)
    train_tiny(tmp_path / "stopped", 3, keep_last=2, every=every)  # ends off its cadence, as a stopped run does
    assert list_checkpoints(tmp_path / "stopped")[-1].name == "step_00000003.pt"
    train_tiny(tmp_path / "stopped", 4, resume=True, keep_last=2, every=every)
    names = [p.name for p in list_checkpoints(tmp_path / "stopped")]
    expected = ["step_00000002.pt", "step_00000004.pt"] if every else ["step_00000004.pt"]
    assert names == [p.name for p in list_checkpoints(tmp_path / "straight")] == expected


def test_rotation_drops_an_off_cadence_checkpoint_only_once_a_newer_one_is_intact(tmp_path):
    model = tiny_model(0)
    for step in (2, 3, 4, 5, 6):
        save_checkpoint(checkpoint_path(tmp_path, step), model=model, step=step)
    checkpoint_path(tmp_path, 6).write_bytes(b"damaged")  # the newest is not intact: 5 is the one to resume from
    assert rotate_checkpoints(tmp_path, 0, every=2) == []  # 0 keeps all, a stopped run's too
    assert rotate_checkpoints(tmp_path, 5, every=2) == [checkpoint_path(tmp_path, 3)]
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step_0000000{s}.pt" for s in (2, 4, 5, 6)]
    assert rotate_checkpoints(tmp_path, 1, every=2) == [checkpoint_path(tmp_path, s) for s in (2, 4)]
    assert rotate_checkpoints(tmp_path, 1) == []  # without the cadence, as before


def test_a_copy_task_run_resumed_with_another_cadence_is_refused(tmp_path):
    """Rotation drops the checkpoints off a run's cadence once a newer one is intact: a resume with another
    checkpoint_every would have deleted the earlier part's regular checkpoints. The copy task compares it now, as the
    translation task does."""
    train_copy_task(steps=4, checkpoint_dir=tmp_path, checkpoint_every=2, **COPY)
    with pytest.raises(ValueError, match=r"checkpoint_every \(checkpoint 2, this run 3\)"):
        train_copy_task(steps=6, checkpoint_dir=tmp_path, checkpoint_every=3, resume=True, **COPY)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002.pt", "step_00000004.pt"]


def test_a_run_resumed_with_another_cadence_is_refused_before_its_rotation_deletes_checkpoints(tmp_path):
    """train never stored its cadence: resumed with checkpoint_every=3 after saving every 2 steps with keep_last=5,
    its rotation deleted the earlier checkpoints that were off the new cadence (2, 4, 8 and 10 of 2..10)."""
    train_tiny(tmp_path, 10, every=2, keep_last=5)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"saved a checkpoint every 2 steps, this one every 3: resume with "
                                         r"checkpoint_every=2"):
        train_tiny(tmp_path, 12, every=3, keep_last=5, resume=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    train_tiny(tmp_path, 12, every=2, keep_last=5, resume=True)
    assert [p.name for p in list_checkpoints(tmp_path)][-1] == "step_00000012.pt"
