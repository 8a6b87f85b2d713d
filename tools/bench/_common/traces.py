"""The activation traces (see the package docstring): token ids, the
MiniLM and decoder captures, contexts and their held-out decode queries."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time

import numpy as np

from .config import (
    CACHE,
    DATA,
    DATASETS,
    DECODER_TAIL,
    DECODER_WINDOW,
    QUERY_STRIDE,
    TRACE_LAYER,
    TRACES,
    _sha,
)
from .widening import DECODER_WIDENING, MINILM_WIDENING, Widening


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
    from transformers import AutoTokenizer

    from swarmfs.layout._capture import default_model_path, read_text
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
    from transformers import AutoTokenizer

    from swarmfs._defaults import LOCAL_WINDOW
    from swarmfs.layout._capture import capture
    from swarmfs.models import heldout_texts
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
