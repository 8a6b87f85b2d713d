#!/usr/bin/env python3
"""Fig. 20: I/O time, effective bandwidth and accuracy vs the sparsity ratio r.

Every method at each r (entry budget ceil(r x S), local window included), one
store per r, methods interleaved as in Fig. 11.  SWARM is profiled at that r
(its clusters depend on it); the baselines' layouts do not depend on r
(PQCache keeps SWARM's r = 10% mean cluster size).  On ``--trace decoder``
SWARM is laid out at the decoder path's operating point (tau
``DECODER_TAU``; ``fig11_methods.swarm_params``).

Iso-accuracy: for each baseline, the I/O time it needs to be as accurate as
SWARM at r = 10%, by attention-output error and by attention mass (absolute
measures; recall is relative to each r's own oracle), interpolated over r;
its ratio to SWARM's I/O time at r = 10% is the "I/O time at equal accuracy"
of the targets.

With ``--step-profiles NAME=DISKS,...`` only the step-time view runs (as in
Fig. 11), per r and profile, and the iso-accuracy is taken on step time
(selection + planning + I/O + assembly) per profile; JSON ``fig20_step``
(docs/benchmarks.md §7, "Step time as a serving engine sees it").

    tools/testbed run -- python -m tools.bench.fig20_sparsity
    python -m tools.bench.fig20_sparsity --trace decoder --tokens 8192 --disks files:4
    tools/testbed --name evalstep-pm9a3 run -- python -m tools.bench.fig20_sparsity \
        --tokens 131072 --ratios 0.05,0.1,0.2 --reps 3 \
        --step-profiles pm9a3=testbed:evalstep-pm9a3,fast=testbed:evalstep-fast
"""

from __future__ import annotations

import sys

import click
import numpy as np

from tools import _options as O
from tools.bench import _common as C
from tools.bench.fig11_methods import (
    LABELS,
    method_layouts,
    method_options,
    print_steps,
    run_methods,
    run_steps,
    step_profiles,
    swarm_params,
)


@C.command("fig20_sparsity", __doc__)
@C.tokens_option
@click.option("--ratios", type=O.CommaList(float, item=O.RATIO, keep_text=True), default=None,
              help="comma list of sparsity ratios r")
@C.dataset_option
@method_options
def cli(cfg, tokens, ratios, dataset, methods, step_profiles):
    S = tokens or (2048 if cfg.smoke else 65536)
    ratios = [float(x) for x in (ratios or ("0.05,0.1" if cfg.smoke else
                                            "0.02,0.05,0.1,0.2,0.3")).split(",")]
    nq = cfg.queries or (2 if cfg.smoke else 12)
    reps = cfg.reps or (1 if cfg.smoke else 2)
    methods = methods.split(",")
    if step_profiles:
        return main_steps(cfg, S, ratios, nq, reps, methods, dataset, step_profiles)
    trace, disks, out = C.setup(cfg, "fig20_sparsity", trace_tokens=4096 if cfg.smoke else 0)
    start, S = C.context(trace, S, dataset)
    base = method_layouts(cfg, trace, start, S, methods, ratio=0.1)
    ceil = C.ceilings(disks, cfg.smoke)
    points = []
    for r, lays in layouts_per_ratio(cfg, trace, start, S, methods, base, ratios):
        print(f"fig20: r = {r}, S = {S}", file=sys.stderr)
        pt = run_methods(cfg, trace, disks, start, S, methods, ratio=r, nq=nq, reps=reps,
                         label=f"fig20 r={r}", store="fig20", layouts=lays)
        pt["ratio"] = r
        points.append(pt)
        for m, x in pt["methods"].items():
            print(f"  r={r:.2f} {m:12s} I/O {x['io_us_median'] / 1e3:8.2f} ms, "
                  f"{x['eff_gbps_median']:.3f} GB/s, recall {x['recall_mean']:.3f}",
                  file=sys.stderr)
    iso = iso_accuracy(points, methods)
    payload = {"figure": "fig20", "title": "sparsity ratio", "tokens": S,
               "dataset": dataset, "disks": disks.describe(), "queries": nq, "reps": reps,
               "ceiling": ceil, "points": points, "iso_accuracy": iso}
    return C.finish(cfg, out, payload, plot)


def main(argv=None):
    return C.run(cli, argv)


def layouts_per_ratio(cfg, trace, start, S, methods, base: dict, ratios):
    """``(r, the methods' layouts at r)`` per r, in order: ``base`` (built at
    r = 0.1) with SWARM's rebuilt at r (SWARM profiles with r: its activated
    sets, and so its clusters, depend on r), built when the loop reaches r."""
    for r in ratios:
        lays = dict(base)
        if "swarm" in methods and r != 0.1:
            lays["swarm"] = C.build_layout("swarm", trace, start, S, cache=cfg.cache,
                                           ratio=r, **swarm_params(cfg))[0]
        yield r, lays


