#!/usr/bin/env python3
"""Fig. 18: effective bandwidth and I/O time vs number of SSDs (1 to 8).

For N = 1, 2, 4, 8: every method's layout stored on the first N testbed
devices (one store, replaced for each N), measured side by side as in
Fig. 11, with the fio ceiling of those N devices measured in the same run.
Targets: SWARM's effective bandwidth at 8 disks >= 7x that at 1 disk, and
>= 90% of the fio 128 KiB ceiling at 4 and 8 disks.

    tools/testbed run -- python -m tools.bench.fig18_num_disks
"""

from __future__ import annotations

import sys

import click

from tools import _options as O
from tools.bench import _common as C
from tools.bench.fig11_methods import LABELS, METHODS, method_layouts, run_methods


@C.command("fig18_num_disks", __doc__)
@C.tokens_option
@click.option("--counts", type=O.CommaList(int, item=O.DISKS, keep_text=True), default=None,
              help="comma list of disk counts")
@C.dataset_option
@click.option("--ratio", type=O.RATIO, default=0.1, show_default=True)
@click.option("--methods", type=O.CommaList(choices=METHODS, keep_text=True),
              default=",".join(METHODS), show_default=True)
def cli(cfg, tokens, counts, dataset, ratio, methods):
    S = tokens or (2048 if cfg.smoke else 65536)
    counts = [int(x) for x in (counts or ("1,2" if cfg.smoke else "1,2,4,8")).split(",")]
    nq = cfg.queries or (3 if cfg.smoke else 16)
    reps = cfg.reps or (1 if cfg.smoke else 4)
    methods = methods.split(",")
    trace, disks, out = C.setup(cfg, "fig18_num_disks", trace_tokens=4096 if cfg.smoke else 0)
    start, S = C.context(trace, S, dataset)
    lays = method_layouts(cfg, trace, start, S, methods, ratio=ratio)
    points = []
    for n in counts:
        d = disks.first(n)
        print(f"fig18: {n} disks, S = {S}", file=sys.stderr)
        ceil = C.ceilings(d, cfg.smoke)
        r = run_methods(cfg, trace, d, start, S, methods, ratio=ratio, nq=nq, reps=reps,
                        label=f"fig18 N={n}", store="fig18", layouts=lays)
        r.update(disks=n, ceiling=ceil)
        points.append(r)
        for m, x in r["methods"].items():
            frac = (x["eff_gbps_median"] / ceil["bw_128k"]["gb_per_s"]) if ceil else None
            print(f"  N={n} {m:12s} I/O {x['io_us_median'] / 1e3:8.2f} ms, "
                  f"{x['eff_gbps_median']:.3f} GB/s"
                  + (f" = {frac:.0%} of fio 128k" if frac else ""), file=sys.stderr)
    targets = _targets(points)
    payload = {"figure": "fig18", "title": "number of SSDs", "tokens": S, "ratio": ratio,
               "dataset": dataset, "disks": disks.describe(), "queries": nq, "reps": reps,
               "points": points, "targets": targets}
    return C.finish(cfg, out, payload, plot)


def main(argv=None):
    return C.run(cli, argv)


def _targets(points):
    by = {p["disks"]: p for p in points}
    t = {}
    if 1 in by and max(by) > 1:
        hi = max(by)
        t["swarm_scaling"] = {"from": 1, "to": hi,
                              "ratio": by[hi]["methods"]["swarm"]["eff_gbps_median"] /
                              by[1]["methods"]["swarm"]["eff_gbps_median"], "target": 7.0}
    for n, p in by.items():
        if p.get("ceiling"):
            c = p["ceiling"]
            sw = p["methods"]["swarm"]["eff_gbps_median"]
            t[f"swarm_vs_fio_{n}"] = {"eff_gbps": sw, "fio_128k": c["bw_128k"]["gb_per_s"],
                                      "fio_4k": c["iops_4k"]["gb_per_s"],
                                      "fraction_128k": sw / c["bw_128k"]["gb_per_s"],
                                      "target": 0.9}
    return t


def plot(p, out):
    pts = p["points"]
    n = [x["disks"] for x in pts]
    methods = list(pts[0]["methods"])
    with C.figure(out, 2, (11, 4), f"Fig. 18: S = {p['tokens']}, r = {p['ratio']}",
                  legend=7) as axes:
        C.lines(axes[0], n, {LABELS.get(m, m): [x["methods"][m]["eff_gbps_median"] for x in pts]
                             for m in methods})
        C.lines(axes[1], n, {LABELS.get(m, m): [x["methods"][m]["io_us_median"] for x in pts]
                             for m in methods}, scale=1e3)
        if pts[0].get("ceiling"):
            axes[0].plot(n, [x["ceiling"]["bw_128k"]["gb_per_s"] for x in pts], "k--",
                         label="fio 128 KiB ceiling")
            axes[0].plot(n, [x["ceiling"]["iops_4k"]["gb_per_s"] for x in pts], "k:",
                         label="fio 4 KiB ceiling")
        axes[0].set_ylabel("effective bandwidth (GB/s, median)")
        axes[1].set_ylabel("I/O time per step (ms, median)")
        axes[1].set_yscale("log")
        axes[0].set_ylim(bottom=0)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(n, [str(x) for x in n])
            ax.set_xlabel("SSDs")


def summary(p: dict) -> str:
    """This figure's section of ``run_all``'s Markdown summary: per disk count
    the fio ceilings and every method's effective bandwidth, then the targets."""
    out = [f"### Fig. 18: number of SSDs (S = {p['tokens']})\n"]
    ms = list(p["points"][0]["methods"])
    rows = []
    for pt in p["points"]:
        c = pt.get("ceiling") or {}
        fio = ((f"{c['bw_128k']['gb_per_s']:.3f}", f"{c['iops_4k']['gb_per_s']:.3f}")
               if c else ("-", "-"))
        rows.append((pt["disks"], *fio,
                     *(f"{pt['methods'][m]['eff_gbps_median']:.3f}" for m in ms),
                     C.ms_cell(pt["methods"]["swarm"]["io_us_median"])))
    out.append(C.md_table(rows, ("SSDs", "fio 128k GB/s", "fio 4k GB/s",
                                 *(f"{LABELS.get(m, m)} GB/s" for m in ms), "SWARM I/O ms"), 0))
    out.append("")
    for k, t in p["targets"].items():
        out.append(f"- {k}: " + ", ".join(f"{a}={C.num_cell(b)}" for a, b in t.items()))
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
