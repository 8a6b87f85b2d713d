"""Decode-time retrieval: medoid scoring, cluster selection, batched fetch.

SWARM §5.2 and §6.1.  For each layer the :class:`Retriever` keeps in DRAM the
medoid keys (the index), the local window (the last W tokens) and the hot
clusters chosen by eq. 6.  :meth:`Retriever.retrieve` runs the stages of
``swarmfs.decode._stages`` in order: the query is checked, scored against the
medoids, clusters are taken in score order until the entry budget r x S is
met (select); their entries are united and deduplicated (eq. 8), entries
already in DRAM are dropped, and the rest are scheduled as entry buckets over
the disks (plan) and read in one batched submission (submit); K and V are
assembled from the read and from DRAM.  Nothing loops in Python per entry or
per request.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _errors as errors
from .. import _validate as V
from .._defaults import RATIO
from ..store._engine import AlignedBuffer
from ..store._format import to_torch
from ..store._index import LayerIndex, union_ints, unique_ints
from ..store._kernels import empty_aligned, kv_rows
from ..store._planner import POLICIES
from ..store._store import Store
from . import _stages as stages
from ._selectors import MedoidSelector, Selector
from ._window import entry_budget, window_positions, window_size

if TYPE_CHECKING:
    import concurrent.futures

__all__ = ["Retriever", "Retrieval", "RetrievalStats", "EntryBuffer", "empty_kv", "entry_views"]


@V.checked_methods
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


@V.checked_methods
@dataclasses.dataclass(frozen=True)
class Retrieval:
    """Result of one retrieval.

    Attributes:
        k: keys [H_kv, n, head_dim] (torch or numpy, store dtype), written in
            place by the engine's gather (no intermediate copy).
        v: values [H_kv, n, head_dim].
        positions: int64 [n] token positions of the entries: ascending, or,
            into an :class:`EntryBuffer`, in the order the entries lie there
            (the DRAM-resident ones ascending, then the read ones as they
            landed); attention does not depend on the order.
        clusters: int64 [c] selected cluster ids, in score order.
        stats: :class:`RetrievalStats`.
        layer: the layer.
        index: the :class:`~swarmfs.LayerIndex` the retrieval read (a
            :class:`~swarmfs.DecodeSession` refuses a retrieval of an older one).
        entry_rows: into an :class:`EntryBuffer`: the entries as stored rows,
            uint8 [n, entry_bytes] (a view of the buffer, of which ``k`` and
            ``v`` are strided views); else None.
    """
    k: Any      # a torch tensor or a numpy array
    v: Any
    positions: np.ndarray
    clusters: np.ndarray
    stats: RetrievalStats
    layer: int = -1
    index: LayerIndex | None = dataclasses.field(default=None, repr=False, compare=False)
    entry_rows: np.ndarray | None = dataclasses.field(default=None, repr=False,
                                                       compare=False)

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
        idx = np.asarray(idx, dtype=np.int64)
        if self.entry_rows is not None:
            return self.entry_rows[idx]
        k, v = self._kv_numpy()
        return kv_rows(k, v, idx)                                   # one pass in C

    def find(self, toks) -> np.ndarray:
        """Where each token position of ``toks`` (int64 [m]) lies in
        ``positions``: int64 [m] indices, -1 for a position not retrieved.
        Vectorised (a binary search, over a sort of ``positions`` when they
        are in landing order)."""
        toks = np.asarray(toks, dtype=np.int64)
        pos = self.positions
        if not pos.size or not toks.size:
            return np.full(toks.shape, -1, np.int64)
        order = None if self.entry_rows is None else self._order
        at = np.minimum(np.searchsorted(pos, toks, sorter=order), pos.shape[0] - 1)
        if order is not None:
            at = order[at]
        return np.where(pos[at] == toks, at, -1)

    @functools.cached_property
    def _order(self) -> np.ndarray:
        return np.argsort(self.positions, kind="stable")

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
        li: LayerIndex = store.layer(layer)
        self.li = li
        S = li.num_tokens
        self.sizes = li.sizes
        self.entry_bytes = store.entry_bytes
        self.lock = threading.RLock()
        self.hot = np.zeros(li.num_clusters, dtype=bool)
        self.window = window_positions(S, min(int(local_window), S))
        self.refs = np.zeros(S, dtype=np.int32)
        self.slot = np.full(S, -1, dtype=np.int64)
        self.rows = np.empty((0, store.entry_bytes), dtype=np.uint8)
        self.free = np.empty(0, dtype=np.int64)
        self.selector_bytes = int(selector.dram_bytes(layer))
        want_hot = np.asarray(li.hot if hot is None else hot, dtype=bool)
        if want_hot.shape != (li.num_clusters,):
            raise errors.InvalidArgumentError(f"hot-cluster mask of shape {want_hot.shape} for "
                                              f"{li.num_clusters} clusters", layer=layer)
        hot_ids = np.flatnonzero(want_hot)
        toks = union_ints(self.window, li.members[li.cluster_copies(hot_ids)])
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
            dram = union_ints(window, toks[~ssd])
            slots = self.slot[dram]
            if slots.size and slots.min() < 0:
                raise errors.InternalError("a resident token has no DRAM slot",
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
            new = unique_ints(toks[self.refs[toks] == 0])
            if new.size:
                at = np.minimum(np.searchsorted(src_toks, new), max(src_toks.shape[0] - 1, 0))
                if src_toks.shape[0] == 0 or np.any(src_toks[at] != new):
                    raise errors.InternalError("rows of a newly resident token are missing",
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
                raise errors.InternalError("a DRAM reference count went negative",
                                           layer=self.li.layer)
            gone = unique_ints(toks[self.refs[toks] == 0])
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


def empty_kv(store: Store, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Uninitialised K and V [H_kv, cap, head_dim] of the store's numpy dtype,
    64-byte aligned (``gather_kv`` stores whole lines into them): the one
    allocation of the Retriever's outputs and of reused output buffers.
    Untouched pages cost no memory."""
    shape = (store.num_kv_heads, int(cap), store.head_dim)
    return empty_aligned(shape, store.np_dtype), empty_aligned(shape, store.np_dtype)


