#!/usr/bin/env python3
"""The long-context task suite: every method on the same inputs (issue 22).

Inputs (seeded, :mod:`swarmfs.models.tasks`): for each context length, a
number of samples, each one context of held-out filler (Python source and
prose alternate, :func:`swarmfs.models.heldout_texts`, text the decoder
never trained on) holding one instance of every task (passkey, needle,
multi-key and multi-value needles, variable tracking, long-range copy),
followed by the queries and their answers.  Each method prefills the
context, then is teacher-forced through the queries and answers one decode
step at a time (so the context grows by appends while it decodes); a task is
solved (exact match) when every answer token is the argmax.  Beside the
tasks, perplexity and KL(dense || method) of ``--continuation`` tokens of
held-out text after a context of the same length.

Methods (all on the same token ids, at each sparsity ratio r):

* ``dense`` -- full attention (SDPA), the reference.
* ``swarm`` -- :class:`swarmfs.hf.SwarmCache` (SWARM §5-§7: layout, medoid
  index, window, hot clusters, batched reads from file disks).
* ``swarm@TAU/CAP/REP`` (``--swarm-layout``) -- ``swarm`` laid out with
  radius TAU, at most CAP entries per cluster, and a ``medoid`` or
  ``centroid`` index (``LayoutParams``): the operating points of issue 23.
* ``quest``, ``infllm``, ``pqcache`` -- the same store and Retriever with
  the baselines' layouts and indexes (``swarmfs.layout._baselines``).
* ``sinks`` -- StreamingLLM: the first 4 tokens and the most recent ones,
  ``ceil(r S)`` in all (a mask over dense attention; no store).
* ``oracle`` -- the exact top ``ceil(r S)`` context tokens of each query by
  head-averaged attention mass, shared across heads (the ceiling of any
  shared selection at that budget); ``oracle-head`` -- the same per KV head.

Reported per length, method and r: exact-match accuracy per task, perplexity,
KL, attention-mass recall, DRAM held as a fraction of the context's KV (index
+ window + hot clusters; masks: 0), SSD bytes, requests and mean read size per
step (medians), entries per cluster.  Output: JSON, a rich table, and plots
(accuracy against r per method; accuracy against context length).

Usage::

    tools/dev run python -m tools.suite --out docs/data/suite.json --plots docs/img
    tools/dev run python -m tools.suite --quick          # CI: well under a minute
"""

from __future__ import annotations

import json
import math
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import click
import numpy as np

from tools._options import COUNT, RATIO, OutPath

STORE_METHODS = ("swarm", "quest", "infllm", "pqcache")
MASK_METHODS = ("sinks", "oracle", "oracle-head")
METHODS = ("dense", *STORE_METHODS, *MASK_METHODS)
SINKS = 4
KINDS = ("python", "prose")


# -- model and inputs ---------------------------------------------------------------

