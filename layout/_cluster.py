"""Correlation-aware clustering of KV entries (SWARM §5.1, eqs. 2-5, Algorithm 1).

Distances.  From a :class:`~._profile.Profile`, let ``A_i`` be the set of
profiled queries that activated entry ``e_i``, ``f(e_i, e_j) = |A_i & A_j|``
the co-activation count and ``F = sum_{k,l} f(e_k, e_l)`` (all ordered pairs,
diagonal included).  Two metrics:

* ``"eq2"``, as written in the paper: ``P = f / F`` (eq. 2), ``d = 1 - P``
  (eq. 3).  ``F`` grows like ``n_queries * (r S)^2`` (about 4.6e8 for 2048
  queries over 8K tokens), so every distance is within ~1e-6 of 1 and
  ``d < tau`` is the same as ``f > (1 - tau) F``: a threshold on the *raw*
  count.  It links entries that are activated often (attention sinks,
  frequent tokens) to each other and leaves the rest isolated, and ``tau``
  must be 1 - O(1/F) to see any edge (:func:`eq2_tau` converts a count
  threshold).  With the default tau every entry would be a singleton.
* ``"jaccard"`` (default): ``d = 1 - |A_i & A_j| / |A_i | A_j|``.  Normalised
  per pair, so ``tau`` means the same at any context length and for rarely
  and often activated entries alike.

Entries never activated by a profiled query (``A_i`` empty) are at distance 1
from everything under both metrics.

The neighbour graph.  Algorithm 1 needs the pairs with ``d < tau`` for the
density (eq. 4) and the candidate queues; those form a sparse graph, found
by one of the methods below.  Eq. 5 needs a candidate's distance to every
current member, also for pairs at ``d >= tau``; those are computed exactly
on demand from the query bitsets (``NeighbourGraph.distance``), so the scan
itself is exact.  Pairs are found by

* ``"exact"``: all pairs; co-activation counts by blocked dense products of
  the activation matrix (O(S^2 n) flops; ``method="auto"`` uses it up to
  :data:`EXACT_LIMIT` activated entries), or
* ``"minhash"`` (Jaccard only): MinHash signatures of the query sets, LSH
  banding to propose candidate pairs, and an exact check of every candidate
  with query bitsets (so every stored distance is exact).  A pair at
  similarity ``1 - tau + 0.1`` shares a bucket with probability >= 0.95;
  closer to the threshold an edge may be missed (it then neither counts in
  rho nor makes a candidate).  Within a
  large bucket each entry is paired with its next :data:`BUCKET_WINDOW`
  entries in token order only, which bounds the work at O(S) per band.

For ``"eq2"`` only entries activated more than ``(1 - tau) F`` times can have
an edge, so the exact method runs over those alone.

Algorithm 1 then runs exactly on the graph (:func:`build_clusters`).  Members
may already be covered by earlier clusters, which is how replicas arise
(§5.1, the A-B-C example).  The only approximations are MinHash's missed
edges (87% of the exact edges found at 16K tokens, tau 0.6; the misses lie
near the threshold) and the caps below.

Deviations from the paper (for the README):

* ``max_cluster_size`` (default 64) caps a cluster; ``max_replicas``
  (default 2) makes an entry that already has that many copies ineligible
  as a candidate.  On long contexts a node's tau-neighbourhood grows with S
  (MiniLM/WikiText-2, tau 0.6: mean degree 37 at 16K tokens, 241 at 128K),
  and without the cap every medoid re-copies its whole neighbourhood
  (replication 9.9x at 128K with clusters of <= 256; 1.85x with the caps).
  ``max_replicas=None`` restores the paper's unbounded replication.
* Algorithm 1's pseudo-code tests ``<= tau``; eq. 4 and the text use
  ``< tau``.  We use ``<`` everywhere (so tau = 1 links exactly the pairs
  that co-activated at least once).
* §5.1 says that ``d = 1`` means two entries are always co-activated; by
  eqs. 2-3 it means ``P = 0``, never co-activated.  We follow the formulas.
* Entries never activated in the profile are not left to Algorithm 1 (where
  each would become a singleton cluster) but grouped in position order into
  clusters of at most ``idle_group_size`` entries, so they stay stored and
  reachable at the cost of few index entries.  Their medoid is the member
  whose key is nearest the group's mean key (if keys are given).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp

from .._errors import LayoutError, ShapeError
from .._validate import (
    checked,
    checked_methods,
    parse_choice,
    parse_int,
    parse_number,
    parse_positive_int,
    parse_ratio,
)
from ._profile import Profile, entry_bitsets, one_blas_thread, pair_intersections, popcount_rows

__all__ = ["BUCKET_WINDOW", "DEFAULT_MAX_CLUSTER_SIZE", "DEFAULT_MAX_REPLICAS",
           "DEFAULT_METRIC", "DEFAULT_TAU", "EXACT_LIMIT", "METHODS", "METRICS", "ClusterStats",
           "Clustering", "NeighbourGraph", "build_clusters", "cluster", "coactivation_distance",
           "eq2_tau", "graph_from_distances", "neighbour_graph"]

METRICS = ("jaccard", "eq2")
#: neighbour-search methods of :func:`neighbour_graph`
METHODS = ("auto", "exact", "minhash")
DEFAULT_METRIC = "jaccard"
#: Default clustering radius for the Jaccard metric.
DEFAULT_TAU = 0.6
#: Default cap on entries per cluster.
DEFAULT_MAX_CLUSTER_SIZE = 64
#: Default cap on the copies of one entry (None: unbounded, as in the paper).
DEFAULT_MAX_REPLICAS = 2
#: Largest number of activated entries for which ``method="auto"`` computes all pairs exactly.
EXACT_LIMIT = 4096
#: In an LSH bucket larger than this, each entry is paired with the next
#: BUCKET_WINDOW entries (in token order) only.
BUCKET_WINDOW = 64
_EQ2_EXACT_MAX = 16384


@checked
def coactivation_distance(f, n_i, n_j, *, metric: str = DEFAULT_METRIC,
                          total: float | None = None) -> np.ndarray:
    """Distance between entries from co-activation counts (eqs. 2-3 or Jaccard).

    Args:
        f: co-activation counts f(e_i, e_j) (array).
        n_i, n_j: activation counts |A_i|, |A_j| (arrays like ``f``).
        metric: ``"eq2"`` (``1 - f / total``) or ``"jaccard"``
            (``1 - f / (n_i + n_j - f)``; 1 where both sets are empty).
        total: F, the sum of f over all ordered pairs (``Profile.
            total_coactivation()``); required for ``"eq2"``.

    Returns:
        float64 distances in [0, 1].

    Raises:
        InvalidChoiceError: unknown metric.
        LayoutError: ``total`` missing/non-positive for eq2.
    """
    parse_choice(metric, "metric", METRICS)
    f = np.asarray(f, np.float64)
    if metric == "eq2":
        if total is None or not total > 0:
            raise LayoutError("metric 'eq2' needs the positive total co-activation F")
        return 1.0 - f / float(total)
    if metric == "jaccard":
        union = np.asarray(n_i, np.float64) + np.asarray(n_j, np.float64) - f
        return np.where(union > 0, 1.0 - f / np.maximum(union, 1.0), 1.0)
    raise AssertionError(metric)       # parse_choice took only METRICS


@checked_methods
@dataclasses.dataclass(frozen=True, eq=False)
class NeighbourGraph:
    """The sparse tau-neighbourhood graph Algorithm 1 runs on.

    Attributes:
        sim: scipy.sparse.csr_matrix float64 [S, S], symmetric, empty
            diagonal; ``sim[i, j] = 1 - d(e_i, e_j) > 1 - tau`` for every
            stored pair; absent pairs have ``d >= tau`` (or were missed by
            MinHash, or cut by ``max_neighbours``).
        tau: the radius.
        metric: ``"jaccard"``, ``"eq2"`` or ``"given"`` (from a matrix).
        method: ``"exact"``, ``"minhash"`` or ``"dense"``.
        degree: int64 [S] neighbours found with d < tau, before any
            ``max_neighbours`` cap: the density rho of eq. 4.
        candidate_pairs: pairs whose distance was computed.
        seconds: time to build.
        distance: exact distance oracle ``distance(x, others) -> float64``
            for one entry against an int array of entries, also for pairs
            without an edge (eq. 5 needs them); None: such pairs count 1.
    """
    sim: sp.csr_matrix
    degree: np.ndarray
    tau: float
    metric: str
    method: str
    candidate_pairs: int
    seconds: float
    distance: Callable[[int, np.ndarray], np.ndarray] | None = None

    @property
    def num_edges(self) -> int:
        """Undirected edges (pairs with d < tau)."""
        return int(self.sim.nnz // 2)


@checked
def eq2_tau(profile: Profile, min_count: float) -> float:
    """The eq. 2/3 radius at which pairs need more than ``min_count`` co-activations.

    ``d = 1 - f / F < tau``  <=>  ``f > (1 - tau) F``; so
    ``tau = 1 - min_count / F`` with ``F = profile.total_coactivation()``.

    Raises:
        InvalidNumberError: min_count outside [0, F).
    """
    total = profile.total_coactivation()
    min_count = parse_number(min_count, "min_count", 0, total, hi_open=True)
    return 1.0 - float(min_count) / total


class _ProfileDistance:
    """Exact distance of one entry to many, from query bitsets (any pair)."""

    def __init__(self, profile: Profile, metric: str, bits=None):
        self.bits = entry_bitsets(profile) if bits is None else bits
        self.n_act = profile.activation_counts()
        self.metric = metric
        self.total = profile.total_coactivation()

    def __call__(self, x: int, others: np.ndarray) -> np.ndarray:
        f = popcount_rows(self.bits[others] & self.bits[x])
        return coactivation_distance(f, self.n_act[x], self.n_act[others],
                                     metric=self.metric, total=self.total)


def _cap_degree(i, j, s, S, k):
    """Keep a pair if it is among the k most similar of either endpoint."""
    a = np.concatenate([i, j])
    b = np.concatenate([j, i])
    w = np.concatenate([s, s])
    o = np.lexsort((b, -w, a))                  # by node, then similarity desc, then id
    a_o = a[o]
    first = np.searchsorted(a_o, a_o, side="left")
    rank = np.arange(a_o.shape[0]) - first
    keep = np.zeros(a.shape[0], bool)
    keep[o[rank < k]] = True
    n = i.shape[0]
    keep = keep[:n] | keep[n:]
    return i[keep], j[keep], s[keep]


def _symmetric(i, j, s, S) -> sp.csr_matrix:
    """Symmetric CSR (int32 indices) from pairs i < j (or i != j) and weights."""
    a = np.concatenate([i, j])
    b = np.concatenate([j, i]).astype(np.int32)
    w = np.concatenate([s, s]).astype(np.float64)
    o = np.lexsort((b, a))
    indptr = np.zeros(S + 1, np.int64)
    np.cumsum(np.bincount(a, minlength=S), out=indptr[1:])
    idx_t = np.int32 if indptr[-1] < 2 ** 31 else np.int64
    return sp.csr_matrix((w[o], b[o], indptr.astype(idx_t)), shape=(S, S))


@checked
def graph_from_distances(D, tau: float) -> NeighbourGraph:
    """Neighbour graph of a dense symmetric distance matrix (tests, small N).

    Args:
        D: float [N, N] symmetric distances in [0, 1].
        tau: radius in (0, 1]; pairs with ``D < tau`` become edges.

    Raises:
        InvalidRatioError: tau outside (0, 1].
        ShapeError: D not square and symmetric, or values outside [0, 1].
    """
    tau = parse_ratio(tau, "tau")
    D = np.asarray(D, np.float64)
    if D.ndim != 2 or D.shape[0] != D.shape[1] or not np.allclose(D, D.T):
        raise ShapeError(f"distance matrix {D.shape} must be square and symmetric")
    if D.size and (D.min() < 0 or D.max() > 1):
        raise ShapeError("distances must lie in [0, 1]")
    m = tau > D
    np.fill_diagonal(m, False)
    i, j = np.nonzero(np.triu(m, 1))
    g = _symmetric(i, j, 1.0 - D[i, j], D.shape[0])
    return NeighbourGraph(sim=g, degree=np.diff(g.indptr).astype(np.int64), tau=tau,
                          metric="given", method="dense",
                          candidate_pairs=int(D.shape[0] * (D.shape[0] - 1) // 2),
                          seconds=0.0, distance=lambda x, others: D[x, others])


def _cat(parts: list, dtype) -> np.ndarray:
    """The concatenation of ``parts`` as ``dtype`` (empty when there are none)."""
    return np.concatenate(parts).astype(dtype) if parts else np.empty(0, dtype)


def _exact_pairs(profile: Profile, tau: float, metric: str, nodes: np.ndarray,
                 block: int = 1024):
    """All pairs among ``nodes`` with d < tau, by blocked dense products."""
    n_act = profile.activation_counts()
    total = profile.total_coactivation()
    A = profile.acts[:, nodes].astype(np.float32).toarray()      # [n, N]
    N = nodes.shape[0]
    ii, jj, ss = [], [], []
    for a in range(0, N, block):
        b = min(a + block, N)
        f = A[:, a:b].T @ A[:, a:]                                  # [b-a, N-a]
        d = coactivation_distance(f, n_act[nodes[a:b]][:, None], n_act[nodes[a:]][None, :],
                                  metric=metric, total=total)
        keep = d < tau
        keep &= (np.arange(a, b)[:, None] < np.arange(a, N)[None, :])   # i < j
        r, c = np.nonzero(keep)
        ii.append(nodes[a + r])
        jj.append(nodes[a + c])
        ss.append(1.0 - d[r, c])
    cand = N * (N - 1) // 2
    return _cat(ii, np.int64), _cat(jj, np.int64), _cat(ss, np.float64), cand


def _lsh_params(threshold: float, max_hashes: int = 200) -> tuple[int, int]:
    """(bands, rows) for MinHash LSH at Jaccard ``threshold``.

    A pair at similarity ``threshold + 0.1`` shares a bucket in some band with
    probability >= 0.95; among the settings that meet this with at most
    ``max_hashes`` hash functions, the one with the most rows per band (fewest
    false candidates) wins.
    """
    target = min(1.0, threshold + 0.1)
    best = (1, 1)
    for rows in range(1, 9):
        p = target ** rows
        bands = 1 if p >= 1 else max(1, math.ceil(math.log(0.05) / math.log1p(-p)))
        if bands * rows <= max_hashes:
            best = (bands, rows)
    return best


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values (sort-based; faster than numpy's hash unique here)."""
    x = np.sort(x)
    if x.shape[0] == 0:
        return x
    keep = np.empty(x.shape[0], bool)
    keep[0] = True
    np.not_equal(x[1:], x[:-1], out=keep[1:])
    return x[keep]


