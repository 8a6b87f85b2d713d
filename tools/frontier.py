#!/usr/bin/env python3
"""The cost/quality frontier of cluster-granular KV retrieval (issue 23).

On held-out text (``swarmfs.models.heldout_texts``, Python and prose) the
decoder's post-RoPE Q, K and V are captured over ``--tokens`` context tokens
plus ``--queries`` later positions; the later positions' queries are the
decode queries (never used to profile).  For every layer, every method
configuration groups the context's entries into clusters and keeps an index
in DRAM; each decode query scores the index, and clusters are taken in score
order until the entry budget ``ceil(r S)`` is met with the local window
(:func:`swarmfs.decode._selectors.select_clusters`, the decode path's rule).

Configurations:

* ``swarm``: co-activation clustering (SWARM §5.1; ``swarmfs.layout.cluster``)
  for each tau and cluster-size cap, with each cluster representative:
  ``medoid`` (§5.2, the paper), ``centroid`` (the members' mean key, the
  same DRAM), ``bounds`` (per-channel min/max of the members' keys, Quest's
  upper bound, twice the DRAM), ``centroids2`` (two 2-means centroids of
  the members, twice the DRAM) or ``oracle`` (each cluster scored by its
  true attention mass for the query: the ranking a perfect scorer of those
  clusters gives, so it separates what the clustering loses from what the
  index loses; no DRAM counted; plotted apart from the methods).
* ``quest``: pages of 8, 16, 32 and 64 tokens with min/max bounds.
* ``infllm``: blocks of 32, 64 and 128 tokens with 4 representative keys.
* ``pqcache``: k-means over the keys into clusters of 8, 16 and 32 on
  average, scored by centroid (the PQCache / ClusterKV family).

Quality: attention-mass recall against the exact top-k (§8.2), and the
relative error of the attention output, per query, averaged over heads,
layers and queries.  Cost: DRAM held (index in float16 + local window) as a
fraction of the context's KV (float16 K and V); per step, SSD bytes (the
selected entries outside the window), requests (one per selected cluster:
a cluster is one extent per stripe) and mean read size; CPU µs to score and
select one query (median).  Perplexity, KL and task accuracy of chosen
points come from the real decode path (``python -m tools.suite``).

Output: JSON (every row) and a Pareto plot per text (recall against DRAM
fraction and against SSD bytes per step, one curve per method family).

    tools/dev run python -m tools.frontier --out docs/data/frontier.json --plots docs/img
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

import click
import numpy as np

from tools._options import COUNT, RATIO, OutPath

FAMILIES = ("swarm", "quest", "infllm", "pqcache")


@dataclasses.dataclass
class Config:
    family: str
    label: str
    ptr: np.ndarray
    members: np.ndarray
    kind: str            # medoid | centroid | bounds | reps | vectors
    index: dict          # float32 arrays, flat keys [C, H_kv*d] (reps: [C, R, H_kv*d])
    build_s: float

    @property
    def index_floats(self) -> int:
        return int(sum(a.size for a in self.index.values()))


def capture_layers(model: pathlib.Path, kind: str, tokens: int, queries: int,
                   cache: pathlib.Path | None):
    """float32 q [L, H_q, T, d], k, v [L, H_kv, T, d] and the logit scale over
    the first ``tokens + queries`` held-out tokens (cached as .npz)."""
    from swarmfs.models import heldout_texts
    T = tokens + queries
    path = None
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        st = model.stat()
        path = cache / f"frontier-{model.name}-{int(st.st_mtime)}-{kind}-{T}.npz"
        if path.exists():
            z = np.load(path)
            return z["q"], z["k"], z["v"], float(z["scaling"])
    from transformers import AutoTokenizer

    from swarmfs import layout as L
    tok = AutoTokenizer.from_pretrained(model)
    ids = np.asarray(tok(heldout_texts(kind), verbose=False)["input_ids"][:T])
    cap = L.capture(str(model), token_ids=ids, progress=False, dtype="float32")
    if path is not None:
        np.savez(path, q=cap.q, k=cap.k, v=cap.v, scaling=cap.scaling)
    return cap.q, cap.k, cap.v, cap.scaling


def _flat(k: np.ndarray, tokens=None) -> np.ndarray:
    """[H_kv, S, d] -> [S, H_kv*d] (the selectors' flat key layout)."""
    x = k if tokens is None else k[:, tokens]
    return np.ascontiguousarray(x.transpose(1, 0, 2).reshape(x.shape[1], -1), np.float32)


def _reduce(flat_members: np.ndarray, ptr: np.ndarray, how: str) -> np.ndarray:
    if how == "mean":
        return (np.add.reduceat(flat_members, ptr[:-1], axis=0)
                / np.diff(ptr)[:, None]).astype(np.float32)
    f = np.minimum if how == "min" else np.maximum
    return f.reduceat(flat_members, ptr[:-1], axis=0).astype(np.float32)


def _two_centroids(flat_members: np.ndarray, ptr: np.ndarray, iters: int = 4) -> np.ndarray:
    """Two representatives per cluster: 2-means of its members' keys, seeded
    by the centroid and the member farthest from it (a one-member cluster
    repeats its key): float32 [C, 2, H_kv*d]."""
    C = ptr.shape[0] - 1
    out = np.empty((C, 2, flat_members.shape[1]), np.float32)
    for c in range(C):                       # offline layout analysis, not the decode path
        x = flat_members[ptr[c]:ptr[c + 1]]
        a = x.mean(0)
        b = x[np.argmax(((x - a) ** 2).sum(1))]
        for _ in range(iters):
            near_b = ((x - b) ** 2).sum(1) < ((x - a) ** 2).sum(1)
            if near_b.all() or not near_b.any():
                break
            a, b = x[~near_b].mean(0), x[near_b].mean(0)
        out[c, 0], out[c, 1] = a, b
    return out


def swarm_configs(q, k, S, scaling, ratio, taus, caps, reps, layer) -> list[Config]:
    from swarmfs import layout as L
    t0 = time.perf_counter()
    prof = L.profile_layer(q[:, :S], k[:, :S], ratio=ratio, scaling=scaling, layer=layer)
    t_prof = time.perf_counter() - t0
    out = []
    for tau in taus:
        for cap in caps:
            t0 = time.perf_counter()
            cl = L.cluster(prof, tau=tau, max_cluster_size=cap, keys=k[:, :S])
            dt = time.perf_counter() - t0 + t_prof
            ptr, mem = np.asarray(cl.ptr, np.int64), np.asarray(cl.members, np.int64)
            fm = _flat(k, mem)
            for rep in reps:
                if rep == "medoid":
                    index = {"vectors": _flat(k, np.asarray(cl.medoids))}
                elif rep == "centroid":
                    index = {"vectors": _reduce(fm, ptr, "mean")}
                elif rep == "centroids2":
                    index = {"reps": _two_centroids(fm, ptr)}
                elif rep == "oracle":
                    index = {}
                else:
                    index = {"lo": _reduce(fm, ptr, "min"), "hi": _reduce(fm, ptr, "max")}
                kind = {"bounds": "bounds", "centroids2": "reps", "oracle": "oracle"}.get(
                    rep, "vectors")
                out.append(Config("cluster-oracle" if rep == "oracle" else "swarm",
                                  f"swarm tau={tau} cap={cap} {rep}", ptr, mem, kind, index,
                                  dt))
    return out


def baseline_configs(q, k, S, pages, blocks, means) -> list[Config]:
    from swarmfs.layout import _baselines as B
    out = []
    kk = k[:, :S]
    for p in pages:
        t0 = time.perf_counter()
        lay = B.quest_pages(kk, page=p)
        out.append(Config("quest", f"quest page={p}", lay.ptr, lay.members, "bounds",
                          dict(lay.index), time.perf_counter() - t0))
    for b in blocks:
        t0 = time.perf_counter()
        lay = B.infllm_blocks(q[:, :S], kk, block=b, reps=4)
        out.append(Config("infllm", f"infllm block={b} reps=4", lay.ptr, lay.members, "reps",
                          dict(lay.index), time.perf_counter() - t0))
    for m in means:
        t0 = time.perf_counter()
        lay = B.kmeans_clusters(kk, mean_size=float(m))
        out.append(Config("pqcache", f"pqcache mean={m}", lay.ptr, lay.members, "vectors",
                          dict(lay.index), time.perf_counter() - t0))
    return out


def selector_for(cfg: Config):
    from swarmfs.decode import _selectors as Sel
    if cfg.kind == "oracle":
        return None
    if cfg.kind == "vectors":
        return Sel.VectorSelector({0: cfg.index["vectors"]})
    if cfg.kind == "reps":
        return Sel.MultiVectorSelector({0: cfg.index["reps"]})
    return Sel.BoundSelector({0: (cfg.index["lo"], cfg.index["hi"])})


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scaling: float):
    """Per query head: probabilities p [H_q, S] and output o [H_q, d]."""
    g = q.shape[0] // k.shape[0]
    kk, vv = np.repeat(k, g, 0), np.repeat(v, g, 0)
    lg = np.einsum("hd,hsd->hs", q, kk) * scaling
    lg -= lg.max(1, keepdims=True)
    p = np.exp(lg)
    p /= p.sum(1, keepdims=True)
    return p, np.einsum("hs,hsd->hd", p, vv)


