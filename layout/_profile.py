"""Activation profile: which KV entries each query activates (SWARM §5.1 step 1).

For one layer, a *profiling query* is the query vector of a context position
``t``; it sees the keys ``0..t`` (causal, as when decoding over a stored
context).  Its *activated set* is the top-k KV entries by attention score at
sparsity ratio ``r`` (SWARM §8.1 evaluates at r = 10%), with
``k = ceil(r * (t + 1))``.

An entry is one token's K and V for *all* KV heads (what the store reads as a
unit), so scores are aggregated over heads: for each query head ``h`` the
softmax probabilities ``p_h(j) = softmax_j(q_h . k_{g(h), j} * scale)`` over
the visible keys are computed with KV head ``g(h) = h // (H_q / H_kv)`` (GQA),
and entry ``j``'s score is ``sum_h p_h(j)``.  Summing probabilities (rather
than logits) weighs every head by the attention mass it actually spends.

Profiling every query of a 128K-token context costs O(S^2) per head, so by
default a deterministic sample of at most :data:`DEFAULT_MAX_QUERIES`
positions is profiled (``numpy.random.default_rng(seed)``, without
replacement, sorted; all positions when the context is shorter).  A random
sample avoids aliasing with the capture window (positions restart every 512
tokens for MiniLM), which an evenly spaced sample would hit.

The result is stored sparsely: ``acts`` is a CSR matrix [n_queries, S]
(row = query, column = activated entry).  Co-activation counts
``f(e_i, e_j) = |{queries activating both}|`` are never formed as an S x S
dense matrix; ``_cluster`` evaluates them for candidate pairs only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from .._defaults import RATIO
from .._errors import LayoutError, ShapeError
from .._validate import (
    checked,
    checked_methods,
    parse_index,
    parse_int,
    parse_positive_int,
    parse_ratio,
)
from ..decode._selectors import single_threaded_blas as one_blas_thread

__all__ = ["DEFAULT_MAX_QUERIES", "DEFAULT_RATIO", "Profile", "aggregate_scores",
           "entry_bitsets", "one_blas_thread", "pair_intersections", "popcount_rows",
           "profile_capture", "profile_layer", "sample_queries"]

#: Default sparsity ratio r (SWARM §8.1: all methods at 10%).
DEFAULT_RATIO = RATIO
#: Default cap on profiled query positions per layer.
DEFAULT_MAX_QUERIES = 2048


@checked_methods
@dataclasses.dataclass(frozen=True, eq=False)
class Profile:
    """Activated sets of the profiled queries of one layer.

    Attributes:
        num_tokens: S, context length in entries.
        queries: int64 [n] profiled query positions, ascending.
        acts: scipy.sparse.csr_matrix bool [n, S]; row ``i`` holds the entries
            activated by the query at ``queries[i]`` (columns sorted).
        ratio: sparsity ratio r used.
        layer: model layer index, or None.
    """
    num_tokens: int
    queries: np.ndarray
    acts: sp.csr_matrix
    ratio: float
    layer: int | None = None

    @property
    def num_queries(self) -> int:
        """Profiled query positions."""
        return int(self.queries.shape[0])

    def activation_counts(self) -> np.ndarray:
        """int64 [S]: how many profiled queries activated each entry."""
        return np.bincount(self.acts.indices, minlength=self.num_tokens).astype(np.int64)

    def visible_counts(self) -> np.ndarray:
        """int64 [S]: how many profiled queries can see each entry (t >= j)."""
        first = np.searchsorted(self.queries, np.arange(self.num_tokens), side="left")
        return (self.num_queries - first).astype(np.int64)

    def by_entry(self) -> sp.csr_matrix:
        """CSR bool [S, n]: row ``j`` lists the queries that activated entry ``j``."""
        return self.acts.T.tocsr()

    def total_coactivation(self) -> float:
        """The denominator of eq. 2: sum over all ordered pairs (k, l) of f(e_k, e_l).

        Equals ``sum_q |A_q|^2`` (every query counts each ordered pair of its
        activated entries once, the diagonal included).
        """
        sizes = np.diff(self.acts.indptr).astype(np.float64)
        return float((sizes ** 2).sum())

    def coactivation(self, i, j) -> np.ndarray:
        """Co-activation counts f(e_i, e_j) for pairs of entries.

        Args:
            i, j: int arrays [P] of entry ids.

        Returns:
            int64 [P] number of profiled queries activating both.
        """
        bits = entry_bitsets(self)
        return pair_intersections(bits, np.asarray(i, np.int64), np.asarray(j, np.int64))


def entry_bitsets(profile: Profile, chunk: int = 8192) -> np.ndarray:
    """uint64 [S, ceil(n / 64)]: bit q of row j is set iff query q activated entry j.

    Bit ``q`` lives in word ``q // 64`` at position ``q % 64``.  Built in
    chunks of entries (dense bool [chunk, n] -> ``np.packbits``), so memory
    stays at O(S n / 8) bytes.
    """
    n, S = profile.num_queries, profile.num_tokens
    words = max(1, (n + 63) // 64)
    bits = np.zeros((S, words), np.uint64)
    E = profile.by_entry()
    for a in range(0, S, chunk):
        b = min(a + chunk, S)
        dense = np.zeros((b - a, words * 64), bool)
        dense[:, :n] = E[a:b].toarray()
        packed = np.packbits(dense, axis=1, bitorder="little")
        bits[a:b] = packed.view("<u8")
    return bits


_POPCOUNT8 = np.array([x.bit_count() for x in range(256)], np.uint8)


def popcount_rows(words: np.ndarray) -> np.ndarray:
    """int64 [R]: number of set bits in each row of a uint64 [R, W] array."""
    if hasattr(np, "bitwise_count"):                       # numpy >= 2.0
        return np.bitwise_count(words).sum(axis=1, dtype=np.int64)
    b = np.ascontiguousarray(words).view(np.uint8).reshape(words.shape[0], -1)
    return _POPCOUNT8[b].sum(axis=1, dtype=np.int64)


def pair_intersections(bits: np.ndarray, i: np.ndarray, j: np.ndarray,
                       chunk: int = 1 << 18) -> np.ndarray:
    """int64 [P]: popcount(bits[i] & bits[j]) per pair, in chunks of pairs."""
    out = np.empty(i.shape[0], np.int64)
    for a in range(0, i.shape[0], chunk):
        b = min(a + chunk, i.shape[0])
        out[a:b] = popcount_rows(bits[i[a:b]] & bits[j[a:b]])
    return out


@checked
def sample_queries(num_tokens: int, max_queries: int = DEFAULT_MAX_QUERIES,
                   seed: int = 0) -> np.ndarray:
    """Deterministic sample of profiling query positions.

    Returns:
        int64 ascending positions: all of ``range(num_tokens)`` if it has at
        most ``max_queries`` positions, else ``max_queries`` drawn without
        replacement by ``numpy.random.default_rng(seed)``.

    Raises:
        InvalidIntegerError: ``num_tokens < 0``, ``max_queries < 1``, or not
            integers.
    """
    num_tokens = parse_int(num_tokens, "num_tokens", 0)
    max_queries = parse_positive_int(max_queries, "max_queries")
    parse_int(seed, "seed")
    if num_tokens <= max_queries:
        return np.arange(num_tokens, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_tokens, size=max_queries, replace=False)).astype(np.int64)


def aggregate_scores(q: np.ndarray, k: np.ndarray, *, scaling: float | None = None,
                     limits=None) -> np.ndarray:
    """Head-aggregated attention probabilities of a batch of queries.

    Args:
        q: float [H_q, B, d] query vectors.
        k: float [H_kv, T, d] keys (H_q a multiple of H_kv).
        scaling: logit scale (default d**-0.5).
        limits: int [B] or None: query ``b`` sees keys ``0..limits[b]``
            (inclusive); None: all T keys.

    Returns:
        float32 [B, T]: ``sum_h softmax(q_h k_{h // g}^T * scaling)``; keys a
        query cannot see get 0.  Each row sums to H_q.
    """
    H_q, B, d = q.shape
    H_kv, T, _ = k.shape
    g = H_q // H_kv
    scaling = d ** -0.5 if scaling is None else float(scaling)
    neg = None
    if limits is not None:
        limits = np.asarray(limits, np.int64)
        neg = np.where(np.arange(T)[None, :] > limits[:, None], -np.inf, 0.0).astype(np.float32)
    agg = np.zeros((B, T), np.float32)
    s = np.empty((B, T), np.float32)
    for h in range(H_q):
        np.matmul(q[h], k[h // g].T, out=s)
        s *= np.float32(scaling)
        if neg is not None:
            s += neg
        s -= s.max(axis=1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=1, keepdims=True)
        agg += s
    return agg


def _profile_rows(q, kf, pos, counts, scaling, batch, cols) -> None:
    """Append each profiled query's activated entries (sorted) to ``cols``."""
    for a in range(0, pos.shape[0], batch):
        p = pos[a:a + batch]
        T = int(p[-1]) + 1
        qb = np.ascontiguousarray(q[:, p], dtype=np.float32)
        agg = aggregate_scores(qb, kf[:, :T], scaling=scaling, limits=p)
        for r, t in enumerate(p):
            kt = int(counts[a + r])
            row = agg[r, :t + 1]
            sel = np.arange(t + 1) if kt >= t + 1 else \
                np.argpartition(row, t + 1 - kt)[t + 1 - kt:]
            cols.append(np.sort(sel))


@checked
def profile_layer(q, k, *, ratio: float = DEFAULT_RATIO, queries=None,
                  max_queries: int = DEFAULT_MAX_QUERIES, seed: int = 0,
                  scaling: float | None = None, layer: int | None = None,
                  batch: int = 64) -> Profile:
    """Profile one layer's activated sets (SWARM §5.1 step 1).

    Query position ``t`` sees keys ``0..t`` and activates the
    ``ceil(ratio * (t + 1))`` entries with the largest head-aggregated
    attention probability (see the module docstring).

    Args:
        q: [H_q, S, d] queries of the context (any float dtype).
        k: [H_kv, S, d] keys.
        ratio: sparsity ratio r in (0, 1].
        queries: int positions to profile; default
            ``sample_queries(S, max_queries, seed)``.
        max_queries, seed: the default sample.
        scaling: logit scale (default d**-0.5; pass ``Capture.scaling``).
        layer: recorded in the result.
        batch: queries scored together (memory ~ 3 x batch x S x 4 bytes).

    Returns:
        A :class:`Profile`.

    Raises:
        ShapeError: q/k ranks, head counts, lengths or head_dim disagree.
        InvalidRatioError: ratio outside (0, 1].
        InvalidIntegerError: batch below 1.
        LayoutError: query positions outside [0, S).
    """
    ratio = parse_ratio(ratio, "ratio", layer=layer)
    parse_positive_int(batch, "batch", layer=layer)
    q = np.asarray(q)
    k = np.asarray(k)
    if q.ndim != 3 or k.ndim != 3:
        raise ShapeError(f"q {q.shape} and k {k.shape} must be [heads, tokens, head_dim]",
                         layer=layer)
    H_q, S, d = q.shape
    H_kv = k.shape[0]
    if k.shape[1] != S or k.shape[2] != d or H_kv == 0 or H_q % H_kv:
        raise ShapeError(f"q {q.shape} and k {k.shape} disagree (same tokens and head_dim, "
                         "query heads a multiple of KV heads)", layer=layer)
    pos = (sample_queries(S, max_queries, seed) if queries is None
           else np.unique(np.asarray(queries, np.int64).reshape(-1)))
    if pos.size == 0 or pos[0] < 0 or pos[-1] >= S:
        raise LayoutError(f"query positions must be a non-empty subset of [0, {S})",
                          layer=layer)
    kf = np.ascontiguousarray(k, dtype=np.float32)
    counts = np.ceil(ratio * (pos + 1) - 1e-9).astype(np.int64)   # k_t >= 1
    counts = np.clip(counts, 1, pos + 1)
    cols: list[np.ndarray] = []
    with one_blas_thread():
        _profile_rows(q, kf, pos, counts, scaling, batch, cols)
    indptr = np.zeros(pos.shape[0] + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = np.concatenate(cols).astype(np.int32 if S < 2 ** 31 else np.int64)
    acts = sp.csr_matrix((np.ones(indices.shape[0], bool), indices, indptr),
                         shape=(pos.shape[0], S))
    return Profile(num_tokens=S, queries=pos, acts=acts, ratio=float(ratio), layer=layer)


@checked
def profile_capture(cap, layer: int, **kw) -> Profile:
    """:func:`profile_layer` on one layer of a :class:`~._capture.Capture`.

    Args:
        cap: the capture.
        layer: index into the captured layers.
        **kw: passed to :func:`profile_layer` (``scaling`` defaults to the
            capture's).

    Raises:
        InvalidIndexError: layer not an integer.
        LayoutError: layer out of range; as :func:`profile_layer`.
    """
    layer = parse_index(layer, "layer")
    if not 0 <= layer < cap.num_layers:
        raise LayoutError(f"layer {layer} outside the {cap.num_layers} captured layers")
    kw.setdefault("scaling", cap.scaling)
    kw.setdefault("layer", int(cap.meta.get("layers", list(range(cap.num_layers)))[layer]))
    return profile_layer(cap.q[layer], cap.k[layer], **kw)
