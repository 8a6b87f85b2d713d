"""Readers stuck on one disk never starve the readers of the others, through
the mount (issue 26; ``_fuse_stream.DiskAdmission``).

A real mount (``python -m swarmfs.mount._fuse``, a subprocess) of a real
store of four O_DIRECT file disks, one of which lies on a small FUSE file
system whose reads the test holds (``tests/_gatefs.py``): the stuck disk.
Eight readers get stuck on it, more than the mount's worker threads allow
per disk; reads of the other disks must still complete, with the right
bytes, within a generous deadline (no timing ratios).  Then the disk is
released and every stuck read must return its right bytes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import trio  # noqa: E402
from test_fuse import DEADLINE, Mount, _cdir, _direct_io_ok  # skips this module without FUSE

from swarmfs import InvalidArgumentError, Store  # noqa: E402
from swarmfs.mount._fuse_stream import DiskAdmission, KVReader, Stream  # noqa: E402

pytestmark = pytest.mark.fuse

GATEFS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gatefs.py")
STUCK = 3                    # the disk whose reads are held
H, D = 2, 64                 # entries of 2 x 2 x 64 float16 = 512 bytes
WIDE_CLUSTERS = 16           # layer 0: clusters of 64 entries, striped over every disk
WIDE_N = 64
SMALL_CLUSTERS = 240         # layer 1: clusters of one entry (one disk each)


class Gate:
    """``tests/_gatefs.py`` serving ``backing`` at its own directory."""

    def __init__(self, backing):
        self.dir = os.path.dirname(backing)
        self.proc = subprocess.Popen([sys.executable, GATEFS, backing, self.dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.stop()
            raise RuntimeError(f"the gate file system did not start: {line!r}")
        deadline = time.monotonic() + DEADLINE
        while not os.path.ismount(self.dir):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the gate file system never showed as mounted")
            time.sleep(0.005)

    def ask(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        return self.proc.stdout.readline().strip()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()              # end of stdin: it unmounts and exits
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                subprocess.run(["fusermount3", "-uz", self.dir], capture_output=True)
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """A store whose disk ``STUCK`` lies on a gate file system: layer 0 has
    16 clusters of 64 entries (every cluster on every disk), layer 1 has
    240 clusters of one entry.  Yields (store, gate, expected bytes per
    (layer, cluster))."""
    d = tmp_path_factory.mktemp("isolation")
    if not _direct_io_ok(str(d)):
        pytest.skip(f"{d} does not support O_DIRECT")
    os.makedirs(d / "gate")
    disks = [str(d / f"disk{i}.img") for i in range(4)]
    disks[STUCK] = str(d / "gate" / f"disk{STUCK}.img")
    rng = np.random.default_rng(26)
    S0, S1 = WIDE_CLUSTERS * WIDE_N, SMALL_CLUSTERS
    s = Store.create(str(d / "store"), disks=disks, num_layers=2, num_kv_heads=H, head_dim=D,
                     dtype="float16")
    s.write_layer(0, rng.standard_normal((S0, 2, H, D), dtype=np.float32).astype(np.float16),
                  [np.arange(c * WIDE_N, (c + 1) * WIDE_N) for c in range(WIDE_CLUSTERS)])
    s.write_layer(1, rng.standard_normal((S1, 2, H, D), dtype=np.float32).astype(np.float16),
                  [np.array([c]) for c in range(SMALL_CLUSTERS)])
    want = {(0, c): s.read_cluster(0, c).tobytes() for c in range(WIDE_CLUSTERS)}
    want.update({(1, c): s.read_cluster(1, c).tobytes() for c in range(SMALL_CLUSTERS)})
    gate = Gate(disks[STUCK])
    try:
        yield s, gate, want
    finally:
        s.close()
        gate.stop()


def _entry_disks(store, layer, c):
    li = store.layer(layer)
    return li.copy_disk[li.cluster_copies([c])]


def _kv_stats(mnt):
    with open(os.path.join(mnt, "stats.json")) as f:
        return json.load(f)["mount"]["kv_reader"]


def _pread(path, off, size):
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, off)
    finally:
        os.close(fd)


def _plan_reads(store, want, mode):
    """(probe, stuck, healthy) reads as (path relative to the mount, offset,
    size, expected bytes); ``probe`` reads the stuck disk before it is held
    (no page a stuck read needs).  Direct I/O: 4 stuck reads of one entry
    on the stuck disk and 4 of a whole stripe (every disk), healthy reads of
    one entry and of 3 neighbouring entries on the other disks.  Page cache:
    one-entry clusters, 8 on the stuck disk, the healthy ones on the others
    (each read once, so each is a FUSE read)."""
    def rel(layer, c):
        return os.path.join(_cdir("", layer, c), "kv.bin")

    stuck, healthy = [], []
    if mode == "direct_io":
        Eb = len(want[(0, 0)]) // WIDE_N
        for c in range(WIDE_CLUSTERS):
            on = _entry_disks(store, 0, c)
            b = want[(0, c)]
            js = np.flatnonzero(on == STUCK)
            if c < 4:                      # one entry on the stuck disk
                j = int(js[c])
                stuck.append((rel(0, c), j * Eb, Eb, b[j * Eb:(j + 1) * Eb]))
            elif c < 8:                    # a stripe: one entry on every disk
                j = int(js[1]) - 1
                stuck.append((rel(0, c), j * Eb, 4 * Eb, b[j * Eb:(j + 4) * Eb]))
            else:
                for j in np.flatnonzero(on != STUCK)[::5].tolist():
                    healthy.append((rel(0, c), j * Eb, Eb, b[j * Eb:(j + 1) * Eb]))
                runs = [j for j in range(WIDE_N - 2) if (on[j:j + 3] != STUCK).all()]
                for j in runs[::4]:
                    healthy.append((rel(0, c), j * Eb, 3 * Eb, b[j * Eb:(j + 3) * Eb]))
    else:
        for c in range(SMALL_CLUSTERS):
            item = (rel(1, c), 0, 1 << 16, want[(1, c)])
            if int(_entry_disks(store, 1, c)[0]) == STUCK:
                if len(stuck) < 9:
                    stuck.append(item)
            else:
                healthy.append(item)
        return stuck[8], stuck[:8], healthy
    return stuck[0], stuck, healthy


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["direct_io", "page_cache"])
def test_readers_of_healthy_disks_progress_beside_eight_stuck_readers(gated, tmp_path, mode):
    store, gate, want = gated
    probe, stuck, healthy = _plan_reads(store, want, mode)
    assert len(stuck) == 8 and len(healthy) >= 60
    args = ["--direct-io"] if mode == "direct_io" else []
    with Mount(store.path, tmp_path / "mnt", *args) as m:
        # the mount is up and reads the stuck disk while it is healthy
        assert _pread(os.path.join(m.mnt, probe[0]), probe[1], probe[2]) == probe[3]
        results: dict[int, bytes] = {}
        threads = []
        assert gate.ask("hold") == "held"
        try:
            for k, (p, off, size, _) in enumerate(stuck):
                path = os.path.join(m.mnt, p)

                def reader(k=k, p=path, off=off, size=size):
                    results[k] = _pread(p, off, size)
                t = threading.Thread(target=reader, daemon=True)
                t.start()
                threads.append(t)
            # all eight are inside the mount, queued on the stuck disk or
            # reading it, and no more of them than its share of threads read it
            deadline = time.monotonic() + DEADLINE
            while True:
                st = _kv_stats(m.mnt)
                if st["disk_in_flight"][STUCK] + st["disk_waiting"][STUCK] == 8:
                    break
                assert time.monotonic() < deadline, f"stuck readers never arrived: {st}"
                time.sleep(0.01)
            assert st["disk_in_flight"][STUCK] <= st["per_disk"] < 8
            assert int(gate.ask("waiting").split()[1]) >= 1

            # the healthy disks' readers are served meanwhile, with the right bytes
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futs = [pool.submit(_pread, os.path.join(m.mnt, p), off, size)
                        for p, off, size, _ in healthy]
                done, late = concurrent.futures.wait(futs, timeout=DEADLINE)
                if late:
                    gate.ask("release")            # let the blocked readers go, then fail
                    pytest.fail(f"{len(late)} of {len(futs)} reads of healthy disks did "
                                f"not complete in {DEADLINE} s beside 8 stuck readers; "
                                f"{_kv_stats(m.mnt)}")
                for f, (p, off, size, b) in zip(futs, healthy, strict=True):
                    assert f.result() == b, (p, off, size)
            assert not results and all(t.is_alive() for t in threads)   # still held
        finally:
            assert gate.ask("release") == "released"
            for t in threads:
                t.join(DEADLINE)
        assert not any(t.is_alive() for t in threads)
        assert [results[k] for k in range(8)] == [b for _, _, _, b in stuck]
        st = _kv_stats(m.mnt)
        assert st["disk_in_flight"] == [0] * 4 and st["disk_waiting"] == [0] * 4
        assert st["disk_waits"] >= 8 - st["per_disk"]


@pytest.mark.slow
def test_readers_of_one_open_file_are_not_held_by_its_stuck_read(gated, tmp_path):
    """Several readers of one open file (one file handle, one stream in the
    daemon): while one read of it waits on the stuck disk, reads of the same
    file's entries on the other disks complete with the right bytes (a miss
    reads without the stream's lock; bench_mount --isolation shares file
    handles this way)."""
    store, gate, want = gated
    c = 0
    on = _entry_disks(store, 0, c)
    b = want[(0, c)]
    Eb = len(b) // WIDE_N
    j_stuck = int(np.flatnonzero(on == STUCK)[0])
    # entries on the other disks, none next to another: random reads, no read-ahead
    # (a read-ahead window spans every disk, so a read it serves waits for it)
    others = np.flatnonzero(on != STUCK)[::3][:16].tolist()
    with Mount(store.path, tmp_path / "mnt", "--direct-io") as m:
        fd = os.open(os.path.join(m.mnt, _cdir("", 0, c), "kv.bin"), os.O_RDONLY)
        try:
            assert os.pread(fd, Eb, j_stuck * Eb) == b[j_stuck * Eb:(j_stuck + 1) * Eb]
            got = {}
            assert gate.ask("hold") == "held"
            try:
                t = threading.Thread(target=lambda: got.setdefault(
                    "stuck", os.pread(fd, Eb, j_stuck * Eb)), daemon=True)
                t.start()
                deadline = time.monotonic() + DEADLINE
                while _kv_stats(m.mnt)["disk_in_flight"][STUCK] < 1:
                    assert time.monotonic() < deadline, "the stuck read never arrived"
                    time.sleep(0.01)
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    futs = [pool.submit(os.pread, fd, Eb, j * Eb) for j in others]
                    done, late = concurrent.futures.wait(futs, timeout=DEADLINE)
                    if late:
                        gate.ask("release")
                        pytest.fail(f"{len(late)} of {len(futs)} reads of the same open "
                                    f"file waited for its stuck read")
                    for f, j in zip(futs, others, strict=True):
                        assert f.result() == b[j * Eb:(j + 1) * Eb]
                assert "stuck" not in got and t.is_alive()
            finally:
                assert gate.ask("release") == "released"
                t.join(DEADLINE)
            assert got["stuck"] == b[j_stuck * Eb:(j_stuck + 1) * Eb]
        finally:
            os.close(fd)


# -- the per-disk queues without FUSE (pytest-trio) ---------------------------------

@pytest.mark.trio
async def test_disk_admission_queues_per_disk_and_cancels_cleanly():
    adm = DiskAdmission(4, per_disk=2, whole=1)
    every = np.arange(4)
    assert adm.try_whole(every)
    assert not adm.try_whole(every)                   # each disk has a whole read now
    assert adm.in_flight.tolist() == [1, 1, 1, 1]
    await adm.acquire(3)                              # disk 3 full
    got = []

    async def part(d, tag):
        await adm.acquire(d)
        got.append(tag)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(part, 3, "a")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(part, 3, "b")                 # queued behind "a"
        await trio.testing.wait_all_tasks_blocked()
        assert adm.stats()["disk_waiting"] == [0, 0, 0, 2] and got == []
        await adm.acquire(0)                          # another disk is not held up
        with trio.CancelScope() as cs:                # a cancelled wait leaves nothing behind
            cs.cancel()
            await adm.acquire(3)
        assert adm.stats()["disk_waiting"] == [0, 0, 0, 2]
        adm.release((3,))                             # handed to the first in line
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["a"]
        adm.release(every.tolist())
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["a", "b"]
    assert adm.in_flight.tolist() == [1, 0, 0, 2] and adm.stats()["disk_waits"] == 3


@pytest.mark.trio
async def test_split_reads_return_the_same_bytes(gated):
    """With one slot per disk every read over several disks is split per
    disk: the bytes are those of the fast path, and no slot stays taken."""
    store, _, want = gated
    with pytest.raises(InvalidArgumentError):
        KVReader(store, limiter=trio.CapacityLimiter(2), per_disk=0)
    reader = KVReader(store, limiter=trio.CapacityLimiter(2), window_max=1 << 14, per_disk=1)
    assert reader.admission.whole == 0
    rng = np.random.default_rng(5)
    async with trio.open_nursery() as nursery:
        reader.nursery = nursery

        async def one(c, off, n):
            s = Stream(0, c, len(want[(0, c)]), li=store.layer(0))
            assert bytes(await reader.read(s, off, n)) == want[(0, c)][off:off + n]
            reader.close(s)

        async with trio.open_nursery() as inner:
            for c, off, n in zip(rng.integers(0, WIDE_CLUSTERS, 40), rng.integers(0, 30000, 40),
                                 rng.integers(1, 8000, 40), strict=True):
                inner.start_soon(one, int(c), int(off), int(n))
        s = Stream(0, 1, len(want[(0, 1)]))             # sequential, with read-ahead
        got = bytearray()
        while b := bytes(await reader.read(s, len(got), 4096)):
            got += b
        assert bytes(got) == want[(0, 1)]
        reader.close(s)
    st = reader.stats()
    assert st["split_reads"] > 0 and st["readahead_hits"] > 0
    assert st["disk_in_flight"] == [0] * 4 and st["disk_waiting"] == [0] * 4
