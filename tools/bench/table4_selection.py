#!/usr/bin/env python3
"""Table 4: selection latency, naive full-key scan vs SWARM's medoid index.

Qwen3-32B-sized keys (2 KiB: 16 x 64 fp16, as 8 KV heads x 128) at each prefix
length.  Two measurements:

* real: the trace's keys widened to that size (naive: score every key, take
  the top r x S) and the medoids of SWARM's layout of that context (score
  every medoid, take clusters in score order until r x S entries), both with
  swarmfs's fp16 GEMV on held-out queries; medians.
* synthetic: ``tools/bench_select.py``'s ``bench_selection`` (random keys,
  fp32 BLAS naive scan) with C = S / the real mean cluster size.

Index memory: the medoid keys (C x 2 KiB) per layer.

    tools/testbed run -- python tools/bench/table4_selection.py
"""

from __future__ import annotations

import sys

import _common as C  # noqa: I001  (puts tools/ on sys.path for bench_select)
import numpy as np
from bench_select import median_ms as _median_ms

PAPER = {131072: (1.635, 0.236, 0.053), 262144: (3.136, 0.374, 0.104),
         524288: (6.176, 0.554, 0.207), 1048576: (12.15, 0.999, 0.412)}


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--no-synthetic", action="store_true")
    a = C.parse(ap, argv)
    from swarmfs.layout._baselines import flat_keys

    from swarmfs._retrieve import group_queries, score_medoids, select_clusters
    sizes = [int(x) for x in (a.tokens or ("1024,2048" if a.smoke else
                                           "131072,262144,524288,1048576")).split(",")]
    reps = a.reps or (5 if a.smoke else 50)
    nq = a.queries or (2 if a.smoke else 8)
    trace, _, out = C.setup(a, "table4_selection",
                                trace_tokens=4096 if a.smoke else max(sizes) + 4096)
    rows = []
    rng = np.random.default_rng(0)
    for S in sizes:
        start, S = C.context(trace, S, "wikitext2")
        from fig16_prefix_batch import FULL_MAX, SEGMENT
        lay, hit = C.build_layout("swarm", trace, start, S, ratio=a.ratio,
                                  **({"segment": SEGMENT} if S > FULL_MAX else {}))
        budget = int(np.ceil(a.ratio * S))
        keys = C.widen_flat(flat_keys(trace.k[:, start:start + S]))             # [S, 1024]
        med = np.ascontiguousarray(keys[lay.medoids])
        sizes_c = lay.sizes
        qs = [group_queries(C.widen_q(trace.q[:, p], trace.scaling), C.WIDE_HEADS)
              for p in C.query_positions(trace, start, S, nq)]
        naive, swarm = [], []
        for qg in qs:
            def scan(qg=qg, keys=keys, k=budget):
                return np.argpartition(-score_medoids(keys, qg)[0], k - 1)[:k]

            def medoids(qg=qg, med=med, k=budget, lay=lay, S=S):
                return select_clusters(score_medoids(med, qg)[0], lay.ptr, lay.members,
                                       num_tokens=S, budget=k)

            naive.append(_median_ms(scan, max(reps // 5, 3)))
            swarm.append(_median_ms(medoids, reps))
        row = {"tokens": S, "clusters": lay.num_clusters,
               "mean_cluster_size": float(sizes_c.mean()),
               "naive_ms": float(np.median(naive)), "swarm_ms": float(np.median(swarm)),
               "swarm_index_bytes": int(med.nbytes), "naive_index_bytes": int(keys.nbytes),
               "layout_cached": hit, "paper": PAPER.get(S)}
        row["speedup"] = row["naive_ms"] / row["swarm_ms"]
        del keys, med
        if not a.no_synthetic:
            import bench_select
            syn = bench_select.bench_selection(S, max(1, round(float(sizes_c.mean()))),
                                               reps, rng, r=a.ratio)
            row["synthetic"] = syn
        rows.append(row)
        print(f"  S={S:8d}: naive {row['naive_ms']:7.3f} ms, medoids {row['swarm_ms']:6.3f} ms "
              f"(x{row['speedup']:.1f}), index {row['swarm_index_bytes'] / 2**20:.1f} MiB, "
              f"{row['clusters']} clusters", file=sys.stderr)
    payload = {"figure": "table4", "title": "selection latency", "ratio": a.ratio,
               "queries": nq, "reps": reps, "rows": rows, "paper": PAPER}
    C.write_json(out, payload)
    plot(payload, out)
    return payload


def plot(p, out):
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["tokens"] / 1024 for r in p["rows"]]
    ax.plot(x, [r["naive_ms"] for r in p["rows"]], "o-", label="naive (all keys)")
    ax.plot(x, [r["swarm_ms"] for r in p["rows"]], "s-", label="SWARM medoid index")
    if p["rows"] and "synthetic" in p["rows"][0]:
        ax.plot(x, [r["synthetic"]["naive_ms"] for r in p["rows"]], "o:",
                label="naive, synthetic fp32 BLAS")
        ax.plot(x, [r["synthetic"]["swarm_ms"] for r in p["rows"]], "s:",
                label="medoids, synthetic")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (K tokens)")
    ax.set_ylabel("selection latency (ms, median)")
    ax.grid(alpha=.3)
    ax.legend(fontsize=8)
    ax.set_title("Table 4: selection latency (2 KiB keys, as Qwen3-32B)", fontsize=10)
    C.save_fig(fig, out)


if __name__ == "__main__":
    main()
