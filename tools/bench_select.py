#!/usr/bin/env python3
"""Selection latency (SWARM Table 4) and planning time.

Selection: a Qwen3-32B-shaped layer (8 KV heads, 64 query heads, head_dim
128, fp16 keys) at 128K, 256K, 512K and 1M tokens.  "naive" scores the query
against every key (the full-key scan) and takes the top r x S; "swarm" scores
it against the medoid index (one medoid per cluster; C = S / mean cluster
size, --cluster-size) and takes clusters in score order until r x S entries
(``swarmfs._retrieve.select_clusters``).  Both use a single-threaded GEMV
on the GQA-summed query (fp32 keys for the naive scan, so it gets BLAS; the fp16
medoid index is scored by swarmfs's C GEMV, as the Retriever does); medians.

Planning: ``plan_reads`` for 100K selected entries (30% with a second copy)
over 4 disks: dedup (eq. 8), entry buckets (§6.1), coalescing.

    tools/dev run python tools/bench_select.py --out bench-out/select
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from swarmfs import plan_reads
from swarmfs._kernels import softmax_sum
from swarmfs._retrieve import (group_queries, score_medoids, select_clusters,
                               single_threaded_blas)
from swarmfs._selectors import head_logits

PAPER = {131072: (1.635, 0.236), 262144: (3.136, 0.374), 524288: (6.176, 0.554),
         1048576: (12.15, 0.999)}


def median_ms(f, reps):
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def bench_selection(S, cluster_size, reps, rng, r=0.1, H=8, Hq=64, d=128):
    C = int(round(S / cluster_size))
    q = rng.standard_normal((1, Hq, d)).astype(np.float32)
    sizes = rng.integers(max(int(cluster_size) // 2, 1), int(cluster_size * 1.5) + 1, size=C)
    ptr = np.zeros(C + 1, np.int64)
    np.cumsum(sizes, out=ptr[1:])
    members = rng.permutation(int(ptr[-1]))          # every token in one cluster
    S_ = int(ptr[-1])
    medoids = rng.standard_normal((C, H * d)).astype(np.float16)   # the store dtype
    budget = int(np.ceil(r * S))
    scale = d ** -0.5

    def swarm_prob():      # the Retriever's default (MedoidSelector score="prob")
        sc = softmax_sum(head_logits(medoids, q, H)[0], scale)
        select_clusters(sc, ptr, members, num_tokens=S_, budget=budget)

    def swarm_logit():     # MedoidSelector score="logit": GQA-summed query, one GEMV
        select_clusters(score_medoids(medoids, group_queries(q, H))[0], ptr, members,
                        num_tokens=S_, budget=budget)

    t_prob = median_ms(swarm_prob, reps)
    t_logit = median_ms(swarm_logit, reps)
    medoids = None                     # free the index before the naive scan allocates keys
    keys = rng.standard_normal((S, H * d), dtype=np.float32)

    def naive():
        qg = group_queries(q, H)[0]
        with single_threaded_blas():
            s = keys @ qg
        np.argpartition(-s, budget - 1)[:budget]

    t_naive = median_ms(naive, max(reps // 10, 5))
    return {"tokens": S, "medoids": C, "mean_cluster_size": cluster_size,
            "naive_ms": t_naive, "swarm_ms": t_prob, "swarm_logit_ms": t_logit,
            "speedup": t_naive / t_prob,
            "swarm_index_bytes": C * H * d * 2,
            "paper_naive_ms": PAPER.get(S, (None, None))[0],
            "paper_swarm_ms": PAPER.get(S, (None, None))[1]}


def bench_planning(reps, rng, n=100_000, replicated=0.3, ndisks=4, S=1 << 20, E=4096):
    tok = rng.choice(S, n, replace=False)
    extra = rng.choice(n, int(n * replicated), replace=False)
    tok_all = np.concatenate([tok, tok[extra]])
    m = tok_all.shape[0]
    # copies striped round-robin as the store lays clusters out, then shuffled
    disk = (np.arange(m) % ndisks).astype(np.int32)
    off = (np.arange(m) // ndisks).astype(np.uint64) * np.uint64(E) + np.uint64(4096)
    perm = rng.permutation(m)
    tok_all, disk, off = tok_all[perm], disk[perm], off[perm]
    p = plan_reads(tok_all, disk, off, ndisks=ndisks, entry_bytes=E, block_size=4096)
    t = median_ms(lambda: plan_reads(tok_all, disk, off, ndisks=ndisks, entry_bytes=E,
                                     block_size=4096), reps)
    return {"entries": n, "candidates": m, "disks": ndisks, "plan_ms": t,
            "requests": p.num_requests, "bucket_entries": p.disk_entries.tolist()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="131072,262144,524288,1048576")
    ap.add_argument("--cluster-sizes", default="14.9,19.4,25.2,32.8",
                    help="mean entries per cluster at each --tokens value (C = S / size); "
                         "default: the layout's measured sizes (MiniLM over WikiText-2: "
                         "14.9 at 128K, bench_layout.py) grown as S^0.377 as measured "
                         "from 16K to 128K")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="bench-out/select")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'tokens':>8} {'medoids':>8} {'naive ms':>9} {'swarm ms':>9} {'logit ms':>9} "
          f"{'paper':>7} {'speedup':>8}")
    sizes = [float(x) for x in a.cluster_sizes.split(",")]
    toks = [int(x) for x in a.tokens.split(",")]
    if len(sizes) == 1:
        sizes = sizes * len(toks)
    for S, cs in zip(toks, sizes):
        r = bench_selection(S, cs, a.reps, rng)
        rows.append(r)
        print(f"{S:8d} {r['medoids']:8d} {r['naive_ms']:9.3f} {r['swarm_ms']:9.3f} "
              f"{r['swarm_logit_ms']:9.3f} {r['paper_swarm_ms'] or 0:7.3f} "
              f"{r['speedup']:8.1f}", flush=True)
    plan = bench_planning(max(a.reps // 4, 20), rng)
    print(f"planning {plan['entries']} entries ({plan['candidates']} candidate copies, "
          f"{plan['disks']} disks): {plan['plan_ms']:.2f} ms, {plan['requests']} requests")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"selection": rows, "planning": plan, "cluster_sizes": sizes,
                   "command": "tools/bench_select.py " + " ".join(argv or sys.argv[1:])},
                  f, indent=1)
    print(f"wrote {a.out}.json")


if __name__ == "__main__":
    main()
