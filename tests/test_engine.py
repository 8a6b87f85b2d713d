"""Conformance tests of the I/O engine: every test runs on io_uring and threads.

Fault injection only where the fault cannot be produced for real: a failing
``io_uring_enter``/``pread`` is injected with ``strace -e inject`` in a
subprocess, a too small ``RLIMIT_MEMLOCK`` is set with ``resource.setrlimit``
in a subprocess (with ``CAP_IPC_LOCK`` dropped by ``setpriv`` when root, since
that capability exempts a process from the limit), and a slow disk is a real
loop device throttled by blk-throttle (root only).
"""

import contextlib
import errno
import gc
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading

import numpy as np
import pytest

from conftest import run_in_threads, wait_until
from swarmfs import _errors as E
from swarmfs.store._engine import READ, WRITE, Engine, logical_block_size, open_disk
from swarmfs.store._kernels import (
    assign_buckets,
    gather_rows,
    scatter_rows,
    verify_rows,
    xxh3_ranges,
    xxh3_rows,
)


@pytest.fixture(params=["ext4", "mixed"])
def disks(request, tmp_path, rng):
    """Three 1 MiB disk files with random content, opened O_DIRECT: all on
    tmp_path (a file system that reads without blocking), or "mixed": d0 and
    d2 on tmpfs (/dev/shm), which cannot, so an io_uring engine runs their
    requests on its threads beside the ring in the same call."""
    where = [tmp_path] * 3
    if request.param == "mixed":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        shm = pathlib.Path(tempfile.mkdtemp(prefix="swarmfs-test-", dir="/dev/shm"))
        request.addfinalizer(lambda: shutil.rmtree(shm, ignore_errors=True))
        where = [shm, tmp_path, shm]
    paths, data, fds = [], [], []
    for i in range(3):
        p = where[i] / f"d{i}"
        b = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
        p.write_bytes(b.tobytes())
        paths.append(str(p))
        data.append(b)
        fds.append(open_disk(p, write=True))
    yield paths, data, fds
    for fd in fds:
        os.close(fd)


def ring_disks(paths):
    """The disks an io_uring engine reads through its ring: those not on
    tmpfs (the rest run on its threads)."""
    return [i for i, p in enumerate(paths) if not str(p).startswith("/dev/shm/")]


def make_engine(fds, kind, qd=32):
    return Engine(fds, kind=kind, queue_depth=qd, block_sizes=[512] * len(fds),
                  names=[f"d{i}" for i in range(len(fds))])


