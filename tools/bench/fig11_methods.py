#!/usr/bin/env python3
"""Fig. 11: I/O time per decode step, effective bandwidth and accuracy per method (r = 10%).

SWARM against No Cluster (exact top-k over all keys, entries in token order),
InfLLM-style blocks, PQCache/ClusterKV-style k-means clusters and Quest pages
(``layout/_baselines.py``), all stored as layers of one store on the same
disks, read by the same engine with the same entry budget ceil(r x S) (local
window included, no hot-cluster cache).  One store per dataset.

Each held-out query is first retrieved by every method (checksums verified):
that pass gives the accuracy (attention-mass recall of the oracle's top-k and
attention-output relative error, from the K/V read back), the selection
times, and the exact read plan.  The plans are then replayed back to back,
one block per method, methods in random order per repetition
(``_common.Bench.stream``): I/O time per step = block time / steps, median
over repetitions.

With ``--step-profiles NAME=DISKS,...`` only the step-time view runs: whole
decode steps (``Retriever.retrieve(out=...)``: selection + planning + I/O +
assembly) of every method on each device profile, side by side
(``_common.stream_steps``), with CPU µs beside I/O µs; JSON ``fig11_step``.

    tools/testbed run -- python -m tools.bench.fig11_methods
    python -m tools.bench.fig11_methods --smoke --disks files:2
    python -m tools.bench.fig11_methods --trace decoder --tokens 8192 --disks files:4
    python -m tools.bench.fig11_methods --step-profiles \
        pm9a3=testbed:evalstep-pm9a3,fast=testbed:evalstep-fast
"""

from __future__ import annotations

import sys

import click
import numpy as np

from tools import _options as O
from tools.bench import _common as C

METHODS = ("swarm", "no_cluster", "infllm", "pqcache", "quest")
LABELS = {"swarm": "SWARM", "no_cluster": "No Cluster", "infllm": "InfLLM",
          "pqcache": "PQCache", "quest": "Quest", "medoid_only": "Medoid Only",
          "no_replica": "No Replica"}
# paper (§8.2): SWARM's bandwidth over each baseline's
PAPER_BW_RATIO = {"no_cluster": 3.95, "infllm": 2.67, "pqcache": 1.55}
PAPER_IO_RATIO = 2.41


def swarm_params(cfg, swarm_kw=None) -> dict:
    """SWARM's layout parameters for ``cfg``'s trace: ``swarm_kw`` when given;
    on the decoder trace the decoder path's operating point
    (``defaults.DECODER_TAU``, ``DECODER_MAX_CLUSTER_SIZE``: what
    ``SwarmCache`` lays a prompt out with); otherwise the offline layout's
    defaults (``layout._cluster``)."""
    if swarm_kw is not None:
        return dict(swarm_kw)
    if cfg.trace == "decoder":
        from swarmfs import _defaults as D
        return {"tau": D.DECODER_TAU, "max_cluster_size": D.DECODER_MAX_CLUSTER_SIZE}
    return {}


def method_layouts(cfg, trace, start, S, methods, *, ratio=0.1, swarm_kw=None, verbose=True):
    """Layouts of the given methods for one context (cached).  PQCache gets
    SWARM's mean cluster size, so both indexes hold about as many vectors.
    SWARM's parameters: :func:`swarm_params`."""
    lays = {}
    sw, _ = C.build_layout("swarm", trace, start, S, cache=cfg.cache, ratio=ratio,
                           **swarm_params(cfg, swarm_kw))
    lays["swarm"] = sw
    mean_size = round(float(sw.sizes.mean()), 1)
    kw = {"infllm": {"block": 64, "reps": 4}, "pqcache": {"mean_size": mean_size},
          "quest": {"page": 16}, "no_cluster": {"group": 64}}
    for m in methods:
        if m == "swarm":
            continue
        lays[m], _ = C.build_layout(m, trace, start, S, cache=cfg.cache, ratio=ratio,
                                    **kw.get(m, {}))
    if verbose:
        sums = {m: lay.summary() for m, lay in lays.items()}
        rows = [(m, s["clusters"], f"{s['size_mean']:.1f}", f"{s['replication']:.2f}",
                 f"{s['build_s']:.1f}") for m, s in sums.items()]
        print(C.table(rows, ("layout", "clusters", "mean size", "replication", "build s")),
              file=sys.stderr)
    return lays


