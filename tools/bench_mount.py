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

``--isolation`` (root) instead measures readers of healthy disks beside
readers stuck on a slow one, through the mount (issue 26): a store of
--disks disks, the last a loop device throttled by blk-throttle to
--slow-bps bytes/s (the testbed's cgroup, which the mount daemon joins once
it is up), the others files under --dir; entries of 4 KiB, mounted with
``--direct-io`` so that every ``pread`` is one FUSE read of exactly its
entries.  --healthy threads read one random entry of the healthy disks at a
time, for --isolation-seconds per phase: alone ("solo"), then beside each
count of --stuck readers of the slow disk (even ones read one entry on it,
odd ones a stripe of one entry per disk, so both whole and split reads are
stuck; they keep reading from one phase to the next).  Each phase starts once
the daemon's stats.json shows every stuck reader queued on or reading the
slow disk.  Reports the healthy reads' p50 and p99 and their ratios to solo.

    python -m tools.bench_mount --isolation --stuck 1,4,8 --out bench_mount_isolation.json
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import types

import click
import numpy as np

from swarmfs import Store
from tools._options import COUNT, DISKS, NONNEG, POSITIVE, CommaList, OutPath, clear_store_dir

MiB = 1 << 20


def build_big(path, *, disks, clusters, cluster_mib, seed=0):
    shape = (2, 8, 128)
    eb = 2 * 8 * 128 * 2
    n = cluster_mib * MiB // eb
    if os.path.exists(os.path.join(path, "manifest.json")):
        with contextlib.suppress(Exception), Store.open(path) as s:
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
        with contextlib.suppress(Exception), Store.open(path) as s:
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
    def kv(n):
        return rng.standard_normal((n, 2, 2, 16), dtype=np.float32).astype(np.float16)

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


def readahead_sweep(big, mnt, sizes_kb, runs, store, *, clusters, concurrent):
    """Median seconds of one ``dd bs=1M`` and of ``concurrent`` concurrent
    ones in page cache mode for each kernel read-ahead (``read_ahead_kb`` of
    the mount's bdi; needs root), interleaved, with the fast path alongside;
    ``clusters``: big clusters in the store (at least ``concurrent``)."""
    res = {}
    with Mount(big, mnt):
        with open("/proc/self/mountinfo") as f:
            bdi = [ln.split()[2] for ln in f if ln.split()[4] == mnt][0]

        def kv(c):
            return os.path.join(mnt, "layers", "00", "clusters", f"{c:06d}", "kv.bin")

        for r in range(runs):
            t = time.perf_counter()
            store.read_cluster(0, r % clusters)
            res.setdefault("fast path read_cluster", []).append(time.perf_counter() - t)
            for kb in sizes_kb:
                with open(f"/sys/class/bdi/{bdi}/read_ahead_kb", "w") as f:
                    f.write(str(kb))
                c = (r + kb) % clusters
                drop_file_cache(kv(c))
                res.setdefault(f"dd, read_ahead_kb={kb}", []).append(
                    timed(["dd", f"if={kv(c)}", "of=/dev/null", "bs=1M"]))
                for cc in range(concurrent):
                    drop_file_cache(kv(cc))
                res.setdefault(f"{concurrent} x dd, read_ahead_kb={kb}", []).append(
                    timed_parallel([["dd", f"if={kv(cc)}", "of=/dev/null", "bs=1M"]
                                    for cc in range(concurrent)]))
    return {k: statistics.median(v) for k, v in res.items()}


def build_isolation(path, disks):
    """A store over ``disks`` (the last one the slow disk): one layer of 64
    clusters of 64 entries of 4 KiB ([2, 8, 128] float16), striped over every
    disk.  Returns the entries' bytes [clusters, 64 * 4096] and the disk of
    each entry [clusters, 64]."""
    clear_store_dir(path, option="--dir")
    rng = np.random.default_rng(3)
    C, n = 64, 64
    kv = rng.standard_normal((C * n, 2, 8, 128), dtype=np.float32).astype(np.float16)
    with Store.create(path, disks=disks, num_layers=1, num_kv_heads=8, head_dim=128,
                      dtype="float16", force=True) as s:
        s.write_layer(0, kv, [np.arange(c * n, (c + 1) * n) for c in range(C)])
        li = s.layer(0)
        on = np.stack([li.copy_disk[li.cluster_copies([c])] for c in range(C)])
        want = np.stack([s.read_cluster(0, c).reshape(-1).view(np.uint8) for c in range(C)])
    return want, on


