#!/usr/bin/env python3
"""Engine benchmark: swarmfs's io_uring engine vs a thread-pool os.preadv loop vs fio.

All three read the same disk files with O_DIRECT, the same random block-aligned
offsets spread over the disks, the same request size and the same queue depth
(io_uring SQ depth = fio iodepth = thread-pool size).  Sizes from 4 KiB to
1 MiB; each point is the median of --repeats runs, the three contenders
interleaved so that machine noise hits all of them alike.

    tools/dev run python tools/bench_engine.py --dir /work/benchdisks --out bench-out/engine

writes ENGINE.json and ENGINE.png.  A benchmark, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from swarmfs._engine import READ, Engine, open_disk

SIZES = [4 << 10, 16 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20]


def ensure_disks(d: str, n: int, size: int) -> list[str]:
    os.makedirs(d, exist_ok=True)
    paths = []
    chunk = os.urandom(1 << 20)
    for i in range(n):
        p = os.path.join(d, f"disk{i}.bin")
        if not os.path.exists(p) or os.path.getsize(p) < size:
            with open(p, "wb") as f:  # real data: unwritten extents would read as zeros
                for _ in range(size >> 20):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        paths.append(p)
    return paths


def make_plan(rng, ndisks, size, bs, nreq, slots):
    """Random aligned reads, round-robin over the disks.  Destinations cycle
    through ``slots`` buffers of ``bs`` bytes, as fio's per-request buffers do
    (slots = 0: one distinct destination per request, as the store does)."""
    disk = (np.arange(nreq) % ndisks).astype(np.int32)
    off = rng.integers(0, size // bs, size=nreq).astype(np.uint64) * np.uint64(bs)
    length = np.full(nreq, bs, dtype=np.uint32)
    idx = np.arange(nreq, dtype=np.uint64)
    dst = (idx % np.uint64(slots) if slots else idx) * np.uint64(bs)
    return disk, off, length, dst


def run_engine(eng, buf, plan):
    t = time.perf_counter()
    eng.execute(READ, *plan, buf)
    return time.perf_counter() - t


def run_threads(pool, fds, bufview, plan):
    disk, off, length, dst = plan
    bs = int(length[0])

    def one(i):
        os.preadv(fds[disk[i]], [bufview[int(dst[i]):int(dst[i]) + bs]], int(off[i]))

    t = time.perf_counter()
    list(pool.map(one, range(len(disk)), chunksize=1))
    return time.perf_counter() - t


def run_fio(paths, bs, qd, nreq):
    cmd = ["fio", "--name=bench", "--filename=" + ":".join(paths), "--ioengine=io_uring",
           "--direct=1", "--rw=randread", f"--bs={bs}", f"--iodepth={qd}",
           f"--number_ios={nreq}", "--norandommap", "--randrepeat=0",
           "--output-format=json", "--thread"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    j = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return j["io_bytes"] / j["bw_bytes"] if j["bw_bytes"] else float("nan"), j["total_ios"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="bench-out/engine-disks", help="where the disk files live")
    ap.add_argument("--disks", type=int, default=4)
    ap.add_argument("--disk-size", type=int, default=512 << 20, help="bytes per disk file")
    ap.add_argument("--qd", type=int, default=32, help="queue depth for all three")
    ap.add_argument("--bytes", type=int, default=256 << 20, help="bytes read per run")
    ap.add_argument("--min-requests", type=int, default=2000)
    ap.add_argument("--max-requests", type=int, default=40000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dst", choices=["ring", "linear"], default="ring",
                    help="ring: destinations cycle through 2 x qd buffers like fio's; "
                         "linear: every request has its own destination")
    ap.add_argument("--out", default="bench-out/engine", help="output prefix (.json, .png)")
    a = ap.parse_args(argv)

    paths = ensure_disks(a.dir, a.disks, a.disk_size)
    fds = [open_disk(p) for p in paths]
    eng = Engine(fds, kind="io_uring", queue_depth=a.qd, block_sizes=[4096] * len(fds))
    pool = cf.ThreadPoolExecutor(max_workers=a.qd)
    rng = np.random.default_rng(1)
    results = []
    for bs in SIZES:
        nreq = int(np.clip(a.bytes // bs, a.min_requests, a.max_requests))
        slots = 2 * a.qd if a.dst == "ring" else 0
        buf = eng.alloc((slots or nreq) * bs)
        view = memoryview(buf.array)
        times = {"swarmfs": [], "threads": [], "fio": []}
        for _ in range(a.repeats):
            plan = make_plan(rng, len(paths), a.disk_size, bs, nreq, slots)
            times["swarmfs"].append(run_engine(eng, buf, plan))
            plan = make_plan(rng, len(paths), a.disk_size, bs, nreq, slots)
            times["threads"].append(run_threads(pool, fds, view, plan))
            t, n = run_fio(paths, bs, a.qd, nreq)
            times["fio"].append(t * nreq / max(n, 1))
        row = {"bs": bs, "requests": nreq, "qd": a.qd}
        for k, ts in times.items():
            med = statistics.median(ts)
            row[k] = {"median_s": med, "gbps": nreq * bs / med / 1e9, "iops": nreq / med,
                      "runs_s": ts}
        row["swarmfs_over_fio"] = row["swarmfs"]["gbps"] / row["fio"]["gbps"]
        row["swarmfs_over_threads"] = row["swarmfs"]["gbps"] / row["threads"]["gbps"]
        results.append(row)
        print(f"{bs >> 10:5d} KiB  swarmfs {row['swarmfs']['gbps']:6.3f} GB/s "
              f"{row['swarmfs']['iops']:9.0f} IOPS | threads {row['threads']['gbps']:6.3f} GB/s "
              f"{row['threads']['iops']:9.0f} IOPS | fio {row['fio']['gbps']:6.3f} GB/s "
              f"{row['fio']['iops']:9.0f} IOPS | swarmfs/fio {row['swarmfs_over_fio']:.3f} "
              f"swarmfs/threads {row['swarmfs_over_threads']:.2f}", flush=True)
        buf.release()
    st = eng.stats()
    meta = {"disks": paths, "qd": a.qd, "dst": a.dst, "repeats": a.repeats, "engine": st.engine,
            "registered_files": st.registered_files, "fixed_requests": st.fixed_requests,
            "submit_calls": st.submit_calls, "executes": st.executes,
            "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
            "fio": subprocess.run(["fio", "--version"], capture_output=True,
                                  text=True).stdout.strip()}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    plot(results, a.out + ".png", a.qd, len(paths))
    print(f"wrote {a.out}.json and {a.out}.png")


def plot(results, path, qd, ndisks):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["bs"] >> 10 for r in results]
    for k, style in (("swarmfs", "o-"), ("threads", "s--"), ("fio", "^:")):
        ax1.plot(x, [r[k]["gbps"] for r in results], style, label=k)
        ax2.plot(x, [r[k]["iops"] / 1e3 for r in results], style, label=k)
    for ax, yl in ((ax1, "GB/s"), (ax2, "kIOPS")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request size (KiB)")
        ax.set_ylabel(yl)
        ax.grid(alpha=.3)
        ax.legend()
    fig.suptitle(f"random O_DIRECT reads, {ndisks} disk files, queue depth {qd} (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
