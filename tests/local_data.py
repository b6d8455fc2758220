"""Where the tests find the Multi30k files: the folder named by ANNOTATED_TRANSFORMER_DATA where it is set; else the
shared folder beside the repository (../shared/datasets/multi30k), then the download cache, where `make test`'s data
step or a chapter fetched them. The tests that need the files skip without them, but fail where AT_REQUIRE_DATA=1
(`make test` and `make unit` set it, after fetching the files): a run that has the data must not pass by skipping
the tests that read it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from annotated_transformer.download import DATA_ENV, MULTI30K_FILES, cache_dir

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "AT_REQUIRE_DATA"


def multi30k_folder() -> Path | None:
    """The first folder with every Multi30k file, None where there is none (and AT_REQUIRE_DATA is not 1)."""
    named = os.environ.get(DATA_ENV)
    places = [Path(named)] if named else [ROOT.parent / "shared" / "datasets" / "multi30k", cache_dir() / "multi30k"]
    for place in places:
        if all((place / name).is_file() for name in MULTI30K_FILES):
            return place
    if os.environ.get(REQUIRE_ENV) == "1":
        raise RuntimeError(f"{REQUIRE_ENV}=1 and no folder has the Multi30k files ({', '.join(MULTI30K_FILES)}); "
                           f"looked in {', '.join(map(str, places))}")
    return None


FOLDER = multi30k_folder()
needs_data = pytest.mark.skipif(FOLDER is None, reason=f"the Multi30k files are not available (set {DATA_ENV})")
