"""Baseline layouts for the evaluation (SWARM §8.1, §8.3) and their DRAM indexes.

Every method of §8 stores the same KV entries on the same disks through the
same engine; what differs is how the entries are grouped into the store's
clusters (the unit a selector picks, striped by eq. 7) and what the DRAM index
that scores a query holds.  Each builder returns a :class:`Layout` ready for
``Store.write_layer`` plus the index data of its selector
(``swarmfs.decode._selectors``):

============  ==============================================  =====================
method        grouping (clusters on disk)                     index (selector)
============  ==============================================  =====================
swarm         co-activation clusters, replicas (§5.1)         medoid keys (Medoid)
no_cluster    token order, no clustering                      every key (Token)
infllm        fixed blocks of ``block`` consecutive tokens     R representative keys
                                                              per block (MultiVector)
pqcache       k-means over keys, per chunk of the context     centroids (Vector)
              (ClusterKV-style; clusters stored together)
quest         pages of ``page`` consecutive tokens             per-channel min/max
                                                              (Bound)
medoid_only   §8.3: a medoid and every entry within tau of     medoid keys
              it (no eq. 5 check)
no_replica    §8.3: Algorithm 1 with one copy per entry        medoid keys
============  ==============================================  =====================

Index vectors are float32 ``[C, H_kv * d]`` (the entry's key flattened over
its KV heads, as ``group_queries`` flattens a query), in the key space of the
``k`` given; callers that store wider entries pad them the same way.

Everything is vectorised numpy except the per-cluster loops that Algorithm 1
itself has (Medoid Only) and the per-chunk k-means loop.

While decoding, the baselines grow by their own rules, not by eq. 9
(:func:`append_rule`, used by ``DecodeSession(baseline=...)``): Quest appends
pages, InfLLM blocks with their representatives, PQCache assigns each new
key to its nearest existing centroid.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from .._errors import LayoutError, ShapeError
from ._cluster import _CSR

__all__ = [
    "METHODS",
    "Growth",
    "InfLLMAppend",
    "Layout",
    "PQCacheAppend",
    "QuestAppend",
    "append_rule",
    "flat_keys",
    "infllm_blocks",
    "kmeans_clusters",
    "medoid_only",
    "no_replica",
    "quest_pages",
    "representative_scores",
    "swarm",
    "token_order",
]

#: Method names, as used by the benchmarks (tools/bench).
METHODS = ("swarm", "no_cluster", "infllm", "pqcache", "quest", "medoid_only", "no_replica")


@dataclasses.dataclass(frozen=True)
class Layout(_CSR):
    """How one method groups a layer's entries, and its index data.

    Attributes:
        name: method name (see :data:`METHODS`).
        ptr: int64 [C+1] and members: int64 [M] clusters as CSR (a token may
            be in several clusters only for co-activation methods).
        medoids: int64 [C] a member of each cluster (the store's medoid; for
            swarm-style layouts the index key).
        kind: selector kind: ``"medoid"``, ``"tokens"``, ``"vectors"``,
            ``"multivector"`` or ``"bounds"``.
        index: index arrays: ``{"vectors": [C, D]}``, ``{"reps": [C, R, D]}``,
            ``{"lo": [C, D], "hi": [C, D]}`` (float32) or ``{}``.
        freq: float32 [C] profile activation frequency (eq. 6), zeros when
            the method has no profile.
        params: the method's parameters (JSON-ready).
        seconds: time to build (s).
    """
    name: str
    ptr: np.ndarray
    members: np.ndarray
    medoids: np.ndarray
    kind: str
    index: dict
    freq: np.ndarray
    params: dict
    seconds: float

    @property
    def num_tokens(self) -> int:
        """Tokens S the layout covers (highest member + 1)."""
        return int(self.members.max()) + 1 if self.members.size else 0

    def summary(self) -> dict:
        """JSON-ready size statistics."""
        s = self.sizes
        return {"method": self.name, "clusters": self.num_clusters,
                "copies": int(self.members.shape[0]),
                "replication": float(self.members.shape[0] / max(self.num_tokens, 1)),
                "size_mean": float(s.mean()), "size_max": int(s.max()),
                "build_s": self.seconds, **{f"param_{k}": v for k, v in self.params.items()}}

    def arrays(self) -> dict:
        """Every array, flat (for an ``np.savez`` cache)."""
        out = {"ptr": self.ptr, "members": self.members, "medoids": self.medoids,
               "freq": self.freq}
        out.update({f"index_{k}": v for k, v in self.index.items()})
        return out

    @classmethod
    def from_arrays(cls, name, kind, arrays, params, seconds) -> Layout:
        """A Layout from the arrays of a saved one (``index_*`` keys are its index)."""
        index = {k[6:]: np.asarray(v) for k, v in arrays.items() if k.startswith("index_")}
        return cls(name=name, ptr=np.asarray(arrays["ptr"]),
                   members=np.asarray(arrays["members"]),
                   medoids=np.asarray(arrays["medoids"]), kind=kind, index=index,
                   freq=np.asarray(arrays["freq"]), params=dict(params), seconds=seconds)


def _check_keys(k) -> np.ndarray:
    k = np.asarray(k)
    if k.ndim != 3 or min(k.shape) == 0:
        raise ShapeError(f"keys {k.shape} must be [H_kv, S, d]")
    return k


def flat_keys(k, tokens=None) -> np.ndarray:
    """float32 [n, H_kv * d]: each token's key over all KV heads (the entry's key)."""
    k = _check_keys(k)
    sel = k if tokens is None else k[:, tokens]
    return np.ascontiguousarray(sel.transpose(1, 0, 2).reshape(sel.shape[1], -1),
                                dtype=np.float32)


def _chunks(S: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of consecutive groups of ``size`` tokens covering [0, S)."""
    if size < 1:
        raise LayoutError(f"group size must be >= 1, got {size}")
    ptr = np.append(np.arange(0, S, size, dtype=np.int64), np.int64(S))
    return ptr, np.arange(S, dtype=np.int64)