def evaluate(cfg: Config, q_dec, k, v, S, scaling, ratio, dense) -> dict:
    """Recall, output error and costs of one configuration at one r, over the decode queries."""
    from swarmfs._defaults import LOCAL_WINDOW
    from swarmfs.decode._report import attention_recall
    from swarmfs.decode._selectors import select_clusters
    from swarmfs.decode._window import entry_budget, window_size
    budget = entry_budget(ratio, S)
    w = window_size(LOCAL_WINDOW, budget, S)
    sel = selector_for(cfg)
    Hkv, _, d = k.shape
    g = q_dec.shape[1] // Hkv
    kk, vv = np.repeat(k[:, :S], g, 0), np.repeat(v[:, :S], g, 0)
    sizes = np.diff(cfg.ptr)
    rec, err, ssd, reqs, cpu = [], [], [], [], []
    for i in range(q_dec.shape[0]):
        qi = np.ascontiguousarray(q_dec[i][None], np.float32)
        t0 = time.perf_counter()
        if sel is None:         # the cluster oracle: each cluster's true attention mass
            scores = np.add.reduceat(dense[i][0].mean(0)[cfg.members], cfg.ptr[:-1])
        else:
            scores = sel.scores(0, qi)[0]
        chosen = select_clusters(scores, cfg.ptr, cfg.members, num_tokens=S, budget=budget,
                                 window=w)
        cpu.append((time.perf_counter() - t0) * 1e6)
        ch = chosen.clusters
        parts = [cfg.members[cfg.ptr[c]:cfg.ptr[c + 1]] for c in ch]
        picked = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        pos = np.union1d(np.arange(S - w, S), picked)
        p, o = dense[i]
        rec.append(attention_recall(p.mean(0), pos, budget)[0])
        lg = np.einsum("hd,hsd->hs", q_dec[i], kk[:, pos]) * scaling
        lg -= lg.max(1, keepdims=True)
        ps = np.exp(lg)
        ps /= ps.sum(1, keepdims=True)
        os_ = np.einsum("hs,hsd->hd", ps, vv[:, pos])
        err.append(float(np.mean(np.linalg.norm(os_ - o, axis=1) /
                                 np.maximum(np.linalg.norm(o, axis=1), 1e-12))))
        outside = picked[picked < S - w]
        ssd.append(outside.size)
        reqs.append(int(sum(1 for c in ch if (cfg.members[cfg.ptr[c]:cfg.ptr[c + 1]]
                                             < S - w).any())))
    entry = 2 * Hkv * d * 2                                  # float16 K and V, all KV heads
    kv = S * entry
    index_b = cfg.index_floats * 2
    b = float(np.mean(ssd)) * entry
    return {"recall": float(np.mean(rec)), "output_error": float(np.mean(err)),
            "dram_fraction": (index_b + w * entry) / kv, "index_fraction": index_b / kv,
            "ssd_bytes_per_step": b, "requests_per_step": float(np.mean(reqs)),
            "mean_read_bytes": b / max(float(np.mean(reqs)), 1e-9),
            "entries_per_cluster": float(cfg.members.size / max(sizes.size, 1)),
            "cpu_us": float(np.median(cpu)), "build_s": cfg.build_s}