def main_steps(cfg, S, ratios, nq, reps, methods, dataset, spec):
    """Fig. 20's step-time view: every method at every r on each device
    profile (side by side), and the step time each baseline needs to be as
    accurate as SWARM at r = 10%, per profile."""
    profiles = step_profiles(spec)
    trace, out = C.setup_trace(cfg, "fig20_step", trace_tokens=4096 if cfg.smoke else 0)
    start, S = C.context(trace, S, dataset)
    base = method_layouts(cfg, trace, start, S, methods, ratio=0.1)
    points = []
    for r, lays in layouts_per_ratio(cfg, trace, start, S, methods, base, ratios):
        print(f"fig20 step view: r = {r}, S = {S}", file=sys.stderr)
        pt = run_steps(cfg, trace, profiles, start, S, methods, ratio=r, nq=nq, reps=reps,
                       label=f"fig20 step r={r}", store="fig20-step", layouts=lays)
        print_steps(f"r={r:.2f}", pt)
        points.append(pt)
    iso = {pn: step_iso_accuracy(points, pn, methods) for pn in profiles}
    for pn, x in iso.items():
        for m, v in x.get("methods", {}).items():
            e = v.get("rel_error", {})
            got = (f"{e['step_ratio_vs_swarm']:.2f}" if e.get("reached") else
                   f"> {e.get('step_ratio_lower_bound', float('nan')):.2f} (not reached)")
            print(f"  [{pn}] equal accuracy (error): {m:11s} step x SWARM {got}",
                  file=sys.stderr)
    payload = {"figure": "fig20", "view": "step", "title": "decode step time vs sparsity",
               "tokens": S, "dataset": dataset, "queries": nq, "reps": reps,
               "profiles": {pn: d.describe() for pn, d in profiles.items()},
               "points": points, "iso_accuracy": iso}
    return C.finish(cfg, out, payload, plot_steps)


def step_iso_accuracy(points, profile, methods, ref_ratio=0.1):
    """:func:`iso_accuracy` on one profile's step times: the step time each
    baseline needs to be as accurate as SWARM at r = ``ref_ratio``."""
    flat = [{"ratio": p["ratio"],
             "methods": {m: dict(x, io_us_median=x["step_us_median"])
                         for m, x in p["profiles"][profile]["methods"].items()}}
            for p in points]
    iso = iso_accuracy(flat, methods, ref_ratio)
    if not iso:
        return {}
    out = {"swarm_step_us": iso.pop("swarm_io_us"), **iso}
    top = max(flat, key=lambda p: p["ratio"])
    for m, res in out["methods"].items():
        for v in res.values():
            if v.get("reached"):
                v["step_us_needed"] = v.pop("io_us_needed")
                v["step_ratio_vs_swarm"] = v.pop("io_ratio_vs_swarm")
            else:   # less accurate even at the largest r: its step there is a lower bound
                v["step_ratio_lower_bound"] = (top["methods"][m]["step_us_median"] /
                                               out["swarm_step_us"])
    return out


def plot_steps(p, out):
    """Per profile: step time against r per method, and error against step time."""
    pts = p["points"]
    profs = list(p["profiles"])
    r = [x["ratio"] for x in pts]
    methods = list(pts[0]["profiles"][profs[0]]["methods"])
    with C.figure(out, len(profs) + 1, (5 * (len(profs) + 1), 4),
                  f"Fig. 20 step view: S = {p['tokens']} (select + plan + I/O + assemble)",
                  legend=6) as axes:
        for ax, pn in zip(axes, profs, strict=False):
            C.lines(ax, r, {LABELS.get(m, m): [x["profiles"][pn]["methods"][m]["step_us_median"]
                                               for x in pts] for m in methods}, scale=1e3)
            ax.set_title(f"{pn}: step time (ms, median)", fontsize=10)
            ax.set_xlabel("sparsity ratio r")
        for pn, style in zip(profs, ("o-", "s--", "^:"), strict=False):
            for i, m in enumerate(methods):
                axes[-1].plot([x["profiles"][pn]["methods"][m]["step_us_median"] / 1e3
                               for x in pts],
                              [x["profiles"][pn]["methods"][m]["rel_error_mean"] for x in pts],
                              style, color=f"C{i}", label=f"{LABELS.get(m, m)} ({pn})")
        axes[-1].set_xscale("log")
        axes[-1].set_xlabel("step time (ms)")
        axes[-1].set_ylabel("attention-output relative error")


