"""Decode-time retrieval: medoid scoring, cluster selection, batched fetch.

SWARM §5.2 and §6.1.  For each layer the :class:`Retriever` keeps in DRAM the
medoid keys (the index), the local window (the last W tokens) and the hot
clusters chosen by eq. 6.  A query is scored against the medoids; clusters are
taken in score order until the entry budget r x S is met; their entries are
united and deduplicated (eq. 8), entries already in DRAM are dropped, and the
rest are scheduled as entry buckets over the disks and read in one batched
submission.  Nothing loops in Python per entry or per request.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time

import numpy as np

from . import _errors as E
from ._selectors import (MedoidSelector, group_queries, score_medoids,  # noqa: F401
                         select_clusters, single_threaded_blas, window_size)
from ._kernels import gather_kv
from ._selectors import _select
from ._store import Store, to_torch

__all__ = ["Retriever", "Retrieval", "RetrievalStats", "group_queries", "select_clusters",
           "score_medoids"]


@dataclasses.dataclass(frozen=True)
class RetrievalStats:
    """What one :meth:`Retriever.retrieve` call cost.

    Attributes:
        score_us: scoring (µs); 0 when scoring and choice run fused in one
            native pass (SWARM's fp16/bf16 medoid index), counted in select_us.
        select_us: cluster choice in score order until the budget (µs).
        plan_us: union, dedup (eq. 8), DRAM filter, entry buckets, coalescing (µs).
        io_us: the batched read, incl. checksum verification (µs).
        assemble_us: building K/V from DRAM and SSD rows (µs).
        total_us: wall time of the call (µs).
        budget: entry budget r x S (entries).
        clusters_selected: clusters chosen by score.
        hot_clusters_selected: of those, hot clusters served from DRAM.
        entries: distinct entries returned.
        entries_dram: of those, served from DRAM (local window, hot clusters).
        entries_ssd: of those, read from the disks.
        duplicates_removed: copies dropped by deduplication.
        bytes_read: bytes read from the disks (bytes, incl. alignment).
        requests: read requests submitted.
        disk_bytes: bytes per disk.
        disk_requests: requests per disk.
        max_mean_load: max over mean of per-disk bytes (1.0 = balanced).
        effective_gbps: useful entry bytes from SSD / io time (GB/s).
    """
    score_us: float
    select_us: float
    plan_us: float
    io_us: float
    assemble_us: float
    total_us: float
    budget: int
    clusters_selected: int
    hot_clusters_selected: int
    entries: int
    entries_dram: int
    entries_ssd: int
    duplicates_removed: int
    bytes_read: int
    requests: int
    disk_bytes: tuple
    disk_requests: tuple
    max_mean_load: float
    effective_gbps: float


@dataclasses.dataclass(frozen=True)
class Retrieval:
    """Result of one retrieval.

    Attributes:
        k: keys [H_kv, n, head_dim] (torch or numpy, store dtype), written in
            place by the engine's gather (no intermediate copy).
        v: values [H_kv, n, head_dim].
        positions: int64 [n] token positions of the entries (ascending).
        clusters: int64 [c] selected cluster ids, in score order.
        stats: :class:`RetrievalStats`.
        layer: the layer.
        index: the :class:`~swarmfs.LayerIndex` the retrieval read (a
            :class:`~swarmfs.DecodeSession` refuses a retrieval of an older one).
    """
    k: object
    v: object
    positions: np.ndarray
    clusters: np.ndarray
    stats: RetrievalStats
    layer: int = -1
    index: object = dataclasses.field(default=None, repr=False, compare=False)

    def _kv_numpy(self):
        k, v = self.k, self.v
        if hasattr(k, "detach"):
            import torch as _torch
            if k.dtype == _torch.bfloat16:
                import ml_dtypes
                return (k.view(_torch.int16).numpy().view(ml_dtypes.bfloat16),
                        v.view(_torch.int16).numpy().view(ml_dtypes.bfloat16))
            return k.numpy(), v.numpy()
        return k, v

    def rows_of(self, idx) -> np.ndarray:
        """The entries at indices ``idx`` (into ``positions``) as stored rows:
        uint8 [len(idx), entry_bytes] (K heads then V heads); a copy."""
        k, v = self._kv_numpy()
        idx = np.asarray(idx, dtype=np.int64)
        kv = np.stack([k[:, idx], v[:, idx]], axis=0).transpose(2, 0, 1, 3)   # [n, 2, H, d]
        return np.ascontiguousarray(kv).reshape(idx.shape[0], -1).view(np.uint8)

    @functools.cached_property
    def rows(self) -> np.ndarray:
        """All entries as stored rows, uint8 [n, entry_bytes] (a copy, made on
        first use)."""
        return self.rows_of(np.arange(self.positions.shape[0]))


class _LayerState:
    """DRAM partition of one layer (SWARM §5.2): the local window and the hot
    clusters, as a pool of entry rows with a slot per resident token.

    A token is resident while something holds it: the window, or any hot
    cluster that contains it (``refs`` counts the holders), so clusters can be
    admitted and evicted one by one (§6.2 cache replacement) without copying
    the rest of the pool.

    Concurrency: every read and change of the residency (``refs``, ``slot``,
    ``rows``, ``free``, ``hot``) happens under ``lock``.  A retrieval decides
    which of its entries are resident and copies their rows out in one
    critical section (:meth:`take_resident`), so an eviction that runs while
    the retrieval reads the disks can neither free nor reuse a row the
    retrieval still needs.
    """

    def __init__(self, store: Store, layer: int, local_window: int, hot, selector):
        li = store.layer(layer)
        self.li = li
        S = li.num_tokens
        self.sizes = li.sizes
        self.entry_bytes = store.entry_bytes
        self.lock = threading.RLock()
        self.hot = np.zeros(li.num_clusters, dtype=bool)
        W = min(int(local_window), S)
        self.window = np.arange(S - W, S, dtype=np.int64)
        self.refs = np.zeros(S, dtype=np.int32)
        self.slot = np.full(S, -1, dtype=np.int64)
        self.rows = np.empty((0, store.entry_bytes), dtype=np.uint8)
        self.free = np.empty(0, dtype=np.int64)
        self.selector_bytes = int(selector.dram_bytes(layer))
        want_hot = np.asarray(li.hot if hot is None else hot, dtype=bool)
        if want_hot.shape != (li.num_clusters,):
            raise E.InvalidArgumentError(f"hot-cluster mask of shape {want_hot.shape} for "
                                         f"{li.num_clusters} clusters", layer=layer)
        hot_ids = np.flatnonzero(want_hot)
        toks = np.union1d(self.window, li.members[li.cluster_copies(hot_ids)])
        rows = np.empty((0, store.entry_bytes), np.uint8)
        if toks.size:          # read through ``li``: the generation this state serves
            copies = li.token_copies(toks)
            plan = store.plan_copies(li, copies)
            rows = store.execute(li, plan, copies).reshape(toks.shape[0], -1).view(np.uint8)
        self.hold(self.window, toks, rows)
        self.admit(hot_ids, toks, rows)

    @property
    def resident(self) -> np.ndarray:
        """bool [S]: tokens whose entries are in DRAM (a copy, taken under the lock)."""
        with self.lock:
            return self.refs > 0

    @property
    def dram_bytes(self) -> int:
        """Bytes in DRAM: resident entries plus the selector's index."""
        with self.lock:
            return int((self.refs > 0).sum()) * self.entry_bytes + self.selector_bytes

    def pin(self, toks: np.ndarray, window: np.ndarray):
        """Split ``toks`` into resident and not, and pin the resident ones,
        atomically with respect to admission and eviction: a pinned token
        keeps its slot (and the slot its row) until :meth:`unpin`, even if its
        cluster is evicted meanwhile.

        Returns:
            (ssd mask bool [len(toks)], dram positions int64 ascending and
            unique (window included), their slots int64, the row pool
            uint8 [*, entry_bytes] those slots index).
        """
        with self.lock:
            ssd = self.refs[toks] <= 0
            dram = np.union1d(window, toks[~ssd])
            slots = self.slot[dram]
            if slots.size and slots.min() < 0:
                raise E.InternalError("a resident token has no DRAM slot",
                                      layer=self.li.layer)
            self.refs[dram] += 1
            return ssd, dram, slots, self.rows

    def unpin(self, dram: np.ndarray) -> None:
        """Release what :meth:`pin` pinned."""
        self.release(dram)

    def hold(self, toks: np.ndarray, src_toks: np.ndarray, src_rows: np.ndarray) -> None:
        """Take a reference on tokens; rows of newly resident ones are copied
        from ``src_rows`` (rows of the sorted token array ``src_toks``)."""
        toks = np.asarray(toks, dtype=np.int64)
        if toks.size == 0:
            return
        with self.lock:
            new = np.unique(toks[self.refs[toks] == 0])
            if new.size:
                at = np.minimum(np.searchsorted(src_toks, new), max(src_toks.shape[0] - 1, 0))
                if src_toks.shape[0] == 0 or np.any(src_toks[at] != new):
                    raise E.InternalError("rows of a newly resident token are missing",
                                          layer=self.li.layer)
            np.add.at(self.refs, toks, 1)
            if new.size:
                need = new.shape[0] - self.free.shape[0]
                if need > 0:
                    base = self.rows.shape[0]
                    grow = max(need, base // 2, 64)
                    self.rows = np.concatenate([self.rows,
                                                np.empty((grow, self.entry_bytes), np.uint8)])
                    self.free = np.concatenate([self.free, np.arange(base, base + grow)])
                slots, self.free = self.free[:new.shape[0]], self.free[new.shape[0]:]
                self.slot[new] = slots
                self.rows[slots] = src_rows[at]

    def release(self, toks: np.ndarray) -> None:
        """Drop a reference on tokens; slots of tokens no longer held are freed."""
        toks = np.asarray(toks, dtype=np.int64)
        if toks.size == 0:
            return
        with self.lock:
            np.add.at(self.refs, toks, -1)
            if self.refs[toks].min() < 0:
                raise E.InternalError("a DRAM reference count went negative",
                                      layer=self.li.layer)
            gone = np.unique(toks[self.refs[toks] == 0])
            if gone.size:
                self.free = np.concatenate([self.free, self.slot[gone]])
                self.slot[gone] = -1

    def admit(self, clusters, src_toks, src_rows) -> None:
        """Make clusters hot; their rows come from (src_toks, src_rows)."""
        clusters = np.asarray(clusters, dtype=np.int64)
        with self.lock:
            clusters = clusters[~self.hot[clusters]]
            if clusters.size:
                self.hold(self.li.members[self.li.cluster_copies(clusters)], src_toks,
                          src_rows)
                self.hot[clusters] = True

    def evict(self, clusters) -> None:
        """Make clusters cold again."""
        clusters = np.asarray(clusters, dtype=np.int64)
        with self.lock:
            clusters = clusters[self.hot[clusters]]
            if clusters.size:
                self.hot[clusters] = False
                self.release(self.li.members[self.li.cluster_copies(clusters)])


class Retriever:
    """Serve decode-step KV retrieval from a store (SWARM §5.2, §6.1).

    Args:
        store: an open :class:`Store`.
        sparsity: r, fraction of the context's entries each query may use
            (the entry budget is ceil(r x S), local window included; §8.1
            uses 0.10).
        local_window: W, the last W tokens kept in DRAM (default: the
            layer's manifest value).
        hot: override of the hot-cluster mask per layer ({layer: bool [C]}),
            default the store's eq. 6 choice.
        policy: ``"balanced"`` (§6.1 entry buckets) or ``"first"`` (static).
        dedup: eq. 8 deduplication (False reads every selected copy).
        max_gap: coalesce entries on a disk separated by at most this many bytes.
        selector: what scores a query (default :class:`MedoidSelector`, SWARM's
            medoid index); the baselines of §8 plug in here (``_selectors``).
        score: the medoid score when ``selector`` is None: ``"prob"``
            (per-head softmax over the medoids, summed) or ``"logit"``.

    Concurrency:
        Any number of threads may call :meth:`retrieve`, :meth:`prefetch`,
        :meth:`score`, :meth:`select`, :meth:`window`, :meth:`budget`,
        :meth:`layer_state` and :meth:`dram_bytes` at the same time, also
        while a :class:`~swarmfs.DecodeSession` steps a layer (admitting and
        evicting hot clusters, appending to the store) and while
        :meth:`refresh` runs.  Each retrieval works on the layer state it
        started with: residency is decided and the DRAM rows are copied in one
        critical section under the layer's lock, so every returned row is the
        stored entry.  A retrieval that started before an append or a
        :meth:`refresh` returns the layer as it was (the store appends
        copy-on-write and never overwrites committed extents).
        :meth:`close` may run while prefetches are queued (they finish
        first).  Relies on :class:`Store` reads (``read_entries``,
        ``plan_copies``, ``execute``, ``layer``) being safe from many threads.

    Raises:
        LayoutError: sparsity outside (0, 1].
        ConfigError: unknown policy.
    """

    def __init__(self, store: Store, *, sparsity: float = 0.1,
                 local_window: int | None = None, hot: dict | None = None,
                 policy: str = "balanced", dedup: bool = True, max_gap: int = 0,
                 selector=None, score: str = "prob"):
        import numbers
        if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real) or \
                not 0 < sparsity <= 1:
            raise E.LayoutError(f"sparsity ratio must be a number in (0, 1], got {sparsity!r}",
                                store=store.path)
        if policy not in ("balanced", "first"):
            raise E.ConfigError(f"unknown policy {policy!r}; use balanced or first",
                                store=store.path)
        self.store = store
        self.sparsity = float(sparsity)
        self.local_window = local_window
        self.policy, self.dedup, self.max_gap = policy, dedup, max_gap
        self._hot = dict(hot or {})
        self.selector = selector if selector is not None else MedoidSelector(store, score)
        self._layers: dict[int, _LayerState] = {}
        self._lock = threading.Lock()
        self._step_locks: dict[int, threading.Lock] = {}
        self._pool = None
        self.group = store.model.num_query_heads // store.num_kv_heads

    def prefetch(self, layer: int, q, **kw):
        """Start :meth:`retrieve` in a background thread (SWARM §7's pipelined
        prefetch: score and fetch layer L+1 with the query predicted from layer
        L while layer L computes).  The engine releases the GIL while it waits
        on the disks, so the caller's work overlaps the I/O.  Safe beside
        :class:`~swarmfs.DecodeSession` steps (see the class's concurrency
        contract).

        Returns:
            a ``concurrent.futures.Future`` whose ``result()`` is the
            :class:`Retrieval` (or raises what ``retrieve`` raised).
        """
        with self._lock:
            if self._pool is None:
                import concurrent.futures
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="swarmfs-prefetch")
            return self._pool.submit(self.retrieve, layer, q, **kw)

    def close(self) -> None:
        """Stop the prefetch thread after the queued prefetches (the store
        stays open; a later :meth:`prefetch` starts a new thread)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def refresh(self, layer: int, *, hot=None) -> None:
        """Forget a layer's DRAM state (after the layer changed on disk, e.g.
        :meth:`Store.append`); it is rebuilt on next use with ``hot`` as the
        hot-cluster mask (default the store's).  Retrievals already running
        finish on the state they started with."""
        with self._lock:
            self._layers.pop(layer, None)
            if hot is not None:
                self._hot[layer] = np.asarray(hot, dtype=bool)
            elif layer in self._hot:
                del self._hot[layer]
        inv = getattr(self.selector, "invalidate", None)
        if inv is not None:
            inv(layer)

    def layer_state(self, layer: int) -> _LayerState:
        """The DRAM partition of a layer (loaded on first use: one batched read
        of the local window and the hot clusters)."""
        st = self._layers.get(layer)
        if st is None:
            with self._lock:
                st = self._layers.get(layer)
                if st is None:
                    W = self.local_window
                    if W is None:
                        W = self.store.layer_record(layer).local_window
                    st = _LayerState(self.store, layer, W, self._hot.get(layer),
                                     self.selector)
                    self._layers[layer] = st
        return st

    def step_lock(self, layer: int) -> threading.Lock:
        """The lock a :class:`~swarmfs.DecodeSession` holds while it steps
        ``layer`` (one stepping session per layer at a time)."""
        with self._lock:
            lk = self._step_locks.get(layer)
            if lk is None:
                lk = self._step_locks[layer] = threading.Lock()
            return lk

    def set_hot(self, layer: int, want, retrieval: Retrieval) -> tuple[np.ndarray, np.ndarray]:
        """Make the hot set of a layer ``want`` (bool [C]) in one change under
        the layer lock (§6.2 cache replacement): clusters leaving it are
        evicted, clusters entering it are filled from ``retrieval`` (which
        must have read them whole).

        Returns:
            (admitted, evicted) cluster ids, int64.

        Raises:
            InvalidArgumentError: a mask of the wrong shape, a retrieval of
                another layer or of an older index of this one (the layer was
                rewritten or appended to since), or an admitted cluster the
                retrieval did not read.
        """
        if not isinstance(retrieval, Retrieval):
            raise E.InvalidArgumentError(f"retrieval must be a Retrieval, got "
                                         f"{type(retrieval).__name__}", layer=layer)
        st = self.layer_state(layer)
        want = np.asarray(want, dtype=bool)
        if want.shape != st.hot.shape:
            raise E.InvalidArgumentError(f"hot mask of shape {want.shape} for "
                                         f"{st.hot.shape[0]} clusters", layer=layer)
        if retrieval.layer != layer or retrieval.index is not st.li:
            # rows of another layer or generation (the layer was rewritten or
            # appended to since): admitting them would serve stale bytes
            raise E.InvalidArgumentError("the retrieval is not of this layer's current "
                                         "index (retrieve again after refresh)", layer=layer)
        with st.lock:
            admitted = np.flatnonzero(want & ~st.hot)
            evicted = np.flatnonzero(st.hot & ~want)
            toks = np.unique(st.li.members[st.li.cluster_copies(admitted)]) \
                if admitted.size else np.empty(0, np.int64)
            at = np.searchsorted(retrieval.positions, toks)
            if toks.size and (at.max() >= retrieval.positions.shape[0] or
                              np.any(retrieval.positions[at] != toks)):
                raise E.InvalidArgumentError("an admitted cluster was not read by the given "
                                             "retrieval", layer=layer)
            st.evict(evicted)
            if admitted.size:
                st.admit(admitted, toks, retrieval.rows_of(at))
        return admitted, evicted

    def dram_bytes(self) -> int:
        """Bytes held in DRAM by the loaded layers (medoids, window, hot clusters)."""
        with self._lock:
            states = list(self._layers.values())
        return sum(st.dram_bytes for st in states)

    # -- the stages ----------------------------------------------------------
    def score(self, layer: int, q) -> np.ndarray:
        """Selector scores of one or more queries: float32 [B, C] (medoid
        scores for SWARM; [B, S] for a token selector).

        ``q`` is [H_q, d] or [B, H_q, d] (numpy or torch).  The query heads of
        a GQA group are summed before the product, which equals summing the
        per-head scores q_h . k_m over the heads that share a KV head.
        """
        self.layer_state(layer)
        return self.selector.scores(layer, self.queries(q))

    def queries(self, q) -> np.ndarray:
        """float32 [B, H_q, d] from [H_q, d] or [B, H_q, d] (numpy or torch,
        any float dtype incl. bfloat16).

        Raises:
            ShapeError: not a query of this store's shape, or not finite.
        """
        if hasattr(q, "detach"):
            q = q.detach().float().cpu().numpy()
        try:
            q = np.asarray(q, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise E.ShapeError(f"query is not a float array: {exc}",
                               store=self.store.path) from None
        if q.ndim == 2:
            q = q[None]
        H, d = self.store.num_kv_heads, self.store.head_dim
        if q.ndim != 3 or q.shape[0] == 0 or q.shape[2] != d or q.shape[1] == 0 or \
                q.shape[1] % H:
            raise E.ShapeError(f"query shape {q.shape} is not [B >= 1, H_q, {d}] with H_q a "
                               f"multiple of {H}", store=self.store.path)
        if not np.isfinite(q).all():
            raise E.ShapeError("query holds NaN or inf", store=self.store.path)
        return np.ascontiguousarray(q)

    _queries = queries

    def window(self, layer: int, budget: int | None = None) -> np.ndarray:
        """Token positions of the local window a query uses: the last
        :func:`~swarmfs._selectors.window_size` (min(W, S, budget // 4))
        tokens, int64 ascending."""
        st = self.layer_state(layer)
        b = self.budget(layer) if budget is None else int(budget)
        w = window_size(st.window.shape[0], b, st.li.num_tokens)
        return st.window[st.window.shape[0] - w:]

    def budget(self, layer: int) -> int:
        """Entry budget ceil(r x S) of a layer (local window included)."""
        return int(math.ceil(self.sparsity * self.layer_state(layer).li.num_tokens))

    def select(self, layer: int, scores: np.ndarray, budget: int | None = None) -> np.ndarray:
        """The clusters :meth:`retrieve` reads for scores [B, C] (or [C]): per
        query, :func:`~swarmfs._selectors.select_clusters` with the layer's
        window, united over the batch.  int64 [c], best first for one query."""
        st = self.layer_state(layer)
        b = self.budget(layer) if budget is None else int(budget)
        return self._select(st, np.atleast_2d(scores), b, self.window(layer, b).shape[0])

    @staticmethod
    def _select(st, scores: np.ndarray, budget: int, w: int) -> np.ndarray:
        li = st.li
        sel = [_select(s, li.members_ptr, li.members, li.num_tokens, budget, w).clusters
               for s in scores]
        return np.unique(np.concatenate(sel)) if len(sel) > 1 else sel[0]

    # -- one decode step ------------------------------------------------------
    def retrieve(self, layer: int, q, *, torch: bool = True, pinned: bool = False,
                 budget: int | None = None, out=None) -> Retrieval:
        """Fetch the KV entries a query (or a batch of queries) needs.

        Stages: score, select (:func:`~swarmfs._selectors.select_clusters`),
        split DRAM / SSD and pin the DRAM rows (under the layer lock), plan
        (eq. 8, §6.1), read (one batched submission), assemble: the C kernel
        ``gather_kv`` writes each entry straight into the K and V outputs, from
        the staging buffer and from the DRAM pool (no per-entry Python, no
        intermediate copy).

        Args:
            layer: layer number.
            q: query [H_q, head_dim] or a batch [B, H_q, head_dim]; with a batch
                the clusters of all queries are united into one read.
            torch: return torch tensors (else numpy).
            pinned: K and V in pinned (page-locked) host memory.
            budget: entry budget per query (default ceil(r x S)).
            out: ``(k, v)`` buffers to write into instead of new arrays: numpy
                arrays or torch CPU tensors [H_kv, cap, head_dim] of the store
                dtype with cap >= n, C-contiguous, reused across steps as a
                serving engine would (no page faults on fresh memory); the
                returned K and V are the views ``k[:, :n]``, ``v[:, :n]``.

        Returns:
            A :class:`Retrieval` with K and V [H_kv, n, head_dim].

        Raises:
            ShapeError: bad query shape.  LayoutError: budget outside [1, S].
            ChecksumError / IOFailedError when the read fails: a retrieval
            that cannot be served is never returned with garbage.
        """
        t0 = time.perf_counter()
        st = self.layer_state(layer)
        li = st.li
        S = li.num_tokens
        total_budget = self.budget(layer) if budget is None else \
            E.as_index(budget, "entry budget", store=self.store.path, layer=layer)
        if not 0 < total_budget <= S:
            raise E.LayoutError(f"entry budget {total_budget} outside [1, {S}]",
                                store=self.store.path, layer=layer)
        qf = self.queries(q)
        window = st.window[st.window.shape[0] -
                           window_size(st.window.shape[0], total_budget, S):]
        fused = getattr(self.selector, "select", None)
        if fused is not None and self.selector.kind == "clusters":
            t1 = time.perf_counter()           # scoring and choice in one native pass
            sel = [x.clusters for x in fused(layer, qf, budget=total_budget,
                                             window=window.shape[0], li=li)]
            clusters = np.unique(np.concatenate(sel)) if len(sel) > 1 else sel[0]
            copies = li.cluster_copies(clusters)
        else:
            scores = self.selector.scores(layer, qf, li) \
                if isinstance(self.selector, MedoidSelector) else self.selector.scores(layer, qf)
            t1 = time.perf_counter()
            if self.selector.kind == "tokens":
                copies, clusters = self._select_tokens(li, scores, window, total_budget)
            else:
                clusters = self._select(st, scores, total_budget, window.shape[0])
                copies = li.cluster_copies(clusters)
        t2 = time.perf_counter()
        toks = li.members[copies]
        ssd, dram_toks, slots, pool = st.pin(toks, window)
        try:
            cand = copies[ssd]
            plan = self.store.plan_copies(li, cand, policy=self.policy, dedup=self.dedup,
                                          max_gap=self.max_gap)
            t3 = time.perf_counter()
            ssd_toks = plan.tokens
            nd, ns = dram_toks.shape[0], ssd_toks.shape[0]
            n = nd + ns
            k, v, kw, vw = self._outputs(n, torch, pinned) if out is None else \
                self._given_outputs(out, n)
            # both lists are ascending and disjoint: merged places by counting
            d_idx = np.arange(nd) + np.searchsorted(ssd_toks, dram_toks)
            s_idx = np.arange(ns) + np.searchsorted(dram_toks, ssd_toks, side="right")
            pos = np.empty(n, dtype=np.int64)
            pos[d_idx] = dram_toks
            pos[s_idx] = ssd_toks
            placed = [0.0]

            def place(buf, src):
                t = time.perf_counter()
                gather_kv(buf, src, s_idx, kw, vw)
                placed[0] = time.perf_counter() - t
            self.store.execute(li, plan, cand, consume=place)
            t4 = time.perf_counter()
            eb = np.uint64(self.store.entry_bytes)
            gather_kv(pool.reshape(-1), slots.astype(np.uint64) * eb, d_idx, kw, vw)
        finally:
            st.unpin(dram_toks)
        t5 = time.perf_counter()
        t4 -= placed[0]                 # placing the SSD entries is assembly, not I/O
        hot_sel = 0
        if clusters.size:
            with st.lock:
                hot_sel = int(st.hot[clusters].sum())
        stats = self._stats(plan, t0, t1, t2, t3, t4, t5, budget=total_budget,
                            clusters=int(clusters.shape[0]), hot=hot_sel, n=n,
                            dram=int(nd),
                            dups=int(cand.shape[0] - plan.num_entries) if self.dedup else 0)
        return Retrieval(k=k, v=v, positions=pos, clusters=clusters, stats=stats,
                         layer=int(layer), index=li)

    def _given_outputs(self, out, n: int):
        """Caller buffers [H_kv, cap, d] -> (k view, v view, k array, v array)."""
        H, d = self.store.num_kv_heads, self.store.head_dim
        try:
            kb, vb = out
        except (TypeError, ValueError):
            raise E.InvalidArgumentError("out must be a (k, v) pair") from None
        arrs = []
        for name, x in (("k", kb), ("v", vb)):
            if hasattr(x, "detach"):
                import torch as _torch
                if str(x.dtype) != f"torch.{self.store.dtype}" or x.device.type != "cpu":
                    raise E.InvalidArgumentError(f"out {name} is {x.dtype} on {x.device}; "
                                                 f"need {self.store.dtype} on the CPU")
                a = x.view(_torch.int16).numpy().view(self.store.np_dtype) \
                    if self.store.dtype == "bfloat16" else x.numpy()
            else:
                a = x
            if not isinstance(a, np.ndarray) or a.dtype != self.store.np_dtype or \
                    a.ndim != 3 or a.shape[0] != H or a.shape[2] != d or \
                    not a.flags.c_contiguous or not a.flags.writeable:
                raise E.InvalidArgumentError(
                    f"out {name} must be a writable C-contiguous [{H}, cap, {d}] "
                    f"{self.store.dtype} array, got {getattr(a, 'shape', None)} "
                    f"{getattr(a, 'dtype', type(a))}")
            if a.shape[1] < n:
                raise E.InvalidArgumentError(f"out {name} holds {a.shape[1]} entries; this "
                                             f"retrieval returns {n}")
            arrs.append(a)
        if arrs[0].shape != arrs[1].shape:
            raise E.InvalidArgumentError("out k and v differ in shape")
        if np.shares_memory(arrs[0][:, :n], arrs[1][:, :n]):
            raise E.InvalidArgumentError("out k and v share memory (V would overwrite K)")
        return kb[:, :n], vb[:, :n], arrs[0], arrs[1]

    def _outputs(self, n: int, torch: bool, pinned: bool):
        """K and V [H_kv, n, d] to return, and numpy views of them to write
        into (the same memory)."""
        H, d = self.store.num_kv_heads, self.store.head_dim
        dt = self.store.np_dtype
        shape = (H, n, d)
        nb = H * n * d * dt.itemsize
        if pinned:
            buf = self.store.engine.alloc(max(2 * nb, 1), pinned=True, register=False)
            kw = buf.array[:nb].view(dt).reshape(shape)
            vw = buf.array[nb:2 * nb].view(dt).reshape(shape)
            if torch:
                return to_torch(kw, self.store.dtype), to_torch(vw, self.store.dtype), kw, vw
            return kw, vw, kw, vw
        if torch:
            import torch as _torch
            tdt = getattr(_torch, self.store.dtype)
            kt, vt = _torch.empty(shape, dtype=tdt), _torch.empty(shape, dtype=tdt)
            if self.store.dtype == "bfloat16":
                return kt, vt, kt.view(_torch.int16).numpy().view(dt), \
                    vt.view(_torch.int16).numpy().view(dt)
            return kt, vt, kt.numpy(), vt.numpy()
        kw, vw = np.empty(shape, dt), np.empty(shape, dt)
        return kw, vw, kw, vw

    @staticmethod
    def _select_tokens(li, scores, window, budget):
        """Token selector: exact top-k over all keys outside the window; any
        copy may serve."""
        want = budget - window.shape[0]
        sc = scores.copy()
        sc[:, window] = -np.inf
        top = np.argpartition(-sc, want - 1, axis=1)[:, :want] if want > 0 else \
            np.empty((sc.shape[0], 0), np.int64)
        return li.token_copies(np.unique(top)), np.empty(0, dtype=np.int64)

    def _stats(self, plan, t0, t1, t2, t3, t4, t5, *, budget, clusters, hot, n, dram,
               dups) -> RetrievalStats:
        io_s = t4 - t3
        N = self.store.num_disks
        return RetrievalStats(
            score_us=(t1 - t0) * 1e6, select_us=(t2 - t1) * 1e6, plan_us=(t3 - t2) * 1e6,
            io_us=io_s * 1e6, assemble_us=(t5 - t4) * 1e6, total_us=(t5 - t0) * 1e6,
            budget=budget, clusters_selected=clusters, hot_clusters_selected=hot,
            entries=n, entries_dram=dram, entries_ssd=plan.num_entries,
            duplicates_removed=dups,
            bytes_read=plan.staging_bytes, requests=plan.num_requests,
            disk_bytes=tuple(int(x) for x in plan.disk_bytes),
            disk_requests=tuple(int(x) for x in np.bincount(plan.disk, minlength=N)),
            max_mean_load=plan.max_mean_load,
            effective_gbps=(plan.num_entries * self.store.entry_bytes / io_s / 1e9)
            if io_s > 0 and plan.num_entries else 0.0)