def run(args) -> dict:
    rows = []
    for kind in args.kinds:
        q, k, v, scaling = capture_layers(args.model, kind, args.tokens, args.queries, args.cache)
        S = args.tokens
        for layer in range(q.shape[0]):
            ql, kl, vl = q[layer], k[layer], v[layer]
            q_dec = np.ascontiguousarray(ql[:, S:S + args.queries].transpose(1, 0, 2))
            dense = [dense_attention(q_dec[i], kl[:, :S], vl[:, :S], scaling)
                     for i in range(q_dec.shape[0])]
            cfgs = baseline_configs(ql, kl, S, args.pages, args.blocks, args.means)
            for r in args.ratios:
                sw = swarm_configs(ql, kl, S, scaling, r, args.taus, args.caps, args.reps, layer)
                for cfg in (sw + cfgs):
                    row = {"kind": kind, "layer": layer, "ratio": r, "family": cfg.family,
                           "config": cfg.label,
                           **evaluate(cfg, q_dec, kl, vl, S, scaling, r, dense)}
                    rows.append(row)
                    print(f"{kind} L{layer} r={r} {cfg.label:34s} recall {row['recall']:.3f} "
                          f"err {row['output_error']:.3f} DRAM {row['dram_fraction']:.3f} "
                          f"ent/cl {row['entries_per_cluster']:.1f} read "
                          f"{row['mean_read_bytes']:.0f} B", file=sys.stderr, flush=True)
    return {"rows": rows, "points": aggregate(rows)}


