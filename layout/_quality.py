"""Retrieval quality of a clustering: attention-mass recall vs the oracle top-k.

Does what decoding does with a SWARM layout (§5.2, §6), with the same
functions: the local window (:func:`swarmfs.decode._window.window_size`) is always
in DRAM; clusters are then taken in descending medoid score until the selection
holds the budget :func:`swarmfs.decode._window.entry_budget` ``ceil(r * S)`` of
distinct entries (:func:`swarmfs.decode._stages.choose`, the Retriever's select
stage: the window counts against it, replicas and window entries count once,
the last cluster is taken whole).

For a held-out query (one never used for profiling) that sees all ``S``
context entries, let ``p(j) = (1 / H_q) sum_h softmax_j(q_h . k_{g(h), j} *
scale)`` be its head-averaged attention over the context.  The *attention-mass
recall* of a selection ``E`` is :func:`swarmfs.decode._report.attention_recall`:
``sum_{j in E} p(j) / sum_{j in T} p(j)`` where ``T`` is the oracle, the
``max(budget, |E|)`` entries with the largest ``p`` (recall <= 1 and an
overshooting last cluster earns nothing).

Medoid scores (what retrieval ranks clusters by): ``"logit"`` sums the scaled
logits ``q_h . k_{g(h), m} * scale`` over all query heads (i.e. over the query
heads of every GQA group); ``"prob"`` sums per-head softmax probabilities over
the medoids instead.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._defaults import LOCAL_WINDOW, RATIO
from .._errors import ShapeError
from .._validate import (
    checked,
    checked_methods,
    parse_choice,
    parse_nonneg_int,
    parse_number,
    parse_positive_int,
    parse_ratio,
)
from ..decode._report import attention_recall, oracle_mass
from ..decode._stages import choose
from ..decode._window import entry_budget, window_mask, window_size
from ..store._index import union_ints
from ._profile import aggregate_scores, one_blas_thread

__all__ = ["RecallReport", "block_clustering", "evaluate_recall"]


@checked_methods
@dataclasses.dataclass(frozen=True, eq=False)
class RecallReport:
    """Recall of one layer's layout on held-out queries.

    Attributes:
        recall: float64 [n] attention-mass recall per query (0..1).
        selected: int64 [n] entries selected per query.
        budget: the entry budget ceil(r * S).
        clusters_read: int64 [n] clusters fetched per query.
        oracle_mass: float64 [n] attention mass of the oracle top-``budget``.
        window_bound: float64 [n] recall of the best selection of the same
            size that contains the local window (window + oracle top of the
            rest): what a perfect clustering would reach.
    """
    recall: np.ndarray
    selected: np.ndarray
    budget: int
    clusters_read: np.ndarray
    oracle_mass: np.ndarray
    window_bound: np.ndarray

    @property
    def mean(self) -> float:
        """Mean recall over the held-out queries."""
        return float(self.recall.mean())

    @property
    def bound(self) -> float:
        """Mean of ``window_bound``."""
        return float(self.window_bound.mean())

    @property
    def overshoot(self) -> float:
        """Mean selected / budget (>= 1)."""
        return float(self.selected.mean() / self.budget)


@checked
def block_clustering(num_tokens: int, block: int):
    """Baseline layout: position-contiguous blocks, medoid = middle token.

    Returns:
        An object with ``ptr``, ``members`` and ``medoids`` (int64 CSR) that
        :func:`evaluate_recall` accepts.

    Raises:
        InvalidIntegerError: num_tokens or block below 1.
    """
    num_tokens = parse_positive_int(num_tokens, "num_tokens")
    block = parse_positive_int(block, "block")
    ptr = np.append(np.arange(0, num_tokens, block), num_tokens).astype(np.int64)
    members = np.arange(num_tokens, dtype=np.int64)
    medoids = np.minimum(ptr[:-1] + block // 2, num_tokens - 1)
    ns = type("Blocks", (), {})()
    ns.ptr, ns.members, ns.medoids = ptr, members, medoids
    return ns


@checked
def evaluate_recall(clustering, q_eval, k, *, ratio: float = RATIO,
                    local_window: int = LOCAL_WINDOW, score: str = "prob",
                    scaling: float | None = None, batch: int = 64) -> RecallReport:
    """Attention-mass recall of medoid-based cluster retrieval (see module doc).

    Args:
        clustering: a :class:`~._cluster.Clustering` (or anything with int
            ``ptr`` [C+1], ``members`` [M], ``medoids`` [C]) over S tokens.
        q_eval: float [H_q, n, d] held-out queries; each sees all S keys.
        k: float [H_kv, S, d] the context's keys.
        ratio: sparsity ratio r in (0, 1]; budget = ceil(r * S) entries.
        local_window: W; the last ``window_size(W, budget, S)`` context
            entries are always selected (the Retriever's rule).
        score: ``"logit"`` or ``"prob"`` medoid scoring.
        scaling: logit scale (default d**-0.5).
        batch: queries scored together.

    Returns:
        A :class:`RecallReport`.

    Raises:
        ShapeError: q/k shapes disagree or the clustering is not over S tokens.
        InvalidRatioError: ratio outside (0, 1].
        InvalidIntegerError: local_window below 0 or batch below 1.
        InvalidChoiceError: an unknown score.
        InvalidNumberError: scaling not a finite positive number.
    """
    ratio = parse_ratio(ratio, "ratio")
    local_window = parse_nonneg_int(local_window, "local_window")
    parse_choice(score, "score", ("logit", "prob"))
    parse_positive_int(batch, "batch")
    if scaling is not None:
        parse_number(scaling, "scaling", 0, lo_open=True)
    q_eval = np.asarray(q_eval)
    k = np.ascontiguousarray(k, dtype=np.float32)
    if q_eval.ndim != 3 or k.ndim != 3 or q_eval.shape[2] != k.shape[2] \
            or q_eval.shape[0] % k.shape[0]:
        raise ShapeError(f"q_eval {q_eval.shape} and k {k.shape} disagree")
    d = q_eval.shape[2]
    S = k.shape[1]
    ptr = np.asarray(clustering.ptr, np.int64)
    members = np.asarray(clustering.members, np.int64)
    medoids = np.asarray(clustering.medoids, np.int64)
    if members.size == 0 or members.max() >= S or np.bincount(members, minlength=S).min() == 0:
        raise ShapeError(f"the clustering does not cover exactly the {S} context tokens")
    scaling = d ** -0.5 if scaling is None else float(scaling)
    budget = entry_budget(ratio, S)
    W = window_size(local_window, budget, S)
    sizes = np.diff(ptr)
    kmed = k[:, medoids]                                    # [H_kv, C, d]
    in_win = window_mask(S, W)
    with one_blas_thread():
        return _evaluate(ptr, members, medoids, sizes, q_eval, k, kmed, in_win, budget, W,
                         score, scaling, batch)


def _evaluate(ptr, members, medoids, sizes, q_eval, k, kmed, in_win, budget, W, score,
              scaling, batch) -> RecallReport:
    H_q, n, _ = q_eval.shape
    H_kv, S, _ = k.shape
    g = H_q // H_kv
    recall = np.empty(n)
    selected = np.empty(n, np.int64)
    nread = np.empty(n, np.int64)
    omass = np.empty(n)
    wbound = np.empty(n)
    for a in range(0, n, batch):
        qb = np.ascontiguousarray(q_eval[:, a:a + batch], dtype=np.float32)
        p = aggregate_scores(qb, k, scaling=scaling) / H_q      # [B, S]
        if score == "prob":
            ms = aggregate_scores(qb, kmed, scaling=scaling)
        else:
            ms = np.zeros((qb.shape[1], medoids.shape[0]), np.float32)
            for h in range(H_q):
                ms += qb[h] @ kmed[h // g].T
        for r in range(qb.shape[1]):
            chosen = choose(ms[r], ptr, members, S, budget, W)
            c = chosen.shape[0]
            n = sizes[chosen]
            idx = np.repeat(ptr[chosen] - (np.cumsum(n) - n), n) + np.arange(n.sum())
            toks = union_ints(members[idx], np.flatnonzero(in_win))
            pr = p[r]
            recall[a + r], _, top = attention_recall(pr, toks, budget)
            m = toks.shape[0]
            selected[a + r] = m
            nread[a + r] = c
            omass[a + r] = oracle_mass(pr, budget)
            rest = pr[S - W:S].sum(dtype=np.float64)
            extra = m - W
            if extra > 0:
                rest += np.partition(pr[:S - W], S - W - extra)[S - W - extra:].sum(
                    dtype=np.float64)
            wbound[a + r] = rest / top if top > 0 else 1.0
    return RecallReport(recall=recall, selected=selected, budget=budget,
                        clusters_read=nread, oracle_mass=omass, window_bound=wbound)
