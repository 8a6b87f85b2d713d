"""Keeping clusters and the DRAM cache current while tokens arrive (SWARM §6.2).

A :class:`DecodeSession` drives one layer of a decode loop over a
:class:`~swarmfs.Retriever`:

* **New entries** stay in DRAM, in the local window, for W steps (§5.2).  In
  that time their co-activation with the clusters' medoids is counted: at a
  step, an entry and a medoid are *co-activated* when both draw at least the
  uniform share of the step's attention (aggregated over query heads, over
  the entries the step attends to), the same "activated by the same query"
  relation the offline profile counts.  After W steps eq. 9 gives
  d(e_new, C_i) = 1 - f(e_new, m_i) / W; the entry joins every cluster with
  d < tau (at most ``max_joins``, the closest first: controlled replication),
  or, if none, a new cluster of such entries (``new_cluster_size`` of them).
  Matured entries are written in batches with :meth:`Store.append`, which
  puts entry |C_i| of cluster i on disk (id_i + |C_i|) mod N.
* **Cache replacement**: each step a selected cluster's frequency f_i rises by
  one and a cached cluster that was not selected loses one; the hot set is
  re-chosen among the cached and the just-selected clusters under the DRAM
  budget by the one eq. 6 rule (:func:`swarmfs.decode._hot.hot_clusters`, the one
  the offline layout uses; the paper keeps a min-heap; choosing over that
  small set each step is equivalent and vectorised).  Admitted clusters
  are filled from the rows this step already read; evicted ones free their
  slots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, NamedTuple

import numpy as np

from .. import _defaults as defaults
from .. import _errors as errors
from .. import _validate as V
from ..store._index import union_ints
from ._hot import hot_clusters
from ._report import query_token_mass
from ._retrieve import EntryBuffer, Retrieval, Retriever, entry_views
from ._window import entry_budget

__all__ = ["DecodeSession", "StepResult", "Upkeep", "PipelinedStep", "pipelined_step"]


@V.checked_methods
@dataclasses.dataclass(frozen=True)
class StepResult:
    """One decode step of a :class:`DecodeSession`.

    Attributes:
        k, v: numpy [H_kv, n, head_dim]: the retrieved entries followed by the
            new entries still pending in DRAM (store dtype), then, with
            ``step(include_new=True)``, this step's own entry.  With
            ``DecodeSession(reuse_outputs=True)`` they, and ``retrieval.k``
            and ``retrieval.v``, are strided views of the session's
            :class:`~swarmfs.EntryBuffer`, valid until its next step (copy
            what must outlive it).
        positions: int64 [n] token positions (pending ones, and this step's
            own entry, are >= the layer's stored length, ascending); the
            retrieved ones are ascending, or with ``reuse_outputs`` in the
            order they landed (:attr:`Retrieval.positions`).
        retrieval: the underlying :class:`Retrieval` of stored entries.
        admitted, evicted: clusters that entered / left the hot set.
        flushed: positions of entries written to the store at this step.
    """
    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray
    retrieval: Retrieval
    admitted: np.ndarray
    evicted: np.ndarray
    flushed: np.ndarray


class Upkeep(NamedTuple):
    """What a step's upkeep changed (:meth:`DecodeSession.upkeep`): clusters
    admitted to and evicted from the hot set (int64), positions flushed to
    the store (int64)."""
    admitted: np.ndarray
    evicted: np.ndarray
    flushed: np.ndarray


@V.checked_methods
class DecodeSession:
    """Online maintenance of one layer during decoding (SWARM §6.2).

    Args:
        retriever: a :class:`Retriever` over a writable store.
        layer: the layer.
        tau: eq. 9 radius in (0, 1]: join clusters co-activated in more than
            (1 - tau) of the W steps.
        window: W, steps a new entry is observed before it is placed
            (default: the layer's local window).
        max_joins: most clusters a new entry joins (replicas).
        new_cluster_size: size of new clusters made of entries that join
            none.
        flush_batch: write matured entries once this many are waiting.
        hot_budget_bytes: DRAM bytes for hot clusters (default: what the
            store's hot set takes).
        t_base_us, t_transfer_us: eq. 6 costs (µs).
        adapt_cache: run cache replacement (False: the hot set stays).
        reuse_outputs: retrieve into an :class:`~swarmfs.EntryBuffer` the
            session keeps and grows: the read entries land in it in the
            stored layout (no staging copy and no assembly pass when entries
            are block multiples, issue 26), the DRAM-resident ones are
            copied in as rows, and the pending entries (and with
            ``include_new`` this step's entry) go after the retrieved ones:
            no copy of the retrieved K/V per step and no fresh pages to
            fault in.  The returned K/V (the step's and its retrieval's) are
            then strided views valid until the next step, and the retrieved
            positions are in landing order (a step with a given
            ``retrieval`` copies as without this option).
        baseline: the append rule of a §8 baseline layout
            (``swarmfs.layout._baselines.append_rule``: Quest's pages,
            InfLLM's blocks, PQCache's centroids), whose index the
            Retriever's selector holds: matured entries are then written by
            that method's rule instead of eq. 9 (no co-activation counts),
            and each flush extends the selector's index with them.  Default
            None: SWARM's eq. 9.

    Concurrency:
        One thread at a time may call :meth:`step` or :meth:`flush` for a
        layer of a Retriever (whichever session it goes through); with
        ``defer_upkeep``, :meth:`upkeep` may run on another thread while the
        caller attends, and the session's next step waits for it.  A second
        concurrent step is detected and raises
        :class:`~swarmfs.ConcurrentUseError` without changing anything.
        Meanwhile any number of threads may :meth:`Retriever.retrieve` or
        :meth:`Retriever.prefetch` the same layer (the SWARM §7 pipeline):
        the hot set changes under the layer lock, and retrievals copy the DRAM
        rows they use under that lock, so they always return the stored
        entries.  The session's appends go through :meth:`Store.append`
        (serialised with other writers by the store); a retrieval that started
        before an append returns the layer as it was.

    Raises:
        InvalidRatioError: tau outside (0, 1].
        InvalidIntegerError: window, new_cluster_size or flush_batch below
            1, max_joins or hot_budget_bytes below 0, or not integers.
        InvalidNumberError: t_base_us or t_transfer_us negative or not finite.
        InvalidBoolError: adapt_cache or reuse_outputs not True or False.
        InvalidTypeError: retriever is not a Retriever.
        InvalidArgumentError: a ``baseline`` that is not an append rule, or a
            Retriever whose selector holds no given index.
        LayoutError: the selector's index has not one row per cluster.
    """

    def __init__(self, retriever: Retriever, layer: int, *, tau: float = defaults.ONLINE_TAU,
                 window: int | None = None, max_joins: int = defaults.MAX_JOINS,
                 new_cluster_size: int | None = None,
                 flush_batch: int = defaults.FLUSH_BATCH, hot_budget_bytes: int | None = None,
                 t_base_us: float = defaults.T_BASE_US,
                 t_transfer_us: float = defaults.T_TRANSFER_US,
                 adapt_cache: bool = True, reuse_outputs: bool = False, baseline=None,
                 defer_upkeep: bool = False):
        V.parse_instance(retriever, "retriever", Retriever, layer=layer)
        self.defer_upkeep = V.parse_bool(defer_upkeep, "defer_upkeep", layer=layer)
        tau = V.parse_ratio(tau, "tau", layer=layer)
        reuse_outputs = V.parse_bool(reuse_outputs, "reuse_outputs", layer=layer)
        adapt_cache = V.parse_bool(adapt_cache, "adapt_cache", layer=layer)
        if new_cluster_size is None:
            new_cluster_size = defaults.NEW_CLUSTER_SIZE
        for name, v, lo in (("window", window, 1), ("max_joins", max_joins, 0),
                            ("new_cluster_size", new_cluster_size, 1),
                            ("flush_batch", flush_batch, 1),
                            ("hot_budget_bytes", hot_budget_bytes, 0)):
            if v is not None:
                V.parse_int(v, name, lo, layer=layer)
        for name, us in (("t_base_us", t_base_us), ("t_transfer_us", t_transfer_us)):
            V.parse_number(us, name, 0, unit="µs", layer=layer)
        self.r = retriever
        self.store = retriever.store
        self.layer = V.parse_index(layer, "layer", store=self.store.path)
        li = retriever.index(self.layer)
        hot = retriever.hot(self.layer)
        self.tau, self.max_joins = float(tau), int(max_joins)
        self.new_cluster_size = int(new_cluster_size)
        self.window = int(window if window is not None else
                          max(retriever.dram_window(self.layer).shape[0], 1))
        self.flush_batch = int(flush_batch)
        self.t_base, self.t_transfer = float(t_base_us), float(t_transfer_us)
        self.adapt_cache = adapt_cache
        self.reuse_outputs = reuse_outputs
        # reuse_outputs: the entry buffer retrievals land in
        self._eb: EntryBuffer | None = None
        self.baseline = self._check_baseline(baseline, li)
        # the pending entries' queries, for a rule that uses them
        self._q: np.ndarray | None = None
        self.freq = li.freq.astype(np.float64).copy()
        self.hot_budget = int(hot_budget_bytes if hot_budget_bytes is not None else
                              int(li.sizes[hot].sum()) * self.store.entry_bytes)
        # pending entries in capacity-doubling buffers: a step appends one
        # row (O(C), not a copy of all pending counts), a flush drops the oldest
        self._n_pend = 0
        self._rows = np.empty((16, self.store.entry_bytes), np.uint8)
        self._age = np.zeros(16, np.int64)
        self._f = np.zeros((16, li.num_clusters), np.int32)
        self.hits = 0
        self.lookups = 0
        # defer_upkeep: the step whose upkeep has not run yet, and the lock
        # that makes the next step wait for an upkeep running on another thread
        self._due: tuple | None = None
        self._upkeep_cv = threading.Condition()
        self._upkeep_running = False

    # -- one step ------------------------------------------------------------
    def step(self, q, k_new=None, v_new=None, *, retrieval: Retrieval | None = None,
             include_new: bool = False) -> StepResult:
        """Serve one decode step and add this step's new entry.

        Every argument is checked before any state changes: a rejected step
        leaves the session (frequencies, pending entries, hot set) as it was.

        Args:
            q: query [H_q, head_dim] of this step (numpy or torch, any float
                dtype incl. bfloat16).
            k_new, v_new: [H_kv, head_dim] K and V of the token produced at
                this step, in the store dtype (numpy, ml_dtypes bfloat16, or
                torch), both or neither.
            retrieval: this step's retrieval made ahead of time (SWARM §7:
                ``Retriever.prefetch(layer, q, torch=False)`` started while the
                previous layer computed); default: retrieve now.  It must be of
                this layer's current index (else ``SwarmError``); with
                ``defer_upkeep``, call :meth:`upkeep` before retrieving ahead,
                since the upkeep may flush.
            include_new: also return this step's own entry (``k_new``,
                ``v_new``) after the pending ones, at the position it will be
                stored at, so that the caller's attention needs no copy to
                add it (``swarmfs.hf`` does this).  It is not part of this
                step's co-activation counts.

        Returns:
            A :class:`StepResult`.

        Raises:
            ShapeError: a query, K or V of the wrong shape or dtype, or K/V
                holding NaN or inf; ``include_new`` without K and V.
            InvalidBoolError: ``include_new`` not True or False.
            InvalidTypeError: a ``retrieval`` that is not a :class:`Retrieval`.
            ConcurrentUseError: another thread is stepping this layer of the
                Retriever (this or another session); nothing was done.
            SwarmError: the layer changed under the session (another writer).
        """
        qf = self.r.queries(q)
        if qf.shape[0] != 1:
            raise errors.ShapeError(f"a step takes one query [H_q, d], got {qf.shape[0]}",
                                    layer=self.layer)
        row = None
        if k_new is not None or v_new is not None:
            row = self._new_row(k_new, v_new)
        include_new = V.parse_bool(include_new, "include_new", layer=self.layer)
        if include_new and row is None:
            raise errors.ShapeError("include_new needs this step's k_new and v_new",
                                    layer=self.layer)
        with self._exclusive("another thread is stepping this layer (one "
                             "DecodeSession.step per layer at a time)"):
            return self._step(qf[0], row, retrieval, include_new)

    @contextlib.contextmanager
    def _exclusive(self, busy: str):
        """The layer's step lock for this session's work, after any upkeep
        another thread is running and with the due one run first.

        Raises:
            ConcurrentUseError: ``busy``: another thread holds the step lock
                (nothing changed: a due upkeep stays due)."""
        with self._upkeep_cv:
            while self._upkeep_running:
                self._upkeep_cv.wait()
            due, self._due = self._due, None
        lock = self.r.step_lock(self.layer)
        if not lock.acquire(blocking=False):
            with self._upkeep_cv:
                self._due = due if self._due is None else self._due
            raise errors.ConcurrentUseError(busy, layer=self.layer)
        try:
            if due is not None:
                self._upkeep(*due)
            yield
        finally:
            lock.release()

    def upkeep(self) -> Upkeep:
        """Run the upkeep of the last step now (``defer_upkeep=True``): the
        eq. 9 counts, the §6.2 hot-set replacement, the new entry added to the
        pending ones, and a flush of the matured ones.  The next :meth:`step`
        (or :meth:`flush`) runs it first when nobody did, so calling it is
        optional; calling it after the step's attention, e.g. on a second
        thread while the next layer computes, takes it off the step's
        critical path.  A second call, or a call with nothing due, does
        nothing and returns empty arrays.

        Concurrency: may run on any thread while the caller reads the step's
        K/V (they are not written); the session's next step, flush or upkeep
        waits for it.

        Returns:
            An :class:`Upkeep` (clusters admitted and evicted, positions flushed).

        Raises:
            ConcurrentUseError: another session is stepping this layer.
            DiskFullError, IOFailedError: the flush failed (the entries stay
                pending).
        """
        empty = np.empty(0, np.int64)
        with self._upkeep_cv:
            due, self._due = self._due, None
            if due is None:
                return Upkeep(empty, empty, empty)
            self._upkeep_running = True
        try:
            lock = self.r.step_lock(self.layer)
            if not lock.acquire(blocking=False):
                with self._upkeep_cv:
                    self._due = due
                raise errors.ConcurrentUseError("another thread is stepping this layer",
                                                layer=self.layer)
            try:
                return self._upkeep(*due)
            finally:
                lock.release()
        finally:
            with self._upkeep_cv:
                self._upkeep_running = False
                self._upkeep_cv.notify_all()

    def _step(self, q: np.ndarray, row, retrieval, include_new: bool) -> StepResult:
        li0 = self.r.index(self.layer)
        self._check_layer(li0)
        n_pend = self._n_pend
        n_new = n_pend + (1 if include_new else 0)     # entries after the retrieved ones
        out = None
        if retrieval is None:
            out = self._outputs(li0, n_new) if self.reuse_outputs else None
            ret = self.r.retrieve(self.layer, q, torch=False, out=out)
        else:
            ret = V.parse_instance(retrieval, "retrieval", Retrieval, layer=self.layer)
            if ret.layer != self.layer or \
                    ret.index is not self.r.index(self.layer) \
                    or hasattr(ret.k, "detach"):
                raise errors.SwarmError("the given retrieval is not a numpy retrieval of this "
                                        "layer's current index (retrieve with torch=False after "
                                        "the previous step)", layer=self.layer)
        li = self.r.index(self.layer)
        self._check_layer(li)
        S = li.num_tokens
        n_ret = ret.positions.shape[0]
        pos = np.concatenate([ret.positions, S + np.arange(n_new)])
        k, v = ret.k, ret.v
        if n_new:
            new = self._rows[:n_pend] if not include_new else \
                np.concatenate([self._rows[:n_pend], row])
            if out is not None:                     # in place, after the retrieved entries
                rows = out.rows[:n_ret + n_new]
                rows[n_ret:] = new
                k, v = entry_views(rows, self.store)
            else:
                nk, nv = entry_views(new, self.store)
                k = np.concatenate([k, nk], axis=1)
                v = np.concatenate([v, nv], axis=1)
        due = (q, k[:, :n_ret + n_pend], ret, n_pend, row)
        if self.defer_upkeep:
            self._due = due
            e = np.empty(0, np.int64)
            return StepResult(k=k, v=v, positions=pos, retrieval=ret, admitted=e, evicted=e,
                              flushed=e)
        u = self._upkeep(*due)
        return StepResult(k=k, v=v, positions=pos, retrieval=ret, admitted=u.admitted,
                          evicted=u.evicted, flushed=u.flushed)

    def _upkeep(self, q, k, ret: Retrieval, n_pend: int, row) -> Upkeep:
        """A step's maintenance after its entries are served (step lock held)."""
        self._count_coactivation(q, k, ret, n_pend)
        admitted, evicted = self._replace_cache(ret) if self.adapt_cache else \
            (np.empty(0, np.int64), np.empty(0, np.int64))
        if row is not None:
            self._add_pending(row, q)
        return Upkeep(admitted, evicted, self._flush_matured())

    def _outputs(self, li, after: int) -> EntryBuffer:
        """The session's EntryBuffer, grown (by 1.25x) to hold any retrieval
        of the layer (at most its S distinct entries, or all its M stored
        copies when the Retriever reads without dedup) plus ``after``
        entries: untouched rows cost no memory until used."""
        need = (li.num_tokens if self.r.dedup else li.num_copies) + after
        if self._eb is None or self._eb.capacity < need:
            self._eb = self.r.entry_buffer(need + need // 4)
        return self._eb

    def _count_coactivation(self, q, k, ret: Retrieval, n_pend: int) -> None:
        """Eq. 9 counts: pending entries x selected clusters whose medoids drew
        at least the uniform share of this step's attention."""
        if n_pend:
            self._age[:n_pend] += 1
        if not n_pend or ret.clusters.size == 0 or self.baseline is not None \
                or ret.index is None:
            return                      # a baseline places entries by its own rule
        scale = self.store.head_dim ** -0.5
        mass = query_token_mass(q, k, scale)                                # [n]
        active = mass >= 1.0 / mass.shape[0]
        n_ret = ret.positions.shape[0]
        pend_active = np.flatnonzero(active[n_ret:])
        if pend_active.size == 0:
            return
        med = ret.index.medoid[ret.clusters]
        idx = ret.find(med)
        ok = (idx >= 0) & active[:n_ret][np.maximum(idx, 0)]
        cl = ret.clusters[ok]
        if cl.size:
            self.pend_f[np.ix_(pend_active, cl)] += 1

    def _replace_cache(self, ret: Retrieval):
        """§6.2 cache replacement over the hot set and this step's clusters,
        read and changed as one (:meth:`Retriever.replace_hot`)."""
        return self.r.replace_hot(self.layer, ret, lambda hot: self.choose_hot(hot, ret))

    def choose_hot(self, hot: np.ndarray, ret: Retrieval) -> np.ndarray:
        """The replacement policy (§6.2): the hot set after this step.

        f_i +1 for the selected clusters, -1 for the idle cached ones, then
        eq. 6 (:func:`~swarmfs.decode._hot.hot_clusters`) over the cached and the
        selected clusters.  A subclass overrides this to try another policy
        (``tools/bench_decode.py``'s LRU baseline does); it runs under the
        layer's step lock, and its result is applied atomically by
        :meth:`Retriever.replace_hot`.

        Args:
            hot: bool [C], the hot set before this step.
            ret: this step's :class:`Retrieval` (its ``clusters`` and ``index``).

        Returns:
            bool [C], the wanted hot set (within the DRAM budget).
        """
        if ret.index is None or ret.index.num_clusters != hot.shape[0]:
            return hot                  # another generation: set_hot refuses it
        sel = ret.clusters
        self.lookups += int(sel.size)
        self.hits += int(hot[sel].sum()) if sel.size else 0
        idle = hot.copy()
        idle[sel] = False
        self.freq[sel] += 1.0
        self.freq[idle] = np.maximum(self.freq[idle] - 1.0, 0.0)
        cand = union_ints(np.flatnonzero(hot), sel)     # ascending: ties keep id order
        want = np.zeros_like(hot)
        want[cand] = hot_clusters(self.freq[cand], ret.index.sizes[cand],
                                  budget_bytes=self.hot_budget,
                                  entry_bytes=self.store.entry_bytes, t_base_us=self.t_base,
                                  t_transfer_us=self.t_transfer)
        return want

    def _check_baseline(self, baseline, li):
        """``baseline`` checked against the Retriever's selector: None, or an
        append rule whose index the selector holds, a row per cluster.

        Raises:
            InvalidArgumentError: not an append rule, or a selector without a
                given index.  LayoutError: the index does not fit the layer.
        """
        if baseline is None:
            return None
        if not all(callable(getattr(baseline, x, None)) for x in ("count", "place")):
            raise errors.InvalidArgumentError(
                f"baseline must be an append rule (swarmfs.layout._baselines.append_rule), "
                f"got {type(baseline).__name__}", layer=self.layer)
        sel = self.r.selector
        if not all(callable(getattr(sel, x, None)) for x in ("layer_index", "replace")):
            raise errors.InvalidArgumentError(
                f"the Retriever's {sel.name} selector holds no given index for the "
                f"{getattr(baseline, 'name', '?')} appends to extend", layer=self.layer)
        for key, x in sel.layer_index(self.layer).items():
            if x.shape[0] != li.num_clusters:
                raise errors.LayoutError(f"the {sel.name} index has {x.shape[0]} {key} rows "
                                         f"for {li.num_clusters} clusters", layer=self.layer)
        return baseline

    def _check_layer(self, li) -> None:
        """The layer is as this session left it: the Retriever's index has the
        session's clusters, and the store holds no tokens beyond that index
        (another writer's append, even before the Retriever is refreshed,
        would make this session's pending positions collide with its)."""
        if li.num_clusters != self.freq.shape[0] or \
                li.num_clusters != self.pend_f.shape[1] or \
                self.store.num_tokens(self.layer) != li.num_tokens:
            raise errors.SwarmError("the layer changed under this DecodeSession (another writer "
                                    "appended to it); start a new session", layer=self.layer)

    def _new_row(self, k_new, v_new) -> np.ndarray:
        """One entry row (uint8 [1, entry_bytes]) from K and V [H_kv, d] in the
        store dtype (numpy or torch), checked and converted, nothing stored."""
        H, d = self.store.num_kv_heads, self.store.head_dim
        want = self.store.np_dtype
        if k_new is None or v_new is None:
            raise errors.ShapeError("give both k_new and v_new, or neither", layer=self.layer)
        arrs = []
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if hasattr(x, "detach"):                      # torch
                tname = str(x.dtype).removeprefix("torch.")
                if tname != self.store.dtype:
                    raise errors.ShapeError(f"{name} is torch {tname}; the store holds "
                                            f"{self.store.dtype}", layer=self.layer)
                x = x.detach().cpu().contiguous()
                if tname == "bfloat16":
                    import torch
                    x = x.view(torch.int16).numpy().view(want)
                else:
                    x = x.numpy()
            x = np.asarray(x)
            if x.shape != (H, d) or x.dtype != want:
                raise errors.ShapeError(f"{name} must be [{H}, {d}] {self.store.dtype}, got "
                                        f"{x.shape} {x.dtype}", layer=self.layer)
            if not np.isfinite(x.astype(np.float32)).all():
                raise errors.ShapeError(f"{name} holds NaN or inf", layer=self.layer)
            arrs.append(x)
        return np.ascontiguousarray(np.stack(arrs)).reshape(1, -1).view(np.uint8)

    @property
    def pend_rows(self) -> np.ndarray:
        """uint8 [pending, entry_bytes]: the pending entries' rows, oldest first."""
        return self._rows[:self._n_pend]

    @property
    def pend_age(self) -> np.ndarray:
        """int64 [pending]: steps each pending entry has been seen."""
        return self._age[:self._n_pend]

    @property
    def pend_f(self) -> np.ndarray:
        """int32 [pending, C]: eq. 9 co-activation counts of the pending entries."""
        return self._f[:self._n_pend]

    def _add_pending(self, row: np.ndarray, q: np.ndarray) -> None:
        n = self._n_pend
        if n == self._rows.shape[0]:                    # full: double the capacity
            cap = 2 * n
            rows = np.empty((cap, self._rows.shape[1]), np.uint8)
            age = np.zeros(cap, np.int64)
            f = np.zeros((cap, self._f.shape[1]), np.int32)
            rows[:n], age[:n], f[:n] = self._rows, self._age, self._f
            self._rows, self._age, self._f = rows, age, f
        if self.baseline is not None and self.baseline.queries:
            if self._q is None or self._q.shape[0] < self._rows.shape[0]:
                qb = np.zeros((self._rows.shape[0],) + q.shape, np.float32)
                if self._q is not None:
                    qb[:n] = self._q[:n]
                self._q = qb
            self._q[n] = q
        self._rows[n] = row[0]
        self._age[n] = 0
        self._f[n] = 0
        self._n_pend = n + 1

    def _drop_pending(self, n: int, new_clusters: int) -> None:
        """Forget the ``n`` oldest pending entries (written now) and give the
        rest a zero count for each of ``new_clusters`` clusters made since."""
        rest = self._n_pend - n
        self._rows[:rest] = self._rows[n:n + rest]
        self._age[:rest] = self._age[n:n + rest]
        self._f[:rest] = self._f[n:n + rest]
        if self._q is not None:
            self._q[:rest] = self._q[n:n + rest]
        if new_clusters:
            f = np.zeros((self._f.shape[0], self._f.shape[1] + new_clusters), np.int32)
            f[:rest, :self._f.shape[1]] = self._f[:rest]
            self._f = f
        self._n_pend = rest

    def joins(self, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Clusters each matured entry joins, as a CSR ``(ptr, clusters)``:
        d = 1 - f/W < tau (eq. 9), the closest ``max_joins`` first.

        Args:
            f: int [n, C] co-activation counts of n matured entries.
        """
        n, C = f.shape
        d = np.where(1.0 - f / float(self.window) < self.tau, 1.0 - f / float(self.window),
                     np.inf)
        k = min(self.max_joins, C)
        if n == 0 or k == 0:
            return np.zeros(n + 1, np.int64), np.empty(0, np.int64)
        idx = np.argpartition(d, k - 1, axis=1)[:, :k] if k < C else \
            np.broadcast_to(np.arange(C), (n, C)).copy()
        vals = np.take_along_axis(d, idx, 1)
        order = np.argsort(vals, axis=1, kind="stable")
        idx = np.take_along_axis(idx, order, 1)
        valid = np.isfinite(np.take_along_axis(vals, order, 1))
        ptr = np.zeros(n + 1, np.int64)
        np.cumsum(valid.sum(axis=1), out=ptr[1:])
        return ptr, idx[valid].astype(np.int64)

    def _flush_matured(self, force: bool = False) -> np.ndarray:
        ready = int((self.pend_age >= self.window).sum())
        li = self.r.index(self.layer)
        m = self._n_pend
        # pending are in age order; a baseline's rule may write fewer (whole pages/blocks)
        n = m if force else ready if self.baseline is None else \
            self.baseline.count(li.num_tokens, ready, m)
        if n == 0 or (not force and n < self.flush_batch):
            return np.empty(0, np.int64)
        kv = self.pend_rows[:m].view(self.store.np_dtype).reshape(
            m, 2, self.store.num_kv_heads, self.store.head_dim)
        medoids = index = None
        # with a baseline, the selector holds a given index (_check_baseline):
        # layer_index and replace
        sel: Any = self.r.selector
        if self.baseline is None:
            joins, size = self.joins(self.pend_f[:n]), self.new_cluster_size
        else:
            qs = self._q[:m].transpose(1, 0, 2) \
                if self.baseline.queries and self._q is not None else None
            g = self.baseline.place(
                sel.layer_index(self.layer), num_tokens=li.num_tokens,
                sizes=li.sizes, k=kv[:, 0].transpose(1, 0, 2).astype(np.float32), n=n, q=qs)
            joins, size, medoids, index = g.joins, g.new_cluster_size, g.medoids, g.index
        C_old = li.num_clusters
        hot = self.r.hot(self.layer)
        pos = self.store.append(self.layer, kv[:n], joins, new_cluster_size=size,
                                expect_tokens=li.num_tokens, medoids=medoids)
        C_new = self.store.num_clusters(self.layer)
        if index is not None:     # the selector's index, then the layer: a retrieval
            sel.replace(self.layer, index)               # between scores li's rows
        self._drop_pending(n, C_new - C_old)
        self.freq = np.concatenate([self.freq, np.zeros(C_new - C_old)])
        self.r.refresh(self.layer, hot=np.concatenate([hot, np.zeros(C_new - C_old, bool)]))
        self.r.layer_state(self.layer)      # reloaded now: dram_bytes counts the layer
        return pos

    def flush(self) -> np.ndarray:
        """Write every pending entry now (e.g. at the end of a request).

        Raises:
            ConcurrentUseError: another thread is stepping this layer.
        """
        with self._exclusive("another thread is stepping this layer"):
            return self._flush_matured(force=True)

    def discard_pending(self, n: int) -> None:
        """Forget the ``n`` newest pending entries, never written: an assisted
        decoder's rejected draft tokens (``swarmfs.hf``'s ``crop``).  Each of
        the steps that added them aged the older pending entries by one; they
        get those ``n`` steps back, so they mature when they would have
        without the drafts.  The eq. 9 counts and cache frequencies the
        discarded steps added stay (both only rank clusters).

        Raises:
            InvalidArgumentError: ``n`` not an integer in [0, pending].
            ConcurrentUseError: another thread is stepping this layer.
        """
        with self._exclusive("another thread is stepping this layer"):
            # (the last step's entry is pending now, its upkeep done)
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or \
                    not 0 <= n <= self._n_pend:
                raise errors.InvalidArgumentError(
                    f"discard_pending: n must be an integer in [0, {self._n_pend}], "
                    f"got {n!r}", layer=self.layer)
            rest = self._n_pend - int(n)
            self._n_pend = rest
            self._age[:rest] = np.maximum(self._age[:rest] - int(n), 0)

    @property
    def hit_rate(self) -> float:
        """Fraction of selected clusters that were hot (cache hit rate)."""
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def pending(self) -> int:
        """New entries still only in DRAM (with ``defer_upkeep``, the last
        step's entry counts before its upkeep adds it)."""
        due = self._due is not None and self._due[4] is not None
        return int(self.pend_rows.shape[0]) + int(due)

    @staticmethod
    def budget_for(retriever: Retriever, layer: int) -> int:
        """Entry budget ceil(r x S) of a layer at its current length."""
        return entry_budget(retriever.ratio, retriever.store.num_tokens(layer))


@V.checked_methods
@dataclasses.dataclass(frozen=True)
class PipelinedStep:
    """One decode step over all layers (:func:`pipelined_step`).

    Attributes:
        results: per layer, what the caller's ``attend`` returned.
        steps: per layer, the :class:`StepResult`.
        step_us: wall time of the whole step (µs).
        retrieval_us: per layer, the retrieval's own time (select + plan +
            I/O + assembly, µs), run in the prefetch thread.
        compute_us: per layer, the session step plus ``attend`` (µs), in the
            caller's thread.
        wait_us: per layer, time the caller waited for the layer's retrieval.
    """
    results: list
    steps: list
    step_us: float
    retrieval_us: list
    compute_us: list
    wait_us: list

    @property
    def sum_us(self) -> float:
        """Retrieval plus compute of every layer: the step without overlap."""
        return float(sum(self.retrieval_us) + sum(self.compute_us))

    @property
    def max_us(self) -> float:
        """The larger of all retrieval and all compute: the step with perfect
        overlap."""
        return float(max(sum(self.retrieval_us), sum(self.compute_us)))


@V.checked
def pipelined_step(sessions: list, queries, attend, new_kv=None) -> PipelinedStep:
    """One decode step over all layers with SWARM §7's pipeline: layer L+1's
    selection and reads (``Retriever.prefetch``) run while layer L's
    :meth:`DecodeSession.step` and attention run in the caller's thread.

    Args:
        sessions: one :class:`DecodeSession` per layer, in layer order (one
            thread at a time per session: this function's caller).
        queries: per layer, the query [H_q, d] used to select that layer's
            entries (in a model, layer L+1's query is not known before layer L
            finishes; SWARM predicts it, e.g. from layer L's input, and the
            caller passes what it predicts).
        attend: ``attend(i, step_result)`` -> anything: the layer's attention
            over ``step_result.k``/``v`` (numpy [H_kv, n, d]).
        new_kv: per layer ``(k_new, v_new)`` of the token this step produces,
            or None.

    Returns:
        A :class:`PipelinedStep` (step time against the sum and the max of
        its parts).

    Raises:
        whatever the retrievals, the session steps or ``attend`` raise; a
        prefetched retrieval whose layer was not stepped is waited for first.
    """
    import time
    try:
        sessions, queries = list(sessions), list(queries)
        new_kv = None if new_kv is None else [None if x is None else tuple(x) for x in new_kv]
    except TypeError:
        raise errors.InvalidArgumentError("sessions, queries and new_kv must be lists (new_kv "
                                          "of (k_new, v_new) pairs or None)") from None
    n = len(sessions)
    if n == 0 or len(queries) != n or (new_kv is not None and len(new_kv) != n):
        raise errors.InvalidArgumentError("sessions, queries (and new_kv) must be non-empty "
                                          "lists of one length")
    for x in sessions:
        V.parse_instance(x, "sessions", DecodeSession)
    if new_kv is not None and any(x is not None and len(x) != 2 for x in new_kv):
        raise errors.InvalidArgumentError("new_kv items must be (k_new, v_new) pairs or None",
                                          argument="new_kv")
    V.parse_callable(attend, "attend")
    t0 = time.perf_counter()
    fut = sessions[0].r.prefetch(sessions[0].layer, queries[0], torch=False)
    results, steps, ret_us, comp_us, wait_us = [], [], [], [], []
    try:
        for i, sess in enumerate(sessions):
            tw = time.perf_counter()
            ret = fut.result()
            wait_us.append((time.perf_counter() - tw) * 1e6)
            fut = sessions[i + 1].r.prefetch(sessions[i + 1].layer, queries[i + 1],
                                             torch=False) if i + 1 < n else None
            tc = time.perf_counter()
            kn, vn = new_kv[i] if new_kv is not None else (None, None)
            res = sess.step(queries[i], kn, vn, retrieval=ret)
            results.append(attend(i, res))
            comp_us.append((time.perf_counter() - tc) * 1e6)
            steps.append(res)
            ret_us.append(ret.stats.total_us)
    finally:
        if fut is not None:
            fut.exception()           # never leave a read running behind an error
    return PipelinedStep(results=results, steps=steps,
                         step_us=(time.perf_counter() - t0) * 1e6, retrieval_us=ret_us,
                         compute_us=comp_us, wait_us=wait_us)