def aggregate(rows: list[dict]) -> list[dict]:
    """Per (text, r, config): means over layers, and the smallest layer's entries per cluster."""
    keys = sorted({(r["kind"], r["ratio"], r["family"], r["config"]) for r in rows})
    out = []
    for kind, ratio, fam, cfg in keys:
        sel = [r for r in rows if (r["kind"], r["ratio"], r["config"]) == (kind, ratio, cfg)]
        pt = {"kind": kind, "ratio": ratio, "family": fam, "config": cfg}
        for f in ("recall", "output_error", "dram_fraction", "index_fraction",
                  "ssd_bytes_per_step", "requests_per_step", "cpu_us", "entries_per_cluster"):
            pt[f] = float(np.mean([r[f] for r in sel]))
        pt["mean_read_bytes"] = pt["ssd_bytes_per_step"] / max(pt["requests_per_step"], 1e-9)
        pt["entries_per_cluster_min"] = float(min(r["entries_per_cluster"] for r in sel))
        pt["recall_min_layer"] = float(min(r["recall"] for r in sel))
        out.append(pt)
    return out


def pareto(points: list[dict], cost: str) -> list[dict]:
    """The points not dominated (lower ``cost`` and higher recall)."""
    pts = sorted(points, key=lambda p: (p[cost], -p["recall"]))
    out, best = [], -1.0
    for p in pts:
        if p["recall"] > best:
            out.append(p)
            best = p["recall"]
    return out


