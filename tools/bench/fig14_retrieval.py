#!/usr/bin/env python3
"""Fig. 14: online retrieval ablations (SWARM §6.1, §8.3) on SWARM's layout.

Static (first copy, no dedup: ``policy="first", dedup=False``), No Balance
(dedup, first copy: ``policy="first"``), No Dedup (``dedup=False``) and SWARM
(eq. 8 dedup + entry buckets), all reading the same stored layer for the same
selected clusters; streamed as in Fig. 11.  Reported: I/O time and I/O volume per step,
max/mean disk load.  Note: without dedup every selected copy is read where it
lies, so the copy policy has nothing to choose and Static and No Dedup
produce the same plan in this planner.

    tools/testbed run -- python -m tools.bench.fig14_retrieval
"""

from __future__ import annotations

from tools.bench import _common as C

POLICIES = {"swarm": {"policy": "balanced", "dedup": True},
            "static": {"policy": "first", "dedup": False},
            "no_balance": {"policy": "first", "dedup": True},
            "no_dedup": {"policy": "balanced", "dedup": False}}
LABELS = {"swarm": "SWARM", "static": "Static", "no_balance": "No Balance",
          "no_dedup": "No Dedup"}
PAPER = {"latency_ratio_mean": 2.57, "volume_ratio_mean": 1.24}
#: bar panels: (measure, scale, panel title, fio ceiling lines)
plot = C.bar_plot(LABELS, [("io_us_median", 1e3, "I/O time per step (ms, median)", 0),
                           ("bytes_read_median", 1e6, "I/O volume per step (MB)", 0),
                           ("max_mean_load_median", 1, "max / mean disk load", 0)],
                  "Fig. 14: retrieval")
#: the columns of this figure's table in run_all's summary
SUMMARY_KEYS = ("io_us_median", "bytes_read_median", "max_mean_load_median")


@C.ablation_command("fig14_retrieval", __doc__)
def cli(ab):
    sw = ab.layout("swarm", ratio=ab.ratio)
    ceil = ab.ceilings()
    bench = ab.bench("fig14", [C.Variant(n, sw, store_as=None if n == "swarm" else "swarm", **kw)
                               for n, kw in POLICIES.items()])
    res = bench.measure(list(POLICIES), list(ab.positions()), ab.reps, accuracy=False,
                        progress="fig14")
    bench.close()
    base = res["swarm"]
    rat = {n: {"latency_ratio": res[n]["io_us_median"] / base["io_us_median"],
               "volume_ratio": res[n]["bytes_read_median"] / base["bytes_read_median"]}
           for n in POLICIES if n != "swarm"}
    means = {"latency_ratio_mean": sum(r["latency_ratio"] for r in rat.values()) / len(rat),
             "volume_ratio_mean": sum(r["volume_ratio"] for r in rat.values()) / len(rat)}
    ab.report(res, ("read {:7.2f} MB", "bytes_read_median", 1e6),
              ("max/mean {:.2f}", "max_mean_load_median", 1))
    return ab.finish("fig14", "retrieval ablations", ceil, res, rat, plot, summary=means,
                     paper=PAPER)


def main(argv=None):
    return C.run(cli, argv)


def summary(p: dict) -> str:
    """This figure's section of ``run_all``'s Markdown summary: a row per
    variant (``_common.variant_table``)."""
    return C.variant_table(p, "Fig. 14: retrieval ablations", SUMMARY_KEYS)


if __name__ == "__main__":
    main()
