#!/usr/bin/env python3
"""Fig. 13: SSD placement ablations (SWARM §8.3): eq. 7 vs sequential vs No Balance.

The same entries are read three ways, per held-out query: SWARM (clusters
striped from eq. 7's start disk), "No Cluster" placement (SWARM's selected
entries read from a token-order layout: entries placed sequentially over the
disks regardless of co-activation) and "No Balance" (the same clusters, every
one starting at disk 0: ``placement="disk0"``).  All three layouts are layers
of one store; each is streamed as in Fig. 11.  Reported: I/O time
per step, aggregate read bandwidth, max/mean disk load.

    tools/testbed run -- python tools/bench/fig13_placement.py
"""

from __future__ import annotations

import sys

import _common as C

PAPER = {"sequential": 2.63, "no_balance": 3.17}     # SWARM's max I/O latency reduction
LABELS = {"swarm": "SWARM (eq. 7)", "sequential": "No Cluster (sequential)",
          "no_balance": "No Balance (disk 0)"}


def main(argv=None):
    ab = C.ablation_setup(__doc__, "fig13_placement", argv)
    a, trace, disks = ab.args, ab.trace, ab.disks
    start, S, nq, reps = ab.start, ab.S, ab.queries, ab.reps
    sw = C.build_layout("swarm", trace, start, S, ratio=a.ratio)[0]
    seq = C.build_layout("no_cluster", trace, start, S, group=64)[0]
    ceil = C.ceilings(disks, a.smoke)
    bench = C.Bench(C.store_dir(a, "fig13"), disks, trace, start, S,
                    [C.Variant("swarm", sw), C.Variant("no_balance", sw, placement="disk0"),
                     C.Variant("sequential", seq)], ratio=a.ratio, queue_depth=a.qd)
    pos = C.query_positions(trace, start, S, nq)
    rec = {"swarm": [bench.record("swarm", p, accuracy=False) for p in pos],
           "no_balance": [bench.record("no_balance", p, accuracy=False) for p in pos]}
    rec["sequential"] = [bench.record_read("sequential", r["_positions"])
                         for r in rec["swarm"]]
    timed = bench.stream(rec, reps, progress="fig13")
    bench.close()
    res = {n: C.summarize(rec[n], timed[n]) for n in LABELS}
    base = res["swarm"]
    rat = {n: {"latency_ratio": res[n]["io_us_median"] / base["io_us_median"],
               "p90_step_ratio": res[n]["step_us_p90"] / base["step_us_p90"],
               "paper_max_latency_ratio": PAPER[n]} for n in PAPER}
    for n, r in res.items():
        print(f"  {n:12s} I/O {r['io_us_median'] / 1e3:7.2f} ms, "
              f"{r['read_gbps_median']:.3f} GB/s read, max/mean {r['max_mean_load_median']:.2f}, "
              f"{r['requests_median']:.0f} requests", file=sys.stderr)
    return ab.finish("fig13", "placement ablations", ceil, res, rat, plot, paper=PAPER)


def plot(p, out):
    plt = C.pyplot()
    names = list(p["variants"])
    v = p["variants"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    lab = [LABELS[n] for n in names]
    axes[0].bar(lab, [v[n]["io_us_median"] / 1e3 for n in names], color="C0")
    axes[0].set_title("I/O time per step (ms, median)", fontsize=10)
    axes[1].bar(lab, [v[n]["read_gbps_median"] for n in names], color="C1")
    C.ceiling_lines(axes[1], p["ceiling"])
    if p["ceiling"]:
        axes[1].legend(fontsize=7)
    axes[1].set_title("aggregate read bandwidth (GB/s)", fontsize=10)
    axes[2].bar(lab, [v[n]["max_mean_load_median"] for n in names], color="C2")
    axes[2].set_title("max / mean disk load", fontsize=10)
    for ax in axes:
        ax.grid(axis="y", alpha=.3)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"Fig. 13: placement, S = {p['tokens']}, {p['disks']['count']} disks",
                 fontsize=11)
    C.save_fig(fig, out)


if __name__ == "__main__":
    main()