@V.checked_methods
class EntryBuffer:
    """A reusable output of :meth:`Retriever.retrieve` that keeps the stored
    entry layout, so that reads land where attention reads them (issue 26).

    One buffer of ``capacity`` rows of ``entry_bytes`` (page aligned,
    registered with the store's engine as a fixed buffer where possible).
    A retrieval into it puts the DRAM-resident entries first (copied rows)
    and reads the rest straight into the rows after them when the store's
    entries are a multiple of its block size (4 KiB fp16 entries of the
    Qwen3-32B shape): no staging buffer and no assembly pass.  Its K and V
    [H_kv, n, head_dim] are strided numpy views of the rows (each head's
    keys one row of ``entry_bytes`` apart), which numpy, torch and BLAS read
    as they are.  Made by :meth:`Retriever.entry_buffer`.

    Attributes:
        rows: uint8 [capacity, entry_bytes], the buffer.
        capacity: entries it holds.

    Concurrency: one retrieval (or session step) at a time per buffer (a
    second one meanwhile gets ConcurrentUseError and reads nothing into
    it); the K, V and ``entry_rows`` of a retrieval stay valid until the
    buffer's next retrieval.
    """

    def __init__(self, buf, entry_bytes: int, capacity: int):
        if not isinstance(buf, AlignedBuffer):
            raise errors.InvalidArgumentError("make an EntryBuffer with "
                                              "Retriever.entry_buffer(capacity)")
        entry_bytes = V.parse_positive_int(entry_bytes, "entry_bytes")
        capacity = V.parse_positive_int(capacity, "capacity")
        if capacity * entry_bytes > buf.size:
            raise errors.InvalidArgumentError(f"{capacity} entries of {entry_bytes} bytes do "
                                              f"not fit a {buf.size}-byte buffer")
        self._buf = buf
        self._busy = threading.Lock()       # one retrieval lands at a time
        self.capacity = int(capacity)
        self.rows = buf.array[:self.capacity * entry_bytes].reshape(self.capacity, entry_bytes)

    def __repr__(self) -> str:
        return f"EntryBuffer({self.capacity} entries of {self.rows.shape[1]} bytes)"


