#!/usr/bin/env python3
"""Decoding with the KV cache on swarmfs (issue 11): quality, online phase, throughput.

Runs our trained decoder (``swarmfs.models.DEFAULT_DECODER``; before it is
committed, ``--checkpoint`` loads the training run's latest checkpoint with
the training tokenizer) over held-out long inputs of two kinds, Python
source and prose (``swarmfs.models.heldout_texts``, or ``--text-python`` /
``--text-prose`` files), through :class:`swarmfs.hf.SwarmCache`.

``quality``: the first ``--context`` tokens are prefilled (dense), laid out
and written to ``--disks`` file disks; the next ``--continuation`` tokens
are teacher-forced one decode step at a time.  Per method and r: perplexity
of the continuation against dense attention (one causal SDPA forward), the
attention-mass recall of every retrieval against the oracle top-k (per
layer), and the median step time.  Methods: ``swarm`` (§5 layout, medoid
index), ``quest``, ``infllm``, ``pqcache`` (``swarmfs.layout._baselines`` on
the same store and Retriever), ``sinks`` (StreamingLLM: the first 4 tokens
plus the most recent ones, the same budget; computed densely with an
attention mask, no store), ``oracle`` (exact top-k per layer and step,
densely with a mask: the ceiling at that budget).

``throughput``: decode ``--steps`` greedy tokens after the context with the
KV on the disks (``prefetch`` none and previous) against dense in-DRAM
decoding (DynamicCache), medians per token, with the per-step breakdown (CPU
µs of scoring/selection/planning/assembly/session/attention beside I/O µs),
the §6.2 cache hit rate, the §7 prefetch hit rate, DRAM bytes and RSS.
With ``--batch 1 4 8`` it measures batches instead (Fig. 16): B requests,
each the next ``--context``-token window of the held-out text, each on its
own store of ``--disks`` disks, decoded together ``--steps`` greedy steps; per batch
size the step time, tokens/s (B tokens per step) against batch 1, the I/O
µs and bytes per step, and dense DynamicCache on the same batch.

``online`` (Table 5 equivalent): after ``--steps`` greedy tokens with eq. 9
upkeep (W = ``--online-window``), the co-activation distance of each new
entry to the medoid of the cluster it joined, over the decode queries issued
after it matured, normalised by the prefix clusters' value, against Min-Size
and Min-Diff assignment.  ``cache`` (Fig. 15 equivalent): §6.2 replacement
against LRU at several DRAM budgets (``--dram-fractions`` of a layer's KV):
cluster hit rate and per-layer retrieval latency.  ``reuse``: time to the
first new token from a stored document (``SwarmCache.from_store``) against a
fresh prefill.

    /work/bench-exclusive tools/dev run python -m tools.bench_decode quality \\
        --out docs/data/decode-quality.json
    /work/bench-exclusive tools/dev run python -m tools.bench_decode throughput \\
        --out docs/data/decode-throughput.json
    /work/bench-exclusive tools/dev run python -m tools.bench_decode throughput \\
        --batch 1 4 8 --ratios 0.1 --out docs/data/decode-batch.json
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
import types

import click
import numpy as np

from tools._options import COUNT, DISKS, FRACTION, NONNEG, RATIO, MethodRatio, OutPath

REPO = pathlib.Path(__file__).resolve().parents[1]


# -- model and text --------------------------------------------------------------

def load_checkpoint(ckpt: str, tokenizer: str):
    """A LlamaForCausalLM from the training run's ``last.pt`` (its recorded
    arguments give the shape) and the training tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    st = torch.load(ckpt, map_location="cpu", weights_only=False)
    a = st["args"]
    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer, eos_token="<|endoftext|>",
                                  bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    eos = tok.eos_token_id
    cfg = LlamaConfig(vocab_size=a["vocab"], hidden_size=a["hidden"],
                      intermediate_size=a["intermediate"], num_hidden_layers=a["layers"],
                      num_attention_heads=a["heads"], num_key_value_heads=a["kv_heads"],
                      head_dim=a["hidden"] // a["heads"], max_position_embeddings=32768,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=eos,
                      eos_token_id=eos, pad_token_id=eos)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(st["model"])
    return model.eval(), tok, f"checkpoint {ckpt} (step {st['step']})"


