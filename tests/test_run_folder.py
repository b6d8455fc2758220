"""The run folder is the unit (issue 21): a new run is refused in a folder that holds anything of a run; a run
holds its folder with a lock for its whole lifetime (a second run is refused, naming the first's process; a
killed run's lock is taken over, and says so); the next run removes the leftovers of every killed write of a
run, and nothing else; an intact checkpoint of an unexpected structure is one CheckpointError; and after a
resume past a damaged checkpoint, the checkpoint named is the one the run wrote or used."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from test_checkpoints import flip_bytes

from annotated_transformer import checkpoints, copy_task, folders, trainer
from annotated_transformer.checkpoints import (
    CheckpointError, content_digest, load_checkpoint, model_from_checkpoint, save_checkpoint, write_atomically,
)
from annotated_transformer.folders import (
    LEFTOVER_NAME, RUN_FILES, check_run_folder, checkpoint_path, checkpoint_problem, latest_checkpoint,
    list_checkpoints, run_folder,
)
from annotated_transformer.cli import main
from annotated_transformer.model import make_model
from annotated_transformer.copy_task import train_copy_task
from annotated_transformer.trainer import NonFiniteLossError

ROOT = Path(__file__).resolve().parents[1]
COPY = dict(profile="quick", d_model=16, N=1, batch_size=8, device="cpu", progress=False)
CLI_COPY = ["train", "--task", "copy", "--profile", "quick", "--d-model", "16", "--layers", "1",
            "--batch-size", "8", "--device", "cpu", "--no-progress"]
ME = f"process {os.getpid()} on {socket.gethostname()}"
needs_flock = pytest.mark.skipif(folders.fcntl is None, reason="no flock on this system (Windows)")

HOLD = """import sys, time
from annotated_transformer.folders import run_folder
with run_folder(sys.argv[1], {}):
    print("holding", flush=True)
    time.sleep(600)
"""


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)


def snapshot(folder: Path) -> dict:
    """{name: bytes} of every file in ``folder``: what a refused run must leave as it was."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def damage(path):
    """Flip four bytes inside the output projection's weights (the checksum no longer matches)."""
    weights = load_checkpoint(path)["model"]["generator.proj.weight"]
    flip_bytes(path, Path(path).read_bytes().find(weights.numpy().tobytes()) + 8)


def leftover(folder, name) -> Path:
    """What a write of ``name`` killed before its rename leaves: write_atomically's temporary file."""
    handle, path = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    os.write(handle, b"half a file")
    os.close(handle)
    return Path(path)


class Holder:
    """Another process that holds ``folder`` with run_folder until it is killed."""

    def __init__(self, folder):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.process.stdout.readline().strip()
        assert line == "holding", self.process.stderr.read()
        self.name = f"process {self.process.pid} on {socket.gethostname()}"

    def kill(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=60)
        self.process.stdout.close()
        self.process.stderr.close()


@pytest.fixture
def holder(tmp_path):
    held = []

    def start(folder):
        held.append(Holder(folder))
        return held[-1]

    yield start
    for one in held:
        one.kill()


# 1. A new run is refused in a folder that holds anything of a run ------------------------------------------

@pytest.mark.parametrize("name", ["step_00000004.pt", *RUN_FILES])
def test_a_new_run_is_refused_where_any_file_of_a_run_is(tmp_path, name):
    if name.endswith(".pt"):
        save_checkpoint(tmp_path / name, model=tiny_model(), step=4)
    else:
        (tmp_path / name).write_bytes(b"a file of a finished run")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=rf"already holds .*{name}.*: the files of a run; resume that run"):
        check_run_folder(tmp_path, tiny_model().config, resume=False)
    with pytest.raises(ValueError, match=name):
        with run_folder(tmp_path, tiny_model().config):
            pass
    if name == "average.pt":  # a finished run: there is nothing to resume
        with pytest.raises(FileNotFoundError, match=rf"holds no checkpoint to resume \(only {name}\)"):
            check_run_folder(tmp_path, tiny_model().config, resume=True)
    elif not name.startswith("step_"):  # a run stopped before its first checkpoint: it starts again
        with pytest.warns(UserWarning, match=rf"holds no checkpoint, only {name}: the run stopped before"):
            check_run_folder(tmp_path, tiny_model().config, resume=True)
    assert snapshot(tmp_path) == before


