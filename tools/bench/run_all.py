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
import importlib
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
              help="the trace every figure runs on (see tools/bench/_common/)")
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


def summary(smoke: bool = False, outdir=None, trace: str = "minilm") -> str:
    """Markdown tables of every figure's JSON present in ``outdir``
    (default bench-out/eval) for one trace, in :data:`FIGURES` order: each
    figure module's ``summary(payload)`` writes its own section."""
    out = []
    if trace != "minilm":
        out.append(f"Trace: `--trace {trace}` (tools/bench/_common/__init__.py).\n")
    for _, module, _ in FIGURES:
        payload = _load_json(module, smoke, outdir, trace)
        if payload:
            out.append(importlib.import_module(f"tools.bench.{module}").summary(payload))
    return "\n".join(out)


if __name__ == "__main__":
    main()