def _window_pairs(order: np.ndarray, keys_sorted: np.ndarray, window: int):
    """Pairs of positions in runs of equal keys, each with its next <= window."""
    n = keys_sorted.shape[0]
    brk = np.flatnonzero(keys_sorted[1:] != keys_sorted[:-1]) + 1
    rs = np.concatenate([[0], brk])
    rl = np.diff(np.concatenate([rs, [n]]))
    big = rl > 1
    rs, rl = rs[big], rl[big]
    ii, jj = [], []
    for off in range(1, min(int(rl.max(initial=1)), window + 1)):
        ok = rl > off
        if not ok.any():
            break
        lens_o = rl[ok] - off
        base = np.repeat(rs[ok] - (np.cumsum(lens_o) - lens_o), lens_o)
        p = base + np.arange(int(lens_o.sum()))
        ii.append(order[p])
        jj.append(order[p + off])
    if not ii:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(ii), np.concatenate(jj)


def _minhash_pairs(profile: Profile, tau: float, nodes: np.ndarray, bits: np.ndarray, *,
                   seed: int = 0, bands: int | None = None, rows: int | None = None):
    """Pairs among ``nodes`` with Jaccard distance < tau: MinHash LSH candidates,
    each checked exactly with query bitsets."""
    s_min = 1.0 - tau
    if bands is None or rows is None:
        bands, rows = _lsh_params(s_min)
    E = profile.by_entry()
    n_q = profile.num_queries
    N = nodes.shape[0]
    lens = (E.indptr[nodes + 1] - E.indptr[nodes]).astype(np.int64)
    flat = _gather_rows(E.indptr, E.indices, nodes)
    seg = np.zeros(N, np.int64)
    np.cumsum(lens[:-1], out=seg[1:])
    small_t = np.uint16 if n_q <= 1 << 16 else np.uint32
    flat = flat.astype(small_t)
    rng = np.random.default_rng(seed)
    mix = rng.integers(1, 2 ** 61, size=rows, dtype=np.uint64) | np.uint64(1)
    keys_acc: list[np.ndarray] = []
    acc_len = 0
    uniq = np.empty(0, np.int64)
    for _ in range(bands):
        perms = np.stack([rng.permutation(n_q).astype(small_t) for _ in range(rows)])
        sig = np.minimum.reduceat(perms[:, flat], seg, axis=1).astype(np.uint64)
        h = np.zeros(N, np.uint64)
        for r in range(rows):
            h = (h ^ sig[r]) * mix[r] + np.uint64(0x9E3779B97F4A7C15)
        order = np.argsort(h, kind="stable")            # stable: token order within a run
        i, j = _window_pairs(order, h[order], BUCKET_WINDOW)
        lo, hi = np.minimum(i, j), np.maximum(i, j)
        ok = np.minimum(lens[lo], lens[hi]) > s_min * np.maximum(lens[lo], lens[hi])
        keys_acc.append(lo[ok] * np.int64(N) + hi[ok])
        acc_len += int(ok.sum())
        if acc_len > (1 << 25):
            uniq = _sorted_unique(np.concatenate([uniq] + keys_acc))
            keys_acc, acc_len = [], 0
    uniq = _sorted_unique(np.concatenate([uniq] + keys_acc))
    del keys_acc
    ii, jj, ss = [], [], []
    for a in range(0, uniq.shape[0], 1 << 22):
        key = uniq[a:a + (1 << 22)]
        i, j = key // N, key % N
        f = pair_intersections(bits, nodes[i], nodes[j])
        d = coactivation_distance(f, lens[i], lens[j], metric="jaccard")
        keep = d < tau
        ii.append(nodes[i[keep]])
        jj.append(nodes[j[keep]])
        ss.append(1.0 - d[keep])
    return _cat(ii, np.int64), _cat(jj, np.int64), _cat(ss, np.float64), int(uniq.shape[0])


