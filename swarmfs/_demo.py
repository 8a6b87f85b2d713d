"""The demos: the main job end to end (``swarmfs demo``).

* :func:`run_demo` -- the default demo: the decoder trained for swarmfs
  decodes held-out long inputs with its KV cache on N disk files, against
  dense attention (:mod:`swarmfs._generate` runs each input).
* :func:`run_capture_demo` -- ``swarmfs demo --minilm``, the capture example,
  below (and ``build_store`` for ``swarmfs build``):

1. **Capture** a real model's K, V and Q over real text (default:
   all-MiniLM-L6-v2 over the standard library's docstrings).  The first
   ``context`` tokens are the stored context; the next ``eval`` tokens are a
   held-out continuation whose queries are never used in profiling.
2. **Layout** per layer (SWARM §5.1-5.2): activation profile of the context's
   own queries (causal), co-activation clustering with replication
   (Algorithm 1), hot clusters by eq. 6 under a DRAM budget, eq. 7 placement.
3. **Store** the clusters on N disk files (striped, checksummed).
4. **Retrieve** for every held-out query and layer (medoid scoring, clusters
   until r x S, dedup, entry buckets, one batched io_uring read) and compare
   with the oracle top-k: attention-mass recall and attention-output error,
   with the exact K/V read back from the disks.
"""

from __future__ import annotations

import os
import time

import numpy as np

from . import _defaults as defaults
from . import _errors as errors
from . import _validate as V
from .decode._report import evaluate_query, summarize
from .decode._retrieve import Retriever
from .decode._window import entry_budget, stored_window
from .layout._layer import LayoutParams, lay_out_layer
from .store._store import Store

__all__ = ["build_store", "evaluate_store", "local_window", "render", "run_capture_demo",
           "run_demo"]


def local_window(params: LayoutParams, num_tokens: int) -> int:
    """W stored for a context of ``num_tokens`` laid out with ``params``:
    :func:`swarmfs.decode._window.stored_window` (the retrieval's window rule at the
    layout's budget ceil(r x S))."""
    return stored_window(params.local_window, params.ratio, num_tokens)


def build_store(cap, store_path, *, disks=4, params: LayoutParams = LayoutParams(),
                context: int | None = None, force: bool = False, engine=None,
                progress: bool = True, profile_cap=None) -> tuple[Store, dict]:
    """Lay out a capture's context and write it to a new store.

    Args:
        cap: a :class:`swarmfs.layout.Capture` (K, V, Q per layer).
        store_path: store directory.
        disks: number of file disks or a list of disk paths.
        params: :class:`swarmfs.layout.LayoutParams`.
        context: store only the first ``context`` tokens (default all).
        profile_cap: another capture whose queries profile this context
            (dataset shift, §8.4); default the context's own queries.

    Returns:
        (open writable Store, per-layer layout report dict).

    Raises:
        LayoutError, ShapeError, StoreExistsError, DiskError.
    """
    from tqdm import tqdm
    V.parse_instance(params, "params", LayoutParams)
    S = cap.num_tokens if context is None else V.parse_int(context, "context", 1,
                                                            cap.num_tokens)
    meta = cap.meta
    dtype = str(cap.k.dtype) if str(cap.k.dtype) in ("float16", "float32") else "bfloat16"
    store = Store.create(store_path, disks=disks, num_layers=cap.num_layers,
                         num_kv_heads=cap.num_kv_heads, head_dim=cap.head_dim, dtype=dtype,
                         model_name=str(meta.get("model")),
                         num_query_heads=cap.num_query_heads, force=force, engine=engine)
    report = {}
    for layer in tqdm(range(cap.num_layers), desc="layout+write", unit="layer",
                      disable=None if progress else True):
        k = cap.k[layer][:, :S]
        v = cap.v[layer][:, :S]
        q = cap.q[layer][:, :S] if profile_cap is None else profile_cap.q[layer]
        t0 = time.perf_counter()
        cl, hot = lay_out_layer(q, k, params=params, scaling=cap.scaling, layer=layer,
                                entry_bytes=store.entry_bytes)
        t1 = time.perf_counter()
        kv = np.ascontiguousarray(np.stack([k, v], axis=0).transpose(2, 0, 1, 3))
        store.write_layer(layer, kv, (cl.ptr, cl.members), cl.medoids, hot=hot,
                          freq=cl.freq, local_window=local_window(params, S),
                          representative=params.representative or "medoid",
                          extra={"layout": {"tau": cl.stats.tau, "metric": cl.stats.metric,
                                            "ratio": params.ratio}})
        t2 = time.perf_counter()
        st = cl.stats
        report[layer] = {"clusters": st.num_clusters, "mean_size": st.size_mean,
                         "max_size": st.size_max, "replication": st.replication,
                         "singletons": st.singletons, "idle_entries": st.idle_entries,
                         "hot_clusters": int(hot.sum()), "layout_s": t1 - t0,
                         "write_s": t2 - t1, "tau": st.tau, "metric": st.metric}
    return store, report