def random_plan(rng, n, ndisks, disk_bytes=1 << 20, bs=512):
    disk = rng.integers(0, ndisks, size=n).astype(np.int32)
    length = (rng.integers(1, 17, size=n) * bs).astype(np.uint32)
    off = (rng.integers(0, (disk_bytes - 16 * bs) // bs, size=n) * bs).astype(np.uint64)
    dst = np.zeros(n, dtype=np.uint64)
    np.cumsum(length[:-1], out=dst[1:])
    return disk, off, length, dst


def test_engine_reads_exact_bytes(disks, engine_kind, rng):
    _, data, fds = disks
    eng = make_engine(fds, engine_kind)
    assert eng.kind == engine_kind
    disk, off, length, dst = random_plan(rng, 100, 3)
    buf = eng.alloc(int(length.sum()))
    st = eng.execute(READ, disk, off, length, dst, buf)
    assert (st == length.astype(np.int32)).all()
    for i in range(100):
        want = data[disk[i]][off[i]:off[i] + length[i]]
        got = buf.array[dst[i]:dst[i] + length[i]]
        assert (want == got).all()
    s = eng.stats()
    assert s.requests == 100 and s.bytes == int(length.sum()) and s.errors == 0
    assert sum(d.requests for d in s.disks) == 100
    assert [d.bytes for d in s.disks] == [int(length[disk == i].sum()) for i in range(3)]


def test_both_engines_return_the_same_bytes(disks, rng):
    _, _, fds = disks
    disk, off, length, dst = random_plan(rng, 300, 3)
    out = []
    for kind in ("io_uring", "threads"):
        eng = make_engine(fds, kind)
        buf = eng.alloc(int(length.sum()))
        eng.execute(READ, disk, off, length, dst, buf)
        out.append(buf.array[:int(length.sum())].copy())
        eng.close()
    assert (out[0] == out[1]).all()


def test_plan_larger_than_ring(disks, engine_kind, rng):
    paths, data, fds = disks
    eng = make_engine(fds, engine_kind, qd=8)
    disk, off, length, dst = random_plan(rng, 1000, 3)
    buf = eng.alloc(int(length.sum()))
    eng.execute(READ, disk, off, length, dst, buf)
    for i in rng.integers(0, 1000, size=50):
        assert (buf.array[dst[i]:dst[i] + length[i]] ==
                data[disk[i]][off[i]:off[i] + length[i]]).all()
    s = eng.stats()
    assert s.requests == 1000
    if engine_kind == "io_uring":
        # one SQE and one CQE per request (regular files: no short reads)
        assert s.sqes == s.cqes == 1000 and s.retries == 0
        # requests to tmpfs disks ran on the engine's threads (one batch)
        nring = int(np.isin(disk, ring_disks(paths)).sum())
        assert s.thread_requests == 1000 - nring
        enters = s.submit_calls - (nring < 1000)
        # never more SQEs in flight than the ring (8): at least n / 8 enters;
        # while more is queued each enter waits for inflight / 4 = 2 CQEs and
        # refills, so at most one enter per 2 requests (plus the last one):
        # an engine that submitted one SQE per enter would make n
        assert -(-nring // 8) <= enters <= nring // 2 + 1


def test_one_submission_when_plan_fits(disks):
    paths, _, fds = disks
    eng = make_engine(fds, "io_uring", qd=64)
    n = 64
    buf = eng.alloc(n * 4096)
    disk = np.arange(n) % 3
    eng.execute(READ, disk, np.arange(n) * 4096, [4096] * n, np.arange(n) * 4096, buf)
    s = eng.stats()
    nring = int(np.isin(disk, ring_disks(paths)).sum())
    # one enter for the ring's share, one thread batch for the tmpfs disks'
    assert s.submit_calls == 1 + (nring < n) and s.sqes == n and s.cqes == n
    assert s.registered_files and s.thread_requests == n - nring
    assert s.fixed_requests == nring  # engine-allocated buffers are registered


def test_writes_round_trip(disks, engine_kind, rng):
    paths, _, fds = disks
    eng = make_engine(fds, engine_kind)
    n = 40
    disk = (np.arange(n) % 3).astype(np.int32)
    off = (np.arange(n) // 3 * 8192).astype(np.uint64)
    length = np.full(n, 8192, dtype=np.uint32)
    dst = np.arange(n, dtype=np.uint64) * 8192
    buf = eng.alloc(n * 8192)
    buf.array[:n * 8192] = rng.integers(0, 256, size=n * 8192, dtype=np.uint8)
    eng.execute(WRITE, disk, off, length, dst, buf)
    for fd in fds:
        os.fsync(fd)
    for i in range(n):
        with open(paths[disk[i]], "rb") as f:
            f.seek(int(off[i]))
            assert f.read(8192) == buf.array[dst[i]:dst[i] + 8192].tobytes()


def test_misaligned_request_names_the_disk(disks, engine_kind):
    _, _, fds = disks
    eng = make_engine(fds, engine_kind)
    buf = eng.alloc(1 << 16)
    with pytest.raises(E.MisalignedRequestError) as ei:
        eng.execute(READ, [0, 2], [0, 100], [512, 512], [0, 512], buf)
    assert ei.value.disk == 2 and "d2" in str(ei.value)
    with pytest.raises(E.MisalignedRequestError):
        eng.execute(READ, [1], [0], [700], [0], buf)
    with pytest.raises(E.OutOfRangeError):
        eng.execute(READ, [3], [0], [512], [0], buf)
    for disk in ([2**32 + 1], [-1], [1.0]):     # 2**32 + 1 narrowed to int32 was disk 1
        with pytest.raises(E.OutOfRangeError):
            eng.execute(READ, np.array(disk), [0], [512], [0], buf, check=False)
    assert eng.stats().requests == 0  # nothing was submitted


def test_kernel_rejection_is_reported_per_request(disks, engine_kind):
    """Unchecked misaligned I/O reaches the kernel, which fails it with EINVAL."""
    _, _, fds = disks
    eng = make_engine(fds, engine_kind)
    buf = eng.alloc(1 << 16)
    with pytest.raises(E.MisalignedRequestError) as ei:
        eng.execute(READ, [0, 1], [0, 100], [512, 512], [0, 512], buf, check=False)
    assert ei.value.disk == 1
    assert eng.stats().errors == 1


@pytest.mark.parametrize("where", ["ext4", "tmpfs"])
def test_short_read_at_eof_is_resubmitted_then_truncation(tmp_path, engine_kind, where):
    """A disk shorter than the read: the rest is resubmitted, then the
    truncation is reported naming the disk; on tmpfs (no non-blocking reads)
    an io_uring engine runs the request on its threads, with the same rule."""
    d = tmp_path
    if where == "tmpfs":
        d = pathlib.Path(tempfile.mkdtemp(prefix="swarmfs-test-", dir="/dev/shm"))
    p = d / "short"
    p.write_bytes(b"x" * (4096 + 512))
    fd = open_disk(p)
    try:
        eng = make_engine([fd], engine_kind)
        buf = eng.alloc(8192)
        with pytest.raises(E.DiskTruncatedError) as ei:
            eng.execute(READ, [0], [0], [8192], [0], buf)
        assert ei.value.disk == 0
        assert buf.array[:4608].tobytes() == b"x" * 4608
        s = eng.stats()
        assert s.short_resubmits >= 1 and s.errors == 1
        assert s.thread_requests == (where == "tmpfs" and engine_kind == "io_uring")
    finally:
        os.close(fd)
        if d != tmp_path:
            shutil.rmtree(d, ignore_errors=True)


def test_missing_and_bad_disk_paths(tmp_path):
    with pytest.raises(E.DiskMissingError):
        open_disk(tmp_path / "nope", disk=3)
    with pytest.raises(E.DiskError):
        open_disk(tmp_path, disk=0)  # a directory


def test_block_size_detection(disks):
    _, _, fds = disks
    assert logical_block_size(fds[0]) in (512, 4096)


def test_empty_plan(disks, engine_kind):
    _, _, fds = disks
    eng = make_engine(fds, engine_kind)
    st = eng.execute(READ, [], [], [], [], eng.alloc(4096))
    assert st.shape == (0,)


def test_execute_refuses_a_missing_or_bad_request_struct(disks, engine_kind):
    """se_execute takes its requests as one se_requests struct: a NULL struct,
    a bad op or a negative count is -EINVAL before any I/O, and n = 0 is an
    empty call (as the Python wrapper's empty plan)."""
    from swarmfs._native import ffi, lib
    _, _, fds = disks
    eng = make_engine(fds, engine_kind)
    status = np.zeros(1, np.int32)
    st = ffi.from_buffer("int32_t[]", status, require_writable=True)
    with eng._call() as ptr:
        assert lib.se_execute(ptr, ffi.NULL, st, ffi.NULL) == -errno.EINVAL
        for bad in ({"op": 7, "n": 1}, {"op": READ, "n": -1}, {"op": READ, "n": 1}):
            assert lib.se_execute(ptr, ffi.new("se_requests *", bad), st,
                                  ffi.NULL) == -errno.EINVAL, bad      # (the last: NULL arrays)
        assert lib.se_execute(ptr, ffi.new("se_requests *", {"op": READ, "n": 0}), st,
                              ffi.NULL) == 0
    assert eng.stats().executes == 0
    eng.close()


def test_data_kernels_match_python(rng):
    import xxhash
    src = rng.integers(0, 256, size=10000, dtype=np.uint8)
    off = rng.integers(0, 10000 - 48, size=30).astype(np.uint64)
    rows = gather_rows(src, off, 48)
    for i in range(30):
        assert rows[i].tobytes() == src[off[i]:off[i] + 48].tobytes()
    dst = np.zeros(30 * 64, dtype=np.uint8)
    scatter_rows(dst, np.arange(30, dtype=np.uint64) * 64, rows, np.arange(30)[::-1], 48)
    assert dst[:48].tobytes() == rows[29].tobytes()
    h = xxh3_rows(rows, 48)
    assert [int(x) for x in h] == [xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows]
    hr = xxh3_ranges(src, off, np.full(30, 48, dtype=np.uint64))
    assert (hr == h).all()
    bad = h.copy()
    bad[[3, 7]] ^= np.uint64(1)
    assert list(verify_rows(src, off, 48, bad)) == [3, 7]


def test_assign_buckets_greedy():
    # 4 entries, entry i may go to disks listed; loads start at zero
    ptr = np.array([0, 1, 2, 4, 6])
    cdisk = np.array([0, 0, 0, 1, 1, 0])
    choice, load = assign_buckets(ptr, cdisk, 2)
    assert list(choice) == [0, 1, 3, 4]
    assert list(load) == [2, 2]


@pytest.mark.parametrize("err", ["ENOSYS", "EPERM"])
def test_fallback_when_io_uring_is_unavailable(disks, monkeypatch, err, rng):
    """Fault injection: io_uring setup fails as with the io_uring_disabled sysctl
    (EPERM) or an old kernel/seccomp (ENOSYS); the thread engine takes over with
    a one-line warning and reads the same bytes."""
    import errno

    import swarmfs.store._engine as eng_mod
    _, data, fds = disks
    code = getattr(errno, err)
    monkeypatch.setattr(eng_mod, "_uring_open", lambda *a: -code)
    monkeypatch.setattr(eng_mod, "_warned", set())
    with pytest.warns(RuntimeWarning, match="io_uring unavailable"):
        eng = Engine(fds, kind="auto", queue_depth=8)
    assert eng.kind == "threads" and eng.stats().engine == "threads"
    assert eng.fallback_reason
    buf = eng.alloc(8192)
    eng.execute(READ, [1, 2], [4096, 0], [4096, 4096], [0, 4096], buf)
    assert buf.array[:4096].tobytes() == data[1][4096:8192].tobytes()
    with pytest.raises(E.IOFailedError):
        Engine(fds, kind="io_uring")   # asked for explicitly: no silent fallback


# -- concurrency: one ring per thread, no lock across I/O --------------------

def uring_fds() -> int:
    """io_uring instances open in this process (ring file descriptors), after
    collecting engines that earlier tests left to the garbage collector."""
    gc.collect()
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[io_uring]"
    return n


def test_threads_read_concurrently_through_one_engine(disks, engine_kind):
    """Stress: six threads, each with its own buffer, read random plans through
    one engine at once; every byte is right, stats() is readable throughout,
    and each thread's ring is torn down when the thread exits (no leaked ring)."""
    _, data, fds = disks
    before = uring_fds()
    eng = make_engine(fds, engine_kind)
    nthreads, iters, nreq = 6, 25, 40
    failures, snapshots = [], []

    def work(seed):
        r = np.random.default_rng(seed)
        buf = eng.alloc(nreq * 16 * 512)
        for _ in range(iters):
            disk, off, length, dst = random_plan(r, nreq, 3)
            eng.execute(READ, disk, off, length, dst, buf)
            for i in range(nreq):
                if not np.array_equal(buf.array[dst[i]:dst[i] + length[i]],
                                      data[disk[i]][off[i]:off[i] + length[i]]):
                    failures.append((seed, i))

    failures += run_in_threads(work, nthreads, poll=lambda: snapshots.append(eng.stats()))
    assert failures == []
    s = eng.stats()
    assert s.requests == nthreads * iters * nreq and s.errors == 0 and s.in_flight == 0
    assert all(a.requests <= b.requests for a, b in zip(snapshots, snapshots[1:], strict=False))
    if engine_kind == "io_uring":
        # every thread's ring registered its buffer (tmpfs disks' requests ran on threads)
        assert s.fixed_requests == s.requests - s.thread_requests
        assert set(s.ring_flags) >= {"SINGLE_ISSUER"}
        # the opener's ring stays; the workers' rings went with their threads
        wait_until(lambda: eng.stats().rings == 1, what="one ring left")
        assert uring_fds() == before + 1
    eng.close()
    assert uring_fds() == before


def _kernel_at_least(major, minor):
    rel = os.uname().release.split("-")[0].split(".")
    return (int(rel[0]), int(rel[1])) >= (major, minor)


@pytest.mark.skipif(not _kernel_at_least(6, 1), reason="IORING_SETUP_DEFER_TASKRUN is Linux 6.1+")
def test_rings_defer_task_work_where_the_kernel_can(disks):
    """Linux 6.1+: every ring is set up with DEFER_TASKRUN (completions are run
    by the ring's thread when it waits), and a plan larger than the ring, read
    by the opener and by another thread, completes."""
    _, data, fds = disks
    eng = make_engine(fds, "io_uring", qd=8)
    assert {"SINGLE_ISSUER", "DEFER_TASKRUN", "COOP_TASKRUN"} <= set(eng.ring_flags)
    n = 200
    disk = (np.arange(n) % 3).astype(np.int32)
    off = (np.arange(n) * 4096 % (1 << 20)).astype(np.uint64)
    dst = np.arange(n, dtype=np.uint64) * 4096

    def read():
        buf = eng.alloc(n * 4096)
        eng.execute(READ, disk, off, [4096] * n, dst, buf)
        for i in range(n):
            assert (buf.array[dst[i]:dst[i] + 4096] == data[disk[i]][off[i]:off[i] + 4096]).all()
        buf.release()

    read()
    errors = []

    def read_in_a_thread():
        try:
            read()
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    t = threading.Thread(target=read_in_a_thread)
    t.start()
    t.join()
    assert errors == []
    s = eng.stats()
    assert s.requests == 2 * n and s.errors == 0 and s.gave_up == 0
    eng.close()


@pytest.fixture
def tmpfs_disks(rng):
    """Two 1 MiB files on tmpfs (/dev/shm), opened O_DIRECT for writing: files
    that cannot be read or written without blocking, so every request of
    theirs is punted to io-wq (IOSQE_ASYNC)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(prefix="swarmfs-test-", dir="/dev/shm")
    fds, data = [], []
    try:
        for i in range(2):
            p = os.path.join(d, f"d{i}")
            b = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
            with open(p, "wb") as f:
                f.write(b.tobytes())
            try:
                fds.append(open_disk(p, write=True))
            except E.SwarmError as exc:
                pytest.skip(f"no O_DIRECT on /dev/shm: {exc}")
            data.append(b)
        yield fds, data
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(d)


def test_blocking_disks_run_on_threads_or_io_wq_with_the_same_bytes(tmpfs_disks, disks, rng):
    """An io_uring engine over tmpfs disks (no non-blocking reads) and ext4
    disks: with blocking="threads" (default) the tmpfs disks' requests run on
    the engine's threads and the rest on the ring, in one call; with
    blocking="io_uring" all go through the ring (IOSQE_ASYNC).  Both read the
    same, right bytes, and the per-disk counters add up."""
    tfds, tdata = tmpfs_disks
    paths, data, fds = disks
    allfds, alldata = list(tfds) + list(fds), list(tdata) + list(data)
    nblocking = 2 + 3 - len(ring_disks(paths))
    disk, off, length, dst = random_plan(rng, 700, 5)
    out = {}
    for blocking in ("threads", "io_uring"):
        eng = Engine(allfds, kind="io_uring", queue_depth=16, block_sizes=[512] * 5,
                     blocking=blocking)
        buf = eng.alloc(int(length.sum()))
        eng.execute(READ, disk, off, length, dst, buf)
        out[blocking] = buf.array[:int(length.sum())].copy()
        s = eng.stats()
        assert s.blocking_disks == nblocking and s.requests == 700 and s.errors == 0
        on_threads = int(np.isin(disk, [0, 1] + [2 + i for i in range(3)
                                                 if i not in ring_disks(paths)]).sum())
        assert s.thread_requests == (on_threads if blocking == "threads" else 0)
        assert [d.requests for d in s.disks] == np.bincount(disk, minlength=5).tolist()
        assert sum(d.bytes for d in s.disks) == s.bytes == int(length.sum())
        eng.close()
    assert np.array_equal(out["threads"], out["io_uring"])
    for i in range(700):
        assert np.array_equal(out["threads"][dst[i]:dst[i] + length[i]],
                              alldata[disk[i]][off[i]:off[i] + length[i]])


def test_blocking_mode_is_checked(disks):
    with pytest.raises(E.InvalidChoiceError, match="blocking"):
        Engine(disks[2], kind="io_uring", blocking="io-wq")


@pytest.mark.parametrize("blocking", ["threads", "io_uring"])
def test_punted_direct_writes_from_many_threads_all_complete(tmpfs_disks, engine_kind,
                                                             blocking):
    """The shape of the one hang seen with DEFER_TASKRUN: small plans of
    O_DIRECT writes punted to io-wq.  Eight threads, each with its own ring,
    write three blocks to the same two tmpfs files (io-wq serialises writes to
    one file) and read them back, 40 times each; every call completes with the
    right bytes and nothing fails or is abandoned."""
    fds, _ = tmpfs_disks
    eng = Engine(fds, kind=engine_kind, queue_depth=32, block_sizes=[512] * 2,
                 blocking=blocking)
    if engine_kind == "io_uring":
        assert eng.stats().blocking_disks == 2
    nthreads, iters = 8, 40
    failures = []

    def work(k):
        r = np.random.default_rng(k)
        wbuf, rbuf = eng.alloc(3 * 4096), eng.alloc(3 * 4096)
        for it in range(iters):
            # blocks 2k or 2k + 1 (+ 16, + 32): no other thread writes them
            disk = np.array([0, 1, it % 2], dtype=np.int32)
            blk = (np.array([0, 1, 2]) * nthreads * 2 + k * 2 + it % 2) % 256
            off = (blk * 4096).astype(np.uint64)
            dst = np.arange(3, dtype=np.uint64) * 4096
            wbuf.array[:3 * 4096] = r.integers(0, 256, 3 * 4096, dtype=np.uint8)
            eng.execute(WRITE, disk, off, [4096] * 3, dst, wbuf)
            eng.execute(READ, disk, off, [4096] * 3, dst, rbuf)
            if not np.array_equal(rbuf.array[:3 * 4096], wbuf.array[:3 * 4096]):
                failures.append((k, it))

    failures += run_in_threads(work, nthreads)
    assert failures == []
    s = eng.stats()
    assert s.requests == nthreads * iters * 6 and s.errors == 0
    assert s.gave_up == 0 and s.in_flight == 0
    eng.close()


def test_a_wait_of_more_than_a_second_is_counted_and_completes():
    """A disk that answers after 1.5 s (a pipe whose data is written then)
    keeps the reader in waits of at most a second each: the read completes
    with the data, and stats() counts the long wait."""
    r, w = os.pipe()
    try:
        eng = Engine([r], kind="io_uring", queue_depth=8, block_sizes=[512])
        buf = eng.alloc(4096)
        t = threading.Timer(1.5, os.write, args=(w, b"s" * 4096))
        t.start()
        eng.execute(READ, [0], [0], [4096], [0], buf)
        t.join()
        assert bytes(buf.array[:4096]) == b"s" * 4096
        s = eng.stats()
        assert s.long_waits >= 1 and s.errors == 0 and s.gave_up == 0
        eng.close()
    finally:
        os.close(r)
        os.close(w)


def test_close_waits_for_calls_in_flight_and_later_calls_raise(disks, engine_kind):
    """close() from one thread while others keep reading: every read either
    completes with the right bytes or raises SwarmError("closed"); none crashes
    or returns garbage, and no ring is left behind."""
    _, data, fds = disks
    before = uring_fds()
    eng = make_engine(fds, engine_kind)
    go = threading.Event()
    outcome = {"ok": 0, "closed": 0, "other": []}
    lock = threading.Lock()

    def work(seed):
        r = np.random.default_rng(seed)
        try:
            buf = eng.alloc(64 * 8192)
        except E.SwarmError:
            with lock:
                outcome["closed"] += 1
            return
        go.set()
        while True:
            disk, off, length, dst = random_plan(r, 64, 3)
            try:
                eng.execute(READ, disk, off, length, dst, buf)
            except E.SwarmError as exc:
                with lock:
                    if "closed" in str(exc):
                        outcome["closed"] += 1
                    else:
                        outcome["other"].append(repr(exc))
                return
            good = all(np.array_equal(buf.array[dst[i]:dst[i] + length[i]],
                                      data[disk[i]][off[i]:off[i] + length[i]])
                       for i in range(64))
            with lock:
                if good:
                    outcome["ok"] += 1
                else:
                    outcome["other"].append("wrong bytes")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    go.wait(10)
    wait_until(lambda: outcome["ok"] >= 8, what="8 reads done")
    eng.close()
    assert eng._ptr is None
    for t in threads:
        t.join(20)
    assert outcome["other"] == [] and outcome["closed"] == 4
    with pytest.raises(E.SwarmError, match="closed"):
        eng.stats()
    eng.close()                                   # idempotent
    wait_until(lambda: uring_fds() == before, what="the rings' fds closed")


def _testbed():
    from tools import _testbed
    return _testbed


def _no_throttle_reason():
    if os.geteuid() != 0:
        return "needs root (loop devices and cgroups)"
    if shutil.which("losetup") is None or not os.path.exists("/dev/loop-control"):
        return "needs losetup and loop devices"
    try:
        _testbed().cgroup_backend()
    except Exception as exc:
        return str(exc)
    return None


SLOW_CHILD = textwrap.dedent(r"""
    import json, os, sys, threading, time
    import numpy as np
    from swarmfs import _errors as E
    from swarmfs.store._engine import READ, Engine, open_disk
    slow_dev, fast_path, kind, cgroup = sys.argv[1:5]
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:   # throttled from now on
        f.write(str(os.getpid()))
    fds = [open_disk(fast_path), open_disk(slow_dev)]
    eng = Engine(fds, kind=kind, queue_depth=32, block_sizes=[512, 512])
    fast, slow = eng.alloc(1 << 16), eng.alloc(1 << 16)
    want_fast = open(fast_path, "rb").read(1 << 16)
    want_slow = open(slow_dev, "rb").read(1 << 16)       # page cache: not throttled
    out = {"slow_done": False}
    NSLOW = 16

    def slow_reader():
        eng.execute(READ, [1] * NSLOW, np.arange(NSLOW) * 4096, [4096] * NSLOW,
                    np.arange(NSLOW) * 4096, slow)
        out["slow_ok"] = bytes(slow.array[:NSLOW * 4096]) == want_slow[:NSLOW * 4096]
        out["slow_done"] = True

    th = threading.Thread(target=slow_reader)
    th.start()
    deadline = time.monotonic() + 10
    while eng.stats().in_flight < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    out["in_flight_seen"] = eng.stats().in_flight          # stats() does not wait
    n = bad = 0
    while th.is_alive() and n < 200:
        eng.execute(READ, [0] * 16, np.arange(16) * 4096, [4096] * 16,
                    np.arange(16) * 4096, fast)
        bad += bytes(fast.array) != want_fast
        n += 1
    out["fast_reads"] = n
    out["fast_bad"] = bad
    out["slow_in_flight_after_fast_reads"] = th.is_alive() and not out["slow_done"]
    # close while the slow read is in flight: close waits, later calls raise
    closer_done = {}

    def closer():
        eng.close()
        closer_done["slow_done_at_close"] = out["slow_done"]

    ct = threading.Thread(target=closer)
    ct.start()
    while not eng._closing:
        time.sleep(0.001)
    try:
        eng.execute(READ, [0], [0], [4096], [0], fast)
        out["call_during_close"] = "returned"
    except E.SwarmError as exc:
        out["call_during_close"] = str(exc)
    out["slow_alive_during_close"] = th.is_alive()
    ct.join()
    th.join()
    out.update(closer_done)
    print(json.dumps(out))
""")


@pytest.mark.root
@pytest.mark.skipif(_no_throttle_reason() is not None, reason=str(_no_throttle_reason()))
def test_reader_of_healthy_disk_does_not_wait_for_a_throttled_disk(tmp_path, engine_kind, rng):
    """Issue 10 item 4: one thread reads a loop device throttled to 4 requests/s
    (blk-throttle), another reads a healthy disk through the same engine.  The
    healthy reader completes 200 reads while the slow read is still in flight
    (with one lock around the I/O it completed none), stats() answers while the
    slow read is in flight, and close() waits for the slow read to finish while
    a call that starts during close raises SwarmError."""
    T = _testbed()
    name = f"swarmfs-engine-pytest-{os.getpid()}-{engine_kind}"
    backing = str(tmp_path / "backing")
    fast = tmp_path / "fast.bin"
    fast.write_bytes(rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    try:
        state = T.up(1, "16M", backing, limits=T.Limits(read_iops=4), name=name)
        dev = state["devices"][0]
        fd = os.open(dev, os.O_WRONLY)
        try:
            os.pwrite(fd, rng.integers(0, 256, 1 << 16, dtype=np.uint8).tobytes(), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        res = subprocess.run([sys.executable, "-c", SLOW_CHILD, dev, str(fast), engine_kind,
                              state["cgroup"]["path"]],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        T.down(name, backing)
    assert out["in_flight_seen"] >= 1
    assert out["fast_reads"] == 200 and out["fast_bad"] == 0
    assert out["slow_in_flight_after_fast_reads"]
    assert "closed" in out["call_during_close"] and out["slow_alive_during_close"]
    assert out["slow_done_at_close"] and out["slow_ok"]


# -- bounded retries (fault injection with strace) ----------------------------

def _strace_reason():
    if shutil.which("strace") is None:
        return "needs strace"
    res = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=getppid",
                          "-e", "inject=getppid:error=EAGAIN", "true"],
                         capture_output=True, text=True)
    return None if res.returncode == 0 else f"strace cannot inject: {res.stderr.strip()}"


RETRY_CHILD = textwrap.dedent(r"""
    import json, os, sys
    import numpy as np
    from swarmfs import _errors as E
    from swarmfs.store._engine import READ, Engine, open_disk
    path, kind, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    fd = open_disk(path)
    eng = Engine([fd], kind=kind, queue_depth=8, names=[path], retry_limit=limit)
    buf = eng.alloc(1 << 16)
    want = open(path, "rb").read(1 << 16)
    out = []
    for attempt in range(2):
        try:
            eng.execute(READ, [0] * 4, np.arange(4) * 4096, [4096] * 4,
                        np.arange(4) * 4096, buf)
            out.append({"ok": bytes(buf.array[:16384]) == want[:16384]})
        except E.IOFailedError as exc:
            out.append({"error": str(exc), "errno": exc.errno, "disk": exc.disk})
    s = eng.stats()
    print(json.dumps({"results": out, "enter_errors": s.enter_errors,
                      "retries": s.retries, "gave_up": s.gave_up, "rings": s.rings}))
""")


def run_injected(path, kind, syscall, err, when, limit, only_path=False):
    # only_path: inject only into calls on the disk file (-P), not the loader's
    res = subprocess.run(
        ["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={syscall}",
         "-e", f"inject={syscall}:error={err}:when={when}"]
        + (["-P", str(path)] if only_path else []) + [
         sys.executable, "-c", RETRY_CHILD, str(path), kind, str(limit)],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_strace_reason() is not None, reason=str(_strace_reason()))
@pytest.mark.parametrize("err", ["EAGAIN", "EINTR", "EIO"])
def test_failing_io_uring_enter_gives_up_and_names_the_disk(tmp_path, err, rng):
    """Issue 9 item 9: io_uring_enter fails (injected) 25 times in a row with a
    retry limit of 20: the first read retries 20 times, then raises
    IOFailedError naming the disk and the error; the broken ring is replaced
    and the second read (5 more failures, then success) returns the right
    bytes.  Every failed enter is counted."""
    p = tmp_path / "d0"
    p.write_bytes(rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    out = run_injected(p, "io_uring", "io_uring_enter", err, "1..25", 20)
    first, second = out["results"]
    assert "io_uring_enter failed 21 times" in first["error"]
    assert os.strerror(getattr(errno, err)) in first["error"]
    assert first["disk"] == 0 and str(p) in first["error"]
    assert first["errno"] == getattr(errno, err)
    assert second == {"ok": True}
    assert out["enter_errors"] == 25 and out["retries"] >= 25
    assert out["gave_up"] == 1 and out["rings"] == 1


@pytest.mark.skipif(_strace_reason() is not None, reason=str(_strace_reason()))
@pytest.mark.parametrize("kind", ["threads", "io_uring"])
def test_pread_that_always_says_eagain_gives_up(tmp_path, rng, kind):
    """Issue 9 item 9, threads engine, and an io_uring engine's requests to a
    tmpfs disk (run on its threads): every pread fails with EAGAIN
    (injected): the read fails with IOFailedError after the retry limit
    instead of spinning for ever, counted once per call."""
    d = tmp_path
    if kind == "io_uring":
        d = pathlib.Path(tempfile.mkdtemp(prefix="swarmfs-test-", dir="/dev/shm"))
    p = d / "d0"
    p.write_bytes(rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    try:
        out = run_injected(p, kind, "pread64", "EAGAIN", "1+", 30, only_path=True)
    finally:
        if d != tmp_path:
            shutil.rmtree(d, ignore_errors=True)
    for r in out["results"]:
        assert "gave up after 30 retries" in r["error"] and r["disk"] == 0
        assert r["errno"] == errno.EAGAIN and str(p) in r["error"]
    assert out["gave_up"] == 2 and out["retries"] >= 2 * 4 * 30


MIXED_CHILD = textwrap.dedent(r"""
    import json, os, subprocess, sys, time
    import numpy as np
    from swarmfs import _errors as E
    from swarmfs.store._engine import READ, Engine, open_disk
    shm, ext, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    eng = Engine([open_disk(shm), open_disk(ext)], kind="io_uring", queue_depth=32,
                 block_sizes=[512, 512], names=["shm", "ext4"], retry_limit=limit)
    buf = eng.alloc(64 << 20)
    # inject faults from here on only (not into the loader's preads): strace
    # attaches to this process, and the call waits until it has
    tracer = subprocess.Popen(["strace", "-f", "-qq", "-o", "/dev/null",
                               "-e", "trace=io_uring_enter,pread64", *sys.argv[4:],
                               "-p", str(os.getpid())])
    def traced():
        with open("/proc/self/status") as f:
            return any(l.startswith("TracerPid:") and l.split()[1] != "0" for l in f)
    t0 = time.monotonic()
    while not traced() and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    disk = np.array([0] * 1000 + [1] * 4, np.int32)        # 1000 on threads, 4 on the ring
    n = len(disk)
    off = (np.arange(n) % 16 * 65536).astype(np.uint64)
    try:
        eng.execute(READ, disk, off, [65536] * n, np.arange(n, dtype=np.uint64) * 65536, buf)
        res = {"ok": True}
    except E.SwarmError as exc:
        res = {"error": str(exc), "disk": exc.disk}
    tracer.terminate()
    tracer.wait()
    s = eng.stats()
    print(json.dumps({"res": res, "n": n, "requests": s.requests, "errors": s.errors,
                      "disk_requests": [d.requests for d in s.disks], "gave_up": s.gave_up,
                      "thread_requests": s.thread_requests, "in_flight": s.in_flight}))
""")


def _run_mixed_child(tmp_path, rng, inject, limit):
    shm = pathlib.Path(tempfile.mkdtemp(prefix="swarmfs-test-", dir="/dev/shm"))
    try:
        for p in (shm / "d0", tmp_path / "d1"):
            p.write_bytes(rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
        res = subprocess.run(
            [sys.executable, "-c", MIXED_CHILD, str(shm / "d0"), str(tmp_path / "d1"),
             str(limit), *inject], capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_strace_reason() is not None, reason=str(_strace_reason()))
def test_ring_share_giving_up_leaves_the_thread_share_alone(tmp_path, rng):
    """A mixed call (4 reads on an ext4 disk's ring, 1000 on a tmpfs disk's
    threads, preads slowed down) whose io_uring_enter fails: the ring's share
    fails and names the ext4 disk; the threads' requests, still running, are
    neither failed nor counted twice (each request counted once, per disk
    too)."""
    out = _run_mixed_child(tmp_path, rng, ["-e", "inject=io_uring_enter:error=EBADF:when=1",
                                           "-e", "inject=pread64:delay_exit=2000"], 0)
    assert out["res"]["disk"] == 1 and "ext4" in out["res"]["error"]
    assert out["requests"] == out["n"] == sum(out["disk_requests"]) == 1004
    assert out["disk_requests"] == [1000, 4] and out["errors"] == 4
    assert out["thread_requests"] == 1000 and out["in_flight"] == 0


@pytest.mark.skipif(_strace_reason() is not None, reason=str(_strace_reason()))
def test_both_shares_giving_up_name_what_failed_on_the_disk_named(tmp_path, rng):
    """io_uring_enter and pread both always fail with EAGAIN: the call gives
    up once; the error names the first failed request's disk (the tmpfs one,
    whose requests ran with pread) with pread's error, not io_uring_enter's."""
    out = _run_mixed_child(tmp_path, rng, ["-e", "inject=io_uring_enter:error=EAGAIN",
                                           "-e", "inject=pread64:error=EAGAIN"], 3)
    err = out["res"]
    assert err["disk"] == 0 and "io_uring_enter" not in err["error"]
    assert "gave up after 3 retries" in err["error"]
    assert out["requests"] == 1004 and out["errors"] == 1004 and out["gave_up"] == 1
    assert sum(out["disk_requests"]) == 1004


@pytest.mark.parametrize("blocking", ["threads", "io_uring"])
def test_closing_the_callers_fd_does_not_change_what_the_engine_reads(tmpfs_disks, blocking,
                                                                      tmp_path):
    """The engine reads through its own duplicates of the fds: the caller
    closing its fd, and the number going to another file, changes nothing
    (on the ring's registered files and on the threads' pread alike)."""
    fds, data = tmpfs_disks
    mine = [os.dup(fd) for fd in fds]
    eng = Engine(mine, kind="io_uring", queue_depth=8, block_sizes=[512] * 2,
                 blocking=blocking)
    os.close(mine[1])
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    os.write(other, b"Z" * 8192)
    if other != mine[1]:
        os.dup2(other, mine[1])            # the closed number now names another file
        os.close(other)
    try:
        buf = eng.alloc(8192)
        eng.execute(READ, [1, 0], [0, 4096], [4096, 4096], [0, 4096], buf)
        assert buf.array[:4096].tobytes() == data[1][:4096].tobytes()
        assert buf.array[4096:8192].tobytes() == data[0][4096:8192].tobytes()
    finally:
        eng.close()
        os.close(mine[1])
        os.close(mine[0])


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_request_outside_the_buffer_is_refused_before_any_io(disks, engine_kind, op):
    """Even with check=False: a plan whose second request ends past the
    buffer raises OutOfRangeError naming its disk, and the first request,
    valid, was not run (a write leaves the disk as it was)."""
    paths, data, fds = disks
    eng = make_engine(fds, engine_kind)
    buf = eng.alloc(8192)
    buf.array[:] = 7
    code = READ if op == "read" else WRITE
    for dst in (buf.size - 512, buf.size, 2**63, 2**64 - 512):
        with pytest.raises(E.OutOfRangeError, match="does not fit") as ei:
            eng.execute(code, [0, 2], [0, 0], [4096, 4096], [0, dst], buf, check=False)
        assert ei.value.disk == 2
    with pytest.raises(E.OutOfRangeError):
        eng.execute(code, [0], [0], [16384], [0], buf, check=False)
    assert eng.stats().requests == 0
    with open(paths[0], "rb") as f:
        assert f.read(4096) == data[0][:4096].tobytes()
    assert (buf.array == 7).all()


@pytest.mark.parametrize("buf", [np.zeros(8192, np.uint8), bytearray(8192), None])
def test_a_buffer_not_from_alloc_is_refused(disks, buf):
    eng = make_engine(disks[2], "io_uring")
    with pytest.raises(E.InvalidArgumentError, match="Engine.alloc"):
        eng.execute(READ, [0], [0], [4096], [0], buf)


def test_an_engine_in_a_fork_child_refuses_every_use(disks):
    eng = make_engine(disks[2], "io_uring")
    eng.stats()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child
        refused = []
        for call in (lambda: eng.alloc(4096), eng.stats,
                     lambda: eng.execute(READ, [0], [0], [4096], [0], None)):
            try:
                call()
            except E.SwarmError as exc:
                refused.append("another process" in str(exc))
        os.write(w, json.dumps(refused).encode())
        os._exit(0)
    os.close(w)
    _, st = os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        assert json.loads(f.read()) == [True, True, True]
    assert eng.stats().requests == 0


# -- locked memory (RLIMIT_MEMLOCK) ------------------------------------------

def _has_cap_ipc_lock() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 14 & 1)
    return False


def _memlock_prefix():
    """Run a child where RLIMIT_MEMLOCK applies (drop CAP_IPC_LOCK if held)."""
    if not _has_cap_ipc_lock():
        return []
    if shutil.which("setpriv") is None:
        return None
    return ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]


MEMLOCK_CHILD = textwrap.dedent(r"""
    import json, resource, sys, threading, warnings
    import numpy as np
    from swarmfs import _errors as E
    from swarmfs.store._engine import READ, Engine, open_disk
    path, kind, qd, limit, later = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        int(sys.argv[4]), int(sys.argv[5])
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
    fd = open_disk(path)
    want = open(path, "rb").read(1 << 20)
    out = {}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            eng = Engine([fd], kind=kind, queue_depth=qd)
        except E.IOFailedError as exc:
            print(json.dumps({"open_error": str(exc), "errno": exc.errno}))
            sys.exit(0)
        buf = eng.alloc(1 << 20)
        if later >= 0:       # lower the limit after open: a new thread's ring fails
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (later, later))
        def read():
            eng.execute(READ, [0] * 64, np.arange(64) * 16384, [16384] * 64,
                        np.arange(64) * 16384, buf)
            out["ok"] = bytes(buf.array[:1 << 20]) == want
        t = threading.Thread(target=read)
        t.start()
        t.join()
    s = eng.stats()
    out.update(kind=eng.kind, qd=eng.queue_depth, warnings=[str(x.message) for x in w],
               buffers_registered=s.buffers_registered, buffer_error=s.buffer_error,
               fixed=s.fixed_requests, fallback=s.fallback_executes, memlock=s.memlock_limit)
    print(json.dumps(out))
""")


def run_memlock(path, kind, qd, limit, later=-1):
    prefix = _memlock_prefix()
    res = subprocess.run(prefix + [sys.executable, "-c", MEMLOCK_CHILD, str(path), kind,
                                   str(qd), str(limit), str(later)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


needs_memlock = pytest.mark.skipif(_memlock_prefix() is None,
                                   reason="needs setpriv to drop CAP_IPC_LOCK")


@pytest.fixture
def disk_file(tmp_path, rng):
    p = tmp_path / "d0"
    p.write_bytes(rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    return p


@needs_memlock
def test_memlock_zero_falls_back_to_threads_and_says_why(disk_file):
    out = run_memlock(disk_file, "auto", 128, 0)
    assert out["kind"] == "threads" and out["ok"]
    assert len(out["warnings"]) == 1
    assert "RLIMIT_MEMLOCK is 0 KiB" in out["warnings"][0]
    assert "ulimit -l" in out["warnings"][0] and "LimitMEMLOCK" in out["warnings"][0]


@needs_memlock
def test_memlock_zero_with_io_uring_requested_raises_naming_the_limit(disk_file):
    out = run_memlock(disk_file, "io_uring", 128, 0)
    assert out["errno"] == errno.ENOMEM
    assert "io_uring setup failed" in out["open_error"]
    assert "RLIMIT_MEMLOCK" in out["open_error"] and "ulimit -l" in out["open_error"]


@needs_memlock
def test_small_memlock_reads_without_registered_buffers_and_reports_it(disk_file):
    """64 KiB: the ring fits, a 1 MiB fixed buffer does not: one warning, the
    read is right, stats() says buffers are not registered and why."""
    out = run_memlock(disk_file, "io_uring", 128, 64 << 10)
    assert out["kind"] == "io_uring" and out["ok"] and out["qd"] == 128
    assert out["buffers_registered"] is False and out["fixed"] == 0
    assert "RLIMIT_MEMLOCK is 64 KiB" in out["buffer_error"]
    assert out["memlock"] == 64 << 10
    assert len(out["warnings"]) == 1 and "registered buffers" in out["warnings"][0]


@needs_memlock
def test_small_memlock_with_a_deep_queue_shrinks_the_ring(disk_file):
    out = run_memlock(disk_file, "io_uring", 4096, 64 << 10)
    assert out["kind"] == "io_uring" and out["ok"]
    assert 8 <= out["qd"] < 4096
    assert any("queue depth reduced from 4096" in m and "RLIMIT_MEMLOCK" in m
               for m in out["warnings"])


@needs_memlock
def test_thread_without_locked_memory_for_its_ring_reads_with_pread(disk_file):
    """The limit drops to 0 after open: a new thread cannot set up its ring,
    reads with pread (right bytes), counts it and warns once."""
    out = run_memlock(disk_file, "io_uring", 128, 8 << 20, later=0)
    assert out["kind"] == "io_uring" and out["ok"] and out["fallback"] == 1
    assert any("could not set up its io_uring ring" in m and "RLIMIT_MEMLOCK" in m
               for m in out["warnings"])


def test_buffers_registered_is_reported(disks):
    _, _, fds = disks
    eng = make_engine(fds, "io_uring")
    assert eng.stats().buffers_registered is False          # nothing registered yet
    buf = eng.alloc(1 << 16)
    s = eng.stats()
    assert buf.slot >= 0 and s.buffers_registered and s.registered_buffers == 1
    buf.release()
    assert eng.stats().registered_buffers == 0
    assert make_engine(fds, "threads").stats().buffers_registered is False


def vm_pin_kib() -> int:
    """Pages pinned in this process (io_uring fixed buffers), KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmPin:"):
                return int(line.split()[1])
    return 0


def test_fixed_buffer_registration_follows_the_threads_that_use_it(disks):
    """A buffer allocated in one thread is registered in another thread's ring
    when that thread first reads into it (fixed reads there too); pins are
    dropped when the thread exits, when the buffer is released (at once in the
    releasing thread's ring, at the next call in other rings) and at close:
    nothing stays pinned."""
    _, data, fds = disks
    eng = make_engine(fds, "io_uring")
    base = vm_pin_kib()
    buf = eng.alloc(1 << 20)
    assert vm_pin_kib() == base + 1024                 # the allocating thread's ring
    step, done = threading.Event(), threading.Event()
    seen = {}

    def worker():
        eng.execute(READ, [1], [8192], [4096], [0], buf)
        seen["ok"] = buf.array[:4096].tobytes() == data[1][8192:12288].tobytes()
        seen["pinned"] = vm_pin_kib()
        done.set()
        step.wait(10)
        other = eng.alloc(1 << 16)                     # next call in this thread
        eng.execute(READ, [0], [0], [4096], [0], other)
        # the kernel unpins a dropped registration from task work, which a
        # loaded machine may run a little later: poll, do not read once
        with contextlib.suppress(AssertionError):      # a pin never dropped fails below
            wait_until(lambda: vm_pin_kib() == base + 64, what="the worker's pin dropped")
        seen["after_release"] = vm_pin_kib()
        other.release()

    t = threading.Thread(target=worker)
    t.start()
    done.wait(10)
    assert seen["ok"] and seen["pinned"] == base + 2048   # registered in both rings
    buf.release()
    wait_until(lambda: vm_pin_kib() == base + 1024,    # still pinned by the worker's ring
               what="the allocating ring's pin dropped, the worker's kept")
    step.set()
    t.join()
    assert seen["after_release"] == base + 64          # dropped there on its next call
    wait_until(lambda: vm_pin_kib() == base and eng.stats().rings == 1,
               what="the pinned memory given back and one ring left")
    s = eng.stats()
    assert s.requests == 2 and s.fixed_requests == s.requests - s.thread_requests
    eng.close()
    wait_until(lambda: vm_pin_kib() == base, what="the pinned memory given back")


def test_buffers_registered_and_released_from_many_threads_stay_correct(disks):
    """Stress: four threads allocate, read into, hand over and release buffers
    (slots are reused while other threads' rings still hold the previous
    registration); every read returns the right bytes, most use fixed
    buffers, and after close nothing stays pinned."""
    _, data, fds = disks
    base = vm_pin_kib()
    eng = make_engine(fds, "io_uring")
    shared, lock, failures = [], threading.Lock(), []

    def work(seed):
        r = np.random.default_rng(seed)
        for k in range(40):
            buf = eng.alloc(int(r.integers(1, 9)) << 16)
            with lock:
                shared.append(buf)
                victim = shared.pop(int(r.integers(0, len(shared)))) \
                    if len(shared) > 3 else None
            if victim is not None:
                victim.release()              # maybe another thread's buffer
            n = buf.size // 4096
            disk = r.integers(0, 3, n).astype(np.int32)
            off = r.integers(0, 255, n).astype(np.uint64) * 4096
            dst = np.arange(n, dtype=np.uint64) * 4096
            eng.execute(READ, disk, off, [4096] * n, dst, buf)
            for i in range(0, n, 7):
                if buf.array[dst[i]:dst[i] + 4096].tobytes() != \
                        data[disk[i]][off[i]:off[i] + 4096].tobytes():
                    failures.append((seed, k, i))

    failures += run_in_threads(work, 4)
    assert failures == []
    s = eng.stats()
    assert s.errors == 0 and s.buffer_register_errors == 0
    assert s.fixed_requests > (s.requests - s.thread_requests) // 2
    eng.close()
    wait_until(lambda: vm_pin_kib() == base, what="the pinned memory given back")  # async