def _gather_rows(indptr, indices, rows) -> np.ndarray:
    """Concatenate CSR rows ``rows`` (vectorised)."""
    starts = indptr[rows]
    lens = indptr[rows + 1] - starts
    total = int(lens.sum())
    offs = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return indices[np.arange(total) + offs]


@checked
def neighbour_graph(profile: Profile, *, tau: float = DEFAULT_TAU,
                    metric: str = DEFAULT_METRIC, method: str = "auto",
                    max_neighbours: int | None = None, seed: int = 0) -> NeighbourGraph:
    """The sparse graph of entry pairs with distance below ``tau`` (§5.1 step 2).

    Args:
        profile: the layer's activation profile.
        tau: clustering radius in (0, 1].
        metric: ``"jaccard"`` or ``"eq2"`` (see the module docstring).
        method: ``"exact"``, ``"minhash"`` (Jaccard only) or ``"auto"``
            (exact up to :data:`EXACT_LIMIT` entries, else MinHash for Jaccard;
            eq2 is always exact over the entries that can reach the threshold).
        max_neighbours: keep an edge only if it is among the this-many
            nearest of one of its endpoints (bounds memory; ``degree``
            still counts every neighbour found).  None: keep all.
        seed: MinHash permutations.

    Returns:
        A :class:`NeighbourGraph` over all S entries (never-activated entries
        have no edges).

    Raises:
        InvalidRatioError: tau outside (0, 1].
        InvalidChoiceError: an unknown metric or method.
        LayoutError: an empty profile; eq2 with a tau so close to 1 that
            more than 16384 entries qualify.
    """
    tau = parse_ratio(tau, "tau", layer=profile.layer)
    parse_choice(metric, "metric", METRICS)
    parse_choice(method, "method", METHODS)
    if max_neighbours is not None:
        parse_positive_int(max_neighbours, "max_neighbours")
    if profile.acts.nnz == 0:
        raise LayoutError("the profile activates no entry", layer=profile.layer)
    t0 = time.perf_counter()
    S = profile.num_tokens
    n_act = profile.activation_counts()
    oracle = _ProfileDistance(profile, metric)
    if metric == "eq2":
        if method == "minhash":
            raise LayoutError("method 'minhash' estimates Jaccard similarity; "
                              "use method 'exact' with metric 'eq2'")
        need = (1.0 - tau) * profile.total_coactivation()
        nodes = np.flatnonzero(n_act > need)
        if nodes.shape[0] > _EQ2_EXACT_MAX:
            raise LayoutError(f"eq. 2 with tau={tau}: {nodes.shape[0]} entries can reach "
                              f"the threshold (> {_EQ2_EXACT_MAX}); the graph would be "
                              "nearly complete. Lower tau or use metric 'jaccard'",
                              layer=profile.layer)
        method = "exact"
        with one_blas_thread():
            i, j, s, cand = _exact_pairs(profile, tau, metric, nodes)
    else:
        nodes = np.flatnonzero(n_act > 0)
        if method == "auto":
            method = "exact" if nodes.shape[0] <= EXACT_LIMIT else "minhash"
        if method == "exact":
            with one_blas_thread():
                i, j, s, cand = _exact_pairs(profile, tau, metric, nodes)
        else:
            i, j, s, cand = _minhash_pairs(profile, tau, nodes, oracle.bits, seed=seed)
    degree = (np.bincount(i, minlength=S) + np.bincount(j, minlength=S)).astype(np.int64)
    if max_neighbours is not None and degree.max(initial=0) > max_neighbours:
        i, j, s = _cap_degree(i, j, s, S, int(max_neighbours))
    g = _symmetric(i, j, s, S)
    return NeighbourGraph(sim=g, degree=degree, tau=tau, metric=metric, method=method,
                          candidate_pairs=int(cand), seconds=time.perf_counter() - t0,
                          distance=oracle)