def _layout_from_clustering(name, cl, seconds, params) -> Layout:
    return Layout(name=name, ptr=cl.ptr, members=cl.members, medoids=cl.medoids,
                  kind="medoid", index={}, freq=cl.freq, params=params, seconds=seconds)


# -- SWARM and its clustering ablations -----------------------------------------

def _profile(q, k, ratio, scaling, profile_q, max_queries):
    from ._profile import profile_layer
    kw = {} if max_queries is None else {"max_queries": int(max_queries)}
    return profile_layer(q if profile_q is None else profile_q, k, ratio=ratio,
                         scaling=scaling, **kw)


def swarm(q, k, *, ratio: float = 0.1, scaling: float | None = None, tau=None,
          profile_q=None, max_queries=None, name: str = "swarm", **cluster_kw) -> Layout:
    """SWARM's layout (§5.1): activation profile, then Algorithm 1 with replicas.

    Exactly the demo's path (``_profile.profile_layer`` + ``_cluster.cluster``
    with the layout defaults) so the evaluation measures what swarmfs builds.

    Args:
        q: [H_q, S, d] queries of the context; k: [H_kv, S, d] keys.
        ratio: sparsity ratio r of the profile (§8.1: 0.10).
        scaling: logit scale (default d**-0.5).
        tau: clustering radius (None: ``_cluster.DEFAULT_TAU``).
        profile_q: [H_q, S, d] queries from another text that profile this
            context instead of its own (dataset shift, §8.4).
        max_queries: profiled positions (None: the profile default).
        **cluster_kw: passed to ``_cluster.cluster`` (e.g. ``max_replicas``).
    """
    from . import _cluster
    t0 = time.perf_counter()
    k = _check_keys(k)
    prof = _profile(q, k, ratio, scaling, profile_q, max_queries)
    if tau is not None:
        cluster_kw["tau"] = tau
    cl = _cluster.cluster(prof, keys=k, **cluster_kw)
    st = cl.stats
    params = {"tau": st.tau, "metric": st.metric, "ratio": ratio,
              "profiled_queries": prof.num_queries,
              "max_cluster_size": cluster_kw.get("max_cluster_size",
                                                 _cluster.DEFAULT_MAX_CLUSTER_SIZE),
              "max_replicas": cluster_kw.get("max_replicas", _cluster.DEFAULT_MAX_REPLICAS),
              "dataset_shift": profile_q is not None}
    return _layout_from_clustering(name, cl, time.perf_counter() - t0, params)


