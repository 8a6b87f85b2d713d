"""Conformance tests of the I/O engine: every test runs on io_uring and threads."""

import os

import numpy as np
import pytest

from swarmfs import _errors as E
from swarmfs._engine import (READ, WRITE, Engine, assign_buckets, gather_rows,
                             logical_block_size, open_disk, scatter_rows,
                             verify_rows, xxh3_ranges, xxh3_rows)


@pytest.fixture
def disks(tmp_path, rng):
    """Three 1 MiB disk files with random content, opened O_DIRECT."""
    paths, data, fds = [], [], []
    for i in range(3):
        p = tmp_path / f"d{i}"
        b = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
        p.write_bytes(b.tobytes())
        paths.append(str(p))
        data.append(b)
        fds.append(open_disk(p, write=True))
    yield paths, data, fds
    for fd in fds:
        os.close(fd)


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
    _, data, fds = disks
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
        # never more SQEs in flight than the ring: several enters, each batch many SQEs
        assert 1000 / 8 <= s.submit_calls <= 1000


def test_one_submission_when_plan_fits(disks):
    _, _, fds = disks
    eng = make_engine(fds, "io_uring", qd=64)
    n = 64
    buf = eng.alloc(n * 4096)
    eng.execute(READ, np.arange(n) % 3, np.arange(n) * 4096, [4096] * n,
                np.arange(n) * 4096, buf)
    s = eng.stats()
    assert s.submit_calls == 1 and s.sqes == n and s.cqes == n
    assert s.registered_files
    assert s.fixed_requests == n  # engine-allocated buffers are registered


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


def test_short_read_at_eof_is_resubmitted_then_truncation(tmp_path, engine_kind):
    p = tmp_path / "short"
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
    finally:
        os.close(fd)


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

    import swarmfs._engine as eng_mod
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