@checked
def build_clusters(graph: NeighbourGraph, *, nodes=None,
                   max_cluster_size: int = DEFAULT_MAX_CLUSTER_SIZE,
                   max_replicas: int | None = DEFAULT_MAX_REPLICAS
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 (BUILD_CLUSTERS, SWARM §5.1) on a neighbour graph.

    Step 3: density ``rho(e_i) = |{j != i : d(e_i, e_j) < tau}|`` (eq. 4,
    ``graph.degree``); the medoid queue orders the nodes by descending rho
    (ties: lower id first).  Step 4: for each medoid ``m`` not yet covered,
    the candidates are its neighbours (``d(m, e) < tau``) in ascending
    distance (ties: lower id first); each is examined once, in order, and
    joins if its mean distance to the current members (eq. 5) is below tau;
    distances come from ``graph.distance`` (exact for every pair), or count 1
    for pairs without an edge if the graph has no distance oracle. The members
    are then marked covered, and the loop stops once every node is covered.
    Nodes without a neighbour become singleton clusters (they come last in the
    queue).

    The scan is vectorised per accepted member: ``acc[c]`` holds
    ``sum_{e in C} d(c, e)`` for every candidate, and the next member is the
    first later eligible candidate with ``acc[c] < tau |C|``; candidates
    skipped on the way were examined against the same cluster, as in the
    sequential loop.

    Args:
        graph: from :func:`neighbour_graph` or :func:`graph_from_distances`.
        nodes: int ids to cluster (default every node of the graph).
        max_cluster_size: cap on members per cluster (>= 1).
        max_replicas: an entry in this many clusters already is no longer a
            candidate (None: no cap, the paper's behaviour).

    Returns:
        ``(ptr int64 [C+1], members int64 [M])``: CSR, each cluster's medoid
        first, then the members in order of addition.

    Raises:
        InvalidIntegerError: max_cluster_size < 1 or max_replicas < 1.
    """
    parse_positive_int(max_cluster_size, "max_cluster_size")
    if max_replicas is not None:
        parse_positive_int(max_replicas, "max_replicas")
    g = graph.sim
    tau = graph.tau
    N = g.shape[0]
    indptr, indices, data = g.indptr, g.indices.astype(np.int64), g.data
    nodes = np.arange(N) if nodes is None else np.asarray(nodes, np.int64)
    rho = graph.degree[nodes]
    queue = nodes[np.argsort(-rho, kind="stable")]
    covered = np.zeros(N, bool)
    copies = np.zeros(N, np.int64)
    cap = np.iinfo(np.int64).max if max_replicas is None else int(max_replicas)
    in_set = np.zeros(N, bool)
    in_set[nodes] = True
    remaining = int(nodes.shape[0])
    pos = np.full(N, -1, np.int64)
    sizes: list[int] = []
    chunks: list[np.ndarray] = []
    has_edges = np.diff(indptr) > 0
    dist = graph.distance
    for m in queue:
        if covered[m]:
            continue
        if not has_edges[m]:
            break                           # the rest of the queue has rho = 0
        a, b = indptr[m], indptr[m + 1]
        nb = indices[a:b]
        d0 = dist(int(m), nb) if dist is not None else 1.0 - data[a:b]
        o = np.lexsort((nb, d0))            # ascending distance, then id
        cand = nb[o]
        acc = np.asarray(d0, np.float64)[o]     # acc[c] = sum_{e in C} d(c, e)
        ok = copies[cand] < cap
        if dist is None:
            pos[cand] = np.arange(cand.shape[0])
        members = [int(m)]
        p, size = 0, 1
        while p < cand.shape[0] and size < max_cluster_size:
            hit = np.flatnonzero((acc[p:] < tau * size) & ok[p:])   # eq. 5: mean < tau
            if hit.shape[0] == 0:
                break
            x = p + int(hit[0])
            c = int(cand[x])
            members.append(c)
            size += 1
            if x + 1 < cand.shape[0]:
                if dist is not None:
                    acc[x + 1:] += dist(c, cand[x + 1:])
                else:                       # pairs without an edge count 1
                    acc[x + 1:] += 1.0
                    ra, rb = indptr[c], indptr[c + 1]
                    idx = pos[indices[ra:rb]]
                    sel = idx > x
                    acc[idx[sel]] -= data[ra:rb][sel]
            p = x + 1
        if dist is None:
            pos[cand] = -1
        mem = np.asarray(members, np.int64)
        newly = mem[~covered[mem] & in_set[mem]]
        covered[mem] = True
        copies[mem] += 1
        remaining -= int(newly.shape[0])
        chunks.append(mem)
        sizes.append(mem.shape[0])
        if remaining == 0:
            break
    rest = queue[~covered[queue]]           # isolated nodes: singleton clusters
    chunks.append(rest)
    sizes.extend([1] * rest.shape[0])
    ptr = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=ptr[1:])
    return ptr, np.concatenate(chunks).astype(np.int64)


@checked_methods
@dataclasses.dataclass(frozen=True)
class ClusterStats:
    """Summary of a clustering.

    Attributes:
        num_tokens: S.
        num_clusters: C.
        num_copies: M, stored entries including replicas.
        replication: M / S (1.0 = no replica).
        size_min, size_mean, size_max: cluster sizes in entries.
        singletons: clusters of one entry (isolated activated entries).
        idle_entries: entries no profiled query activated.
        idle_groups: clusters made of those entries.
        edges: pairs with distance < tau in the neighbour graph.
        candidate_pairs: pairs whose distance was computed.
        metric, method, tau: as used.
        graph_seconds, cluster_seconds: wall time of each stage (s).
    """
    num_tokens: int
    num_clusters: int
    num_copies: int
    replication: float
    size_min: int
    size_mean: float
    size_max: int
    singletons: int
    idle_entries: int
    idle_groups: int
    edges: int
    candidate_pairs: int
    metric: str
    method: str
    tau: float
    graph_seconds: float
    cluster_seconds: float



class _CSR:
    """Clusters as CSR arrays ``ptr`` [C+1] and ``members`` [M] (a cluster's
    members are ``members[ptr[c]:ptr[c+1]]``): what a clustering and a
    baseline layout share."""

    ptr: np.ndarray
    members: np.ndarray

    @property
    def num_clusters(self) -> int:
        """Clusters C."""
        return int(self.ptr.shape[0] - 1)

    @property
    def sizes(self) -> np.ndarray:
        """int64 [C] cluster sizes in entries."""
        return np.diff(self.ptr)

@checked_methods
@dataclasses.dataclass(frozen=True, eq=False)
class Clustering(_CSR):
    """KV clusters of one layer (CSR), ready for ``Store.write_layer``.

    Attributes:
        ptr: int64 [C+1] cluster c holds ``members[ptr[c]:ptr[c+1]]``.
        members: int64 [M] token ids; each cluster starts with its medoid,
            then the members in order of addition.  Every token in [0, S) is
            in at least one cluster, none twice in one cluster.
        medoids: int64 [C] medoid token of each cluster (its first member).
        freq: float32 [C] activation frequency f_i: the fraction of the
            profiled queries that can see the medoid (t >= medoid) which
            activated it; 0 for groups of never-activated entries (eq. 6).
        idle: bool [C] cluster is a group of never-activated entries.
        stats: :class:`ClusterStats`.
    """
    ptr: np.ndarray
    members: np.ndarray
    medoids: np.ndarray
    freq: np.ndarray
    idle: np.ndarray
    stats: ClusterStats

    def cluster(self, c: int) -> np.ndarray:
        """int64 token ids of cluster ``c`` (medoid first)."""
        return self.members[self.ptr[c]:self.ptr[c + 1]]

    def cluster_of(self) -> np.ndarray:
        """int64 [M] cluster id of every stored copy."""
        return np.repeat(np.arange(self.num_clusters, dtype=np.int64), self.sizes)


def _idle_groups(idle: np.ndarray, group: int, keys) -> tuple[list[np.ndarray], np.ndarray]:
    """Split never-activated tokens (ascending) into runs of <= group; pick medoids."""
    n_groups = -(-idle.shape[0] // group)
    groups = np.array_split(idle, n_groups) if n_groups else []
    medoids = []
    for gr in groups:
        if keys is None:
            medoids.append(int(gr[gr.shape[0] // 2]))
        else:
            kk = keys[:, gr].transpose(1, 0, 2).reshape(gr.shape[0], -1).astype(np.float32)
            medoids.append(int(gr[np.argmin(((kk - kk.mean(0)) ** 2).sum(1))]))
    out = []
    for gr, m in zip(groups, medoids, strict=True):
        out.append(np.concatenate([[m], gr[gr != m]]).astype(np.int64))
    return out, np.asarray(medoids, np.int64)


@checked
def cluster(profile: Profile, *, tau: float = DEFAULT_TAU, metric: str = DEFAULT_METRIC,
            max_cluster_size: int = DEFAULT_MAX_CLUSTER_SIZE,
            max_replicas: int | None = DEFAULT_MAX_REPLICAS,
            max_neighbours: int | None = None, idle_group_size: int = 64,
            method: str = "auto", keys=None, seed: int = 0) -> Clustering:
    """Cluster one layer's KV entries by co-activation (SWARM §5.1).

    Builds the tau-neighbourhood graph (:func:`neighbour_graph`), runs
    Algorithm 1 on the activated entries (:func:`build_clusters`) and groups
    the never-activated ones (module docstring).

    Args:
        profile: the layer's :class:`~._profile.Profile`.
        tau: clustering radius in (0, 1] (eqs. 4-5).
        metric: ``"jaccard"`` (default) or ``"eq2"`` (then pick tau with
            :func:`eq2_tau`).
        max_cluster_size: cap on entries per cluster.
        max_replicas: cap on the copies of an entry (None: unbounded).
        max_neighbours: keep only each node's this many nearest neighbours
            as candidates (rho still counts all); None: keep all.
        idle_group_size: cap on a group of never-activated entries.
        method: neighbour search, see :func:`neighbour_graph`.
        keys: optional float [H_kv, S, d] keys; if given, the medoid of a
            group of never-activated entries is the member whose key is
            nearest the group's mean key (else the middle member).
        seed: MinHash seed.

    Returns:
        A :class:`Clustering`: Algorithm 1 clusters (in creation order), then
        singletons, then groups of never-activated entries.

    Raises:
        InvalidRatioError: tau outside (0, 1].
        InvalidChoiceError: an unknown metric or method.
        InvalidIntegerError: a size or count below 1, or not an integer.
        LayoutError: an empty profile.
        ShapeError: ``keys`` does not cover the profile's S tokens.
    """
    tau = parse_ratio(tau, "tau", layer=profile.layer)
    parse_positive_int(idle_group_size, "idle_group_size")
    parse_int(seed, "seed")
    S = profile.num_tokens
    if keys is not None:
        keys = np.asarray(keys)
        if keys.ndim != 3 or keys.shape[1] != S:
            raise ShapeError(f"keys {keys.shape} must be [H_kv, {S}, d]", layer=profile.layer)
    graph = neighbour_graph(profile, tau=tau, metric=metric, method=method,
                            max_neighbours=max_neighbours, seed=seed)
    t0 = time.perf_counter()
    n_act = profile.activation_counts()
    active = np.flatnonzero(n_act > 0)
    idle = np.flatnonzero(n_act == 0)
    ptr, members = build_clusters(graph, nodes=active, max_cluster_size=max_cluster_size,
                                  max_replicas=max_replicas)
    C1 = ptr.shape[0] - 1
    groups, _ = _idle_groups(idle, idle_group_size, keys)
    if groups:
        members = np.concatenate([members] + groups)
        ptr = np.concatenate([ptr, ptr[-1] + np.cumsum([g.shape[0] for g in groups])])
    C = ptr.shape[0] - 1
    medoids = members[ptr[:-1]]
    vis = np.maximum(profile.visible_counts()[medoids], n_act[medoids])
    freq = np.where(vis > 0, n_act[medoids] / np.maximum(vis, 1), 0.0).astype(np.float32)
    is_idle = np.zeros(C, bool)
    is_idle[C1:] = True
    sizes = np.diff(ptr)
    stats = ClusterStats(
        num_tokens=S, num_clusters=C, num_copies=int(members.shape[0]),
        replication=float(members.shape[0] / S), size_min=int(sizes.min()),
        size_mean=float(sizes.mean()), size_max=int(sizes.max()),
        singletons=int((sizes[:C1] == 1).sum()), idle_entries=int(idle.shape[0]),
        idle_groups=len(groups), edges=graph.num_edges,
        candidate_pairs=graph.candidate_pairs, metric=graph.metric, method=graph.method,
        tau=tau, graph_seconds=graph.seconds, cluster_seconds=time.perf_counter() - t0)
    return Clustering(ptr=ptr, members=members, medoids=medoids, freq=freq, idle=is_idle,
                      stats=stats)