def entry_views(rows: np.ndarray, store: Store) -> tuple[np.ndarray, np.ndarray]:
    """K and V [H_kv, n, head_dim] (store dtype) as strided views of entry
    rows uint8 [n, entry_bytes] (K heads then V heads, as stored)."""
    n = rows.shape[0]
    kv = rows.view(store.np_dtype).reshape(n, 2, store.num_kv_heads, store.head_dim)
    return kv[:, 0].transpose(1, 0, 2), kv[:, 1].transpose(1, 0, 2)


@V.checked_methods
class Retriever:
    """Serve decode-step KV retrieval from a store (SWARM §5.2, §6.1).

    Args:
        store: an open :class:`Store`.
        ratio: the sparsity ratio r, fraction of the context's entries each
            query may use (the entry budget is ceil(r x S), local window
            included; §8.1 uses 0.10).
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
        assembly_threads: 1 (default) or 2 threads placing a retrieval's
            entries into K and V (:func:`swarmfs.store._kernels.gather_kv`; only
            placements of at least 4 MiB are split).  2 pays when the other
            core is idle during assembly (0.6-0.76x the assembly stage,
            0.83x the retrieval of a sequential decode step); beside the
            layer pipeline's prefetch or a BLAS whose threads spin on the
            other core it costs more than it saves (docs/benchmarks.md §9,
            sixth pass), hence not the default.

    Concurrency:
        Any number of threads may call :meth:`retrieve`, :meth:`prefetch`,
        :meth:`queries`, :meth:`score`, :meth:`select`, :meth:`window`,
        :meth:`budget`, :meth:`index`, :meth:`hot`, :meth:`layer_state` and
        :meth:`dram_bytes` at the same time, also
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
        InvalidRatioError: ratio outside (0, 1].
        InvalidChoiceError: an unknown policy or score.
        InvalidIntegerError: a negative local window or max_gap, or one
            that is not an integer.
        InvalidBoolError: dedup not True or False.
        InvalidCallError: an unknown keyword argument.
    """

    def __init__(self, store: Store, *, ratio: float | None = None,
                 local_window: int | None = None, hot: dict | None = None,
                 policy: str = "balanced", dedup: bool = True, max_gap: int = 0,
                 selector: Selector | None = None, score: str = "prob",
                 assembly_threads: int | None = None):
        V.parse_instance(store, "store", Store)
        where = {"store": store.path}
        ratio = RATIO if ratio is None else V.parse_ratio(ratio, "ratio", **where)
        if local_window is not None:
            local_window = V.parse_nonneg_int(local_window, "local_window", **where)
        V.parse_choice(policy, "policy", POLICIES, **where)
        dedup = V.parse_bool(dedup, "dedup", **where)
        max_gap = V.parse_nonneg_int(max_gap, "max_gap", 1 << 30, **where)
        self.store = store
        self.ratio = float(ratio)
        self.local_window = local_window
        self.policy, self.dedup, self.max_gap = policy, dedup, max_gap
        self.assembly_threads = stages.assembly_threads(assembly_threads, store.path)
        self._hot = dict(hot or {})
        self.selector = selector if selector is not None else MedoidSelector(store, score)
        self._fused = stages.fuses(self.selector)     # scores and chooses in one pass
        self._layers: dict[int, _LayerState] = {}
        self._lock = threading.Lock()
        self._step_locks: dict[int, threading.Lock] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
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
        layer = self._layer(layer)
        with self._lock:
            self._layers.pop(layer, None)
            if hot is not None:
                self._hot[layer] = np.asarray(hot, dtype=bool)
            elif layer in self._hot:
                del self._hot[layer]
        self.selector.invalidate(layer)

    def index(self, layer: int):
        """The :class:`~swarmfs.LayerIndex` the layer's DRAM state serves (the
        generation retrievals read until the next :meth:`refresh`)."""
        return self.layer_state(layer).li

    def dram_window(self, layer: int) -> np.ndarray:
        """Positions of the local window held in DRAM: the last min(W, S)
        tokens, int64 ascending (a query uses the last
        :meth:`window` of them)."""
        return self.layer_state(layer).window.copy()

    def hot(self, layer: int) -> np.ndarray:
        """bool [C]: the layer's hot clusters now (a copy)."""
        st = self.layer_state(layer)
        with st.lock:
            return st.hot.copy()

    def replace_hot(self, layer: int, retrieval: Retrieval, choose):
        """§6.2 cache replacement in one critical section: ``choose(hot)``
        gets the layer's hot mask (bool [C], a copy) and returns the mask to
        make hot, which :meth:`set_hot` then applies, all under the layer lock
        (no retrieval sees a half-changed hot set, no other replacement
        interleaves).

        Returns:
            (admitted, evicted) cluster ids, int64, as :meth:`set_hot`.
        """
        st = self.layer_state(layer)
        with st.lock:
            return self._set_hot(st, layer, choose(st.hot.copy()), retrieval)

    def layer_state(self, layer: int) -> _LayerState:
        """The DRAM partition of a layer (loaded on first use: one batched read
        of the local window and the hot clusters).

        Raises:
            OutOfRangeError: ``layer`` is not an integer (a bool or a float
                would otherwise find another key's state) or not stored.
        """
        layer = self._layer(layer)
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

    def _layer(self, layer) -> int:
        """``layer`` as an int (the one check of every layer argument here)."""
        return V.parse_index(layer, "layer", store=self.store.path)

    def step_lock(self, layer: int) -> threading.Lock:
        """The lock a :class:`~swarmfs.DecodeSession` holds while it steps
        ``layer`` (one stepping session per layer at a time)."""
        layer = self._layer(layer)
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
        return self._set_hot(self.layer_state(layer), layer, want, retrieval)

    @staticmethod
    def _set_hot(st: _LayerState, layer: int, want, retrieval: Retrieval):
        V.parse_instance(retrieval, "retrieval", Retrieval, layer=layer)
        want = np.asarray(want, dtype=bool)
        if want.shape != st.hot.shape:
            raise errors.InvalidArgumentError(f"hot mask of shape {want.shape} for "
                                              f"{st.hot.shape[0]} clusters", layer=layer)
        if retrieval.layer != layer or retrieval.index is not st.li:
            # rows of another layer or generation (the layer was rewritten or
            # appended to since): admitting them would serve stale bytes
            raise errors.InvalidArgumentError("the retrieval is not of this layer's current "
                                              "index (retrieve again after refresh)", layer=layer)
        with st.lock:
            admitted = np.flatnonzero(want & ~st.hot)
            evicted = np.flatnonzero(st.hot & ~want)
            toks = unique_ints(st.li.members[st.li.cluster_copies(admitted)]) \
                if admitted.size else np.empty(0, np.int64)
            at = retrieval.find(toks)
            if toks.size and at.min() < 0:
                raise errors.InvalidArgumentError("an admitted cluster was not read by the given "
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
    # -- the stages ----------------------------------------------------------
    def queries(self, q) -> np.ndarray:
        """Stage 1 (:func:`swarmfs.decode._stages.queries`): float32 [B, H_q, d] from
        [H_q, d] or [B, H_q, d] (numpy or torch, any float dtype incl. bfloat16).

        Raises:
            ShapeError: not a query of this store's shape, or not finite.
        """
        return stages.queries(q, self.store.num_kv_heads, self.store.head_dim,
                              store=self.store.path)

    def score(self, layer: int, q) -> np.ndarray:
        """Stage 2 (:func:`swarmfs.decode._stages.score`): selector scores of one or
        more queries, float32 [B, C] (medoid scores for SWARM; [B, S] for a
        token selector).

        ``q`` is [H_q, d] or [B, H_q, d] (numpy or torch).
        """
        return stages.score(self.selector, layer, self.queries(q), self.index(layer))

    def window(self, layer: int, budget: int | None = None) -> np.ndarray:
        """Token positions of the local window a query uses: the last
        :func:`~swarmfs.decode._window.window_size` (min(W, S, budget // 4))
        tokens, int64 ascending."""
        st = self.layer_state(layer)
        b = self.budget(layer) if budget is None else int(budget)
        return self._window(st, b)

    @staticmethod
    def _window(st: _LayerState, budget: int) -> np.ndarray:
        w = window_size(st.window.shape[0], budget, st.li.num_tokens)
        return st.window[st.window.shape[0] - w:]

    def budget(self, layer: int) -> int:
        """Entry budget ceil(r x S) of a layer (local window included)."""
        return entry_budget(self.ratio, self.index(layer).num_tokens)

    def _budget(self, layer: int, li, budget) -> int:
        if budget is None:
            return entry_budget(self.ratio, li.num_tokens)
        return V.parse_int(budget, "budget", 1, li.num_tokens, store=self.store.path,
                           layer=layer)

    def select(self, layer: int, q, *, budget: int | None = None) -> np.ndarray:
        """Stages 1-3: the clusters :meth:`retrieve` reads for a query [H_q, d]
        or a batch [B, H_q, d] (numpy or torch), by the same calls: int64 [c],
        best first for one query, ascending for a batch (empty for a token
        selector).

        Raises:
            ShapeError: bad query shape.  InvalidIntegerError: budget outside
                [1, S] or not an integer.
        """
        st = self.layer_state(layer)
        b = self._budget(layer, st.li, budget)
        clusters, _ = stages.select(self.selector, layer, self.queries(q), st.li, budget=b,
                                    window=self._window(st, b))
        return clusters

    # -- one decode step ------------------------------------------------------
    def retrieve(self, layer: int, q, *, torch: bool = True, pinned: bool = False,
                 budget: int | None = None, out=None) -> Retrieval:
        """Fetch the KV entries a query (or a batch of queries) needs.

        The stages of ``swarmfs.decode._stages`` in order: query, score, select
        (:func:`~swarmfs.decode._stages.choose`, or the selector's fused pass), split
        DRAM / SSD and pin the DRAM rows (under the layer lock), plan (eq. 8,
        §6.1), submit (one batched submission; the C kernel ``gather_kv``
        places each entry into K and V straight from the staging buffer),
        assemble (the DRAM rows into K and V): no per-entry Python, no
        intermediate copy.

        Args:
            layer: layer number.
            q: query [H_q, head_dim] or a batch [B, H_q, head_dim]; with a batch
                the clusters of all queries are united into one read.
            torch: return torch tensors (else numpy).
            pinned: K and V in pinned (page-locked) host memory.
            budget: entry budget per query (default ceil(r x S)).
            out: an :class:`EntryBuffer` (:meth:`entry_buffer`): the entries
                land in it in the stored layout, K and V are strided numpy
                views of it and ``positions`` are in landing order; or
                ``(k, v)`` buffers to write into instead of new arrays: numpy
                arrays or torch CPU tensors [H_kv, cap, head_dim] of the store
                dtype with cap >= n, C-contiguous, reused across steps as a
                serving engine would (no page faults on fresh memory); the
                returned K and V are the views ``k[:, :n]``, ``v[:, :n]`` (of
                the buffers' own kind: ``torch`` and ``pinned`` are ignored).
                64-byte aligned buffers (:meth:`kv_buffers`, torch tensors)
                let large steps store around the cache.

        Returns:
            A :class:`Retrieval` with K and V [H_kv, n, head_dim].

        Raises:
            ShapeError: bad query shape.  InvalidIntegerError: budget outside
            [1, S] or not an integer.  InvalidBoolError: torch or pinned not
            True or False.
            ChecksumError / IOFailedError when the read fails: a retrieval
            that cannot be served is never returned with garbage.
        """
        t0 = time.perf_counter()
        torch = V.parse_bool(torch, "torch", layer=layer)
        pinned = V.parse_bool(pinned, "pinned", layer=layer)
        st = self.layer_state(layer)
        li = st.li
        budget = self._budget(layer, li, budget)
        qf = self.queries(q)                                              # query
        window = self._window(st, budget)
        scores = None if self._fused else stages.score(self.selector, layer, qf, li)  # score
        t1 = time.perf_counter()
        clusters, copies = stages.select(self.selector, layer, qf, li, budget=budget,
                                         window=window, scores=scores)    # select
        t2 = time.perf_counter()
        ssd, dram_toks, slots, pool = st.pin(li.members[copies], window)
        try:
            cand = copies[ssd]
            plan = stages.plan(self.store, li, cand, policy=self.policy,  # plan
                               dedup=self.dedup, max_gap=self.max_gap)
            t3 = time.perf_counter()
            rows = None
            if isinstance(out, EntryBuffer):      # reads land in the entry rows
                n = dram_toks.shape[0] + plan.num_entries
                rows = self._entry_rows(out, n)
                if not out._busy.acquire(blocking=False):
                    raise errors.ConcurrentUseError("another retrieval is landing in this "
                                                    "EntryBuffer", layer=layer)
                try:
                    pos = stages.land(self.store, li, plan, cand, out, dram_toks)  # submit
                    t4 = time.perf_counter()
                    stages.copy_rows(pool, slots, rows[:dram_toks.shape[0]])   # assemble
                finally:
                    out._busy.release()
                k, v = entry_views(rows, self.store)
                placed = 0.0
            else:
                pos, d_idx, s_idx = stages.merge_positions(dram_toks, plan.tokens)
                n = pos.shape[0]
                k, v, kw, vw = self._outputs(n, torch, pinned) if out is None else \
                    self._given_outputs(out, n)
                placed = stages.submit(self.store, li, plan, cand, s_idx, kw, vw,  # submit
                                       threads=self.assembly_threads)
                t4 = time.perf_counter()
                stages.assemble(pool, slots, self.store.entry_bytes, d_idx, kw, vw,  # assemble
                                threads=self.assembly_threads)
        finally:
            st.unpin(dram_toks)
        t5 = time.perf_counter()
        t4 -= placed                    # placing the SSD entries is assembly, not I/O
        hot_sel = 0
        if clusters.size:
            with st.lock:
                hot_sel = int(st.hot[clusters].sum())
        nd = int(dram_toks.shape[0])
        stats = self._stats(plan, t0, t1, t2, t3, t4, t5, budget=budget,
                            clusters=int(clusters.shape[0]), hot=hot_sel, n=n, dram=nd,
                            dups=int(cand.shape[0] - plan.num_entries) if self.dedup else 0)
        return Retrieval(k=k, v=v, positions=pos, clusters=clusters, stats=stats,
                         layer=int(layer), index=li, entry_rows=rows)

    def _entry_rows(self, out: EntryBuffer, n: int) -> np.ndarray:
        """The first n rows of an EntryBuffer of this store's engine
        (InvalidArgumentError otherwise)."""
        if out._buf.registered_elsewhere(self.store.engine) or \
                out.rows.shape[1] != self.store.entry_bytes:
            raise errors.InvalidArgumentError("the EntryBuffer is not of this store "
                                              "(make it with this Retriever's entry_buffer)",
                                              store=self.store.path)
        if out.capacity < n:
            raise errors.InvalidArgumentError(f"the EntryBuffer holds {out.capacity} entries; "
                                              f"this retrieval returns {n}",
                                              store=self.store.path)
        return out.rows[:n]

    def entry_buffer(self, capacity: int) -> EntryBuffer:
        """A reusable :class:`EntryBuffer` of ``capacity`` entries for
        :meth:`retrieve` ``(out=...)``: reads land in it in the stored entry
        layout, and K and V are strided views of it (issue 26).  A layer's
        retrieval returns at most its S distinct entries (its M copies
        without dedup).

        Raises:
            InvalidIntegerError: capacity is not a positive integer.
            InvalidArgumentError: the buffer does not fit in memory."""
        capacity = V.parse_positive_int(capacity, "capacity", store=self.store.path)
        nbytes = capacity * self.store.entry_bytes
        try:
            buf = self.store.engine.alloc(nbytes)
        except (MemoryError, OSError, ValueError) as exc:
            raise errors.InvalidArgumentError(f"an EntryBuffer of {capacity} entries "
                                              f"({nbytes} bytes) does not fit: {exc}",
                                              store=self.store.path) from None
        return EntryBuffer(buf, self.store.entry_bytes, capacity)

    def _given_outputs(self, out, n: int):
        """Caller buffers [H_kv, cap, d] -> (k view, v view, k array, v array)."""
        H, d = self.store.num_kv_heads, self.store.head_dim
        try:
            kb, vb = out
        except (TypeError, ValueError):
            raise errors.InvalidArgumentError("out must be a (k, v) pair") from None
        arrs = []
        for name, x in (("k", kb), ("v", vb)):
            if hasattr(x, "detach"):
                import torch as _torch
                if str(x.dtype) != f"torch.{self.store.dtype}" or x.device.type != "cpu":
                    raise errors.InvalidArgumentError(f"out {name} is {x.dtype} on {x.device}; "
                                                      f"need {self.store.dtype} on the CPU",
                                                      store=self.store.path)
                if x.requires_grad:
                    raise errors.InvalidArgumentError(f"out {name} requires grad; retrieve "
                                                      "into a tensor without autograd history "
                                                      "(e.g. under torch.no_grad())",
                                                      store=self.store.path)
                a = x.view(_torch.int16).numpy().view(self.store.np_dtype) \
                    if self.store.dtype == "bfloat16" else x.numpy()
            else:
                a = x
            if not isinstance(a, np.ndarray) or a.dtype != self.store.np_dtype or \
                    a.ndim != 3 or a.shape[0] != H or a.shape[2] != d or \
                    not a.flags.c_contiguous or not a.flags.writeable:
                raise errors.InvalidArgumentError(
                    f"out {name} must be a writable C-contiguous [{H}, cap, {d}] "
                    f"{self.store.dtype} array, got {getattr(a, 'shape', None)} "
                    f"{getattr(a, 'dtype', type(a))}")
            if a.shape[1] < n:
                raise errors.InvalidArgumentError(f"out {name} holds {a.shape[1]} entries; this "
                                                  f"retrieval returns {n}",
                                                  store=self.store.path)
            arrs.append(a)
        if arrs[0].shape != arrs[1].shape:
            raise errors.InvalidArgumentError("out k and v differ in shape")
        if np.shares_memory(arrs[0][:, :n], arrs[1][:, :n]):
            raise errors.InvalidArgumentError("out k and v share memory (V would overwrite K)")
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
        kw, vw = empty_kv(self.store, n)
        return kw, vw, kw, vw

    def kv_buffers(self, cap: int) -> tuple[np.ndarray, np.ndarray]:
        """Reusable outputs for :meth:`retrieve` ``(out=...)``: numpy K and V
        [H_kv, cap, head_dim] of the store's numpy dtype (``Store.np_dtype``;
        ml_dtypes bfloat16 for a bfloat16 store), zeroed and 64-byte aligned,
        so that assembly stores whole cache lines around the cache
        (``gather_kv``).  Torch CPU tensors are aligned as well and may be
        passed instead.  Each call returns new buffers; one pair serves one
        retrieval at a time.

        Raises:
            InvalidIntegerError: cap is not a positive integer.
            InvalidArgumentError: the buffers do not fit in memory."""
        cap = V.parse_positive_int(cap, "cap", store=self.store.path)
        k, v = empty_kv(self.store, cap)
        k.fill(0)
        v.fill(0)
        return k, v

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