def measure(bench, names, positions, reps, *, seed=0, label=""):
    """Record (accuracy pass, verified), then stream (timed): see ``Bench.measure``."""
    return bench.measure(names, list(positions), reps, seed=seed, progress=label)


def run_methods(cfg, trace, disks, start, S, methods, *, ratio=0.1, nq, reps, label,
                store="methods", swarm_kw=None, layouts=None):
    """Build (or load) every method's layout of one context, store them as
    layers of one store on ``disks`` and measure them side by side."""
    lays = layouts or method_layouts(cfg, trace, start, S, methods, ratio=ratio,
                                     swarm_kw=swarm_kw)
    bench = C.Bench(C.store_dir(cfg, store), disks, trace, start, S,
                    [C.Variant(m, lays[m]) for m in methods], ratio=ratio, cfg=cfg)
    pos = C.query_positions(trace, start, S, nq)
    try:
        res = measure(bench, methods, pos, reps, label=label)
    finally:
        bench.close()
    return {"tokens": S, "start": start, "local_window": bench.W,
            "budget": int(np.ceil(ratio * S)), "methods": res,
            "ratios": ratios(res) if "swarm" in res else {},
            "windows": C.window_stats(trace, start, S, pos, bench.W,
                                      {m: lays[m] for m in methods})}


def step_profiles(spec: str | None) -> dict:
    """``--step-profiles NAME=DISKS,NAME=DISKS`` -> {name: Disks} (each DISKS
    as ``--disks``: ``testbed:NAME`` or ``files:N``)."""
    out = {}
    for item in (spec or "").split(","):
        if not item:
            continue
        name, sep, disks = item.partition("=")
        if not sep or not name or not disks:
            raise SystemExit(f"--step-profiles: {item!r} is not NAME=DISKS")
        out[name] = C.resolve_disks(disks)
    return out


def run_steps(cfg, trace, profiles: dict, start, S, methods, *, ratio=0.1, nq, reps, label,
              store="steps", layouts) -> dict:
    """The step-time view: whole decode steps (selection + planning + I/O +
    assembly, ``Retriever.retrieve(out=...)``) of every method on every
    device profile, side by side (``_common.stream_steps``).  Accuracy comes
    from one verified, untimed retrieval per query on the first profile
    (it does not depend on the disks)."""
    benches = {}
    try:
        for pname, disks in profiles.items():
            benches[pname] = C.Bench(C.store_dir(cfg, f"{store}-{pname}"), disks, trace, start,
                                     S, [C.Variant(m, layouts[m]) for m in methods],
                                     ratio=ratio, cfg=cfg)
        pos = C.query_positions(trace, start, S, nq)
        first = next(iter(benches.values()))
        acc = {}
        for m in methods:
            rec = [first.record(m, p) for p in pos]
            acc[m] = {f"{k}_mean": C.mean(rec, k) for k in C.ACC_KEYS}
            acc[m].update({f"{k}_median": C.median(rec, k)
                           for k in ("bytes_read", "requests", "entries", "clusters")})
            acc[m]["index_bytes"] = first.index_bytes(m)
        steps = C.stream_steps(benches, methods, list(pos), reps, progress=label)
    finally:
        for b in benches.values():
            b.close()
    res = {pn: {m: {**steps[pn][m], **acc[m]} for m in methods} for pn in profiles}
    return {"tokens": S, "start": start, "ratio": ratio, "budget": int(np.ceil(ratio * S)),
            "profiles": {pn: {"disks": profiles[pn].describe(), "methods": res[pn],
                              "ratios": step_ratios(res[pn])} for pn in profiles}}


def step_ratios(res: dict) -> dict:
    """Each baseline's step time (and parts) over SWARM's, at equal budget."""
    if "swarm" not in res:
        return {}
    sw = res["swarm"]
    return {m: {"step_ratio": r["step_us_median"] / sw["step_us_median"],
                "cpu_ratio": r["cpu_us_median"] / max(sw["cpu_us_median"], 1e-9),
                "io_ratio": r["io_us_median"] / sw["io_us_median"],
                "rel_error_delta": r["rel_error_mean"] - sw["rel_error_mean"]}
            for m, r in res.items() if m != "swarm"}


