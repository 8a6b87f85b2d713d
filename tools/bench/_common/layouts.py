"""Each method's layout of a context, memoised on disk with ``joblib.Memory``."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from .config import REPO, _sha
from .traces import Trace


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
    if seg and seg < S:
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
    for a, lay in zip(range(0, S, seg), parts, strict=True):
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
