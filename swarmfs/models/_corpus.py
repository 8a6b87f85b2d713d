"""The decoder's text corpus and its fixed train / held-out split.

One rule, used by the training recipe (``tools/train_decoder.py``), by the
evaluation (``tools/eval_decoder.py``) and by every measurement that needs
long held-out inputs:

* **Python source**: every ``*.py`` file of the running interpreter's
  standard library (``sysconfig.get_paths()["stdlib"]``), except
  ``site-packages`` and test directories (``test``, ``tests``,
  ``idle_test``), decoded as UTF-8 (files that are not are skipped).  A
  file is held out when ``sha1(relative path)`` taken as an integer is
  ``0 mod 20`` (about 5% of the files, the same on every machine with the
  same Python version).
* **Prose** (``../shared/data``, read in place): WikiText-2 raw test, Tiny
  Shakespeare and the GSM8K test set.  The last 10% of each (cut at a line
  boundary) is held out, the first 90% is trained on.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sysconfig

from .._errors import InvalidArgumentError, NotFoundError

__all__ = ["KINDS", "PROSE_HELDOUT_FRACTION", "STDLIB_HELDOUT_MODULUS", "Document", "stdlib_dir",
           "data_dir", "documents", "training_texts", "heldout_documents", "heldout_texts"]

#: Fraction of each prose source held out (its tail).
PROSE_HELDOUT_FRACTION = 0.10
#: A stdlib file is held out when sha1(relative path) % STDLIB_HELDOUT_MODULUS == 0.
STDLIB_HELDOUT_MODULUS = 20
_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
_PROSE_FILES = {
    "wikitext2": "wikitext2_raw_test.raw",
    "shakespeare": "tinyshakespeare_input.txt",
    "gsm8k": "gsm8k_test.jsonl",
}
KINDS = ("python", "prose")


@dataclasses.dataclass(frozen=True)
class Document:
    """One training or held-out document.

    Attributes:
        name: ``"stdlib/<relative path>"`` or ``"<source>"`` (``wikitext2``,
            ``shakespeare``, ``gsm8k``).
        kind: ``"python"`` or ``"prose"``.
        text: the document's text (str).
        heldout: True when the document is never trained on.
    """

    name: str
    kind: str
    text: str
    heldout: bool


def stdlib_dir() -> pathlib.Path:
    """The running interpreter's standard-library directory."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def data_dir() -> pathlib.Path:
    """Where the shared datasets are: ``$SWARMFS_DATA`` if set, else
    ``../shared/data`` next to the source tree, else ``/work/shared/data``
    (the first that holds WikiText-2; the same rule as ``tools/_shared_data``).

    Raises:
        NotFoundError: none of them holds ``wikitext2_raw_test.raw``.
    """
    repo = pathlib.Path(__file__).resolve().parents[2]
    tried = [os.environ.get("SWARMFS_DATA"), repo.parent / "shared" / "data",
             "/work/shared/data"]
    for d in tried:
        if d and (pathlib.Path(d) / _PROSE_FILES["wikitext2"]).exists():
            return pathlib.Path(d)
    raise NotFoundError("shared data (WikiText-2) not found in any of "
                        f"{[str(t) for t in tried if t]}; set SWARMFS_DATA")


def _is_heldout_path(rel: str) -> bool:
    h = int.from_bytes(hashlib.sha1(rel.encode()).digest()[:8], "big")
    return h % STDLIB_HELDOUT_MODULUS == 0


def _stdlib_documents() -> list[Document]:
    root = stdlib_dir()
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        docs.append(Document("stdlib/" + rel, "python", text, _is_heldout_path(rel)))
    return docs


def _split_tail(text: str, fraction: float) -> tuple[str, str]:
    cut = text.rfind("\n", 0, int(len(text) * (1.0 - fraction))) + 1
    return text[:cut], text[cut:]


def _prose_documents(root: pathlib.Path) -> list[Document]:
    docs = []
    for name, fname in _PROSE_FILES.items():
        path = root / fname
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise NotFoundError(f"{path}: {e.strerror}") from e
        if name == "gsm8k":  # one question + answer per JSON line
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            text = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows)
        train, held = _split_tail(text, PROSE_HELDOUT_FRACTION)
        docs.append(Document(name, "prose", train, False))
        docs.append(Document(name, "prose", held, True))
    return docs


def documents(data: str | os.PathLike | None = None) -> list[Document]:
    """Every document of the corpus, train and held-out, in a fixed order.

    Args:
        data: directory of the shared datasets (default: :func:`data_dir`).

    Returns:
        list of :class:`Document`: stdlib files sorted by path, then the
        prose sources (train part, then held-out tail, for each).

    Raises:
        NotFoundError: the shared datasets are missing.
    """
    root = data_dir() if data is None else pathlib.Path(data)
    return _stdlib_documents() + _prose_documents(root)


def training_texts(data: str | os.PathLike | None = None) -> list[Document]:
    """The documents the decoder is trained on (never a held-out one)."""
    return [d for d in documents(data) if not d.heldout]


def heldout_documents(kind: str | None = None,
                      data: str | os.PathLike | None = None) -> list[Document]:
    """The held-out documents, optionally of one kind.

    Args:
        kind: ``"python"``, ``"prose"`` or None (both).
        data: directory of the shared datasets (default: :func:`data_dir`).

    Raises:
        InvalidArgumentError: unknown ``kind``.
        NotFoundError: the shared datasets are missing.
    """
    if kind is not None and kind not in KINDS:
        raise InvalidArgumentError(f"kind must be one of {KINDS} or None, not {kind!r}")
    return [d for d in documents(data) if d.heldout and (kind is None or d.kind == kind)]


def heldout_texts(kind: str = "python", data: str | os.PathLike | None = None) -> str:
    """The held-out text of one kind as one string, for long-context inputs.

    ``"python"``: the held-out stdlib files in path order, each preceded by a
    ``# file: <name>`` line (30 files, about 184K tokens of the decoder's
    tokenizer on Python 3.11).  ``"prose"``: the held-out tail of WikiText-2
    (about 39K tokens), then those of Tiny Shakespeare and GSM8K (about 104K
    tokens in all).  Take the first N
    tokens of it for an N-token long input.

    Args:
        kind: ``"python"`` or ``"prose"``.
        data: directory of the shared datasets (default: :func:`data_dir`).

    Returns:
        str: the concatenated held-out text.

    Raises:
        InvalidArgumentError: unknown ``kind``.
        NotFoundError: the shared datasets are missing.
    """
    if kind not in KINDS:
        raise InvalidArgumentError(f"kind must be one of {KINDS}, not {kind!r}")
    docs = heldout_documents(kind, data)
    if kind == "python":
        return "".join(f"# file: {d.name}\n{d.text}\n" for d in docs)
    return "\n".join(d.text for d in docs)