def load(args):
    from swarmfs import _generate as G
    from swarmfs import hf
    if args.model or not args.checkpoint:
        try:
            d = args.model or G.default_model_dir()
            model, tok = G.load_model(d)
            return model, tok, str(d)
        except Exception as exc:                     # noqa: BLE001 - fall back below
            if args.model or not os.path.exists(args.fallback_checkpoint):
                raise
            print(f"[bench] {exc}; using the training checkpoint", flush=True)
            args.checkpoint = args.fallback_checkpoint
    model, tok, name = load_checkpoint(args.checkpoint, args.tokenizer)
    hf.enable(model)
    return model, tok, name


def texts(args) -> dict:
    out = {}
    for kind in args.kinds:
        f = getattr(args, f"text_{kind}")
        if f:
            out[kind] = pathlib.Path(f).read_text(encoding="utf-8")
        else:
            from swarmfs.models import heldout_texts
            out[kind] = heldout_texts(kind)
    return out


def token_ids(tok, text, n):
    import torch
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :n]
    if ids.shape[1] < n:
        raise SystemExit(f"the text has only {ids.shape[1]} tokens, {n} needed")
    return ids.to(torch.long)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# -- dense baselines with an attention mask ------------------------------------------

def nll(logits, targets) -> np.ndarray:
    import torch
    lp = torch.log_softmax(logits.float(), dim=-1)
    return (-lp.gather(-1, targets[:, None])[:, 0]).numpy().astype(np.float64)


def dense_nll(model, ctx, cont):
    import torch
    model.set_attn_implementation("sdpa")
    S, n = ctx.shape[1], cont.shape[0]
    with torch.no_grad():
        lg = model(torch.cat([ctx, cont[None]], 1), use_cache=False).logits[0, S - 1:S - 1 + n]
    return nll(lg, cont)


def masked_nll(model, ctx, cont, budget: int, policy: str):
    """Teacher-forced continuation where each decode query sees ``budget``
    context tokens chosen by ``policy`` (``sinks``: first 4 + most recent;
    ``oracle``: the exact top-k by attention mass of that query, per layer)
    plus the continuation so far.  Dense SDPA over a DynamicCache, the
    selection applied as a mask through the "swarm" attention name's hook."""
    import torch
    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    S, n = ctx.shape[1], cont.shape[0]

    def attn(module, query, key, value, mask, **kw):
        if query.shape[2] != 1:
            return sdpa_attention_forward(module, query, key, value, mask, **kw)
        L = key.shape[2]
        keep = torch.zeros(L, dtype=torch.bool)
        keep[S:] = True                                   # the continuation so far
        if policy == "sinks":
            keep[:4] = True
            keep[max(4, S - (budget - 4)):S] = True
        else:
            g = query.shape[1] // key.shape[1]
            kk = key[0, :, :S].float().repeat_interleave(g, 0)          # [H_q, S, d]
            p = torch.softmax(query[0, :, 0:1].float() @ kk.transpose(1, 2)
                              * kw.get("scaling", 1.0), -1)[:, 0]     # [H_q, S]
            keep[p.mean(0).topk(budget).indices] = True
        m = keep.view(1, 1, 1, L)
        return sdpa_attention_forward(module, query, key, value, m, **kw)

    AttentionInterface.register("bench-mask", attn)
    model.set_attn_implementation("bench-mask")
    try:
        with torch.no_grad():
            dc = DynamicCache()
            out = model(ctx, cache=dc, use_cache=True)
            lg = [out.logits[0, -1]]
            for t in range(n - 1):
                lg.append(model(cont[t:t + 1][None], cache=dc, use_cache=True).logits[0, -1])
        return nll(torch.stack(lg), cont)
    finally:
        from swarmfs import hf
        hf.enable(model)


# -- swarmfs ------------------------------------------------------------------------

def swarm_run(model, ctx, cont, *, ratio, method, disks, workdir, prefetch="none"):
    """Prefill the context into a new store, teacher-force the continuation."""
    import torch

    from swarmfs import hf
    from swarmfs._generate import recall_report
    hf.enable(model)
    path = pathlib.Path(workdir) / f"{method}-{ratio}"
    n = cont.shape[0]
    with torch.no_grad(), hf.SwarmCache(path, model.config, ratio=ratio, disks=disks,
                                        method=method, record=True, append=True,
                                        force=True, prefetch=prefetch) as cache:
        t0 = time.perf_counter()
        out = model(ctx, cache=cache, use_cache=True)
        prefill_s = time.perf_counter() - t0
        lg = [out.logits[0, -1]]
        ms = []
        for t in range(n - 1):
            t0 = time.perf_counter()
            lg.append(model(cont[t:t + 1][None], cache=cache, use_cache=True).logits[0, -1])
            ms.append((time.perf_counter() - t0) * 1e3)
        rec = recall_report(cache, ratio, ctx.shape[1])
        summ = cache.summary()
        layout = cache.layout_report
    return {"nll": nll(torch.stack(lg), cont), "recall": rec["recall"],
            "recall_per_layer": rec["per_layer"], "rel_error": rec["rel_error"],
            "mass": rec["mass"], "oracle_mass": rec["oracle_mass"],
            "step_ms": statistics.median(ms), "prefill_layout_s": prefill_s,
            "layout": {str(k): v for k, v in layout.items()}, "summary": summ}


