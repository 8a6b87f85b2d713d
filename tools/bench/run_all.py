#!/usr/bin/env python3
"""Run the whole evaluation (SWARM §8): every figure, then a Markdown summary.

Each figure runs as its own process (so memory is returned between them),
inheriting this process's cgroup: start it inside the testbed's throttled
group.  Fig. 17's low-end profile runs on a temporary 4-disk ``900p``
testbed that this script brings up and always takes down again.

    tools/testbed up --disks 8 --size 2G --profile pm9a3
    tools/testbed run -- python -m tools.bench.run_all
    tools/testbed down

    python -m tools.bench.run_all --smoke --disks files:2     # CI-sized, no root
    python -m tools.bench.run_all --trace decoder --disks files:8   # on swarm-llama's trace

Outputs: ``bench-out/eval/<figure>.json|.png``, ``run_all.json`` (wall time and
status per figure) and ``summary.md`` (the tables of docs/benchmarks.md §7);
with ``--trace decoder`` each name gets ``-decoder`` (``<figure>-decoder.json``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import time

import click

from tools import _options as O

from tools import _testbed as T
from tools.bench import _common as C
from tools.bench.fig11_methods import LABELS

#: (name, module under tools.bench, extra args) in run order
FIGURES = [
    ("fig11", "fig11_methods", []),
    ("fig12", "fig12_clustering", []),
    ("fig13", "fig13_placement", []),
    ("fig14", "fig14_retrieval", []),
    ("fig18", "fig18_num_disks", []),
    ("fig20", "fig20_sparsity", []),
    ("fig19", "fig19_tau", []),
    ("fig17", "fig17_ssd_type", []),
    ("fig16", "fig16_prefix_batch", []),
    ("table4", "table4_selection", []),
]
LOW_END = {"name": "swarmfs-900p", "disks": 4, "size": "2G", "profile": "900p"}


@click.command(help=__doc__.split("\n")[0])
@click.option("--disks", type=O.DiskSpec(), default="testbed", show_default=True)
@click.option("--smoke", is_flag=True)
@click.option("--only", type=O.CommaList(choices=[f[0] for f in FIGURES], keep_text=True),
              default=None, help="comma list of figures (fig11,...,table4)")
@click.option("--skip", type=O.CommaList(choices=[f[0] for f in FIGURES], keep_text=True),
              default=None)
@click.option("--no-900p", "no_900p", is_flag=True, help="fig17 on the main testbed only")
@click.option("--cache", default=str(C.CACHE), show_default=True)
@click.option("--trace-tokens", type=O.COUNT, default=None,
              help="capture this many trace tokens first (default: what fig16 needs)")
@click.option("--trace", type=click.Choice(C.TRACES), default="minilm", show_default=True,
              help="the trace every figure runs on (see tools/bench/_common.py)")
@click.pass_context
def cli(ctx, disks, smoke, only, skip, no_900p, cache, trace_tokens, trace):
    only = set(only.split(",")) if only else None
    skip = set(filter(None, (skip or "").split(",")))
    C.OUT.mkdir(parents=True, exist_ok=True)
    common = ["--disks", disks, "--cache", cache, "--trace", trace] + \
        (["--smoke"] if smoke else [])
    log = {"command": " ".join(["python -m tools.bench.run_all"] + list(ctx.obj or [])),
           "machine": C.machine(), "figures": {}}
    t_all = time.perf_counter()
    # the trace first, so no figure pays for it inside its timing
    with _step(log, "trace"):
        need = trace_tokens or (4096 if smoke else 1048576 + 4096)
        C.load_trace(need, kind=trace, cache=pathlib.Path(cache), progress=not smoke)
    for name, module, extra in FIGURES:
        if (only and name not in only) or name in skip:
            continue
        cmd = [sys.executable, "-m", f"tools.bench.{module}"] + common + extra
        with _step(log, name):
            _run(cmd, name)
        if name == "fig17" and not smoke and not no_900p and disks.startswith("testbed"):
            with _step(log, "fig17-900p"):
                _low_end(cmd)
            _run([sys.executable, "-m", f"tools.bench.{module}", "--merge"], "fig17-merge")
    log["total_s"] = time.perf_counter() - t_all
    suffix = ("" if trace == "minilm" else f"-{trace}") + ("-smoke" if smoke else "")
    (C.OUT / f"run_all{suffix}.json").write_text(json.dumps(log, indent=1))
    md = summary(smoke, trace=trace)
    (C.OUT / f"summary{suffix}.md").write_text(md)
    print(md)
    print(f"total {log['total_s'] / 60:.1f} min; wrote {C.OUT}/summary{suffix}.md",
          file=sys.stderr)
    failed = [k for k, v in log["figures"].items() if v["status"] != "ok"]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    return cli.main(args=args, prog_name="python -m tools.bench.run_all", obj=args,
                    standalone_mode=argv is None)


@contextlib.contextmanager
def _step(log, name):
    t0 = time.perf_counter()
    print(f"== {name}", file=sys.stderr, flush=True)
    rec = {"status": "ok"}
    try:
        yield
    except (subprocess.CalledProcessError, SystemExit, RuntimeError) as exc:
        rec["status"] = f"failed: {exc}"
        print(f"!! {name} failed: {exc}", file=sys.stderr, flush=True)
    finally:
        rec["seconds"] = time.perf_counter() - t0
        log["figures"][name] = rec
        print(f"== {name}: {rec['status']}, {rec['seconds']:.0f} s", file=sys.stderr, flush=True)


def _run(cmd, name):
    """Run one figure as its own process, from the repository root (where
    ``python -m tools.bench...`` finds the package)."""
    subprocess.run(cmd, check=True, cwd=C.REPO)


def _low_end(cmd):
    """Fig. 17 on a temporary 900p testbed: up, run inside its cgroup, down."""
    lim = T.limits_for(LOW_END["profile"])
    backing = f"/dev/shm/{LOW_END['name']}"
    T.down(LOW_END["name"], backing)          # leftovers of a crashed run
    try:
        st = T.up(LOW_END["disks"], LOW_END["size"], backing, limits=lim,
                  profile=LOW_END["profile"], scale=T.DEFAULT_SCALE, name=LOW_END["name"])
        cg = os.path.join(st["cgroup"]["path"], "cgroup.procs")
        args = [a if a != "testbed" else f"testbed:{LOW_END['name']}" for a in cmd]
        subprocess.run(["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', cg] + args,
                       check=True, cwd=C.REPO)
    finally:
        rep = T.down(LOW_END["name"], backing)
        print(f"  900p testbed down: {len(rep['devices_detached'])} devices detached",
              file=sys.stderr)


# -- the Markdown summary ------------------------------------------------------------

def _load_json(name, smoke, outdir=None, trace="minilm"):
    """A figure's JSON as ``BenchConfig.prefix`` names it, or None."""
    p = C.BenchConfig(name=name, smoke=smoke, trace=trace).prefix()
    p = (outdir or C.OUT) / f"{p.name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def _ms(us):
    return f"{us / 1e3:.2f}" if us is not None else "-"


