"""Seeded long-context tasks in natural filler (RULER-style; issue 22).

One generator serves the decoder's training mixture
(``tools/train_decoder.py``) and the long-context suite (``tools/suite.py``):
the training draws filler from the training streams, the suite from held-out
text (:func:`swarmfs.models.heldout_texts`) or from text outside every
training source, with other seeds, so keys and values never repeat between
the two.

Every task is built in token space: natural filler ids with template pieces
(each tokenized on its own by the decoder's tokenizer) spliced in at seeded
positions.  A sample ends with a query whose answer is the last tokens of
the sample; the answer is correct (exact match) when greedy decoding after
the query emits exactly those tokens, which is the same as every answer
token being the argmax under teacher forcing.

Tasks (:data:`TASKS`):

* ``passkey`` -- "The pass key is 71432. Remember it. 71432 is the pass
  key." at one depth; the query asks for the pass key (Mohtashami and
  Jaggi 2023).
* ``needle`` -- one "special magic number" for a word key (RULER NIAH single).
* ``multikey`` -- four needles with different keys, one of them asked for
  (RULER NIAH multi-key).
* ``multivalue`` -- four needles with one key and four values, all asked
  for in the order they appear (RULER NIAH multi-value).
* ``vartrack`` -- a chain ``VAR A = n``, ``VAR B = VAR A``, ``VAR C = VAR B``
  spread over the context beside a distractor chain; the query asks which
  variables hold n (RULER variable tracking).
* ``copy`` -- a passage of filler from elsewhere placed at one depth; at the
  end its first 24 tokens are repeated and the answer is its next 16 tokens
  (long-range copy, which only attending back to the passage predicts).

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from .._errors import InvalidArgumentError

__all__ = ["TASKS", "COPY_CUE", "COPY_ANSWER", "TaskSample", "SuiteSample", "make_sample",
           "make_suite_sample", "embed_tasks", "Templates"]

#: The task names, in the suite's order.
TASKS = ("passkey", "needle", "multikey", "multivalue", "vartrack", "copy")

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
#: copy task: cue tokens repeated at the end, then the answer tokens
COPY_CUE, COPY_ANSWER = 24, 16


@dataclasses.dataclass(frozen=True)
class TaskSample:
    """One task instance.

    Attributes:
        task: one of :data:`TASKS`.
        ids: int64 [n] token ids, the context, the query and the answer.
        answer: (start, end) token span of the answer in ``ids``; the query
            ends at ``start`` and ``end == len(ids)``.
        depth: relative position in [0, 1] of the first inserted needle (or
            passage) in the context.
        distance: tokens between the first needle and the answer's start.
    """

    task: str
    ids: np.ndarray
    answer: tuple[int, int]
    depth: float
    distance: int


class Templates:
    """Token ids of the template pieces, tokenized once.

    Args:
        encode: ``str -> list[int]``, the decoder's tokenizer without special
            tokens (e.g. ``lambda s: tok(s, add_special_tokens=False)["input_ids"]``
            or a ``tokenizers.Tokenizer``'s ``encode(s).ids``).
    """

    def __init__(self, encode: Callable[[str], Sequence[int]]):
        self._encode = encode
        self._cache: dict[str, np.ndarray] = {}

    def __call__(self, text: str) -> np.ndarray:
        ids = self._cache.get(text)
        if ids is None:
            ids = np.asarray(list(self._encode(text)), dtype=np.int64)
            if len(self._cache) < 200_000:
                self._cache[text] = ids
        return ids


def _word(rng: np.random.Generator) -> str:
    n = int(rng.integers(2, 4))
    return "".join(_CONSONANTS[rng.integers(len(_CONSONANTS))] + _VOWELS[rng.integers(len(_VOWELS))]
                   for _ in range(n))


def _words(rng: np.random.Generator, k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        w = _word(rng)
        if w not in out:
            out.append(w)
    return out


def _number(rng: np.random.Generator, digits: int) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _var(rng: np.random.Generator) -> str:
    return "".join(_LETTERS[i] for i in rng.integers(0, len(_LETTERS), 5))


@dataclasses.dataclass
class _Instance:
    """Needle pieces (to place in order, before the query) and the query."""

    needles: list[np.ndarray]
    query: np.ndarray
    answer: np.ndarray


def _instance(task: str, t: Templates, rng: np.random.Generator,
              filler: np.ndarray | None) -> _Instance:
    if task == "passkey":
        n = _number(rng, 5)
        return _Instance([t(f"\nThe pass key is {n}. Remember it. {n} is the pass key.\n")],
                         t("\nWhat is the pass key? The pass key is"), t(f" {n}"))
    if task in ("needle", "multikey"):
        keys = _words(rng, 1 if task == "needle" else 4)
        vals = [_number(rng, 7) for _ in keys]
        asked = int(rng.integers(len(keys)))
        needles = [t(f"\nOne of the special magic numbers for {k} is: {v}.\n")
                   for k, v in zip(keys, vals, strict=True)]
        k = keys[asked]
        return _Instance(needles, t(f"\nWhat is the special magic number for {k}? "
                                    f"The special magic number for {k} is:"), t(f" {vals[asked]}"))
    if task == "multivalue":
        k = _word(rng)
        vals = [_number(rng, 7) for _ in range(4)]
        needles = [t(f"\nOne of the special magic numbers for {k} is: {v}.\n") for v in vals]
        return _Instance(needles, t(f"\nWhat are all the special magic numbers for {k}? They are:"),
                         t(" " + ", ".join(vals)))
    if task == "vartrack":
        n, d = _number(rng, 5), _number(rng, 5)
        chain = [_var(rng) for _ in range(3)]
        other = [_var(rng) for _ in range(3)]
        pieces = []
        for i in range(3):  # the two chains interleave, each in order
            for names, value in ((chain, n), (other, d)):
                rhs = value if i == 0 else f"VAR {names[i - 1]}"
                pieces.append(t(f"\nVAR {names[i]} = {rhs}.\n"))
        return _Instance(pieces, t(f"\nWhich variables are assigned the value {n}? Answer:"),
                         t(" " + " ".join(chain)))
    if task == "copy":
        if filler is None or filler.size < 4 * (COPY_CUE + COPY_ANSWER):
            raise InvalidArgumentError("copy task: filler too short for a passage")
        p = 4 * (COPY_CUE + COPY_ANSWER)
        s = int(rng.integers(0, filler.size - p))
        passage = filler[s:s + p].astype(np.int64)
        return _Instance([passage], np.concatenate([t("\n"), passage[:COPY_CUE]]),
                         passage[COPY_CUE:COPY_CUE + COPY_ANSWER].copy())
    raise InvalidArgumentError(f"task must be one of {TASKS}, not {task!r}")


def _splice(filler: np.ndarray,
            inserts: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, list[int]]:
    """``filler`` with each (position in filler, ids) inserted; returns the
    ids and the start of each insert in the result (in the given order)."""
    order = sorted(range(len(inserts)), key=lambda i: inserts[i][0])
    parts, starts, prev, out_len = [], [0] * len(inserts), 0, 0
    for i in order:
        pos, ids = inserts[i]
        parts.append(filler[prev:pos])
        out_len += pos - prev
        starts[i] = out_len
        parts.append(ids)
        out_len += ids.size
        prev = pos
    parts.append(filler[prev:])
    return np.concatenate(parts).astype(np.int64), starts


def make_sample(task: str, filler: np.ndarray, length: int, seed, t: Templates,
                depth: float | None = None) -> TaskSample:
    """One seeded task instance of ``length`` tokens in natural filler.

    Args:
        task: one of :data:`TASKS`.
        filler: int [m] token ids of natural text (m >= ``length``); the
            context is a window of it, and the copy task's passage another.
        length: total tokens of the sample (context + query + answer).
        seed: anything ``numpy.random.default_rng`` takes; the same seed
            gives the same sample.
        t: the tokenized template pieces (:class:`Templates`).
        depth: relative position in [0, 1] of the first needle; None draws
            it uniformly from [0.05, 0.95].  The other needles follow at
            random positions between it and the query.

    Returns:
        :class:`TaskSample`.

    Raises:
        InvalidArgumentError: unknown task, a depth outside [0, 1], or a
            filler or length too short for the task.
    """
    if task not in TASKS:
        raise InvalidArgumentError(f"task must be one of {TASKS}, not {task!r}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise InvalidArgumentError(f"depth must be in [0, 1], not {depth!r}")
    filler = np.asarray(filler)
    if filler.size < length:
        raise InvalidArgumentError(f"filler has {filler.size} tokens, fewer than length {length}")
    rng = np.random.default_rng(seed)
    inst = _instance(task, t, rng, filler)
    tail = inst.query.size + inst.answer.size
    n_ctx = length - tail - sum(p.size for p in inst.needles)
    if n_ctx < 16 * max(1, len(inst.needles)):
        raise InvalidArgumentError(f"length {length} is too short for task {task!r}")
    start = int(rng.integers(0, filler.size - n_ctx + 1))
    ctx = filler[start:start + n_ctx].astype(np.int64)
    if task == "copy":  # the passage must not also be in the context window
        p = inst.needles[0]
        lo = int(rng.integers(0, filler.size - p.size + 1))
        for _ in range(64):
            if lo + p.size <= start or lo >= start + n_ctx:
                break
            lo = int(rng.integers(0, filler.size - p.size + 1))
        p = filler[lo:lo + p.size].astype(np.int64)
        inst = _Instance([p], np.concatenate([t("\n"), p[:COPY_CUE]]),
                         p[COPY_CUE:COPY_CUE + COPY_ANSWER].copy())
    d = float(rng.uniform(0.05, 0.95)) if depth is None else depth
    first = int(round(d * n_ctx))
    rest = sorted(int(x) for x in rng.integers(first, n_ctx + 1, len(inst.needles) - 1))
    ids, starts = _splice(ctx, list(zip([first, *rest], inst.needles, strict=True)))
    ids = np.concatenate([ids, inst.query, inst.answer])
    a0 = ids.size - inst.answer.size
    return TaskSample(task, ids, (a0, ids.size), d, a0 - starts[0])


@dataclasses.dataclass(frozen=True)
class SuiteSample:
    """One long context holding one instance of each of several tasks.

    The context (``ids[:context_end]``) holds every task's needles at seeded
    depths; after it come the queries, one task after another, each followed
    by its answer.  A decoder is prefilled with the context and then
    teacher-forced through the queries and answers, so one prefill (and one
    layout) serves every task.

    Attributes:
        ids: int64 [n] token ids.
        context_end: tokens of the context (the prefill).
        answers: per task, (task, start, end): the answer span in ``ids``.
        depths: per task, the relative depth in [0, 1] of its first needle.
    """

    ids: np.ndarray
    context_end: int
    answers: tuple[tuple[str, int, int], ...]
    depths: tuple[float, ...]


def make_suite_sample(filler: np.ndarray, length: int, seed, t: Templates,
                      tasks: Sequence[str] = TASKS) -> SuiteSample:
    """A seeded :class:`SuiteSample` of ``length`` tokens (context, queries
    and answers) in natural filler.

    Each task's first needle goes at a depth drawn uniformly from
    [0.05, 0.95] of the context, its other needles at random later
    positions; the copy task's passage comes from another part of
    ``filler`` than the context window.  The queries follow in a seeded
    order.

    Args:
        filler: int [m] token ids of natural text, m >= ``length`` + 1,024.
        length: total tokens of the sample.
        seed: anything ``numpy.random.default_rng`` takes.
        t: the tokenized template pieces.
        tasks: task names (each once) from :data:`TASKS`.

    Returns:
        :class:`SuiteSample`.

    Raises:
        InvalidArgumentError: an unknown or repeated task, or a filler or
            length too short.
    """
    tasks = [str(x) for x in tasks]
    bad = [x for x in tasks if x not in TASKS]
    if bad or len(set(tasks)) != len(tasks) or not tasks:
        raise InvalidArgumentError(f"tasks must be distinct names from {TASKS}, not {tasks!r}")
    filler = np.asarray(filler)
    if filler.ndim != 1 or filler.size < length + 1024:
        raise InvalidArgumentError(f"filler has {filler.size} tokens; length {length} needs "
                                   f"{length + 1024}")
    rng = np.random.default_rng(seed)
    start = int(rng.integers(0, filler.size - length + 1))
    window = filler[start:start + length]
    rest = np.concatenate([filler[:start], filler[start + length:]])  # passages come from here
    insts = [_instance(name, t, rng, rest) for name in tasks]
    n_needles = sum(p.size for i in insts for p in i.needles)
    n_tail = sum(i.query.size + i.answer.size for i in insts)
    n_ctx = length - n_needles - n_tail
    if n_ctx < 64 * len(tasks):
        raise InvalidArgumentError(f"length {length} is too short for tasks {tasks}")
    ctx = window[:n_ctx].astype(np.int64)
    inserts: list[tuple[int, np.ndarray]] = []
    depths, firsts = [], []
    for inst in insts:
        d = float(rng.uniform(0.05, 0.95))
        first = int(round(d * n_ctx))
        later = sorted(int(x) for x in rng.integers(first, n_ctx + 1, len(inst.needles) - 1))
        firsts.append(len(inserts))
        inserts += list(zip([first, *later], inst.needles, strict=True))
        depths.append(d)
    ids, _ = _splice(ctx, inserts)
    parts, answers, pos = [ids], [], ids.size
    for i in rng.permutation(len(insts)):
        inst = insts[int(i)]
        parts += [inst.query, inst.answer]
        pos += inst.query.size
        answers.append((tasks[int(i)], pos, pos + inst.answer.size))
        pos += inst.answer.size
    return SuiteSample(np.concatenate(parts).astype(np.int64), int(ids.size), tuple(answers),
                       tuple(depths))


def embed_tasks(row: np.ndarray, rng: np.random.Generator, t: Templates, n_tasks: int,
                tasks: Sequence[str] = TASKS, carry: np.ndarray | None = None
                ) -> tuple[np.ndarray, ...]:
    """Splice ``n_tasks`` task instances into a training window.

    Each instance's needles go at random positions and its query and answer
    at a random later position, so the distance from needle to query ranges
    from a few tokens to the whole window.  The window keeps its length.

    Args:
        row: int [n] token ids of natural text (the window, n > 256).
        rng: the window's generator (the caller seeds it per step).
        t: the tokenized template pieces.
        n_tasks: instances to place (each of a uniformly drawn task).
        tasks: the task names to draw from.
        carry: optional bool [n], a mask over ``row`` to move with its
            tokens (the spliced-in tokens get False; what the splice pushes
            past the end is dropped with its tokens).

    Returns:
        (ids int64 [n], answer bool [n]): the window and a mask of the answer
        tokens (for a weighted loss on them); with ``carry``, a third item,
        the carried mask bool [n].
    """
    n = row.size
    inserts: list[tuple[int, np.ndarray]] = []
    answer_sizes: list[int] = []  # per insert: its trailing answer tokens (0: a needle)
    budget = n // 2
    for _ in range(n_tasks):
        inst = _instance(str(tasks[int(rng.integers(len(tasks)))]), t, rng, row)
        size = sum(p.size for p in inst.needles) + inst.query.size + inst.answer.size
        if size > budget:
            break
        budget -= size
        # positions in the original window; the query after every needle
        q = int(rng.integers(n // 8, n))
        pos = sorted(int(x) for x in rng.integers(0, q, len(inst.needles)))
        for p, piece in zip(pos, inst.needles, strict=True):
            inserts.append((p, piece))
            answer_sizes.append(0)
        inserts.append((q, np.concatenate([inst.query, inst.answer])))
        answer_sizes.append(inst.answer.size)
    total = sum(p.size for _, p in inserts)
    at = [min(p, n - total) for p, _ in inserts]
    pieces = [piece for _, piece in inserts]
    ids, starts = _splice(row[:n - total], list(zip(at, pieces, strict=True)))
    mask = np.zeros(ids.size, bool)
    for (_, piece), s, k in zip(inserts, starts, answer_sizes, strict=True):
        mask[s + piece.size - k:s + piece.size] = True
    if carry is None:
        return ids, mask
    blanks = [np.zeros(piece.size, np.int64) for piece in pieces]
    moved, _ = _splice(np.asarray(carry, np.int64)[:n - total],
                       list(zip(at, blanks, strict=True)))
    return ids, mask, moved.astype(bool)