def quality(args, model, tok):
    out = {"context": args.context, "continuation": args.continuation,
           "ratios": args.ratios, "methods": args.methods, "kinds": {}}
    for kind, text in texts(args).items():
        ids = token_ids(tok, text, args.offset + args.context + args.continuation)
        ids = ids[:, args.offset:]
        ctx, cont = ids[:, :args.context], ids[0, args.context:]
        t0 = time.perf_counter()
        d = dense_nll(model, ctx, cont)
        res = {"perplexity_dense": math.exp(d.mean()), "dense_s": time.perf_counter() - t0,
               "runs": []}
        print(f"[{kind}] dense ppl {res['perplexity_dense']:.3f}", flush=True)
        with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
            for r in args.ratios:
                budget = math.ceil(r * args.context)
                for m in args.methods:
                    t0 = time.perf_counter()
                    if m in ("sinks", "oracle"):
                        x = masked_nll(model, ctx, cont, budget, m)
                        row = {"method": m, "ratio": r, "perplexity": math.exp(x.mean())}
                    else:
                        s = swarm_run(model, ctx, cont, ratio=r, method=m, disks=args.disks,
                                      workdir=wd)
                        row = {"method": m, "ratio": r,
                               "perplexity": math.exp(s.pop("nll").mean()), **s}
                    row["ppl_vs_dense"] = row["perplexity"] / res["perplexity_dense"] - 1
                    row["seconds"] = time.perf_counter() - t0
                    res["runs"].append(row)
                    print(f"[{kind}] r={r} {m:8s} ppl {row['perplexity']:.3f} "
                          f"({100 * row['ppl_vs_dense']:+.2f}%) recall "
                          f"{row.get('recall', float('nan')):.3f} mass "
                          f"{row.get('mass', float('nan')):.3f} (oracle "
                          f"{row.get('oracle_mass', float('nan')):.3f}) "
                          f"{row['seconds']:.0f} s", flush=True)
        out["kinds"][kind] = res
    return out


def disks_for(args, i: int, n: int):
    """The disks of the i-th of n stores: ``--disks`` file disks, or the i-th of n
    equal shares of ``--disk-paths`` (block devices of the testbed, one store per share)."""
    if not args.disk_paths:
        return args.disks
    k = len(args.disk_paths) // n
    if k == 0:
        raise SystemExit(f"--disk-paths: {len(args.disk_paths)} paths for {n} stores")
    return args.disk_paths[i * k:(i + 1) * k]