def print_steps(title: str, pt: dict):
    """Per profile and method: step time, CPU µs beside I/O µs, and the parts."""
    rows = [(f"{title} [{pn}]", m, f"{x['step_us_median']:.0f}", f"{x['cpu_us_median']:.0f}",
             f"{x['io_us_median']:.0f}", f"{x['select_us_median']:.0f}",
             f"{x['plan_us_median']:.0f}", f"{x['assemble_us_median']:.0f}",
             f"{x['rel_error_mean']:.3f}", f"{pr['ratios'].get(m, {}).get('step_ratio', 1.0):.2f}")
            for pn, pr in pt["profiles"].items() for m, x in pr["methods"].items()]
    print(C.table(rows, ("point", "method", "step us", "CPU us", "I/O us", "select", "plan",
                         "assemble", "err", "x SWARM")), file=sys.stderr)


def ratios(res: dict) -> dict:
    """SWARM's effective-bandwidth ratio and I/O-time ratio over each method."""
    sw = res["swarm"]
    out = {}
    for m, r in res.items():
        if m == "swarm":
            continue
        io_total = r["io_us_median"] + (r["score_us_median"] if m == "no_cluster" else 0)
        out[m] = {
            "bw_ratio": sw["eff_gbps_median"] / r["eff_gbps_median"],
            "goodput_ratio": (sw["goodput_gbps_median"] / r["goodput_gbps_median"]
                              if sw.get("goodput_gbps_median") and r.get("goodput_gbps_median")
                              else None),
            "io_ratio": r["io_us_median"] / sw["io_us_median"],
            "io_plus_score_ratio": (r["io_us_median"] + r["score_us_median"]) /
                                   (sw["io_us_median"] + sw["score_us_median"]),
            "recall_delta": sw["recall_mean"] - r["recall_mean"],
            "rel_error_delta": r["rel_error_mean"] - sw["rel_error_mean"],
            "paper_bw_ratio": PAPER_BW_RATIO.get(m),
            "no_cluster_bw_incl_score_ratio": (
                sw["eff_gbps_median"] / (r["useful_bytes_median"] / (io_total / 1e6) / 1e9)
                if m == "no_cluster" else None),
        }
    return out


def method_options(f):
    """The --methods and --step-profiles options Figs. 11 and 20 share."""
    f = click.option("--step-profiles", default=None, metavar="NAME=DISKS,...",
                     help="only the step-time view (selection + planning + I/O + assembly) "
                          "on these device profiles side by side, e.g. "
                          "pm9a3=testbed:evalstep-pm9a3,fast=testbed:evalstep-fast")(f)
    return click.option("--methods", type=O.CommaList(choices=METHODS, keep_text=True),
                        default=",".join(METHODS), show_default=True)(f)


@C.command("fig11_methods", __doc__)
@C.tokens_option
@click.option("--datasets", type=O.CommaList(choices=list(C.DATASETS), keep_text=True),
              default=None, help="comma list (default all three; smoke wikitext2)")
@click.option("--ratio", type=O.RATIO, default=0.1, show_default=True)
@method_options
def cli(cfg, tokens, datasets, ratio, methods, step_profiles):
    S = tokens or (2048 if cfg.smoke else 131072)
    datasets = (datasets or ("wikitext2" if cfg.smoke else "wikitext2,shakespeare,gsm8k")
                ).split(",")
    nq = cfg.queries or (3 if cfg.smoke else 24)
    reps = cfg.reps or (1 if cfg.smoke else 3)
    methods = methods.split(",")
    if step_profiles:
        return main_steps(cfg, S, datasets, nq, reps, methods, ratio, step_profiles)
    trace, disks, out = C.setup(cfg, "fig11_methods", trace_tokens=(4096 if cfg.smoke else 0))
    ceil_before = C.ceilings(disks, cfg.smoke)
    results = {}
    for ds in datasets:
        start, S = C.context(trace, S, ds)
        print(f"fig11: {ds}, S = {S}, {disks.count} disks", file=sys.stderr)
        results[ds] = run_methods(cfg, trace, disks, start, S, methods, ratio=ratio, nq=nq,
                                  reps=reps, label=f"fig11 {ds}", store="fig11")
        _print(ds, results[ds]["methods"], results[ds]["ratios"])
    ceil_after = C.ceilings(disks, cfg.smoke)
    avg = _average(results, methods)
    payload = {"figure": "fig11", "title": "methods at r = 10%", "ratio": ratio,
               "tokens": S, "disks": disks.describe(), "queries": nq, "reps": reps,
               "ceiling_before": ceil_before, "ceiling_after": ceil_after,
               "datasets": results, "average": avg,
               "paper": {"bw_ratio": PAPER_BW_RATIO, "io_ratio": PAPER_IO_RATIO}}
    return C.finish(cfg, out, payload, plot)


