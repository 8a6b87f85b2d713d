#!/usr/bin/env python3
"""Fig. 13: SSD placement ablations (SWARM §8.3): eq. 7 vs sequential vs No Balance.

The same entries are read three ways, per held-out query: SWARM (clusters
striped from eq. 7's start disk), "No Cluster" placement (SWARM's selected
entries read from a token-order layout: entries placed sequentially over the
disks regardless of co-activation) and "No Balance" (the same clusters, every
one starting at disk 0: ``placement="disk0"``).  All three layouts are layers
of one store; each is streamed as in Fig. 11.  Reported: I/O time
per step, aggregate read bandwidth, max/mean disk load.

    tools/testbed run -- python -m tools.bench.fig13_placement
"""

from __future__ import annotations

import sys

from tools.bench import _common as C

PAPER = {"sequential": 2.63, "no_balance": 3.17}     # SWARM's max I/O latency reduction
LABELS = {"swarm": "SWARM (eq. 7)", "sequential": "No Cluster (sequential)",
          "no_balance": "No Balance (disk 0)"}


@C.ablation_command("fig13_placement", __doc__)
def cli(ab):
    cfg, trace, disks = ab.cfg, ab.trace, ab.disks
    start, S, nq, reps = ab.start, ab.S, ab.queries, ab.reps
    sw = C.build_layout("swarm", trace, start, S, cache=cfg.cache, ratio=ab.ratio)[0]
    seq = C.build_layout("no_cluster", trace, start, S, cache=cfg.cache, group=64)[0]
    ceil = C.ceilings(disks, cfg.smoke)
    bench = C.Bench(C.store_dir(cfg, "fig13"), disks, trace, start, S,
                    [C.Variant("swarm", sw), C.Variant("no_balance", sw, placement="disk0"),
                     C.Variant("sequential", seq)], ratio=ab.ratio, cfg=cfg)
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


def main(argv=None):
    return C.run(cli, argv)


def plot(p, out):
    C.variant_bars(p, out, LABELS,
                   [("io_us_median", 1e3, "I/O time per step (ms, median)", 0),
                    ("read_gbps_median", 1, "aggregate read bandwidth (GB/s)", 1),
                    ("max_mean_load_median", 1, "max / mean disk load", 0)],
                   f"Fig. 13: placement, S = {p['tokens']}, {p['disks']['count']} disks",
                   size=(13, 3.8), tick_size=7)


if __name__ == "__main__":
    main()
