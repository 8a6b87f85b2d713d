#!/usr/bin/env python3
"""Benchmark the FUSE mount against the fast path.

Builds (or reuses) two stores under --dir:

* ``big``: one layer of --big-clusters clusters of --cluster-mib MiB each
  (entries [2, 8, 128] float16 = 4 KiB), striped over --disks file disks;
* ``wide``: one layer of --clusters small clusters (entries [2, 2, 16] float16).

and measures, side by side in every run (median of --runs):

* fast path: ``Store.read_cluster`` of a big cluster (one batched submission);
* fast path in 1 MiB pieces: ``Store.read_cluster_range`` per MiB (what the
  mount does per FUSE request, without FUSE);
* mount, page cache (default): ``dd if=.../kv.bin bs=1M of=/dev/null`` after
  ``posix_fadvise(DONTNEED)`` drops the file's cached pages; also ``cat``;
* mount, ``--direct-io``: the same dd and cat;
* concurrent: --concurrent dd processes on different big clusters at once
  (both modes), against the fast path reading the same clusters one after
  another;
* listings of the whole wide mount: ``ls -R``, ``find | wc -l`` and
  ``du -s``, each cold (first run on a fresh mount) and warm (second run);
* following the store: seconds from an ``append`` commit until its new
  cluster is visible on a following mount (``--follow-runs`` appends to a
  copy-free small store).

Writes everything to --out as JSON and prints a table.

    python -m tools.bench_mount --dir /tmp/swarmfs-bench --runs 5 --out bench_mount.json
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types

import click
import numpy as np

from tools._options import COUNT, DISKS, NONNEG, CommaList, OutPath, clear_store_dir
from swarmfs import Store

MiB = 1 << 20


def build_big(path, *, disks, clusters, cluster_mib, seed=0):
    shape = (2, 8, 128)
    eb = 2 * 8 * 128 * 2
    n = cluster_mib * MiB // eb
    if os.path.exists(os.path.join(path, "manifest.json")):
        with contextlib.suppress(Exception):
            with Store.open(path) as s:
                if s.num_clusters(0) == clusters and int(s.layer(0).sizes[0]) == n \
                        and s.num_disks == disks:
                    return
    clear_store_dir(path, option="--dir")
    rng = np.random.default_rng(seed)
    S = n * clusters
    kv = rng.standard_normal((S,) + shape, dtype=np.float32).astype(np.float16)
    s = Store.create(path, disks=disks, num_layers=1, num_kv_heads=8, head_dim=128,
                     dtype="float16")
    s.write_layer(0, kv, [np.arange(i * n, (i + 1) * n) for i in range(clusters)])
    s.close()


def build_wide(path, *, disks, clusters, seed=1):
    if os.path.exists(os.path.join(path, "manifest.json")):
        with contextlib.suppress(Exception):
            with Store.open(path) as s:
                if s.num_clusters(0) == clusters and s.num_disks == disks:
                    return
    clear_store_dir(path, option="--dir")
    rng = np.random.default_rng(seed)
    S = clusters * 4
    kv = rng.standard_normal((S, 2, 2, 16), dtype=np.float32).astype(np.float16)
    cuts = np.sort(rng.choice(np.arange(1, S), clusters - 1, replace=False))
    s = Store.create(path, disks=disks, num_layers=1, num_kv_heads=2, head_dim=16,
                     dtype="float16")
    s.write_layer(0, kv, np.split(rng.permutation(S), cuts))
    s.close()


class Mount:
    """A mount served by ``python -m swarmfs.mount._fuse ... --foreground``."""

    def __init__(self, store, mnt, *extra):
        self.store, self.mnt, self.extra = store, mnt, list(extra)
        self.proc = None

    def __enter__(self):
        os.makedirs(self.mnt, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "swarmfs.mount._fuse", self.store,
                                      self.mnt, "--foreground", *self.extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.poll() is not None else ""
                self.__exit__()
                raise RuntimeError(f"mount of {self.store} failed: {err}")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        if os.path.ismount(self.mnt):
            subprocess.run(["fusermount3", "-u", self.mnt], capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)
                self.proc.kill()
                self.proc.wait()
            self.proc.stderr.close()


def drop_file_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def proc_cpu_s(pid):
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CPU = {}        # name -> [(daemon CPU s, reader CPU s)] per run


def timed(cmd, name=None, daemon=None):
    """Wall seconds of ``cmd``; with ``name``, also records the CPU seconds
    the mount daemon (pid ``daemon``) and the reader spent on it."""
    import resource
    c0 = proc_cpu_s(daemon) if daemon else 0.0
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dt = time.perf_counter() - t
    if name:
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        reader = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        CPU.setdefault(name, []).append(
            ((proc_cpu_s(daemon) - c0) if daemon else None, reader))
    return dt


def timed_parallel(cmds):
    t = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for c in cmds]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"{p.args} failed")
    return time.perf_counter() - t


def measure_follow(path, mnt, runs):
    """Seconds from an append's commit until its first new cluster is
    visible on a mount that follows the store (``runs`` appends)."""
    if runs <= 0:
        return []
    clear_store_dir(path, option="--dir")
    rng = np.random.default_rng(2)
    s = Store.create(path, disks=2, num_layers=1, num_kv_heads=2, head_dim=16,
                     dtype="float16")
    kv = lambda n: rng.standard_normal((n, 2, 2, 16), dtype=np.float32).astype(np.float16)
    s.write_layer(0, kv(1000), [np.arange(i * 100, (i + 1) * 100) for i in range(10)])
    out = []
    try:
        with Mount(path, mnt):
            cl = os.path.join(mnt, "layers", "00", "clusters")
            for _ in range(runs):
                C = s.num_clusters(0)
                s.append(0, kv(64), new_cluster_size=64)
                t = time.perf_counter()
                want = os.path.join(cl, f"{C:06d}.npy")
                while not os.path.exists(want):
                    if time.perf_counter() - t > 30:
                        raise RuntimeError("an append never became visible")
                    time.sleep(0.002)
                out.append(time.perf_counter() - t)
    finally:
        s.close()
    return out


def readahead_sweep(big, mnt, sizes_kb, runs, store):
    """Median seconds of one ``dd bs=1M`` and of four concurrent ones in page
    cache mode for each kernel read-ahead (``read_ahead_kb`` of the mount's
    bdi; needs root), interleaved, with the fast path alongside."""
    res = {}
    with Mount(big, mnt):
        bdi = [ln.split()[2] for ln in open("/proc/self/mountinfo")
               if ln.split()[4] == mnt][0]
        kv = lambda c: os.path.join(mnt, "layers", "00", "clusters", f"{c:06d}", "kv.bin")
        for r in range(runs):
            t = time.perf_counter()
            store.read_cluster(0, r % 4)
            res.setdefault("fast path read_cluster", []).append(time.perf_counter() - t)
            for kb in sizes_kb:
                with open(f"/sys/class/bdi/{bdi}/read_ahead_kb", "w") as f:
                    f.write(str(kb))
                c = (r + kb) % 4
                drop_file_cache(kv(c))
                res.setdefault(f"dd, read_ahead_kb={kb}", []).append(
                    timed(["dd", f"if={kv(c)}", "of=/dev/null", "bs=1M"]))
                for cc in range(4):
                    drop_file_cache(kv(cc))
                res.setdefault(f"4 x dd, read_ahead_kb={kb}", []).append(timed_parallel(
                    [["dd", f"if={kv(cc)}", "of=/dev/null", "bs=1M"] for cc in range(4)]))
    return {k: statistics.median(v) for k, v in res.items()}


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--dir", default="/tmp/swarmfs-bench")
@click.option("--disks", type=DISKS, default=4)
@click.option("--cluster-mib", type=COUNT, default=64)
@click.option("--big-clusters", type=COUNT, default=4)
@click.option("--clusters", type=COUNT, default=100_000)
@click.option("--runs", type=COUNT, default=5)
@click.option("--ls-runs", type=NONNEG, default=3)
@click.option("--follow-runs", type=NONNEG, default=5)
@click.option("--readahead-sweep", type=CommaList(int, item=NONNEG), default=None,
              help="comma-separated read_ahead_kb values to compare instead of the "
                   "main benchmark (root only)")
@click.option("--concurrent", type=COUNT, default=4)
@click.option("--threads", type=COUNT, default=8)
@click.option("--out", type=OutPath(), default="bench_mount.json")
def cli(**options):
    a = types.SimpleNamespace(**options)
    os.makedirs(a.dir, exist_ok=True)
    big, wide = os.path.join(a.dir, "big"), os.path.join(a.dir, "wide")
    t0 = time.perf_counter()
    build_big(big, disks=a.disks, clusters=max(a.big_clusters, a.concurrent),
              cluster_mib=a.cluster_mib)
    build_wide(wide, disks=a.disks, clusters=a.clusters)
    print(f"stores ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    store = Store.open(big)
    if a.readahead_sweep:
        sweep = readahead_sweep(big, os.path.join(a.dir, "mnt"),
                                a.readahead_sweep, a.runs, store)
        for k, v in sweep.items():
            print(f"{k}: median {v:.4f} s")
        with open(a.out, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                       "readahead_sweep_median_seconds": sweep}, f, indent=1)
        store.close()
        return
    nbytes = int(store.layer(0).sizes[0]) * store.entry_bytes
    conc = list(range(max(a.concurrent, 1)))
    times = {k: [] for k in ("fast_read_cluster", "fast_read_cluster_cpu", "fast_range_1MiB",
                             "mount_dd_1M", "mount_cat", "mount_direct_dd_1M",
                             "mount_direct_cat", "fast_concurrent", "mount_concurrent_dd_1M",
                             "mount_direct_concurrent_dd_1M")}
    m1, m2 = os.path.join(a.dir, "mnt"), os.path.join(a.dir, "mnt-direct")
    thr = ["--threads", str(a.threads)]
    with Mount(big, m1, *thr) as M1, Mount(big, m2, "--direct-io", *thr) as M2:
        kv = lambda m, c=0: os.path.join(m, "layers", "00", "clusters", f"{c:06d}", "kv.bin")
        # correctness once, and warm-up of the index on both mounts
        want = store.read_cluster(0, 0).tobytes()
        for m in (m1, m2):
            with open(kv(m), "rb") as f:
                if f.read() != want:
                    raise RuntimeError(f"{m}: bytes differ from the fast path")
        for _ in range(a.runs):
            t = time.perf_counter()
            store.read_cluster(0, 0)
            times["fast_read_cluster"].append(time.perf_counter() - t)
            t0 = time.process_time()
            store.read_cluster(0, 0)
            times["fast_read_cluster_cpu"].append(time.process_time() - t0)
            t = time.perf_counter()
            for off in range(0, nbytes, MiB):
                store.read_cluster_range(0, 0, off, MiB)
            times["fast_range_1MiB"].append(time.perf_counter() - t)
            drop_file_cache(kv(m1))
            times["mount_dd_1M"].append(timed(["dd", f"if={kv(m1)}", "of=/dev/null", "bs=1M"],
                                              "mount_dd_1M", M1.proc.pid))
            drop_file_cache(kv(m1))
            times["mount_cat"].append(timed(["sh", "-c", f"cat {kv(m1)} > /dev/null"]))
            times["mount_direct_dd_1M"].append(
                timed(["dd", f"if={kv(m2)}", "of=/dev/null", "bs=1M"], "mount_direct_dd_1M",
                      M2.proc.pid))
            times["mount_direct_cat"].append(
                timed(["sh", "-c", f"cat {kv(m2)} > /dev/null"]))
            if a.concurrent > 1:
                t = time.perf_counter()
                for c in conc:
                    store.read_cluster(0, c)
                times["fast_concurrent"].append(time.perf_counter() - t)
                for c in conc:
                    drop_file_cache(kv(m1, c))
                times["mount_concurrent_dd_1M"].append(timed_parallel(
                    [["dd", f"if={kv(m1, c)}", "of=/dev/null", "bs=1M"] for c in conc]))
                times["mount_direct_concurrent_dd_1M"].append(timed_parallel(
                    [["dd", f"if={kv(m2, c)}", "of=/dev/null", "bs=1M"] for c in conc]))
    store.close()

    walks = {"ls -R": ["ls", "-R"], "find | wc -l": ["sh", "-c", "find \"$0\" | wc -l"],
             "du -s": ["du", "-s"]}
    listing = {name: {"cold": [], "warm": []} for name in walks}
    ls_entries = None
    m3 = os.path.join(a.dir, "mnt-wide")
    for _ in range(a.ls_runs):
        for name, cmd in walks.items():
            with Mount(wide, m3, *thr):
                for phase in ("cold", "warm"):
                    t = time.perf_counter()
                    out = subprocess.run(cmd + [m3], check=True, capture_output=True).stdout
                    listing[name][phase].append(time.perf_counter() - t)
                    if name == "ls -R":
                        ls_entries = sum(1 for line in out.splitlines()
                                         if line and not line.endswith(b":"))
                    elif name == "find | wc -l":
                        find_entries = int(out.split()[0])
    follow = measure_follow(os.path.join(a.dir, "follow"), os.path.join(a.dir, "mnt-follow"),
                            a.follow_runs)

    med = {k: statistics.median(v) for k, v in times.items() if v}
    mbps = lambda sec, n=nbytes: n / sec / 1e6
    fast = mbps(med["fast_read_cluster"])
    # (name, median seconds, MB/s, MB/s of the fast-path baseline it is compared with)
    rows = [("fast path read_cluster", med["fast_read_cluster"], fast, fast),
            ("fast path read_cluster_range, 1 MiB pieces", med["fast_range_1MiB"],
             mbps(med["fast_range_1MiB"]), fast),
            ("mount dd bs=1M (page cache)", med["mount_dd_1M"], mbps(med["mount_dd_1M"]), fast),
            ("mount cat (page cache)", med["mount_cat"], mbps(med["mount_cat"]), fast),
            ("mount dd bs=1M (--direct-io)", med["mount_direct_dd_1M"],
             mbps(med["mount_direct_dd_1M"]), fast),
            ("mount cat (--direct-io)", med["mount_direct_cat"],
             mbps(med["mount_direct_cat"]), fast)]
    if a.concurrent > 1:
        tot = nbytes * len(conc)
        cfast = mbps(med["fast_concurrent"], tot)
        rows += [(f"fast path read_cluster x{len(conc)} (one after another)",
                  med["fast_concurrent"], cfast, cfast),
                 (f"mount {len(conc)} concurrent dd bs=1M (page cache)",
                  med["mount_concurrent_dd_1M"], mbps(med["mount_concurrent_dd_1M"], tot), cfast),
                 (f"mount {len(conc)} concurrent dd bs=1M (--direct-io)",
                  med["mount_direct_concurrent_dd_1M"],
                  mbps(med["mount_direct_concurrent_dd_1M"], tot), cfast)]
    result = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "host": {"kernel": platform.release(), "cpus": os.cpu_count(),
                 "python": platform.python_version()},
        "params": vars(a), "cluster_bytes": nbytes,
        "runs_seconds": times,
        "median_seconds": med,
        "throughput_MBps": {name: round(v, 1) for name, _, v, _ in rows},
        "ratio_to_fast_path": {name: round(v / base, 3) for name, _, v, base in rows},
        "fast_read_cluster_cpu_s": med.get("fast_read_cluster_cpu"),
        "cpu_seconds_daemon_reader": CPU,
        "median_cpu_seconds": {k: {"daemon": statistics.median(d for d, _ in v),
                                   "reader": statistics.median(r for _, r in v)}
                               for k, v in CPU.items()},
        "listing": {"clusters": a.clusters, "ls_R_entries": ls_entries,
                    "find_entries": find_entries if a.ls_runs else None,
                    "seconds": listing,
                    "median_seconds": {n: {p: statistics.median(v) for p, v in d.items() if v}
                                       for n, d in listing.items()}},
        "follow_seconds": follow,
        "follow_median_seconds": statistics.median(follow) if follow else None,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}}  {'median s':>9}  {'MB/s':>8}  {'vs fast':>7}")
    for name, sec, v, _ in rows:
        print(f"{name:{w}}  {sec:9.4f}  {v:8.1f}  {result['ratio_to_fast_path'][name]:7.3f}")
    print(f"CPU per cluster file read (median): fast path {med['fast_read_cluster_cpu']:.3f} s; "
          + "; ".join(f"{k}: daemon {v['daemon']:.3f} s + dd {v['reader']:.3f} s"
                      for k, v in result["median_cpu_seconds"].items()))
    for name, d in result["listing"]["median_seconds"].items():
        if d:
            print(f"{name} of a mount of {a.clusters} clusters: cold {d['cold']:.2f} s, "
                  f"warm {d['warm']:.2f} s")
    if ls_entries is not None:
        print(f"(ls -R: {ls_entries} names; find: {find_entries} paths)")
    if follow:
        print(f"append -> visible on a following mount: median "
              f"{statistics.median(follow):.3f} s, max {max(follow):.3f} s")
    print(f"wrote {a.out}")


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line, as a program)."""
    return cli.main(args=argv, obj=argv, standalone_mode=argv is None)


if __name__ == "__main__":
    main()