def load_model(path: pathlib.Path, threads: int):
    """The decoder (float32, eval) with the ``swarm`` attention enabled, and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmfs import hf
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.enable(model)
    return model, tok


def fillers(tok) -> dict[str, np.ndarray]:
    """Held-out token streams per kind (never trained on)."""
    from swarmfs.models import heldout_texts
    return {k: np.asarray(tok(heldout_texts(k), verbose=False)["input_ids"], dtype=np.int64)
            for k in KINDS}


def task_samples(tok, fill: dict, length: int, n: int, seed: int):
    """``n`` :class:`~swarmfs.models.tasks.SuiteSample` of ``length`` tokens
    (kinds alternate), seeded by (seed, length, i)."""
    from swarmfs.models.tasks import Templates, make_suite_sample
    t = Templates(lambda s: tok(s, add_special_tokens=False)["input_ids"])
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        out.append((kind, make_suite_sample(fill[kind], length, [seed, length, i], t)))
    return out


# -- methods: logits of the teacher-forced region ---------------------------------

def _logp(logits):
    import torch
    return torch.log_softmax(logits.float(), dim=-1)


def dense_logits(model, ids: np.ndarray, start: int):
    """Log-probabilities float32 [n - start, V] predicting ``ids[start:]``, dense."""
    import torch
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            x = torch.from_numpy(ids[None])
            return _logp(model(x, use_cache=False).logits[0, start - 1:-1])
    finally:
        from swarmfs import hf
        hf.enable(model)


def masked_logits(model, ids: np.ndarray, start: int, budget: int, policy: str):
    """Teacher-forced decode after a dense prefill of ``ids[:start]``; each
    decode query sees ``budget`` context tokens chosen by ``policy`` (module
    docstring) plus every token decoded so far.  The selection is a mask
    over SDPA through an attention function registered for the call."""
    import torch
    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    S = start

    def attn(module, query, key, value, mask, **kw):
        if query.shape[2] != 1:
            return sdpa_attention_forward(module, query, key, value, mask, **kw)
        L, hkv = key.shape[2], key.shape[1]
        g = query.shape[1] // hkv
        keep = torch.zeros(hkv, L, dtype=torch.bool)
        keep[:, S:] = True
        k = min(budget, S)
        if policy == "sinks":
            keep[:, :min(SINKS, k)] = True
            keep[:, S - max(0, k - SINKS):S] = True
        else:
            logits = torch.einsum("hgd,hsd->hgs", query[0, :, 0].float().view(hkv, g, -1),
                                  key[0, :, :S].float()) * kw.get("scaling", 1.0)
            p = torch.softmax(logits, -1).mean(1)                   # [H_kv, S]
            if policy == "oracle":
                keep[:, p.mean(0).topk(k).indices] = True
            else:
                keep.scatter_(1, p.topk(k, dim=-1).indices, True)
        m = keep.repeat_interleave(g, 0)[None, :, None, :]
        return sdpa_attention_forward(module, query, key, value, m, **kw)

    name = f"suite-{policy}"
    AttentionInterface.register(name, attn)
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            dc = DynamicCache()
            out = model(torch.from_numpy(ids[None, :S]), cache=dc, use_cache=True)
            lg = [out.logits[0, -1]]
            for t in range(S, ids.size - 1):
                lg.append(model(torch.from_numpy(ids[None, t:t + 1]), cache=dc,
                                use_cache=True).logits[0, -1])
        return _logp(torch.stack(lg)), {}
    finally:
        from swarmfs import hf
        hf.enable(model)


def kv_bytes(model, tokens: int) -> int:
    """Bytes of ``tokens`` tokens' K and V over all layers, in the store's dtype (float32 here)."""
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * d * 4 * tokens


def parse_variant(text: str) -> tuple[str, dict]:
    """``"TAU/CAP/REP"`` (``0.9/16/centroid``) -> (method label, LayoutParams
    fields): a SWARM layout other than the decoder default."""
    from swarmfs.layout import LayoutParams
    try:
        tau, cap, rep = text.split("/")
        fields = {"tau": float(tau), "max_cluster_size": int(cap), "representative": rep}
        LayoutParams(**fields)
    except Exception as exc:                           # noqa: BLE001 (reported as usage)
        raise click.BadParameter(f"{text!r}: TAU/CAP/REP, e.g. 0.9/16/centroid ({exc})") \
            from None
    return f"swarm@{text}", fields


def base_method(method: str) -> str:
    """``swarm@...`` -> ``swarm``; other methods unchanged."""
    return method.split("@", 1)[0]


def store_logits(model, ids: np.ndarray, start: int, *, method: str, ratio: float,
                 workdir: pathlib.Path, disks: int):
    """Teacher-forced decode with the KV on swarmfs (``method``: a store
    method, or ``swarm@TAU/CAP/REP``), and the step's cost: recall, DRAM
    fraction, SSD bytes / requests / mean read, entries per cluster."""
    import torch

    from swarmfs import hf
    from swarmfs._generate import recall_report
    from swarmfs.layout import LayoutParams
    layout = LayoutParams(**parse_variant(method.split("@", 1)[1])[1]) if "@" in method \
        else None
    path = workdir / f"{base_method(method)}-{ratio}-{time.monotonic_ns()}"
    with torch.no_grad(), hf.SwarmCache(path, model.config, ratio=ratio, disks=disks,
                                        method=base_method(method), record=True,
                                        append=True, force=True, layout=layout) as cache:
        out = model(torch.from_numpy(ids[None, :start]), cache=cache, use_cache=True)
        lg, dram = [out.logits[0, -1]], 0
        for t in range(start, ids.size - 1):
            lg.append(model(torch.from_numpy(ids[None, t:t + 1]), cache=cache,
                            use_cache=True).logits[0, -1])
            if t == start:          # after the first step: index, window and hot clusters
                dram = cache.dram_bytes()
        rec = recall_report(cache, ratio, start)
        rows = cache.step_table()
        lay = cache.layout_report
    reads = sum(r["requests"] for r in rows)
    epc = [v["mean_size"] for v in lay.values() if "mean_size" in v]
    import shutil
    shutil.rmtree(path, ignore_errors=True)
    cost = {"recall": rec["recall"], "dram_fraction": dram / kv_bytes(model, start),
            "bytes_per_step": statistics.median(r["bytes_read"] for r in rows) if rows else 0.0,
            "requests_per_step": statistics.median(r["requests"] for r in rows) if rows else 0.0,
            "mean_read_bytes": sum(r["bytes_read"] for r in rows) / reads if reads else 0.0,
            "entries_per_cluster_min": min(epc) if epc else None,
            "entries_per_cluster": float(np.mean(epc)) if epc else None}
    return _logp(torch.stack(lg)), cost


def run_method(model, ids, start, method, ratio, workdir, disks):
    """(log-probabilities [n - start, V], cost dict) of one method on one input."""
    budget = math.ceil(ratio * start)
    if method == "dense":
        return dense_logits(model, ids, start), {"dram_fraction": 1.0}
    if method in MASK_METHODS:
        return masked_logits(model, ids, start, budget, method)
    return store_logits(model, ids, start, method=method, ratio=ratio, workdir=workdir,
                        disks=disks)


# -- the suite ------------------------------------------------------------------------

def exact_match(logp, sample) -> dict[str, bool]:
    """task -> every answer token is the argmax."""
    pred = logp.argmax(-1).numpy()
    s = sample.context_end
    return {task: bool((pred[a - s:b - s] == sample.ids[a:b]).all())
            for task, a, b in sample.answers}


def kl(dense_lp, lp) -> float:
    """Mean over positions of KL(dense || method) in nats."""
    return float((dense_lp.exp() * (dense_lp - lp)).sum(-1).mean())


def nll(lp, targets: np.ndarray) -> float:
    import torch
    return float(-lp.gather(-1, torch.from_numpy(targets)[:, None]).mean())


def run_suite(args, model, tok, log) -> dict:
    fill = fillers(tok)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
        wd = pathlib.Path(wd)
        for length in args.lengths:
            samples = task_samples(tok, fill, length, args.samples, args.seed)
            for kind, smp in samples:
                dense = None
                for r in args.ratios:
                    for m in args.methods:
                        if m == "dense" and dense is not None:
                            continue
                        t0 = time.perf_counter()
                        lp, cost = run_method(model, smp.ids, smp.context_end, m, r, wd,
                                              args.disks)
                        em = exact_match(lp, smp)
                        if m == "dense":
                            dense = lp
                        row = {"part": "tasks", "length": length, "kind": kind,
                               "method": m, "ratio": None if m == "dense" else r,
                               "exact": em, "kl": kl(dense, lp) if dense is not None else None,
                               "seconds": time.perf_counter() - t0, **cost}
                        runs.append(row)
                        log(f"tasks L={length} {kind:6s} {m:11s} r={row['ratio']} "
                            f"acc {np.mean(list(em.values())):.2f} {row['seconds']:.1f} s")
            for kind in KINDS:
                ids = fill[kind][args.offset:args.offset + length + args.continuation]
                if ids.size < length + args.continuation:
                    continue
                dense = None
                for r in args.ratios:
                    for m in args.methods:
                        if m == "dense" and dense is not None:
                            continue
                        t0 = time.perf_counter()
                        lp, cost = run_method(model, ids, length, m, r, wd, args.disks)
                        if m == "dense":
                            dense = lp
                        row = {"part": "text", "length": length, "kind": kind, "method": m,
                               "ratio": None if m == "dense" else r,
                               "nll": nll(lp, ids[length:]), "kl": kl(dense, lp),
                               "seconds": time.perf_counter() - t0, **cost}
                        runs.append(row)
                        log(f"text  L={length} {kind:6s} {m:11s} r={row['ratio']} "
                            f"ppl {math.exp(row['nll']):.2f} KL {row['kl']:.4f}")
    return {"runs": runs, "summary": summarize(runs)}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (length, method, r): accuracy per task and overall,
    perplexity (geometric over kinds), KL, and the cost means."""
    from swarmfs.models.tasks import TASKS
    keys = sorted({(r["length"], r["method"], r["ratio"] or 0.0) for r in runs},
                  key=lambda x: (x[0], METHODS.index(base_method(x[1])), x[1], x[2]))
    out = []
    for length, m, ratio in keys:
        sel = [r for r in runs if r["length"] == length and r["method"] == m
               and (r["ratio"] or 0.0) == ratio]
        tasks = [r for r in sel if r["part"] == "tasks"]
        text = [r for r in sel if r["part"] == "text"]
        row = {"length": length, "method": m, "ratio": ratio or None,
               "samples": len(tasks)}
        for t in TASKS:
            v = [r["exact"][t] for r in tasks if t in r["exact"]]
            row[f"acc_{t}"] = float(np.mean(v)) if v else None
        row["accuracy"] = _mean([row[f"acc_{t}"] for t in TASKS])
        row["ppl"] = math.exp(np.mean([r["nll"] for r in text])) if text else None
        row["kl"] = _mean([r["kl"] for r in text])
        for f in ("recall", "dram_fraction", "bytes_per_step", "requests_per_step",
                  "mean_read_bytes", "entries_per_cluster", "entries_per_cluster_min"):
            row[f] = _mean([r.get(f) for r in sel])
        out.append(row)
    return out