def no_replica(q, k, **kw) -> Layout:
    """§8.3 "No Replica": Algorithm 1 with every entry in one cluster only
    (``max_replicas=1``); otherwise as :func:`swarm`."""
    return swarm(q, k, name="no_replica", max_replicas=1, **kw)


def medoid_only(q, k, *, ratio: float = 0.1, scaling: float | None = None, tau=None,
                profile_q=None, max_queries=None, max_cluster_size=None,
                max_replicas="default", idle_group_size: int = 64) -> Layout:
    """§8.3 "Medoid Only": a cluster is a medoid plus the entries within tau of
    the medoid, nearest first (no eq. 5 check against the other members).

    Same profile, neighbour graph, medoid queue (eq. 4 density), caps and
    grouping of never-activated entries as ``_cluster.cluster``; only step 4's
    membership test differs.
    """
    from . import _cluster
    t0 = time.perf_counter()
    k = _check_keys(k)
    tau = _cluster.DEFAULT_TAU if tau is None else float(tau)
    mcs = _cluster.DEFAULT_MAX_CLUSTER_SIZE if max_cluster_size is None else int(max_cluster_size)
    cap = _cluster.DEFAULT_MAX_REPLICAS if max_replicas == "default" else max_replicas
    cap = np.iinfo(np.int64).max if cap is None else int(cap)
    prof = _profile(q, k, ratio, scaling, profile_q, max_queries)
    g = _cluster.neighbour_graph(prof, tau=tau)
    S = prof.num_tokens
    n_act = prof.activation_counts()
    active = np.flatnonzero(n_act > 0)
    idle = np.flatnonzero(n_act == 0)
    indptr, indices = g.sim.indptr, g.sim.indices.astype(np.int64)
    sim = g.sim.data
    queue = active[np.argsort(-g.degree[active], kind="stable")]
    covered = np.zeros(S, bool)
    copies = np.zeros(S, np.int64)
    chunks = []
    for m in queue:
        if covered[m]:
            continue
        a, b = indptr[m], indptr[m + 1]
        if a == b:
            break                                   # the rest have no neighbour
        nb = indices[a:b]
        o = np.lexsort((nb, -sim[a:b]))             # ascending distance, then id
        cand = nb[o]
        cand = cand[copies[cand] < cap][:mcs - 1]
        mem = np.concatenate([[m], cand]).astype(np.int64)
        covered[mem] = True
        copies[mem] += 1
        chunks.append(mem)
    rest = queue[~covered[queue]]
    chunks.extend(rest[:, None])
    groups, _ = _cluster._idle_groups(idle, idle_group_size, k)
    chunks.extend(groups)
    sizes = np.array([c.shape[0] for c in chunks], np.int64)
    ptr = np.zeros(sizes.shape[0] + 1, np.int64)
    np.cumsum(sizes, out=ptr[1:])
    members = np.concatenate(chunks).astype(np.int64)
    medoids = members[ptr[:-1]]
    vis = np.maximum(prof.visible_counts()[medoids], n_act[medoids])
    freq = np.where(vis > 0, n_act[medoids] / np.maximum(vis, 1), 0.0).astype(np.float32)
    params = {"tau": tau, "metric": g.metric, "ratio": ratio, "max_cluster_size": mcs,
              "max_replicas": None if cap == np.iinfo(np.int64).max else cap,
              "profiled_queries": prof.num_queries, "dataset_shift": profile_q is not None}
    return Layout(name="medoid_only", ptr=ptr, members=members, medoids=medoids,
                  kind="medoid", index={}, freq=freq, params=params,
                  seconds=time.perf_counter() - t0)