def _kv_reader_stats(mnt):
    with open(os.path.join(mnt, "stats.json")) as f:
        return json.load(f)["mount"]["kv_reader"]


def measure_isolation(a):
    """Healthy readers' latency through the mount alone and beside stuck
    readers of a throttled disk (see the module docstring)."""
    from tools import _testbed as T
    name = f"swarmfs-bench-mount-isolation-{os.getpid()}"
    backing = os.path.join(a.dir, "isolation-backing")
    state = T.up(1, "64M", backing, limits=T.Limits(read_bps=a.slow_bps), name=name)
    slow = a.disks - 1
    phases, meta = [], {}
    try:
        dev = state["devices"][0]
        os.makedirs(os.path.join(a.dir, "isolation-disks"), exist_ok=True)
        disks = [os.path.join(a.dir, "isolation-disks", f"disk{i}.img")
                 for i in range(slow)] + [dev]
        want, on = build_isolation(os.path.join(a.dir, "isolation"), disks)
        Eb = want.shape[1] // on.shape[1]
        healthy = np.argwhere(on != slow)               # (cluster, entry) pairs
        narrow = np.argwhere(on == slow)
        stripes = [(c, j - 1) for c, j in narrow if j >= 1 and j + a.disks - 1 <= on.shape[1]]
        mnt = os.path.join(a.dir, "mnt-isolation")
        with Mount(os.path.join(a.dir, "isolation"), mnt, "--direct-io",
                   "--threads", str(a.threads)) as M:
            T.enter(M.proc.pid, name=name)              # the daemon's reads of dev: throttled
            fds = [os.open(os.path.join(mnt, "layers", "00", "clusters", f"{c:06d}", "kv.bin"),
                           os.O_RDONLY) for c in range(on.shape[0])]
            stop_stuck = threading.Event()
            stuck_done, stuck_bad, stuck_threads = [0], [0], []

            def stuck_reader(k):
                r = np.random.default_rng(100 + k)
                while not stop_stuck.is_set():
                    if k % 2 == 0:
                        c, j = narrow[r.integers(len(narrow))]
                        n = 1
                    else:
                        c, j = stripes[r.integers(len(stripes))]
                        n = a.disks
                    try:
                        got = os.pread(fds[c], n * Eb, int(j) * Eb)
                    except OSError:
                        return                          # unmounted under it
                    stuck_bad[0] += got != want[c, j * Eb:(j + n) * Eb].tobytes()
                    stuck_done[0] += 1

            def healthy_phase(label):
                lat, bad = [[] for _ in range(a.healthy)], [0]
                end = time.monotonic() + a.isolation_seconds
                before = stuck_done[0]

                def reader(k):
                    r = np.random.default_rng(k)
                    while time.monotonic() < end:
                        c, j = healthy[r.integers(len(healthy))]
                        t = time.perf_counter()
                        got = os.pread(fds[c], Eb, int(j) * Eb)
                        lat[k].append(time.perf_counter() - t)
                        bad[0] += got != want[c, j * Eb:(j + 1) * Eb].tobytes()

                ths = [threading.Thread(target=reader, args=(k,)) for k in range(a.healthy)]
                for t in ths:
                    t.start()
                for t in ths:
                    t.join()
                us = np.concatenate([np.asarray(x) for x in lat]) * 1e6
                row = {"stuck_readers": label, "healthy_reads": int(us.size),
                       "p50_us": float(np.percentile(us, 50)) if us.size else None,
                       "p99_us": float(np.percentile(us, 99)) if us.size else None,
                       "max_us": float(us.max()) if us.size else None,
                       "wrong_bytes": bad[0], "stuck_reads_done": stuck_done[0] - before,
                       "daemon": _kv_reader_stats(mnt)}
                solo = phases[0] if phases else row
                for q in ("p50", "p99"):
                    row[f"{q}_over_solo"] = (row[f"{q}_us"] / solo[f"{q}_us"]
                                             if row[f"{q}_us"] and solo[f"{q}_us"] else None)
                phases.append(row)
                print(f"{label:>6} {row['healthy_reads']:8d} {row['p50_us'] or 0:10.0f} "
                      f"{row['p99_us'] or 0:10.0f} {row['p50_over_solo'] or 0:9.2f} "
                      f"{row['p99_over_solo'] or 0:9.2f} {row['stuck_reads_done']:7d} "
                      f"{row['daemon']['disk_in_flight'][slow]:4d} "
                      f"{row['daemon']['disk_waiting'][slow]:4d}", flush=True)

            print(f"slow disk {slow} ({dev}) throttled to {a.slow_bps} B/s; {a.healthy} healthy "
                  f"readers of 4 KiB entries, {a.isolation_seconds:g} s per phase, mount "
                  f"--direct-io --threads {a.threads}")
            print(f"{'stuck':>6} {'reads':>8} {'p50 µs':>10} {'p99 µs':>10} {'p50/solo':>9} "
                  f"{'p99/solo':>9} {'stuck':>7} {'in':>4} {'wait':>4}")
            try:
                healthy_phase(0)
                for n in sorted(set(a.stuck)):
                    while len(stuck_threads) < n:
                        t = threading.Thread(target=stuck_reader, args=(len(stuck_threads),),
                                             daemon=True)
                        t.start()
                        stuck_threads.append(t)
                    deadline = time.monotonic() + 60
                    while True:
                        st = _kv_reader_stats(mnt)
                        if st["disk_in_flight"][slow] + st["disk_waiting"][slow] >= n or \
                                time.monotonic() > deadline:
                            break
                        time.sleep(0.05)
                    healthy_phase(n)
            finally:
                stop_stuck.set()
                T.down(name, backing)                   # lifts the throttle: stuck reads end
                for t in stuck_threads:
                    t.join(60)
                for fd in fds:
                    os.close(fd)
            meta = {"slow_disk": slow, "slow_device": dev, "slow_bps": a.slow_bps,
                    "disks": a.disks, "entry_bytes": Eb, "threads": a.threads,
                    "healthy_readers": a.healthy, "seconds_per_phase": a.isolation_seconds,
                    "stuck_reads_wrong_bytes": stuck_bad[0],
                    "stuck_reads": "even: one entry on the slow disk; odd: one entry on "
                                   "every disk"}
    finally:
        T.down(name, backing)
    return {"meta": meta, "phases": phases}


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
@click.option("--isolation", is_flag=True,
              help="instead of the main benchmark: healthy readers' latency beside readers "
                   "stuck on a throttled disk (root)")
