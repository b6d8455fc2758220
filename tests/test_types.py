"""Type hints of the public API (the names in ``annotated_transformer.__all__``): every public function, and the
public methods of every public class, annotate all their parameters and their result, and mypy finds no error in
the modules that hold them ([tool.mypy] in pyproject.toml lists them; PyTorch's types count as Any there)."""
from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import annotated_transformer
from annotated_transformer import _API

ROOT = Path(__file__).resolve().parents[1]
MYPY = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]


def unannotated(function) -> list[str]:
    """The parameters of ``function`` without a type (not self, cls, *args, **kwargs), and "return" when the
    result has none (``__init__`` returns nothing to annotate)."""
    signature = inspect.signature(function)
    missing = [p.name for p in signature.parameters.values()
               if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               and p.annotation is inspect.Parameter.empty]
    if signature.return_annotation is inspect.Signature.empty and function.__name__ != "__init__":
        missing.append("return")
    return missing


def public_callables() -> dict[str, object]:
    """Each public function, and each public class's ``__init__``, ``forward``, ``__call__`` and public methods
    defined in the class itself."""
    found = {}
    for name in _API:
        obj = getattr(annotated_transformer, name)
        if inspect.isclass(obj):
            for attribute, value in vars(obj).items():
                if inspect.isfunction(value) and (not attribute.startswith("_")
                                                  or attribute in ("__init__", "__call__")):
                    found[f"{name}.{attribute}"] = value
        elif inspect.isfunction(obj):
            found[name] = obj
    return found


def test_the_public_api_is_annotated():
    callables = public_callables()
    assert len(callables) > len(_API)  # the classes' methods too
    missing = {name: gaps for name, function in callables.items() if (gaps := unannotated(function))}
    assert not missing, f"public callables without type hints: {missing}"


def test_the_check_finds_a_missing_hint():
    def typed(x: int, *args, flag: bool = False, **kwargs) -> int:
        return x

    def untyped(x, flag: bool = False):
        return x

    assert unannotated(typed) == [] and unannotated(untyped) == ["x", "return"]


def test_mypy_checks_the_modules_of_the_public_api():
    modules = {f"annotated_transformer/{module}.py" for module in _API.values()}
    assert set(MYPY["files"]) == modules, "pyproject's [tool.mypy] files are not the public modules"


def mypy(*args: str, cache: Path) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: it comes with the test dependencies (make setup)", pytrace=False)
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_mypy_finds_no_error_and_reports_a_type_error(tmp_path):
    done = mypy(cache=tmp_path / "cache")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Success: no issues found in" in done.stdout
    # the same configuration reports a wrong call, so a passing run means something (the cache makes it quick)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("from annotated_transformer.masks import subsequent_mask\n\nsubsequent_mask('three')\n")
    done = mypy("--config-file", str(ROOT / "pyproject.toml"), str(wrong), cache=tmp_path / "cache")
    assert done.returncode == 1 and "arg-type" in done.stdout, done.stdout