def batch_throughput(args, model, tok):
    """Fig. 16: batches of ``--batch`` sizes, each row its own request and
    store, against dense DynamicCache on the same batch; medians per step."""
    import torch
    from transformers import DynamicCache

    from swarmfs import hf
    text = texts(args)[args.kinds[0]]
    B_max = max(args.batch)
    ctx = token_ids(tok, text, args.offset + args.context * B_max)[0, args.offset:]
    rows = [ctx[i * args.context:(i + 1) * args.context] for i in range(B_max)]
    out = {"context": args.context, "steps": args.steps, "ratio": args.ratios[0],
           "kind": args.kinds[0], "disks": args.disks, "batches": {}}
    for B in args.batch:
        ids = torch.stack(rows[:B])
        am = torch.ones_like(ids)
        res = {}
        with tempfile.TemporaryDirectory(dir=args.workdir) as wd, torch.no_grad():
            for name in ("dense", "swarm"):
                if name == "dense":
                    model.set_attn_implementation("sdpa")
                    cache = DynamicCache()
                else:
                    hf.enable(model)
                    cache = hf.SwarmCache([pathlib.Path(wd) / f"row{i}" for i in range(B)],
                                          model.config, ratio=args.ratios[0],
                                          disks=disks_for(args, 0, 1), eos_token_id=False)
                try:
                    o = model(ids, attention_mask=am, cache=cache, use_cache=True)
                    nxt = o.logits[:, -1:].argmax(-1)
                    del o
                    ms = []
                    for _ in range(args.steps):
                        am = torch.cat([am, torch.ones(B, 1, dtype=am.dtype)], 1)
                        t0 = time.perf_counter()
                        o = model(nxt, attention_mask=am, cache=cache, use_cache=True)
                        ms.append((time.perf_counter() - t0) * 1e3)
                        nxt = o.logits[:, -1:].argmax(-1)
                    am = torch.ones_like(ids)
                    med = statistics.median(ms)
                    res[name] = {"step_ms": med, "tokens_per_s": B * 1e3 / med}
                    if name == "swarm":
                        s = cache.summary()
                        res[name].update(io_us_per_step=s["io_us"],
                                         bytes_per_step=s["bytes_read"],
                                         cpu_us_per_step=sum(s[k] for k in (
                                             "score_us", "select_us", "plan_us",
                                             "assemble_us", "session_us")),
                                         attend_us_per_step=s["attend_us"],
                                         dram_bytes=s["dram_bytes"])
                finally:
                    if name == "swarm":
                        cache.close()
        out["batches"][str(B)] = res
        base = out["batches"].get(str(min(args.batch)), res)
        for name in res:
            res[name]["vs_batch_1"] = res[name]["tokens_per_s"] / base[name]["tokens_per_s"]
        print(f"batch {B}: swarmfs {res['swarm']['step_ms']:.1f} ms/step, "
              f"{res['swarm']['tokens_per_s']:.1f} tokens/s "
              f"({res['swarm']['vs_batch_1']:.2f}x batch {min(args.batch)}), I/O "
              f"{res['swarm']['io_us_per_step']:.0f} µs/step; dense "
              f"{res['dense']['tokens_per_s']:.1f} tokens/s", flush=True)
    out["rss_mb"] = rss_mb()
    return out


def throughput(args, model, tok):
    """Dense in-DRAM decoding (DynamicCache) and swarmfs decoding (prefetch
    none / previous, and upkeep in the background) step by step in turn, so
    that they share the machine's noise; medians per token.  With
    ``--batch``: :func:`batch_throughput`."""
    import contextlib
    if args.batch:
        return batch_throughput(args, model, tok)

    import torch
    from transformers import DynamicCache

    from swarmfs import hf
    text = texts(args)[args.kinds[0]]
    ctx = token_ids(tok, text, args.offset + args.context)[:, args.offset:]
    out = {"context": args.context, "steps": args.steps, "ratio": args.ratios[0],
           "kind": args.kinds[0], "disks": disks_for(args, 0, 2)}
    # swarmfs: no prefetch, §7's prefetch, and the session upkeep on a worker
    # thread after each layer's attention (issue 26)
    # (prefetch, upkeep, method, r); --compare adds a method at its own r,
    # e.g. the r at which a baseline matches swarmfs's accuracy (issue 26)
    variants = {"swarm_prefetch_none": ("none", "inline", "swarm", args.ratios[0]),
                "swarm_prefetch_previous": ("previous", "inline", "swarm", args.ratios[0]),
                "swarm_upkeep_background": ("none", "background", "swarm", args.ratios[0])}
    for m, r in args.compare:
        variants[f"{m}@{r:g}"] = ("none", "inline", m, r)
    names = ["dense", *variants]
    with tempfile.TemporaryDirectory(dir=args.workdir) as wd, contextlib.ExitStack() as ex, \
            torch.no_grad():
        caches = {"dense": DynamicCache()}
        for i, (name, (pf, up, m, r)) in enumerate(variants.items()):
            caches[name] = ex.enter_context(hf.SwarmCache(
                pathlib.Path(wd) / name.replace("@", "_"), model.config, ratio=r, method=m,
                disks=disks_for(args, i, len(variants)), prefetch=pf, upkeep=up,
                force=bool(args.disk_paths)))
        nxt, ms = {}, {n: [] for n in names}
        for n in names:
            model.set_attn_implementation("sdpa") if n == "dense" else hf.enable(model)
            o = model(ctx, cache=caches[n], use_cache=True)
            nxt[n] = o.logits[:, -1:].argmax(-1)
            del o
        out["rss_mb_after_prefills"] = rss_mb()
        for _ in range(args.steps):
            for n in names:
                model.set_attn_implementation("sdpa") if n == "dense" else hf.enable(model)
                t0 = time.perf_counter()
                o = model(nxt[n], cache=caches[n], use_cache=True)
                ms[n].append((time.perf_counter() - t0) * 1e3)
                nxt[n] = o.logits[:, -1:].argmax(-1)
        dc = caches["dense"]
        out["dense"] = {"step_ms": statistics.median(ms["dense"]),
                        "tokens_per_s": 1e3 / statistics.median(ms["dense"]),
                        "kv_bytes": sum(x.keys.nbytes + x.values.nbytes for x in dc.layers)}
        print(f"dense: {out['dense']['step_ms']:.2f} ms/token", flush=True)
        for n in names[1:]:
            c = caches[n]
            s = c.summary()
            cpu = sum(s[k] for k in ("score_us", "select_us", "plan_us", "assemble_us",
                                     "session_us"))
            med = statistics.median(ms[n])
            out[n] = {"method": variants[n][2], "ratio": variants[n][3],
                      "step_ms": med, "tokens_per_s": 1e3 / med,
                      "vs_dense": med / out["dense"]["step_ms"],
                      "cpu_us_per_step": cpu, "io_us_per_step": s["io_us"],
                      "attend_us_per_step": s["attend_us"], "summary": s,
                      "steps": c.step_table()}
            print(f"{n}: {med:.2f} ms/token ({med / out['dense']['step_ms']:.2f}x dense), "
                  f"CPU {cpu:.0f} µs, I/O {s['io_us']:.0f} µs, attend {s['attend_us']:.0f} µs, "
                  f"wait {s['wait_us']:.0f} µs per step; cache hit {s['cache_hit_rate']:.3f}, "
                  f"prefetch hit {s['prefetch_hit']}, DRAM {s['dram_bytes']} B", flush=True)
        out["rss_mb"] = rss_mb()
    return out


