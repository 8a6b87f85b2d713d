#!/usr/bin/env python3
"""Fig. 14: online retrieval ablations (SWARM §6.1, §8.3) on SWARM's layout.

Static (first copy, no dedup: ``policy="first", dedup=False``), No Balance
(dedup, first copy: ``policy="first"``), No Dedup (``dedup=False``) and SWARM
(eq. 8 dedup + entry buckets), all reading the same stored layer for the same
selected clusters; streamed as in Fig. 11.  Reported: I/O time and I/O volume per step,
max/mean disk load.  Note: without dedup every selected copy is read where it
lies, so the copy policy has nothing to choose and Static and No Dedup
produce the same plan in this planner.

    tools/testbed run -- python tools/bench/fig14_retrieval.py
"""

from __future__ import annotations

import sys

import _common as C

POLICIES = {"swarm": {"policy": "balanced", "dedup": True},
            "static": {"policy": "first", "dedup": False},
            "no_balance": {"policy": "first", "dedup": True},
            "no_dedup": {"policy": "balanced", "dedup": False}}
LABELS = {"swarm": "SWARM", "static": "Static", "no_balance": "No Balance",
          "no_dedup": "No Dedup"}
PAPER = {"latency_ratio_mean": 2.57, "volume_ratio_mean": 1.24}


def main(argv=None):
    ab = C.ablation_setup(__doc__, "fig14_retrieval", argv)
    a, trace, disks = ab.args, ab.trace, ab.disks
    start, S, nq, reps = ab.start, ab.S, ab.queries, ab.reps
    sw = C.build_layout("swarm", trace, start, S, ratio=a.ratio)[0]
    ceil = C.ceilings(disks, a.smoke)
    variants = [C.Variant(n, sw, store_as=None if n == "swarm" else "swarm", **kw)
                for n, kw in POLICIES.items()]
    bench = C.Bench(C.store_dir(a, "fig14"), disks, trace, start, S, variants,
                    ratio=a.ratio, queue_depth=a.qd)
    pos = C.query_positions(trace, start, S, nq)
    res = bench.measure(list(POLICIES), list(pos), reps, accuracy=False, progress="fig14")
    bench.close()
    base = res["swarm"]
    rat = {n: {"latency_ratio": res[n]["io_us_median"] / base["io_us_median"],
               "volume_ratio": res[n]["bytes_read_median"] / base["bytes_read_median"]}
           for n in POLICIES if n != "swarm"}
    summary = {"latency_ratio_mean": sum(r["latency_ratio"] for r in rat.values()) / len(rat),
               "volume_ratio_mean": sum(r["volume_ratio"] for r in rat.values()) / len(rat)}
    for n, r in res.items():
        print(f"  {n:12s} I/O {r['io_us_median'] / 1e3:7.2f} ms, read "
              f"{r['bytes_read_median'] / 1e6:7.2f} MB, max/mean {r['max_mean_load_median']:.2f}",
              file=sys.stderr)
    return ab.finish("fig14", "retrieval ablations", ceil, res, rat, plot, summary=summary,
                     paper=PAPER)


def plot(p, out):
    plt = C.pyplot()
    names = list(p["variants"])
    v = p["variants"]
    lab = [LABELS[n] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    axes[0].bar(lab, [v[n]["io_us_median"] / 1e3 for n in names], color="C0")
    axes[0].set_title("I/O time per step (ms, median)", fontsize=10)
    axes[1].bar(lab, [v[n]["bytes_read_median"] / 1e6 for n in names], color="C1")
    axes[1].set_title("I/O volume per step (MB)", fontsize=10)
    axes[2].bar(lab, [v[n]["max_mean_load_median"] for n in names], color="C2")
    axes[2].set_title("max / mean disk load", fontsize=10)
    for ax in axes:
        ax.grid(axis="y", alpha=.3)
    fig.suptitle(f"Fig. 14: retrieval, S = {p['tokens']}, {p['disks']['count']} disks",
                 fontsize=11)
    C.save_fig(fig, out)


if __name__ == "__main__":
    main()
