#!/usr/bin/env python3
"""Fig. 17: high-end vs low-end SSDs: 4 x PM9A3 and 4 x Optane 900P (scaled).

One invocation measures one device profile (the testbed's, via ``--disks``):
every method at each prefix length on the first 4 devices, as in Fig. 11.
``--merge`` combines the per-profile JSON files into the figure.  run_all.py
runs it on the main (pm9a3) testbed and on a temporary 900p testbed.

    tools/testbed run -- python tools/bench/fig17_ssd_type.py            # pm9a3
    tools/testbed --name swarmfs-900p up --disks 4 --size 2G --profile 900p
    SWARMFS_TESTBED_NAME=swarmfs-900p tools/testbed run -- \\
        python tools/bench/fig17_ssd_type.py --disks testbed:swarmfs-900p
    python tools/bench/fig17_ssd_type.py --merge
"""

from __future__ import annotations

import json
import sys

import _common as C
from fig11_methods import LABELS, METHODS, run_methods


def main(argv=None):
    ap = C.parser(__doc__)
    ap.add_argument("--tokens", default=None, help="comma list of prefix lengths")
    ap.add_argument("--ndisks", type=int, default=4)
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--merge", action="store_true", help="only combine per-profile results")
    a = C.parse(ap, argv)
    base = C.OUT / ("fig17_ssd_type" + ("-smoke" if a.smoke else ""))
    if a.out:
        base = C.pathlib.Path(a.out)
    if a.merge:
        return merge(base)
    sizes = [int(x) for x in (a.tokens or ("1024,2048" if a.smoke else
                                           "16384,32768,65536,131072")).split(",")]
    nq = a.queries or (2 if a.smoke else 12)
    reps = a.reps or (1 if a.smoke else 2)
    methods = a.methods.split(",")
    trace, disks, _ = C.setup(a, "fig17_ssd_type", trace_tokens=4096 if a.smoke else 0)
    d = disks.first(min(a.ndisks, disks.count))
    profile = (d.testbed or {}).get("profile") or "files"
    ceil = C.ceilings(d, a.smoke)
    points = []
    for S in sizes:
        start, S = C.context(trace, S, "wikitext2")
        print(f"fig17: {profile}, S = {S}, {d.count} disks", file=sys.stderr)
        r = run_methods(a, trace, d, start, S, methods, ratio=a.ratio, nq=nq, reps=reps,
                        label=f"fig17 {profile} S={S}", store=f"fig17-{profile}")
        points.append(r)
        for m, x in r["methods"].items():
            print(f"  {m:12s} I/O {x['io_us_median'] / 1e3:8.2f} ms, "
                  f"{x['eff_gbps_median']:.3f} GB/s", file=sys.stderr)
    payload = {"figure": "fig17", "profile": profile, "ratio": a.ratio,
               "disks": d.describe(), "queries": nq, "reps": reps, "ceiling": ceil,
               "ceiling_after": C.ceilings(d, a.smoke), "points": points}
    C.write_json(C.pathlib.Path(f"{base}-{profile}"), payload)
    return merge(base)


def merge(base):
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
    C.write_json(base, payload)
    plot(payload, base)
    return payload


def plot(p, out):
    plt = C.pyplot()
    profs = list(p["profiles"])
    fig, axes = plt.subplots(1, len(profs), figsize=(5.5 * len(profs), 4), squeeze=False)
    for ax, prof in zip(axes[0], profs):
        j = p["profiles"][prof]
        pts = j["points"]
        x = [pt["tokens"] / 1024 for pt in pts]
        for m in pts[0]["methods"]:
            ax.plot(x, [pt["methods"][m]["eff_gbps_median"] for pt in pts], "o-",
                    label=LABELS.get(m, m))
        C.ceiling_lines(ax, j.get("ceiling"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prefix length (K tokens)")
        ax.set_ylabel("effective bandwidth (GB/s, median)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{j['disks']['count']} x {prof}", fontsize=10)
        ax.grid(alpha=.3)
        ax.legend(fontsize=7)
    fig.suptitle("Fig. 17: SSD type", fontsize=11)
    C.save_fig(fig, out)


if __name__ == "__main__":
    main()
