"""The maintainers' scripts: chapters as plain scripts, and the steps that record the GPU figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def run_script(*args, env=None, timeout=300):
    return subprocess.run(list(args), cwd=ROOT, env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                          timeout=timeout)


def test_chapters_become_scripts_with_future_imports_at_the_top(tmp_path):
    pytest.importorskip("jupytext")
    done = run_script(sys.executable, str(SCRIPTS / "chapter_scripts.py"), "write", str(tmp_path), "appendix_runtime",
                      "masking")
    assert done.returncode == 0, done.stderr
    scripts = sorted(tmp_path.glob("*.py"))
    assert [path.name for path in scripts] == ["02_masking.py", "22_appendix_runtime.py"]
    for path in scripts:
        source = path.read_text()
        code = [line for line in source.splitlines() if line and not line.startswith("#")]
        assert code[0] == "from __future__ import annotations"
        assert source.count("from __future__ import annotations") == 1
        compile(source, str(path), "exec")  # a misplaced __future__ import is a SyntaxError


def test_running_chapter_scripts_reports_passes_and_failures(tmp_path):
    folder = tmp_path / "chapters"
    folder.mkdir()
    (folder / "00_good.py").write_text("from pathlib import Path\nassert Path('results').is_dir()  # runs in book/\n")
    (folder / "01_bad.py").write_text("assert 1 + 1 == 3, 'arithmetic is broken'\n")
    report = tmp_path / "report.json"
    done = run_script(sys.executable, str(SCRIPTS / "chapter_scripts.py"), "run", str(folder), "--report", str(report))
    assert done.returncode == 1
    assert "arithmetic is broken" in done.stdout
    rows = {row["chapter"]: row["status"] for row in json.loads(report.read_text())["chapters"]}
    assert rows == {"good": "passed", "bad": "failed (exit 1)"}
    only_good = run_script(sys.executable, str(SCRIPTS / "chapter_scripts.py"), "run", str(folder), "good")
    assert only_good.returncode == 0, only_good.stdout


def test_a_killed_chapter_script_says_so(tmp_path):
    (tmp_path / "00_oom.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer\n")
    done = run_script(sys.executable, str(SCRIPTS / "chapter_scripts.py"), "run", str(tmp_path))
    assert done.returncode == 1 and "killed by signal 9" in done.stdout


def test_a_slow_chapter_script_times_out(tmp_path):
    (tmp_path / "00_slow.py").write_text("import time\ntime.sleep(30)\n")
    done = run_script(sys.executable, str(SCRIPTS / "chapter_scripts.py"), "run", str(tmp_path), "--timeout", "1")
    assert done.returncode == 1 and "timed out after 1 s" in done.stdout


def test_record_gpu_script_without_a_step_prints_its_usage():
    done = run_script("bash", str(SCRIPTS / "record_gpu.sh"))
    assert done.returncode == 2
    assert "translation" in done.stdout and "checks" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_record_gpu_script_refuses_to_record_without_a_gpu(tmp_path):
    done = run_script("bash", str(SCRIPTS / "record_gpu.sh"), "checks",
                      env={"PYTHON": sys.executable, "OUT": str(tmp_path), "AT_DEVICE": "cuda"})
    assert done.returncode != 0
    assert "no CUDA device" in done.stdout + done.stderr
    assert not (tmp_path / "bench_gpu.json").exists()


STAND_IN = """#!{python}
# the interpreter for a dry run of `record_gpu.sh session`: the package's commands and pytest are stood in for
# (a benchmark writes its sections, the training section hangs), anything else runs in the real interpreter
import json, os, sys, time
args = sys.argv[1:]
if args[:2] == ["-m", "pytest"]:
    print("52 passed")
elif args[:3] == ["-m", "annotated_transformer", "train"]:
    print("copy exact-match (greedy, 1000 random sequences): 99.8%")
elif args[:3] == ["-m", "annotated_transformer", "bench"]:
    after = args[args.index("--only") + 1:]
    sections = after[:next(i for i, arg in enumerate(after) if arg.startswith("--"))]
    if "training" in sections:
        time.sleep(600)
    with open(args[args.index("--json") + 1], "w") as out:
        json.dump(dict(meta={{"command": " ".join(args)}}, **{{name: [] for name in sections}}), out)
else:
    os.execv({python!r}, [{python!r}, *args])
