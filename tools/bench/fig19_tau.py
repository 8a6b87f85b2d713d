#!/usr/bin/env python3
"""Fig. 19: sensitivity to the clustering radius tau, with dataset shift (§8.4).

For each (context dataset, profiling dataset) pair and each tau, SWARM's
layout of an S-token context is built, stored and measured.  "Shifted" pairs
profile the context's keys with the queries of another dataset's S-token
slice (``build_layout(profile_start=...)``, like ``build_store(profile_cap=)``):
the clusters come from a different text's attention, the held-out decode
queries are the context's own continuation.  Reported: I/O time, effective
bandwidth, recall, clusters and replication.

    tools/testbed run -- python -m tools.bench.fig19_tau
"""

from __future__ import annotations

import sys

import click

from tools import _options as O
from tools.bench import _common as C
from tools.bench.fig11_methods import measure

PAIRS = "wikitext2:wikitext2,shakespeare:shakespeare,gsm8k:gsm8k," \
        "shakespeare:wikitext2,gsm8k:wikitext2,wikitext2:gsm8k"


@C.command("fig19_tau", __doc__)
@C.tokens_option
@click.option("--taus", type=O.CommaList(float, item=O.FiniteFloat(0, 1), keep_text=True),
              default=None, help="comma list of tau")
@click.option("--pairs", type=O.CommaList(choices=[f"{a}:{b}" for a in C.DATASETS
                                                  for b in C.DATASETS], keep_text=True),
              default=None, help="context:profile dataset pairs")
@click.option("--ratio", type=O.RATIO, default=0.1, show_default=True)
def cli(cfg, tokens, taus, pairs, ratio):
    S = tokens or (2048 if cfg.smoke else 32768)
    taus = [float(x) for x in (taus or ("0.5,0.7" if cfg.smoke else
                                        "0.3,0.45,0.6,0.75,0.9")).split(",")]
    pairs = [tuple(p.split(":")) for p in (pairs or ("wikitext2:wikitext2" if cfg.smoke
                                                     else PAIRS)).split(",")]
    nq = cfg.queries or (2 if cfg.smoke else 12)
    reps = cfg.reps or (1 if cfg.smoke else 2)
    trace, disks, out = C.setup(cfg, "fig19_tau", trace_tokens=4096 if cfg.smoke else 0)
    ceil = C.ceilings(disks, cfg.smoke)
    rows = []
    for ctx, prof in pairs:
        start, S = C.context(trace, S, ctx)
        pstart = None if prof == ctx else C.context(trace, S, prof)[0]
        lays = {}
        for tau in taus:
            lays[f"tau={tau}"] = C.build_layout("swarm", trace, start, S, cache=cfg.cache,
                                                ratio=ratio, tau=tau, profile_start=pstart)[0]
        bench = C.Bench(C.store_dir(cfg, "fig19"), disks, trace, start, S,
                        [C.Variant(n, lay) for n, lay in lays.items()], ratio=ratio, cfg=cfg)
        pos = C.query_positions(trace, start, S, nq)
        res = measure(bench, list(lays), pos, reps, label=f"fig19 {ctx}<-{prof}")
        bench.close()
        for tau in taus:
            r = res[f"tau={tau}"]
            rows.append({"context": ctx, "profile": prof, "shifted": prof != ctx, "tau": tau,
                         "tokens": S, **{k: v for k, v in r.items() if k != "layout"},
                         "clusters_total": r["layout"]["clusters"],
                         "size_mean": r["layout"]["size_mean"],
                         "replication": r["layout"]["replication"]})
            print(f"  {ctx:11s} <- {prof:11s} tau {tau:.2f}: I/O "
                  f"{r['io_us_median'] / 1e3:7.2f} ms, {r['eff_gbps_median']:.3f} GB/s, "
                  f"recall {r['recall_mean']:.3f}, {r['layout']['clusters']} clusters, "
                  f"replication {r['layout']['replication']:.2f}", file=sys.stderr)
    payload = {"figure": "fig19", "title": "tau sensitivity with dataset shift", "tokens": S,
               "ratio": ratio, "disks": disks.describe(), "queries": nq, "reps": reps,
               "ceiling": ceil, "rows": rows}
    return C.finish(cfg, out, payload, plot)


def main(argv=None):
    return C.run(cli, argv)


def plot(p, out):
    pairs = list(dict.fromkeys((r["context"], r["profile"]) for r in p["rows"]))
    with C.figure(out, 3, (15, 4), f"Fig. 19: tau, S = {p['tokens']}, "
                  f"{p['disks']['count']} disks") as axes:
        for ctx, prof in pairs:
            rr = [r for r in p["rows"] if r["context"] == ctx and r["profile"] == prof]
            t = [r["tau"] for r in rr]
            lab = ctx if ctx == prof else f"{ctx} (profiled on {prof})"
            ls = "o-" if ctx == prof else "s--"
            for ax, key, scale in zip(axes, ("io_us_median", "eff_gbps_median", "recall_mean"),
                                      (1e3, 1, 1), strict=True):
                C.lines(ax, t, {lab: [r[key] for r in rr]}, ls, scale=scale)
        C.ceiling_lines(axes[1], p["ceiling"])
        for ax, yl in zip(axes, ("I/O time per step (ms, median)", "effective bandwidth (GB/s)",
                                 "attention-mass recall"), strict=True):
            ax.set_xlabel("tau")
            ax.set_ylim(bottom=0)
            ax.set_ylabel(yl)
        axes[2].legend(fontsize=7)


def summary(p: dict) -> str:
    """This figure's section of ``run_all``'s Markdown summary: a row per
    (context, profile, tau)."""
    rows = [(r["context"], r["profile"], r["tau"], C.ms_cell(r["io_us_median"]),
             f"{r['eff_gbps_median']:.3f}", f"{r['recall_mean']:.3f}", r["clusters_total"],
             f"{r['replication']:.2f}") for r in p["rows"]]
    return "\n".join([f"### Fig. 19: tau with dataset shift (S = {p['tokens']})\n",
                      C.md_table(rows, ("context", "profiled on", "tau", "I/O ms", "eff. GB/s",
                                        "recall", "clusters", "replication"), 2), ""])


if __name__ == "__main__":
    main()
