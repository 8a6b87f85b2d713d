#!/usr/bin/env python3
"""Offline layout benchmarks: scale (time, peak RSS) and retrieval recall.

``scale``: profiling (§5.1 step 1) + clustering (steps 2-4, Algorithm 1) of
one MiniLM layer at S = 16K, 32K, 64K and 128K tokens, with the default
settings.  The queries and keys are real: all-MiniLM-L6-v2 run over
WikiText-2 (test split, ~273K MiniLM tokens) in 512-token windows, captured
once and cached (``--cache``).  Each S runs in a fresh subprocess that loads
only that layer's first S queries/keys, so its peak RSS (``ru_maxrss``) is
the RSS of one layer's profiling + clustering, including those inputs.

``recall``: attention-mass recall of medoid-based cluster retrieval for
held-out queries (``swarmfs.layout._quality``), per layer, for the Jaccard
metric (default) and eq. 2 as written, on WikiText-2 and GSM8K.  The first
``--context`` tokens are the stored context: profiling samples its queries;
evaluation uses ``--heldout`` queries drawn from the following tokens (never
profiled), each attending to the whole context.

    python -m tools.bench_layout scale --out bench-out/layout-scale.json
    python -m tools.bench_layout recall --context 3072 --eq2-counts 0.0125,0.025 \
        --out bench-out/recall-3k.json
    python -m tools.bench_layout recall --context 16384 --heldout-span 4096 \
        --eq2-counts 0.0125,0.025 --out bench-out/recall-16k.json
    python -m tools.bench_layout recall --datasets wikitext2 --context 16384 \
        --heldout-span 4096 --taus 0.5,0.6,0.7 --eq2-counts 0.0125,0.025,0.05 \
        --out bench-out/recall-sweep-16k.json

``--eq2-counts`` gives eq. 2's threshold as a fraction of the profiled queries
(0.0125 x 2048 = 26 co-activations, i.e. tau = 1 - 26 / F).  Recall lines
report, per layer: ``W256``/``W0`` = local window of 256 / none, ``prob``/
``logit`` = medoid scoring, ``bound`` = best possible recall with the window
forced in, ``reads`` = clusters fetched per query, ``blocks`` = recall of
position-contiguous blocks of the same mean size.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
import types

import click
import numpy as np

from tools._options import COUNT, CommaList, FiniteFloat, OutPath
from tools._shared_data import data_dir

DATA = data_dir()
TEXTS = {"wikitext2": DATA / "wikitext2_raw_test.raw", "gsm8k": DATA / "gsm8k_test.jsonl"}


def _rss_mb() -> float:
    """Peak RSS of this process image in MB (VmHWM: unlike ru_maxrss, it is
    not inherited from the parent across fork + exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cached_capture(dataset: str, tokens: int, layers, cache: pathlib.Path) -> pathlib.Path:
    """Capture MiniLM over a dataset once; reuse the file afterwards."""
    from swarmfs.layout._capture import capture, read_text, save_capture
    tag = "all" if layers is None else "-".join(map(str, layers))
    path = cache / f"minilm-{dataset}-{tokens}-L{tag}.safetensors"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    cap = capture(text=read_text(TEXTS[dataset]), max_tokens=tokens, layers=layers,
                  text_source=f"{dataset} ({TEXTS[dataset].name})", progress=True)
    if cap.num_tokens < tokens:
        raise SystemExit(f"{dataset} has only {cap.num_tokens} tokens, need {tokens}")
    save_capture(path, cap)
    print(f"captured {tokens} tokens of {dataset} in {time.perf_counter() - t:.1f} s "
          f"-> {path}", file=sys.stderr)
    return path


# -- scale ---------------------------------------------------------------------

def _scale_worker(args) -> None:
    """One S in this process: load q/k[:S], profile, cluster; print JSON."""
    from safetensors import safe_open

    from swarmfs.layout._cluster import cluster
    from swarmfs.layout._profile import profile_layer
    S = args.tokens
    with safe_open(args.capture, framework="numpy") as f:
        meta = f.metadata()
        q = np.ascontiguousarray(f.get_slice("q")[0, :, :S], dtype=np.float32)
        k = np.ascontiguousarray(f.get_slice("k")[0, :, :S], dtype=np.float32)
    scaling = float(meta.get("scaling", k.shape[-1] ** -0.5))
    rss_in = _rss_mb()
    t0 = time.perf_counter()
    prof = profile_layer(q, k, scaling=scaling)
    t1 = time.perf_counter()
    cl = cluster(prof, keys=k)
    t2 = time.perf_counter()
    st = cl.stats
    print(json.dumps({
        "tokens": S, "layer": args.layer, "profile_s": t1 - t0, "cluster_s": t2 - t1,
        "graph_s": st.graph_seconds, "algorithm1_s": st.cluster_seconds,
        "total_s": t2 - t0, "peak_rss_mb": _rss_mb(), "rss_inputs_mb": rss_in,
        "queries": prof.num_queries, "activations": int(prof.acts.nnz),
        "method": st.method, "tau": st.tau, "edges": st.edges,
        "candidate_pairs": st.candidate_pairs, "clusters": st.num_clusters,
        "size_mean": st.size_mean, "size_max": st.size_max, "replication": st.replication,
        "singletons": st.singletons, "idle_entries": st.idle_entries}))


def cmd_scale(args) -> dict:
    sizes = [int(s) for s in args.sizes.split(",")]
    cap = cached_capture("wikitext2", max(sizes), [args.layer], args.cache)
    rows = []
    for S in sizes:
        out = subprocess.run([sys.executable, "-m", "tools.bench_layout", "_scale_worker",
                              "--capture", str(cap), "--tokens", str(S),
                              "--layer", str(args.layer)],
                             check=True, capture_output=True, text=True,
                             cwd=pathlib.Path(__file__).resolve().parents[1])
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"S={S:>6}  profile {row['profile_s']:5.1f} s  graph {row['graph_s']:5.1f} s  "
              f"alg1 {row['algorithm1_s']:5.1f} s  total {row['total_s']:5.1f} s  "
              f"peak RSS {row['peak_rss_mb']:6.0f} MB", file=sys.stderr, flush=True)
    hdr = (f"{'S':>7} {'profile s':>9} {'graph s':>8} {'alg.1 s':>8} {'total s':>8} "
           f"{'peak RSS MB':>11} {'method':>7} {'edges':>9} {'clusters':>8} {'mean size':>9} "
           f"{'replication':>11}")
    print(hdr)
    for r in rows:
        print(f"{r['tokens']:>7} {r['profile_s']:>9.1f} {r['graph_s']:>8.1f} "
              f"{r['algorithm1_s']:>8.1f} {r['total_s']:>8.1f} {r['peak_rss_mb']:>11.0f} "
              f"{r['method']:>7} {r['edges']:>9} {r['clusters']:>8} {r['size_mean']:>9.1f} "
              f"{r['replication']:>11.2f}")
    return {"benchmark": "layout-scale", "model": "all-MiniLM-L6-v2", "text": "wikitext2",
            "layer": args.layer, "cpu_count": os.cpu_count(), "rows": rows}