"""


def dry_session(tmp_path, **env):
    """`record_gpu.sh session 24` with the stand-in interpreter and two stand-in chapters; $OUT is tmp_path/out."""
    python = tmp_path / "python"
    python.write_text(STAND_IN.format(python=sys.executable))
    python.chmod(0o755)
    chapters = tmp_path / "chapters"
    chapters.mkdir()
    (chapters / "01_good.py").write_text("print('a chapter')\n")
    (chapters / "16_translation.py").write_text("raise SystemExit('the session leaves translation out')\n")
    return run_script("bash", str(SCRIPTS / "record_gpu.sh"), "session", "24", timeout=120, env={
        "PYTHON": str(python), "OUT": str(tmp_path / "out"), "AT_DEVICE": "cpu", "CHAPTER_DIR": str(chapters),
        "ANNOTATED_TRANSFORMER_DATA": str(tmp_path), **env})


def test_record_gpu_session_runs_every_part_within_its_time(tmp_path):
    """The one-call session's own logic, in a few seconds: the package's commands are stood in for, the chapters
    are two stand-ins run by the real runner. Every part notes its exit status, translation is left out, each
    benchmark section lands in a file of its own under $OUT and nothing in book/results/, a section that hangs is
    stopped at its share of the time and stops nothing else, and at most 8 files come back."""
    out = tmp_path / "out"
    before = sorted((ROOT / "book" / "results").rglob("*"))
    done = dry_session(tmp_path, BENCH_PARTS="decoding@1:50,decoding:50,training:55,attention layers:100")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (out / "environment.txt").read_text()
    for part in ("CUDA tests: exit 0", "chapters: exit 0", "copy task: exit 0, copy exact-match",
                 "bench decoding --batch-sizes 1: exit 0", "bench decoding: exit 0",
                 "bench training --compile: exit 124", "bench attention layers: exit 0"):
        assert part in log, log
    rows = json.loads((out / "chapters-full.json").read_text())["chapters"]
    assert [row["chapter"] for row in rows] == ["good"]
    parts = (("decoding_batch1", {"decoding"}), ("decoding", {"decoding"}),
             ("attention_layers", {"attention", "layers"}))
    for name, sections in parts:
        assert set(json.loads((out / f"bench_{name}.json").read_text())) == {"meta", *sections}
    assert not (out / "bench_training.json").exists()
    assert sorted((ROOT / "book" / "results").rglob("*")) == before
    assert len(list(out.iterdir())) <= 8, sorted(out.iterdir())  # what a short GPU loan brings back


def test_record_gpu_sessions_default_benchmark_profiles_the_step_first(tmp_path):
    """Without BENCH_PARTS: the step's profile (eager and compiled), the shapes, then the compiled training step
    (which hangs in the stand-in and is stopped); each lands in a file of its own, at most 8 come back."""
    done = dry_session(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    log = (out / "environment.txt").read_text()
    for part in ("bench profile --compile: exit 0", "bench shapes: exit 0", "bench training --compile: exit 124"):
        assert part in log, log
    assert log.index("bench profile") < log.index("bench shapes") < log.index("bench training")
    profile = json.loads((out / "bench_profile.json").read_text())
    assert set(profile) == {"meta", "profile"} and "--compile" in profile["meta"]["command"].split()
    assert len(list(out.iterdir())) <= 8, sorted(out.iterdir())


CHECKS_STAND_IN = """#!{python}
# the interpreter for a dry run of `record_gpu.sh checks`: the CUDA tests fail, the benchmark hangs, the copy task
# passes; anything else (the environment's check) runs in the real interpreter
import os, sys, time
args = sys.argv[1:]
if args[:2] == ["-m", "pytest"]:
    print("1 failed, 51 passed")
    sys.exit(1)
elif args[:3] == ["-m", "annotated_transformer", "bench"]:
    time.sleep(600)
elif args[:3] == ["-m", "annotated_transformer", "train"]:
    print("copy exact-match (greedy, 1000 random sequences): 99.8%")
else:
    os.execv({python!r}, [{python!r}, *args])
"""


def test_record_gpu_checks_run_every_part_within_its_limit(tmp_path):
    """`record_gpu.sh checks`: a failing part and a part that hangs (stopped at CHECK_TIMEOUT, exit 124) stop
    nothing else, each part notes its exit status, and the step exits with the first failure."""
    python = tmp_path / "python"
    python.write_text(CHECKS_STAND_IN.format(python=sys.executable))
    python.chmod(0o755)
    out = tmp_path / "out"
    done = run_script("bash", str(SCRIPTS / "record_gpu.sh"), "checks", timeout=60, env={
        "PYTHON": str(python), "OUT": str(out), "AT_DEVICE": "cpu", "CHECK_TIMEOUT": "3",
        "ANNOTATED_TRANSFORMER_DATA": str(tmp_path)})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    log = (out / "environment.txt").read_text()
    for part in ("CUDA tests: exit 1", "bench: exit 124", "copy task: exit 0"):
        assert part in log, log
    assert "copy exact-match" in (out / "copy-amp.log").read_text()