def evaluate_store(store: Store, cap, *, context: int, eval_positions, ratio: float,
                   progress: bool = True) -> dict:
    """Retrieve for held-out queries on every layer and score against the oracle.

    Returns:
        {layer: summary dict} with recall, rel_error, oracle_rel_error,
        entries, bytes_read, requests, max_mean_load, effective_gbps, io_us,
        select_us (score + choice), plan_us, dram_bytes.
    """
    from tqdm import tqdm
    r = Retriever(store, ratio=ratio)
    out = {}
    S = int(context)
    for layer in tqdm(store.layers, desc="retrieve", unit="layer",
                      disable=None if progress else True):
        k_ctx = cap.k[layer][:, :S]
        v_ctx = cap.v[layer][:, :S]
        r.layer_state(layer)      # load the DRAM partition before timing
        rows = []
        for t in eval_positions:
            q = cap.q[layer][:, t]
            ret = r.retrieve(layer, q, torch=False)
            acc = evaluate_query(q, k_ctx, v_ctx, ret.positions, k_ret=ret.k, v_ret=ret.v,
                                 scaling=cap.scaling, ratio=ratio)
            s = ret.stats
            acc.update(bytes_read=s.bytes_read, requests=s.requests,
                       max_mean_load=s.max_mean_load, effective_gbps=s.effective_gbps,
                       io_us=s.io_us, select_us=s.score_us + s.select_us,
                       plan_us=s.plan_us, entries_ssd=s.entries_ssd,
                       entries_dram=s.entries_dram, clusters=s.clusters_selected)
            rows.append(acc)
        summ = summarize(rows)
        summ["dram_bytes"] = r.layer_state(layer).dram_bytes
        summ["queries"] = len(rows)
        out[layer] = summ
    return out