# -- online phase: Table 5 equivalent ------------------------------------------------

def _activated(q, k, ratio, visible):
    """bool [G, T]: probe g (query [H_q, d]) activates the top ceil(r x n_g)
    of the first n_g = visible[g] keys by head-summed softmax probability
    (the profile's rule, layout._profile)."""
    G, T = q.shape[0], k.shape[1]
    H, d = k.shape[0], k.shape[2]
    g = q.shape[1] // H
    act = np.zeros((G, T), bool)
    for i in range(G):
        n = int(visible[i])
        lg = np.einsum("hgd,hsd->hgs", q[i].reshape(H, g, d), k[:, :n]) * d ** -0.5
        p = np.exp(lg - lg.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        sc = p.sum((0, 1))
        kk = math.ceil(ratio * n)
        act[i, np.argpartition(-sc, kk - 1)[:kk]] = True
    return act


def _jaccard(act, a, b, probes):
    """Co-activation (Jaccard) distance of entries a and b over probe rows."""
    x, y = act[probes, a], act[probes, b]
    u = int((x | y).sum())
    return 1.0 - (int((x & y).sum()) / u) if u else 1.0


def online(args, model, tok):
    """Table 5 equivalent: after G greedy decode steps with eq. 9 upkeep, the
    mean co-activation distance between each new entry and the medoid of the
    cluster it joined, over held-out probes (the decode queries issued after
    the entry matured), normalised by the same distance for the prefix's
    clusters (offline value); against Min-Size (join the smallest cluster)
    and Min-Diff (join the cluster whose medoid key is most similar)."""
    import torch

    from swarmfs import Store, hf
    from swarmfs.layout import LayoutParams
    text = texts(args)[args.kinds[0]]
    ctx = token_ids(tok, text, args.offset + args.context)[:, args.offset:]
    S, G, r, W = args.context, args.steps, args.ratios[0], args.online_window
    out = {"context": S, "generated": G, "ratio": r, "window": W, "kind": args.kinds[0],
           "layers": {}}
    hf.enable(model)
    with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
        path = pathlib.Path(wd) / "online"
        with torch.no_grad(), hf.SwarmCache(path, model.config, ratio=r, disks=args.disks,
                                            layout=LayoutParams(local_window=W),
                                            record=True, append=True) as cache:
            o = model(ctx, cache=cache, use_cache=True)
            t_ = o.logits[:, -1:].argmax(-1)
            for _ in range(G):
                o = model(t_, cache=cache, use_cache=True)
                t_ = o.logits[:, -1:].argmax(-1)
            records = {L: [x[0] for x in v] for L, v in cache.records.items()}
            init_clusters = {L: x["clusters"] for L, x in cache.layout_report.items()}
            out["cache_hit_rate"] = cache.summary()["cache_hit_rate"]
        with Store.open(path) as st:
            for L in st.layers:
                li = st.layer(L)
                T = li.num_tokens
                kv = st.read_entries(L, np.arange(T)).astype(np.float32)
                k = np.ascontiguousarray(kv[:, 0].transpose(1, 0, 2))
                q = np.stack(records[L])                          # [G, H_q, d]
                act = _activated(q, k, r, S + np.arange(G) + 1)
                C0 = init_clusters[L]
                cl = np.repeat(np.arange(li.num_clusters), li.sizes)
                med = li.medoid
                rng = np.random.default_rng(0)
                # offline: prefix members against their medoids, all probes
                offl = []
                for c in rng.choice(C0, size=min(C0, 400), replace=False):
                    for e in li.members[li.members_ptr[c]:li.members_ptr[c + 1]][:8]:
                        if e != med[c]:
                            offl.append(_jaccard(act, e, med[c], np.arange(G)))
                off = float(np.mean(offl))
                new = np.arange(S, T)
                sizes = li.sizes[:C0].astype(np.int64).copy()
                mk = k[:, med[:C0]].transpose(1, 0, 2).reshape(C0, -1)
                mk = mk / np.linalg.norm(mk, axis=1, keepdims=True)
                rows = {"swarm": [], "min_size": [], "min_diff": []}
                steps = []
                for e in new:
                    i = int(e - S)                   # the step that produced e
                    probes = np.arange(i + W + 1, G)  # issued after e matured
                    if probes.size < 8:
                        continue
                    sw = cl[li.tok_copy[li.tok_ptr[e]:li.tok_ptr[e + 1]]]
                    d_sw = min(_jaccard(act, e, med[c], probes) for c in sw)
                    c_ms = int(np.argmin(sizes))
                    sizes[c_ms] += 1
                    ke = k[:, e].reshape(-1)
                    c_md = int(np.argmax(mk @ (ke / np.linalg.norm(ke))))
                    rows["swarm"].append(d_sw)
                    rows["min_size"].append(_jaccard(act, e, med[c_ms], probes))
                    rows["min_diff"].append(_jaccard(act, e, med[c_md], probes))
                    steps.append(i)
                steps = np.asarray(steps)
                res = {"offline_distance": off, "new_entries": int(new.size),
                       "evaluated": int(steps.size),
                       "joined_existing": int(sum(
                           (cl[li.tok_copy[li.tok_ptr[e]:li.tok_ptr[e + 1]]] < C0).any()
                           for e in new)), "by_tokens": {}}
                for upto in (16, 32, 64, 128, 256, 512):
                    m = steps < upto
                    if m.any():
                        res["by_tokens"][upto] = {
                            n: float(np.mean(np.asarray(v)[m]) / off) for n, v in rows.items()}
                out["layers"][L] = res
                print(f"layer {L}: offline {off:.3f}, " + ", ".join(
                    f"<{u}: " + " ".join(f"{n} {x:.3f}" for n, x in v.items())
                    for u, v in res["by_tokens"].items()), flush=True)
    return out


# -- online phase: Fig. 15 equivalent ------------------------------------------------

def _lru_session():
    from swarmfs import DecodeSession

    class LRUSession(DecodeSession):
        """The Fig. 15 baseline: the hot set keeps the most recently
        selected clusters that fit the DRAM budget (instead of eq. 6's
        frequency/size score); hits counted as in DecodeSession."""

        def choose_hot(self, hot, ret):
            if ret.index is None or ret.index.num_clusters != hot.shape[0]:
                return hot              # another generation: set_hot refuses it
            sel = ret.clusters
            self.lookups += int(sel.size)
            self.hits += int(hot[sel].sum()) if sel.size else 0
            if not hasattr(self, "_last"):
                self._last = np.zeros(hot.shape[0], np.int64)
                self._clock = 0
            if self._last.shape[0] < hot.shape[0]:     # clusters made by appends
                self._last = np.concatenate([self._last, np.zeros(hot.shape[0] -
                                                                  self._last.shape[0], np.int64)])
            self._clock += 1
            self._last[sel] = self._clock
            cand = np.union1d(np.flatnonzero(hot), sel)
            order = cand[np.argsort(-self._last[cand], kind="stable")]
            cum = np.cumsum(ret.index.sizes[order] * self.store.entry_bytes)
            want = np.zeros_like(hot)
            want[order[cum <= self.hot_budget]] = True
            return want

    return LRUSession


def cache_policy(args, model, tok):
    """Fig. 15 equivalent: §6.2 replacement (eq. 6 score, +1/-1 frequency)
    against LRU at several DRAM budgets for hot clusters: cache hit rate
    (selected clusters found hot) and per-layer retrieval latency over
    ``--steps`` greedy decode steps from one stored prefix."""
    import torch

    from swarmfs import hf
    text = texts(args)[args.kinds[0]]
    ctx = token_ids(tok, text, args.offset + args.context)[:, args.offset:]
    r = args.ratios[0]
    out = {"context": args.context, "steps": args.steps, "ratio": r, "kind": args.kinds[0],
           "runs": []}
    hf.enable(model)
    LRU = _lru_session()
    with tempfile.TemporaryDirectory(dir=args.workdir) as wd:
        path = pathlib.Path(wd) / "doc"
        with torch.no_grad(), hf.SwarmCache(path, model.config, ratio=r, disks=args.disks,
                                            append=False) as c:
            o = model(ctx, cache=c, use_cache=True)
            first = o.logits[:, -1:].argmax(-1)
        for frac in args.dram_fractions:
            for policy in ("swarm", "lru"):
                c = hf.SwarmCache.from_store(path, model.config, ratio=r, hot_budget=frac)
                if policy == "lru":
                    c.session_class = LRU
                with torch.no_grad(), c:
                    t_ = first
                    for _ in range(args.steps):
                        o = model(t_, cache=c, use_cache=True)
                        t_ = o.logits[:, -1:].argmax(-1)
                    tot = [s.score_us + s.select_us + s.plan_us + s.io_us + s.assemble_us
                           for s in c.stats]
                    io = [s.io_us for s in c.stats]
                    summ = c.summary()
                row = {"dram_fraction": frac, "policy": policy,
                       "hit_rate": summ["cache_hit_rate"],
                       "layer_latency_us": float(np.median(tot)),
                       "layer_io_us": float(np.median(io)),
                       "entries_ssd": summ["entries_ssd"], "dram_bytes": summ["dram_bytes"]}
                out["runs"].append(row)
                print(f"DRAM {frac:.3f} {policy:5s}: hit rate {row['hit_rate']:.3f}, per-layer "
                      f"{row['layer_latency_us']:.0f} µs (I/O {row['layer_io_us']:.0f}), SSD "
                      f"entries/step {row['entries_ssd']:.0f}", flush=True)
    return out


# -- reuse: a stored prefix against a new prefill -----------------------------------

def reuse(args, model, tok):
    """Time to the first new token for a request that starts with a stored
    document: a fresh prefill (dense forward + layout + write) against
    ``SwarmCache.from_store`` (open the store, decode the next token from
    the disks), and the dense prefill alone for scale; medians of
    ``--steps`` repetitions (at least 1), in turn."""
    import torch
    from transformers import DynamicCache

    from swarmfs import hf
    text = texts(args)[args.kinds[0]]
    ids = token_ids(tok, text, args.offset + args.context + 1)[:, args.offset:]
    ctx, nxt = ids[:, :-1], ids[:, -1:]
    r = args.ratios[0]
    t = {"dense_prefill": [], "swarm_prefill": [], "from_store": []}
    with tempfile.TemporaryDirectory(dir=args.workdir) as wd, torch.no_grad():
        for i in range(max(1, args.reps)):
            model.set_attn_implementation("sdpa")
            t0 = time.perf_counter()
            model(torch.cat([ctx, nxt], 1), cache=DynamicCache(), use_cache=True)
            t["dense_prefill"].append(time.perf_counter() - t0)
            hf.enable(model)
            path = pathlib.Path(wd) / f"doc{i}"
            t0 = time.perf_counter()
            with hf.SwarmCache(path, model.config, ratio=r, disks=args.disks,
                               append=False) as c:
                model(ctx, cache=c, use_cache=True)
                model(nxt, cache=c, use_cache=True)
            t["swarm_prefill"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            # the request's ids are checked against the prompt fingerprint (timed too)
            with hf.SwarmCache.from_store(path, model.config, ratio=r,
                                          input_ids=torch.cat([ctx, nxt], 1)) as c:
                model(nxt, cache=c, use_cache=True)
            t["from_store"].append(time.perf_counter() - t0)
    out = {"context": args.context, "ratio": r, "kind": args.kinds[0],
           **{f"{k}_s": statistics.median(v) for k, v in t.items()}, "all": t}
    print(", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in t.items()), flush=True)
    return out


#: options that take one or more values, as ``--kinds python prose``
#: (argparse's ``nargs="+"``); click gets them as repeated options
_LISTS = ("--kinds", "--ratios", "--methods", "--disk-paths", "--dram-fractions", "--batch")


def _is_value(tok: str) -> bool:
    """Whether ``tok`` after a list option is one of its values (not an option)."""
    if not tok.startswith("-"):
        return True
    try:
        float(tok)
        return True
    except ValueError:
        return False


def spread_lists(args: list[str]) -> list[str]:
    """``--kinds python prose`` -> ``--kinds python --kinds prose``: the values
    that follow a list option, up to the next option; pure."""
    out, i = [], 0
    while i < len(args):
        tok = args[i]
        out.append(tok)
        i += 1
        if tok == "--":
            out += args[i:]
            break
        if tok in _LISTS:
            n = 0
            while i < len(args) and _is_value(args[i]):
                out += ([tok] if n else []) + [args[i]]
                i, n = i + 1, n + 1
    return out


class _ListsCommand(click.Command):
    """A command whose :data:`_LISTS` options take several values each."""

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, spread_lists(list(args)))


@click.command(cls=_ListsCommand, help=__doc__.split("\n\n")[0])
@click.argument("what", type=click.Choice(["quality", "throughput", "online", "cache", "reuse"]))
@click.option("--model", default=None)
@click.option("--checkpoint", default=None)
@click.option("--fallback-checkpoint", default="/work/train/ckpt/last.pt")
@click.option("--tokenizer", default="/work/train/tokenizer.json")
@click.option("--kinds", multiple=True, default=["python", "prose"],
              type=click.Choice(["python", "prose"]))
@click.option("--text-python", default=None)
@click.option("--text-prose", default=None)
@click.option("--context", type=COUNT, default=8192)
@click.option("--offset", type=NONNEG, default=0, help="skip this many tokens first")
@click.option("--continuation", type=COUNT, default=64)
@click.option("--steps", type=COUNT, default=32)
@click.option("--ratios", type=RATIO, multiple=True, default=[0.05, 0.1, 0.2])
@click.option("--methods", multiple=True, type=click.Choice(
                  ["swarm", "quest", "infllm", "pqcache", "sinks", "oracle"]),
              default=["swarm", "quest", "infllm", "pqcache", "sinks", "oracle"])
@click.option("--disks", type=DISKS, default=4)
@click.option("--disk-paths", multiple=True, default=None,
              help="throughput: devices (e.g. the testbed's loop devices), split evenly "
                   "between the two swarmfs stores; overrides --disks")
@click.option("--online-window", type=COUNT, default=32,
              help="W for the online run: steps before a new entry joins (eq. 9)")
@click.option("--workdir", default=None, help="where the stores go (default $TMPDIR)")
@click.option("--dram-fractions", type=FRACTION, multiple=True,
              default=[0.01, 0.02, 0.05, 0.1])
@click.option("--threads", type=COUNT, default=2, help="torch threads")
@click.option("--reps", type=COUNT, default=3, help="repetitions (reuse)")
@click.option("--batch", type=COUNT, multiple=True, default=[],
              help="throughput: batch sizes to measure (e.g. 1 4 8; Fig. 16), each row "
                   "its own request and store")
@click.option("--compare", type=MethodRatio(), multiple=True, default=[],
              help="throughput: also decode with METHOD@R (e.g. quest@0.3: a baseline at "
                   "the r where it matches swarmfs's accuracy)")
@click.option("--out", type=OutPath(), default=None)
def cli(**options):
    args = types.SimpleNamespace(**{k: list(v) if isinstance(v, tuple) else v
                                    for k, v in options.items()})
    args.disk_paths = args.disk_paths or None
    import torch
    torch.set_num_threads(args.threads)
    model, tok, name = load(args)
    t0 = time.perf_counter()
    res = {"quality": quality, "throughput": throughput, "online": online,
            "cache": cache_policy, "reuse": reuse}[args.what](
        args, model, tok)
    res.update(model=name, seconds=time.perf_counter() - t0, cpu=platform.processor() or
               platform.machine(), torch_threads=torch.get_num_threads(),
               command=" ".join(sys.argv))
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(res, indent=1, default=float))
    return 0


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line, as a program)."""
    return cli.main(args=argv, obj=argv, standalone_mode=argv is None)


if __name__ == "__main__":
    sys.exit(main())