@click.option("--stuck", type=CommaList(int, item=COUNT), default="1,4,8",
              help="isolation: counts of stuck readers, one phase each")
@click.option("--healthy", type=COUNT, default=4, help="isolation: readers of healthy disks")
@click.option("--slow-bps", type=COUNT, default=2048,
              help="isolation: read bytes/s of the throttled disk")
@click.option("--isolation-seconds", type=POSITIVE, default=10.0,
              help="isolation: seconds per phase")
@click.option("--out", type=OutPath(), default=None,
              help="JSON results (default bench_mount.json; with --isolation "
                   "bench_mount_isolation.json)")
def cli(**options):
    a = types.SimpleNamespace(**options)
    if a.out is None:
        a.out = "bench_mount_isolation.json" if a.isolation else "bench_mount.json"
    os.makedirs(a.dir, exist_ok=True)
    if a.isolation:
        if a.disks < 2:
            raise click.BadParameter("--isolation needs at least 2 disks (one is the slow "
                                     "one)", param_hint="--disks")
        res = measure_isolation(a)
        res["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out}")
        return
    big, wide = os.path.join(a.dir, "big"), os.path.join(a.dir, "wide")
    t0 = time.perf_counter()
    nbig = max(a.big_clusters, a.concurrent)
    build_big(big, disks=a.disks, clusters=nbig, cluster_mib=a.cluster_mib)
    build_wide(wide, disks=a.disks, clusters=a.clusters)
    print(f"stores ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    store = Store.open(big)
    if a.readahead_sweep:
        sweep = readahead_sweep(big, os.path.join(a.dir, "mnt"), a.readahead_sweep, a.runs,
                                store, clusters=nbig, concurrent=a.concurrent)
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
        def kv(m, c=0):
            return os.path.join(m, "layers", "00", "clusters", f"{c:06d}", "kv.bin")

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
    def mbps(sec, n=nbytes):
        return n / sec / 1e6

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
