"""Shared machinery of the evaluation benchmarks (SWARM §8): traces, layouts,
stores, timed retrieval, accuracy, JSON and plots.

**Trace.**  One real activation trace drives every figure: all-MiniLM-L6-v2
run over the three texts of ``../shared/data`` (read in place, never copied):
WikiText-2 test (273,178 MiniLM tokens), Tiny Shakespeare (288,719) and GSM8K
test (211,635), tokenised separately (no special tokens) and concatenated in
that order (773,532 tokens).  Longer contexts repeat that sequence (SWARM
§8.1: "when a single sequence is insufficient, we concatenate multiple
samples").  The model runs in its native 512-token windows over the whole
token sequence (``layout._capture``); because 773,532 is not a multiple of 512
the second pass falls on other window boundaries (shifted by 412 tokens), so
its K/V/Q are new model outputs, not copies of the first pass.  We keep layer
2 of 6 (post-projection Q, K, V, 12 heads x 32, fp16).  Only layers 0-2 are
computed (a copy of the model config with ``num_hidden_layers = 3``; layer 2
sees exactly the same inputs as in the 6-layer model, which
``tests/test_bench_smoke.py`` checks bit for bit).

**Stretching to Qwen3-32B entries.**  An entry of the store is one token's K
and V with the size of a Qwen3-32B entry (8 KV heads x 128 x fp16 x 2 = 4 KiB
per token per layer), stored as 16 heads x 64: MiniLM head h (32 values) is
store head h, zero-padded to 64; heads 12-15 are zeros.  Queries are padded
the same way and multiplied by MiniLM's logit scale over the store's
(sqrt(64 / 32)), so every dot product is MiniLM's up to that factor, and
every score, selection and attention weight is MiniLM's, including SWARM's
per-head softmax medoid score (padded heads add the same constant to every
cluster).  Every byte moved, every index vector (2 KiB per key, as a
Qwen3-32B key) and every GEMV is Qwen3-32B-sized.  The access pattern per
decode step is therefore a real one (real queries against real keys of a
real context), the I/O is that of a 4 KiB-entry model.

**Contexts and held-out queries.**  A context of S tokens is a slice
``[start, start + S)`` of the trace (``start`` = the beginning of a dataset's
first pass, default WikiText-2).  Decode-step queries are held out: positions
``start + S + 8 i`` (never profiled), each attending to the S context tokens.

**Harness.**  Every figure is a click command made by :func:`command` (or
:func:`ablation_command`): the options all figures share become one frozen
:class:`BenchConfig` passed down explicitly (no module state); its own options
follow.  Run them as ``python -m tools.bench.<figure>`` from the repository
root.  Layouts are memoised with ``joblib.Memory`` (:func:`build_layout`),
tables are printed with tabulate (:func:`table`), and figures are drawn with
:func:`figure`, :func:`lines` and :func:`variant_bars`.

Not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import shutil
import statistics
import sys
import time

import click
import numpy as np

from tools import _options as O
from tools import _testbed
from tools._shared_data import data_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
DATA = data_dir()
#: dataset name -> file in ../shared/data, in trace order
DATASETS = {"wikitext2": "wikitext2_raw_test.raw",
            "shakespeare": "tinyshakespeare_input.txt",
            "gsm8k": "gsm8k_test.jsonl"}
CACHE = pathlib.Path(os.environ.get("SWARMFS_EVAL_CACHE", "/var/tmp/swarmfs-eval"))
OUT = REPO / "bench-out" / "eval"

#: MiniLM layer kept in the trace (0-based, of 6)
TRACE_LAYER = 2
#: MiniLM's attention shape (all-MiniLM-L6-v2: 12 heads x 32, no GQA)
MINI_HEADS, MINI_DIM = 12, 32
#: store entry shape: 16 heads x 64 x fp16 x (K, V) = 4 KiB per token per layer,
#: the size of a Qwen3-32B entry (8 KV heads x 128); 16 x 64 lets every MiniLM
#: head be its own store head (the medoid score is a per-head softmax)
WIDE_HEADS, WIDE_DIM = 16, 64
ENTRY_BYTES = 2 * WIDE_HEADS * WIDE_DIM * 2
QUERY_STRIDE = 8            # held-out decode positions start + S + 8 i
#: a timed block of replayed steps lasts at least this long (s); see Bench.stream
BLOCK_S = 2.5
#: untimed replay before each block (s): drains the throttle's burst credit
WARMUP_S = 0.3


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What a figure's command line chose (one per run; every figure takes
    these options, see :func:`command`).

    Attributes:
        name: the figure's module, e.g. ``"fig11_methods"`` (output name).
        disks: ``testbed`` | ``testbed:NAME`` | ``files:N`` | comma list of paths.
        out: output prefix (``.json``, ``.png``); None: ``bench-out/eval/NAME``.
        smoke: tiny sizes on file disks (CI): checks the harness only.
        queries, reps: held-out queries per point and timed repetitions
            (None: the figure's default).
        qd: engine queue depth (SQEs per ring).
        cache: trace, layout (joblib) and store directory.
        trace_tokens: tokens to capture at least (None: what the figure needs).
        block_s: seconds per timed block (see :meth:`Bench.stream`).
        warmup_s: untimed replay before a block (s).
        command: the command line, recorded in the JSON.
    """
    name: str
    disks: str = "testbed"
    out: pathlib.Path | None = None
    smoke: bool = False
    queries: int | None = None
    reps: int | None = None
    qd: int = 128
    cache: pathlib.Path = CACHE
    trace_tokens: int | None = None
    block_s: float = BLOCK_S
    warmup_s: float = WARMUP_S
    command: str = ""

    def prefix(self, name: str | None = None) -> pathlib.Path:
        """The output prefix of ``name`` (default this figure's)."""
        if self.out is not None:
            return pathlib.Path(self.out)
        return OUT / ((name or self.name) + ("-smoke" if self.smoke else ""))