def plot(points: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in sorted({p["kind"] for p in points}):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, cost, xl in ((axes[0], "dram_fraction", "DRAM held / KV"),
                             (axes[1], "ssd_bytes_per_step", "SSD bytes per step")):
            for fam, mk in zip(FAMILIES, "o^sD", strict=False):
                pts = [p for p in points if p["kind"] == kind and p["family"] == fam]
                if not pts:
                    continue
                ax.scatter([p[cost] for p in pts], [p["recall"] for p in pts], marker=mk,
                           s=14, alpha=0.35)
                front = pareto(pts, cost)
                ax.plot([p[cost] for p in front], [p["recall"] for p in front], marker=mk,
                        label=fam)
            ax.set(xlabel=xl, ylabel="attention-mass recall", xscale="log")
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"cost/quality frontier, held-out {kind} (all r)")
        fig.tight_layout()
        p = out / f"frontier_{kind}.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def _floats(ctx, param, value):
    try:
        return tuple(float(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: comma-separated numbers") from None


def _ints(ctx, param, value):
    try:
        xs = tuple(int(x) for x in value.split(",")) if value else ()
    except ValueError:
        raise click.BadParameter(f"{value!r}: comma-separated integers") from None
    if any(x < 1 for x in xs):
        raise click.BadParameter(f"{value!r}: each must be >= 1")
    return xs


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=pathlib.Path),
              default=None, help="decoder directory (default swarmfs.models.DEFAULT_DECODER)")
@click.option("--kinds", multiple=True, type=click.Choice(["python", "prose"]),
              default=["python", "prose"])
@click.option("--tokens", type=COUNT, default=8192, help="context tokens S")
@click.option("--queries", type=COUNT, default=64, help="decode queries after the context")
@click.option("--ratios", type=RATIO, multiple=True, default=[0.05, 0.1, 0.2])
@click.option("--taus", callback=_floats, default="0.3,0.7,0.9")
@click.option("--caps", callback=_ints, default="8,16,64")
@click.option("--reps", multiple=True,
              type=click.Choice(["medoid", "centroid", "bounds", "centroids2", "oracle"]),
              default=["medoid", "centroid", "bounds"],
              help="cluster representatives; centroids2: two per cluster (2-means); "
                   "oracle: each cluster ranked by its true attention mass (what a perfect "
                   "scorer of those clusters would do; costs no DRAM here)")
@click.option("--pages", callback=_ints, default="8,16,32,64")
@click.option("--blocks", callback=_ints, default="32,64,128")
@click.option("--means", callback=_ints, default="8,16,32")
@click.option("--cache", type=click.Path(file_okay=False, path_type=pathlib.Path),
              default=pathlib.Path("bench-out/frontier"), help="capture cache")
@click.option("--out", type=OutPath(), default=None)
@click.option("--plots", type=click.Path(file_okay=False, path_type=pathlib.Path), default=None)
def cli(**o):
    import types
    args = types.SimpleNamespace(**o)
    from swarmfs.models import DEFAULT_DECODER
    args.model = pathlib.Path(args.model or DEFAULT_DECODER)
    res = run(args)
    res["config"] = {k: (str(v) if isinstance(v, pathlib.Path) else v)
                     for k, v in vars(args).items()}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1))
    if args.plots:
        plot(res["points"], args.plots)
    from tools.bench._common import table
    pts = res["points"]
    print(table([[p["kind"], p["ratio"], p["config"], f"{p['recall']:.3f}",
                  f"{p['recall_min_layer']:.3f}", f"{p['dram_fraction']:.3f}",
                  f"{p['entries_per_cluster_min']:.1f}", f"{p['mean_read_bytes']:.0f}",
                  f"{p['ssd_bytes_per_step'] / 1024:.1f}", f"{p['cpu_us']:.0f}"] for p in pts],
                ["text", "r", "config", "recall", "min layer", "DRAM/KV", "ent/cl min",
                 "read B", "KiB/step", "CPU us"]))
    return res


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line)."""
    return cli.main(args=argv, standalone_mode=argv is None)


if __name__ == "__main__":
    sys.exit(main())
