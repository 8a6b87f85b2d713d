#!/usr/bin/env python3
"""Fig. 12: clustering ablations (SWARM §8.3): SWARM vs Medoid Only vs No Replica.

Medoid Only: a cluster is the medoid and every entry within tau of it (no
eq. 5 check against the other members).  No Replica: Algorithm 1 with one
copy per entry (``max_replicas=1``).  Same profile, radius and caps as SWARM
(``layout/_baselines.py``); all three stored as layers of one store and read
with the same budget; steps interleaved.  Reported: I/O time per decode step,
bytes read, recall and output error.

    tools/testbed run -- python -m tools.bench.fig12_clustering
"""

from __future__ import annotations

import sys

from tools.bench import _common as C
from tools.bench.fig11_methods import LABELS, measure

VARIANTS = ("swarm", "medoid_only", "no_replica")
PAPER = {"medoid_only": 1.14, "no_replica": 1.33}     # SWARM's latency reduction
#: bar panels: (measure, scale, panel title, fio ceiling lines)
plot = C.bar_plot(LABELS, [("io_us_median", 1e3, "I/O time per step (ms, median)", 0),
                           ("bytes_read_median", 1e6, "bytes read per step (MB)", 0),
                           ("recall_mean", 1, "attention-mass recall", 0)],
                  "Fig. 12: clustering ablations")
#: the columns of this figure's table in run_all's summary
SUMMARY_KEYS = ("io_us_median", "bytes_read_median", "recall_mean")


@C.ablation_command("fig12_clustering", __doc__)
def cli(ab):
    lays = {m: ab.layout(m, ratio=ab.ratio) for m in VARIANTS}
    for m, lay in lays.items():
        s = lay.summary()
        print(f"  {m:12s} {s['clusters']:7d} clusters, mean {s['size_mean']:.1f}, "
              f"replication {s['replication']:.2f}", file=sys.stderr)
    ceil = ab.ceilings()
    bench = ab.bench("fig12", [C.Variant(m, lays[m]) for m in VARIANTS])
    res = measure(bench, VARIANTS, ab.positions(), ab.reps, label="fig12")
    bench.close()
    sw = res["swarm"]
    rat = {m: {"latency_ratio": res[m]["io_us_median"] / sw["io_us_median"],
               "bytes_ratio": res[m]["bytes_read_median"] / sw["bytes_read_median"],
               "recall_delta": sw["recall_mean"] - res[m]["recall_mean"],
               "paper_latency_ratio": PAPER[m]} for m in VARIANTS if m != "swarm"}
    ab.report(res, ("read {:7.2f} MB", "bytes_read_median", 1e6),
              ("recall {:.3f}", "recall_mean", 1), ("err {:.3f}", "rel_error_mean", 1))
    return ab.finish("fig12", "clustering ablations", ceil, res, rat, plot, paper=PAPER)


def main(argv=None):
    return C.run(cli, argv)


def summary(p: dict) -> str:
    """This figure's section of ``run_all``'s Markdown summary: a row per
    variant (``_common.variant_table``)."""
    return C.variant_table(p, "Fig. 12: clustering ablations", SUMMARY_KEYS)


if __name__ == "__main__":
    main()
