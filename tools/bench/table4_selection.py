#!/usr/bin/env python3
"""Table 4: selection latency, naive full-key scan vs SWARM's medoid index.

Qwen3-32B-sized keys (2 KiB: 16 x 64 fp16 for MiniLM, 8 x 128 for the decoder trace, as
8 KV heads x 128) at each prefix
length.  Two measurements:

* real: the trace's keys widened to that size (naive: score every key, take
  the top r x S) and the medoids of SWARM's layout of that context (score
  every medoid, take clusters in score order until r x S entries), both with
  swarmfs's fp16 GEMV on held-out queries; medians.
* synthetic: ``tools/bench_select.py``'s ``bench_selection`` (random keys,
  fp32 BLAS naive scan) with C = S / the real mean cluster size.

Index memory: the medoid keys (C x 2 KiB) per layer.

    tools/testbed run -- python -m tools.bench.table4_selection
"""

from __future__ import annotations

import sys

import click
import numpy as np

from tools import _options as O
from tools.bench import _common as C
from tools.bench.fig16_prefix_batch import FULL_MAX, SEGMENT
from tools.bench_select import bench_selection
from tools.bench_select import median_ms as _median_ms

PAPER = {131072: (1.635, 0.236, 0.053), 262144: (3.136, 0.374, 0.104),
         524288: (6.176, 0.554, 0.207), 1048576: (12.15, 0.999, 0.412)}


@C.command("table4_selection", __doc__)
@click.option("--tokens", type=O.CommaList(int, item=O.COUNT, keep_text=True), default=None,
              help="comma list of prefix lengths")
@click.option("--ratio", type=O.RATIO, default=0.1, show_default=True)
@click.option("--no-synthetic", is_flag=True, help="skip the synthetic measurement")
def cli(cfg, tokens, ratio, no_synthetic):
    from swarmfs.decode._selectors import group_queries, score_medoids, select_clusters
    from swarmfs.layout._baselines import flat_keys
    sizes = [int(x) for x in (tokens or ("1024,2048" if cfg.smoke else
                                         "131072,262144,524288,1048576")).split(",")]
    reps = cfg.reps or (5 if cfg.smoke else 50)
    nq = cfg.queries or (2 if cfg.smoke else 8)
    trace, _, out = C.setup(cfg, "table4_selection",
                            trace_tokens=4096 if cfg.smoke else max(sizes) + 4096)
    rows = []
    rng = np.random.default_rng(0)
    for S in sizes:
        start, S = C.context(trace, S, "wikitext2")
        lay, hit = C.build_layout("swarm", trace, start, S, cache=cfg.cache, ratio=ratio,
                                  **({"segment": SEGMENT} if S > FULL_MAX else {}))
        budget = int(np.ceil(ratio * S))
        wide = trace.wide
        keys = C.widen_flat(flat_keys(trace.k[:, start:start + S]), wide)       # [S, 1024]
        med = np.ascontiguousarray(keys[lay.medoids])
        sizes_c = lay.sizes
        pos = C.query_positions(trace, start, S, nq)
        qs = [group_queries(q, wide.store_kv_heads) for q in
              C.widen_q(trace.decode_queries(pos, start + S), trace.scaling, wide)]
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
        if not no_synthetic:
            syn = bench_selection(S, max(1, round(float(sizes_c.mean()))),
                                  reps, rng, r=ratio)
            row["synthetic"] = syn
        rows.append(row)
        print(f"  S={S:8d}: naive {row['naive_ms']:7.3f} ms, medoids {row['swarm_ms']:6.3f} ms "
              f"(x{row['speedup']:.1f}), index {row['swarm_index_bytes'] / 2**20:.1f} MiB, "
              f"{row['clusters']} clusters", file=sys.stderr)
    payload = {"figure": "table4", "title": "selection latency", "ratio": ratio,
               "queries": nq, "reps": reps, "rows": rows, "paper": PAPER}
    return C.finish(cfg, out, payload, plot)


def main(argv=None):
    return C.run(cli, argv)


def plot(p, out):
    x = [r["tokens"] / 1024 for r in p["rows"]]
    series = {"naive (all keys)": ("naive_ms", "o-"), "SWARM medoid index": ("swarm_ms", "s-")}
    with C.figure(out, 1, (6, 4), "Table 4: selection latency (2 KiB keys, as Qwen3-32B)",
                  legend=8) as (ax,):
        for label, (key, style) in series.items():
            C.lines(ax, x, {label: [r[key] for r in p["rows"]]}, style)
        if p["rows"] and "synthetic" in p["rows"][0]:
            for label, (key, style) in (("naive, synthetic fp32 BLAS", ("naive_ms", "o:")),
                                        ("medoids, synthetic", ("swarm_ms", "s:"))):
                C.lines(ax, x, {label: [r["synthetic"][key] for r in p["rows"]]}, style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prefix length (K tokens)")
        ax.set_ylabel("selection latency (ms, median)")


def summary(p: dict) -> str:
    """This table's section of ``run_all``'s Markdown summary: naive and
    medoid selection latency per prefix length, with the paper's."""
    rows = []
    for r in p["rows"]:
        pp = r.get("paper")
        rows.append((r["tokens"], f"{r['naive_ms']:.3f}", f"{r['swarm_ms']:.3f}",
                     f"{r['speedup']:.1f}", f"{r['swarm_index_bytes'] / 2**20:.1f}",
                     r["clusters"], f"{pp[0]} / {pp[1]}" if pp else "-"))
    return "\n".join(["### Table 4: selection latency\n",
                      C.md_table(rows, ("S", "naive ms", "medoid ms", "speedup",
                                        "medoid index MiB", "clusters",
                                        "paper naive / SWARM ms"), 0), ""])


if __name__ == "__main__":
    main()
