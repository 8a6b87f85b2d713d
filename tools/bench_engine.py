#!/usr/bin/env python3
"""Engine benchmark: swarmfs's I/O engine against fio at its best settings, and
reader isolation beside a throttled disk.

``throughput`` (default): swarmfs's io_uring engine (one ``Engine.execute``
per run, the whole plan in C; requests to disks that cannot read without
blocking, e.g. tmpfs, run on its threads; "swarmfs-io-wq" is the same engine
with those on io_uring's io-wq workers instead, shown where there are such
disks), swarmfs's threads engine (the pread fallback, also in C) and fio at
its best settings for this workload: ``--ioengine=io_uring --fixedbufs
--registerfiles --hipri=0 --sqthread_poll=0 --direct=1 --rw=randread``, one
job over the same files; the same with ``--force_async=1``; and
``--ioengine=psync`` with one job per request in flight (fio's best where
io_uring would hand every read to kernel workers anyway).  "vs best fio"
divides by the fastest of the three.  They read the same disks with
O_DIRECT (files made in ``--dir``, or the block devices or files of
``--devices`` as they are), the same number of random block-aligned requests
spread round-robin over the disks, the same request size and queue depth
(io_uring SQ depth = fio iodepth = fio psync jobs = threads per call).
Destinations cycle through 2 x qd buffers, as fio's per-request buffers do.
The contenders run interleaved, ``--repeats`` times per size; medians.
Wall µs per request (1 / IOPS) and CPU µs per request are printed side by
side, two ways: the whole process's CPU (getrusage: all threads, incl. the
kernel's io-wq workers; for fio less its start-up and teardown, measured by a
run of qd requests) and the submitting threads' CPU (swarmfs: the calling
thread; fio: its job threads, fio's own usr+sys).

``isolation`` (root): a reader of a healthy disk (a tmpfs file) and a reader
of a loop device throttled by blk-throttle to ``--slow-iops`` requests/s
share one engine.  The healthy reader's latency per call (16 x 4 KiB) is
measured alone, then while the other thread keeps the slow disk busy; p50 and
p99 and their ratio.  A third row serialises both readers with one lock
around ``execute`` (what one engine mutex held across the I/O does).

    tools/dev run python -m tools.bench_engine --out bench-out/engine
    tools/testbed up --disks 4 --profile none       # loop devices: non-blocking reads
    tools/dev run python -m tools.bench_engine --devices /dev/loop0,/dev/loop1,... --out X
    tools/dev run python -m tools.bench_engine isolation --out bench-out/engine-isolation

writes <out>.json (and <out>.png for throughput).  A benchmark, not a test:
nothing asserts.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import stat
import statistics
import subprocess
import sys
import threading
import time
import types

import click
import numpy as np

from swarmfs._errors import SwarmError
from swarmfs.store._engine import READ, Engine, open_disk
from tools._options import COUNT, DISKS, POSITIVE, QUEUE_DEPTH, CommaList, OutPath

SIZES = {"4K": 4 << 10, "16K": 16 << 10, "64K": 64 << 10, "128K": 128 << 10,
         "256K": 256 << 10, "1M": 1 << 20}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        return f"{len(names)} x {names[0]}" if names else platform.processor()
    except OSError:
        return platform.processor()


def fs_type(path: str) -> str:
    best, fstype = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            if os.path.abspath(path).startswith(mnt) and len(mnt) > len(best):
                best, fstype = mnt, typ
    return fstype


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


def disk_bytes(paths) -> int:
    """Bytes of each disk that the plans read: all of the smallest of
    ``paths`` (files or block devices), because fio reads each disk whole.
    A plan over part of a disk is not fio's workload: on a VM one range of
    tmpfs can read 20% slower than another (the first 256 MiB of 1 GiB
    files: fio 75-83K IOPS at 128 KiB against 93-103K over the whole;
    docs/bench/engine.md)."""
    sizes = []
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            sizes.append(os.lseek(fd, 0, os.SEEK_END))
        finally:
            os.close(fd)
    return min(sizes)


def disk_files(d: str, n: int, size: int) -> tuple[list[str], int]:
    """The ``n`` disk files in ``d`` (:func:`ensure_disks`; an existing file
    may be larger than ``size``) and the bytes of each the plans read
    (:func:`disk_bytes`)."""
    paths = ensure_disks(d, n, size)
    return paths, disk_bytes(paths)


def make_plan(rng, ndisks, size, bs, nreq, slots):
    """Random aligned reads, round-robin over the disks; destinations cycle
    through ``slots`` buffers of ``bs`` bytes."""
    disk = (np.arange(nreq) % ndisks).astype(np.int32)
    off = rng.integers(0, size // bs, size=nreq).astype(np.uint64) * np.uint64(bs)
    length = np.full(nreq, bs, dtype=np.uint32)
    dst = (np.arange(nreq, dtype=np.uint64) % np.uint64(slots)) * np.uint64(bs)
    return disk, off, length, dst


def rusage_s(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def run_engine(eng, buf, plan):
    """(wall s, process CPU s, calling thread's CPU s) of one execute."""
    c0, j0, t0 = rusage_s(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    eng.execute(READ, *plan, buf, check=False)
    return (time.perf_counter() - t0, rusage_s(resource.RUSAGE_SELF) - c0,
            time.thread_time() - j0)


#: fio's contenders: io_uring at the issue's best settings, the same with
#: ``--force_async=1``, and ``psync`` with one job per request in flight (on
#: files without non-blocking reads, e.g. tmpfs, io_uring hands every request
#: to kernel workers, and threads calling pread are fio's best there).
FIO_VARIANTS = {"fio": [], "fio-force-async": ["--force_async=1"], "fio-psync": "psync"}


def fio_cmd(paths, bs, qd, nreq, extra=()):
    """fio's command line: io_uring with ``extra`` options, or ``extra ==
    "psync"``: qd psync jobs of nreq / qd requests each, reported as one."""
    common = ["fio", "--name=bench", "--filename=" + ":".join(paths), "--direct=1",
              "--rw=randread", f"--bs={bs}", "--norandommap", "--randrepeat=0",
              "--output-format=json", "--thread"]
    if extra == "psync":
        return [*common, "--ioengine=psync", f"--numjobs={qd}", "--group_reporting",
                f"--number_ios={-(-nreq // qd) if isinstance(nreq, int) else nreq}"]
    return [*common, "--ioengine=io_uring", "--fixedbufs", "--registerfiles", "--hipri=0",
            "--sqthread_poll=0", f"--iodepth={qd}", f"--number_ios={nreq}", *extra]


def run_fio(paths, bs, qd, nreq, startup_cpu=0.0, extra=()):
    """(wall s, process CPU s less start-up, job threads' CPU s) of one fio
    run, scaled to ``nreq`` requests."""
    c0 = rusage_s(resource.RUSAGE_CHILDREN)
    out = subprocess.run(fio_cmd(paths, bs, qd, nreq, extra), capture_output=True, text=True,
                         check=True).stdout
    proc_cpu = rusage_s(resource.RUSAGE_CHILDREN) - c0 - startup_cpu
    job = json.loads(out[out.index("{"):])["jobs"][0]
    rd = job["read"]
    n = max(rd["total_ios"], 1)
    wall = rd["io_bytes"] / rd["bw_bytes"] if rd["bw_bytes"] else float("nan")
    job_cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1e3
    return wall * nreq / n, proc_cpu * nreq / n, job_cpu * nreq / n


def fio_startup_cpu(paths, bs, qd, extra=()) -> float:
    """CPU seconds of a fio process that reads only qd requests: its start-up
    and teardown, subtracted from each run's process CPU (median of 3)."""
    cs = []
    for _ in range(3):
        c0 = rusage_s(resource.RUSAGE_CHILDREN)
        subprocess.run(fio_cmd(paths, bs, qd, qd, extra), capture_output=True, check=True)
        cs.append(rusage_s(resource.RUSAGE_CHILDREN) - c0)
    return statistics.median(cs)


def throughput(a):
    if a.devices:
        paths = list(a.devices)
        try:
            fds = [open_disk(p, disk=i) for i, p in enumerate(paths)]
        except SwarmError as exc:
            raise click.UsageError(f"--devices: {exc}") from exc
        a.disk_size = disk_bytes(paths)
        where = "block devices" if all(os.path.realpath(p).startswith("/dev/")
                                       for p in paths) \
            else fs_type(os.path.dirname(os.path.abspath(paths[0])))
        if a.disk_size < max(SIZES[s] for s in a.sizes):
            raise click.UsageError(f"--devices: the smallest is {a.disk_size} bytes, less "
                                   "than one request")
    else:
        paths, a.disk_size = disk_files(a.dir, a.disks, a.disk_size)
        where = fs_type(a.dir)
        fds = [open_disk(p) for p in paths]
    engines = {
        "swarmfs": Engine(fds, kind="io_uring", queue_depth=a.qd,
                          block_sizes=[4096] * len(fds)),
        "swarmfs-threads": Engine(fds, kind="threads", queue_depth=a.qd,
                                  block_sizes=[4096] * len(fds)),
    }
    if engines["swarmfs"].stats().blocking_disks:
        # the same io_uring engine with those disks' requests on io-wq
        engines["swarmfs-io-wq"] = Engine(fds, kind="io_uring", queue_depth=a.qd,
                                          block_sizes=[4096] * len(fds), blocking="io_uring")
    rng = np.random.default_rng(1)
    results = []
    sizes = [SIZES[s] for s in a.sizes]
    print(f"CPU: {cpu_model()}; disks: {len(paths)} on {where}; queue depth {a.qd}; "
          f"ring flags {engines['swarmfs'].ring_flags}; disks without non-blocking reads "
          f"{engines['swarmfs'].stats().blocking_disks}")
    hdr = (f"{'size':>6} {'contender':>16} {'kIOPS':>8} {'GB/s':>7} {'wall µs/req':>12} "
           f"{'CPU µs/req':>11} {'thread CPU':>11} {'vs best fio':>11}")
    print(hdr)
    for bs in sizes:
        nreq = int(np.clip(a.bytes // bs, a.min_requests, a.max_requests))
        slots = 2 * a.qd
        bufs = {k: e.alloc(slots * bs) for k, e in engines.items()}
        runs = {k: [] for k in (*engines, *FIO_VARIANTS)}
        startup = {k: fio_startup_cpu(paths, bs, a.qd, extra) for k, extra in FIO_VARIANTS.items()}
        for _ in range(a.repeats):
            for k, eng in engines.items():
                plan = make_plan(rng, len(paths), a.disk_size, bs, nreq, slots)
                runs[k].append(run_engine(eng, bufs[k], plan))
            for k, extra in FIO_VARIANTS.items():
                runs[k].append(run_fio(paths, bs, a.qd, nreq, startup[k], extra))
        row = {"bs": bs, "requests": nreq, "qd": a.qd}
        for k, rs in runs.items():
            wall = statistics.median(r[0] for r in rs)
            cpu = statistics.median(r[1] for r in rs)
            row[k] = {"median_s": wall, "iops": nreq / wall, "gbps": nreq * bs / wall / 1e9,
                      "wall_us_per_req": wall / nreq * 1e6, "cpu_us_per_req": cpu / nreq * 1e6,
                      "thread_cpu_us_per_req": statistics.median(r[2] for r in rs) / nreq * 1e6,
                      "runs": rs}
        for k in FIO_VARIANTS:
            row[k]["startup_cpu_s"] = startup[k]
        best = max(FIO_VARIANTS, key=lambda k: row[k]["iops"])
        row["fio_best"] = best
        for k in (*engines, *FIO_VARIANTS):
            row[f"{k}_over_fio"] = row[k]["iops"] / row[best]["iops"]
        results.append(row)
        for k in (*engines, *FIO_VARIANTS):
            r = row[k]
            ratio = f"{row[k + '_over_fio']:.2f}x"
            print(f"{bs >> 10:>4}Ki {k:>16} {r['iops'] / 1e3:8.1f} {r['gbps']:7.2f} "
                  f"{r['wall_us_per_req']:12.2f} {r['cpu_us_per_req']:11.2f} "
                  f"{r['thread_cpu_us_per_req']:11.2f} {ratio:>11}", flush=True)
        for b in bufs.values():
            b.release()
    st = engines["swarmfs"].stats()
    meta = {"disks": paths, "fs": where, "qd": a.qd, "repeats": a.repeats,
            "cpu": cpu_model(), "kernel": platform.release(),
            "ring_flags": list(st.ring_flags), "registered_files": st.registered_files,
            "fixed_requests": st.fixed_requests, "requests": st.requests,
            "submit_calls": st.submit_calls, "executes": st.executes,
            "fio_variants": {k: " ".join(fio_cmd(["<disks>"], "<bs>", a.qd, "<n>", extra))
                             for k, extra in FIO_VARIANTS.items()},
            "blocking_disks": st.blocking_disks, "thread_requests": st.thread_requests,
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
            "fio": subprocess.run(["fio", "--version"], capture_output=True,
                                  text=True).stdout.strip()}
    print(f"swarmfs: {st.requests} requests ({st.thread_requests} on its threads) in "
          f"{st.submit_calls} io_uring_enter calls or thread batches, "
          f"{st.fixed_requests} with fixed buffers")
    for e in engines.values():
        e.close()
    write_json(a.out, {"meta": meta, "results": results})
    plot(results, a.out + ".png", a.qd, len(paths), where)


def percentile(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def isolation(a):
    from tools import _testbed as T
    name = f"swarmfs-bench-isolation-{os.getpid()}"
    backing = os.path.join(a.dir, "isolation-backing")
    healthy = ensure_disks(os.path.join(a.dir, "isolation-healthy"), 1, 64 << 20)[0]
    state = T.up(1, "64M", backing, limits=T.Limits(read_iops=a.slow_iops), name=name)
    rows = []
    try:
        dev = state["devices"][0]
        T.enter(os.getpid(), name=name)         # this process's reads of dev are throttled
        print(f"CPU: {cpu_model()}; healthy disk: {healthy} ({fs_type(healthy)}); slow disk: "
              f"{dev} throttled to {a.slow_iops} reads/s (blk-throttle)")
        print(f"{'engine':>9} {'mode':>11} {'reads':>6} {'p50 µs':>9} {'p99 µs':>10} "
              f"{'p99/solo':>9} {'CPU µs/read':>12} {'slow reads':>11}")
        fds = [open_disk(healthy), open_disk(dev)]
        for kind in ("io_uring", "threads"):
            eng = Engine(fds, kind=kind, queue_depth=32, block_sizes=[512, 512])
            hbuf, sbuf = eng.alloc(16 * 4096), eng.alloc(4 * 4096)
            rng = np.random.default_rng(3)
            solo = None
            for mode in ("solo", "beside-slow", "one-lock"):
                lock = threading.Lock() if mode == "one-lock" else None
                stop = threading.Event()
                slow_done = [0]

                def slow_reader(stop=stop, sbuf=sbuf, lock=lock, eng=eng, slow_done=slow_done):
                    r = np.random.default_rng(4)
                    while not stop.is_set():
                        off = r.integers(0, (64 << 20) // 4096, 4).astype(np.uint64) * 4096
                        args = ([1] * 4, off, [4096] * 4, np.arange(4) * 4096, sbuf)
                        if lock is not None:
                            with lock:
                                eng.execute(READ, *args)
                        else:
                            eng.execute(READ, *args)
                        slow_done[0] += 1

                th = None
                if mode != "solo":
                    th = threading.Thread(target=slow_reader)
                    th.start()
                    deadline = time.monotonic() + 5
                    while eng.stats().in_flight < 1 and time.monotonic() < deadline:
                        time.sleep(0.001)
                lat, cpu = [], []
                t_end = time.monotonic() + a.seconds
                while time.monotonic() < t_end and len(lat) < a.reads:
                    off = rng.integers(0, (64 << 20) // 4096, 16).astype(np.uint64) * 4096
                    args = ([0] * 16, off, [4096] * 16, np.arange(16) * 4096, hbuf)
                    c0 = time.thread_time()
                    t0 = time.perf_counter()
                    if lock is not None:
                        with lock:
                            eng.execute(READ, *args)
                    else:
                        eng.execute(READ, *args)
                    lat.append((time.perf_counter() - t0) * 1e6)
                    cpu.append((time.thread_time() - c0) * 1e6)
                stop.set()
                if th is not None:
                    th.join()
                p50, p99 = percentile(lat, 50), percentile(lat, 99)
                if mode == "solo":
                    solo = p99
                row = {"engine": kind, "mode": mode, "reads": len(lat), "p50_us": p50,
                       "p99_us": p99, "p99_over_solo": p99 / solo,
                       "cpu_us_per_read": statistics.median(cpu), "slow_calls": slow_done[0]}
                rows.append(row)
                print(f"{kind:>9} {mode:>11} {len(lat):6d} {p50:9.0f} {p99:10.0f} "
                      f"{p99 / solo:9.2f} {row['cpu_us_per_read']:12.1f} {slow_done[0]:11d}",
                      flush=True)
            eng.close()
        for fd in fds:
            os.close(fd)
    finally:
        T.down(name, backing)
    meta = {"cpu": cpu_model(), "kernel": platform.release(), "slow_iops": a.slow_iops,
            "healthy_fs": fs_type(healthy), "healthy_read": "16 x 4 KiB random, one execute",
            "slow_read": "4 x 4 KiB random, one execute, repeated",
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])}
    write_json(a.out, {"meta": meta, "results": rows})


def write_json(out, obj):
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(obj, f, indent=1)
    print(f"wrote {out}.json")


def plot(results, path, qd, ndisks, where):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["bs"] >> 10 for r in results]
    for k, style in (("swarmfs", "o-"), ("swarmfs-io-wq", "D-"), ("swarmfs-threads", "s--"),
                     ("fio", "^:"), ("fio-force-async", "v:"), ("fio-psync", "x:")):
        if k not in results[0]:
            continue
        ax1.plot(x, [r[k]["iops"] / 1e3 for r in results], style, label=k)
        ax2.plot(x, [r[k]["cpu_us_per_req"] for r in results], style, label=k)
    for ax, yl in ((ax1, "kIOPS"), (ax2, "CPU µs per request (process)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request size (KiB)")
        ax.set_ylabel(yl)
        ax.grid(alpha=.3)
        ax.legend()
    fig.suptitle(f"random O_DIRECT reads, {ndisks} disks ({where}), queue depth {qd} (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


#: Fewest requests per run by default (``--bytes`` / request size is raised to it).
MIN_REQUESTS = 4000


def _min_requests(ctx, param, value):
    """--min-requests against --max-requests (eager, so parsed first): at
    most it; not given, ``MIN_REQUESTS`` or --max-requests if lower."""
    hi = ctx.params.get("max_requests")
    if hi is None:                      # --max-requests itself was refused
        return value
    if value is None:
        return min(MIN_REQUESTS, hi)
    if value > hi:
        raise click.BadParameter(f"{value} is more than --max-requests {hi}")
    return value


def _devices(ctx, param, value):
    """--devices: each a block device or a regular file that exists."""
    for p in value or ():
        try:
            mode = os.stat(p).st_mode
        except OSError as exc:
            raise click.BadParameter(f"{p}: {exc.strerror}") from exc
        if not (stat.S_ISBLK(mode) or stat.S_ISREG(mode)):
            raise click.BadParameter(f"{p} is neither a block device nor a file")
    return value


@click.command(help=__doc__.split("\n\n")[0])
@click.argument("mode", required=False, default="throughput",
                type=click.Choice(["throughput", "isolation"]))
@click.option("--dir", default="/dev/shm/swarmfs-engine-bench" if
              os.path.isdir("/dev/shm") else "bench-out/engine-disks",
              help="where the disk files live (default: tmpfs)")
@click.option("--devices", type=CommaList(), default=None, callback=_devices,
              help="throughput: read these block devices or files (comma-separated, "
                   "their content as it is) instead of --disks files in --dir")
@click.option("--disks", type=DISKS, default=4)
@click.option("--disk-size", type=COUNT, default=256 << 20,
              help="bytes per disk file (at least: a larger existing file is read whole, "
                   "as fio reads it)")
@click.option("--qd", type=QUEUE_DEPTH, default=32, help="queue depth for all contenders")
@click.option("--sizes", type=CommaList(choices=list(SIZES), upper=True), default="4K,128K",
              help="request sizes, e.g. 4K,16K,128K,1M")
@click.option("--bytes", type=COUNT, default=512 << 20, help="bytes read per run")
@click.option("--min-requests", type=COUNT, default=None, callback=_min_requests,
              help=f"fewest requests per run (default {MIN_REQUESTS}, or --max-requests "
                   "if that is lower)")
@click.option("--max-requests", type=COUNT, default=100000, is_eager=True,
              help="most requests per run")
@click.option("--repeats", type=COUNT, default=7)
@click.option("--slow-iops", type=COUNT, default=20,
              help="isolation: read requests/s of the throttled disk")
@click.option("--reads", type=COUNT, default=20000, help="isolation: healthy reads per mode")
@click.option("--seconds", type=POSITIVE, default=3.0,
              help="isolation: at most this long per mode")
@click.option("--out", type=OutPath(prefix=True, suffixes=(".json", ".png")), default=None,
              help="output prefix: writes PREFIX.json (and PREFIX.png); a trailing .json "
                   "or .png is dropped")
def cli(**options):
    a = types.SimpleNamespace(**options)
    if a.out is None:
        a.out = "bench-out/engine" if a.mode == "throughput" else "bench-out/engine-isolation"
    (throughput if a.mode == "throughput" else isolation)(a)


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line, as a program)."""
    return cli.main(args=argv, obj=argv, standalone_mode=argv is None)


if __name__ == "__main__":
    main()