# -- recall --------------------------------------------------------------------

def cmd_recall(args) -> dict:
    from swarmfs.layout._capture import load_capture
    from swarmfs.layout._cluster import DEFAULT_TAU, cluster, eq2_tau
    from swarmfs.layout._profile import profile_layer
    from swarmfs.layout._quality import block_clustering, evaluate_recall
    ctx = args.context
    span = args.heldout_span or max(args.heldout, 1024)
    results = []
    for ds in args.datasets.split(","):
        path = cached_capture(ds, ctx + span, None, args.cache)
        cap = load_capture(path)
        rng = np.random.default_rng(args.seed)
        pool = np.arange(ctx, ctx + span)
        held = np.sort(rng.choice(pool, size=min(args.heldout, span), replace=False))
        for L in (args.layers or range(cap.num_layers)):
            k = np.ascontiguousarray(cap.k[L][:, :ctx], dtype=np.float32)
            qe = np.ascontiguousarray(cap.q[L][:, held], dtype=np.float32)
            prof = profile_layer(cap.q[L][:, :ctx], k, scaling=cap.scaling,
                                 max_queries=args.max_queries)
            n_q = prof.num_queries
            settings = [("jaccard", tau, None) for tau in (args.taus or [DEFAULT_TAU])]
            settings += [("eq2", eq2_tau(prof, frac * n_q), frac)
                         for frac in args.eq2_counts]
            for metric, tau, frac in settings:
                t = time.perf_counter()
                cl = cluster(prof, tau=tau, metric=metric, keys=k)
                secs = time.perf_counter() - t
                rec = {"dataset": ds, "layer": L, "context": ctx, "metric": metric,
                       "tau": tau, "eq2_min_count": None if frac is None else frac * n_q,
                       "clusters": cl.stats.num_clusters, "size_mean": cl.stats.size_mean,
                       "size_max": cl.stats.size_max, "replication": cl.stats.replication,
                       "singletons": cl.stats.singletons, "cluster_s": secs}
                for W in (256, 0):
                    for score in ("prob", "logit"):
                        r = evaluate_recall(cl, qe, k, scaling=cap.scaling, local_window=W,
                                            score=score)
                        rec[f"recall_{score}_W{W}"] = r.mean
                        rec[f"reads_{score}_W{W}"] = float(r.clusters_read.mean())
                    rec[f"bound_W{W}"] = r.bound
                    b = block_clustering(ctx, max(2, round(cl.stats.size_mean)))
                    rec[f"blocks_prob_W{W}"] = evaluate_recall(
                        b, qe, k, scaling=cap.scaling, local_window=W).mean
                results.append(rec)
                name = f"jaccard {tau:g}" if frac is None else f"eq2 f>{frac * n_q:.0f}"
                print(f"{ds:>9} L{L} {name:>12}: C={rec['clusters']:>6} "
                      f"size {rec['size_mean']:5.1f} rep {rec['replication']:4.2f} "
                      f"single {rec['singletons']:>5} | W256 prob {rec['recall_prob_W256']:.3f} "
                      f"logit {rec['recall_logit_W256']:.3f} bound {rec['bound_W256']:.3f} "
                      f"reads {rec['reads_prob_W256']:6.0f} | W0 prob {rec['recall_prob_W0']:.3f} "
                      f"logit {rec['recall_logit_W0']:.3f} reads {rec['reads_prob_W0']:6.0f} | "
                      f"blocks W0 {rec['blocks_prob_W0']:.3f}", flush=True)
    return {"benchmark": "layout-recall", "model": "all-MiniLM-L6-v2", "context": ctx,
            "heldout": int(args.heldout), "ratio": 0.1, "results": results}