# -- token-order baselines ------------------------------------------------------

def token_order(num_tokens: int, *, group: int = 64) -> Layout:
    """"No Cluster" (§8.1): entries in token order, no clustering.

    The store needs clusters, so consecutive tokens are grouped ``group`` at a
    time; under eq. 7 that is the same striping as one entry per cluster
    (token ``t`` on disk ``t mod N``, in order), with a small cluster table.
    The selector is the exact top-k over every key (``TokenSelector``): its
    index is the full key matrix, built by the caller from the stored keys.
    """
    t0 = time.perf_counter()
    ptr, members = _chunks(int(num_tokens), group)
    return Layout(name="no_cluster", ptr=ptr, members=members, medoids=members[ptr[:-1]],
                  kind="tokens", index={}, freq=np.zeros(ptr.shape[0] - 1, np.float32),
                  params={"group": group}, seconds=time.perf_counter() - t0)


def quest_pages(k, *, page: int = 16) -> Layout:
    """Quest: pages of ``page`` consecutive tokens; the index keeps each
    page's per-channel minimum and maximum key (the score
    sum_c max(q_c lo_c, q_c hi_c) bounds q . k over the page)."""
    t0 = time.perf_counter()
    k = _check_keys(k)
    S = k.shape[1]
    ptr, members = _chunks(S, page)
    fk = flat_keys(k)
    lo = np.minimum.reduceat(fk, ptr[:-1], axis=0)
    hi = np.maximum.reduceat(fk, ptr[:-1], axis=0)
    return Layout(name="quest", ptr=ptr, members=members, medoids=members[ptr[:-1]],
                  kind="bounds", index={"lo": lo, "hi": hi},
                  freq=np.zeros(ptr.shape[0] - 1, np.float32), params={"page": page},
                  seconds=time.perf_counter() - t0)


