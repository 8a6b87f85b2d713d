#!/usr/bin/env python3
"""Selection latency (SWARM Table 4) and planning time.

Selection: a Qwen3-32B-shaped layer (8 KV heads, 64 query heads, head_dim
128, fp16 keys) at 128K, 256K, 512K and 1M tokens.  "naive" scores the query
against every key (the full-key scan) and takes the top r x S; "swarm" scores
it against the medoid index (one medoid per cluster; C = S / mean cluster
size, --cluster-size) and takes clusters in score order until r x S distinct
entries, in one native call as the Retriever does
(``swarmfs.store._kernels.select_fused``: per-head logits, softmax sums, partial
selection; the default "prob" score, and "logit").  "split" is the same work
as separate kernel calls from Python (``head_logits`` + ``softmax_sum`` +
``select_clusters``).  "int8" is the default "prob" selection since the
int8 medoid index (``select_i8``: per-row int8 keys, per-head int8 query,
exact integer dots with AVX512-VNNI or AVX2, fp32 softmax; the "prob"
columns are the exact score).  ``--recall DIR`` instead measures the int8
index's attention-mass recall against the exact score on the demo's capture
in fp16.  The naive scan is a single-threaded BLAS GEMV on the
GQA-summed query over fp32 keys; medians, one core.

The scoring kernels dispatch at run time (AVX-512, AVX2+FMA+F16C, NEON,
scalar); ``--paths avx512,avx2`` measures each named path (forced with
``swarmfs.store._kernels.set_kernel_path``), and the CPU flags are printed.

Planning: ``plan_reads`` for 100K selected entries (30% with a second copy)
over 4 disks: dedup (eq. 8), entry buckets (§6.1), coalescing.

    tools/dev run python -m tools.bench_select --out bench-out/select
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import sys
import time
import types

import click
import numpy as np

from swarmfs import plan_reads
from swarmfs.decode._index2 import pack_medoids_i8x2, select_i8x2
from swarmfs.decode._selectors import (
    group_queries,
    head_logits,
    select_clusters,
    single_threaded_blas,
)
from swarmfs.store._kernels import (
    cpu_flags,
    empty_aligned,
    gather_kv,
    gather_kv_mode,
    kernel_path,
    pack_medoids,
    pack_medoids_i8,
    select_fused,
    select_i8,
    set_kernel_path,
    softmax_sum,
    supported_paths,
)
from tools._options import COUNT, POSITIVE, CommaList, FiniteFloat, OutPath

PAPER = {131072: (1.635, 0.236), 262144: (3.136, 0.374), 524288: (6.176, 0.554),
         1048576: (12.15, 0.999)}

#: Mean entries per cluster of the layout at 128K tokens (MiniLM over
#: WikiText-2, bench_layout.py) and its growth with the token count S: S^0.377
#: as measured from 16K to 128K, to two digits (so that the default --tokens
#: get the sizes 14.9, 19.4, 25.2 and 32.8 earlier runs used).
CLUSTER_SIZE_128K = 14.9
CLUSTER_SIZE_GROWTH = 0.38
#: Qwen3-32B's query heads per KV head (64 over 8): the default --query-heads.
GQA_GROUP = 8


def default_cluster_size(S: int) -> float:
    """Mean entries per cluster at ``S`` tokens (0.1 precision)."""
    return round(CLUSTER_SIZE_128K * (S / 131072) ** CLUSTER_SIZE_GROWTH, 1)


def _cluster_sizes(ctx, param, value):
    """--cluster-sizes against --tokens (an eager option, so parsed first):
    one size per --tokens value, one for all of them, or (not given) the
    layout's size at each value."""
    toks = ctx.params.get("tokens")
    if toks is None:                    # --tokens itself was refused
        return value
    if value is None:
        return [default_cluster_size(S) for S in toks]
    if len(value) not in (1, len(toks)):
        raise click.BadParameter(f"{len(value)} cluster sizes for {len(toks)} --tokens "
                                 "values (give one, or one per value)")
    return value * len(toks) if len(value) == 1 else value


def _query_heads(ctx, param, value):
    """--query-heads against --kv-heads (eager): a multiple of it; not given,
    ``GQA_GROUP`` per KV head."""
    kv = ctx.params.get("kv_heads")
    if kv is None:                      # --kv-heads itself was refused
        return value
    if value is None:
        return GQA_GROUP * kv
    if value % kv:
        raise click.BadParameter(f"{value} query heads over {kv} KV heads: the query heads "
                                 "must be a multiple of the KV heads")
    return value


MINIMA = {}      # the minimum of the last median_ms of each key (ms)


def median_ms(f, reps, key=None):
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    if key is not None:
        MINIMA[key] = min(ts) * 1e3
    return statistics.median(ts) * 1e3