_CACHE = pathlib.Path(tempfile.gettempdir()) / "swarmfs-bench"
_PATH = click.Path(path_type=pathlib.Path, file_okay=False)
_OUT = OutPath(path=True)


def _write(result: dict, out: pathlib.Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


@click.group(help=__doc__.split("\n\n")[0])
def cli():
    pass


@cli.command(help="time and peak RSS per S")
@click.option("--sizes", type=CommaList(int, item=COUNT, keep_text=True),
              default="16384,32768,65536,131072")
@click.option("--layer", type=click.IntRange(0, 5), default=2)
@click.option("--cache", type=_PATH, default=_CACHE)
@click.option("--out", type=_OUT)
def scale(out, **options):
    _write(cmd_scale(types.SimpleNamespace(**options)), out)


@cli.command(help="held-out recall per layer and metric")
@click.option("--datasets", type=CommaList(choices=list(TEXTS), keep_text=True),
              default="wikitext2,gsm8k")
@click.option("--context", type=COUNT, default=3072)
@click.option("--heldout", type=COUNT, default=256)
@click.option("--heldout-span", type=COUNT, default=None,
              help="held-out queries come from [context, context + span)")
@click.option("--max-queries", type=COUNT, default=2048)
@click.option("--taus", type=CommaList(float, item=FiniteFloat(0, 1)), default=None,
              help="Jaccard radii (default: the library default)")
@click.option("--layers", type=CommaList(int, item=click.IntRange(0, 5)), default=None)
@click.option("--eq2-counts", type=CommaList(float, item=FiniteFloat(0, 1, min_open=True)),
              default=[0.025, 0.05, 0.1],
              help="eq. 2 thresholds as fractions of the profiled queries")
@click.option("--seed", type=int, default=0)
@click.option("--cache", type=_PATH, default=_CACHE)
@click.option("--out", type=_OUT)
def recall(out, **options):
    _write(cmd_recall(types.SimpleNamespace(**options)), out)


@cli.command("_scale_worker", hidden=True)
@click.option("--capture")
@click.option("--tokens", type=int)
@click.option("--layer", type=int)
def scale_worker(**options):
    _scale_worker(types.SimpleNamespace(**options))


def main(argv=None) -> None:
    """Run :func:`cli` (``argv`` None: the command line, as a program)."""
    return cli.main(args=argv, obj=argv, standalone_mode=argv is None)


if __name__ == "__main__":
    main()
