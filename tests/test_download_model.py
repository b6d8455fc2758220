"""`python -m annotated_transformer download-model` against a local web server that plays a release: fetched and
verified, refused in one line when the bytes differ from their digest, a useful line when there is no release, and a
download that fails halfway leaves the earlier release whole."""
from __future__ import annotations

import hashlib
import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from annotated_transformer.download import MODEL_FILES, MODEL_SUMS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def release(tmp_path):
    """A folder served on the loopback interface as a release: the model files and their SHA256SUMS."""
    folder = tmp_path / "release"
    folder.mkdir()
    contents = {"average.pt": b"weights" * 1000, "tokenizer.model": b"pieces" * 100,
                "multi30k-laptop.json": json.dumps({"test": {"beam": {"bleu": 40.0}}}).encode()}
    assert set(contents) == set(MODEL_FILES)
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    (folder / MODEL_SUMS).write_text("".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n"
                                             for name, data in contents.items()))
    handler = lambda *args, **kwargs: http.server.SimpleHTTPRequestHandler(*args, directory=str(folder), **kwargs)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


def download(url: str, model_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "annotated_transformer", "download-model", "--url", url,
                           "--model-dir", str(model_dir)], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_download_model_fetches_verifies_and_says_how_to_translate(release, tmp_path):
    folder, url = release
    done = download(url, tmp_path / "model")
    assert done.returncode == 0, done.stderr
    for name in MODEL_FILES:
        assert (tmp_path / "model" / name).read_bytes() == (folder / name).read_bytes()
    assert "BLEU 40.0" in done.stdout and f"translate --checkpoint {tmp_path / 'model' / 'average.pt'}" in done.stdout


def test_download_model_refuses_bytes_that_differ_in_one_line(release, tmp_path):
    folder, url = release
    (folder / "tokenizer.model").write_bytes(b"something else")
    done = download(url, tmp_path / "model")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: the download of")
    assert "tokenizer.model" in done.stderr and "nothing was saved" in done.stderr
    assert not (tmp_path / "model" / "tokenizer.model").exists()
    assert not list((tmp_path / "model").glob(".*.part"))


def test_download_model_without_a_release_says_so(tmp_path):
    done = download("http://127.0.0.1:9/", tmp_path / "model")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "is http://127.0.0.1:9/ a release of the translator" in done.stderr


@pytest.mark.parametrize("url, model_dir, expected", [
    ("notaurl", "model", "error: could not read notaurl/SHA256SUMS (unknown url type"),
    ("http://127.0.0.1:9/", "", "error: --model-dir is an empty path"),  # "" is not "here"
])
def test_download_model_refuses_a_bad_url_or_folder_in_one_line_naming_it(tmp_path, url, model_dir, expected):
    done = subprocess.run([sys.executable, "-m", "annotated_transformer", "download-model", "--url", url,
                           "--model-dir", model_dir], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(expected), done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("own", ["valid.json", ".run.lock", "average.pt", "multi30k-laptop.json"])
def test_download_model_replaces_no_file_that_no_download_made(release, tmp_path, own):
    """A training run's folder, a reader's own model or a record (book/results/ holds multi30k-laptop.json) is
    refused in one line, before anything is fetched; a folder that an earlier download filled is updated."""
    folder, url = release
    model = tmp_path / "model"
    model.mkdir()
    (model / own).write_bytes(b"the reader's own")
    done = download(url, model)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert str(model) in done.stderr and ("training run" in done.stderr or "no earlier download" in done.stderr)
    assert [path.name for path in model.iterdir()] == [own] and (model / own).read_bytes() == b"the reader's own"


def test_download_model_updates_an_earlier_download(release, tmp_path):
    folder, url = release
    assert download(url, tmp_path / "model").returncode == 0
    (folder / "average.pt").write_bytes(b"newer weights")
    (folder / MODEL_SUMS).write_text("".join(f"{hashlib.sha256((folder / name).read_bytes()).hexdigest()}  {name}\n"
                                             for name in MODEL_FILES))
    done = download(url, tmp_path / "model")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "model" / "average.pt").read_bytes() == b"newer weights"
    assert (tmp_path / "model" / MODEL_SUMS).read_text() == (folder / MODEL_SUMS).read_text()


def test_download_model_that_fails_halfway_leaves_the_earlier_release_whole(release, tmp_path):
    """A new release whose second file fails after the first was fetched: the folder keeps the earlier release, not
    the new weights beside the old tokenizer, and the next call completes the new one."""
    folder, url = release
    model = tmp_path / "model"
    assert download(url, model).returncode == 0
    before = {name: (model / name).read_bytes() for name in MODEL_FILES}
    (folder / "average.pt").write_bytes(b"newer weights")
    (folder / "tokenizer.model").write_bytes(b"newer pieces")
    sums = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in MODEL_FILES}
    (folder / MODEL_SUMS).write_text("".join(f"{sums[name]}  {name}\n" for name in MODEL_FILES))
    (folder / "tokenizer.model").write_bytes(b"a broken copy")  # not what the sums say
    done = download(url, model)
    assert done.returncode == 2 and "tokenizer.model" in done.stderr, done.stderr
    assert {name: (model / name).read_bytes() for name in MODEL_FILES} == before
    (folder / "tokenizer.model").write_bytes(b"newer pieces")
    done = download(url, model)
    assert done.returncode == 0, done.stderr
    assert (model / "average.pt").read_bytes() == b"newer weights"
    assert (model / "tokenizer.model").read_bytes() == b"newer pieces"
    assert sorted(path.name for path in model.iterdir()) == sorted([*MODEL_FILES, MODEL_SUMS])