def render(summary: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    from swarmfs.models.tasks import TASKS
    t = Table(title="long-context suite (accuracy = exact match; cost per decode step)")
    cols = ["L", "method", "r", *TASKS, "acc", "ppl", "KL", "recall", "DRAM/KV",
            "KB/step", "reads", "read B", "ent/cl"]
    for c in cols:
        t.add_column(c, justify="right")

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)
    for r in summary:
        t.add_row(str(r["length"]), r["method"], f(r["ratio"], ".2f"),
                  *[f(r[f"acc_{k}"], ".2f") for k in TASKS], f(r["accuracy"], ".3f"),
                  f(r["ppl"], ".2f"), f(r["kl"], ".4f"), f(r["recall"], ".3f"),
                  f(r["dram_fraction"], ".3f"),
                  f(None if r["bytes_per_step"] is None else r["bytes_per_step"] / 1024, ".1f"),
                  f(r["requests_per_step"], ".0f"), f(r["mean_read_bytes"], ".0f"),
                  f(r["entries_per_cluster"], ".1f"))
    Console(width=220).print(t)


def plot(summary: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
    """accuracy against r per method (one panel per length), and accuracy
    against context length per method (at each r)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    lengths = sorted({r["length"] for r in summary})
    ratios = sorted({r["ratio"] for r in summary if r["ratio"]})
    methods = sorted({r["method"] for r in summary},
                     key=lambda m: (METHODS.index(base_method(m)), m))
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.6), squeeze=False)
    for ax, length in zip(axes[0], lengths, strict=True):
        for m in methods:
            rows = [r for r in summary if r["length"] == length and r["method"] == m]
            if m == "dense" and rows:
                ax.axhline(rows[0]["accuracy"], color="k", ls="--", label="dense")
                continue
            rows = sorted(rows, key=lambda r: r["ratio"])
            ax.plot([r["ratio"] for r in rows], [r["accuracy"] for r in rows], "o-", label=m)
        ax.set(title=f"{length} tokens", xlabel="sparsity ratio r", ylabel="accuracy",
               ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    p1 = out / "suite_accuracy_vs_r.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(1, max(1, len(ratios)), figsize=(4.5 * max(1, len(ratios)), 3.6),
                             squeeze=False)
    for ax, r in zip(axes[0], ratios or [None], strict=True):
        for m in methods:
            rows = sorted((x for x in summary if x["method"] == m and
                           (m == "dense" or x["ratio"] == r)), key=lambda x: x["length"])
            ax.plot([x["length"] for x in rows], [x["accuracy"] for x in rows],
                    "k--" if m == "dense" else "o-", label=m)
        ax.set(title=f"r = {r}", xlabel="context tokens", ylabel="accuracy", xscale="log",
               ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    p2 = out / "suite_accuracy_vs_length.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]


def _ints(ctx, param, value):
    try:
        xs = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: comma-separated token counts") from None
    if any(x < 256 for x in xs):
        raise click.BadParameter(f"{value!r}: each length must be at least 256")
    return xs


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=pathlib.Path),
              default=None, help="decoder directory (default swarmfs.models.DEFAULT_DECODER)")
@click.option("--lengths", callback=_ints, default="4096,8192,16384",
              help="context lengths, comma-separated")
@click.option("--samples", type=COUNT, default=2, help="task samples per length")
@click.option("--ratios", type=RATIO, multiple=True, default=[0.1])
@click.option("--methods", multiple=True, type=click.Choice(METHODS), default=METHODS)
@click.option("--swarm-layout", "variants", multiple=True, callback=lambda c, p, v: v,
              help="also run SWARM laid out as TAU/CAP/REP (e.g. 0.9/16/centroid: "
                   "radius, entries-per-cluster cap, medoid or centroid index)")
@click.option("--continuation", type=COUNT, default=64,
              help="held-out text tokens scored after each context (perplexity, KL)")
@click.option("--offset", type=click.IntRange(min=0), default=0,
              help="where the held-out text windows start")
@click.option("--disks", type=click.IntRange(min=1), default=4)
@click.option("--seed", type=int, default=1000)
@click.option("--threads", type=COUNT, default=2)
@click.option("--workdir", type=click.Path(file_okay=False), default=None)
@click.option("--quick", is_flag=True,
              help="the CI subset: 1,024 tokens, one sample, r = 0.1")
@click.option("--out", type=OutPath(), default=None, help="JSON results")
@click.option("--plots", type=click.Path(file_okay=False, path_type=pathlib.Path), default=None,
              help="directory for the plots")
def cli(**o):
    import types
    args = types.SimpleNamespace(**o)
    if args.quick:
        args.lengths, args.samples, args.continuation = (1024,), 1, 16
        args.ratios = args.ratios if o["ratios"] != (0.1,) else (0.1,)
    args.methods = (*args.methods, *(parse_variant(v)[0] for v in args.variants))
    if "dense" not in args.methods:         # the reference of every KL
        args.methods = ("dense", *args.methods)
    from swarmfs.models import DEFAULT_DECODER
    args.model = args.model or DEFAULT_DECODER
    model, tok = load_model(args.model, args.threads)
    t0 = time.perf_counter()
    res = run_suite(args, model, tok, lambda s: print(s, file=sys.stderr, flush=True))
    res["config"] = {k: (str(v) if isinstance(v, pathlib.Path) else v)
                     for k, v in vars(args).items()}
    res["machine"] = {"cpu": platform.processor() or platform.machine(),
                      "python": platform.python_version(), "seconds": time.perf_counter() - t0}
    render(res["summary"])
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    if args.plots:
        plot(res["summary"], args.plots)
    return res


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line)."""
    return cli.main(args=argv, standalone_mode=argv is None)


if __name__ == "__main__":
    sys.exit(main())