def run_capture_demo(workdir: str, *, model=None, text=None, text_source=None,
                     disks: int = 4, context: int = 16384, eval_queries: int = 64,
                     params: LayoutParams = LayoutParams(), engine=None,
                     progress: bool = True) -> dict:
    """``swarmfs demo --minilm``: capture, lay out, store, retrieve and report
    (see the module docstring).

    Args:
        workdir: the store directory; its disk files go to ``workdir/disks``
            (replaced if it holds a store).
        model: local HF model directory (default all-MiniLM-L6-v2).
        text: the text (default the standard library's docstrings).
        disks: number of disk files.
        context: tokens stored.
        eval_queries: held-out queries (tokens after the context).

    Returns:
        The report dict (``layout``, ``retrieval``, ``store``, ``timing``).

    Raises:
        InvalidIntegerError: disks outside [1, 256], eval_queries below 1.
        ConfigError: context plus eval_queries below the capture minimum.
        StoreExistsError: ``workdir`` holds something other than a store.
    """
    from .layout import _capture
    workdir = V.parse_path(workdir, "workdir")
    disks = V.parse_int(disks, "disks", 1, 256)
    context = V.parse_positive_int(context, "context")
    eval_queries = V.parse_positive_int(eval_queries, "eval_queries")
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise errors.StoreExistsError("demo directory exists and is not a directory", store=workdir)
    if os.path.isdir(workdir) and os.listdir(workdir) and \
            not os.path.exists(os.path.join(workdir, "manifest.json")):
        raise errors.StoreExistsError("demo directory is not empty and holds no swarmfs store; "
                                      "choose another --dir", store=workdir)
    if int(context) + int(eval_queries) < _capture.MIN_TOKENS:
        raise errors.ConfigError(f"--context {context} plus --eval-queries {eval_queries} is below "
                                 f"the minimum of {_capture.MIN_TOKENS} tokens")
    t0 = time.perf_counter()
    total = context + eval_queries
    cap = _capture.capture(model, text, max_tokens=total, progress=progress,
                           text_source=text_source)
    if cap.num_tokens < total:
        if cap.num_tokens <= eval_queries + 256:
            raise errors.ModelError(f"text gives {cap.num_tokens} tokens; the demo needs at "
                                    f"least {eval_queries + 257} (context + held-out queries)")
        import warnings
        warnings.warn(f"swarmfs demo: the text gives {cap.num_tokens} tokens; storing a "
                      f"context of {cap.num_tokens - eval_queries} instead of {context}",
                      stacklevel=2)
        context = cap.num_tokens - eval_queries
    t1 = time.perf_counter()
    store, layout = build_store(cap, workdir, disks=disks,
                                params=params, context=context, force=True, engine=engine,
                                progress=progress)
    t2 = time.perf_counter()
    evalpos = np.arange(context, context + eval_queries)
    with store:
        retrieval = evaluate_store(store, cap, context=context, eval_positions=evalpos,
                                   ratio=params.ratio, progress=progress)
        info = store.info()
        stats = store.stats()
    t3 = time.perf_counter()
    return {
        "model": cap.meta.get("model"), "text": cap.meta.get("text_source"),
        "context_tokens": int(context), "eval_queries": int(eval_queries),
        "ratio": params.ratio, "budget": entry_budget(params.ratio, context),
        "local_window": params.local_window, "disks": disks,
        "store": {"path": info["path"], "engine": info["engine"],
                  "entry_bytes": info["entry_bytes"], "kv_bytes": info["kv_bytes"],
                  "replication": info["replication"], "clusters": info["clusters"],
                  "disk_bytes": [d["used_bytes"] for d in info["disks"]],
                  "checksum_failures": stats.checksum_failures},
        "layout": layout, "retrieval": retrieval,
        "timing": {"capture_s": t1 - t0, "layout_and_write_s": t2 - t1,
                   "retrieval_s": t3 - t2},
    }


def run_demo(kinds=("python", "prose"), *, context: int = 8192, evaluate: int = 128,
             model_dir=None, store=None, disks=4, ratio: float = defaults.RATIO, engine=None,
             on_progress=None) -> dict:
    """The main job: decode held-out long inputs with the KV on N disks.

    For each kind of held-out text, :func:`swarmfs._generate.run_evaluate`
    teacher-forces the ``evaluate`` tokens after a ``context``-token prefix
    through dense attention and through swarmfs (prefill, co-activation
    layout, write to ``disks`` file disks, one retrieval per layer and step).

    Args:
        kinds: kinds of held-out text (``"python"``, ``"prose"``).
        context: prefix tokens stored on the disks.
        evaluate: continuation tokens, each one decode step.
        store: store directory (replaced); default a temporary one.
        on_progress: called with the kind before each run.

    Returns:
        {"model": path, "ratio": r, "disks": N, "runs": {kind: run_evaluate's dict}}.

    Raises:
        InvalidRatioError: ratio outside (0, 1].
        InvalidIntegerError: context or evaluate below 1.
        InvalidArgumentError, ModelError, NotFoundError, SwarmError.
    """
    from . import _generate as G
    ratio = V.parse_ratio(ratio, "ratio")
    context = V.parse_positive_int(context, "context")
    evaluate = V.parse_positive_int(evaluate, "evaluate")
    if on_progress is not None:
        V.parse_callable(on_progress, "on_progress")
    model, tok = G.load_model(model_dir)
    runs = {}
    for kind in kinds:
        if on_progress is not None:
            on_progress(kind)
        text = G.heldout_input(tok, kind, context + evaluate)
        runs[kind] = G.run_evaluate(text, evaluate, model=model, tok=tok, store=store,
                                    disks=disks, ratio=ratio, force=True, engine=engine,
                                    max_context=context)
    return {"model": str(model_dir or G.default_model_dir()), "ratio": ratio,
            "disks": disks if isinstance(disks, int) else len(disks), "runs": runs}