def test_an_empty_folder_has_nothing_to_resume(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no checkpoint to resume$"):
        check_run_folder(tmp_path, tiny_model().config, resume=True)


def test_a_finished_run_whose_step_checkpoints_were_deleted_is_not_overwritten(tmp_path, capsys):
    """The issue's reproducer, with the copy task: the same train command again, without --resume."""
    run = tmp_path / "run"
    args = CLI_COPY + ["--steps", "2", "--checkpoint-dir", str(run)]
    assert main(args) == 0
    newest = latest_checkpoint(run)
    (run / "average.pt").write_bytes(newest.read_bytes())  # the run's final model, kept
    (run / "valid.json").write_text('{"step": [2], "loss": [2.0]}')
    for path in list_checkpoints(run):
        path.unlink()  # to save space
    before = snapshot(run)
    capsys.readouterr()
    assert main(args) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "already holds average.pt, valid.json" in error
    assert "Traceback" not in error and error.count("\n") == 1
    assert snapshot(run) == before


# 2. One run at a time: a lock for the run's lifetime -------------------------------------------------------

@needs_flock
def test_a_second_run_is_refused_naming_the_first_and_its_write_is_left_alone(tmp_path, holder, capsys):
    first = holder(tmp_path)
    assert (tmp_path / ".run.lock").read_text() == first.name
    writing = leftover(tmp_path, "step_00000100.pt")  # a save of the first run, under way
    before = snapshot(tmp_path)
    message = f"{tmp_path} is in use by another run, {first.name}"
    with pytest.raises(ValueError, match=message):
        with run_folder(tmp_path, tiny_model().config):
            pass
    with pytest.raises(ValueError, match=message):
        train_copy_task(steps=2, checkpoint_dir=tmp_path, **COPY)
    assert main(CLI_COPY + ["--steps", "2", "--checkpoint-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert snapshot(tmp_path) == before and writing.exists()


@needs_flock
def test_a_killed_runs_lock_is_taken_over_and_said(tmp_path, holder):
    first = holder(tmp_path)
    first.kill()  # SIGKILL: no clean-up; the lock file stays, naming a process that is gone
    assert (tmp_path / ".run.lock").read_text() == first.name
    with pytest.warns(UserWarning, match=f"took over the lock of {tmp_path} from {first.name}, which ended"):
        with run_folder(tmp_path, tiny_model().config) as folder:
            assert folder == tmp_path and (tmp_path / ".run.lock").read_text() == ME
    assert not (tmp_path / ".run.lock").exists()


@needs_flock
def test_a_lock_file_of_a_process_elsewhere_that_holds_no_lock_is_taken_over(tmp_path):
    (tmp_path / ".run.lock").write_text("process 4194301 on another-machine")
    with pytest.warns(UserWarning, match="from process 4194301 on another-machine, which ended without"):
        train_copy_task(steps=2, checkpoint_dir=tmp_path, **COPY)
    assert not (tmp_path / ".run.lock").exists() and list_checkpoints(tmp_path)


@needs_flock
def test_two_command_line_runs_started_at_once_one_is_refused(tmp_path):
    """The issue's reproducer: two runs in one folder at once used to both exit 0 with mixed checkpoints."""
    args = CLI_COPY + ["--steps", "100000", "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, "-m", "annotated_transformer", *args], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and all(run.poll() is None for run in runs):
            time.sleep(0.1)
        refused = [run for run in runs if run.poll() is not None]
        assert len(refused) == 1, "neither run was refused"
        running = next(run for run in runs if run is not refused[0])
        error = refused[0].stderr.read()
        assert refused[0].returncode == 2, error
        assert f"is in use by another run, process {running.pid} on {socket.gethostname()}" in error
        assert error.startswith("error: ") and "Traceback" not in error
        assert running.poll() is None  # the first goes on
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
            run.wait(timeout=60)
            run.stderr.close()


@needs_flock
@pytest.mark.parametrize("name_after", [0.3, None])
def test_a_run_refused_before_the_holder_wrote_its_name_waits_for_the_name(tmp_path, name_after):
    """The race that the test above met once: the holder has the lock but has not yet written its name. The refused
    run waits for the name a moment (up to 2 s), and says "a process" only if none comes."""
    import threading

    lock = tmp_path / folders.LOCK_FILE
    held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    folders.fcntl.flock(held, folders.fcntl.LOCK_EX | folders.fcntl.LOCK_NB)
    name = threading.Timer(name_after or 0, os.pwrite, (held, b"process 7 on elsewhere", 0))
    try:
        if name_after is not None:
            name.start()
        started = time.monotonic()
        with pytest.raises(ValueError, match="in use by another run, " +
                           ("process 7 on elsewhere" if name_after else "a process") + r" \(see"):
            with run_folder(tmp_path, tiny_model().config):
                pass
        assert (time.monotonic() - started > 1.5) == (name_after is None)
    finally:
        name.cancel()
        os.close(held)


@needs_flock
def test_the_same_folder_is_refused_to_a_second_run_in_the_same_process(tmp_path):
    with run_folder(tmp_path, {}):
        with pytest.raises(ValueError, match=f"in use by another run, {ME}"):
            with run_folder(tmp_path, {}):
                pass
    with run_folder(tmp_path, {}):  # free again
        pass


@needs_flock
def test_the_lock_is_released_on_exceptions_and_refusals(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError):
        with run_folder(tmp_path, {}):
            raise RuntimeError("the run failed")
    assert not (tmp_path / ".run.lock").exists()
    (tmp_path / "average.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="already holds average.pt"):  # refused by the check, after the lock
        with run_folder(tmp_path, {}):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["average.pt"]
    seen = []

    def interrupted(*args, **kwargs):
        seen.append((tmp_path / "copy" / ".run.lock").read_text())
        raise KeyboardInterrupt

    monkeypatch.setattr(copy_task, "train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_copy_task(steps=2, checkpoint_dir=tmp_path / "copy", **COPY)
    assert seen == [ME] and not (tmp_path / "copy" / ".run.lock").exists()  # held while training, then let go
    with run_folder(tmp_path / "copy", {}):
        pass


def test_the_other_processes_of_a_group_check_without_holding_or_cleaning(tmp_path):
    stale = leftover(tmp_path, "valid.json")
    with run_folder(tmp_path, {}, hold=False) as folder:
        assert folder == tmp_path and not (tmp_path / ".run.lock").exists() and stale.exists()
    with pytest.raises(ValueError, match="is a file"):
        with run_folder(stale, {}, hold=False):
            pass
    with run_folder(None, {}) as nothing:
        assert nothing is None


# 3. The next run removes the leftovers of killed writes, and nothing else ---------------------------------

USERS = (".notes.tmp", ".valid.json.abc.tmp", ".average.pt.ABCDEFGH.tmp", "average.pt.tmp", "x.tmp",
         ".step_00000002.pt.abcdefgh.tmp.keep", ".results.json.abcdefgh.tmp", ".model.pt.abcdefgh.tmp")


@pytest.mark.parametrize("resume", [False, True])
def test_the_next_run_removes_every_leftover_of_its_writes_and_nothing_else(tmp_path, resume):
    if resume:
        train_copy_task(steps=2, checkpoint_dir=tmp_path, checkpoint_every=1, **COPY)
    killed = [leftover(tmp_path, name) for name in ("step_00000003.pt", *RUN_FILES, "write-test")]
    for name in USERS:
        (tmp_path / name).write_text("a user's file")
    with pytest.warns(UserWarning, match=rf"removed {len(killed)} temporary file\(s\) of killed writes") as caught:
        train_copy_task(steps=4, checkpoint_dir=tmp_path, checkpoint_every=1, resume=resume, **COPY)
    said = next(str(w.message) for w in caught if "removed" in str(w.message))
    assert sorted(said.split(f"{tmp_path}: ")[1].split(", ")) == sorted(path.name for path in killed)
    assert not any(path.exists() for path in killed) and all((tmp_path / name).exists() for name in USERS)


def test_without_flock_a_run_leaves_the_temporary_files_it_cannot_know_are_dead(tmp_path, monkeypatch):
    """Where a run cannot hold its folder (Windows), a temporary file may be another run's live write: removing it
    would make that run fail to save what it made. It stays, and the run goes on."""
    monkeypatch.setattr(folders, "fcntl", None)
    train_copy_task(steps=2, checkpoint_dir=tmp_path, checkpoint_every=1, **COPY)
    writing = leftover(tmp_path, "step_00000003.pt")  # perhaps a live run's
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="removed")  # no "removed ... temporary file(s)"
        train_copy_task(steps=4, checkpoint_dir=tmp_path, checkpoint_every=1, resume=True, **COPY)
    assert writing.exists() and not (tmp_path / ".run.lock").exists()


def test_leftover_names_are_exactly_those_of_write_atomically(tmp_path):
    names = []

    def write(stream):
        names.extend(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp"))
        stream.write(b"x")

    for name in ("step_00000001.pt", *RUN_FILES):
        for _ in range(20):
            write_atomically(tmp_path / name, write)
    assert len(names) == 20 * (1 + len(RUN_FILES)) and all(LEFTOVER_NAME.match(name) for name in names)
    assert not any(LEFTOVER_NAME.match(name) for name in USERS)
    handle, probe = tempfile.mkstemp(dir=tmp_path, prefix=".write-test.", suffix=".tmp")  # check_run_folder's
    os.close(handle)
    assert LEFTOVER_NAME.match(Path(probe).name)


# 4. An intact checkpoint of an unexpected structure is one CheckpointError ---------------------------------

def rewritten(tmp_path, name, **parts) -> Path:
    """A checkpoint with some parts replaced and a checksum that matches, as another version might write."""
    source = save_checkpoint(tmp_path / "source.pt", model=tiny_model(), step=3)
    state = {key: value for key, value in load_checkpoint(source).items() if key != "checksum"}
    state.update(parts)
    if parts.get("model", ...) is None:
        del state["model"]
    state["checksum"] = content_digest(state)
    torch.save(state, tmp_path / name)
    return tmp_path / name


STRUCTURES = {
    "a later version's setting": (dict(config={**tiny_model().config, "rotary": True}), "rotary"),
    "config a list": (dict(config=["d_model", 16]), "'config'"),
    "extra a list": (dict(extra=[1, 2]), "'extra'"),
    "step a string": (dict(step="3"), "'step'"),
    "no model": (dict(model=None), "'model'"),
    "model a list": (dict(model=[1]), "'model'"),
    "optimizer a list": (dict(optimizer=[]), "'optimizer'"),
    "rng empty": (dict(rng=[]), "'rng'"),
    "rng of numbers": (dict(rng=[1, 2]), "'rng'"),
    "settings a list": (dict(extra={"settings": ["seed", 0]}), "'settings'"),
}


@pytest.mark.parametrize("kind", STRUCTURES)
def test_an_unexpected_structure_is_one_checkpoint_error(tmp_path, kind):
    parts, named = STRUCTURES[kind]
    bad = rewritten(tmp_path, "bad.pt", **parts)
    for load in (load_checkpoint, lambda p: model_from_checkpoint(p, device="cpu")):
        with pytest.raises(CheckpointError) as caught:
            load(bad)
        message = str(caught.value)
        assert str(bad) in message and "holds what this version cannot use" in message and named in message
        assert "\n" not in message
    assert checkpoint_problem(bad) == message


def test_the_command_line_reports_a_later_versions_checkpoint_in_one_line(tmp_path, capsys):
    bad = rewritten(tmp_path, "later.pt", config={**tiny_model().config, "rotary": True})
    (tmp_path / "input.txt").write_text("3 4 5\n")
    assert main(["translate", "--checkpoint", str(bad), "--device", "cpu", "--input", str(tmp_path / "input.txt")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and str(bad) in error and "rotary" in error and "Traceback" not in error


def test_resuming_skips_a_newest_checkpoint_of_an_unexpected_structure(tmp_path):
    train_copy_task(steps=2, checkpoint_dir=tmp_path, checkpoint_every=1, **COPY)
    state = {k: v for k, v in load_checkpoint(checkpoint_path(tmp_path, 2)).items() if k != "checksum"}
    state["extra"] = {**state["extra"], "settings": ["not", "a", "dict"]}
    state["checksum"] = content_digest(state)
    torch.save(state, checkpoint_path(tmp_path, 2))
    with pytest.warns(UserWarning, match="skipped 1 damaged checkpoint.*'settings'"):
        _, history = train_copy_task(steps=3, checkpoint_dir=tmp_path, checkpoint_every=1, resume=True, **COPY)
    assert history["step"] == [1, 2, 3]


# 5. The checkpoint named after a resume past a damaged one -------------------------------------------------

def damaged_run(tmp_path) -> Path:
    run = tmp_path / "run"
    train_copy_task(steps=8, checkpoint_dir=run, checkpoint_every=4, **COPY)
    damage(checkpoint_path(run, 8))
    return run


@pytest.mark.parametrize("steps, named", [(6, 6), (4, 4)])
def test_the_intact_checkpoint_is_named_after_a_resume_past_a_damaged_one(tmp_path, steps, named):
    run = damaged_run(tmp_path)
    with pytest.warns(UserWarning, match="skipped 1 damaged"):
        train_copy_task(steps=steps, checkpoint_dir=run, checkpoint_every=4, resume=True, **COPY)
    assert latest_checkpoint(run) == checkpoint_path(run, 8)  # the damaged file stays, as evidence
    assert latest_checkpoint(run, intact=True) == checkpoint_path(run, named)
    with pytest.raises(NonFiniteLossError, match=str(checkpoint_path(run, named))):
        trainer.check_finite(named + 1, float("nan"), None, run)


def test_the_command_line_names_the_checkpoint_it_wrote_after_a_resume_past_a_damaged_one(tmp_path, capsys):
    run = damaged_run(tmp_path)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(CLI_COPY + ["--steps", "6", "--checkpoint-every", "4", "--checkpoint-dir", str(run),
                                "--resume"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"checkpoint: {checkpoint_path(run, 6)}"