def main(argv=None):
    return C.run(cli, argv)


def main_steps(cfg, S, datasets, nq, reps, methods, ratio, spec):
    """Fig. 11's step-time view: every method at r on each profile, per dataset."""
    profiles = step_profiles(spec)
    trace, out = C.setup_trace(cfg, "fig11_step", trace_tokens=(4096 if cfg.smoke else 0))
    results = {}
    for ds in datasets:
        start, S = C.context(trace, S, ds)
        lays = method_layouts(cfg, trace, start, S, methods, ratio=ratio)
        results[ds] = run_steps(cfg, trace, profiles, start, S, methods, ratio=ratio, nq=nq,
                                reps=reps, label=f"fig11 step {ds}", store="fig11-step",
                                layouts=lays)
        print_steps(ds, results[ds])
    payload = {"figure": "fig11", "view": "step", "title": "decode step time per method",
               "ratio": ratio, "tokens": S, "queries": nq, "reps": reps,
               "profiles": {pn: d.describe() for pn, d in profiles.items()},
               "datasets": results}
    return C.finish(cfg, out, payload, plot_steps)


def plot_steps(p, out):
    """Stacked step time (select, plan, I/O, assemble medians) per method,
    one panel per profile, at r (first dataset)."""
    pt = next(iter(p["datasets"].values()))
    profs = list(pt["profiles"])
    with C.figure(out, len(profs), (6 * len(profs), 4),
                  f"Fig. 11 step view: S = {p['tokens']}, r = {p['ratio']}", grid="y",
                  legend=7) as axes:
        for ax, pn in zip(axes, profs, strict=True):
            res = pt["profiles"][pn]["methods"]
            lab = [LABELS.get(m, m) for m in res]
            bottom = np.zeros(len(res))
            for part in ("select_us", "plan_us", "io_us", "assemble_us"):
                v = np.array([x[f"{part}_median"] for x in res.values()]) / 1e3
                ax.bar(lab, v, bottom=bottom, label=part[:-3])
                bottom += v
            ax.plot(lab, [x["step_us_median"] / 1e3 for x in res.values()], "k_", ms=20,
                    label="measured step")
            ax.set_title(f"{pn}: step time (ms, median)", fontsize=10)


def _average(results, methods):
    """Per method, the mean over datasets of the medians; ratios of those."""
    avg = {}
    for m in methods:
        rows = [r["methods"][m] for r in results.values()]
        avg[m] = {k: float(np.mean([x[k] for x in rows if x.get(k) is not None]))
                  for k in rows[0] if isinstance(rows[0][k], (int, float))}
    rat = {}
    for m in methods:
        if m == "swarm" or "swarm" not in methods:
            continue
        rr = [r["ratios"][m] for r in results.values()]
        rat[m] = {k: (float(np.mean([x[k] for x in rr if x[k] is not None]))
                      if any(x[k] is not None for x in rr) else None)
                  for k in ("bw_ratio", "goodput_ratio", "io_ratio", "io_plus_score_ratio",
                            "recall_delta", "rel_error_delta")}
    return {"methods": avg, "ratios": rat}


def _print(ds, res, rat):
    rows = [(m, f"{r['io_us_median'] / 1e3:.2f}", f"{r['score_us_median'] / 1e3:.2f}",
             f"{r['eff_gbps_median']:.3f}", f"{r['goodput_gbps_median'] or 0:.3f}",
             f"{r['mean_request_kib_median']:.1f}", f"{r['recall_mean']:.3f}",
             f"{r['rel_error_mean']:.3f}", f"{r['index_bytes'] / 1e6:.1f}")
            for m, r in res.items()]
    print(C.table(rows, ("method", "I/O ms", "score ms", "GB/s", "good", "req KiB", "recall",
                         "err", "index MB")), file=sys.stderr)
    for m, x in rat.items():
        print(f"  SWARM vs {m}: bandwidth x{x['bw_ratio']:.2f}, I/O time x{x['io_ratio']:.2f}",
              file=sys.stderr)


