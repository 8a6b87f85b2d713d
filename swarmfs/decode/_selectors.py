"""What a query selects: scoring the DRAM index, and choosing clusters.

SWARM scores a query against the medoid key of every cluster (§5.2, the index
in DRAM), then takes clusters in score order until the entry budget is met.
The baselines of §8 differ only in the scoring, so the
:class:`~swarmfs.Retriever` takes any selector:

* :class:`MedoidSelector` -- SWARM: the medoid keys stored with the clusters.
* :class:`VectorSelector` -- one vector per cluster (k-means centroids:
  PQCache / ClusterKV style).
* :class:`MultiVectorSelector` -- several representative keys per cluster,
  the cluster's score is their best (InfLLM style blocks).
* :class:`BoundSelector` -- per-channel min/max keys per cluster, the score is
  the upper bound sum_c max(q_c lo_c, q_c hi_c) (Quest pages).
* :class:`TokenSelector` -- every key: the exact top-k tokens (the oracle,
  "No Cluster" in §8.1, which pays for scoring all keys).

All take the queries ``q`` float32 [B, H_q, d] and return float32 scores
[B, C] (tokens: [B, S]).  Selectors that score by a dot product sum the query
heads of each GQA group first (``group_queries``), which is equivalent; they
also accept such an already summed ``qg`` [B, H_kv*d].  What a selector
offers the Retriever is the :class:`Selector` protocol; one that caches
per-layer state drops it in ``invalidate(layer)``, which
:meth:`~swarmfs.Retriever.refresh` calls after the layer changed.

The choice itself is one pure function, :func:`select_clusters` (the C rule
``_select``), with one local-window rule (:func:`swarmfs.decode._window.window_size`);
the Retriever's stages (``swarmfs.decode._stages``), the layout quality evaluation
(``layout._quality``) and the demo all use these two.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
import time
from typing import Protocol, runtime_checkable

import numpy as np

from .._errors import InvalidArgumentError, LayoutError, NotFoundError
from .._validate import checked_methods, parse_choice, parse_int, parse_positive_int

__all__ = ["Selector", "FusedSelector", "MedoidSelector", "VectorSelector",
           "MultiVectorSelector", "BoundSelector", "TokenSelector", "Selection",
           "select_clusters", "group_queries", "score_medoids", "head_logits",
           "single_threaded_blas", "ThreadChooser"]

_BLAS = None


def single_threaded_blas():
    """Context in which numpy's BLAS runs on one thread.

    The medoid GEMV is memory-bound; on a few shared cores a multi-threaded
    BLAS spends more time synchronising its threads than computing (measured
    here: 8 ms instead of 0.2 ms for a 16 MB index when another process is
    busy).  ``threadpoolctl`` switches the pool for the call only (~6 µs).
    """
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController
        _BLAS = ThreadpoolController()
    return _BLAS.limit(limits=1, user_api="blas")


def score_medoids(medoids: np.ndarray, qg: np.ndarray) -> np.ndarray:
    """Medoid scores: float32 [B, C] = qg [B, H_kv*d] @ medoids [C, H_kv*d].T.

    fp16/bf16 medoids are scored by the C kernel ``gemv_half`` (fp32
    accumulation), fp32 ones by single-threaded BLAS.

    Raises:
        InvalidArgumentError: the shapes do not match.
    """
    qg = np.asarray(qg, dtype=np.float32)
    if medoids.ndim != 2 or qg.ndim != 2 or qg.shape[1] != medoids.shape[1]:
        raise InvalidArgumentError(f"queries {qg.shape} do not match the rows "
                                   f"{medoids.shape}")
    if medoids.dtype == np.float32:
        with single_threaded_blas():
            return qg @ medoids.T
    from ..store._kernels import gemv_half
    return gemv_half(medoids, qg, bf16=medoids.dtype.name == "bfloat16")


def group_queries(q, num_kv_heads: int) -> np.ndarray:
    """Sum the query heads of each GQA group: [B, H_q, d] -> float32 [B, H_kv*d].

    Query head h uses KV head h // (H_q / H_kv).  Because
    sum_h q_h . k = (sum_h q_h) . k, scoring the summed query against a key
    of KV head g equals summing the per-head scores of g's query heads (§6.1,
    applied to the medoid index of §5.2).  ``q`` may be [H_q, d] (one query),
    numpy or torch.

    Raises:
        InvalidArgumentError: H_q is not a multiple of num_kv_heads.
    """
    if hasattr(q, "detach"):
        q = q.detach().float().cpu().numpy()
    try:
        q = np.asarray(q, dtype=np.float32)
        H = int(num_kv_heads)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"group_queries: {exc}") from None
    if q.ndim == 2:
        q = q[None]
    if H <= 0 or q.ndim != 3 or q.shape[1] % H:
        raise InvalidArgumentError(f"query shape {q.shape} is not [B, H_q, d] with H_q a "
                                   f"multiple of {H}")
    B, Hq, d = q.shape
    return q.reshape(B, H, Hq // H, d).sum(axis=2).reshape(B, H * d)


# -- the one selection rule ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Selection:
    """What one query selects (:func:`select_clusters`).

    Attributes:
        clusters: int64 [c] chosen cluster ids, best score first.
        entries: distinct entries of the window and the chosen clusters
            (replicas and window overlap counted once).
        window: tokens of the local window (the last ``window`` positions).
    """
    clusters: np.ndarray
    entries: int
    window: int


@runtime_checkable
class Selector(Protocol):
    """What scores a query for the :class:`~swarmfs.Retriever` (SWARM §5.2; the
    §8 baselines).

    Attributes:
        kind: ``"clusters"`` (scores per cluster, [B, C]) or ``"tokens"``
            (scores per token, [B, S]: the exact top-k).
        name: the method's name (``"swarm"``, ``"quest"``, ...).

    Concurrency: ``scores`` and ``dram_bytes`` may run in several threads at
    once, also beside ``invalidate``.
    """

    kind: str
    name: str

    def scores(self, layer: int, q: np.ndarray, li=None) -> np.ndarray:
        """float32 [B, C] (or [B, S]) scores of queries float32 [B, H_q, d];
        ``li`` the :class:`~swarmfs.LayerIndex` the caller works on (a
        selector whose index is the store's reads it from there)."""

    def dram_bytes(self, layer: int) -> int:
        """Bytes of the layer's index held in DRAM."""

    def invalidate(self, layer: int) -> None:
        """Drop whatever the selector derived from the layer's stored state
        (the layer changed on disk); a no-op for selectors whose index is
        given to them."""


@runtime_checkable
class FusedSelector(Selector, Protocol):
    """A :class:`Selector` that also scores and chooses in one pass."""

    def select(self, layer: int, q: np.ndarray, *, budget: int, window: int,
               li=None) -> list:
        """Per query of ``q`` float32 [B, H_q, d], the :class:`Selection` that
        :meth:`scores` followed by :func:`select_clusters` makes."""


def select_clusters(scores, members_ptr, members, *, num_tokens: int, budget: int,
                    window: int = 0) -> Selection:
    """Clusters in score order until the selection holds ``budget`` distinct entries.

    SWARM §5.2 and eq. 8: the selection is the union of the local window (the
    last ``window`` tokens, always in DRAM) and the chosen clusters' members;
    clusters are taken in descending score (ties: lower id first) until that
    union holds at least ``budget`` distinct entries, so the last cluster is the
    only one that may overshoot, and replicas or window entries are never
    counted twice.  With ``budget >= num_tokens`` and a clustering that covers
    every token the result is the whole context.  A pure function; scores
    are compared as float32; the work runs in C (partial selection, no full
    sort).

    Args:
        scores: float [C] one query's cluster scores (NaN ranks last).
        members_ptr: int [C+1] CSR pointers of the clusters' members.
        members: int [M] token positions in [0, num_tokens).
        num_tokens: S, tokens of the context.
        budget: entries wanted (window included); capped at S.
        window: tokens of the local window (see :func:`swarmfs.decode._window.window_size`).

    Returns:
        A :class:`Selection`.

    Raises:
        InvalidArgumentError: shapes or values that do not fit together.
    """
    scores = np.asarray(scores)
    ptr = np.asarray(members_ptr)
    members = np.asarray(members)
    if scores.ndim != 1 or ptr.ndim != 1 or ptr.shape[0] != scores.shape[0] + 1 or \
            members.ndim != 1 or scores.dtype.kind not in "fiu" or \
            ptr.dtype.kind not in "iu" or members.dtype.kind not in "iu":
        raise InvalidArgumentError(f"select_clusters: scores {scores.shape} {scores.dtype}, "
                                   f"pointers {ptr.shape} and members {members.shape} do not "
                                   "fit together")
    try:
        S, budget, w = (operator.index(x) for x in (num_tokens, budget, window))
    except TypeError:
        raise InvalidArgumentError(f"select_clusters: num_tokens {num_tokens!r}, budget "
                                   f"{budget!r} and window {window!r} must be integers") \
            from None
    if S < 0 or w < 0 or budget < 0:
        raise InvalidArgumentError(f"select_clusters: num_tokens {S}, budget {budget} and "
                                   f"window {w} must be >= 0")
    w = min(w, S)
    from ..store._kernels import choose_clusters
    # the cluster table's rule (pointers in order, members in the context, S < 2**31)
    # is checked in one place: choose_clusters with check=True
    clusters, entries = choose_clusters(scores, ptr, members, num_tokens=S,
                                        budget=min(budget, S), window=w, check=True)
    return Selection(clusters, entries, w)


def _select(scores, ptr, members, S: int, budget: int, w: int) -> Selection:
    """:func:`select_clusters` on trusted arrays (the Retriever's own index):
    int64 ``ptr``, int32 (or int64) ``members``, 0 <= w <= S, 0 <= budget <= S.  In C
    (``se_choose_clusters``: a key threshold by two counting passes, a radix sort of the
    clusters above it, a bitmap of seen tokens)."""
    from ..store._kernels import choose_clusters
    clusters, entries = choose_clusters(scores, ptr, members, num_tokens=S, budget=budget,
                                        window=w, check=False)
    return Selection(clusters, entries, min(w, S))


def _of_layer(table: dict, layer, what: str):
    """``table[layer]``, or NotFoundError naming the layer."""
    try:
        return table[layer]
    except (KeyError, TypeError):
        raise NotFoundError(f"the {what} has no index for layer {layer!r}",
                            layer=layer) from None


def _gemv(m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Dot-product scores with the GQA groups summed: [B, rows]."""
    if q.ndim == 2:                          # already [B, H_kv*d]
        return score_medoids(m, np.asarray(q, np.float32))
    return score_medoids(m, group_queries(q, m.shape[-1] // q.shape[-1]))


def head_logits(m: np.ndarray, q: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Per-query-head logits q_h . k_{g(h)} of rows ``m`` [C, H_kv*d] (store
    dtype; fp32 may also come head-major as [H_kv, C, d]): float32
    [B, H_q, C]; query head h uses KV head h // (H_q / H_kv)."""
    from ..store._kernels import head_logits_half
    B, Hq, d = q.shape
    H = int(num_kv_heads)
    if m.dtype != np.float32:       # one pass over the index, in C
        return head_logits_half(m, q, H, bf16=m.dtype.name == "bfloat16")
    G = Hq // H
    mt = m if m.ndim == 3 else np.ascontiguousarray(m.reshape(m.shape[0], H, d).transpose(1, 0, 2))
    qh = q.reshape(B, H, G, d).transpose(1, 0, 2, 3).reshape(H, B * G, d)
    with single_threaded_blas():
        out = np.matmul(qh, mt.transpose(0, 2, 1))               # [H, B*G, C], one call
    return np.ascontiguousarray(out.reshape(H, B, G, -1).transpose(1, 0, 2, 3)).reshape(B, Hq, -1)


SCORES = ("prob", "logit")
INDEXES = ("int8", "exact")


class ThreadChooser:
    """One or two threads for the int8 selection, from what calls measured
    (``MedoidSelector(threads="auto")``, issue 26).

    The second thread pays only when the other core is free; while the
    model's attention, MLP or a BLAS pool uses it, two threads are slower
    than one (here 4 ms against 0.2 ms at 8K tokens with the other core
    busy).  So the chooser keeps, per layer, an exponential moving average
    of the µs per query of each setting and uses the faster one.  It
    re-measures the other setting after ``explore_every`` calls (the
    re-measurement replaces that setting's average, which may be stale or
    from a cold first call); each
    re-measurement that confirms the choice doubles that interval (up to
    ``max_interval``), one that overturns it resets it, so a losing setting
    costs at most about 1/max_interval of the calls once the load is
    steady, and a change of load is followed within a few re-measurements.
    Starts with one thread, then measures two.

    Concurrency: any number of threads may call :meth:`pick` and
    :meth:`record` (one lock, held for a few operations).
    """

    def __init__(self, explore_every: int = 16, max_interval: int = 1024,
                 alpha: float = 0.25):
        self.explore_every = parse_positive_int(explore_every, "explore_every")
        self.max_interval = max(parse_positive_int(max_interval, "max_interval"),
                                self.explore_every)
        self.alpha = float(alpha)
        self._ema: dict[tuple[int, int], float] = {}
        self._calls: dict[int, int] = {}
        self._next: dict[int, int] = {}         # call number of the next re-measurement
        self._interval: dict[int, int] = {}
        self._exploring: dict[int, int] = {}    # the setting being re-measured
        self._lock = threading.Lock()

    def pick(self, layer: int) -> int:
        """The thread count for this layer's next call: 1 or 2."""
        with self._lock:
            n = self._calls.get(layer, 0)
            self._calls[layer] = n + 1
            one, two = self._ema.get((layer, 1)), self._ema.get((layer, 2))
            if one is None:
                return 1
            if two is None:
                return 2
            best = 1 if one <= two else 2
            interval = self._interval.setdefault(layer, self.explore_every)
            if n >= self._next.setdefault(layer, n + interval):
                self._next[layer] = n + interval
                self._exploring[layer] = 3 - best
                return 3 - best
            return best

    def record(self, layer: int, threads: int, us_per_query: float) -> None:
        """A call of ``threads`` threads took ``us_per_query`` µs per query."""
        with self._lock:
            old = self._ema.get((layer, threads))
            exploring = self._exploring.get(layer) == threads
            # a re-measurement replaces the old average: its samples are rare and
            # the average may be stale (a cold first call, another load)
            self._ema[(layer, threads)] = us_per_query if old is None or exploring else \
                old + self.alpha * (us_per_query - old)
            if exploring:
                del self._exploring[layer]
                other = self._ema.get((layer, 3 - threads))
                interval = self._interval.get(layer, self.explore_every)
                self._interval[layer] = min(2 * interval, self.max_interval) \
                    if other is not None and us_per_query > other else self.explore_every

    def estimate(self, layer: int) -> dict[int, float | None]:
        """{threads: the moving average of µs per query, or None}."""
        with self._lock:
            return {t: self._ema.get((layer, t)) for t in (1, 2)}


@checked_methods
class MedoidSelector:
    """SWARM §5.2: score each cluster by its medoid's key (store dtype).

    Args:
        store: the store.
        score: ``"prob"`` (default): each query head's softmax over the
            medoids, summed over heads -- a cluster ranks by the attention
            mass its medoid would draw, which is what recall measures (the
            layout benchmark measured mean recall 0.885 against 0.834 for
            ``"logit"`` on WikiText-2 at 16K tokens); ``"logit"``: the scaled
            logits summed over heads, computed on the GQA-summed query (one
            GEMV, the cheapest).
        index: how the "prob" score reads the medoid keys.  ``"int8"``
            (default): an int8 copy quantised per row (one medoid, one KV
            head) with an fp32 scale, the query quantised per head likewise,
            exact integer dot products (AVX512-VNNI ``vpdpbusd``, AVX2
            ``vpmaddubsw``), fp32 softmax: 2-3x faster, half the DRAM of an
            fp16 index, recall measured in docs/benchmarks.md §9 (an
            approximation of the exact score).  ``"exact"``: the store-dtype
            keys with fp32 accumulation.  An fp32 store is quantised from
            its fp16 rounding.  Ignored by ``"logit"``, and on the NEON path
            (no int8 kernel there yet; the exact score runs instead).
        levels: 1 (default) scores every medoid; 2 selects through the
            two-level int8 index (``swarmfs.decode._index2``: per KV head, balanced
            groups of ``group_size`` medoids (a PCA tree) under centroids, the best groups
            scored exactly, ``coverage`` x the budget's share of them), an
            approximation for less work per query; only ``select`` and only
            with ``index="int8"`` (``scores`` stays one-level).  Recall and
            speed: docs/benchmarks.md §9.
        threads: 1 (default) or 2: the one-level int8 score of one query on
            two threads (half the KV heads each; :func:`swarmfs.store._kernels.select_i8`),
            for a step whose other work is not using the second core;
            ``"auto"``: per layer, whichever of 1 and 2 measured faster
            lately (:class:`ThreadChooser`), so the second core is used
            only while it helps.  The other scores and ``levels=2`` run on
            one thread.
        device: None (default): the CPU kernels above.  A torch device
            (``"cuda"``, ``"cuda:1"``, ``"cpu"``): the score runs in torch
            on that device, for a model whose attention already runs there
            (issue 26): the medoid keys are copied there once per layer
            index (store dtype on a GPU, float32 on the CPU), each query's
            logits are one batched matmul per KV head, the "prob" softmax
            is float32, and only the scores [B, C] come back to choose
            clusters by the same rule.  ``index`` and ``levels`` do not
            apply (the exact keys are scored); ``"cpu"`` runs the same code
            on the CPU (how it is tested where no GPU exists).

    Raises:
        InvalidChoiceError: score or index not one of the choices.
        InvalidArgumentError: a device torch does not know, or torch is
            missing.
    """

    kind = "clusters"
    name = "swarm"

    def __init__(self, store, score: str = "prob", index: str = "int8", levels: int = 1,
                 group_size: int = 32, coverage: float = 3.0, threads: int = 1,
                 device=None):
        parse_choice(score, "score", SCORES)
        parse_choice(index, "index", INDEXES)
        levels = parse_int(levels, "levels", 1, 2)
        parse_positive_int(group_size, "group_size")
        from ..store._kernels import thread_count
        from ._index2 import check_coverage
        coverage = check_coverage(coverage)
        self.chooser = ThreadChooser() if isinstance(threads, str) and threads == "auto" \
            else None
        self.threads = "auto" if self.chooser is not None else thread_count(threads)
        self.store = store
        self.score = score
        self.index = index
        self.levels, self.group_size, self.coverage = int(levels), int(group_size), float(coverage)
        self.scale = float(store.head_dim) ** -0.5
        self.device = None if device is None else _torch_device(device)
        self._derived: dict[tuple, tuple] = {}      # {(what, layer): (layer index, array)}

    def _cached(self, what: str, layer, li, make):
        """``make()`` for the layer index ``li``, made once per index object:
        a retrieval that started on an older index keeps using that index."""
        hit = self._derived.get((what, layer))
        if hit is not None and hit[0] is li:
            return hit[1]
        out = make()
        self._derived[(what, layer)] = (li, out)
        return out

    def _medoids(self, layer, li=None):
        """The medoid keys [C, H_kv*d] of a layer index ``li`` (default the
        store's current one)."""
        li = self.store.layer(layer) if li is None else li
        return self._cached("medoids", layer, li, lambda: np.ascontiguousarray(
            li.medoid_keys.view(self.store.np_dtype)).reshape(li.num_clusters, -1))

    def _head_major(self, layer, li, m):
        """fp32 keys head-major [H_kv, C, d], made once per layer index."""
        H = self.store.num_kv_heads
        return self._cached("head_major", layer, li, lambda: np.ascontiguousarray(
            m.reshape(m.shape[0], H, -1).transpose(1, 0, 2)))

    def _packed(self, layer, li, m):
        """The index in ``pack_medoids`` layout, made once per layer index."""
        from ..store._kernels import pack_medoids
        return self._cached("packed", layer, li,
                            lambda: pack_medoids(m, self.store.num_kv_heads))

    def _int8(self, layer, li, m):
        """The ``pack_medoids_i8`` index, made once per layer index (None when
        the exact index is asked for or runs instead: the "logit" score, a
        head size not a multiple of 4, the NEON path)."""
        from ..store._kernels import kernel_path, pack_medoids_i8
        if self.index != "int8" or self.score != "prob" or self.store.head_dim % 4:
            return None
        if kernel_path() == "neon":      # no NEON int8 kernel yet: the exact NEON one
            return None

        def make():
            bf16 = m.dtype.name == "bfloat16"
            m16 = np.clip(m, -65504.0, 65504.0).astype(np.float16) \
                if m.dtype == np.float32 else m
            return pack_medoids_i8(m16, self.store.num_kv_heads, bf16=bf16)
        return self._cached("int8", layer, li, make)

    def scores(self, layer: int, q: np.ndarray, li=None) -> np.ndarray:
        """Medoid scores float32 [B, C] of queries float32 [B, H_q, d] (the
        ``score`` and ``index`` chosen at construction); ``li`` the layer
        index the caller works on (default the store's current one)."""
        li = self.store.layer(layer) if li is None else li
        m = self._medoids(layer, li)
        if self.device is not None:
            return self._torch_scores(layer, li, m, q)
        if self.score == "logit":
            return _gemv(m, q)
        from ..store._kernels import head_logits_i8, softmax_sum
        ix = self._int8(layer, li, m)
        if ix is not None:
            q = np.asarray(q, dtype=np.float32)
            return np.stack([softmax_sum(head_logits_i8(ix, qq, self.store.num_kv_heads),
                                         self.scale) for qq in q])
        if m.dtype == np.float32:        # fp32: a head-major copy, made once per index
            m = self._head_major(layer, li, m)
        logits = head_logits(m, q, self.store.num_kv_heads)
        return np.stack([softmax_sum(x, self.scale) for x in logits])

    def select(self, layer: int, q: np.ndarray, *, budget: int, window: int,
               li=None) -> list[Selection]:
        """Score and choose in one native pass per query (fp16/bf16 index;
        ``_kernels.select_fused``); the same clusters as :meth:`scores` then
        :func:`select_clusters`.  ``q`` float32 [B, H_q, d]; ``li`` the
        layer index the caller works on (default the store's current one)."""
        li = self.store.layer(layer) if li is None else li
        m = self._medoids(layer, li)
        if self.device is not None:
            return [_select(x, li.members_ptr, li.members, li.num_tokens, budget, window)
                    for x in self._torch_scores(layer, li, m, q)]
        ix = self._int8(layer, li, m)
        if ix is not None and self.levels == 2:
            return self._select_two_level(layer, li, m, q, budget, window)
        if ix is not None:
            from ..store._kernels import select_i8
            qs = np.asarray(q, dtype=np.float32)
            threads = self.threads if self.chooser is None else self.chooser.pick(layer)
            t0 = time.perf_counter()
            out = []
            for qq in qs:
                cl, n = select_i8(ix, qq, self.store.num_kv_heads, scale=self.scale,
                                  ptr=li.members_ptr, members=li.members,
                                  num_tokens=li.num_tokens, budget=budget, window=window,
                                  check=False, threads=threads)
                out.append(Selection(cl, n, window))
            if self.chooser is not None and qs.shape[0]:
                self.chooser.record(layer, threads,
                                    (time.perf_counter() - t0) * 1e6 / qs.shape[0])
            return out
        if m.dtype == np.float32:
            return [_select(s, li.members_ptr, li.members, li.num_tokens, budget, window)
                    for s in self.scores(layer, q, li)]
        from ..store._kernels import select_fused
        packed = self._packed(layer, li, m) if self.score == "prob" else None
        out = []
        for qq in q:
            cl, n = select_fused(m, qq, self.store.num_kv_heads, scale=self.scale,
                                 score=self.score, bf16=m.dtype.name == "bfloat16",
                                 ptr=li.members_ptr, members=li.members,
                                 num_tokens=li.num_tokens, budget=budget, window=window,
                                 packed=packed, check=False)
            out.append(Selection(cl, n, window))
        return out

    def _torch_scores(self, layer, li, m, q) -> np.ndarray:
        """``scores`` on ``self.device`` in torch: float32 [B, C] (numpy)."""
        import torch
        H = self.store.num_kv_heads
        dev = self.device

        def make():                  # head-major [H_kv, C, d] on the device
            from ..store._format import to_torch
            t = to_torch(np.ascontiguousarray(m), self.store.dtype)
            t = t.to(dev).float() if dev.type == "cpu" else t.to(dev)
            return t.reshape(t.shape[0], H, -1).transpose(0, 1).contiguous()
        mt = self._cached("torch", layer, li, make)
        qt = torch.as_tensor(np.asarray(q, dtype=np.float32)).to(dev)
        B, Hq, d = qt.shape
        G = Hq // H
        if self.score == "logit":
            qg = qt.reshape(B, H, G, d).sum(2).transpose(0, 1)            # [H, B, d]
            out = torch.matmul(qg.to(mt.dtype), mt.transpose(1, 2)).float().sum(0)
            return out.cpu().numpy()
        qh = qt.reshape(B, H, G, d).transpose(0, 1).reshape(H, B * G, d)
        lg = torch.matmul(qh.to(mt.dtype), mt.transpose(1, 2)).float() * self.scale
        p = torch.softmax(lg, dim=-1).reshape(H, B, G, -1).sum((0, 2))  # [B, C]
        return p.cpu().numpy()

    def _select_two_level(self, layer, li, m, q, budget, window) -> list[Selection]:
        """``select`` through the two-level index, made once per layer index."""
        from ._index2 import pack_medoids_i8x2, select_i8x2

        def make():
            src = m if m.dtype != np.float32 else \
                np.clip(m, -65504.0, 65504.0).astype(np.float16)
            return pack_medoids_i8x2(src, self.store.num_kv_heads, group_size=self.group_size,
                                     bf16=m.dtype.name == "bfloat16")
        index2 = self._cached("int8x2", layer, li, make)
        out = []
        for qq in np.asarray(q, dtype=np.float32):
            cl, n = select_i8x2(index2, qq, self.store.num_kv_heads, scale=self.scale,
                                ptr=li.members_ptr, members=li.members,
                                num_tokens=li.num_tokens, budget=budget, window=window,
                                coverage=self.coverage, check=False)
            out.append(Selection(cl, n, window))
        return out

    def invalidate(self, layer: int) -> None:
        """Drop the cached index of a layer (it changed on disk)."""
        for key in [k for k in self._derived if k[1] == layer]:
            self._derived.pop(key, None)

    def dram_bytes(self, layer: int) -> int:
        """Bytes of the layer's medoid index and the copies made of it
        (head-major, packed, int8)."""
        extra = 0
        for (what, lay), (_, x) in list(self._derived.items()):
            if lay != layer or what == "medoids":
                continue
            if what == "torch":              # host memory only where the device is the CPU
                on_cpu = getattr(self.device, "type", None) == "cpu"
                extra += x.nelement() * x.element_size() if on_cpu else 0
                continue
            # an array, or a record of arrays (the int8 and two-level indexes)
            extra += int(x.nbytes) if hasattr(x, "nbytes") else \
                sum(a.nbytes for a in x if isinstance(a, np.ndarray))
        return int(self._medoids(layer).nbytes + extra)


def _torch_device(device):
    """A torch.device from a name or device (InvalidArgumentError)."""
    try:
        import torch
    except ImportError:
        raise InvalidArgumentError(f"device={device!r} needs torch, which is not "
                                   "installed") from None
    try:
        dev = torch.device(device)
        torch.empty(1, device=dev)              # the device exists and is usable
    except (RuntimeError, TypeError, ValueError, AssertionError) as exc:
        raise InvalidArgumentError(f"device {device!r} is not usable: {exc}") from None
    return dev


class _GivenIndex:
    """A selector whose per-layer index is given to it (the §8 baselines).

    The index grows with the layer: :meth:`replace` installs the index after
    an append (``DecodeSession(baseline=...)`` does, by the method's rule in
    ``swarmfs.layout._baselines``), and scoring a layer index ``li`` uses the
    first ``li.num_clusters`` rows, so a retrieval still working on the
    generation before an append scores the clusters it knows.
    """

    #: the :attr:`Layout.index` keys of this selector's per-layer index
    keys: tuple = ()
    kind: str
    name: str
    #: {layer: the index array, or a tuple of them in :attr:`keys` order}
    _table: dict

    def invalidate(self, layer: int) -> None:
        """Nothing to drop: the index was given, not derived from the store."""

    def _rows(self, x: np.ndarray, layer, li) -> np.ndarray:
        """The rows of ``x`` [C', ...] that score layer index ``li`` (all
        without one): its first C (clusters; tokens for a token selector).

        Raises:
            LayoutError: fewer rows than ``li`` has clusters (the index was not
                extended after an append), naming the layer.
        """
        if li is None:
            return x
        n = li.num_tokens if self.kind == "tokens" else li.num_clusters
        if x.shape[0] < n:
            what = "tokens" if self.kind == "tokens" else "clusters"
            raise LayoutError(f"the {self.name} index holds {x.shape[0]} rows for {n} "
                              f"{what}: it was not extended when the layer grew (decode "
                              "with DecodeSession(baseline=...), the method's append rule)",
                              layer=layer)
        return x[:n]

    def layer_index(self, layer: int) -> dict:
        """The layer's index in :attr:`Layout.index` form (``{"lo", "hi"}``,
        ``{"reps"}``, ``{"vectors"}``, ``{"keys"}``; the arrays themselves).

        Raises:
            NotFoundError: no index for the layer.
        """
        x = _of_layer(self._table, layer, self.name)
        return dict(zip(self.keys, x if isinstance(x, tuple) else (x,), strict=True))

    def replace(self, layer: int, index: dict) -> None:
        """Install a layer's index (e.g. after an append), in one assignment:
        a scoring running meanwhile sees the old index or the new one.

        Args:
            index: the arrays of :meth:`layer_index`'s form.

        Raises:
            InvalidArgumentError: keys or row counts that do not fit.
        """
        if not isinstance(index, dict) or set(index) != set(self.keys):
            raise InvalidArgumentError(f"the {self.name} index holds {self.keys}, got "
                                       f"{sorted(index) if isinstance(index, dict) else index!r}",
                                       layer=layer)
        old = self._table.get(layer)
        old = old if isinstance(old, tuple) else (old,) * len(self.keys)
        arrs = tuple(np.ascontiguousarray(index[x], None if o is None else o.dtype)
                     for x, o in zip(self.keys, old, strict=True))   # the layer's dtype kept
        if len({a.shape for a in arrs}) != 1:
            raise InvalidArgumentError(f"the {self.name} index arrays differ in shape",
                                       layer=layer)
        self._table[layer] = arrs if len(arrs) > 1 else arrs[0]


class VectorSelector(_GivenIndex):
    """One vector per cluster (e.g. k-means centroids): {layer: [C, H_kv*d]}."""

    kind = "clusters"
    keys = ("vectors",)

    def __init__(self, vectors: dict, name: str = "centroid"):
        self.vectors = self._table = {k: np.ascontiguousarray(v) for k, v in vectors.items()}
        self.name = name

    def scores(self, layer, q, li=None):
        """Dot products with the cluster vectors: float32 [B, C]."""
        return _gemv(self._rows(_of_layer(self.vectors, layer, self.name), layer, li), q)

    def dram_bytes(self, layer):
        """Bytes of the layer's index."""
        return int(_of_layer(self.vectors, layer, self.name).nbytes)


class MultiVectorSelector(_GivenIndex):
    """R representative keys per cluster, {layer: [C, R, H_kv*d]}; a cluster
    scores its best representative (InfLLM)."""

    kind = "clusters"
    keys = ("reps",)

    def __init__(self, reps: dict, name: str = "representatives"):
        self.reps = self._table = {k: np.ascontiguousarray(v) for k, v in reps.items()}
        self.name = name

    def scores(self, layer, q, li=None):
        """Best dot product over each cluster's representatives: float32 [B, C]."""
        r = self._rows(_of_layer(self.reps, layer, self.name), layer, li)
        C, R, D = r.shape
        return _gemv(r.reshape(C * R, D), q).reshape(q.shape[0], C, R).max(axis=2)

    def dram_bytes(self, layer):
        """Bytes of the layer's index."""
        return int(_of_layer(self.reps, layer, self.name).nbytes)


class BoundSelector(_GivenIndex):
    """Quest: per-channel key bounds per cluster, {layer: (lo, hi)} each
    float32 [C, H_kv*d]; score = sum_c max(q_c lo_c, q_c hi_c), an upper bound
    of q . k over the cluster's keys."""

    kind = "clusters"
    name = "quest"
    keys = ("lo", "hi")

    def __init__(self, bounds: dict):
        self.bounds = self._table = {
            k: (np.ascontiguousarray(lo, np.float32), np.ascontiguousarray(hi, np.float32))
            for k, (lo, hi) in bounds.items()}

    def scores(self, layer, q, li=None):
        """Upper bounds of q . k over each cluster's keys: float32 [B, C]."""
        lo, hi = (self._rows(x, layer, li) for x in _of_layer(self.bounds, layer, self.name))
        qg = np.asarray(q, np.float32) if q.ndim == 2 else \
            group_queries(q, lo.shape[1] // q.shape[-1])
        pos = np.maximum(qg, 0)
        neg = np.minimum(qg, 0)
        # max(q lo, q hi) = q+ hi + q- lo, summed over channels: two GEMVs
        return (pos @ hi.T + neg @ lo.T).astype(np.float32)

    def dram_bytes(self, layer):
        """Bytes of the layer's index."""
        lo, hi = _of_layer(self.bounds, layer, self.name)
        return int(lo.nbytes + hi.nbytes)


class TokenSelector(_GivenIndex):
    """Every key of the layer, {layer: [S, H_kv*d]}: the exact top-k tokens
    (the oracle / "No Cluster" baseline of §8.1)."""

    kind = "tokens"
    name = "oracle"
    keys = ("keys",)

    def __init__(self, keys: dict):
        self._table = {k: np.ascontiguousarray(v) for k, v in keys.items()}

    def scores(self, layer, q, li=None):
        """Dot products with every key: float32 [B, S]."""
        return _gemv(self._rows(_of_layer(self._table, layer, self.name), layer, li), q)

    def layer_index(self, layer: int) -> dict:
        """The layer's keys, ``{"keys": [S, H_kv*d]}``."""
        return {"keys": _of_layer(self._table, layer, self.name)}

    def replace(self, layer: int, index: dict) -> None:
        """Install a layer's keys ``{"keys": [S, H_kv*d]}`` (after an append)."""
        if not isinstance(index, dict) or set(index) != {"keys"}:
            raise InvalidArgumentError("the oracle index is {'keys': [S, H_kv*d]}",
                                       layer=layer)
        self._table[layer] = np.ascontiguousarray(index["keys"])

    def dram_bytes(self, layer):
        """Bytes of the layer's index."""
        return int(_of_layer(self._table, layer, self.name).nbytes)