def cold_ms(f, reps, evict):
    """Median ms of f() right after ``evict`` (a write pass over memory far
    larger than the caches), as in a decode step whose reads and assembly
    have pushed the medoid index out of cache."""
    f()
    ts = []
    for _ in range(reps):
        evict()
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def bench_selection(S, cluster_size, reps, rng, r=0.1, H=8, Hq=64, d=128, paths=None,
                    two_level=False, group_size=32, coverage=3.0, naive_scan=True,
                    cold=False):
    C = int(round(S / cluster_size))
    q = rng.standard_normal((1, Hq, d)).astype(np.float32)
    sizes = rng.integers(max(int(cluster_size) // 2, 1), int(cluster_size * 1.5) + 1, size=C)
    ptr = np.zeros(C + 1, np.int64)
    np.cumsum(sizes, out=ptr[1:])
    members = rng.permutation(int(ptr[-1]))          # every token in one cluster
    S_ = int(ptr[-1])
    medoids = rng.standard_normal((C, H * d)).astype(np.float16)   # the store dtype
    budget = int(np.ceil(r * S))
    scale = d ** -0.5

    packed = pack_medoids(medoids, H)      # made once per layer, as MedoidSelector does
    ix8 = pack_medoids_i8(medoids, H)      # the int8 index (the default), likewise
    ix2 = pack_medoids_i8x2(medoids, H, group_size=group_size) if two_level else None

    def int8x2():
        return select_i8x2(ix2, q[0], H, scale=scale, ptr=ptr, members=members, num_tokens=S_,
                           budget=budget, window=0, coverage=coverage, check=False)

    def fused(score):
        return lambda: select_fused(medoids, q[0], H, scale=scale, score=score, bf16=False,
                                    ptr=ptr, members=members, num_tokens=S_,
                                    budget=budget, window=0,
                                    packed=packed if score == "prob" else None,
                                    check=False)

    def int8(threads=1):
        return lambda: select_i8(ix8, q[0], H, scale=scale, ptr=ptr, members=members,
                                 num_tokens=S_, budget=budget, window=0, check=False,
                                 threads=threads)

    from swarmfs.decode._selectors import ThreadChooser
    chooser = ThreadChooser()

    def int8_auto():       # MedoidSelector(threads="auto")'s rule around the same call
        t = chooser.pick(0)
        t0 = time.perf_counter()
        int8(t)()
        chooser.record(0, t, (time.perf_counter() - t0) * 1e6)

    def split():           # the same as separate calls from Python
        sc = softmax_sum(head_logits(medoids, q, H)[0], scale)
        select_clusters(sc, ptr, members, num_tokens=S_, budget=budget)

    per_path = {}
    paths = paths or [kernel_path()]
    junk = np.ones(400 << 17, np.uint64) if cold else None      # 400 MiB

    def evict():
        junk[::8] += 1
    for path in paths:
        set_kernel_path(path)
        per_path[path] = {"int8_ms": median_ms(int8(1), reps, "int8"),
                          "int8_min_ms": MINIMA["int8"],
                          "int8_2threads_ms": median_ms(int8(2), reps, "int8t2"),
                          "int8_2threads_min_ms": MINIMA["int8t2"],
                          "int8_auto_ms": median_ms(int8_auto, reps, "int8auto"),
                          "int8_auto_min_ms": MINIMA["int8auto"],
                          **({"int8x2_ms": median_ms(int8x2, reps, "x2"),
                              "int8x2_min_ms": MINIMA["x2"]} if two_level else {}),
                          "prob_ms": median_ms(fused("prob"), reps),
                          "logit_ms": median_ms(fused("logit"), reps),
                          **({"int8_cold_ms": cold_ms(int8(1), max(reps // 4, 5), evict),
                              **({"int8x2_cold_ms": cold_ms(int8x2, max(reps // 4, 5), evict)}
                                 if two_level else {})} if cold else {})}
    set_kernel_path("auto")
    # the read floor: one pass over the int8 index with next to no arithmetic
    # (numpy's max over it as uint64, SIMD: the core's streaming-read rate),
    # the least any score that reads every medoid costs
    flat = ix8.data.reshape(-1).view(np.uint64)
    t_floor = median_ms(flat.max, reps, "floor")
    t_split = median_ms(split, max(reps // 4, 5))
    t_prob = per_path[paths[0]]["prob_ms"]
    t_logit = per_path[paths[0]]["logit_ms"]
    junk = None
    ix8_bytes = ix8.data.nbytes
    # free the index before the naive scan allocates keys
    medoids = packed = ix8 = ix2 = None
    keys = rng.standard_normal((S, H * d), dtype=np.float32) if naive_scan else None

    def naive():
        qg = group_queries(q, H)[0]
        with single_threaded_blas():
            s = keys @ qg
        np.argpartition(-s, budget - 1)[:budget]

    t_naive = median_ms(naive, max(reps // 10, 5)) if naive_scan else float("nan")
    return {"tokens": S, "medoids": C, "mean_cluster_size": cluster_size,
            "naive_ms": t_naive, "swarm_ms": t_prob, "swarm_logit_ms": t_logit,
            "split_ms": t_split, "paths": per_path,
            "int8_index_bytes": int(ix8_bytes), "int8_read_floor_ms": t_floor,
            "int8_read_floor_min_ms": MINIMA["floor"],
            "speedup": t_naive / t_prob,
            "swarm_index_bytes": C * H * d * 2,
            "paper_naive_ms": PAPER.get(S, (None, None))[0],
            "paper_swarm_ms": PAPER.get(S, (None, None))[1]}


def bench_planning(reps, rng, n=100_000, replicated=0.3, ndisks=4, S=1 << 20, E=4096):
    tok = rng.choice(S, n, replace=False)
    extra = rng.choice(n, int(n * replicated), replace=False)
    tok_all = np.concatenate([tok, tok[extra]])
    m = tok_all.shape[0]
    # copies striped round-robin as the store lays clusters out, then shuffled
    disk = (np.arange(m) % ndisks).astype(np.int32)
    off = (np.arange(m) // ndisks).astype(np.uint64) * np.uint64(E) + np.uint64(4096)
    perm = rng.permutation(m)
    tok_all, disk, off = tok_all[perm], disk[perm], off[perm]
    p = plan_reads(tok_all, disk, off, ndisks=ndisks, entry_bytes=E, block_size=4096)
    t = median_ms(lambda: plan_reads(tok_all, disk, off, ndisks=ndisks, entry_bytes=E,
                                     block_size=4096), reps, "plan")
    return {"entries": n, "candidates": m, "disks": ndisks, "plan_ms": t,
            "plan_min_ms": MINIMA["plan"],
            "requests": p.num_requests, "bucket_entries": p.disk_entries.tolist()}


def random_store(path, rng, *, L, S, H, d, Hq, hot_random=False):
    """A float16 store of L layers of S random entries on 4 file disks at
    ``path``: clusters of 16 in random order, 1 in 50 hot (the first ones, or
    random ones with ``hot_random``), a 256-token local window."""
    from swarmfs import Store
    s = Store.create(path, disks=4, num_layers=L, num_kv_heads=H, head_dim=d,
                     num_query_heads=Hq, dtype="float16")
    for layer in range(L):
        kv = rng.standard_normal((S, 2, H, d)).astype(np.float16)
        cl = np.array_split(rng.permutation(S), S // 16)
        hot = np.zeros(len(cl), bool)
        if hot_random:
            hot[rng.choice(len(cl), len(cl) // 50, replace=False)] = True
        else:
            hot[: len(cl) // 50] = True
        s.write_layer(layer, kv, cl, hot=hot, local_window=256)
    return s


def bench_assembly(reps, rng, S=32768, H=8, d=128, Hq=64, r=0.1, batches=(1, 4, 8),
                   root=None):
    """Retrieve at batch 1, 4 and 8 from a store on tmpfs (Qwen3-32B-shaped
    entries, 4 KiB fp16) into reused K/V buffers (``retrieve(out=...)``): GB/s
    of returned entry bytes over the retrieval's wall time, and assembly alone
    (entries written into K/V by gather_kv), with one and with two assembly
    threads (``Retriever.assembly_threads``), interleaved step by step.

    Returns:
        {threads: {batch: medians}}."""
    import tempfile

    from swarmfs import Retriever
    base = root or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        s = random_store(os.path.join(tmp, "st"), rng, L=1, S=S, H=H, d=d, Hq=Hq,
                         hot_random=True)
        ret = Retriever(s, ratio=r)
        qs = rng.standard_normal((max(batches), Hq, d)).astype(np.float32)
        out = {1: {}, 2: {}}
        cap = S                            # output buffers reused across steps
        kb, vb = ret.kv_buffers(cap)       # 64-byte aligned, as torch tensors are
        for b in batches:
            q = qs[:b] if b > 1 else qs[0]
            ret.retrieve(0, q, torch=False, out=(kb, vb))
            res = {1: [], 2: []}
            for _ in range(reps):          # one and two assembly threads interleaved
                for t in (1, 2):
                    ret.assembly_threads = t
                    res[t].append(ret.retrieve(0, q, torch=False, out=(kb, vb)))
            for t in (1, 2):
                x = res[t]
                tot = [y.stats.total_us for y in x]
                asm = [y.stats.assemble_us for y in x]
                nbytes = x[0].stats.entries * s.entry_bytes
                out[t][b] = {"entries": x[0].stats.entries, "bytes": nbytes,
                             "total_us": statistics.median(tot),
                             "assemble_us": statistics.median(asm),
                             "gbps": nbytes / statistics.median(tot) / 1e3,
                             "assemble_gbps": nbytes / statistics.median(asm) / 1e3,
                             "io_us": statistics.median([y.stats.io_us for y in x]),
                             "select_us": statistics.median([y.stats.score_us +
                                                             y.stats.select_us for y in x]),
                             "plan_us": statistics.median([y.stats.plan_us for y in x])}
        s.close()
    for t in (1, 2):
        for b in batches:
            o, o1 = out[t][b], out[t][batches[0]]
            o["gbps_vs_batch1"] = o["gbps"] / o1["gbps"]
            o["assemble_gbps_vs_batch1"] = o["assemble_gbps"] / o1["assemble_gbps"]
    return out


def bench_pipeline(steps, rng, L=8, S=16384, H=8, d=128, Hq=64, r=0.1, root=None):
    """A decode step over L layers from a tmpfs store, with numpy attention of
    the Hq query heads over each layer's retrieved K/V: sequential (each
    layer retrieves, then attends) against ``pipelined_step`` (layer L+1's
    retrieval prefetched while layer L steps and attends), each with one
    assembly thread and with two (keys ``*_2t``), and sequential with
    sessions that build K/V in place (``reuse_outputs``, key
    ``sequential_2t_reuse``).  Every step adds one new entry per layer
    (pending in DRAM for the window's W steps), and the sequential steps
    attend to it too (``include_new``), as a decode loop does.  The
    configurations step in turn, step by step, so they share the machine's
    noise (fewer steps than W, so no session appends).  Medians."""
    import tempfile

    from swarmfs import DecodeSession, Retriever, pipelined_step
    from swarmfs.decode._report import attention_logits
    base = root or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    scale = d ** -0.5
    qs = rng.standard_normal((steps + 2, L, Hq, d)).astype(np.float32)
    news = rng.standard_normal((steps + 2, L, 2, H, d)).astype(np.float16)

    def attend(i, res, q):
        lg = attention_logits(q[:, None, :], res.k, scale)[:, 0]      # [Hq, n]
        p = np.exp(lg - lg.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        g = Hq // H
        return np.einsum("hgn,hnd->hgd", p.reshape(H, g, -1), res.v.astype(np.float32))

    with tempfile.TemporaryDirectory(dir=base) as tmp:
        s = random_store(os.path.join(tmp, "st"), rng, L=L, S=S, H=H, d=d, Hq=Hq)
        configs = [(m, t, False) for m in ("sequential", "pipelined") for t in (1, 2)] + \
            [("sequential", 2, True)]
        runs = []
        for mode, threads, reuse in configs:
            r_obj = Retriever(s, ratio=r, assembly_threads=threads)
            runs.append((mode, threads, reuse, r_obj,
                         [DecodeSession(r_obj, layer, adapt_cache=True, reuse_outputs=reuse)
                          for layer in range(L)], []))
        for t in range(steps + 2):             # the configurations step in turn
            q = qs[t]
            for mode, _threads, _reuse, _r_obj, sess, rows in runs:
                if mode == "pipelined":
                    res = pipelined_step(sess, list(q), lambda i, x, q=q: attend(i, x, q[i]),
                                         new_kv=[(x[0], x[1]) for x in news[t]])
                    rows.append((res.step_us, res.sum_us, res.max_us, sum(res.retrieval_us),
                                 sum(res.compute_us)))
                else:
                    t0 = time.perf_counter()
                    ret_us = 0.0
                    for i in range(L):
                        x = sess[i].step(q[i], news[t, i, 0], news[t, i, 1], include_new=True)
                        attend(i, x, q[i])
                        ret_us += x.retrieval.stats.total_us
                    step = (time.perf_counter() - t0) * 1e6
                    rows.append((step, step, step, ret_us, step - ret_us))
        out = {}
        for mode, threads, reuse, r_obj, _sess, rows in runs:
            r_obj.close()
            # rows 0-1 are the warm-up (layer states)
            med = [statistics.median(c) for c in zip(*rows[2:], strict=True)]
            key = mode + ("_2t" if threads == 2 else "") + ("_reuse" if reuse else "")
            out[key] = {"step_us": med[0], "sum_us": med[1], "max_us": med[2],
                        "retrieval_us": med[3], "compute_us": med[4]}
        s.close()
    out["speedup"] = out["sequential"]["step_us"] / out["pipelined"]["step_us"]
    out["speedup_2t"] = out["sequential_2t"]["step_us"] / out["pipelined_2t"]["step_us"]
    return out



def bench_session(steps, rng, S=32768, H=8, d=128, Hq=64, r=0.1, root=None):
    """``DecodeSession.step`` on one Qwen3-32B-shaped layer (4 KiB fp16
    entries, S tokens, 4 file disks on tmpfs, r = 0.1): each step adds a new
    entry and returns it too (``include_new``), as ``swarmfs.hf`` does;
    sessions that copy (``copy``), that land the reads in their EntryBuffer
    (``reuse_outputs``, key ``reuse``), and that also defer the upkeep
    (``defer_upkeep``, key ``deferred``: the step returns once its entries
    are served and ``upkeep()`` runs after it, as it would beside the
    attention; its time is ``offpath_us``) step in turn, over separate
    Retrievers of one store.  Medians of the step (the critical path), of
    its retrieval, of the retrieval's I/O (and the step's CPU beside it:
    step minus I/O), and of the rest (the session's upkeep: eq. 9 counts,
    §6.2 replacement, pending entries, building K/V)."""
    import tempfile

    from swarmfs import DecodeSession, Retriever
    base = root or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        s = random_store(os.path.join(tmp, "st"), rng, L=1, S=S, H=H, d=d, Hq=Hq)
        qs = rng.standard_normal((steps + 3, Hq, d)).astype(np.float32)
        news = rng.standard_normal((steps + 3, 2, H, d)).astype(np.float16)
        runs = {}
        for key, reuse, defer in (("copy", False, False), ("reuse", True, False),
                                  ("deferred", True, True)):
            ret = Retriever(s, ratio=r)
            runs[key] = (ret, DecodeSession(ret, 0, reuse_outputs=reuse, defer_upkeep=defer,
                                            window=steps + 10), [], [], [], [])
        n = 0
        for t in range(steps + 3):
            for _ret, sess, tot, rt, io, off in runs.values():
                t0 = time.perf_counter()
                x = sess.step(qs[t], news[t, 0], news[t, 1], include_new=True)
                t1 = time.perf_counter()
                if sess.defer_upkeep:
                    sess.upkeep()
                off.append((time.perf_counter() - t1) * 1e6)
                tot.append((t1 - t0) * 1e6)
                rt.append(x.retrieval.stats.total_us)
                io.append(x.retrieval.stats.io_us)
                n = x.k.shape[1]
        out = {"tokens": S, "entries": n, "entry_bytes": s.entry_bytes}
        for key, (ret, _sess, tot, rt, io, off) in runs.items():
            ret.close()
            step, rtv = statistics.median(tot[3:]), statistics.median(rt[3:])
            iov = statistics.median(io[3:])
            out[key] = {
                "step_us": step, "step_min_us": min(tot[3:]), "retrieval_us": rtv,
                "io_us": iov, "cpu_us": step - iov, "cpu_over_io": (step - iov) / iov,
                "upkeep_us": statistics.median([a - b for a, b in
                                                zip(tot[3:], rt[3:], strict=True)]),
                "offpath_us": statistics.median(off[3:])}
        s.close()
    return out


GATHER_SHAPES = (("Qwen3-32B, 32K, r = 0.1", 8, 128, np.float16, 3284),
                 ("Qwen3-32B, 128K, r = 0.1", 8, 128, np.float16, 13108),
                 ("MiniLM widened (Fig. 11 store), 128K, r = 0.1", 16, 64, np.float16, 13108))


def bench_gather(reps, rng, paths, rounds=3):
    """``gather_kv`` alone on each kernel path (the scalar path is memcpy, the
    vector paths store around the cache when the call writes >= 16 MiB), entries
    from a staging buffer in random order into 64-byte aligned K and V
    [H, n + n/8, d] at ascending columns (the other eighth stands for the
    DRAM-resident rows), as ``retrieve`` places a step; then the same followed
    by one read of K and V (np.copyto into scratch) standing for the
    attention that consumes them.  Each path on one thread and split over
    two (``threads=2``, key ``PATH/2t``); paths and thread counts interleaved
    ``rounds`` times; the minimum over rounds of each round's median."""
    out = []
    for name, H, d, dt, n in GATHER_SHAPES:
        nt = n + n // 8
        eb = 2 * H * d * np.dtype(dt).itemsize
        buf = rng.integers(0, 255, n * eb + 64, dtype=np.uint8)
        src = 64 + rng.permutation(n).astype(np.uint64) * np.uint64(eb)
        dst = np.sort(rng.permutation(nt)[:n])
        k, v = empty_aligned((H, nt, d), dt), empty_aligned((H, nt, d), dt)
        sk, sv = empty_aligned((H, nt, d), dt), empty_aligned((H, nt, d), dt)
        for x in (k, v, sk, sv):
            x.fill(0)
        res = {}
        for _ in range(rounds):
            for p, threads in itertools.product(paths, (1, 2)):
                set_kernel_path(p)
                g, c = [], []
                for _ in range(reps):
                    t = time.perf_counter()
                    gather_kv(buf, src, dst, k, v, threads=threads)
                    t1 = time.perf_counter()
                    np.copyto(sk, k)
                    np.copyto(sv, v)
                    g.append(t1 - t)
                    c.append(time.perf_counter() - t1)
                r = res.setdefault(p if threads == 1 else p + "/2t",
                                   {"mode": gather_kv_mode(k, v, n), "threads": threads,
                                    "gather_ms": [], "read_after_ms": []})
                r["gather_ms"].append(statistics.median(g) * 1e3)
                r["read_after_ms"].append(statistics.median(c) * 1e3)
        set_kernel_path("auto")
        for r in res.values():
            r["gather_ms"], r["read_after_ms"] = min(r["gather_ms"]), min(r["read_after_ms"])
            r["gather_gbps"] = n * eb / (r["gather_ms"] * 1e-3) / 1e9
        out.append({"shape": name, "kv_heads": H, "head_dim": d, "dtype": np.dtype(dt).name,
                    "entries": n, "bytes": n * eb, "paths": res})
    return out


def bench_recall(workdir, context=16384, queries=64, r=0.1, coverages=(2.0, 3.0)):
    """The int8 index against the exact "prob" score on a real layout: the
    demo's capture (all-MiniLM-L6-v2 over its default text) cast to fp16,
    laid out and written as the demo does; per held-out query and layer, the
    selection of each index (same budget and local window as the Retriever),
    the overlap of their chosen entries (|int8 & exact| / |exact|) and each
    one's attention-mass recall (``_report.attention_recall`` against the
    exact attention over the whole context)."""
    from swarmfs._demo import build_store, local_window
    from swarmfs.decode._report import attention_recall, token_mass
    from swarmfs.decode._selectors import MedoidSelector
    from swarmfs.decode._window import window_size
    from swarmfs.layout import LayoutParams, capture

    params = LayoutParams()
    cap = capture(None, None, max_tokens=context + queries, progress=False,
                  dtype="float16")
    S = min(context, cap.num_tokens - queries)
    store, _ = build_store(cap, workdir, disks=2, params=params, context=S, force=True,
                           progress=False)
    budget = int(np.ceil(r * S))
    sels = {"exact": MedoidSelector(store, index="exact"), "int8": MedoidSelector(store)}
    for cov in coverages:
        sels[f"2lvl_c{cov:g}"] = MedoidSelector(store, levels=2, coverage=cov)
    rows = {name: [] for name in sels}
    rows.update({"overlap": []}, **{f"overlap_{name}": [] for name in sels if name != "exact"})
    with store:
        for layer in range(cap.num_layers):
            li = store.layer(layer)
            w = window_size(local_window(params, S), budget, S)
            k = cap.k[layer][:, :S].astype(np.float32)
            for t in range(S, S + queries):
                q = cap.q[layer][:, t].astype(np.float32)
                G = q.shape[0] // k.shape[0]
                logits = np.einsum("hgd,hsd->hgs", q.reshape(k.shape[0], G, -1), k)
                mass = token_mass(logits.reshape(q.shape[0], -1)[:, None] * cap.scaling)[0]
                pos = {}
                for name, sel in sels.items():
                    x = sel.select(layer, q[None], budget=budget, window=w, li=li)[0]
                    mem = [li.members[li.members_ptr[c]:li.members_ptr[c + 1]]
                           for c in x.clusters]
                    pos[name] = np.unique(np.concatenate(mem + [np.arange(S - w, S)]))
                    rows[name].append(attention_recall(mass, pos[name], budget)[0])
                rows["overlap"].append(np.intersect1d(pos["int8"], pos["exact"]).size /
                                       pos["exact"].size)
                for name in sels:
                    if name != "exact":
                        rows[f"overlap_{name}"].append(
                            np.intersect1d(pos[name], pos["exact"]).size / pos["exact"].size)
    return {"context": S, "queries": queries, "layers": cap.num_layers,
            "model": cap.meta.get("model"), "dtype": "float16",
            "recall_exact": float(np.mean(rows["exact"])),
            "recall_int8": float(np.mean(rows["int8"])),
            "recall_int8_min_minus_exact": float(np.min(np.subtract(rows["int8"],
                                                                    rows["exact"]))),
            "entry_overlap_mean": float(np.mean(rows["overlap"])),
            "entry_overlap_min": float(np.min(rows["overlap"])),
            "two_level": {name: {"recall": float(np.mean(rows[name])),
                                 "recall_min_minus_exact": float(np.min(np.subtract(
                                     rows[name], rows["exact"]))),
                                 "recall_minus_int8": float(np.mean(rows[name]) -
                                                            np.mean(rows["int8"])),
                                 "entry_overlap_mean": float(np.mean(rows[f"overlap_{name}"])),
                                 "entry_overlap_min": float(np.min(rows[f"overlap_{name}"]))}
                          for name in sels if name.startswith("2lvl")}}


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--tokens", type=CommaList(int, item=COUNT), is_eager=True,
              default="131072,262144,524288,1048576")
@click.option("--cluster-sizes", type=CommaList(float, item=FiniteFloat(min=1)),
              default=None, callback=_cluster_sizes,
              help="mean entries per cluster at each --tokens value (C = S / size), or one "
                   "for all; default: the layout's measured size (MiniLM over WikiText-2: "
                   "14.9 at 128K, bench_layout.py) grown as S^0.38 (0.377 as measured "
                   "from 16K to 128K)")
@click.option("--reps", type=COUNT, default=200)
@click.option("--paths", default="auto",
              type=CommaList(choices=["auto", "all", "scalar", "avx2", "avx512", "neon"]),
              help="kernel paths to measure, comma-separated (scalar, avx2, avx512, "
                   "neon; 'all' = every path this CPU runs; default: the auto path)")
@click.option("--assembly", is_flag=True,
              help="also retrieve at batch 1/4/8 from a tmpfs store (GB/s, assembly)")
@click.option("--gather", is_flag=True,
              help="only time gather_kv (assembly) on each --paths path, with and "
                   "without streaming stores, and a read of K/V after it")
@click.option("--pipeline", is_flag=True,
              help="also time a decode step over 8 layers, sequential vs pipelined")
@click.option("--session", is_flag=True,
              help="also time DecodeSession.step (Qwen3-32B-shaped layer, 32K tokens), "
                   "copying, landing in its EntryBuffer, and with the upkeep deferred")
@click.option("--session-tokens", type=CommaList(int, item=click.IntRange(min=1024)),
              default="32768",
              show_default=True, help="--session: context lengths to step at (e.g. "
                                      "32768,131072)")
@click.option("--recall", metavar="DIR",
              help="only measure the int8 index's recall against the exact score on "
                   "the demo's capture cast to fp16 (store written under DIR)")
@click.option("--two-level", is_flag=True,
              help="also time the two-level int8 index (select_i8x2) on each path")
@click.option("--group-size", type=COUNT, default=32)
@click.option("--coverage", type=POSITIVE, default=3.0)
@click.option("--no-naive", is_flag=True, help="skip the naive full-key scan")
@click.option("--busy", is_flag=True,
              help="keep another core busy with float32 matrix products (as the model's "
                   "attention and MLP would) while selection is measured")
@click.option("--cold", is_flag=True,
              help="also time the int8 selections right after a 400 MiB write pass "
                   "(the index out of cache, as inside a decode step)")
@click.option("--kv-heads", type=COUNT, default=8, is_eager=True,
              help="KV heads (Qwen3-32B: 8)")
@click.option("--query-heads", type=COUNT, default=None, callback=_query_heads,
              help="query heads, a multiple of --kv-heads (default: 8 per KV head, as "
                   "Qwen3-32B's 64 over 8)")
@click.option("--head-dim", type=COUNT, default=128, help="head dim (Qwen3-32B: 128)")
@click.option("--out", type=OutPath(prefix=True, suffixes=(".json",)), default="bench-out/select",
              help="output prefix: writes PREFIX.json (PREFIX-recall.json, "
                   "PREFIX-gather.json); a trailing .json is dropped")
@click.pass_context
def cli(ctx, **options):
    a = types.SimpleNamespace(**options)
    argv = ctx.obj
    if a.recall:
        rec = bench_recall(a.recall)
        print(json.dumps(rec, indent=1))
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + "-recall.json", "w") as f:
            json.dump(rec, f, indent=1)
        return
    rng = np.random.default_rng(0)
    rows = []
    auto = kernel_path()
    if "all" in a.paths and a.paths != ["all"]:
        raise click.BadParameter("'all' stands alone", param_hint="--paths")
    paths = supported_paths()[::-1] if a.paths == ["all"] else \
        [auto if p == "auto" else p for p in a.paths]
    missing = [p for p in paths if p not in supported_paths()]
    if missing:
        raise click.BadParameter(f"this CPU does not run {', '.join(missing)} (it runs "
                                 f"{', '.join(supported_paths())})", param_hint="--paths")
    if a.gather:
        paths = paths if "scalar" in paths else ["scalar"] + paths
        print(f"CPU flags: {' '.join(cpu_flags())}; gather_kv on {', '.join(paths)} "
              "(scalar = memcpy), interleaved; ms = min over 3 rounds of medians")
        res = bench_gather(max(a.reps // 4, 10), rng, paths)
        for row in res:
            for p, r in row["paths"].items():
                print(f"{row['shape']:>46} {row['bytes'] / 1e6:6.1f} MB  {p:>10} {r['mode']:>9}: "
                      f"gather {r['gather_ms']:7.3f} ms ({r['gather_gbps']:5.1f} GB/s), "
                      f"read after {r['read_after_ms']:6.3f} ms, sum "
                      f"{r['gather_ms'] + r['read_after_ms']:7.3f} ms")
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + "-gather.json", "w") as f:
            json.dump({"gather": res, "cpu_flags": cpu_flags(), "paths": paths,
                       "command": "python -m tools.bench_select " +
                       " ".join(argv or sys.argv[1:])}, f, indent=1)
        print(f"wrote {a.out}-gather.json")
        return
    print(f"CPU flags: {' '.join(cpu_flags())}; auto path: {auto}; measured: "
          f"{', '.join(paths)}; one thread (int8 2t: select_i8 with threads=2, same run)")
    if a.head_dim % 4:
        raise click.BadParameter(f"head dim {a.head_dim} is not a multiple of 4",
                                 param_hint="--head-dim")
    print(f"shape: {a.kv_heads} KV heads, {a.query_heads} query heads, head dim "
          f"{a.head_dim}" + (" (Qwen3-32B)" if (a.kv_heads, a.query_heads, a.head_dim) ==
                             (8, 64, 128) else ""))
    if a.two_level:
        print(f"two-level index: group size {a.group_size}, coverage {a.coverage}")
    print(f"{'tokens':>8} {'medoids':>8} {'naive ms':>9} " +
          " ".join(f"{p + ' int8':>12} {p + ' int8 2t':>14} {p + ' prob':>12} "
                   f"{p + ' logit':>12}" for p in paths) +
          f" {'split ms':>9} {'paper':>7}")
    sizes, toks = a.cluster_sizes, a.tokens
    busy = _BusyCore() if a.busy else contextlib.nullcontext()
    with busy:
        _selection_rows(a, toks, sizes, rng, paths, rows)
    _rest(a, argv, rng, paths, rows, sizes, auto)


class _BusyCore:
    """A child process doing float32 matrix products on one thread until
    the block ends: the other core, busy as the model keeps it."""

    def __enter__(self):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.proc = ctx.Process(target=_spin, args=(self.stop,), daemon=True)
        self.proc.start()
        time.sleep(1.0)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.proc.join(10)


def _spin(stop) -> None:
    # numpy (and its BLAS pool, one thread per core) is loaded with this
    # module before this runs, so an environment variable set here is too
    # late: limit the pool itself, or the "busy core" keeps both cores busy
    from threadpoolctl import threadpool_limits
    a = np.random.default_rng(0).standard_normal((384, 384)).astype(np.float32)
    with threadpool_limits(limits=1):
        while not stop.is_set():
            for _ in range(20):
                a = np.tanh(a @ a)


def _selection_rows(a, toks, sizes, rng, paths, rows) -> None:
    for S, cs in zip(toks, sizes, strict=False):
        r = bench_selection(S, cs, a.reps, rng, paths=paths, two_level=a.two_level,
                            group_size=a.group_size, coverage=a.coverage,
                            naive_scan=not a.no_naive, cold=a.cold, H=a.kv_heads,
                            Hq=a.query_heads, d=a.head_dim)
        rows.append(r)
        print(f"{S:8d} {r['medoids']:8d} {r['naive_ms']:9.3f} " +
              " ".join(f"{r['paths'][p]['int8_ms']:12.3f} "
                       f"{r['paths'][p]['int8_2threads_ms']:14.3f} "
                       f"{r['paths'][p]['prob_ms']:12.3f} {r['paths'][p]['logit_ms']:12.3f}"
                       for p in paths) +
              f" {r['split_ms']:9.3f} {r['paper_swarm_ms'] or 0:7.3f}" +
              f" | read floor {r['int8_read_floor_ms']:.3f} (min "
              f"{r['int8_read_floor_min_ms']:.3f}) for {r['int8_index_bytes'] / 1e6:.1f} MB" +
              "".join(f" | {p} int8 min {r['paths'][p]['int8_min_ms']:.3f}" +
                      (f", cold {r['paths'][p]['int8_cold_ms']:.3f}" if a.cold else "") +
                      (f", 2-level {r['paths'][p]['int8x2_ms']:.3f} (min "
                       f"{r['paths'][p]['int8x2_min_ms']:.3f}"
                       + (f", cold {r['paths'][p]['int8x2_cold_ms']:.3f}" if a.cold else "")
                       + ")" if a.two_level else "")
                      for p in paths) +
              "".join(f" | {p} int8 auto {r['paths'][p]['int8_auto_ms']:.3f}"
                      for p in paths), flush=True)


def _rest(a, argv, rng, paths, rows, sizes, auto) -> None:
    """Planning, and the optional assembly, pipeline and session parts; the JSON."""
    plan = bench_planning(max(a.reps // 4, 20), rng)
    print(f"planning {plan['entries']} entries ({plan['candidates']} candidate copies, "
          f"{plan['disks']} disks): {plan['plan_ms']:.2f} ms, {plan['requests']} requests")
    step = bench_planning(max(a.reps // 4, 20), rng, n=13108, ndisks=8, S=131072)
    print(f"planning a 128K-token step at r = 0.1: {step['entries']} entries "
          f"({step['candidates']} candidate copies, {step['disks']} disks): "
          f"{step['plan_ms']:.3f} ms (min {step['plan_min_ms']:.3f}), "
          f"{step['requests']} requests")
    plan["step_128k"] = step
    if a.assembly:
        asm = bench_assembly(max(a.reps // 4, 20), rng)
        plan["assembly"] = asm
        for (t, b), x in ((tb, x) for t, row in asm.items() for tb, x in
                          (((t, b), x) for b, x in row.items())):
            print(f"{t} assembly thread{'s' if t > 1 else ''}, "
                  f"batch {b}: {x['entries']} entries, retrieve {x['total_us']:.0f} µs "
                  f"(select {x['select_us']:.0f}, plan {x['plan_us']:.0f}, I/O {x['io_us']:.0f}, "
                  f"assemble {x['assemble_us']:.0f}) = {x['gbps']:.2f} GB/s "
                  f"({x['gbps_vs_batch1']:.2f}x batch 1); assembly {x['assemble_gbps']:.1f} GB/s "
                  f"({x['assemble_gbps_vs_batch1']:.2f}x)")
    if a.pipeline:
        pipe = bench_pipeline(max(a.reps // 10, 8), rng)
        plan["pipeline"] = pipe
        for mode in ("sequential", "pipelined", "sequential_2t", "pipelined_2t",
                     "sequential_2t_reuse"):
            x = pipe[mode]
            print(f"decode step, 8 layers, {mode}: {x['step_us'] / 1e3:.2f} ms (retrieval "
                  f"{x['retrieval_us'] / 1e3:.2f} ms + compute {x['compute_us'] / 1e3:.2f} ms; "
                  f"sum {x['sum_us'] / 1e3:.2f}, max {x['max_us'] / 1e3:.2f})")
        print(f"pipelined / sequential step: {1 / pipe['speedup']:.2f} (one assembly "
              f"thread), {1 / pipe['speedup_2t']:.2f} (two)")
    for n_tok in (a.session_tokens if a.session else []):
        ses = bench_session(max(a.reps // 8, 10), rng, S=n_tok)
        plan.setdefault("session", ses)                 # the first length, as before
        plan.setdefault("sessions", {})[n_tok] = ses
        for key in ("copy", "reuse", "deferred"):
            x = ses[key]
            print(f"DecodeSession.step ({ses['tokens']} tokens, {ses['entries']} entries of "
                  f"{ses['entry_bytes']} B), {key}: {x['step_us'] / 1e3:.2f} ms (retrieval "
                  f"{x['retrieval_us'] / 1e3:.2f} ms, upkeep {x['upkeep_us'] / 1e3:.2f} ms; "
                  f"CPU {x['cpu_us'] / 1e3:.2f} ms beside I/O {x['io_us'] / 1e3:.2f} ms, "
                  f"{x['cpu_over_io']:.2f}x; off the path {x['offpath_us'] / 1e3:.2f} ms)")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"selection": rows, "planning": plan, "cluster_sizes": sizes,
                   "shape": {"kv_heads": a.kv_heads, "query_heads": a.query_heads,
                             "head_dim": a.head_dim},
                   "cpu_flags": cpu_flags(), "auto_path": auto, "paths": paths,
                   "busy_core": bool(a.busy),
                   "command": "python -m tools.bench_select " + " ".join(argv or sys.argv[1:])},
                  f, indent=1)
    print(f"wrote {a.out}.json")


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line, as a program)."""
    return cli.main(args=argv, obj=argv, standalone_mode=argv is None)


if __name__ == "__main__":
    main()
