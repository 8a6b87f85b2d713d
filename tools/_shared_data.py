"""Where the workspace's shared datasets live (WikiText-2, GSM8K, Tiny
Shakespeare), read in place and never copied into the project."""

from __future__ import annotations

import os
import pathlib

_REPO = pathlib.Path(__file__).resolve().parents[1]


def data_dir() -> pathlib.Path:
    """``$SWARMFS_DATA`` if set, else ``../shared/data`` next to the
    repository, else ``/work/shared/data`` (where a clone outside /work finds
    them): the first that holds WikiText-2.  If none does, ``../shared/data``
    (missing; the tests that need it skip)."""
    for d in (os.environ.get("SWARMFS_DATA"), _REPO.parent / "shared" / "data",
              "/work/shared/data"):
        if d and (pathlib.Path(d) / "wikitext2_raw_test.raw").exists():
            return pathlib.Path(d)
    return _REPO.parent / "shared" / "data"
