#!/usr/bin/env python3
"""Fig. 16: SWARM's I/O time per decode step vs prefix length, batch 1, 4 and 8.

Contexts are prefixes of the trace (WikiText-2, then Tiny Shakespeare, GSM8K
and the repeated sequence beyond 773K tokens; see ``_common``).  A batch is B
held-out queries (consecutive decode positions standing in for B requests
sharing the prefix): the Retriever unites their clusters into one
deduplicated, balanced read.  One store per prefix length (the previous one
is replaced).  Contexts longer than 256K tokens are laid out per 128K-token
segment (``_common.layouts._segmented``).  Also records the selection latency
(medoid scoring + cluster choice) and the medoid index size at each length,
used by Table 4.

    tools/testbed run -- python -m tools.bench.fig16_prefix_batch
"""

from __future__ import annotations

import sys

import click
import numpy as np

from tools import _options as O
from tools.bench import _common as C

#: longest context laid out in one piece; longer ones per SEGMENT tokens
FULL_MAX = 262144
SEGMENT = 131072


@C.command("fig16_prefix_batch", __doc__)
@click.option("--tokens", type=O.CommaList(int, item=O.COUNT, keep_text=True), default=None,
              help="comma list of prefix lengths")
@click.option("--batches", type=O.CommaList(int, item=O.COUNT, keep_text=True), default="1,4,8",
              show_default=True)
@click.option("--ratio", type=O.RATIO, default=0.1, show_default=True)
def cli(cfg, tokens, batches, ratio):
    sizes = [int(x) for x in (tokens or ("1024,2048" if cfg.smoke else
                                         "131072,262144,524288,1048576")).split(",")]
    batches = [int(x) for x in batches.split(",")]
    nsteps = cfg.queries or (2 if cfg.smoke else 4)         # batched steps per point
    reps = cfg.reps or (1 if cfg.smoke else 2)
    need = max(sizes) + C.QUERY_STRIDE * nsteps * max(batches) + 8
    trace, disks, out = C.setup(cfg, "fig16_prefix_batch", trace_tokens=max(need, 4096))
    ceil_before = C.ceilings(disks, cfg.smoke)
    rows = []
    for S in sizes:
        start, S = C.context(trace, S, "wikitext2")
        with C.timer(f"fig16 layout S={S}"):
            lay, hit = C.build_layout("swarm", trace, start, S, cache=cfg.cache, ratio=ratio,
                                      **({"segment": SEGMENT} if S > FULL_MAX else {}))
        with C.timer(f"fig16 store S={S}"):
            bench = C.Bench(C.store_dir(cfg, "fig16"), disks, trace, start, S,
                            [C.Variant("swarm", lay)], ratio=ratio, cfg=cfg)
        pos = C.query_positions(trace, start, S, nsteps * max(batches))
        rec = {f"B={B}": [bench.record("swarm", list(pos[i * B:(i + 1) * B]),
                                       accuracy=(B == 1)) for i in range(nsteps)]
               for B in batches}
        timed = bench.stream(rec, reps, progress=f"fig16 S={S}")
        for B in batches:
            sel = rec[f"B={B}"]
            rows.append({"tokens": S, "batch": B, **C.summarize(sel, timed[f"B={B}"]),
                         "score_plus_select_us_median": float(np.median(
                             [r["score_us"] + r["select_us"] for r in sel])),
                         "index_bytes": bench.index_bytes("swarm"),
                         "clusters": lay.num_clusters,
                         "mean_cluster_size": float(lay.sizes.mean()),
                         "replication": lay.summary()["replication"],
                         "layout_build_s": lay.seconds, "layout_cached": hit,
                         "recall_mean_b1": C.mean(rec[f"B={batches[0]}"], "recall"),
                         "rel_error_mean_b1": C.mean(rec[f"B={batches[0]}"], "rel_error")})
            r = rows[-1]
            print(f"  S={S:8d} B={B}: I/O {r['io_us_median'] / 1e3:8.2f} ms, "
                  f"{r['eff_gbps_median']:.3f} GB/s, read {r['bytes_read_median'] / 1e6:.1f} MB,"
                  f" {r['requests_median']:.0f} requests", file=sys.stderr)
        bench.close()
    payload = {"figure": "fig16", "title": "prefix length x batch size", "ratio": ratio,
               "disks": disks.describe(), "steps_per_point": nsteps, "reps": reps,
               "ceiling_before": ceil_before, "ceiling_after": C.ceilings(disks, cfg.smoke),
               "rows": rows}
    return C.finish(cfg, out, payload, plot)


def main(argv=None):
    return C.run(cli, argv)


def plot(p, out):
    batches = sorted({r["batch"] for r in p["rows"]})
    rows = {B: [r for r in p["rows"] if r["batch"] == B] for B in batches}
    x = [r["tokens"] / 1024 for r in rows[batches[0]]]
    with C.figure(out, 2, (11, 4), f"Fig. 16: SWARM, r = {p['ratio']}, "
                  f"{p['disks']['count']} disks", legend=8) as axes:
        C.lines(axes[0], x, {f"batch {B}": [r["io_us_median"] for r in rr]
                             for B, rr in rows.items()}, scale=1e3)
        C.lines(axes[1], x, {f"batch {B}": [r["eff_gbps_median"] for r in rr]
                             for B, rr in rows.items()})
        C.ceiling_lines(axes[1], p["ceiling_before"])
        axes[0].set_ylabel("I/O time per step (ms, median)")
        axes[1].set_ylabel("effective bandwidth (GB/s, median)")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prefix length (K tokens)")
        axes[0].set_yscale("log")
        axes[1].set_ylim(bottom=0)


def summary(p: dict) -> str:
    """This figure's section of ``run_all``'s Markdown summary: a row per
    (prefix length, batch)."""
    rows = [(r["tokens"], r["batch"], C.ms_cell(r["io_us_median"]),
             f"{r['eff_gbps_median']:.3f}", f"{r['bytes_read_median'] / 1e6:.1f}",
             f"{r['requests_median']:.0f}", f"{r['recall_mean_b1']:.3f}") for r in p["rows"]]
    return "\n".join(["### Fig. 16: prefix length x batch (SWARM)\n",
                      C.md_table(rows, ("S", "batch", "I/O ms", "eff. GB/s", "MB read",
                                        "requests", "recall (B=1)"), 0), ""])


if __name__ == "__main__":
    main()
