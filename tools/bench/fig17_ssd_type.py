#!/usr/bin/env python3
"""Fig. 17: high-end vs low-end SSDs: 4 x PM9A3 and 4 x Optane 900P (scaled).

One invocation measures one device profile (the testbed's, via ``--disks``):
every method at each prefix length on the first 4 devices, as in Fig. 11.
``--merge`` combines the per-profile JSON files into the figure.  run_all.py
runs it on the main (pm9a3) testbed and on a temporary 900p testbed.

    tools/testbed run -- python -m tools.bench.fig17_ssd_type            # pm9a3
    tools/testbed --name swarmfs-900p up --disks 4 --size 2G --profile 900p
    SWARMFS_TESTBED_NAME=swarmfs-900p tools/testbed run -- \\
        python -m tools.bench.fig17_ssd_type --disks testbed:swarmfs-900p
    python -m tools.bench.fig17_ssd_type --merge
"""

from __future__ import annotations

import json
import pathlib
import sys

import click

from tools import _options as O
from tools.bench import _common as C
from tools.bench.fig11_methods import LABELS, METHODS, run_methods


@C.command("fig17_ssd_type", __doc__)
@click.option("--tokens", type=O.CommaList(int, item=O.COUNT, keep_text=True), default=None,
              help="comma list of prefix lengths")
@click.option("--ndisks", type=O.DISKS, default=4, show_default=True)
@click.option("--ratio", type=O.RATIO, default=0.1, show_default=True)
@click.option("--methods", type=O.CommaList(choices=METHODS, keep_text=True),
              default=",".join(METHODS), show_default=True)
@click.option("--merge", is_flag=True, help="only combine per-profile results")
def cli(cfg, tokens, ndisks, ratio, methods, merge):
    base = cfg.prefix()
    if merge:
        return merge_profiles(cfg, base)
    sizes = [int(x) for x in (tokens or ("1024,2048" if cfg.smoke else
                                         "16384,32768,65536,131072")).split(",")]
    nq = cfg.queries or (2 if cfg.smoke else 12)
    reps = cfg.reps or (1 if cfg.smoke else 2)
    methods = methods.split(",")
    trace, disks, _ = C.setup(cfg, "fig17_ssd_type", trace_tokens=4096 if cfg.smoke else 0)
    d = disks.first(min(ndisks, disks.count))
    profile = (d.testbed or {}).get("profile") or "files"
    ceil = C.ceilings(d, cfg.smoke)
    points = []
    for S in sizes:
        start, S = C.context(trace, S, "wikitext2")
        print(f"fig17: {profile}, S = {S}, {d.count} disks", file=sys.stderr)
        r = run_methods(cfg, trace, d, start, S, methods, ratio=ratio, nq=nq, reps=reps,
                        label=f"fig17 {profile} S={S}", store=f"fig17-{profile}")
        points.append(r)
        for m, x in r["methods"].items():
            print(f"  {m:12s} I/O {x['io_us_median'] / 1e3:8.2f} ms, "
                  f"{x['eff_gbps_median']:.3f} GB/s", file=sys.stderr)
    payload = {"figure": "fig17", "profile": profile, "ratio": ratio,
               "disks": d.describe(), "queries": nq, "reps": reps, "ceiling": ceil,
               "ceiling_after": C.ceilings(d, cfg.smoke), "points": points}
    C.write_json(cfg, pathlib.Path(f"{base}-{profile}"), payload)
    return merge_profiles(cfg, base)


def main(argv=None):
    return C.run(cli, argv)


def merge_profiles(cfg, base):
    """Combine the per-profile JSON files ``BASE-<profile>.json`` into the figure."""
    parts = {}
    for p in sorted(base.parent.glob(base.name + "-*.json")):
        j = json.loads(p.read_text())
        if "profile" in j and p.stem == f"{base.name}-{j['profile']}":
            parts[j["profile"]] = j
    if not parts:
        raise SystemExit(f"no {base.name}-<profile>.json to merge")
    payload = {"figure": "fig17", "title": "SSD type", "profiles": parts,
               "summary": {prof: [{"tokens": pt["tokens"],
                                   **{m: {"io_us": x["io_us_median"],
                                          "eff_gbps": x["eff_gbps_median"]}
                                      for m, x in pt["methods"].items()}}
                                  for pt in j["points"]] for prof, j in parts.items()}}
    return C.finish(cfg, base, payload, plot)


def plot(p, out):
    profs = list(p["profiles"])
    with C.figure(out, len(profs), (5.5 * len(profs), 4), "Fig. 17: SSD type",
                  legend=7) as axes:
        for ax, prof in zip(axes, profs, strict=True):
            j = p["profiles"][prof]
            pts = j["points"]
            C.lines(ax, [pt["tokens"] / 1024 for pt in pts],
                    {LABELS.get(m, m): [pt["methods"][m]["eff_gbps_median"] for pt in pts]
                     for m in pts[0]["methods"]})
            C.ceiling_lines(ax, j.get("ceiling"))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prefix length (K tokens)")
            ax.set_ylabel("effective bandwidth (GB/s, median)")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{j['disks']['count']} x {prof}", fontsize=10)


def summary(p: dict) -> str:
    """This figure's section of ``run_all``'s Markdown summary: per device
    profile, every method's effective bandwidth per prefix length."""
    out = ["### Fig. 17: SSD type (4 disks; effective GB/s, median)\n"]
    for prof, j in p["profiles"].items():
        c = j.get("ceiling") or {}
        ms = list(j["points"][0]["methods"])
        out.append(f"{prof}" + (f" (fio 128k {c['bw_128k']['gb_per_s']:.3f} GB/s, "
                                f"4k {c['iops_4k']['gb_per_s']:.3f} GB/s)" if c else "")
                   + ":\n")
        rows = [(pt["tokens"], *(f"{pt['methods'][m]['eff_gbps_median']:.3f}" for m in ms))
                for pt in j["points"]]
        out.append(C.md_table(rows, ("S", *(LABELS.get(m, m) for m in ms)), 0))
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