def plot(p, out):
    ds = list(p["datasets"])
    methods = list(next(iter(p["datasets"].values()))["methods"])
    d = p["disks"]
    w = 0.8 / len(methods)
    x = np.arange(len(ds))
    with C.figure(out, 3, (15, 4.2), f"Fig. 11: S = {p['tokens']}, r = {p['ratio']}, "
                  f"{d['count']} x {d['profile'] or 'file'} disks, 4 KiB entries",
                  grid="y") as axes:
        for i, m in enumerate(methods):
            rows = [p["datasets"][k]["methods"][m] for k in ds]
            io = [r["io_us_median"] / 1e3 for r in rows]
            b = axes[0].bar(x + i * w, io, w, label=LABELS.get(m, m))
            if m == "no_cluster":
                axes[0].bar(x + i * w, [r["score_us_median"] / 1e3 for r in rows], w,
                            bottom=io, color=b[0].get_facecolor(), alpha=0.4, hatch="//",
                            label="No Cluster key scan")
            axes[1].bar(x + i * w, [r["eff_gbps_median"] for r in rows], w,
                        label=LABELS.get(m, m))
            axes[1].bar(x + i * w, [r.get("goodput_gbps_median") or 0 for r in rows], w * 0.5,
                        color="black", alpha=0.45,
                        label="top-k goodput (inner bars)" if i == 0 else None)
            axes[2].bar(x + i * w, [r["recall_mean"] for r in rows], w, label=LABELS.get(m, m))
        C.ceiling_lines(axes[1], p["ceiling_before"])
        for ax, t in zip(axes, ("I/O time per decode step (ms, median)",
                                "effective bandwidth; inner: top-k goodput (GB/s)",
                                "attention-mass recall vs oracle top-k"), strict=True):
            ax.set_xticks(x + 0.4 - w / 2, ds)
            ax.set_title(t, fontsize=10)
        axes[0].legend(fontsize=7)
        axes[1].legend(fontsize=7)


def summary(p: dict) -> str:
    """This figure's section of ``run_all``'s Markdown summary: per dataset
    and method the I/O time, bandwidth, accuracy and index size, then SWARM's
    ratios over each baseline."""
    d = p["disks"]
    c = p.get("ceiling_before") or {}
    out = [f"### Fig. 11: methods at r = {p['ratio']} (S = {p['tokens']}, "
           f"{d['count']} x {d['profile'] or 'file'} disks)\n"]
    if c:
        out.append(f"fio ceiling in the same run: {c['bw_128k']['gb_per_s']:.3f} GB/s "
                   f"(128 KiB, qd 32/device), {c['iops_4k']['gb_per_s']:.3f} GB/s "
                   f"= {c['iops_4k']['iops'] / 1e3:.0f}k IOPS (4 KiB)\n")
    rows = []
    for ds, r in p["datasets"].items():
        for m, x in r["methods"].items():
            frac = f"{x['eff_gbps_median'] / c['bw_128k']['gb_per_s']:.0%}" if c else "-"
            scan = C.ms_cell(x["score_us_median"]) if m == "no_cluster" else "-"
            rows.append((ds, LABELS.get(m, m), C.ms_cell(x["io_us_median"]), scan,
                         f"{x['eff_gbps_median']:.3f}", frac,
                         f"{x.get('goodput_gbps_median') or 0:.3f}",
                         f"{x['bytes_read_median'] / 1e6:.1f}",
                         f"{x['requests_median']:.0f}",
                         f"{x['mean_request_kib_median']:.1f}", f"{x['recall_mean']:.3f}",
                         f"{x['rel_error_mean']:.3f} ({x['oracle_rel_error_mean']:.3f})",
                         f"{x['index_bytes'] / 2**20:.1f}"))
    out.append(C.md_table(rows, ("dataset", "method", "I/O ms", "key-scan ms", "eff. GB/s",
                                 "% of fio 128k", "top-k goodput GB/s", "MB read", "requests",
                                 "req KiB", "recall", "rel. error (oracle)", "index MiB"), 2))
    out.append("")
    rat = p["average"]["ratios"]
    if rat:
        out.append("SWARM over each baseline (mean over datasets of the per-dataset "
                   "median ratios):\n")
        rows = []
        for m, x in rat.items():
            pb = p["paper"]["bw_ratio"].get(m)
            rows.append((LABELS.get(m, m), f"{x['bw_ratio']:.2f}", pb if pb else "-",
                         C.num_cell(x.get("goodput_ratio")), f"{x['io_ratio']:.2f}",
                         C.num_cell(x.get("io_plus_score_ratio")),
                         p["paper"]["io_ratio"] if pb else "-",
                         f"{x['recall_delta']:+.3f}"))
        out.append(C.md_table(rows, ("baseline", "eff. bandwidth x", "paper", "top-k goodput x",
                                     "I/O time x", "I/O + selection time x", "paper",
                                     "recall SWARM - baseline")))
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
