"""The measurement: a store of several variants' layouts (:class:`Bench`),
recorded and replayed reads, and whole decode steps (:func:`stream_steps`)."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import shutil
import sys
import time

import numpy as np

from .config import ENTRY_BYTES, BenchConfig
from .disks import Disks
from .stats import summarize
from .traces import Trace
from .widening import narrow, widen_flat, widen_kv, widen_q


@dataclasses.dataclass
class Variant:
    """One measured configuration: a stored layout plus how it is read.

    Attributes:
        name: label in tables and plots.
        layout: the method's layout.
        placement: ``"eq7"`` or ``"disk0"``.
        policy, dedup, max_gap: Retriever read options (§6.1, §8.3).
        store_as: share the stored layer of another variant (same layout,
            same placement) instead of writing it again.
    """
    name: str
    layout: object
    placement: str = "eq7"
    policy: str = "balanced"
    dedup: bool = True
    max_gap: int = 0
    store_as: str | None = None


class Bench:
    """A store on one set of disks holding several variants' layouts as
    layers of one context, with a Retriever per variant.

    All layers hold the same entries (the context's K/V, widened to 4 KiB);
    layer i is variant i's grouping, written one after another on the same
    disks (eq. 7's global pointer continues across layers).  ``cfg`` gives
    the engine queue depth and the streaming block and warm-up times.
    """

    def __init__(self, path, disks: Disks, trace: Trace, start: int, S: int,
                 variants: list, *, cfg: BenchConfig, ratio: float = 0.1, kv=None):
        from swarmfs import Store
        from swarmfs._demo import local_window
        from swarmfs.layout import LayoutParams
        self.trace, self.start, self.S, self.ratio = trace, start, S, ratio
        self.cfg = cfg
        self.variants = {v.name: v for v in variants}
        owners = [v for v in variants if v.store_as is None]
        path = pathlib.Path(path)
        if path.exists():
            shutil.rmtree(path)
        t0 = time.perf_counter()
        wide = trace.wide
        self.store = Store.create(path, disks=disks.spec(), num_layers=len(owners),
                                  num_kv_heads=wide.store_kv_heads,
                                  head_dim=wide.store_head_dim,
                                  num_query_heads=wide.store_query_heads, dtype="float16",
                                  model_name=f"{trace.meta.get('model', trace.kind)} KV in "
                                             f"{wide.entry_bytes // 1024} KiB entries",
                                  force=True, queue_depth=cfg.qd, verify=True)
        tmp = None
        if kv is None:
            if S * ENTRY_BYTES > (1 << 30):
                tmp = path.parent / f"{path.name}-kv.npy"
            kv = widen_kv(trace.k[:, start:start + S], trace.v[:, start:start + S], wide,
                          path=tmp)
        self.W = local_window(LayoutParams(ratio=ratio), S)
        self.layer = {}
        for i, v in enumerate(owners):
            lay = v.layout
            self.store.write_layer(i, kv, (lay.ptr, lay.members), lay.medoids, freq=lay.freq,
                                   local_window=self.W, placement=v.placement,
                                   extra={"variant": v.name})
            self.layer[v.name] = i
        for v in variants:
            if v.store_as is not None:
                self.layer[v.name] = self.layer[v.store_as]
        self.write_s = time.perf_counter() - t0
        self.k_flat = kv[:, 0].reshape(S, -1)         # for the token (oracle) selector
        del kv
        self.retrievers = {v.name: self._retriever(v) for v in variants}
        for name, r in self.retrievers.items():
            r.layer_state(self.layer[name])            # DRAM partition before timing
        del self.k_flat
        if tmp is not None:
            tmp.unlink()                               # selectors hold their own copies

    def _retriever(self, v: Variant):
        from swarmfs import Retriever
        from swarmfs.decode._selectors import (
            BoundSelector,
            MultiVectorSelector,
            TokenSelector,
            VectorSelector,
        )
        lay, L = v.layout, self.layer[v.name]
        wide = self.trace.wide
        sel = None
        if lay.kind == "tokens":
            sel = TokenSelector({L: np.ascontiguousarray(self.k_flat)})
        elif lay.kind == "vectors":
            sel = VectorSelector({L: widen_flat(lay.index["vectors"], wide)}, name=v.name)
        elif lay.kind == "multivector":
            sel = MultiVectorSelector({L: widen_flat(lay.index["reps"], wide)}, name=v.name)
        elif lay.kind == "bounds":
            sel = BoundSelector({L: (widen_flat(lay.index["lo"], wide, np.float32),
                                     widen_flat(lay.index["hi"], wide, np.float32))})
        return Retriever(self.store, ratio=self.ratio, policy=v.policy, dedup=v.dedup,
                         max_gap=v.max_gap, selector=sel)

    def close(self):
        self.retrievers.clear()
        self.store.close()

    def index_bytes(self, name: str) -> int:
        """DRAM bytes of a variant's index (medoids, keys, vectors or bounds)."""
        r = self.retrievers[name]
        return int(r.selector.dram_bytes(self.layer[name]))

    def dram_bytes(self, name: str) -> int:
        """Index plus local window (and hot clusters, none here)."""
        return int(self.retrievers[name].layer_state(self.layer[name]).dram_bytes)

    def disk_bytes(self, name: str) -> int:
        li = self.store.layer(self.layer[name])
        return int(li.num_copies * self.store.entry_bytes)

    def queries(self, pos) -> np.ndarray:
        """The model's held-out queries [n, H_q, d] at positions ``pos``
        after this context (``Trace.decode_queries``)."""
        return self.trace.decode_queries(pos, self.start + self.S)

    # -- one decode step: record ---------------------------------------------------
    def record(self, name: str, pos, *, accuracy: bool = True) -> dict:
        """Retrieve for the held-out query at ``pos`` (an int, or a list of
        positions: one batched step) with variant ``name``, untimed for the
        figures: returns the step's metrics and keeps the plan the Retriever
        executed (``Store.execute``), which :meth:`stream` replays.

        The retrieval reads with checksums verified; its own ``io_us`` is kept
        as ``io_us_live`` (an isolated read: see :meth:`stream` for why the
        figures do not use it on the testbed)."""
        r = self.retrievers[name]
        L = self.layer[name]
        pos = np.atleast_1d(np.asarray(pos, np.int64))
        qw = widen_q(self.queries(pos), self.trace.scaling, self.trace.wide)
        with self._recording() as plans:
            ret = r.retrieve(L, qw if pos.shape[0] > 1 else qw[0], torch=False)
        s = ret.stats
        useful = int(np.unique(ret.positions).shape[0]) - s.entries_dram
        out = {"score_us": s.score_us, "select_us": s.select_us, "plan_us": s.plan_us,
               "io_us_live": s.io_us, "assemble_us": s.assemble_us,
               "budget": s.budget, "clusters": s.clusters_selected, "entries": s.entries,
               "entries_dram": s.entries_dram, "entries_ssd_read": s.entries_ssd,
               "useful_entries": useful, "useful_bytes": useful * ENTRY_BYTES,
               "bytes_read": s.bytes_read, "requests": s.requests,
               "mean_request_kib": s.bytes_read / max(s.requests, 1) / 1024,
               "max_mean_load": s.max_mean_load, "disk_bytes": list(s.disk_bytes),
               "_plans": plans, "_positions": ret.positions}
        if accuracy:
            out.update(self.accuracy(pos, ret))
            if pos.shape[0] == 1:
                st = r.layer_state(L)
                ssd = ret.positions[~st.resident[ret.positions]]
                needed = int(np.isin(ssd, out.pop("_top")).sum())
                out["needed_bytes"] = needed * ENTRY_BYTES
            out.pop("_top", None)
        return out

    @contextlib.contextmanager
    def _recording(self):
        """Capture every (layer index, plan, copies) ``Store.execute`` runs."""
        st = self.store
        real = type(st).execute
        plans = []

        def execute(li, plan, copies, **kw):
            plans.append((li, plan, copies))
            return real(st, li, plan, copies, **kw)

        st.execute = execute
        try:
            yield plans
        finally:
            del st.execute

    def record_read(self, name: str, tokens) -> dict:
        """Plan (untimed) the read of given tokens from a variant's layer: any
        copy, §6.1 buckets; the I/O of another method's selection on this
        layout (Fig. 13)."""
        L = self.layer[name]
        li = self.store.layer(L)
        st = self.retrievers[name].layer_state(L)
        t = np.unique(np.asarray(tokens, np.int64))
        t = t[~st.resident[t]]
        copies = li.token_copies(t)
        v = self.variants[name]
        plan = self.store.plan_copies(li, copies, policy=v.policy, dedup=v.dedup,
                                      max_gap=v.max_gap)
        return {"useful_entries": int(t.shape[0]), "useful_bytes": int(t.shape[0]) * ENTRY_BYTES,
                "bytes_read": plan.staging_bytes, "requests": plan.num_requests,
                "mean_request_kib": plan.staging_bytes / max(plan.num_requests, 1) / 1024,
                "max_mean_load": plan.max_mean_load, "_plans": [(li, plan, copies)]}

    def accuracy(self, pos: np.ndarray, ret) -> dict:
        """Attention-mass recall and output error of the first query of a step,
        with the K/V read back from the store (SWARM §8.2, ``_report``), and
        the oracle's top-k (``_top``: the entries the query actually needs)."""
        from swarmfs.decode._report import attention_logits, evaluate_query, token_mass
        tr = self.trace
        a, S = self.start, self.S
        q0 = self.queries(pos[:1])[0]                                  # [H_q, d], the model's
        r0 = evaluate_query(q0, tr.k[:, a:a + S], tr.v[:, a:a + S],
                            ret.positions, k_ret=narrow(ret.k, tr.wide),
                            v_ret=narrow(ret.v, tr.wide), scaling=tr.scaling, ratio=self.ratio)
        mass = token_mass(attention_logits(q0[:, None, :], tr.k[:, a:a + S], tr.scaling))[0]
        top = np.argpartition(-mass, r0["budget"] - 1)[:r0["budget"]]
        return {"_top": top, **{k: r0[k] for k in ("recall", "rel_error", "oracle_rel_error",
                                                    "mass", "oracle_mass")}}

    # -- timed: back-to-back replay ----------------------------------------------------
    def stream(self, recorded: dict, reps: int, *, seed: int = 0, progress: str = "") -> dict:
        """Time the recorded reads of every variant, replayed back to back.

        ``recorded`` is ``{name: [step metrics from record/record_read]}``.
        For each repetition the variants run in a fresh random order, each as
        one block: its steps replayed back to back, untimed for
        ``cfg.warmup_s`` seconds (default :data:`WARMUP_S`), then timed,
        cycling through the steps until at least ``cfg.block_s`` seconds
        (default :data:`BLOCK_S`) and one full pass have elapsed.  A step
        is its plan executed by ``Store.execute`` (one batched submission
        plus the gather into rows; checksums off, as fio reads).

        Why blocks: blk-throttle (the testbed's SSD emulation) grants I/O in
        quanta of one throttle slice (100 ms of the limit here: 14.4 MB and
        2,291 requests per PM9A3 device), so an isolated read of a few MB per
        device after an idle moment runs almost unthrottled, and a single
        step's time is quantised.  The warm-up drains that credit; over a
        block of >= 2.5 s the quantisation is <= 4% of the time.  A block's
        time divided by its steps is the per-step I/O time of a continuous
        decode, where selecting the next layer overlaps the current read (§7).

        Returns:
            {name: {"block_s": [per rep], "io_us": [per rep: block time /
            steps], "step_us": [every step], "eff_gbps": [per rep],
            "read_gbps": [per rep]}}.
        """
        rng = np.random.default_rng(seed)
        out = {n: {"block_s": [], "io_us": [], "engine_us": [], "step_us": [], "eff_gbps": [],
                   "read_gbps": [], "goodput_gbps": []} for n in recorded}
        self.store.verify_checksums = False
        t_all = time.perf_counter()
        try:
            for rep in range(reps):
                for n in rng.permutation(list(recorded)):
                    n = str(n)
                    steps = recorded[n]
                    t0 = time.perf_counter()
                    i = 0
                    while time.perf_counter() - t0 < self.cfg.warmup_s:
                        self._replay(steps[i % len(steps)])
                        i += 1
                    t0 = time.perf_counter()
                    times, done = [], []
                    while len(times) < len(steps) or time.perf_counter() - t0 < self.cfg.block_s:
                        st = steps[len(times) % len(steps)]
                        times.append(self._replay(st))
                        done.append(st)
                    blk = time.perf_counter() - t0
                    o = out[n]
                    o["block_s"].append(blk)
                    o["io_us"].append(blk / len(done) * 1e6)
                    o["engine_us"].append(sum(e for _, e in times) / len(done) * 1e6)
                    o["step_us"].extend(t * 1e6 for t, _ in times)
                    o["eff_gbps"].append(sum(x["useful_bytes"] for x in done) / blk / 1e9)
                    o["read_gbps"].append(sum(x["bytes_read"] for x in done) / blk / 1e9)
                    if all("needed_bytes" in x for x in done):
                        o["goodput_gbps"].append(sum(x["needed_bytes"] for x in done) / blk / 1e9)
                if progress:
                    print(f"  {progress}: rep {rep + 1}/{reps}, "
                          f"{time.perf_counter() - t_all:.0f} s", file=sys.stderr, flush=True)
        finally:
            self.store.verify_checksums = True
        return out

    def _replay(self, st) -> tuple[float, float]:
        """Execute a recorded step; (wall seconds, engine seconds: the longest
        per-disk span from first submission to last completion)."""
        eng = self.store.engine
        b = eng.stats().disks
        t0 = time.perf_counter()
        for li, plan, copies in st["_plans"]:
            self.store.execute(li, plan, copies)
        t = time.perf_counter() - t0
        a = eng.stats().disks
        return t, max(x.busy_us - y.busy_us for x, y in zip(a, b, strict=True)) / 1e6

    def measure(self, names, steps, reps: int, *, accuracy: bool = True, seed: int = 0,
                progress: str = "") -> dict:
        """Record every variant's steps (accuracy pass), stream them (timed),
        and summarise per variant."""
        rec = {n: [self.record(n, p, accuracy=accuracy) for p in steps] for n in names}
        timed = self.stream(rec, reps, seed=seed, progress=progress)
        return {n: {**summarize(rec[n], timed[n]), "index_bytes": self.index_bytes(n),
                    "dram_bytes": self.dram_bytes(n), "disk_bytes": self.disk_bytes(n),
                    "layout": self.variants[n].layout.summary()} for n in names}


    # -- timed: whole decode steps, as a serving engine runs them -------------------
    def step_queries(self, positions) -> list:
        """Widened held-out queries [store H_q, store d] float32, one per position."""
        return list(widen_q(self.queries(positions), self.trace.scaling, self.trace.wide))

    def step_buffers(self, name: str, queries) -> tuple:
        """Reusable K/V outputs for ``Retriever.retrieve(out=...)``, sized by
        one untimed pass over the queries (the largest step's entries)."""
        r, L = self.retrievers[name], self.layer[name]
        n = max(int(r.retrieve(L, q, torch=False).positions.shape[0]) for q in queries)
        return r.kv_buffers(n)

    def step_block(self, name: str, queries, bufs) -> dict:
        """One timed block of whole decode steps of variant ``name``.

        Each step is ``Retriever.retrieve(layer, q, out=bufs)``: selection
        (scoring + cluster choice), planning, the batched read and the
        assembly into the caller's reused K/V buffers, back to back, cycling
        through the queries: untimed for ``cfg.warmup_s`` seconds, then timed
        for at least ``cfg.block_s`` seconds and one full pass (as
        :meth:`stream`, for blk-throttle's quanta).  Checksums are off, as in
        :meth:`stream`.

        Returns:
            {"step_us": block time / steps (µs), "steps": [per step:
            (select, plan, io, assemble, total) µs from ``Retrieval.stats``,
            select = score_us + select_us], "useful_bytes": total}.
        """
        r, L = self.retrievers[name], self.layer[name]
        self.store.verify_checksums = False
        try:
            t0 = time.perf_counter()
            i = 0
            while time.perf_counter() - t0 < self.cfg.warmup_s:
                r.retrieve(L, queries[i % len(queries)], torch=False, out=bufs)
                i += 1
            parts, useful = [], 0
            t0 = time.perf_counter()
            while len(parts) < len(queries) or time.perf_counter() - t0 < self.cfg.block_s:
                s = r.retrieve(L, queries[len(parts) % len(queries)], torch=False,
                               out=bufs).stats
                parts.append((s.score_us + s.select_us, s.plan_us, s.io_us, s.assemble_us,
                              s.total_us))
                useful += (s.entries - s.entries_dram) * ENTRY_BYTES
            blk = time.perf_counter() - t0
        finally:
            self.store.verify_checksums = True
        return {"step_us": blk / len(parts) * 1e6, "steps": parts, "useful_bytes": useful,
                "block_s": blk}


STEP_PARTS = ("select_us", "plan_us", "io_us", "assemble_us", "total_us")


def stream_steps(benches: dict, names, positions, reps: int, *, seed: int = 0,
                 progress: str = "") -> dict:
    """Whole decode steps of every variant on every device profile, side by side.

    ``benches`` is ``{profile: Bench}`` (the same variants on each profile's
    disks).  In each repetition every (profile, variant) pair runs one
    :meth:`Bench.step_block`, the pairs in a fresh random order, so slow
    phases of the shared machine hit every method and profile alike.

    Returns:
        {profile: {variant: summary}}: ``step_us_median`` (median over
        repetitions of block time / steps: the wall time of a serial decode
        step), ``step_us_reps``, the medians over all timed steps of
        ``select_us`` (score + choice), ``plan_us``, ``io_us``,
        ``assemble_us``, ``total_us`` (``Retrieval.stats``), ``cpu_us_median``
        (median per-step select + plan + assemble), ``eff_gbps_median``
        (useful SSD bytes / block time) and the step counts.
    """
    rng = np.random.default_rng(seed)
    qs = {p: {n: b.step_queries(positions) for n in names} for p, b in benches.items()}
    bufs = {p: {n: b.step_buffers(n, qs[p][n]) for n in names} for p, b in benches.items()}
    raw = {p: {n: [] for n in names} for p in benches}
    pairs = [(p, n) for p in benches for n in names]
    t_all = time.perf_counter()
    for rep in range(reps):
        for i in rng.permutation(len(pairs)):
            p, n = pairs[i]
            raw[p][n].append(benches[p].step_block(n, qs[p][n], bufs[p][n]))
        if progress:
            print(f"  {progress}: step rep {rep + 1}/{reps}, "
                  f"{time.perf_counter() - t_all:.0f} s", file=sys.stderr, flush=True)
    out = {}
    for p in benches:
        out[p] = {}
        for n in names:
            blocks = raw[p][n]
            steps = np.array([s for b in blocks for s in b["steps"]], np.float64)
            x = {"step_us_median": float(np.median([b["step_us"] for b in blocks])),
                 "step_us_reps": [b["step_us"] for b in blocks],
                 "eff_gbps_median": float(np.median([b["useful_bytes"] / b["block_s"] / 1e9
                                                     for b in blocks])),
                 "timed_steps": int(steps.shape[0]), "reps": len(blocks)}
            for j, k in enumerate(STEP_PARTS):
                x[f"{k}_median"] = float(np.median(steps[:, j]))
            x["cpu_us_median"] = float(np.median(steps[:, 0] + steps[:, 1] + steps[:, 3]))
            x["parts_sum_us_median"] = float(np.median(steps[:, :4].sum(axis=1)))
            out[p][n] = x
    return out
