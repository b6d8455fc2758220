"""The root conftest.py gives each pytest-xdist worker one math thread, as `make test` does, unless
OMP_NUM_THREADS says otherwise: run directly with `pytest -n 2`, workers that each start a thread per core fight
over the cores (the book's chapters of small models ran several times more slowly so on this 2-core machine)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """\
import os


def test_threads():
    print("OMP_NUM_THREADS =", os.environ.get("OMP_NUM_THREADS"))
    assert os.environ.get("OMP_NUM_THREADS") == os.environ["EXPECTED_THREADS"]
"""


def run_pytest(folder: Path, files: dict[str, str], *options: str, passed: int, env=None) -> str:
    """pytest with pytest-xdist in ``folder``, holding the project's conftest.py and ``files``; its output, after
    checking that ``passed`` tests passed."""
    pytest.importorskip("xdist")
    shutil.copy(ROOT / "conftest.py", folder / "conftest.py")
    for name, text in files.items():
        (folder / name).write_text(text)
    done = subprocess.run([sys.executable, "-m", "pytest", *options, "-p", "no:cacheprovider"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and f"{passed} passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("given, expected", [(None, "1"), ("3", "3")])
def test_xdist_workers_get_one_math_thread_unless_told_otherwise(tmp_path, given, expected):
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env |= {"EXPECTED_THREADS": expected} | ({"OMP_NUM_THREADS": given} if given else {})
    run_pytest(tmp_path, {"test_probe.py": PROBE}, "-n", "2", "-q", passed=1, env=env)


def test_xdist_workers_take_the_files_of_slow_tests_first(tmp_path):
    """Under `--dist loadfile` a file of slow tests goes first, whatever its size and place (conftest.py)."""
    files = {
        "pytest.ini": "[pytest]\nmarkers =\n    slow: slow\n",
        "test_a_many.py": "".join(f"def test_quick_{i}():\n    pass\n\n\n" for i in range(5)),
        "test_b_few.py": "import pytest\n\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n",
        "test_c_one.py": "def test_other():\n    pass\n",
    }
    out = run_pytest(tmp_path, files, "-n", "1", "--dist", "loadfile", "-v", passed=7)
    ran = [line.split()[-1] for line in out.splitlines() if line.startswith("[gw0]") and "PASSED" in line]
    assert [name.split("::")[0] for name in ran] == ["test_b_few.py"] + 5 * ["test_a_many.py"] + ["test_c_one.py"]
