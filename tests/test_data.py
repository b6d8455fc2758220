"""Multi30k loading, the joint SentencePiece tokenizer and batching (book/data.md), and the download, checksums and
caching behind the loading (book/appendix_data.md).

The data come from the folder that tests/local_data.py finds (ANNOTATED_TRANSFORMER_DATA, which CI sets; else
../shared/datasets/multi30k beside the repository, or the download cache). The download path is exercised with file:// URLs and a patched urlopen: no network is needed. Tokenizers are trained
into a temporary cache.
"""
from __future__ import annotations

import contextlib
import gzip
import http.client
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from annotated_transformer import data, download
from annotated_transformer.data import (
    BOS_ID, EOS_ID, PAD_ID, UNK_ID, EpochBatches, collate, encode_pairs, load_split, load_tokenizer, normalize,
    pad_sequences, padded_lengths, read_lines, tokenizer_from_tensor, tokenizer_to_tensor, train_tokenizer,
)
from annotated_transformer.download import DATA_ENV, MULTI30K_FILES, fetch

from local_data import FOLDER, needs_data


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache for the tokenizers of this module; the data come from FOLDER."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ANNOTATED_TRANSFORMER_CACHE", str(folder))
        if FOLDER is not None:
            patch.setenv(DATA_ENV, str(FOLDER))
        yield folder


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No local data folder and an empty cache: fetch must download. Returns the cache folder."""
    monkeypatch.delenv(DATA_ENV, raising=False)
    monkeypatch.setenv("ANNOTATED_TRANSFORMER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.fixture(scope="module")
def train_pairs(cache):
    return load_split("train")


@pytest.fixture(scope="module")
def tokenizer(cache, train_pairs):
    return load_tokenizer(train_tokenizer(train_pairs, vocab_size=1000))


# ---------------------------------------------------------------- loading


@needs_data
def test_split_sizes_and_contents(cache):
    sizes = {split: len(load_split(split)) for split in ("train", "valid", "test")}
    assert sizes == {"train": 29_000, "valid": 1_014, "test": 1_000} == data.SPLIT_SIZES
    german, english = load_split("train")[0]
    assert german.startswith("Zwei junge weiße Männer") and english.startswith("Two young, White males")
    assert all(isinstance(s, str) and s for pair in load_split("test") for s in pair)


@needs_data
def test_local_folder_is_read_and_verified(tmp_path):
    for name in ("val.de.gz", "val.en.gz"):
        (tmp_path / name).write_bytes((FOLDER / name).read_bytes())
    assert fetch("val.de.gz", directory=tmp_path) == tmp_path / "val.de.gz"
    assert len(load_split("valid", directory=tmp_path)) == 1_014


@needs_data
def test_corrupted_local_file_is_refused(tmp_path):
    good = (FOLDER / "val.en.gz").read_bytes()
    (tmp_path / "val.en.gz").write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    with pytest.raises(ValueError, match="SHA-256") as error:
        fetch("val.en.gz", directory=tmp_path)
    assert MULTI30K_FILES["val.en.gz"] in str(error.value)


def test_missing_file_in_local_folder_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="train.de.gz is not in") as error:
        fetch("train.de.gz")
    assert DATA_ENV in str(error.value)


@needs_data
def test_download_from_a_url_is_verified_and_cached(tmp_path, offline):
    server = tmp_path / "server"
    server.mkdir()
    (server / "test_2016_flickr.en.gz").write_bytes((FOLDER / "test_2016_flickr.en.gz").read_bytes())
    path = fetch("test_2016_flickr.en.gz", url=server.as_uri() + "/")
    assert path == offline / "multi30k" / "test_2016_flickr.en.gz"
    assert files_in(offline) == ["test_2016_flickr.en.gz"]
    # The second call uses the cache: the URL is not touched.
    assert fetch("test_2016_flickr.en.gz", url="file:///nowhere/") == path


@needs_data
@pytest.mark.parametrize("locks", [True, False])
def test_a_download_is_readable_as_an_ordinary_file_with_or_without_locks(tmp_path, offline, monkeypatch, locks):
    """The file gets the mode that open() would give (mkstemp makes 0600, unreadable to others sharing the
    cache), also on the branch without fcntl (Windows), which closes the file before its rename."""
    if not locks:
        monkeypatch.setattr(download, "fcntl", None)
    server = tmp_path / "server"
    server.mkdir()
    (server / "val.en.gz").write_bytes((FOLDER / "val.en.gz").read_bytes())
    umask = os.umask(0o022)
    os.umask(umask)
    path = fetch("val.en.gz", url=server.as_uri() + "/")
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert files_in(offline) == ["val.en.gz"]


@needs_data
def test_corrupted_download_writes_nothing(tmp_path, offline):
    server = tmp_path / "server"
    server.mkdir()
    good = (FOLDER / "val.en.gz").read_bytes()
    (server / "val.en.gz").write_bytes(good[:200] + bytes([good[200] ^ 1]) + good[201:])
    with pytest.raises(ValueError, match="SHA-256"):
        fetch("val.en.gz", url=server.as_uri() + "/")
    assert files_in(offline) == []  # neither val.en.gz nor a .part file


def test_offline_message_says_what_to_do(offline, monkeypatch):
    def no_network(*args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    with pytest.raises(FileNotFoundError) as error:
        fetch("train.en.gz")
    message = str(error.value)
    assert "train.en.gz" in message and download.MULTI30K_URL in message
    assert DATA_ENV in message and str(offline / "multi30k") in message
    assert files_in(offline) == []


@pytest.mark.parametrize("failure", [PermissionError(13, "Permission denied", "/cache/multi30k/x"),
                                     OSError(28, "No space left on device")])
def test_a_disk_that_takes_no_file_is_no_network_failure(offline, monkeypatch, failure):
    """A read-only cache or a full disk was reported as a network failure, with the advice to put the file into the
    very folder that could not be written."""
    def refuse(*args, **kwargs):
        raise failure

    monkeypatch.setattr(download, "download", refuse)
    with pytest.raises(OSError) as error:
        fetch("train.en.gz")
    assert not isinstance(error.value, FileNotFoundError) and "without a network" not in str(error.value)
    assert error.value.filename  # the file it concerns


def test_a_file_missing_from_the_directory_argument_says_what_to_change(tmp_path, monkeypatch):
    """The advice was to unset the environment variable, which changes nothing for a directory argument."""
    monkeypatch.delenv(DATA_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match="set by the directory argument.*or pass no directory to download"):
        fetch("train.en.gz", directory=tmp_path)


@pytest.mark.parametrize("failure", [
    ConnectionResetError("connection reset by peer"),
    http.client.IncompleteRead(b""),  # a chunked response cut off: not an OSError
])
def test_interrupted_download_leaves_no_partial_file(offline, monkeypatch, failure):
    class Broken:
        headers = {}  # no Content-Length

        def __init__(self):
            self.calls = 0

        def read(self, size):
            self.calls += 1
            if self.calls > 2:
                raise failure
            return b"x" * size

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: Broken())
    with pytest.raises(FileNotFoundError, match="could not download val.de.gz"):
        fetch("val.de.gz")
    assert files_in(offline) == []



@needs_data
def test_corrupted_download_message_names_the_url_and_the_final_path_not_a_part_file(tmp_path, offline):
    server = tmp_path / "server"
    server.mkdir()
    good = (FOLDER / "val.de.gz").read_bytes()
    (server / "val.de.gz").write_bytes(good[:50] + bytes([good[50] ^ 1]) + good[51:])
    with pytest.raises(ValueError) as error:
        fetch("val.de.gz", url=server.as_uri() + "/")
    message = str(error.value)
    assert f"the download of {server.as_uri()}/val.de.gz has SHA-256" in message
    assert f"nothing was saved to {offline / 'multi30k' / 'val.de.gz'}" in message and DATA_ENV in message
    assert ".part" not in message and MULTI30K_FILES["val.de.gz"] in message
    assert files_in(offline) == []


def make_part(folder: Path, name: str, age_seconds: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f".{name}.{int(age_seconds)}x.part"
    part.write_bytes(b"the first blocks")
    then = time.time() - age_seconds
    os.utime(part, (then, then))
    return part


@contextlib.contextmanager
def held(part: Path):
    """Another process holds the lock of ``part``, as a download still running does."""
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'ab'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
                               str(part)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield part
    finally:
        holder.kill()
        holder.wait()


@needs_data
def test_fetch_removes_stale_part_files_of_killed_downloads(tmp_path, offline):
    server = tmp_path / "server"
    server.mkdir()
    (server / "val.de.gz").write_bytes((FOLDER / "val.de.gz").read_bytes())
    cache = offline / "multi30k"
    stale = make_part(cache, "val.de.gz", 1)                                  # a download killed a moment ago
    live = make_part(cache, "val.de.gz", 5)                                   # another process, still writing
    other = make_part(cache, "val.en.gz", 3600)                               # another file's: not this fetch's
    with held(live):
        path = fetch("val.de.gz", url=server.as_uri() + "/")
    assert not stale.exists() and live.exists() and other.exists()
    assert files_in(offline) == sorted([live.name, other.name, "val.de.gz"])
    # A cached file is cleaned around too, without a download.
    stale = make_part(cache, "val.de.gz", 3600)
    assert fetch("val.de.gz", url="file:///nowhere/") == path and not stale.exists()


def served_blob(tmp_path: Path) -> tuple[str, str]:
    """A file to download, by URL, and its SHA-256."""
    blob = tmp_path / "server" / "blob"
    blob.parent.mkdir()
    blob.write_bytes(b"some bytes to download" * 1000)
    return blob.as_uri(), download.sha256(blob)


@pytest.mark.skipif(download.fcntl is None, reason="without locks, a new file is young: age decides")
@pytest.mark.parametrize("cleaner_holds_the_lock", [False, True])
def test_a_cleaner_between_a_new_part_file_and_its_lock_costs_only_a_new_name(
        tmp_path, monkeypatch, cleaner_holds_the_lock):
    """Another fetch cleans up in the instant after mkstemp, before the download's lock: the file looks abandoned and is
    deleted. The download notices (its path no longer names its file) and starts again, instead of writing into a file
    without a name and failing at the rename. With the cleaner still holding the lock, the download waits for it."""
    url, digest = served_blob(tmp_path)
    destination = tmp_path / "cache" / "blob"
    real_mkstemp, made = download.tempfile.mkstemp, []

    def mkstemp_then_a_cleaner(*args, **kwargs):
        handle, temporary = real_mkstemp(*args, **kwargs)
        made.append(temporary)
        if len(made) == 1 and not cleaner_holds_the_lock:
            assert download.remove_stale_parts(destination) == [Path(temporary)]
        elif len(made) == 1:
            locked, done = threading.Event(), threading.Event()

            def cleaner():
                with open(temporary, "r+b") as stream:
                    locks = download.fcntl
                    locks.flock(stream.fileno(), locks.LOCK_EX | locks.LOCK_NB)
                    locked.set()
                    time.sleep(0.3)  # the download's lock waits meanwhile
                    os.unlink(temporary)
                done.set()

            threading.Thread(target=cleaner, daemon=True).start()
            assert locked.wait(10)
        return handle, temporary

    monkeypatch.setattr(download.tempfile, "mkstemp", mkstemp_then_a_cleaner)
    assert download.download(url, destination, "blob", expected=digest) == destination
    assert download.sha256(destination) == digest and len(made) == 2
    assert sorted(p.name for p in destination.parent.iterdir()) == ["blob"]


def test_a_killed_download_leaves_a_part_file_that_the_next_fetch_removes(tmp_path):
    """kill -9 in the middle of a download: the lock dies with the process, so the file is known to be abandoned."""
    part = make_part(tmp_path, "val.de.gz", 0)
    with held(part):
        assert download.remove_stale_parts(tmp_path / "val.de.gz") == [] and part.exists()
    assert download.remove_stale_parts(tmp_path / "val.de.gz") == [part] and not part.exists()


def test_remove_stale_parts_returns_what_it_removed_and_tolerates_races(tmp_path, monkeypatch):
    destination = tmp_path / "train.en.gz"
    old, new = make_part(tmp_path, "train.en.gz", 700), make_part(tmp_path, "train.en.gz", 10)
    monkeypatch.setattr(download, "fcntl", None)  # without locks (Windows), age decides
    assert download.remove_stale_parts(destination) == [old] and new.exists()
    assert download.remove_stale_parts(destination, older_than=1) == [new]
    assert download.remove_stale_parts(tmp_path / "missing" / "train.en.gz") == []   # no folder yet
    vanished = make_part(tmp_path, "train.en.gz", 700)
    real_unlink = Path.unlink

    def removed_by_another_process(self, *args, **kwargs):
        real_unlink(self)
        raise FileNotFoundError(self)

    monkeypatch.setattr(Path, "unlink", removed_by_another_process)
    assert download.remove_stale_parts(destination) == [] and not vanished.exists()


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="unknown Multi30k file"):
        fetch("train.fr.gz")
    with pytest.raises(ValueError, match="split must be one of"):
        load_split("dev")
    with pytest.raises(ValueError, match="ending in '/'"):
        fetch("val.de.gz", url="https://example.org/data")


def test_mismatched_line_counts_are_refused(tmp_path, monkeypatch):
    for name, lines in (("val.de.gz", ["a", "b"]), ("val.en.gz", ["a"])):
        with gzip.open(tmp_path / name, "wt", encoding="utf-8") as stream:
            stream.write("\n".join(lines) + "\n")
    monkeypatch.setattr(download, "verify", lambda path, name: path)  # these are not the real files
    with pytest.raises(ValueError, match="2 German lines but 1 English lines"):
        load_split("valid", directory=tmp_path)


def test_read_lines_plain_and_gzip(tmp_path):
    lines = ["Ein Hund läuft.", "", "Zwei Männer\tlachen.", "ﬁ\u00a0x  "]
    text = "".join(line + "\n" for line in lines)
    (tmp_path / "a.de").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "a.de.gz", "wt", encoding="utf-8") as stream:
        stream.write(text)
    assert read_lines(tmp_path / "a.de") == lines == read_lines(str(tmp_path / "a.de.gz"))
    (tmp_path / "crlf.en").write_bytes(b"one\r\ntwo\r\nthree")  # Windows line ends, no final line end
    assert read_lines(tmp_path / "crlf.en") == ["one", "two", "three"]
    (tmp_path / "cr.en").write_bytes(b"a\rb\n")  # only \n ends a line
    assert read_lines(tmp_path / "cr.en") == ["a\rb"]
    (tmp_path / "empty.en").write_bytes(b"")
    assert read_lines(tmp_path / "empty.en") == []


def test_read_lines_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file at .*missing.de"):
        read_lines(tmp_path / "missing.de")
    with pytest.raises(FileNotFoundError, match="is a folder"):
        read_lines(tmp_path)
    bad = "Ein Hund.\nZwei Hunde.\nDrei Männer.\n".encode("latin-1")
    (tmp_path / "bad.de").write_bytes(bad)
    with pytest.raises(ValueError, match=r"line 3 of .*bad\.de is not UTF-8"):
        read_lines(tmp_path / "bad.de")
    with gzip.open(tmp_path / "bad.de.gz", "wb") as stream:
        stream.write(bad)
    with pytest.raises(ValueError, match=r"line 3 of .*bad\.de\.gz is not UTF-8"):
        read_lines(tmp_path / "bad.de.gz")
    (tmp_path / "plain.de.gz").write_text("not compressed\n", encoding="utf-8")
    with pytest.raises(ValueError, match="plain.de.gz is not a UTF-8 text file compressed with gzip"):
        read_lines(tmp_path / "plain.de.gz")
    (tmp_path / "cut.de.gz").write_bytes(gzip.compress(b"Ein Hund.\n" * 1000)[:-20])
    with pytest.raises(ValueError, match="cut.de.gz is not a UTF-8 text file compressed with gzip"):
        read_lines(tmp_path / "cut.de.gz")
    damaged = bytearray(gzip.compress("".join(f"Satz {i}.\n" for i in range(5000)).encode()))
    damaged[200:260] = bytes(60)
    (tmp_path / "damaged.de.gz").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="damaged.de.gz"):
        read_lines(tmp_path / "damaged.de.gz")


def test_read_lines_drops_a_byte_order_mark_at_the_start_only(tmp_path):
    text = "\ufeffEin Hund.\n\ufeffZwei Katzen.\n"
    (tmp_path / "bom.de").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "bom.de.gz", "wt", encoding="utf-8") as stream:
        stream.write(text)
    for name in ("bom.de", "bom.de.gz"):
        assert read_lines(tmp_path / name) == ["Ein Hund.", "\ufeffZwei Katzen."]  # a mark inside a file is text


def test_evaluate_scores_a_reference_with_a_byte_order_mark_as_without(tmp_path):
    from annotated_transformer.translation import bleu

    references = ["A dog runs in the park.", "Two men are talking."]
    (tmp_path / "src.de").write_text("\ufeffEin Hund rennt.\nZwei Männer reden.\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("\ufeff" + "".join(r + "\n" for r in references), encoding="utf-8")
    pairs = list(zip(read_lines(tmp_path / "src.de"), read_lines(tmp_path / "ref.en")))  # as evaluate reads them
    assert pairs[0] == ("Ein Hund rennt.", references[0])
    assert bleu(references, [english for _, english in pairs])[0].score == pytest.approx(100.0)


# ---------------------------------------------------------------- tokenizer


@needs_data
def test_tokenizer_special_ids_and_round_trip(tokenizer, cache):
    assert tokenizer.get_piece_size() == 1000
    assert [tokenizer.pad_id(), tokenizer.unk_id(), tokenizer.bos_id(), tokenizer.eos_id()] == [0, 1, 2, 3]
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    test = [side for pair in load_split("test") for side in pair]
    assert tokenizer.decode(tokenizer.encode(test)) == test  # the test sentences are already normalised
    valid = [side for pair in load_split("valid") for side in pair]
    assert tokenizer.decode(tokenizer.encode(valid)) == [normalize(s) for s in valid]
    assert not any(UNK_ID in ids for ids in tokenizer.encode(test + valid))


def test_normalize():
    assert normalize("  Ein  Hund\u00a0läuft. ") == "Ein Hund läuft."
    assert normalize("ﬁ") == "fi"  # NFKC


@needs_data
def test_tokenizer_is_cached_by_content_and_settings(tokenizer, train_pairs, cache):
    path = train_tokenizer(train_pairs, vocab_size=1000)
    mtime = path.stat().st_mtime_ns
    assert train_tokenizer(train_pairs, vocab_size=1000) == path and path.stat().st_mtime_ns == mtime
    assert path.parent == cache / "tokenizers"
    other = train_tokenizer(train_pairs[:2000], vocab_size=500)
    assert other != path and "500" in other.name


@needs_data
def test_the_same_text_makes_the_same_file_on_a_machine_with_other_cores(train_pairs, tmp_path, monkeypatch):
    """SentencePiece writes its number of threads into the file: trained with the machine's count of cores, the
    tokenizer of a run moved to a machine with more cores had another SHA-256, and its checkpoints refused to resume."""
    made = []
    for cores in (2, 16):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        made.append(train_tokenizer(train_pairs[:500], vocab_size=300, directory=tmp_path / str(cores)).read_bytes())
    assert made[0] == made[1]


@needs_data
def test_a_run_begun_with_a_tokenizer_of_another_thread_count_resumes_with_its_own(train_pairs, tmp_path, monkeypatch):
    """A run begun before the thread count was fixed named a file of other bytes but the same pieces: it goes on with
    the file beside its checkpoints; a tokenizer of other pieces is still refused."""
    pairs = train_pairs[:500]
    monkeypatch.setattr(data, "TRAINER_THREADS", 2)
    old = load_tokenizer(train_tokenizer(pairs, vocab_size=300, directory=tmp_path / "old"))
    monkeypatch.undo()
    run = tmp_path / "run"
    run.mkdir()
    data.write_tokenizer(run / "tokenizer.model", old)
    checkpoint = {"extra": {"tokenizer_sha256": data.tokenizer_digest(old)}}
    new = data.SentencePieces(load_tokenizer(train_tokenizer(pairs, vocab_size=300, directory=tmp_path / "new")))
    assert data.tokenizer_digest(new.processor) != data.tokenizer_digest(old)  # other bytes
    said = []
    data.keep_tokenizer(run, new, checkpoint, log=said.append)
    assert data.tokenizer_digest(new.processor) == data.tokenizer_digest(old) and "is kept" in said[0]
    other = data.SentencePieces(load_tokenizer(train_tokenizer(pairs[:300], vocab_size=300, directory=tmp_path)))
    with pytest.raises(ValueError, match="trained with another tokenizer than these settings make"):
        data.keep_tokenizer(run, other, checkpoint)
    newer = data.SentencePieces(load_tokenizer(train_tokenizer(pairs, vocab_size=300, directory=tmp_path / "new")))
    data.keep_tokenizer(run, newer, {"extra": {}})  # checkpoints that name no digest: the same
    assert data.tokenizer_digest(newer.processor) == data.tokenizer_digest(old)


@needs_data
@pytest.mark.parametrize("damage", ["cut off", "not a model", "empty", "another size"])
def test_a_bad_cached_tokenizer_is_trained_again_with_a_warning(train_pairs, tmp_path, damage):
    pairs = train_pairs[:500]
    path = train_tokenizer(pairs, vocab_size=300, directory=tmp_path)
    good = path.read_bytes()
    other = train_tokenizer(pairs, vocab_size=200, directory=tmp_path / "other").read_bytes()
    path.write_bytes({"cut off": good[: len(good) // 2], "not a model": b"<html>", "empty": b"",
                      "another size": other}[damage])
    with pytest.warns(UserWarning, match="the tokenizer cache held a bad file .*: training it again"):
        assert train_tokenizer(pairs, vocab_size=300, directory=tmp_path) == path
    assert path.read_bytes() == good                          # the same text and settings make the same file
    assert load_tokenizer(path).get_piece_size() == 300
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, "other"])  # no scratch file left


@needs_data
@pytest.mark.parametrize("size, message", [(9, r"at least (\d+)"), (100_000, r"at most (\d+)")])
def test_vocabulary_sizes_beyond_sentencepieces_limits_are_refused_with_the_limit(train_pairs, tmp_path, size,
                                                                                 message):
    pairs = train_pairs[:500]
    with pytest.raises(ValueError, match=r"vocab_size must be " + message + r" for this text.*got " + str(size)) as e:
        train_tokenizer(pairs, vocab_size=size, directory=tmp_path)
    limit = int(__import__("re").search(message, str(e.value))[1])
    assert load_tokenizer(train_tokenizer(pairs, vocab_size=limit, directory=tmp_path)).get_piece_size() == limit
    assert not list(tmp_path.glob(f"*-{size}-*"))


@needs_data
def test_training_removes_old_leftovers_of_killed_trainings_from_the_cache(train_pairs, tmp_path):
    old_folder, old_file = tmp_path / "tmpab12cd34", tmp_path / ".joint-bpe-300-0123.model.x1y2z3w4.tmp"
    new_folder, mine = tmp_path / "tmpfresh000", tmp_path / "tmpnotes"
    for folder in (old_folder, new_folder, mine):
        folder.mkdir()
        (folder / "corpus.txt").write_text("Ein Hund.\n")
    (mine / "notes.txt").write_text("a folder of the user's, not a scratch folder")
    old_file.write_bytes(b"half a model")
    hour_ago = time.time() - 3700
    for path in (old_folder, old_file, mine):
        os.utime(path, (hour_ago, hour_ago))
    with pytest.warns(UserWarning, match="removed 2 leftover"):
        train_tokenizer(train_pairs[:300], vocab_size=200, directory=tmp_path)
    assert not old_folder.exists() and not old_file.exists()
    assert new_folder.exists() and mine.exists()        # possibly a live training's; not a scratch folder


def test_a_damaged_tokenizer_file_is_refused_by_name(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="tokenizer.model cannot be read as a SentencePiece model: it is damaged"):
        load_tokenizer(tmp_path / "tokenizer.model")


def test_train_tokenizer_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer([("a", "b")], vocab_size=0, directory=tmp_path)
    with pytest.raises(ValueError, match="model_type"):
        train_tokenizer([("a", "b")], model_type="wordpiece", directory=tmp_path)
    with pytest.raises(ValueError, match="at least one sentence with text"):
        train_tokenizer([], directory=tmp_path)
    with pytest.raises(FileNotFoundError, match="no SentencePiece model"):
        load_tokenizer(tmp_path / "missing.model")


@needs_data
def test_tokenizer_survives_a_weights_only_checkpoint(tokenizer, tmp_path):
    torch.save({"tokenizer": tokenizer_to_tensor(tokenizer)}, tmp_path / "c.pt")
    restored = tokenizer_from_tensor(torch.load(tmp_path / "c.pt", weights_only=True)["tokenizer"])
    sentences = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]
    assert restored.encode(sentences) == tokenizer.encode(sentences)
    with pytest.raises(TypeError, match="uint8"):
        tokenizer_from_tensor(torch.zeros(3))


# ---------------------------------------------------------------- examples and batches


@needs_data
def test_encode_pairs_adds_the_special_symbols(tokenizer):
    pairs = [("Ein Hund.", "A dog."), ("Zwei Katzen schlafen auf dem Sofa.", "Two cats sleep on the sofa.")]
    examples = encode_pairs(pairs, tokenizer)
    for (german, english), (source, target) in zip(pairs, examples):
        assert source == tokenizer.encode(german) + [EOS_ID]
        assert target == [BOS_ID] + tokenizer.encode(english) + [EOS_ID]
    short = encode_pairs(pairs, tokenizer, max_len=len(examples[0][1]))
    assert short == examples[:1]
    with pytest.raises(ValueError, match="max_len"):
        encode_pairs(pairs, tokenizer, max_len=2)


def test_pad_and_collate():
    examples = [([5, 6, EOS_ID], [BOS_ID, 7, EOS_ID]), ([5, EOS_ID], [BOS_ID, 7, 8, 9, EOS_ID])]
    assert pad_sequences([[1, 2, 3], [4]]).tolist() == [[1, 2, 3], [4, 0, 0]]
    batch = collate(examples)
    assert batch.src.tolist() == [[5, 6, EOS_ID], [5, EOS_ID, PAD_ID]]
    assert batch.tgt.tolist() == [[BOS_ID, 7, EOS_ID, PAD_ID], [BOS_ID, 7, 8, 9]]
    assert batch.tgt_y.tolist() == [[7, EOS_ID, PAD_ID, PAD_ID], [7, 8, 9, EOS_ID]]
    assert batch.ntokens == 6
    assert batch.src_mask.tolist() == [[[True, True, True]], [[True, True, False]]]
    assert collate(examples, [1]).src.tolist() == [[5, EOS_ID]]
    with pytest.raises(ValueError, match="at least one"):
        pad_sequences([])


def test_epoch_batches_cover_each_example_once_per_epoch():
    generator = torch.Generator().manual_seed(1)
    examples = [([4] * int(n) + [EOS_ID], [BOS_ID] + [5] * int(m) + [EOS_ID])
                for n, m in torch.randint(1, 30, (500, 2), generator=generator).tolist()]
    batches = EpochBatches(examples, max_tokens=200, seed=3)
    n = len(batches)
    for epoch in (0, 1):
        seen = sorted(i for b in batches.epoch(epoch) for i in b)
        assert seen == list(range(len(examples)))
    assert batches.epoch(0) != batches.epoch(1)  # reshuffled
    for index in range(2 * n):
        batch = batches(index)
        assert batch.src.numel() <= 200 and batch.tgt.size(0) * (batch.tgt.size(1) + 1) <= 200
    again = EpochBatches(examples, max_tokens=200, seed=3)
    assert torch.equal(again(n + 5).src, batches(n + 5).src)  # a function of the batch number
    assert not torch.equal(EpochBatches(examples, 200, seed=4)(0).src, batches(0).src)
    with pytest.raises(ValueError, match="empty"):
        EpochBatches([], 100)


def test_pad_sequences_to_a_width_and_collate_to_a_multiple():
    assert pad_sequences([[1, 2, 3], [4]], width=5).tolist() == [[1, 2, 3, 0, 0], [4, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="width=2 is shorter than the longest sequence \\(3\\)"):
        pad_sequences([[1, 2, 3]], width=2)
    assert [padded_lengths(s, t, 8) for s, t in ((1, 2), (8, 9), (9, 10), (3, 17))] == [
        (8, 9), (8, 9), (16, 17), (8, 17)]
    assert padded_lengths(5, 7) == (5, 7)
    examples = [([5, 6, EOS_ID], [BOS_ID, 7, EOS_ID]), ([5, EOS_ID], [BOS_ID, 7, 8, 9, EOS_ID])]
    plain, rounded = collate(examples), collate(examples, multiple=4)
    assert rounded.src.shape == (2, 4) and rounded.tgt.shape == (2, 4) and rounded.tgt_y.shape == (2, 4)
    assert torch.equal(rounded.src[:, :3], plain.src) and (rounded.src[:, 3] == PAD_ID).all()
    assert torch.equal(rounded.tgt_y, plain.tgt_y) and rounded.ntokens == plain.ntokens
    assert rounded.src_mask[:, 0, :3].tolist() == plain.src_mask[:, 0].tolist()
    assert not rounded.src_mask[:, 0, 3].any()


@pytest.mark.parametrize("multiple", [8, 16])
def test_epoch_batches_rounded_to_a_multiple_keep_the_budget_and_have_fewer_shapes(multiple):
    generator = torch.Generator().manual_seed(1)
    sources = torch.randint(1, 40, (800,), generator=generator)  # targets of similar lengths
    targets = (sources + torch.randint(-3, 4, (800,), generator=generator)).clamp(min=1)
    examples = [([4] * n + [EOS_ID], [BOS_ID] + [5] * m + [EOS_ID])
                for n, m in zip(sources.tolist(), targets.tolist())]
    plain = EpochBatches(examples, max_tokens=400, seed=3)
    rounded = EpochBatches(examples, max_tokens=400, seed=3, multiple=multiple)
    shapes = {}
    for name, epoch in (("plain", plain), ("rounded", rounded)):
        batches = [epoch(i) for i in range(len(epoch))]
        assert sorted(i for b in epoch.epoch(0) for i in b) == list(range(len(examples)))
        for batch in batches:  # the budget counts the full target, one token longer than batch.tgt
            assert batch.src.numel() <= 400 and len(batch) * (batch.tgt.size(1) + 1) <= 400
        assert sum(b.ntokens for b in batches) == sum(len(t) - 1 for _, t in examples)
        shapes[name] = {(tuple(b.src.shape), tuple(b.tgt.shape)) for b in batches}
    for (src_shape, tgt_shape) in shapes["rounded"]:
        assert src_shape[1] % multiple == 0 and tgt_shape[1] % multiple == 0
    assert len(shapes["rounded"]) * 3 < len(shapes["plain"])
    assert len(rounded) >= len(plain)  # more padding, so at least as many batches


@pytest.mark.parametrize("multiple", [0, -8, 2.0, True, None])
def test_epoch_batches_refuse_a_bad_multiple(multiple):
    with pytest.raises(ValueError, match="multiple must be a positive integer"):
        EpochBatches([([4, EOS_ID], [BOS_ID, 5, EOS_ID])], 100, multiple=multiple)