def iso_accuracy(points, methods, ref_ratio=0.1):
    """The I/O time each method needs to be as accurate as SWARM at
    r = ref_ratio, by two absolute measures (recall is relative to the
    oracle's top-k at each r, so it cannot compare different r):
    attention-output relative error (lower is better) and the attention mass
    retrieved (higher is better).  Linear interpolation between the measured
    r; "not reached" when no measured r is that accurate."""
    ref = [p for p in points if abs(p["ratio"] - ref_ratio) < 1e-9]
    if not ref or "swarm" not in methods:
        return {}
    sw = ref[0]["methods"]["swarm"]
    out = {"swarm_io_us": sw["io_us_median"], "swarm_recall": sw["recall_mean"],
           "swarm_rel_error": sw["rel_error_mean"], "swarm_mass": sw.get("mass_mean"),
           "methods": {}}
    rr = np.array([p["ratio"] for p in points])
    o = np.argsort(rr)
    for m in methods:
        if m == "swarm":
            continue
        io = np.array([p["methods"][m]["io_us_median"] for p in points])[o]
        res = {}
        for key, sign in (("rel_error", -1.0), ("mass", 1.0)):
            if sw.get(f"{key}_mean") is None:
                continue
            acc = sign * np.array([p["methods"][m][f"{key}_mean"] for p in points])[o]
            target = sign * sw[f"{key}_mean"]
            hit = np.flatnonzero(acc >= target)
            if hit.size == 0:
                res[key] = {"reached": False, "best": float(sign * acc.max())}
                continue
            i = int(hit[0])
            if i == 0:
                need_io, need_r = io[0], rr[o][0]
            else:
                f = (target - acc[i - 1]) / (acc[i] - acc[i - 1])
                need_io = io[i - 1] + f * (io[i] - io[i - 1])
                need_r = rr[o][i - 1] + f * (rr[o][i] - rr[o][i - 1])
            res[key] = {"reached": True, "ratio_needed": float(need_r),
                        "io_us_needed": float(need_io),
                        "io_ratio_vs_swarm": float(need_io / sw["io_us_median"]),
                        "at_or_below_smallest_ratio": i == 0}
        out["methods"][m] = res
    return out


def plot(p, out):
    pts = p["points"]
    r = [x["ratio"] for x in pts]
    methods = list(pts[0]["methods"])
    lab = {LABELS.get(m, m): m for m in methods}
    with C.figure(out, 3, (15, 4), f"Fig. 20: S = {p['tokens']}, {p['disks']['count']} disks "
                  "(right: error vs I/O time, one point per r)", legend=7) as axes:
        C.lines(axes[0], r, {k: [x["methods"][m]["io_us_median"] for x in pts]
                             for k, m in lab.items()}, scale=1e3)
        C.lines(axes[1], r, {k: [x["methods"][m]["eff_gbps_median"] for x in pts]
                             for k, m in lab.items()})
        for k, m in lab.items():
            axes[2].plot([x["methods"][m]["io_us_median"] / 1e3 for x in pts],
                         [x["methods"][m]["rel_error_mean"] for x in pts], "o-", label=k)
        C.ceiling_lines(axes[1], p["ceiling"])
        axes[0].set_xlabel("sparsity ratio r")
        axes[0].set_ylabel("I/O time per step (ms, median)")
        axes[1].set_xlabel("sparsity ratio r")
        axes[1].set_ylabel("effective bandwidth (GB/s, median)")
        axes[2].set_xlabel("I/O time per step (ms)")
        axes[2].set_ylabel("attention-output relative error")
        axes[2].set_xscale("log")


def summary(p: dict) -> str:
    """This figure's section of ``run_all``'s Markdown summary: every method's
    I/O time, bandwidth and recall per r, then the iso-accuracy table."""
    out = [f"### Fig. 20: sparsity ratio (S = {p['tokens']})\n"]
    ms = list(p["points"][0]["methods"])
    rows = [(pt["ratio"], *(f"{C.ms_cell(pt['methods'][m]['io_us_median'])} / "
                            f"{pt['methods'][m]['eff_gbps_median']:.3f} / "
                            f"{pt['methods'][m]['recall_mean']:.3f}" for m in ms))
            for pt in p["points"]]
    out.append(C.md_table(rows, ("r", *(f"{LABELS.get(m, m)} I/O ms / GB/s / recall"
                                        for m in ms)), 0))
    iso = p.get("iso_accuracy") or {}
    if iso:
        out += ["", _iso_summary(iso)]
    out.append("")
    return "\n".join(out)


def _iso_summary(iso: dict) -> str:
    """The iso-accuracy table of :func:`summary` (``iso_accuracy``'s result)."""
    head = (f"Iso-accuracy: I/O time each baseline needs to be as accurate as SWARM "
            f"at r = 0.1 (error {iso['swarm_rel_error']:.3f}"
            + (f", mass {iso['swarm_mass']:.3f}" if iso.get("swarm_mass") else "")
            + f"; I/O {C.ms_cell(iso['swarm_io_us'])} ms):\n")
    rows = []
    for m, res in iso["methods"].items():
        for key, x in res.items():
            if x["reached"]:
                low = " (at or below the smallest r)" if x["at_or_below_smallest_ratio"] else ""
                rows.append((LABELS.get(m, m), key, f"{x['ratio_needed']:.3f}{low}",
                             C.ms_cell(x["io_us_needed"]), f"{x['io_ratio_vs_swarm']:.2f}"))
            else:
                rows.append((LABELS.get(m, m), key, f"not reached (best {x['best']:.3f})",
                             "-", "-"))
    return "\n".join([head, C.md_table(rows, ("baseline", "by", "r needed", "I/O ms needed",
                                               "I/O time x SWARM"), 2)])


if __name__ == "__main__":
    main()
