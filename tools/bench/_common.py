"""Shared machinery of the evaluation benchmarks (SWARM §8): traces, layouts,
stores, timed retrieval, accuracy, JSON and plots.

**Traces.**  One real activation trace drives every figure, chosen with
``--trace`` (a field of :class:`BenchConfig`): ``minilm`` (the default, and
every number in docs/benchmarks.md §7) or ``decoder``.  Both run over the
three texts of ``../shared/data`` (read in place, never copied): WikiText-2
test, Tiny Shakespeare and GSM8K test, tokenised separately with the model's
own tokenizer (no special tokens) and concatenated in that order.  Longer
contexts repeat that sequence (SWARM §8.1: "when a single sequence is
insufficient, we concatenate multiple samples").

**Trace: minilm.**  all-MiniLM-L6-v2 (an encoder with 512 positions):
WikiText-2 273,178 MiniLM tokens, Tiny Shakespeare 288,719, GSM8K 211,635
(773,532 in all).  The model runs in its native 512-token windows over the
whole token sequence (``layout._capture``); because 773,532 is not a multiple
of 512 the second pass falls on other window boundaries (shifted by 412
tokens), so its K/V/Q are new model outputs, not copies of the first pass.
We keep layer 2 of 6 (post-projection Q, K, V, 12 heads x 32, fp16).  Only
layers 0-2 are computed (a copy of the model config with
``num_hidden_layers = 3``; layer 2 sees exactly the same inputs as in the
6-layer model, which ``tests/test_bench_smoke.py`` checks bit for bit).

**Trace: decoder.**  swarm-llama (``swarmfs.models.DEFAULT_DECODER``, the
causal Llama swarmfs ships: 8 query heads over 2 KV heads x 32, RoPE) over the
same texts (371,175 + 374,124 + 237,699 = 982,998 of its tokens), post-RoPE
Q, K, V of one layer, fp16.  It runs causally in consecutive windows of
8,192 tokens (its longest trained context) from token 0; each window is run
together with the next 512 tokens as one causal sequence, whose queries are
the window's decode queries (the K/V/Q of the window itself do not depend on
them: the model is causal).  A context starts at the first window boundary
inside its dataset, so a context of k x 8,192 tokens is k whole causal
windows.  Contexts longer than 8,192 tokens are such windows side by
side, exactly as the MiniLM trace's 512-token windows: positions restart at
0 in every window and no token of one window ever attended to another, so
the context holds no co-activation across window boundaries that the model
computed, and the held-out queries see every window's keys at the same
relative positions as their own window's.  (The queries after a context that
ends on a window boundary come from that window's continuation, RoPE
positions 8,192-8,703: a decode step just past the trained length, within
``max_position_embeddings`` = 32,768, as ``swarmfs demo`` decodes after an
8K prefill.)  The kept layer follows a rule computed
per checkpoint (:func:`decoder_layer`: the layer whose attention mass lies
furthest outside the local window on held-out text); the rule's numbers are
in the trace meta and every figure's JSON (``trace``).  Caches are named by
a hash of ``model.safetensors``, so a new checkpoint is captured anew.

**Stretching to Qwen3-32B entries.**  An entry of the store is one token's K
and V with the size of a Qwen3-32B entry (8 KV heads x 128 x fp16 x 2 = 4 KiB
per token per layer); :class:`Widening` maps a model's heads onto it.
MiniLM: 16 store heads x 64 with one query head each: MiniLM head h (32
values) is store head h, zero-padded to 64; heads 12-15 are zeros.  Decoder:
Qwen3-32B's own shape, 8 KV heads x 128 and 64 query heads (GQA group 8):
decoder KV head h is store KV head h (32 values, zero-padded to 128), decoder
query head j (GQA group j // 4) is store query head 8 (j // 4) + j mod 4,
the other store heads are zeros.  Queries are multiplied by the model's logit
scale over the store's (scaling / head_dim**-0.5 of the store), so every
logit is the model's, and every score, selection and attention weight is the
model's, including SWARM's per-head softmax medoid score (zero query heads
add the same constant to every cluster).  Every byte moved, every index vector
(2 KiB per key, as a Qwen3-32B key) and every GEMV is Qwen3-32B-sized (the
decoder trace also scores 64 query heads, as Qwen3-32B).  The access pattern
per decode step is therefore a real one (real queries against real keys of a
real context), the I/O is that of a 4 KiB-entry model.
``tests/test_bench_widening.py`` checks that every logit and the dense
attention output from the widened arrays are the model's.

**Contexts and held-out queries.**  A context of S tokens is a slice
``[start, start + S)`` of the trace (``start`` = the beginning of a dataset's
first pass, default WikiText-2; for the decoder the first window boundary in
it).  Decode-step queries are held out: positions ``start + S + 8 i`` (never
profiled), each attending to the S context tokens; for the decoder they are
the queries it computed there as the causal continuation of the context's
last window (:meth:`Trace.decode_queries`).

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

#: the traces a figure can run on (``--trace``; see the module docstring)
TRACES = ("minilm", "decoder")
#: MiniLM layer kept in the MiniLM trace (0-based, of 6)
TRACE_LAYER = 2
#: the decoder trace's causal window: swarm-llama's longest trained context
DECODER_WINDOW = 8192
#: tokens the decoder runs after each window as its causal continuation; their
#: queries are the held-out decode queries of a context ending with the window
DECODER_TAIL = 512
#: bytes of a store entry (one token's K and V in one layer): a Qwen3-32B
#: entry, 8 KV heads x 128 x fp16 x 2, for both traces (see ``Widening``)
ENTRY_BYTES = 4096
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
        trace: ``"minilm"`` (default) or ``"decoder"``: which trace drives
            the figure (see the module docstring).
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
    trace: str = "minilm"
    command: str = ""

    def prefix(self, name: str | None = None) -> pathlib.Path:
        """The output prefix of ``name`` (default this figure's); ``-decoder``
        is appended for the decoder trace."""
        if self.out is not None:
            return pathlib.Path(self.out)
        return OUT / ((name or self.name) + ("" if self.trace == "minilm" else f"-{self.trace}")
                      + ("-smoke" if self.smoke else ""))


# -- trace ---------------------------------------------------------------------

def _sha(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
    return h.hexdigest()[:12]


def truncated_model(layers: int, cache: pathlib.Path | None = None,
                    src: pathlib.Path | None = None) -> pathlib.Path:
    """A copy of a model directory (default all-MiniLM-L6-v2's) whose config
    keeps only the first ``layers`` layers (weights and tokenizer are symlinks
    to the source's, re-pointed if they point elsewhere, so a changed
    checkpoint is used as it is)."""
    from swarmfs.layout._capture import default_model_path
    src = pathlib.Path(src or default_model_path()).resolve()
    name = "all-MiniLM-L6-v2" if src.name == "model" else src.name
    dst = (cache or CACHE) / f"{name}-{_sha(src)[:8]}-first{layers}"
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = int(layers)
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name == "config.json":
            continue
        link = dst / p.name
        if link.is_symlink() and pathlib.Path(os.readlink(link)) == p:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(p)
    if not (dst / "config.json").is_file() or \
            json.loads((dst / "config.json").read_text()) != cfg:
        tmp = dst / f"config.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(cfg, indent=2))
        tmp.replace(dst / "config.json")
    return dst


def decoder_model() -> pathlib.Path:
    """The decoder of the decoder trace: swarm-llama (``swarmfs.models``)."""
    from swarmfs.models import DEFAULT_DECODER
    return pathlib.Path(DEFAULT_DECODER)


def model_hash(model_dir: pathlib.Path) -> str:
    """First 12 hex digits of the SHA-256 of ``model.safetensors``: names the
    decoder's caches, so a new checkpoint gets a new trace and new layouts."""
    h = hashlib.sha256()
    with open(pathlib.Path(model_dir) / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def trace_tokens(num_tokens: int, model: pathlib.Path | None = None
                 ) -> tuple[np.ndarray, dict]:
    """Token ids of the trace: the datasets in ``DATASETS`` order, repeated.

    Args:
        num_tokens: length of the sequence.
        model: the model directory whose tokenizer to use (default MiniLM's).

    Returns:
        (int64 [num_tokens] ids, {dataset: [start, length] of its first pass}).
    """
    from swarmfs.layout._capture import default_model_path, read_text
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model or default_model_path(), local_files_only=True)
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


# -- Qwen3-32B-sized entries ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Widening:
    """How a traced model's attention heads become Qwen3-32B-sized store entries.

    Model KV head h is store KV head h (its ``head_dim`` values first, zeros
    after); model query head j, of GQA group j // g (g = query_heads /
    kv_heads), is store query head G (j // g) + j mod g (G = store_query_heads
    / store_kv_heads), so it meets its own KV head's keys; every other store
    head is zeros.  Queries are multiplied by scaling / store_head_dim**-0.5,
    so every logit at the store's softmax scale equals the model's.

    Attributes:
        kv_heads, query_heads, head_dim: the model's attention shape.
        store_kv_heads, store_query_heads, store_head_dim: the store's.

    Raises:
        ShapeError: the model's heads do not fit into the store's.
    """
    kv_heads: int
    query_heads: int
    head_dim: int
    store_kv_heads: int
    store_query_heads: int
    store_head_dim: int

    def __post_init__(self):
        from swarmfs._errors import ShapeError
        if (self.query_heads % self.kv_heads or self.store_query_heads % self.store_kv_heads
                or self.kv_heads > self.store_kv_heads or self.head_dim > self.store_head_dim
                or self.query_heads // self.kv_heads >
                self.store_query_heads // self.store_kv_heads):
            raise ShapeError(f"{self}: the model's heads do not fit into the store's")

    @property
    def entry_bytes(self) -> int:
        """Bytes of one stored entry (K and V, fp16)."""
        return 2 * self.store_kv_heads * self.store_head_dim * 2

    def query_slots(self) -> np.ndarray:
        """int64 [query_heads]: the store query head of each model query head."""
        j = np.arange(self.query_heads, dtype=np.int64)
        g = self.query_heads // self.kv_heads
        return (self.store_query_heads // self.store_kv_heads) * (j // g) + j % g


#: all-MiniLM-L6-v2 (12 heads x 32, no GQA) as 16 store heads x 64, one query
#: head each: every MiniLM head is its own store head (the medoid score is a
#: per-head softmax), 4 KiB per entry
MINILM_WIDENING = Widening(12, 12, 32, 16, 16, 64)
#: swarm-llama (8 query heads over 2 KV heads x 32) as Qwen3-32B: 64 query
#: heads over 8 KV heads x 128 (GQA group 8), 4 KiB per entry
DECODER_WIDENING = Widening(2, 8, 32, 8, 64, 128)


def _check_model_shape(x, heads: int, dim: int, what: str, wide: Widening):
    from swarmfs._errors import ShapeError
    if x.ndim < 2 or x.shape[-2:] != (heads, dim):
        raise ShapeError(f"{what} {x.shape} is not [..., {heads}, {dim}] ({wide})")


def widen_flat(x: np.ndarray, wide: Widening, dtype=np.float16) -> np.ndarray:
    """Index vectors [..., kv_heads x head_dim] (head-major, as
    ``layout._baselines.flat_keys``) -> [..., store_kv_heads x store_head_dim]:
    model head h in slots [D h, D h + d) (D the store's head_dim), zeros
    elsewhere."""
    x = np.asarray(x)
    lead = x.shape[:-1]
    out = np.zeros(lead + (wide.store_kv_heads, wide.store_head_dim), dtype)
    y = x.reshape(lead + (-1, x.shape[-1] // wide.kv_heads if x.shape[-1] else 0))
    _check_model_shape(y, wide.kv_heads, wide.head_dim, "index vectors", wide)
    out[..., :wide.kv_heads, :wide.head_dim] = y
    return out.reshape(lead + (wide.store_kv_heads * wide.store_head_dim,))


def widen_kv(k: np.ndarray, v: np.ndarray, wide: Widening, *, path=None) -> np.ndarray:
    """K, V [kv_heads, S, head_dim] -> store entries [S, 2, store_kv_heads,
    store_head_dim] fp16: model KV head h is store head h (first head_dim
    values), the rest are zeros.

    With ``path`` the array is a file-backed memmap (large contexts: 4 GiB at
    1M tokens), else in memory.
    """
    H, S, d = k.shape
    _check_model_shape(np.empty((H, d)), wide.kv_heads, wide.head_dim, "keys", wide)
    shape = (S, 2, wide.store_kv_heads, wide.store_head_dim)
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


def widen_q(q: np.ndarray, scaling: float, wide: Widening) -> np.ndarray:
    """Model query [query_heads, head_dim] (or a batch [B, ...]) -> float32
    [.., store_query_heads, store_head_dim]: query head j in store head
    ``wide.query_slots()[j]``, times scaling / store_head_dim**-0.5 (the
    store's per-head softmax scale is head_dim**-0.5, so the medoid "prob"
    score sees the model's scaled logits; dot-product rankings do not change
    with the factor)."""
    q = np.asarray(q, np.float32)
    _check_model_shape(q, wide.query_heads, wide.head_dim, "queries", wide)
    lead = q.shape[:-2]
    out = np.zeros(lead + (wide.store_query_heads, wide.store_head_dim), np.float32)
    out[..., wide.query_slots(), :wide.head_dim] = \
        q * np.float32(scaling / wide.store_head_dim ** -0.5)
    return out


def narrow(x, wide: Widening) -> np.ndarray:
    """Retrieved K or V [store_kv_heads, n, store_head_dim] -> the model's
    [kv_heads, n, head_dim]."""
    return np.asarray(x)[:wide.kv_heads, :, :wide.head_dim]


# -- the traces ----------------------------------------------------------------

@dataclasses.dataclass
class Trace:
    """A captured trace (one model layer) and where each dataset starts.

    Attributes:
        q: [H_q, T, d] fp16 queries of the kept layer (post-RoPE for the decoder).
        k, v: [H_kv, T, d] fp16 keys and values.
        scaling: softmax scale of the logits.
        segments: {dataset: (start, length)} of each dataset's first pass.
        meta: the capture's metadata plus the trace recipe.
        path: the cached file.
        kind: ``"minilm"`` or ``"decoder"`` (``--trace``).
        wide: how its heads become 4 KiB store entries.
        window: capture window (tokens): windows are consecutive from token
            0, each run as its own sequence (positions restart).
        q_tail: decoder only: [H_q, windows, DECODER_TAIL, d] queries of the
            tokens after each window, run as that window's causal
            continuation (the decode queries of a context ending there).
        align: contexts start at a multiple of this (the decoder's window,
            so a context of k x 8192 tokens is k whole causal windows).
    """
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scaling: float
    segments: dict
    meta: dict
    path: pathlib.Path
    kind: str = "minilm"
    wide: Widening = MINILM_WIDENING
    window: int = 512
    q_tail: np.ndarray | None = None
    align: int = 1

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    def start(self, dataset: str) -> int:
        """First context position of ``dataset``: its first token (rounded up
        to ``align``)."""
        a = int(self.segments[dataset][0])
        return -(-a // self.align) * self.align

    def _window_end(self, end: int) -> int:
        """End of the capture window that holds token ``end - 1``."""
        return min((end - 1) // self.window * self.window + self.window, self.num_tokens)

    def query_limit(self, end: int) -> int:
        """Positions below this have a held-out query for a context ending at
        ``end``: the trace's end; for the decoder, the end of the window
        holding the context's last token plus its tail."""
        if self.q_tail is None:
            return self.num_tokens
        return self._window_end(end) + int(self.q_tail.shape[2])

    def decode_queries(self, positions, end: int) -> np.ndarray:
        """Queries [n, H_q, d] of held-out positions after a context ending
        at ``end``.  MiniLM: the trace's queries there.  Decoder: the queries
        the decoder computed causally after the context's last window (inside
        that window, or in its tail).

        Raises:
            SystemExit: a position has no such query.
        """
        pos = np.atleast_1d(np.asarray(positions, np.int64))
        if self.q_tail is None:
            return self.q[:, pos].transpose(1, 0, 2)
        e = self._window_end(end)
        if pos.size and (pos.min() < end or pos.max() >= self.query_limit(end)):
            raise SystemExit(f"held-out positions {pos.min()}..{pos.max()} are not in "
                             f"[{end}, {self.query_limit(end)}): no causal decode query")
        out = np.empty((pos.shape[0],) + (self.q.shape[0], self.q.shape[2]), self.q.dtype)
        inside = pos < e
        out[inside] = self.q[:, pos[inside]].transpose(1, 0, 2)
        out[~inside] = self.q_tail[:, (end - 1) // self.window,
                                   pos[~inside] - e].transpose(1, 0, 2)
        return out


def _cached_trace(cache: pathlib.Path, pattern: str, num_tokens: int):
    """The smallest cached trace file matching ``pattern`` (``*`` = its token
    count) with at least ``num_tokens`` tokens, or None."""
    best = None
    for p in cache.glob(pattern):
        n = int(p.stem.rsplit("-", 1)[1])
        if n >= num_tokens and (best is None or n < best[0]):
            best = (n, p)
    return None if best is None else best[1]


def load_trace(num_tokens: int, *, kind: str = "minilm", cache: pathlib.Path | None = None,
               progress: bool = True) -> Trace:
    """The ``kind`` trace of ``num_tokens`` tokens, captured once and cached.

    A longer cached trace is reused (its prefix is the same trace: capture
    windows start at 0, and the decoder is causal).  ``num_tokens`` 0 means
    any cached MiniLM trace, and one pass of the three texts (982,998
    tokens) for the decoder.
    """
    cache = pathlib.Path(cache or CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    if kind == "decoder":
        return _load_decoder_trace(num_tokens, cache, progress)
    if kind != "minilm":
        raise SystemExit(f"unknown trace {kind!r} (one of {', '.join(TRACES)})")
    from swarmfs.layout._capture import capture, load_capture, save_capture
    path = _cached_trace(cache, f"trace-minilm-L{TRACE_LAYER}-*.safetensors", num_tokens)
    if path is None:
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
    cap = load_capture(path)
    meta = dict(cap.meta)
    return Trace(q=cap.q[0], k=cap.k[0], v=cap.v[0], scaling=cap.scaling,
                 segments={k: tuple(v) for k, v in meta["segments"].items()},
                 meta=meta, path=path, kind="minilm", wide=MINILM_WIDENING,
                 window=int(meta.get("window", 512)))


def mass_outside_window(q: np.ndarray, k: np.ndarray, scaling: float, window: int, *,
                        stride: int = 8, chunk: int = 64) -> float:
    """Mean causal attention mass outside the local window.

    For query positions p = window, window + stride, ... of one causal
    sequence, the softmax attention over keys 0..p, averaged over query
    heads; the mass on keys older than the ``window`` most recent tokens
    (position <= p - window), averaged over the positions.

    Args:
        q: [H_q, S, d] queries; k: [H_kv, S, d] keys (GQA allowed).
        scaling: the softmax scale.
        window: local window W (tokens, the query's own included).
    """
    from swarmfs.decode._report import attention_logits
    S = k.shape[1]
    P = np.arange(window, S, stride)
    out = []
    for a in range(0, P.shape[0], chunk):
        p = P[a:a + chunk]
        n = int(p.max()) + 1
        lg = attention_logits(q[:, p], k[:, :n], scaling)            # [H_q, |p|, n]
        j = np.arange(n)
        lg[:, j[None, :] > p[:, None]] = -np.inf
        lg -= lg.max(axis=-1, keepdims=True)
        w = np.exp(lg)
        w /= w.sum(axis=-1, keepdims=True)
        old = j[None, :] <= (p - window)[:, None]                     # [|p|, n]
        out.append((w * old[None]).sum(axis=-1).mean(axis=0))
    return float(np.concatenate(out).mean())


def decoder_layer(cache: pathlib.Path, model: pathlib.Path | None = None) -> dict:
    """The decoder layer the trace keeps, by a stated rule, computed once per
    checkpoint (cached as ``decoder-layer-<sha>.json``).

    Rule: the layer whose causal attention mass lies furthest outside the
    local window (W = ``swarmfs._defaults.LOCAL_WINDOW``, 256 tokens) on
    held-out text: the first 8,192 decoder tokens of
    ``swarmfs.models.heldout_texts("prose")`` (the held-out tail of
    WikiText-2, which the decoder never trained on), one causal window,
    queries at every 8th position from W on (:func:`mass_outside_window`).
    That layer is the one whose decode steps most need entries from the SSDs.

    Returns:
        {"layer", "mass_outside_window" (per layer), "rule", "model_sha256", ...}.
    """
    from swarmfs._defaults import LOCAL_WINDOW
    from swarmfs.layout._capture import capture
    from swarmfs.models import heldout_texts
    from transformers import AutoTokenizer
    model = pathlib.Path(model or decoder_model())
    sha = model_hash(model)
    p = pathlib.Path(cache) / f"decoder-layer-{sha}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.is_file():
        return json.loads(p.read_text())
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    ids = tok(heldout_texts("prose"), add_special_tokens=False,
              verbose=False)["input_ids"][:DECODER_WINDOW]
    t0 = time.perf_counter()
    cap = capture(model, token_ids=ids, window=DECODER_WINDOW, dtype="float32", progress=False)
    mass = [mass_outside_window(cap.q[i], cap.k[i], cap.scaling, LOCAL_WINDOW)
            for i in range(cap.num_layers)]
    out = {"layer": int(np.argmax(mass)), "mass_outside_window": mass,
           "local_window": LOCAL_WINDOW, "tokens": len(ids), "query_stride": 8,
           "text": 'swarmfs.models.heldout_texts("prose"), first tokens (held-out WikiText-2)',
           "rule": "the layer whose causal attention mass (mean over query heads and "
                   "positions) lies furthest outside the local window on held-out text",
           "model_sha256": sha, "seconds": time.perf_counter() - t0}
    tmp = p.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(p)
    return out


def _load_decoder_trace(num_tokens: int, cache: pathlib.Path, progress: bool) -> Trace:
    """The decoder trace (see the module docstring): swarm-llama over the
    three texts in causal windows of :data:`DECODER_WINDOW` tokens, each run
    with its next :data:`DECODER_TAIL` tokens as one causal sequence; the
    window's Q/K/V are the trace, the tail's queries its decode queries."""
    from swarmfs.layout._capture import Capture, capture, load_capture, save_capture
    model = decoder_model()
    sha = model_hash(model)
    rule = decoder_layer(cache, model)
    layer, W, T = int(rule["layer"]), DECODER_WINDOW, DECODER_TAIL
    stem = f"trace-decoder-{sha}-L{layer}-w{W}-t{T}"
    if num_tokens <= 0:                        # default: one pass of the three texts
        num_tokens = sum(n for _, n in trace_tokens(1, model)[1].values())
    path = _cached_trace(cache, f"{stem}-*.safetensors", num_tokens)
    if path is None:
        ids, segments = trace_tokens(num_tokens + T, model)
        nwin = -(-num_tokens // W)
        ends = np.minimum(np.arange(1, nwin + 1) * W, num_tokens)
        chunks = [ids[w * W:ends[w] + T] for w in range(nwin)]   # all W + T but the last
        t0 = time.perf_counter()
        cap = capture(truncated_model(layer + 1, cache, model), token_ids=np.concatenate(chunks),
                      window=W + T, layers=[layer], dtype="float16", progress=progress,
                      text_source="+".join(DATASETS) + " (../shared/data), repeated")
        Hq, H, d = cap.num_query_heads, cap.num_kv_heads, cap.head_dim
        q = np.empty((Hq, num_tokens, d), np.float16)
        k = np.empty((H, num_tokens, d), np.float16)
        v = np.empty_like(k)
        tail = np.empty((Hq, nwin, T, d), np.float16)
        for w in range(nwin):
            o, n = w * (W + T), int(ends[w]) - w * W
            q[:, w * W:ends[w]] = cap.q[0, :, o:o + n]
            k[:, w * W:ends[w]] = cap.k[0, :, o:o + n]
            v[:, w * W:ends[w]] = cap.v[0, :, o:o + n]
            tail[:, w] = cap.q[0, :, o + n:o + n + T]
        meta = dict(cap.meta, num_tokens=num_tokens, window=W, tail=T, segments=segments,
                    capture_s=time.perf_counter() - t0, model="swarm-llama",
                    model_sha256=sha, layer=layer, layers=[layer], layer_rule=rule,
                    trace=f"datasets concatenated in order, repeated; causal windows of {W} "
                          f"tokens from token 0 (positions restart at each), each run with "
                          f"its next {T} tokens whose queries are its decode queries")
        del cap
        path = cache / f"{stem}-{num_tokens}.safetensors"
        tmp = path.with_name(f"{path.stem}.tail.tmp{os.getpid()}.npy")
        np.save(tmp, tail)
        tmp.replace(path.with_name(f"{path.stem}.tail.npy"))
        save_capture(path, Capture(k=k[None], v=v[None], q=q[None],
                                   token_ids=ids[:num_tokens].astype(np.int32), meta=meta))
    cap = load_capture(path)
    meta = dict(cap.meta)
    return Trace(q=cap.q[0], k=cap.k[0], v=cap.v[0], scaling=cap.scaling,
                 segments={k: tuple(v) for k, v in meta["segments"].items()},
                 meta=meta, path=path, kind="decoder", wide=DECODER_WIDENING,
                 window=int(meta["window"]),
                 q_tail=np.load(path.with_name(f"{path.stem}.tail.npy")), align=int(meta["window"]))


def context(trace: Trace, S: int, dataset: str = "wikitext2") -> tuple[int, int]:
    """(start, S) of a context of S tokens that begins with ``dataset``.

    Raises:
        SystemExit: the trace is too short for the context plus its queries.
    """
    start = trace.start(dataset)
    need = start + S + QUERY_STRIDE * 2
    if start + S > trace.num_tokens or need > trace.query_limit(start + S):
        raise SystemExit(f"trace has {trace.num_tokens} tokens; a {S}-token context of "
                         f"{dataset} needs {need}")
    return start, int(S)


def query_positions(trace: Trace, start: int, S: int, n: int) -> np.ndarray:
    """Held-out decode positions after a context (never profiled)."""
    pos = start + S + QUERY_STRIDE * np.arange(n)
    return pos[pos < trace.query_limit(start + S)]


def window_stats(trace: Trace, start: int, S: int, positions, local: int,
                 layouts: dict | None = None) -> dict:
    """Where a context's capture windows show in its held-out attention and
    in its layouts (what putting independent windows side by side changes).

    For the held-out queries at ``positions`` (the model's, unwidened), the
    mean attention mass (softmax per query head, mean over heads) on: the
    capture window holding the context's last token (``own_window``; for the
    decoder, the window the queries continue), the other windows
    (``other_windows``), the first token of every window (``window_starts``:
    attention sinks), and the last ``local`` tokens (``local_window``).  Per
    layout, the share of its clusters whose members come from more than one
    window (``cross_window_clusters``).

    Returns:
        JSON-ready dict; ``windows`` is the number of windows the context touches.
    """
    from swarmfs.decode._report import attention_logits, token_mass
    p0 = np.arange(start, start + S)
    win = p0 // trace.window
    own = win == win[-1]
    first = (p0 % trace.window == 0) | (p0 == start)
    k = trace.k[:, start:start + S]
    rows = []
    for q in trace.decode_queries(positions, start + S):
        m = token_mass(attention_logits(q[:, None, :], k, trace.scaling))[0].astype(np.float64)
        rows.append((m[own].sum(), m[~own].sum(), m[first].sum(), m[-local:].sum()))
    r = np.mean(rows, axis=0) if rows else np.full(4, np.nan)
    out = {"windows": int(win[-1] - win[0] + 1), "window": trace.window,
           "own_window": float(r[0]), "other_windows": float(r[1]),
           "window_starts": float(r[2]), "local_window": float(r[3]), "local": int(local),
           "queries": len(rows), "cross_window_clusters": {}}
    for name, lay in (layouts or {}).items():
        w = (start + lay.members) // trace.window
        lo = np.minimum.reduceat(w, lay.ptr[:-1])
        hi = np.maximum.reduceat(w, lay.ptr[:-1])
        out["cross_window_clusters"][name] = float(np.mean(lo != hi))
    return out


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
        from swarmfs.decode._selectors import BoundSelector, MultiVectorSelector, TokenSelector, VectorSelector
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
        click.Option(["--trace"], type=click.Choice(TRACES), default="minilm",
                     show_default=True,
                     help="minilm: all-MiniLM-L6-v2 in 512-token windows; decoder: "
                          "swarm-llama's causal Q/K/V in 8192-token windows"),
    ]


_SHARED = ("disks", "out", "smoke", "queries", "reps", "qd", "cache", "trace_tokens",
           "block_s", "warmup_s", "trace")


def _help(doc: str) -> str:
    """A module docstring as click help: indented command examples kept as
    they are (click's ``\\b`` marker), the rest re-wrapped."""
    paras = doc.strip().split("\n\n")
    return "\n\n".join("\b\n" + p if p.startswith("    ") else p for p in paras)


def command(name: str, doc: str, *, disks: str = "testbed"):
    """Make ``f(cfg, **options)`` a figure's click command.

    The command takes the options every figure takes (``--disks --out
    --smoke --queries --reps --qd --cache --trace-tokens --block-s
    --warmup-s --trace``), frozen into a :class:`BenchConfig` passed as ``cfg``, plus
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
    tr = load_trace(max(cfg.trace_tokens or 0, trace_tokens), kind=cfg.trace,
                    cache=cfg.cache, progress=not cfg.smoke)
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


#: the figures' shared context options: ``--tokens`` (S) and ``--dataset``
tokens_option = click.option("--tokens", type=O.COUNT, default=None, help="context length S")
dataset_option = click.option("--dataset", type=click.Choice(list(DATASETS)),
                              default="wikitext2", show_default=True)


def ablation_command(name: str, doc: str):
    """:func:`command` for an ablation figure: also ``--tokens``,
    ``--dataset``, ``--ratio``; the function gets an :class:`Ablation` with
    one loaded context: 128K tokens of WikiText-2, 24 held-out queries and 3
    repetitions by default; 2K, 3 and 1 with ``--smoke``."""
    def deco(f):
        @click.option("--ratio", type=O.RATIO, default=0.1, show_default=True)
        @dataset_option
        @tokens_option
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
    payload.setdefault("trace", trace_identity(cfg))
    payload.setdefault("trace_recipe", " ".join(
        __doc__.split(f"**Trace: {cfg.trace}.**")[1].split("**")[0].split()
        + __doc__.split("**Stretching to Qwen3-32B entries.**")[1].split("**")[0].split()))
    p = out.with_suffix(".json")
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_json_default))
    tmp.replace(p)
    print(f"wrote {p}", file=sys.stderr)
    return p


def trace_identity(cfg: BenchConfig) -> dict:
    """What identifies the trace a figure ran on (for its JSON): the model,
    its checkpoint hash and kept layer (with the decoder's layer rule), the
    window, and how its heads were widened."""
    if cfg.trace == "decoder":
        model = decoder_model()
        rule = decoder_layer(cfg.cache, model)
        return {"kind": "decoder", "model": "swarm-llama", "model_sha256": model_hash(model),
                "layer": rule["layer"], "layer_rule": rule, "window": DECODER_WINDOW,
                "tail": DECODER_TAIL, "widening": dataclasses.asdict(DECODER_WIDENING)}
    return {"kind": "minilm", "model": "sentence-transformers/all-MiniLM-L6-v2",
            "layer": TRACE_LAYER, "window": 512,
            "widening": dataclasses.asdict(MINILM_WIDENING)}


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