def render(report: dict, console=None) -> None:
    """Print the ``--minilm`` demo report (:func:`run_capture_demo`) as tables (rich)."""
    from rich.console import Console
    from rich.table import Table
    con = console or Console(width=max(Console().width, 150))
    con.print(f"[bold]swarmfs demo[/]: {report['model']} over {report['text']}; "
              f"context {report['context_tokens']} tokens, {report['eval_queries']} held-out "
              f"queries, r = {report['ratio']} (budget {report['budget']} entries, local "
              f"window {report['local_window']}), {report['disks']} disks, engine "
              f"{report['store']['engine']}")
    t = Table(title="layout per layer (SWARM §5)")
    for c in ("layer", "clusters", "mean size", "max", "replication", "singletons",
              "never activated", "hot", "DRAM bytes", "layout s"):
        t.add_column(c, justify="right")
    for layer, x in report["layout"].items():
        rr = report["retrieval"].get(layer, {})
        t.add_row(str(layer), str(x["clusters"]), f"{x['mean_size']:.1f}", str(x["max_size"]),
                  f"{x['replication']:.3f}", str(x["singletons"]), str(x["idle_entries"]),
                  str(x["hot_clusters"]), f"{rr.get('dram_bytes', 0):,}",
                  f"{x['layout_s']:.2f}")
    con.print(t)
    t = Table(title="retrieval for held-out queries (mean per query)")
    for c in ("layer", "recall", "mass", "oracle mass", "rel. error", "oracle err", "entries",
              "SSD",
              "bytes read", "requests", "max/mean", "GB/s", "I/O µs", "select µs"):
        t.add_column(c, justify="right")
    for layer, x in report["retrieval"].items():
        t.add_row(str(layer), f"{x['recall']:.3f}", f"{x['mass']:.3f}",
                  f"{x['oracle_mass']:.3f}", f"{x['rel_error']:.3f}",
                  f"{x['oracle_rel_error']:.3f}", f"{x['entries']:.0f}",
                  f"{x['entries_ssd']:.0f}", f"{x['bytes_read']:,.0f}", f"{x['requests']:.1f}",
                  f"{x['max_mean_load']:.2f}", f"{x['effective_gbps']:.2f}",
                  f"{x['io_us']:.0f}", f"{x['select_us']:.0f}")
    con.print(t)
    rs = list(report["retrieval"].values())
    con.print(f"mean recall {np.mean([x['recall'] for x in rs]):.3f} of the oracle's attention "
              f"mass (oracle = exact top-{report['budget']}); mean attention-output error "
              f"{np.mean([x['rel_error'] for x in rs]):.3f} (oracle "
              f"{np.mean([x['oracle_rel_error'] for x in rs]):.3f}); every entry read back "
              f"checksum-verified ({report['store']['checksum_failures']} failures)")
    tm = report["timing"]
    con.print(f"time: capture {tm['capture_s']:.1f} s, layout+write "
              f"{tm['layout_and_write_s']:.1f} s, retrieval+evaluation {tm['retrieval_s']:.1f} s;"
              f" store at {report['store']['path']}")
