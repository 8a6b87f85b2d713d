"""The decode path of a :class:`~swarmfs.hf.SwarmCache` (SWARM §5.2, §6, §7):
per layer and token, each document's rows step their DecodeSessions over
one retrieval (the rows' clusters united into one read), then each row
attends over its own entries, the attention sinks it lacks and its mask's
columns.  The per-step figures (:class:`StepStats`) and their tables.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from .. import _errors as errors
from .. import _validate as V
from ..store._format import to_torch
from ..store._index import union_ints
from . import _batch
from ._attention import _sdpa

__all__ = ["StepStats", "DecodeMixin"]


def _to_numpy(t, dtype_name: str) -> np.ndarray:
    """torch tensor -> numpy in the store dtype (bfloat16 as ml_dtypes)."""
    t = t.detach().cpu().contiguous()
    if dtype_name == "bfloat16":
        import ml_dtypes
        return t.view(__import__('torch').int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()



@V.checked_methods
@dataclasses.dataclass(frozen=True)
class StepStats:
    """One decode step of one layer.

    Attributes:
        step: decode step (0 = first token after the stored prefix).
        layer: layer.
        clusters: clusters selected; hot: of those, served from DRAM.
        entries: stored entries attended to; entries_ssd: of those read from
            the disks; pending: new tokens attended to from DRAM.
        bytes_read, requests: the batched read (bytes incl. alignment).
        score_us, select_us, plan_us, io_us, assemble_us: retrieval stages (µs).
        session_us: DecodeSession work besides retrieval: eq. 9 counts, cache
            replacement, appends (µs).
        attend_us: the attention product over the retrieved entries (µs).
        wait_us: time this layer waited for its §7 prefetch to finish (µs;
            the prefetch's own stage times are in score_us ... assemble_us,
            spent in the background thread).
        measure_us: scoring the exact query to measure the prefetch hit
            rate (µs; measurement only, CPU).
        prefetched: the retrieval came from a §7 prefetch.
        prefetch_hit: fraction of the entries the exact query selects
            (its clusters and the window) that the prefetched retrieval
            holds (NaN without prefetch).
        cache_hit_rate: the layer's running §6.2 cache hit rate.
        row: the batch row (a retrieval several rows share, SWARM's one read
            per layer per store, is counted in its first row's bytes_read,
            requests and stage µs; the other rows' ``entries`` are what each
            of them attends to).
    """
    step: int
    layer: int
    clusters: int
    hot: int
    entries: int
    entries_ssd: int
    pending: int
    bytes_read: int
    requests: int
    score_us: float
    select_us: float
    plan_us: float
    io_us: float
    assemble_us: float
    session_us: float
    attend_us: float
    wait_us: float
    measure_us: float
    prefetched: bool
    prefetch_hit: float
    cache_hit_rate: float
    row: int = 0


class DecodeMixin:
    """SwarmCache's decode path and reports (it needs the cache's rows,
    documents, layers, ``_session`` and ``_ensure_retriever``)."""

    # the SwarmCache's state this mixin reads (set by SwarmCache.__init__)
    _rows: list
    _docs: list
    layers: list
    stats: list
    sinks: int
    record: bool
    ratio: float
    prefetch_mode: str
    upkeep_mode: str
    _upkeeps: dict
    _upkeep_pool: Any
    path: Any
    _kv_dtype: Any
    _futures: dict
    _prev_q: dict
    _alive: Any
    _pads_checked: bool

    def _session(self, row, layer: int) -> Any:
        raise NotImplementedError            # SwarmCache's

    def _ensure_retriever(self, doc) -> Any:
        raise NotImplementedError            # SwarmCache's

    def _dram_window(self, tokens: int) -> int:
        raise NotImplementedError            # SwarmCache's

    def _exact_entries(self, r, layer: int, q: np.ndarray) -> np.ndarray:
        """Entries a query selects (its clusters and the window): for the §7
        prefetch hit rate, and a row's own entries in a shared retrieval."""
        li = r.index(layer)
        sel = r.select(layer, q)
        return union_ints(li.members[li.cluster_copies(sel)], r.window(layer))

    def _check_pads(self, mask) -> None:
        """Rows over stored documents of different lengths: each row's mask
        shows its document ending at the longest's (checked once)."""
        self._pads_checked = True
        P = self.layers[0].seen
        pads = np.array([r.pad for r in self._rows])
        if mask is None:
            if pads.any():
                raise errors.ShapeError("the rows' stored documents differ in length: pad the "
                                        "shorter ones on the left and pass an attention_mask",
                                        store=self.path)
            return
        vis = _batch.visible(mask[:, 0, 0, :P]).cpu().numpy()
        vis = np.broadcast_to(vis, (len(self._rows), P))
        bad = np.flatnonzero((vis & (np.arange(P)[None, :] < pads[:, None])).any(axis=1))
        if bad.size:
            b = int(bad[0])
            raise errors.ShapeError(f"row {b}: its stored document must end at column {P}, "
                                    f"padded on the left by {pads[b]} masked tokens",
                                    store=self._rows[b].doc.path)

    def _decode(self, layer: int, module, query, key, value, scaling, mask=None):
        B, Hq, T, d = (int(x) for x in query.shape)
        if not self._pads_checked:
            self._check_pads(mask)
        alive = self._alive if self._alive is not None and self._alive.shape == (B, T) \
            else np.ones((B, T), bool)
        out = None
        for t in range(T):
            groups = []
            for doc in self._docs:
                rows = [r for r in doc.rows if alive[r.row, t]]
                if rows:
                    groups.append((doc, rows))
            reads = {}
            if len(groups) > 1:   # the other stores' reads run while the first one's does
                for doc, rows in groups[1:]:
                    for r in rows:
                        self._session(r, layer)
                    q = np.stack([self._query(query, r, t) for r in rows])
                    reads[id(doc)] = self._ensure_retriever(doc).prefetch(
                        layer, q if doc.shared else q[0], torch=False)
            for doc, rows in groups:
                for r, res, keep, info in self._step_rows(layer, doc, rows, query, key, value,
                                                          t, T, reads.get(id(doc))):
                    ta = time.perf_counter()
                    o, attended = self._attend(r, layer, module, query, t, res, keep, scaling,
                                               mask)
                    if out is None:
                        out = o.new_zeros((B, T) + tuple(o.shape[2:]))
                    out[r.row, t] = o[0, 0]
                    self._note(r, layer, res, info, (time.perf_counter() - ta) * 1e6,
                               attended, query, t, scaling, keep)
                    if self.upkeep_mode == "background":
                        self._start_upkeep(r, layer)
        if out is None:                     # every row has finished
            out = query.new_zeros((B, T, Hq, d))
        return out, None

    def _start_upkeep(self, row, layer: int) -> None:
        """Run the session's upkeep of this step on the worker thread."""
        if self._upkeep_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._upkeep_pool = ThreadPoolExecutor(1, thread_name_prefix="swarmfs-upkeep")
        self._upkeeps[(row.row, layer)] = self._upkeep_pool.submit(row.sessions[layer].upkeep)

    def _wait_upkeep(self, row, layer: int) -> None:
        """The session's last upkeep, finished (its error raised here)."""
        f = self._upkeeps.pop((row.row, layer), None)
        if f is not None:
            f.result()

    @staticmethod
    def _query(query, r, t) -> np.ndarray:
        return query[r.row, :, t, :].detach().float().cpu().numpy().copy()    # [H_q, d]

    def _step_rows(self, layer, doc, rows, query, key, value, t, T, read):
        """The DecodeSession steps of one document's rows at token t: one
        retrieval per layer serves them all (SWARM §6.1: the batch's clusters
        united into one read).  Yields (row, StepResult, keep bool [n] or
        None: the row's own entries of a shared retrieval, info)."""
        dt = self._kv_dtype
        r = self._ensure_retriever(doc)
        sess = [self._session(row, layer) for row in rows]
        for row in rows:
            self._wait_upkeep(row, layer)
        qs = [self._query(query, row, t) for row in rows]
        ret, pre, hit, wait_us, measure_us = None, False, float("nan"), 0.0, 0.0
        tw = time.perf_counter()
        if read is not None:
            ret = read.result()
            wait_us = (time.perf_counter() - tw) * 1e6
        elif doc.shared:
            ret = r.retrieve(layer, np.stack(qs), torch=False)
        else:
            fut = self._futures.pop(layer, None)
            if fut is not None:
                pre_ret = fut.result()
                tm = time.perf_counter()
                if T == 1:
                    exact = self._exact_entries(r, layer, qs[0])
                    hit = float(np.isin(exact, pre_ret.positions).mean()) if exact.size else 1.0
                    pre, ret = True, pre_ret
                wait_us = (tm - tw) * 1e6
                measure_us = (time.perf_counter() - tm) * 1e6
        keeps = [None] * len(rows)
        if doc.shared:
            for i, q in enumerate(qs):
                keeps[i] = np.isin(ret.positions, self._exact_entries(r, layer, q))
        for i, row in enumerate(rows):
            s = sess[i]
            k_new = _to_numpy(key[row.row, :, t, :], dt)              # [H_kv, d]
            v_new = _to_numpy(value[row.row, :, t, :], dt)
            hold = t > 0      # a multi-token forward's later tokens stay in DRAM until the next
            # a flush in this step makes S at most S + pending: the window it reloads with
            r.local_window = self._dram_window(doc.store.num_tokens(layer) + s.pending + 1)
            if hold:
                saved, s.flush_batch = s.flush_batch, 1 << 62
            t0 = time.perf_counter()
            try:
                res = s.step(qs[i], k_new, v_new, retrieval=ret, include_new=True)
            finally:
                if hold:
                    s.flush_batch = saved
            t1 = time.perf_counter()
            if self.prefetch_mode == "previous" and T == 1:
                # §7: start layer L+1's retrieval now, with its previous query
                self._prev_q[layer] = qs[i]
                nxt = (layer + 1) % len(self.layers)
                if nxt in self._prev_q and nxt not in self._futures:
                    self._futures[nxt] = r.prefetch(nxt, self._prev_q[nxt], torch=False)
            keep = keeps[i]
            if keep is not None:
                keep = np.concatenate([keep, np.ones(res.positions.shape[0] - keep.shape[0],
                                                     bool)])
            own_read = ret is None or pre or (read is not None and not doc.shared) or i == 0
            yield row, res, keep, (pre, hit, wait_us if i == 0 else 0.0, measure_us,
                                   (t1 - t0) * 1e6, own_read)

    def _sink_gap(self, doc: _batch.Doc, layer: int, pos: np.ndarray) -> np.ndarray:
        """Sink positions (the first ``sinks`` tokens) a step's entries lack."""
        if not self.sinks:
            return np.empty(0, np.int64)
        if layer not in doc.sinks:           # a stored document: read them once
            s = min(self.sinks, doc.store.num_tokens(layer))
            rows = doc.store.read_entries(layer, np.arange(s, dtype=np.int64))
            kv = to_torch(np.ascontiguousarray(rows), self._kv_dtype)       # [s, 2, H, d]
            doc.sinks[layer] = (kv[:, 0].transpose(0, 1).contiguous(),
                                kv[:, 1].transpose(0, 1).contiguous())
        n = int(doc.sinks[layer][0].shape[1])
        return np.setdiff1d(np.arange(n, dtype=np.int64), pos[pos < n])  # any order

    def _attend(self, row, layer, module, query, t, res, keep, scaling, mask):
        """One row's attention at token t over its step's entries, the
        attention sinks it lacks and its mask columns.  Returns (output
        [1, 1, H_q, d], attended positions int64)."""
        import torch
        dt = self._kv_dtype
        pos = res.positions
        kk, vv = to_torch(res.k, dt), to_torch(res.v, dt)   # retrieved, pending, this token
        gap = self._sink_gap(row.doc, layer, pos)
        if gap.size:
            sk, sv = row.doc.sinks[layer]
            idx = torch.from_numpy(gap)
            kk = torch.cat([sk.index_select(1, idx), kk], 1)
            vv = torch.cat([sv.index_select(1, idx), vv], 1)
            pos = np.concatenate([gap, pos])
            if keep is not None:
                keep = np.concatenate([np.ones(gap.size, bool), keep])
        if keep is not None:
            keep = keep | (pos < self.sinks)
        m = None
        if mask is not None:      # padding and any masked token: the mask's columns
            mb = row.row if mask.shape[0] > 1 else 0
            cols = torch.from_numpy(pos + row.pad).to(mask.device)
            m = _batch.visible(mask[mb:mb + 1, :, t:t + 1, :].index_select(-1, cols))
            if bool(m.all()):
                m = None
        if keep is not None and not keep.all():
            kt = torch.from_numpy(keep).view(1, 1, 1, -1)
            m = kt if m is None else m & kt
        out, _ = _sdpa(module, query[row.row:row.row + 1, :, t:t + 1, :], kk[None], vv[None],
                       m, scaling=scaling, is_causal=False)
        return out, pos if keep is None else pos[keep]

    def _note(self, row, layer, res, info, attend_us, attended, query, t, scaling,
              keep) -> None:
        """The step's StepStats (and record)."""
        pre, hit, wait_us, measure_us, step_us, own_read = info
        rs = res.retrieval.stats
        step = row.steps.get(layer, 0)
        row.steps[layer] = step + 1
        n_ret = res.retrieval.positions.shape[0]
        entries = rs.entries if keep is None else int(keep[:n_ret].sum())
        retrieval_us = 0.0 if pre or not own_read else rs.total_us
        io = (lambda x: x) if own_read else (lambda x: 0 * x)
        self.stats.append(StepStats(
            step=step, layer=layer, clusters=rs.clusters_selected,
            hot=rs.hot_clusters_selected, entries=entries,
            entries_ssd=io(rs.entries_ssd), pending=int(res.positions.shape[0] - n_ret - 1),
            bytes_read=io(rs.bytes_read), requests=io(rs.requests), score_us=io(rs.score_us),
            select_us=io(rs.select_us), plan_us=io(rs.plan_us), io_us=io(rs.io_us),
            assemble_us=io(rs.assemble_us),
            session_us=max(step_us - retrieval_us, 0.0) if own_read else step_us,
            attend_us=attend_us, wait_us=wait_us, measure_us=measure_us,
            prefetched=pre, prefetch_hit=hit, cache_hit_rate=row.sessions[layer].hit_rate,
            row=row.row))
        if self.record:
            ret = res.retrieval.positions
            if keep is not None:
                ret = ret[keep[:n_ret]]
            row.records.setdefault(layer, []).append(
                (self._query(query, row, t), ret.copy(), float(scaling), attended.copy()))

    def step_table(self) -> list[dict]:
        """Per decode step, the sums (bytes, entries, µs) over layers and rows
        and the means (hit rates): a list of dicts, one per step."""
        by: dict[int, list[StepStats]] = {}
        for s in self.stats:
            by.setdefault(s.step, []).append(s)
        rows = []
        for step in sorted(by):
            ss = by[step]
            row: dict[str, Any] = {"step": step}
            for f in ("clusters", "hot", "entries", "entries_ssd", "pending", "bytes_read",
                      "requests", "score_us", "select_us", "plan_us", "io_us", "assemble_us",
                      "session_us", "attend_us", "wait_us", "measure_us"):
                row[f] = sum(getattr(s, f) for s in ss)
            row["pending"] = ss[0].pending
            row["rows"] = len({s.row for s in ss})
            row["cache_hit_rate"] = float(np.mean([s.cache_hit_rate for s in ss]))
            hits = [s.prefetch_hit for s in ss if s.prefetched]
            row["prefetch_hit"] = float(np.mean(hits)) if hits else None
            rows.append(row)
        return rows

    def summary(self) -> dict:
        """Medians over decode steps of :meth:`step_table`, the §6.2 cache
        hit rate, the §7 prefetch hit rate, the DRAM bytes held, the rows and
        the operating point (issue 23): ``entries_per_cluster`` (mean over
        layers of the prompt's layout; ``entries_per_cluster_min`` the
        smallest layer's), ``dram_share`` (DRAM held / the prompt's KV
        bytes) and ``mean_read_bytes`` (SSD bytes / requests over all
        steps)."""
        rows = self.step_table()
        out: dict[str, Any] = {
            "steps": len(rows), "prefix_tokens": self._rows[0].doc.prefix_length,
            "ratio": self.ratio, "prefetch": self.prefetch_mode, "rows": len(self._rows),
            "finished_rows": sum(r.finished for r in self._rows)}
        if rows:
            for f in ("clusters", "entries", "entries_ssd", "bytes_read", "requests",
                      "score_us", "select_us", "plan_us", "io_us", "assemble_us",
                      "session_us", "attend_us", "wait_us", "measure_us"):
                out[f] = float(np.median([r[f] for r in rows]))
            sess = [s for r in self._rows for s in r.sessions.values()]
            lookups = sum(s.lookups for s in sess)
            out["cache_hit_rate"] = sum(s.hits for s in sess) / lookups if lookups else 0.0
            ph = [s.prefetch_hit for s in self.stats if s.prefetched]
            out["prefetch_hit"] = float(np.mean(ph)) if ph else None
        out["dram_bytes"] = self.dram_bytes()
        report = self._rows[0].doc.layout_report
        sizes = [x["mean_size"] for x in report.values() if "mean_size" in x]
        out["entries_per_cluster"] = float(np.mean(sizes)) if sizes else None
        out["entries_per_cluster_min"] = float(min(sizes)) if sizes else None
        st = self._rows[0].doc.store
        kv = out["prefix_tokens"] * len(report) * (st.entry_bytes if st is not None else 0)
        out["dram_share"] = out["dram_bytes"] / kv if kv else None
        reqs = sum(r["requests"] for r in rows)
        out["mean_read_bytes"] = sum(r["bytes_read"] for r in rows) / reqs if reqs else None
        return out

    def dram_bytes(self) -> int:
        """Bytes of the prefixes held in DRAM: medoid indexes, local windows, hot
        clusters (the Retrievers' partitions), attention sinks and pending new
        entries."""
        total = 0
        for d in self._docs:
            if d.retriever is None:
                continue
            total += d.retriever.dram_bytes()
            total += sum(k.nbytes + v.nbytes for k, v in d.sinks.values())
            total += sum(s.pending for r in d.rows for s in r.sessions.values()) * \
                d.store.entry_bytes
        return int(total)