def _md(rows, headers, left: int = 1) -> str:
    """A Markdown table (tabulate): the first ``left`` columns left-aligned,
    the rest (numbers) right-aligned."""
    align = ("left",) * left + ("right",) * (len(headers) - left)
    return C.table(rows, headers, markdown=True, align=align)


def summary(smoke: bool = False, outdir=None, trace: str = "minilm") -> str:
    """Markdown tables of every figure's JSON present in ``outdir``
    (default bench-out/eval) for one trace."""
    def _load(name, smoke):
        return _load_json(name, smoke, outdir, trace)

    out = []
    if trace != "minilm":
        out.append(f"Trace: `--trace {trace}` (tools/bench/_common.py).\n")
    f11 = _load("fig11_methods", smoke)
    if f11:
        d = f11["disks"]
        c = f11.get("ceiling_before") or {}
        out.append(f"### Fig. 11: methods at r = {f11['ratio']} (S = {f11['tokens']}, "
                   f"{d['count']} x {d['profile'] or 'file'} disks)\n")
        if c:
            out.append(f"fio ceiling in the same run: {c['bw_128k']['gb_per_s']:.3f} GB/s "
                       f"(128 KiB, qd 32/device), {c['iops_4k']['gb_per_s']:.3f} GB/s "
                       f"= {c['iops_4k']['iops'] / 1e3:.0f}k IOPS (4 KiB)\n")
        rows = []
        for ds, r in f11["datasets"].items():
            for m, x in r["methods"].items():
                frac = (f"{x['eff_gbps_median'] / c['bw_128k']['gb_per_s']:.0%}"
                        if c else "-")
                scan = _ms(x["score_us_median"]) if m == "no_cluster" else "-"
                rows.append((ds, LABELS.get(m, m), _ms(x["io_us_median"]), scan,
                             f"{x['eff_gbps_median']:.3f}", frac,
                             f"{x.get('goodput_gbps_median') or 0:.3f}",
                             f"{x['bytes_read_median'] / 1e6:.1f}",
                             f"{x['requests_median']:.0f}",
                             f"{x['mean_request_kib_median']:.1f}", f"{x['recall_mean']:.3f}",
                             f"{x['rel_error_mean']:.3f} ({x['oracle_rel_error_mean']:.3f})",
                             f"{x['index_bytes'] / 2**20:.1f}"))
        out.append(_md(rows, ("dataset", "method", "I/O ms", "key-scan ms", "eff. GB/s",
                              "% of fio 128k", "top-k goodput GB/s", "MB read", "requests",
                              "req KiB", "recall", "rel. error (oracle)", "index MiB"), 2))
        out.append("")
        rat = f11["average"]["ratios"]
        if rat:
            out.append("SWARM over each baseline (mean over datasets of the per-dataset "
                       "median ratios):\n")
            rows = []
            for m, x in rat.items():
                pb = f11["paper"]["bw_ratio"].get(m)
                rows.append((LABELS.get(m, m), f"{x['bw_ratio']:.2f}", pb if pb else "-",
                             _num(x.get("goodput_ratio")), f"{x['io_ratio']:.2f}",
                             _num(x.get("io_plus_score_ratio")),
                             f11["paper"]["io_ratio"] if pb else "-",
                             f"{x['recall_delta']:+.3f}"))
            out.append(_md(rows, ("baseline", "eff. bandwidth x", "paper", "top-k goodput x",
                                  "I/O time x", "I/O + selection time x", "paper",
                                  "recall SWARM - baseline")))
            out.append("")
    for name, title, keys in (
            ("fig12_clustering", "Fig. 12: clustering ablations",
             ("io_us_median", "bytes_read_median", "recall_mean")),
            ("fig13_placement", "Fig. 13: placement ablations",
             ("io_us_median", "read_gbps_median", "max_mean_load_median")),
            ("fig14_retrieval", "Fig. 14: retrieval ablations",
             ("io_us_median", "bytes_read_median", "max_mean_load_median"))):
        j = _load(name, smoke)
        if not j:
            continue
        out.append(f"### {title} (S = {j['tokens']}, {j['disks']['count']} disks)\n")
        rows = []
        for n, x in j["variants"].items():
            rr = j.get("ratios", {}).get(n, {})
            vs = ", ".join(f"{k} {v:.2f}" for k, v in rr.items() if isinstance(v, float)
                           and not k.startswith("paper"))
            rows.append((n, *(_fmt(k, x.get(k)) for k in keys), vs or "-"))
        out.append(_md(rows, ("variant", *keys, "vs SWARM")))
        out.append("")
    f18 = _load("fig18_num_disks", smoke)
    if f18:
        out.append(f"### Fig. 18: number of SSDs (S = {f18['tokens']})\n")
        ms = list(f18["points"][0]["methods"])
        rows = []
        for p in f18["points"]:
            c = p.get("ceiling") or {}
            fio = ((f"{c['bw_128k']['gb_per_s']:.3f}", f"{c['iops_4k']['gb_per_s']:.3f}")
                   if c else ("-", "-"))
            rows.append((p["disks"], *fio,
                         *(f"{p['methods'][m]['eff_gbps_median']:.3f}" for m in ms),
                         _ms(p["methods"]["swarm"]["io_us_median"])))
        out.append(_md(rows, ("SSDs", "fio 128k GB/s", "fio 4k GB/s",
                              *(f"{LABELS.get(m, m)} GB/s" for m in ms), "SWARM I/O ms"), 0))
        out.append("")
        for k, t in f18["targets"].items():
            out.append(f"- {k}: " + ", ".join(f"{a}={_num(b)}" for a, b in t.items()))
        out.append("")
    f20 = _load("fig20_sparsity", smoke)
    if f20:
        out.append(f"### Fig. 20: sparsity ratio (S = {f20['tokens']})\n")
        ms = list(f20["points"][0]["methods"])
        rows = [(p["ratio"], *(f"{_ms(p['methods'][m]['io_us_median'])} / "
                               f"{p['methods'][m]['eff_gbps_median']:.3f} / "
                               f"{p['methods'][m]['recall_mean']:.3f}" for m in ms))
                for p in f20["points"]]
        out.append(_md(rows, ("r", *(f"{LABELS.get(m, m)} I/O ms / GB/s / recall"
                                     for m in ms)), 0))
        iso = f20.get("iso_accuracy") or {}
        if iso:
            out.append("")
            out.append(f"Iso-accuracy: I/O time each baseline needs to be as accurate as SWARM "
                       f"at r = 0.1 (error {iso['swarm_rel_error']:.3f}"
                       + (f", mass {iso['swarm_mass']:.3f}" if iso.get("swarm_mass") else "")
                       + f"; I/O {_ms(iso['swarm_io_us'])} ms):\n")
            rows = []
            for m, res in iso["methods"].items():
                for key, x in res.items():
                    if x["reached"]:
                        low = (" (at or below the smallest r)"
                               if x["at_or_below_smallest_ratio"] else "")
                        rows.append((LABELS.get(m, m), key, f"{x['ratio_needed']:.3f}{low}",
                                     _ms(x["io_us_needed"]), f"{x['io_ratio_vs_swarm']:.2f}"))
                    else:
                        rows.append((LABELS.get(m, m), key,
                                     f"not reached (best {x['best']:.3f})", "-", "-"))
            out.append(_md(rows, ("baseline", "by", "r needed", "I/O ms needed",
                                  "I/O time x SWARM"), 2))
        out.append("")
    f19 = _load("fig19_tau", smoke)
    if f19:
        out.append(f"### Fig. 19: tau with dataset shift (S = {f19['tokens']})\n")
        rows = [(r["context"], r["profile"], r["tau"], _ms(r["io_us_median"]),
                 f"{r['eff_gbps_median']:.3f}", f"{r['recall_mean']:.3f}", r["clusters_total"],
                 f"{r['replication']:.2f}") for r in f19["rows"]]
        out.append(_md(rows, ("context", "profiled on", "tau", "I/O ms", "eff. GB/s", "recall",
                              "clusters", "replication"), 2))
        out.append("")
    f17 = _load("fig17_ssd_type", smoke)
    if f17:
        out.append("### Fig. 17: SSD type (4 disks; effective GB/s, median)\n")
        for prof, j in f17["profiles"].items():
            c = j.get("ceiling") or {}
            ms = list(j["points"][0]["methods"])
            out.append(f"{prof}" + (f" (fio 128k {c['bw_128k']['gb_per_s']:.3f} GB/s, "
                                    f"4k {c['iops_4k']['gb_per_s']:.3f} GB/s)" if c else "")
                       + ":\n")
            rows = [(p["tokens"], *(f"{p['methods'][m]['eff_gbps_median']:.3f}" for m in ms))
                    for p in j["points"]]
            out.append(_md(rows, ("S", *(LABELS.get(m, m) for m in ms)), 0))
            out.append("")
    f16 = _load("fig16_prefix_batch", smoke)
    if f16:
        out.append("### Fig. 16: prefix length x batch (SWARM)\n")
        rows = [(r["tokens"], r["batch"], _ms(r["io_us_median"]), f"{r['eff_gbps_median']:.3f}",
                 f"{r['bytes_read_median'] / 1e6:.1f}", f"{r['requests_median']:.0f}",
                 f"{r['recall_mean_b1']:.3f}") for r in f16["rows"]]
        out.append(_md(rows, ("S", "batch", "I/O ms", "eff. GB/s", "MB read", "requests",
                              "recall (B=1)"), 0))
        out.append("")
    t4 = _load("table4_selection", smoke)
    if t4:
        out.append("### Table 4: selection latency\n")
        rows = []
        for r in t4["rows"]:
            pp = r.get("paper")
            rows.append((r["tokens"], f"{r['naive_ms']:.3f}", f"{r['swarm_ms']:.3f}",
                         f"{r['speedup']:.1f}", f"{r['swarm_index_bytes'] / 2**20:.1f}",
                         r["clusters"], f"{pp[0]} / {pp[1]}" if pp else "-"))
        out.append(_md(rows, ("S", "naive ms", "medoid ms", "speedup", "medoid index MiB",
                              "clusters", "paper naive / SWARM ms"), 0))
        out.append("")
    return "\n".join(out)


def _fmt(k, v):
    if v is None:
        return "-"
    if k.startswith("io_us"):
        return f"{v / 1e3:.2f} ms"
    if k.startswith("bytes"):
        return f"{v / 1e6:.2f} MB"
    return f"{v:.3f}"


def _num(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
