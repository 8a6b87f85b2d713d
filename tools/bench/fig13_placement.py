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

from tools.bench import _common as C

PAPER = {"sequential": 2.63, "no_balance": 3.17}     # SWARM's max I/O latency reduction
LABELS = {"swarm": "SWARM (eq. 7)", "sequential": "No Cluster (sequential)",
          "no_balance": "No Balance (disk 0)"}
#: bar panels: (measure, scale, panel title, fio ceiling lines)
plot = C.bar_plot(LABELS, [("io_us_median", 1e3, "I/O time per step (ms, median)", 0),
                           ("read_gbps_median", 1, "aggregate read bandwidth (GB/s)", 1),
                           ("max_mean_load_median", 1, "max / mean disk load", 0)],
                  "Fig. 13: placement", size=(13, 3.8), tick_size=7)
#: the columns of this figure's table in run_all's summary
SUMMARY_KEYS = ("io_us_median", "read_gbps_median", "max_mean_load_median")


@C.ablation_command("fig13_placement", __doc__)
def cli(ab):
    sw = ab.layout("swarm", ratio=ab.ratio)
    seq = ab.layout("no_cluster", group=64)
    ceil = ab.ceilings()
    bench = ab.bench("fig13", [C.Variant("swarm", sw),
                               C.Variant("no_balance", sw, placement="disk0"),
                               C.Variant("sequential", seq)])
    pos = ab.positions()
    rec = {"swarm": [bench.record("swarm", p, accuracy=False) for p in pos],
           "no_balance": [bench.record("no_balance", p, accuracy=False) for p in pos]}
    rec["sequential"] = [bench.record_read("sequential", r["_positions"])
                         for r in rec["swarm"]]
    timed = bench.stream(rec, ab.reps, progress="fig13")
    bench.close()
    res = {n: C.summarize(rec[n], timed[n]) for n in LABELS}
    base = res["swarm"]
    rat = {n: {"latency_ratio": res[n]["io_us_median"] / base["io_us_median"],
               "p90_step_ratio": res[n]["step_us_p90"] / base["step_us_p90"],
               "paper_max_latency_ratio": PAPER[n]} for n in PAPER}
    ab.report(res, ("{:.3f} GB/s read", "read_gbps_median", 1),
              ("max/mean {:.2f}", "max_mean_load_median", 1),
              ("{:.0f} requests", "requests_median", 1))
    return ab.finish("fig13", "placement ablations", ceil, res, rat, plot, paper=PAPER)


def main(argv=None):
    return C.run(cli, argv)


def summary(p: dict) -> str:
    """This figure's section of ``run_all``'s Markdown summary: a row per
    variant (``_common.variant_table``)."""
    return C.variant_table(p, "Fig. 13: placement ablations", SUMMARY_KEYS)


if __name__ == "__main__":
    main()