def representative_scores(q, k, *, window: int) -> np.ndarray:
    """InfLLM's representative score of every token (float64 [S]).

    ``r_m = sum_{j = m+1}^{m+window} q_j . k_m`` summed over the query heads
    that share each KV head: how strongly the following ``window`` tokens'
    queries attend to token m (InfLLM §3.2, "representative tokens").
    Computed with prefix sums of the queries, O(S H d).
    """
    q = np.asarray(q)
    k = _check_keys(k)
    H_q, S, d = q.shape
    H = k.shape[0]
    if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2] or H_q % H:
        raise ShapeError(f"q {q.shape} and k {k.shape} disagree")
    qs = q.astype(np.float64).reshape(H, H_q // H, S, d).sum(axis=1)       # [H, S, d]
    cs = np.zeros((H, S + 1, d), np.float64)
    np.cumsum(qs, axis=1, out=cs[:, 1:])
    m = np.arange(S)
    hi = np.minimum(m + window, S - 1) + 1
    lo = m + 1
    nxt = cs[:, hi] - cs[:, np.minimum(lo, S)]                              # [H, S, d]
    return np.einsum("hsd,hsd->s", nxt, k.astype(np.float64))


def infllm_blocks(q, k, *, block: int = 64, reps: int = 4) -> Layout:
    """InfLLM: fixed blocks of ``block`` consecutive tokens; each block is
    indexed by the keys of its ``reps`` most representative tokens
    (:func:`representative_scores` with a window of one block) and scores a
    query by its best representative (``MultiVectorSelector``).  Whole blocks
    are selected."""
    t0 = time.perf_counter()
    k = _check_keys(k)
    S = k.shape[1]
    if reps < 1:
        raise LayoutError(f"reps must be >= 1, got {reps}")
    ptr, members = _chunks(S, block)
    r = representative_scores(q, k, window=block)
    C = ptr.shape[0] - 1
    tok = _block_reps(r, ptr, block, reps)                                 # [C, reps]
    fk = flat_keys(k, tok.reshape(-1)).reshape(C, reps, -1)
    return Layout(name="infllm", ptr=ptr, members=members, medoids=tok[:, 0].astype(np.int64),
                  kind="multivector", index={"reps": fk},
                  freq=np.zeros(C, np.float32), params={"block": block, "reps": reps},
                  seconds=time.perf_counter() - t0)


def _block_reps(r: np.ndarray, ptr: np.ndarray, block: int, reps: int) -> np.ndarray:
    """Per block of ``ptr`` (consecutive tokens, all ``block`` long but a
    shorter last one), its ``reps`` tokens of highest score ``r`` (ties: the
    earlier token; a block shorter than ``reps`` repeats its best): int64
    [C, reps] positions, best first."""
    S, C = r.shape[0], ptr.shape[0] - 1
    pad = C * block - S
    rr = np.concatenate([r, np.full(pad, -np.inf)]).reshape(C, block)
    top = np.argsort(-rr, axis=1, kind="stable")[:, :reps]
    top = np.where(top < np.diff(ptr)[:, None], top, top[:, :1])
    return (ptr[:-1, None] + top).astype(np.int64)


def _kmeans(x: np.ndarray, n: int, iters: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lloyd's k-means (squared Euclidean) from ``n`` random points; an empty
    cluster is re-seeded with the point farthest from its centroid.

    Returns:
        (centroids [n, D], label [m], squared distance to its centroid [m]).
    """
    m = x.shape[0]
    n = min(n, m)
    c = x[rng.choice(m, n, replace=False)].copy()
    xx = (x * x).sum(1)
    rows = np.arange(m)

    def assign(c):
        d = xx[:, None] - 2.0 * (x @ c.T) + (c * c).sum(1)[None, :]
        lab = d.argmin(1)
        return lab, d[rows, lab]

    for _ in range(iters):
        lab, dist = assign(c)
        order = np.argsort(lab, kind="stable")
        cnt = np.bincount(lab, minlength=n)
        nz = np.flatnonzero(cnt)
        starts = np.concatenate([[0], np.cumsum(cnt[nz])[:-1]])
        c[nz] = np.add.reduceat(x[order], starts, axis=0) / cnt[nz, None]
        empty = np.flatnonzero(cnt == 0)
        if empty.size:
            c[empty] = x[np.argsort(-dist)[:empty.size]]
    lab, dist = assign(c)
    return c, lab, dist


def kmeans_clusters(k, *, mean_size: float = 16.0, chunk: int = 4096, iters: int = 10,
                    seed: int = 0) -> Layout:
    """PQCache / ClusterKV style: k-means over the keys, selection by centroid.

    The context is cut into chunks of ``chunk`` consecutive tokens (ClusterKV
    clusters chunk by chunk; one k-means over a 1M-token context with 65K
    centroids would cost hours here); each chunk's flattened keys get
    ``round(chunk / mean_size)`` centroids.  Clusters are stored together (a
    cluster is a store cluster, striped like SWARM's), each token exactly once;
    the index is the centroids (``VectorSelector``: q . centroid is the mean
    of q . k over the cluster).  Members are ordered by distance to the
    centroid, so the medoid (the first) is the member nearest it.
    """
    from ..decode._selectors import single_threaded_blas
    t0 = time.perf_counter()
    k = _check_keys(k)
    S = k.shape[1]
    rng = np.random.default_rng(seed)
    member_parts, size_parts, cents = [], [], []
    with single_threaded_blas():
        for a in range(0, S, chunk):
            b = min(a + chunk, S)
            x = flat_keys(k[:, a:b])
            c, lab, dist = _kmeans(x, max(1, int(round((b - a) / mean_size))), iters, rng)
            cnt = np.bincount(lab, minlength=c.shape[0])
            keep = np.flatnonzero(cnt)
            member_parts.append(np.lexsort((dist, lab)) + a)    # by cluster, nearest first
            size_parts.append(cnt[keep])
            cents.append(c[keep])
    sizes = np.concatenate(size_parts)
    ptr = np.zeros(sizes.shape[0] + 1, np.int64)
    np.cumsum(sizes, out=ptr[1:])
    members = np.concatenate(member_parts).astype(np.int64)
    return Layout(name="pqcache", ptr=ptr, members=members, medoids=members[ptr[:-1]],
                  kind="vectors",
                  index={"vectors": np.concatenate(cents).astype(np.float32)},
                  freq=np.zeros(sizes.shape[0], np.float32),
                  params={"mean_size": mean_size, "chunk": chunk, "iters": iters, "seed": seed},
                  seconds=time.perf_counter() - t0)


# -- decoding: each baseline's own rule for appended entries ----------------------

@dataclasses.dataclass(frozen=True)
class Growth:
    """Where one flush of new entries goes under a baseline's rule, and the
    layer's index after it (:meth:`QuestAppend.place` and the others).

    Attributes:
        joins: ``(ptr int64 [n+1], clusters int64 [j])`` the existing
            clusters each new entry joins (``Store.append``'s ``joins``).
        new_cluster_size: tokens per new cluster of the entries that join
            none, taken in token order (``Store.append``'s rule).
        medoids: int64 [k] position of each new cluster's medoid
            (``Store.append(medoids=)``).
        index: the index after the append, one row per cluster (the C old
            ones, then the k new ones), in :attr:`Layout.index` form; the old
            arrays are not modified (a retrieval still scoring them is safe).
    """
    joins: tuple
    new_cluster_size: int
    medoids: np.ndarray
    index: dict


def _index_rows(index: dict, keys: tuple, num_clusters: int, name: str) -> None:
    """LayoutError unless ``index`` holds ``keys``, each with one row per cluster."""
    if not isinstance(index, dict) or any(x not in index for x in keys):
        raise LayoutError(f"a {name} index holds {keys}, got "
                          f"{sorted(index) if isinstance(index, dict) else type(index)}")
    bad = [x for x in keys if np.asarray(index[x]).shape[0] != num_clusters]
    if bad:
        raise LayoutError(f"the {name} index has {np.asarray(index[bad[0]]).shape[0]} rows "
                          f"for {num_clusters} clusters (it was not extended by an append)")


def _check_new(k, n: int, q=None) -> int:
    if k.ndim != 3 or not 0 < int(n) <= k.shape[1]:
        raise ShapeError(f"new keys {k.shape} must be [H_kv, m, d] with 0 < n = {n} <= m")
    if q is not None and (q.ndim != 3 or q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2]
                          or q.shape[0] % k.shape[0]):
        raise ShapeError(f"new queries {q.shape} do not match the keys {k.shape}")
    return int(n)


class QuestAppend:
    """Quest's pages while decoding (Tang et al. 2024, §3; SWARM §8.1).

    Pages stay ``page`` tokens long and aligned: page p holds positions
    [p x page, (p+1) x page).  New entries first fill the layer's partial
    last page (its bounds widened by their keys), then start new pages whose
    per-channel min/max key bounds are computed from their keys.  A partial
    page of new entries is written only by a forced flush; otherwise it waits
    in the local window (pending) until it is full.

    Args:
        page: tokens per page (:func:`quest_pages`' ``page``).
    """

    name = "quest"
    #: whether :meth:`place` needs the new entries' queries
    queries = False

    def __init__(self, page: int = 16):
        if isinstance(page, bool) or not isinstance(page, (int, np.integer)) or page < 1:
            raise LayoutError(f"page must be an integer >= 1, got {page!r}")
        self.page = int(page)

    def count(self, num_tokens: int, ready: int, pending: int) -> int:
        """Entries that may be written now: the ``ready`` (matured) ones up to
        the last page boundary, so that no page is left partial."""
        return max(((int(num_tokens) + int(ready)) // self.page) * self.page -
                   int(num_tokens), 0)

    def place(self, index: dict, *, num_tokens: int, sizes, k, n: int, q=None) -> Growth:
        """Pages for the first ``n`` new entries.

        Args:
            index: ``{"lo", "hi"}`` float32 [C, H_kv*d] bounds of the C pages.
            num_tokens: S, tokens stored (the new ones get S, S+1, ...).
            sizes: int [C] the stored pages' sizes.
            k: float [H_kv, m, d] keys of the m pending entries, oldest first.
            n: entries written now (1 <= n <= m).
            q: unused.

        Raises:
            LayoutError: an index without a row per page, or a last page that
                is not the partial page ending at S.  ShapeError: bad shapes.
        """
        k = np.asarray(k)
        n = _check_new(k, n)
        sizes = np.asarray(sizes)
        C, S = sizes.shape[0], int(num_tokens)
        _index_rows(index, ("lo", "hi"), C, self.name)
        fill = min((-S) % self.page, n)
        if fill and (C == 0 or sizes[-1] != S % self.page):
            raise LayoutError(f"the last page holds {int(sizes[-1]) if C else 0} tokens; "
                              f"pages of {self.page} aligned at 0 end with {S % self.page} "
                              f"at S = {S}")
        fk = flat_keys(k[:, :n])
        starts = np.arange(fill, n, self.page)
        lo = np.concatenate([index["lo"], np.minimum.reduceat(fk, starts, axis=0)
                             if starts.size else fk[:0]]).astype(np.float32, copy=False)
        hi = np.concatenate([index["hi"], np.maximum.reduceat(fk, starts, axis=0)
                             if starts.size else fk[:0]]).astype(np.float32, copy=False)
        if fill:                                   # the partial last page widens
            lo[C - 1] = np.minimum(lo[C - 1], fk[:fill].min(axis=0))
            hi[C - 1] = np.maximum(hi[C - 1], fk[:fill].max(axis=0))
        jptr = np.minimum(np.arange(n + 1, dtype=np.int64), fill)
        return Growth(joins=(jptr, np.full(fill, C - 1, np.int64)),
                      new_cluster_size=self.page, medoids=S + starts.astype(np.int64),
                      index={"lo": lo, "hi": hi})


class InfLLMAppend:
    """InfLLM's blocks while decoding (Xiao et al. 2024, §3.2; SWARM §8.1).

    New entries form blocks of ``block`` consecutive tokens from the stored
    length on.  A block's representatives are its ``reps`` tokens of highest
    representative score (:func:`representative_scores` over the ``block``
    following tokens' queries, the window :func:`infllm_blocks` uses), so a
    block is written once those ``block`` successors have been decoded: the
    scores are then exactly those of a layout of the whole sequence.  A
    forced flush writes what is pending, scoring the last tokens over the
    queries that exist (as at the end of the prefill).

    Args:
        block: tokens per block; reps: representatives per block
            (:func:`infllm_blocks`' parameters).
    """

    name = "infllm"
    queries = True

    def __init__(self, block: int = 64, reps: int = 4):
        for nm, v in (("block", block), ("reps", reps)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise LayoutError(f"{nm} must be an integer >= 1, got {v!r}")
        self.block, self.reps = int(block), int(reps)

    def count(self, num_tokens: int, ready: int, pending: int) -> int:
        """Entries that may be written now: whole blocks of ``ready`` entries
        whose ``block`` successors are pending too."""
        b = self.block
        return max(min(int(ready) // b, int(pending) // b - 1), 0) * b

    def place(self, index: dict, *, num_tokens: int, sizes, k, n: int, q=None) -> Growth:
        """Blocks and representatives for the first ``n`` new entries.

        Args:
            index: ``{"reps"}`` float32 [C, R, H_kv*d] representative keys.
            num_tokens: S, tokens stored; sizes: int [C] the blocks' sizes.
            k: float [H_kv, m, d] and q: float [H_q, m, d] keys and queries
                of the m pending entries, oldest first (the step's query of
                each entry's token).
            n: entries written now (1 <= n <= m).

        Raises:
            LayoutError: an index without a row per block or of another R.
            ShapeError: bad shapes or no queries.
        """
        k = np.asarray(k)
        if q is None:
            raise ShapeError("InfLLM's representatives need the new entries' queries")
        q = np.asarray(q)
        n = _check_new(k, n, q)
        C = np.asarray(sizes).shape[0]
        _index_rows(index, ("reps",), C, self.name)
        if index["reps"].ndim != 3 or index["reps"].shape[1] != self.reps:
            raise LayoutError(f"the infllm index {index['reps'].shape} does not hold "
                              f"{self.reps} representatives per block")
        m = min(k.shape[1], n + self.block)          # the block's successors' queries
        r = representative_scores(q[:, :m], k[:, :m], window=self.block)[:n]
        ptr, _ = _chunks(n, self.block)
        tok = _block_reps(r, ptr, self.block, self.reps)                   # [c, reps]
        reps = flat_keys(k, tok.reshape(-1)).reshape(tok.shape[0], self.reps, -1)
        return Growth(joins=(np.zeros(n + 1, np.int64), np.empty(0, np.int64)),
                      new_cluster_size=self.block, medoids=int(num_tokens) + tok[:, 0],
                      index={"reps": np.concatenate([index["reps"], reps])})


class PQCacheAppend:
    """PQCache's clusters while decoding (Zhang et al. 2025; SWARM §8.1).

    The codebook is not retrained: each new key is encoded with the existing
    centroids, i.e. it joins the cluster of its nearest centroid (squared
    Euclidean over the flattened key, as :func:`kmeans_clusters` assigns),
    and the index is unchanged.  Every entry stays in exactly one cluster.
    """

    name = "pqcache"
    queries = False

    def count(self, num_tokens: int, ready: int, pending: int) -> int:
        """Entries that may be written now: every matured one."""
        return int(ready)

    def place(self, index: dict, *, num_tokens: int, sizes, k, n: int, q=None) -> Growth:
        """The nearest centroid of each of the first ``n`` new entries.

        Args:
            index: ``{"vectors"}`` float32 [C, H_kv*d] centroids.
            num_tokens: S; sizes: int [C]; k: float [H_kv, m, d] keys of the
                m pending entries; n: entries written now; q: unused.

        Raises:
            LayoutError: an index without a row per cluster.  ShapeError: bad
                shapes.
        """
        from ..decode._selectors import single_threaded_blas
        k = np.asarray(k)
        n = _check_new(k, n)
        C = np.asarray(sizes).shape[0]
        _index_rows(index, ("vectors",), C, self.name)
        c = np.asarray(index["vectors"], np.float32)
        x = flat_keys(k[:, :n])
        with single_threaded_blas():
            d = (x * x).sum(1)[:, None] - 2.0 * (x @ c.T) + (c * c).sum(1)[None, :]
        return Growth(joins=(np.arange(n + 1, dtype=np.int64), d.argmin(1).astype(np.int64)),
                      new_cluster_size=1, medoids=np.empty(0, np.int64), index=dict(index))


def append_rule(layout: Layout):
    """The rule by which a baseline layout grows while decoding, with the
    layout's own parameters: :class:`QuestAppend`, :class:`InfLLMAppend` or
    :class:`PQCacheAppend`; None for the co-activation layouts (swarm and its
    ablations grow by SWARM §6.2, eq. 9).

    Raises:
        LayoutError: a token-order layout (``no_cluster``: its index is every
            key, which no append rule extends) or an unknown one.
    """
    if layout.kind == "medoid":
        return None
    if layout.name == "quest":
        return QuestAppend(page=layout.params["page"])
    if layout.name == "infllm":
        return InfLLMAppend(block=layout.params["block"], reps=layout.params["reps"])
    if layout.name == "pqcache":
        return PQCacheAppend()
    raise LayoutError(f"no append rule for the {layout.name!r} layout")
