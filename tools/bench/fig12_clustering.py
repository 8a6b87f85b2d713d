#!/usr/bin/env python3
"""Fig. 12: clustering ablations (SWARM §8.3): SWARM vs Medoid Only vs No Replica.

Medoid Only: a cluster is the medoid and every entry within tau of it (no
eq. 5 check against the other members).  No Replica: Algorithm 1 with one
copy per entry (``max_replicas=1``).  Same profile, radius and caps as SWARM
(``layout/_baselines.py``); all three stored as layers of one store and read
with the same budget; steps interleaved.  Reported: I/O time per decode step,
bytes read, recall and output error.

    tools/testbed run -- python tools/bench/fig12_clustering.py
"""

from __future__ import annotations

import sys

import _common as C
from fig11_methods import LABELS, measure

VARIANTS = ("swarm", "medoid_only", "no_replica")
PAPER = {"medoid_only": 1.14, "no_replica": 1.33}     # SWARM's latency reduction


def main(argv=None):
    ab = C.ablation_setup(__doc__, "fig12_clustering", argv)
    a, trace, disks = ab.args, ab.trace, ab.disks
    start, S, nq, reps = ab.start, ab.S, ab.queries, ab.reps
    lays = {m: C.build_layout(m, trace, start, S, ratio=a.ratio)[0] for m in VARIANTS}
    for m, lay in lays.items():
        s = lay.summary()
        print(f"  {m:12s} {s['clusters']:7d} clusters, mean {s['size_mean']:.1f}, "
              f"replication {s['replication']:.2f}", file=sys.stderr)
    ceil = C.ceilings(disks, a.smoke)
    bench = C.Bench(C.store_dir(a, "fig12"), disks, trace, start, S,
                    [C.Variant(m, lays[m]) for m in VARIANTS], ratio=a.ratio, queue_depth=a.qd)
    pos = C.query_positions(trace, start, S, nq)
    res = measure(bench, VARIANTS, pos, reps, label="fig12")
    bench.close()
    sw = res["swarm"]
    rat = {m: {"latency_ratio": res[m]["io_us_median"] / sw["io_us_median"],
               "bytes_ratio": res[m]["bytes_read_median"] / sw["bytes_read_median"],
               "recall_delta": sw["recall_mean"] - res[m]["recall_mean"],
               "paper_latency_ratio": PAPER[m]} for m in VARIANTS if m != "swarm"}
    for m, r in res.items():
        print(f"  {m:12s} I/O {r['io_us_median'] / 1e3:7.2f} ms, read "
              f"{r['bytes_read_median'] / 1e6:7.2f} MB, recall {r['recall_mean']:.3f}, "
              f"err {r['rel_error_mean']:.3f}", file=sys.stderr)
    return ab.finish("fig12", "clustering ablations", ceil, res, rat, plot, paper=PAPER)


def plot(p, out):
    plt = C.pyplot()
    names = list(p["variants"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    lab = [LABELS.get(n, n) for n in names]
    v = p["variants"]
    axes[0].bar(lab, [v[n]["io_us_median"] / 1e3 for n in names], color="C0")
    axes[0].set_title("I/O time per step (ms, median)", fontsize=10)
    axes[1].bar(lab, [v[n]["bytes_read_median"] / 1e6 for n in names], color="C1")
    axes[1].set_title("bytes read per step (MB)", fontsize=10)
    axes[2].bar(lab, [v[n]["recall_mean"] for n in names], color="C2")
    axes[2].set_title("attention-mass recall", fontsize=10)
    for ax in axes:
        ax.grid(axis="y", alpha=.3)
    fig.suptitle(f"Fig. 12: clustering ablations, S = {p['tokens']}, "
                 f"{p['disks']['count']} disks", fontsize=11)
    C.save_fig(fig, out)


if __name__ == "__main__":
    main()