# -- trace ---------------------------------------------------------------------

def _sha(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
    return h.hexdigest()[:12]


def truncated_model(layers: int, cache: pathlib.Path | None = None) -> pathlib.Path:
    """A copy of all-MiniLM-L6-v2's directory whose config keeps only the first
    ``layers`` layers (weights and tokenizer are symlinks to the package's)."""
    from swarmfs.layout._capture import default_model_path
    src = default_model_path()
    dst = (cache or CACHE) / f"all-MiniLM-L6-v2-first{layers}"
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = int(layers)
    if not (dst / "config.json").is_file() or \
            json.loads((dst / "config.json").read_text()) != cfg:
        dst.mkdir(parents=True, exist_ok=True)
        for p in src.iterdir():
            if p.name != "config.json" and not (dst / p.name).exists():
                (dst / p.name).symlink_to(p)
        tmp = dst / "config.json.tmp"
        tmp.write_text(json.dumps(cfg, indent=2))
        tmp.replace(dst / "config.json")
    return dst


def trace_tokens(num_tokens: int) -> tuple[np.ndarray, dict]:
    """Token ids of the trace: the datasets in ``DATASETS`` order, repeated.

    Returns:
        (int64 [num_tokens] ids, {dataset: [start, length] of its first pass}).
    """
    from swarmfs.layout._capture import default_model_path, read_text
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    parts, segments, off = [], {}, 0
    for name, fname in DATASETS.items():
        ids = tok(read_text(DATA / fname), add_special_tokens=False,
                  verbose=False)["input_ids"]
        parts.append(np.asarray(ids, np.int64))
        segments[name] = [off, len(ids)]
        off += len(ids)
    one = np.concatenate(parts)
    reps = -(-int(num_tokens) // one.shape[0])
    return np.tile(one, reps)[:num_tokens], segments


@dataclasses.dataclass
class Trace:
    """The captured trace (one MiniLM layer) and where each dataset starts.

    Attributes:
        q, k, v: [H, T, d] fp16 arrays (12 x T x 32) of the kept layer.
        scaling: softmax scale of the logits.
        segments: {dataset: (start, length)} of each dataset's first pass.
        meta: the capture's metadata plus the trace recipe.
        path: the cached file.
    """
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scaling: float
    segments: dict
    meta: dict
    path: pathlib.Path

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    def start(self, dataset: str) -> int:
        return int(self.segments[dataset][0])


def load_trace(num_tokens: int, *, cache: pathlib.Path | None = None,
               progress: bool = True) -> Trace:
    """The trace of ``num_tokens`` tokens, captured once and cached.

    A longer cached trace is reused (its prefix is the same trace: capture
    windows start at 0).
    """
    from swarmfs.layout._capture import capture, load_capture, save_capture
    cache = cache or CACHE
    cache.mkdir(parents=True, exist_ok=True)
    best = None
    for p in cache.glob(f"trace-minilm-L{TRACE_LAYER}-*.safetensors"):
        n = int(p.stem.rsplit("-", 1)[1])
        if n >= num_tokens and (best is None or n < best[0]):
            best = (n, p)
    if best is None:
        ids, segments = trace_tokens(num_tokens)
        t0 = time.perf_counter()
        cap = capture(truncated_model(TRACE_LAYER + 1, cache), token_ids=ids,
                      layers=[TRACE_LAYER], dtype="float16", progress=progress,
                      text_source="+".join(DATASETS) + " (../shared/data), repeated")
        meta = dict(cap.meta, segments=segments, capture_s=time.perf_counter() - t0,
                    model="sentence-transformers/all-MiniLM-L6-v2",
                    trace="datasets concatenated in order, repeated; layers 0-2 run")
        cap = dataclasses.replace(cap, meta=meta)
        path = cache / f"trace-minilm-L{TRACE_LAYER}-{num_tokens}.safetensors"
        save_capture(path, cap)
        best = (num_tokens, path)
    cap = load_capture(best[1])
    meta = dict(cap.meta)
    return Trace(q=cap.q[0], k=cap.k[0], v=cap.v[0], scaling=cap.scaling,
                 segments={k: tuple(v) for k, v in meta["segments"].items()},
                 meta=meta, path=best[1])


def context(trace: Trace, S: int, dataset: str = "wikitext2") -> tuple[int, int]:
    """(start, S) of a context of S tokens that begins with ``dataset``.

    Raises:
        SystemExit: the trace is too short for the context plus its queries.
    """
    start = trace.start(dataset)
    if start + S + QUERY_STRIDE * 2 > trace.num_tokens:
        raise SystemExit(f"trace has {trace.num_tokens} tokens; a {S}-token context of "
                         f"{dataset} needs {start + S + 2 * QUERY_STRIDE}")
    return start, int(S)


def query_positions(trace: Trace, start: int, S: int, n: int) -> np.ndarray:
    """Held-out decode positions after a context (never profiled)."""
    pos = start + S + QUERY_STRIDE * np.arange(n)
    return pos[pos < trace.num_tokens]


# -- Qwen3-32B-sized entries ----------------------------------------------------

def widen_flat(x: np.ndarray, dtype=np.float16) -> np.ndarray:
    """[..., 384] (MiniLM's 12 heads x 32, head-major) -> [..., 1024]: head h
    in slots [64 h, 64 h + 32) of the store's 16 x 64, zeros elsewhere."""
    lead = x.shape[:-1]
    out = np.zeros(lead + (WIDE_HEADS, WIDE_DIM), dtype)
    out[..., :MINI_HEADS, :MINI_DIM] = np.asarray(x).reshape(lead + (MINI_HEADS, MINI_DIM))
    return out.reshape(lead + (WIDE_HEADS * WIDE_DIM,))


def widen_kv(k: np.ndarray, v: np.ndarray, *, path=None) -> np.ndarray:
    """K, V [12, S, 32] -> store entries [S, 2, 16, 64] fp16: MiniLM head h
    is store head h (first 32 values), heads 12-15 and the rest are zeros.

    With ``path`` the array is a file-backed memmap (large contexts: 4 GiB at
    1M tokens), else in memory.
    """
    H, S, d = k.shape
    shape = (S, 2, WIDE_HEADS, WIDE_DIM)
    if path is None:
        out = np.zeros(shape, np.float16)
    else:
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=shape)
    step = 1 << 16
    for a in range(0, S, step):
        b = min(a + step, S)
        out[a:b, 0, :H, :d] = k[:, a:b].transpose(1, 0, 2)
        out[a:b, 1, :H, :d] = v[:, a:b].transpose(1, 0, 2)
    return out


def widen_q(q: np.ndarray, scaling: float) -> np.ndarray:
    """MiniLM query [12, 32] (or a batch [B, 12, 32]) -> [.., 16, 64] float32,
    times scaling / 64**-0.5: the store's per-head softmax scale is
    head_dim**-0.5, so the medoid "prob" score sees MiniLM's scaled logits;
    dot-product rankings do not change with the factor."""
    q = np.asarray(q, np.float32)
    lead = q.shape[:-2]
    out = np.zeros(lead + (WIDE_HEADS, WIDE_DIM), np.float32)
    out[..., :q.shape[-2], :q.shape[-1]] = q * np.float32(scaling / WIDE_DIM ** -0.5)
    return out


def narrow(x, H: int, d: int) -> np.ndarray:
    """Retrieved K or V [16, n, 64] -> MiniLM's [H, n, d]."""
    return np.asarray(x)[:H, :, :d]


# -- layouts (cached) -------------------------------------------------------------

def _source_hash() -> str:
    """Hash of the layout code, so cached layouts follow code changes."""
    files = sorted((REPO / "layout").glob("*.py"))
    return _sha(*(p.read_bytes() for p in files))


def _layout_cache(cache: pathlib.Path):
    """The layout builder memoised on disk (``joblib.Memory`` under
    ``CACHE/joblib``), keyed by its arguments except the trace itself (the
    trace file's name stands for it)."""
    import joblib
    return joblib.Memory(pathlib.Path(cache) / "joblib", verbose=0).cache(
        _build_layout, ignore=["trace", "cache"])


def build_layout(method: str, trace: Trace, start: int, S: int, *, cache: pathlib.Path,
                 ratio: float = 0.1, profile_start: int | None = None, **kw):
    """One method's layout of the context [start, start+S), cached on disk.

    Args:
        method: one of ``layout._baselines.METHODS``.
        cache: the cache directory (``BenchConfig.cache``).
        ratio: profile sparsity ratio (SWARM-style methods).
        profile_start: start of another S-token slice of the trace whose
            queries profile this context (dataset shift, §8.4).
        **kw: the method's parameters (e.g. ``tau``, ``block``).

    Returns:
        (:class:`swarmfs.layout._baselines.Layout`, cache hit: bool).
    """
    build = _layout_cache(cache)
    args = dict(method=method, trace=trace, trace_id=trace.path.name, start=int(start),
                S=int(S), ratio=float(ratio), profile_start=profile_start,
                params=json.dumps(kw, sort_keys=True), source=_source_hash(), cache=cache)
    hit = build.check_call_in_cache(**args)
    return build(**args), hit


def _build_layout(method, trace, trace_id, start, S, ratio, profile_start, params, source,
                  cache):
    """The uncached build behind :func:`build_layout` (``trace_id`` and
    ``source`` only key the cache)."""
    from swarmfs.layout import _baselines as B
    kw = json.loads(params)
    k = trace.k[:, start:start + S]
    q = trace.q[:, start:start + S]
    pq = None if profile_start is None else trace.q[:, profile_start:profile_start + S]
    common = {"ratio": ratio, "scaling": trace.scaling, "profile_q": pq}
    seg = kw.pop("segment", None)
    if seg and S > seg:
        return _segmented(method, trace, start, S, int(seg), ratio, cache, kw)
    if method == "swarm":
        return B.swarm(q, k, **common, **kw)
    if method == "no_replica":
        return B.no_replica(q, k, **common, **kw)
    if method == "medoid_only":
        return B.medoid_only(q, k, **common, **kw)
    if method == "no_cluster":
        return B.token_order(S, **kw)
    if method == "quest":
        return B.quest_pages(k, **kw)
    if method == "infllm":
        return B.infllm_blocks(q, k, **kw)
    if method == "pqcache":
        return B.kmeans_clusters(k, **kw)
    raise SystemExit(f"unknown method {method!r}")


def _segmented(method, trace, start, S, seg, ratio, cache, kw):
    """A co-activation layout of a long context built segment by segment: each
    ``seg``-token segment is profiled with its own queries (which see the
    segment's keys only) and clustered on its own; the cluster tables are
    concatenated (members shifted to context positions).  Used beyond 256K
    tokens, where one profile + Algorithm 1 over the whole context outgrows
    this machine (256K: 186 s and 8 GB; the neighbour graph grows faster
    than S)."""
    from swarmfs.layout import _baselines as B
    parts = [build_layout(method, trace, start + a, min(seg, S - a), ratio=ratio,
                          cache=cache, **kw)[0] for a in range(0, S, seg)]
    ptr, members, meds, freq, off = [np.zeros(1, np.int64)], [], [], [], 0
    for a, lay in zip(range(0, S, seg), parts):
        ptr.append(lay.ptr[1:] + off)
        off += lay.members.shape[0]
        members.append(lay.members + a)
        meds.append(lay.medoids + a)
        freq.append(lay.freq)
    return B.Layout(name=method, ptr=np.concatenate(ptr), members=np.concatenate(members),
                    medoids=np.concatenate(meds), kind=parts[0].kind, index={},
                    freq=np.concatenate(freq),
                    params=dict(parts[0].params, segment=seg, segments=len(parts)),
                    seconds=sum(p.seconds for p in parts))


# -- disks and stores -------------------------------------------------------------

@dataclasses.dataclass
class Disks:
    """Where the stores go.

    Attributes:
        paths: device or file paths (None: ``files`` file disks in the store dir).
        files: number of file disks when ``paths`` is None.
        testbed: the testbed state (profile, limits, cgroup) or None.
    """
    paths: list | None
    files: int = 0
    testbed: dict | None = None

    @property
    def count(self) -> int:
        return len(self.paths) if self.paths is not None else self.files

    def first(self, n: int) -> Disks:
        if n > self.count:
            raise SystemExit(f"{n} disks wanted, {self.count} available")
        if self.paths is None:
            return Disks(None, n, self.testbed)
        return Disks(self.paths[:n], 0, self.testbed)

    def spec(self):
        return self.paths if self.paths is not None else self.files

    def describe(self) -> dict:
        tb = self.testbed or {}
        return {"kind": "testbed" if self.testbed else "files", "count": self.count,
                "paths": self.paths, "testbed": tb.get("name"),
                "profile": tb.get("profile"), "scale": tb.get("scale"),
                "limits_per_device": tb.get("limits")}


def resolve_disks(spec: str) -> Disks:
    """``testbed`` / ``testbed:NAME`` (devices of an up testbed), ``files:N``
    (N file disks inside each store directory) or a comma list of paths."""
    if spec.startswith("testbed"):
        name = spec.split(":", 1)[1] if ":" in spec else _testbed.DEFAULT_NAME
        st = _testbed.load_state(name)
        if not st or not st.get("complete"):
            raise SystemExit(f"testbed {name!r} is not up: run tools/testbed up first "
                             f"(or pass --disks files:N)")
        return Disks(list(st["devices"]), 0, st)
    if spec.startswith("files:"):
        return Disks(None, int(spec.split(":", 1)[1]))
    return Disks([p for p in spec.split(",") if p])


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
        from swarmfs._demo import LayoutParams, local_window
        self.trace, self.start, self.S, self.ratio = trace, start, S, ratio
        self.cfg = cfg
        self.variants = {v.name: v for v in variants}
        owners = [v for v in variants if v.store_as is None]
        path = pathlib.Path(path)
        if path.exists():
            shutil.rmtree(path)
        t0 = time.perf_counter()
        self.store = Store.create(path, disks=disks.spec(), num_layers=len(owners),
                                  num_kv_heads=WIDE_HEADS, head_dim=WIDE_DIM,
                                  num_query_heads=WIDE_HEADS, dtype="float16",
                                  model_name="all-MiniLM-L6-v2 KV in 4 KiB entries",
                                  force=True, queue_depth=cfg.qd, verify=True)
        tmp = None
        if kv is None:
            if S * ENTRY_BYTES > (1 << 30):
                tmp = path.parent / f"{path.name}-kv.npy"
            kv = widen_kv(trace.k[:, start:start + S], trace.v[:, start:start + S], path=tmp)
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
        from swarmfs._selectors import (
            BoundSelector,
            MultiVectorSelector,
            TokenSelector,
            VectorSelector,
        )
        lay, L = v.layout, self.layer[v.name]
        sel = None
        if lay.kind == "tokens":
            sel = TokenSelector({L: np.ascontiguousarray(self.k_flat)})
        elif lay.kind == "vectors":
            sel = VectorSelector({L: widen_flat(lay.index["vectors"])}, name=v.name)
        elif lay.kind == "multivector":
            sel = MultiVectorSelector({L: widen_flat(lay.index["reps"])}, name=v.name)
        elif lay.kind == "bounds":
            sel = BoundSelector({L: (widen_flat(lay.index["lo"], np.float32),
                                     widen_flat(lay.index["hi"], np.float32))})
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
        qw = widen_q(self.trace.q[:, pos].transpose(1, 0, 2), self.trace.scaling)
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
        from swarmfs._report import attention_logits, evaluate_query, token_mass
        tr = self.trace
        H, d = tr.k.shape[0], tr.k.shape[2]
        a, S = self.start, self.S
        r0 = evaluate_query(tr.q[:, pos[0]], tr.k[:, a:a + S], tr.v[:, a:a + S],
                            ret.positions, k_ret=narrow(ret.k, H, d),
                            v_ret=narrow(ret.v, H, d), scaling=tr.scaling, ratio=self.ratio)
        mass = token_mass(attention_logits(tr.q[:, pos[0]][:, None, :], tr.k[:, a:a + S],
                                           tr.scaling))[0]
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
        return t, max(x.busy_us - y.busy_us for x, y in zip(a, b)) / 1e6

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
        """Widened held-out queries [16, 64] float32, one per position."""
        return [widen_q(self.trace.q[:, int(p)], self.trace.scaling) for p in positions]

    def step_buffers(self, name: str, queries) -> tuple:
        """Reusable K/V outputs for ``Retriever.retrieve(out=...)``, sized by
        one untimed pass over the queries (the largest step's entries)."""
        r, L = self.retrievers[name], self.layer[name]
        n = max(int(r.retrieve(L, q, torch=False).positions.shape[0]) for q in queries)
        shape = (WIDE_HEADS, n, WIDE_DIM)
        return np.zeros(shape, np.float16), np.zeros(shape, np.float16)

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


# -- summarising ------------------------------------------------------------------------

def median(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(statistics.median(vals)) if vals else None


def mean(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else None


STEP_KEYS = ("score_us", "select_us", "plan_us", "io_us_live", "bytes_read", "useful_bytes",
             "needed_bytes",
             "requests", "mean_request_kib", "max_mean_load", "entries", "entries_dram",
             "useful_entries", "clusters")
ACC_KEYS = ("recall", "rel_error", "oracle_rel_error", "mass", "oracle_mass")


def summarize(rec: list, timed: dict) -> dict:
    """Per variant: medians of the recorded steps' counts and selection
    times, means of their accuracy, and the streamed I/O time per step and
    effective bandwidth (median over repetitions of the block values)."""
    out = {f"{k}_median": median(rec, k) for k in STEP_KEYS}
    out["io_us_median"] = float(statistics.median(timed["io_us"]))
    out["io_us_reps"] = timed["io_us"]
    out["engine_us_median"] = float(statistics.median(timed["engine_us"]))
    out["eff_gbps_median"] = float(statistics.median(timed["eff_gbps"]))
    out["read_gbps_median"] = float(statistics.median(timed["read_gbps"]))
    out["goodput_gbps_median"] = (float(statistics.median(timed["goodput_gbps"]))
                                  if timed["goodput_gbps"] else None)
    out["step_us_median"] = float(statistics.median(timed["step_us"]))
    out["step_us_p90"] = float(np.percentile(timed["step_us"], 90))
    out["steps"] = len(rec)
    out["reps"] = len(timed["io_us"])
    if rec and "recall" in rec[0]:
        for k in ACC_KEYS:
            out[f"{k}_mean"] = mean(rec, k)
    return out


# -- the fio ceiling ----------------------------------------------------------------

def fio_ceiling(disks: Disks, *, bs="128k", qd: int = 32, runtime_s: float = 3) -> dict | None:
    """fio randread on all devices at once inside the testbed's cgroup
    (``tools/_testbed.ceiling``); None for file disks (smoke runs)."""
    if disks.testbed is None or disks.paths is None:
        return None
    r = _testbed.ceiling(disks.paths, bs, qd, runtime_s=runtime_s,
                         cgroup=disks.testbed["cgroup"]["path"])
    return {k: r[k] for k in ("bs", "qd", "ndevices", "gb_per_s", "iops", "limit_gb_per_s",
                              "fraction_of_limit", "split")}


def ceilings(disks: Disks, smoke: bool) -> dict:
    """The bandwidth (128 KiB) and IOPS (4 KiB) ceilings, qd 32 per device."""
    if smoke or disks.testbed is None:
        return {}
    return {"bw_128k": fio_ceiling(disks, bs="128k"), "iops_4k": fio_ceiling(disks, bs="4k")}


# -- CLI, output -----------------------------------------------------------------------

def _options(disks: str) -> list:
    """The click options every figure takes (fields of :class:`BenchConfig`)."""
    return [
        click.Option(["--disks"], type=O.DiskSpec(), default=disks, show_default=True,
                     help="testbed | testbed:NAME | files:N | comma list of devices/files"),
        click.Option(["--out"], type=O.OutPath(prefix=True, path=True), default=None,
                     help="output prefix (.json, .png)"),
        click.Option(["--smoke"], is_flag=True,
                     help="tiny sizes on file disks (CI): checks the harness, not performance"),
        click.Option(["--queries"], type=O.COUNT, default=None, help="held-out queries per point"),
        click.Option(["--reps"], type=O.COUNT, default=None, help="timed repetitions per query"),
        click.Option(["--qd"], type=O.QUEUE_DEPTH, default=128, show_default=True,
                     help="engine queue depth"),
        click.Option(["--cache"], type=click.Path(path_type=pathlib.Path), default=CACHE,
                     show_default=True, help="trace/layout cache and store directories"),
        click.Option(["--trace-tokens"], type=O.COUNT, default=None,
                     help="tokens to capture (default: what the figure needs)"),
        click.Option(["--block-s"], type=O.NONNEG_FLOAT, default=None,
                     help=f"seconds per timed block (default {BLOCK_S}; smoke 0)"),
        click.Option(["--warmup-s"], type=O.NONNEG_FLOAT, default=None,
                     help=f"untimed replay before a block (default {WARMUP_S}; smoke 0)"),
    ]


_SHARED = ("disks", "out", "smoke", "queries", "reps", "qd", "cache", "trace_tokens",
           "block_s", "warmup_s")


def _help(doc: str) -> str:
    """A module docstring as click help: indented command examples kept as
    they are (click's ``\\b`` marker), the rest re-wrapped."""
    paras = doc.strip().split("\n\n")
    return "\n\n".join("\b\n" + p if p.startswith("    ") else p for p in paras)


def command(name: str, doc: str, *, disks: str = "testbed"):
    """Make ``f(cfg, **options)`` a figure's click command.

    The command takes the options every figure takes (``--disks --out
    --smoke --queries --reps --qd --cache --trace-tokens --block-s
    --warmup-s``), frozen into a :class:`BenchConfig` passed as ``cfg``, plus
    the figure's own ``@click.option``\\ s (written below this decorator),
    passed by name.  Run it with :func:`run`.
    """
    def deco(f):
        own = list(reversed(getattr(f, "__click_params__", [])))

        def callback(**kw):
            shared = {k: kw.pop(k) for k in _SHARED}
            argv = click.get_current_context().obj or []
            smoke = shared["smoke"]
            for k, default in (("block_s", BLOCK_S), ("warmup_s", WARMUP_S)):
                if shared[k] is None:
                    shared[k] = 0.0 if smoke else default
            cfg = BenchConfig(name=name, command=" ".join(
                [f"python -m tools.bench.{name}"] + list(argv)), **shared)
            return f(cfg, **kw)

        return click.Command(name, callback=callback, params=_options(disks) + own,
                             help=_help(doc))
    return deco


def run(cmd: click.Command, argv=None):
    """Run a figure's command: from the shell (``argv`` None) as a program
    that exits; with ``argv`` (tests, run_all) it returns the payload and
    raises instead of exiting."""
    args = list(sys.argv[1:] if argv is None else argv)
    prog = f"python -m tools.bench.{cmd.name}"
    if argv is None:
        return cmd.main(args=args, prog_name=prog, obj=args)
    return cmd.main(args=args, prog_name=prog, obj=args, standalone_mode=False)


def setup(cfg: BenchConfig, name: str, *, trace_tokens: int
          ) -> tuple[Trace, Disks, pathlib.Path]:
    """Load the trace, resolve the disks (file disks for a smoke run that
    names the testbed), pick the output prefix of ``name``."""
    out = cfg.prefix(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tr = load_trace(max(cfg.trace_tokens or 0, trace_tokens), cache=cfg.cache,
                    progress=not cfg.smoke)
    spec = "files:2" if cfg.smoke and cfg.disks.startswith("testbed") else cfg.disks
    return tr, resolve_disks(spec), out


@dataclasses.dataclass(frozen=True)
class Ablation:
    """What an ablation figure (Figs. 12-14) starts from: its configuration,
    the trace, the disks, the output prefix, one context and the query count."""
    cfg: BenchConfig
    dataset: str
    ratio: float
    trace: Trace
    disks: Disks
    out: pathlib.Path
    start: int
    S: int
    queries: int
    reps: int

    def layout(self, method: str, **kw):
        """The context's layout by ``method`` (:func:`build_layout`; ``kw``:
        its ratio and the method's parameters)."""
        return build_layout(method, self.trace, self.start, self.S, cache=self.cfg.cache,
                            **kw)[0]

    def ceilings(self) -> dict:
        """The fio ceilings of the disks (:func:`ceilings`)."""
        return ceilings(self.disks, self.cfg.smoke)

    def bench(self, store: str, variants) -> "Bench":
        """A :class:`Bench` of ``variants`` over the context, in store ``store``."""
        return Bench(store_dir(self.cfg, store), self.disks, self.trace, self.start, self.S,
                     variants, ratio=self.ratio, cfg=self.cfg)

    def positions(self) -> np.ndarray:
        """The held-out query positions (:func:`query_positions`)."""
        return query_positions(self.trace, self.start, self.S, self.queries)

    @staticmethod
    def report(res: dict, *columns) -> None:
        """A line per variant on stderr: its I/O ms, then each column
        ``(format, key, scale)`` as ``format.format(result[key] / scale)``."""
        for n, r in res.items():
            print(f"  {n:12s} I/O {r['io_us_median'] / 1e3:7.2f} ms, " +
                  ", ".join(fmt.format(r[k] / s) for fmt, k, s in columns), file=sys.stderr)

    def finish(self, figure: str, title: str, ceiling, variants: dict, ratios: dict, plot,
               **extra) -> dict:
        """Write the figure's JSON (``extra`` after the common fields) and plot."""
        payload = {"figure": figure, "title": title, "tokens": self.S,
                   "dataset": self.dataset, "ratio": self.ratio,
                   "disks": self.disks.describe(), "queries": self.queries, "reps": self.reps,
                   "ceiling": ceiling, "variants": variants, "ratios": ratios, **extra}
        return finish(self.cfg, self.out, payload, plot)


def ablation_command(name: str, doc: str):
    """:func:`command` for an ablation figure: also ``--tokens``,
    ``--dataset``, ``--ratio``; the function gets an :class:`Ablation` with
    one loaded context: 128K tokens of WikiText-2, 24 held-out queries and 3
    repetitions by default; 2K, 3 and 1 with ``--smoke``."""
    def deco(f):
        @click.option("--ratio", type=O.RATIO, default=0.1, show_default=True)
        @click.option("--dataset", type=click.Choice(list(DATASETS)), default="wikitext2",
                      show_default=True)
        @click.option("--tokens", type=O.COUNT, default=None, help="context length S")
        def body(cfg, tokens, dataset, ratio):
            S = tokens or (2048 if cfg.smoke else 131072)
            trace, disks, out = setup(cfg, name, trace_tokens=4096 if cfg.smoke else 0)
            start, S = context(trace, S, dataset)
            return f(Ablation(cfg, dataset, ratio, trace, disks, out, start, S,
                              queries=cfg.queries or (3 if cfg.smoke else 24),
                              reps=cfg.reps or (1 if cfg.smoke else 3)))
        return command(name, doc)(body)
    return deco


def store_dir(cfg: BenchConfig, name: str) -> pathlib.Path:
    d = cfg.cache / "stores" / name
    d.parent.mkdir(parents=True, exist_ok=True)
    return d


def machine() -> dict:
    return {"cpus": os.cpu_count(), "kernel": platform.release(),
            "loadavg_at_start": os.getloadavg(), "python": platform.python_version(),
            "mem_available_gib": _meminfo("MemAvailable") / 2**30}


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def finish(cfg: BenchConfig, out: pathlib.Path, payload: dict, plot) -> dict:
    """A figure's last step: write its JSON (:func:`write_json`), draw it with
    ``plot(payload, out)`` and return the payload."""
    write_json(cfg, out, payload)
    plot(payload, out)
    return payload


def write_json(cfg: BenchConfig, out: pathlib.Path, payload: dict) -> pathlib.Path:
    """The figure's JSON with the command line, the machine, the streaming
    settings and the trace recipe added."""
    payload = dict(payload)
    payload.setdefault("command", cfg.command or " ".join(sys.argv))
    payload.setdefault("machine", machine())
    payload.setdefault("stream", {"block_s": cfg.block_s, "warmup_s": cfg.warmup_s})
    payload.setdefault("trace_recipe", __doc__.split("**Trace.**")[1].split("**Contexts")[0]
                       .strip().replace("\n", " "))
    p = out.with_suffix(".json")
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_json_default))
    tmp.replace(p)
    print(f"wrote {p}", file=sys.stderr)
    return p


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, pathlib.Path):
        return str(x)
    raise TypeError(type(x))


# -- tables and plots ------------------------------------------------------------------

def table(rows, headers, *, markdown: bool = False, align=None) -> str:
    """Rows as a table (``tabulate``): GitHub Markdown (``markdown=True``,
    the summary of docs/benchmarks.md §7) or plain columns (progress on
    stderr).  Cells are written as given (format numbers before)."""
    from tabulate import tabulate
    return tabulate(rows, headers, tablefmt="pipe" if markdown else "simple",
                    colalign=align, disable_numparse=True)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_fig(fig, out: pathlib.Path) -> pathlib.Path:
    p = out.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(p, dpi=100)
    print(f"wrote {p}", file=sys.stderr)
    return p


@contextlib.contextmanager
def figure(out: pathlib.Path, panels: int, size: tuple, title: str, *, grid: str | None = "both",
           legend: float | None = None):
    """One figure of ``panels`` side by side: yields the axes (a list); on
    exit every panel gets a light grid (``grid``: ``"both"``, ``"y"`` or
    None) and a legend of font size ``legend`` (None: none), the figure its
    title, and it is saved as ``out.png``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False)
    axes = list(axes[0])
    yield axes
    for ax in axes:
        if grid:
            ax.grid(axis=grid, alpha=.3)
        if legend:
            ax.legend(fontsize=legend)
    fig.suptitle(title, fontsize=11)
    save_fig(fig, out)


def lines(ax, x, series: dict, style: str = "o-", *, scale: float = 1.0):
    """One line per label: ``series`` is ``{label: y values}`` over ``x``
    (each y divided by ``scale``, e.g. 1e3 for µs to ms)."""
    for label, ys in series.items():
        ax.plot(x, [y / scale for y in ys], style, label=label)


def variant_bars(p: dict, out: pathlib.Path, labels: dict, panels, title: str,
                 size=(12, 3.8), *, tick_size: float | None = None):
    """The ablation figures (12-14): one bar panel per measure over the
    variants of ``p["variants"]``.  ``panels`` is ``[(key, scale, title,
    ceiling)]``: the variant's ``key`` divided by ``scale``, with the fio
    ceiling lines of ``p["ceiling"]`` when ``ceiling``."""
    names = list(p["variants"])
    lab = [labels.get(n, n) for n in names]
    with figure(out, len(panels), size, title, grid="y") as axes:
        for i, (ax, (key, scale, sub, ceil)) in enumerate(zip(axes, panels)):
            ax.bar(lab, [p["variants"][n][key] / scale for n in names], color=f"C{i}")
            if ceil:
                ceiling_lines(ax, p["ceiling"])
                if p["ceiling"]:
                    ax.legend(fontsize=7)
            ax.set_title(sub, fontsize=10)
            if tick_size:
                ax.tick_params(axis="x", labelsize=tick_size)


def bar_plot(labels: dict, panels, title: str, **kw):
    """The ``plot(payload, out)`` of an ablation figure: :func:`variant_bars`
    with ``panels``, titled ``"<title>, S = <tokens>, <N> disks"`` (``kw``:
    its ``size``, ``tick_size``)."""
    def plot(p, out):
        variant_bars(p, out, labels, panels,
                     f"{title}, S = {p['tokens']}, {p['disks']['count']} disks", **kw)
    return plot


def ceiling_lines(ax, ceil: dict, *, unit: float = 1.0):
    """Dashed horizontal lines at the fio ceilings (GB/s)."""
    for key, style, label in (("bw_128k", "--", "fio 128 KiB"), ("iops_4k", ":", "fio 4 KiB")):
        c = (ceil or {}).get(key)
        if c:
            ax.axhline(c["gb_per_s"] * unit, ls=style, color="gray", lw=1,
                       label=f"{label} ceiling {c['gb_per_s']:.2f} GB/s")


@contextlib.contextmanager
def timer(label: str):
    t0 = time.perf_counter()
    yield
    print(f"  {label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
