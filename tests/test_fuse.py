"""The read-only FUSE view (swarmfs.mount._fuse, _fuse_tree, _fuse_stream).

Real mounts of real stores on O_DIRECT file disks: every mount runs in a
subprocess (``python -m swarmfs.mount._fuse STORE MNT --foreground``), is polled
with a deadline until ``os.path.ismount``, and is always unmounted in teardown
(fusermount3 -u, then -uz, then kill).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

if not os.path.exists("/dev/fuse"):
    pytest.skip("/dev/fuse is missing (no FUSE in this kernel or container)",
                allow_module_level=True)
if shutil.which("fusermount3") is None:
    pytest.skip("fusermount3 is missing (install fuse3)", allow_module_level=True)
if not os.access("/dev/fuse", os.R_OK | os.W_OK):
    pytest.skip("/dev/fuse is not accessible to this user", allow_module_level=True)
pyfuse3 = pytest.importorskip("pyfuse3")
trio = pytest.importorskip("trio")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import random_clusters, random_kv, same_bits, wait_until  # noqa: E402
from swarmfs import Store  # noqa: E402
from swarmfs.mount import _fuse_tree as T  # noqa: E402
from swarmfs.mount._fuse import MountError, umount  # noqa: E402
from swarmfs.mount._fuse_stream import KVReader, Stream  # noqa: E402

pytestmark = pytest.mark.fuse

DEADLINE = 30.0
C0 = 5000                    # clusters of layer 0
BIG = 40_000                 # entries of layer 1's cluster 0 (128 B each: 5 MiB)


# -- helpers ---------------------------------------------------------------------

def _mounted(mnt):
    try:
        return os.path.ismount(mnt)
    except OSError:
        return False


def _in_mountinfo(mnt):
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == mnt for line in f)


def _direct_io_ok(d):
    """Whether files under ``d`` accept an aligned O_DIRECT read."""
    import mmap
    p = os.path.join(d, ".odirect-probe")
    with open(p, "wb") as f:
        f.write(b"\0" * 8192)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    m = mmap.mmap(-1, 4096)
    try:
        os.preadv(fd, [m], 4096)
        return True
    except OSError:
        return False
    finally:
        m.close()
        os.close(fd)
        os.unlink(p)


class Mount:
    """A mount served by a subprocess; unmounted and reaped on exit, also
    when the test failed."""

    def __init__(self, store, mnt, *args):
        self.store, self.mnt, self.args = str(store), str(mnt), list(args)
        self.proc = None
        self.log = os.path.join(os.path.dirname(self.mnt), os.path.basename(self.mnt) + ".log")

    def start(self):
        os.makedirs(self.mnt, exist_ok=True)
        self._logf = open(self.log, "wb")     # noqa: SIM115 - the daemon's log, closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarmfs.mount._fuse", self.store, self.mnt, "--foreground",
             *self.args], stdout=self._logf, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + DEADLINE
        while not _mounted(self.mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mount failed:\n{self.output()}")
            time.sleep(0.005)
        return self

    def output(self):
        with open(self.log, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self):
        if _in_mountinfo(self.mnt):
            subprocess.run(["fusermount3", "-u", self.mnt], capture_output=True)
        if _in_mountinfo(self.mnt):
            subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_logf", None):
            self._logf.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _build_main_store(path):
    rng = np.random.default_rng(7)
    s = Store.create(path, disks=4, num_layers=2, num_kv_heads=2, head_dim=16,
                     dtype="float16")
    S0 = 4 * C0
    s.write_layer(0, random_kv(rng, S0, 2, 16, "float16"),
                  random_clusters(rng, S0, C0, extra_copies=300))
    S1 = BIG + 3000
    s.write_layer(1, random_kv(rng, S1, 2, 16, "float16"),
                  [np.arange(BIG), np.arange(BIG, S1), np.array([5, BIG + 1, 17])])
    return s


# -- fixtures --------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuse")
    if not _direct_io_ok(str(d)):
        pytest.skip(f"{d} does not support O_DIRECT")
    return d


@pytest.fixture(scope="module")
def store(workdir):
    s = _build_main_store(str(workdir / "store"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def mnt(store, workdir):
    with Mount(store.path, workdir / "mnt") as m:
        yield m.mnt


def _cdir(mnt, layer, c):
    return os.path.join(mnt, "layers", f"{layer:02d}", "clusters", f"{c:06d}")


def _sha(b):
    return hashlib.sha256(b).hexdigest()


# -- the tree without FUSE ---------------------------------------------------------

node_st = st.one_of(
    st.sampled_from([T.Node(k) for k in (T.ROOT, T.STATS, T.DISKS, T.LAYERS)]),
    st.builds(lambda v: T.Node(T.MANIFEST, ver=v), st.integers(0, T.MANIFEST_VER_MASK)),
    st.builds(lambda k, i: T.Node(k, disk=i), st.sampled_from([T.DISK_DIR, T.DISK_INFO]),
              st.integers(0, 255)),
    st.builds(lambda k, i: T.Node(k, layer=i), st.sampled_from([T.LAYER_DIR, T.CLUSTERS]),
              st.integers(0, T.MAX_LAYERS - 1)),
    st.builds(lambda i, v: T.Node(T.MEDOIDS, layer=i, ver=v),
              st.integers(0, T.MAX_LAYERS - 1), st.integers(0, T.VER_MASK)),
    st.builds(lambda k, i, c, v: T.Node(k, layer=i, cluster=c, ver=v),
              st.sampled_from([T.CLUSTER_DIR, T.KV_BIN, T.KV_NPY, T.TOKENS, T.CLUSTER_INFO]),
              st.integers(0, T.MAX_LAYERS - 1), st.integers(0, T.MAX_CLUSTERS),
              st.integers(0, T.VER_MASK)))


@given(node_st)
def test_inode_arithmetic_round_trips(node):
    ino = T.encode(node)
    assert 0 < ino < 1 << 63
    assert T.decode(ino) == node


@given(st.integers(0, (1 << 63) - 1))
def test_decode_never_raises(ino):
    node = T.decode(ino)
    assert node is None or T.encode(node) == ino


@given(st.lists(st.integers(0, 10**12), max_size=50))
def test_tokens_text_size_is_exact(toks):
    t = np.array(toks, dtype=np.int64)
    assert T.tokens_text_size(t) == len(T.tokens_text(t))


@given(st.integers(0, 10**9), st.integers(1, 64), st.integers(1, 1024),
       st.sampled_from(["float16", "float32", "bfloat16"]))
def test_npy_header_is_numpy_readable_and_aligned(n, H, d, dtype):
    import io
    h = T.npy_header(T.npy_descr(dtype), (n, 2, H, d))
    assert len(h) % 64 == 0
    f = io.BytesIO(h)
    assert np.lib.format.read_magic(f) == (1, 0)
    shape, fortran, dt = np.lib.format.read_array_header_1_0(f)
    assert shape == (n, 2, H, d) and not fortran
    assert dt == np.dtype(T.npy_descr(dtype)) and f.tell() == len(h)


def test_lookup_counts_forget_never_raises(store):
    c = T.LookupCounts()
    ino = T.encode(T.Node(T.KV_BIN, layer=0, cluster=17))
    c.add(ino)
    c.add(ino)
    c.forget(ino, 1)
    assert c.get(ino) == 1 and c.total == 1
    c.forget(ino, 5)                    # more than it holds: clamped, counted
    c.forget(T.encode(T.Node(T.KV_BIN, layer=1, cluster=0)), 3)   # never looked up
    c.forget((1 << 62) + 12345, 1)                                # garbage inode
    assert c.get(ino) == 0 and c.total == 0 and c.underflows == 3
    c.add_clusters(0, 100, 200, T.KV_NPY_FILE)             # a READDIRPLUS reply, in bulk
    assert c.total == 100 and c.get(T.encode(T.Node(T.KV_NPY, layer=0, cluster=150, ver=7))) == 1
    known = c.known_clusters(0, 300)
    assert known.sum() == 100 and known[100:200].all()


def test_readdir_resumes_from_any_next_id(store):
    tree = T.Tree(store)
    parent = T.Node(T.CLUSTERS, layer=0)
    full = list(tree.entries(parent, 0))
    assert [n for n, _, _ in full] == [b".", b".."] + [b"%06d.npy" % c for c in range(C0)]
    for start in (1, 2, 999, C0 - 1, C0, C0 + 2):
        tail = list(tree.entries(parent, start))
        assert tail == full[start:]
    # every next_id resumes right after its entry, in every directory
    for d in (T.Node(T.ROOT), T.Node(T.DISKS), T.Node(T.LAYERS), T.Node(T.LAYER_DIR, layer=1),
              T.Node(T.CLUSTER_DIR, layer=1, cluster=2), T.Node(T.DISK_DIR, disk=3)):
        ents = list(tree.entries(d, 0))
        for i, (_, _, nid) in enumerate(ents):
            assert list(tree.entries(d, nid)) == ents[i + 1:]
        assert all(tree.lookup(d, name) == node for name, node, _ in ents)
        assert [n for n, _, _ in ents[:2]] == [b".", b".."]


def test_names_are_canonical(store):
    tree = T.Tree(store)
    cl = T.Node(T.CLUSTERS, layer=0)
    assert tree.lookup(cl, b"000042") == T.Node(T.CLUSTER_DIR, layer=0, cluster=42)
    assert tree.lookup(cl, b"000042.npy") == T.Node(T.KV_NPY, layer=0, cluster=42)
    for bad in (b"42", b"0000042", b"-00001", b"00004a", b"%06d" % C0, b"", b".npy",
                b"42.npy", b"000042.bin", b"000042.npy.npy"):
        assert tree.lookup(cl, bad) is None
    layers = T.Node(T.LAYERS)
    assert tree.lookup(layers, b"01") == T.Node(T.LAYER_DIR, layer=1)
    assert tree.lookup(layers, b"1") is None and tree.lookup(layers, b"02") is None


def test_versions_change_only_with_contents(workdir, rng):
    path = str(workdir / "versions")
    s = Store.create(path, disks=3, num_layers=2, num_kv_heads=2, head_dim=16)
    s.write_layer(0, random_kv(rng, 600, 2, 16, "float16"),
                  [np.arange(i * 60, (i + 1) * 60) for i in range(10)])
    s.write_layer(1, random_kv(rng, 100, 2, 16, "float16"), [np.arange(100)])
    t0 = T.Tree(s)
    before = {c: s.read_cluster(0, c).tobytes() for c in range(10)}
    joins = [np.array([2]) if i < 5 else np.array([7]) if i < 8 else
             np.array([], dtype=np.int64) for i in range(20)]
    s.append(0, random_kv(rng, 20, 2, 16, "float16"), joins, new_cluster_size=64)
    with Store.open(path) as r:
        m = r.manifest
        idx = {0: r.layer(0), 1: t0.load_layer(1)}     # layer 1 unchanged: same index
        t1 = T.Tree(s, m, idx, prev=t0)
        after = {c: r.read_cluster(0, c).tobytes() for c in range(r.num_clusters(0))}
    assert t1.num_clusters(0) == 11
    changed = [c for c in range(11) if c >= 10 or before[c] != after[c]]
    assert changed == [2, 7, 10]
    assert np.flatnonzero(t1.changed[0]).tolist() == changed
    for c in range(10):
        n0 = T.Node(T.KV_NPY, layer=0, cluster=c)
        a0, a1 = t0.current(n0), t1.current(n0)
        assert (a0 == a1) == (c not in changed), c
        assert t0.valid(a0) and t1.valid(a1)
        assert t1.valid(a0) == (c not in changed)      # an old changed inode is stale
        assert t1.size(a1) == len(T.npy_header("<f2", (len(after[c]) // s.entry_bytes,
                                                      2, 2, 16))) + len(after[c])
    assert t1.layer_ver[1] == t0.layer_ver[1] and t1.layer_ver[0] != t0.layer_ver[0]
    assert t1.manifest_ver != t0.manifest_ver
    assert not t1.valid(t0.current(T.Node(T.MANIFEST)))
    assert T.Tree(s, m, idx, prev=t1).manifest_ver == t1.manifest_ver   # nothing new
    s.close()


# -- the read path without FUSE (pytest-trio) -------------------------------------------

@pytest.mark.trio
async def test_kv_reader_ranges_and_readahead(store):
    want = store.read_cluster(1, 0).tobytes()
    nbytes = len(want)
    second = Store.open(store.path)            # a second engine serves reads in parallel
    reader = KVReader(store, limiter=trio.CapacityLimiter(4), window_max=1 << 20,
                      engines=[store, second])
    async with trio.open_nursery() as nursery:
        reader.nursery = nursery
        # a small read reads only the entries it covers: no read-ahead
        before = store.stats().bytes_read
        s = Stream(1, 0, nbytes)
        assert bytes(await reader.read(s, 1000, 100)) == want[1000:1100]
        assert store.stats().bytes_read - before <= 4 * 512
        reader.close(s)
        # a sequential stream is served from read-ahead windows
        s = Stream(1, 0, nbytes)
        got = bytearray()
        off = 0
        while True:
            b = bytes(await reader.read(s, off, 128 << 10))
            if not b:
                break
            got += b
            off += len(b)
        assert bytes(got) == want
        assert reader.counters["readahead_hits"] > 0
        reader.close(s)
        # concurrent random reads on one stream
        s = Stream(1, 0, nbytes)
        rng = np.random.default_rng(3)

        async def one(o, n):
            assert bytes(await reader.read(s, o, n)) == want[o:o + n]

        async with trio.open_nursery() as inner:
            for o, n in zip(rng.integers(0, nbytes, 64), rng.integers(1, 300_000, 64), strict=True):
                inner.start_soon(one, int(o), int(n))
        assert bytes(await reader.read(s, nbytes, 10)) == b""
        reader.close(s)
    # both engines served reads, and every read was whole and right
    assert second.stats().engine.bytes > 0 and store.stats().engine.bytes > 0
    second.close()
    assert reader.pool.allocated <= reader.pool.budget


# -- through the mount ---------------------------------------------------------------

def test_tree_listing(mnt, store):
    assert sorted(os.listdir(mnt)) == ["disks", "layers", "manifest.json", "stats.json"]
    assert sorted(os.listdir(os.path.join(mnt, "disks"))) == ["0", "1", "2", "3"]
    assert sorted(os.listdir(os.path.join(mnt, "layers"))) == ["00", "01"]
    assert sorted(os.listdir(os.path.join(mnt, "layers", "01"))) == ["clusters", "medoids.npy"]
    assert sorted(os.listdir(_cdir(mnt, 1, 2))) == ["info.json", "kv.bin", "kv.npy",
                                                    "tokens.txt"]
    assert sorted(os.listdir(os.path.join(mnt, "layers", "01", "clusters"))) == \
        ["000000.npy", "000001.npy", "000002.npy"]
    for d in (mnt, _cdir(mnt, 0, 7), os.path.join(mnt, "layers", "00", "clusters")):
        ls = subprocess.run(["ls", "-f", d], capture_output=True, text=True,
                            check=True).stdout.split()
        assert ls[:2] == [".", ".."], d          # ls -f: unsorted, as the directory lists
        assert sorted(ls[2:]) == sorted(os.listdir(d))
    # ".." resolves to the parent, "." to itself
    assert os.stat(os.path.join(_cdir(mnt, 0, 7), "..")).st_ino == \
        os.stat(os.path.join(mnt, "layers", "00", "clusters")).st_ino
    # CCCCCC.npy and CCCCCC/kv.npy are one file (two links)
    a, b = os.stat(_cdir(mnt, 0, 7) + ".npy"), os.stat(os.path.join(_cdir(mnt, 0, 7), "kv.npy"))
    assert a.st_ino == b.st_ino and a.st_nlink == 2 and a.st_size == b.st_size


def test_directory_of_5000_clusters_lists_exactly(mnt, store):
    d = os.path.join(mnt, "layers", "00", "clusters")
    want = [f"{c:06d}.npy" for c in range(C0)]
    names = os.listdir(d)
    assert len(names) == C0 and sorted(names) == want
    out = subprocess.run(["ls", d], capture_output=True, text=True, check=True).stdout.split()
    assert out == want
    with os.scandir(d) as it:          # getdents in small steps: resumes by next_id
        assert sorted(e.name for e in it) == want
    assert os.stat(d).st_nlink == 2     # no listed subdirectories
    # READDIRPLUS carried every entry's attributes: no lookups, and sizes exact
    def lookups():
        with open(os.path.join(mnt, "stats.json")) as f:
            return json.load(f)["mount"]["lookups"]
    before = lookups()
    ls = subprocess.run(["ls", "-l", d], capture_output=True, text=True, check=True).stdout
    sizes = [int(line.split()[4]) for line in ls.splitlines()[1:]]
    li = store.layer(0)
    hdr = [len(T.npy_header("<f2", (int(n), 2, 2, 16))) for n in li.sizes]
    assert sizes == (np.array(hdr) + li.sizes * store.entry_bytes).tolist()
    assert lookups() - before <= 2      # stats.json itself


def test_manifest_and_medoids(mnt, store):
    with open(os.path.join(mnt, "manifest.json"), "rb") as f:
        got = f.read()
    with open(os.path.join(store.path, "manifest.json"), "rb") as f:
        assert got == f.read()
    for layer in (0, 1):
        m = np.load(os.path.join(mnt, "layers", f"{layer:02d}", "medoids.npy"))
        assert same_bits(m, store.medoid_keys(layer))


@pytest.mark.slow
def test_kv_files_match_the_fast_path(mnt, store):
    rng = np.random.default_rng(1)
    picks = [(0, 0), (0, C0 - 1)] + [(0, int(c)) for c in rng.choice(C0, 150, replace=False)]
    picks += [(1, c) for c in range(3)]
    for layer, c in picks:
        want = store.read_cluster(layer, c)
        d = _cdir(mnt, layer, c)
        with open(os.path.join(d, "kv.bin"), "rb") as f:
            assert f.read() == want.tobytes(), (layer, c)
        got = np.load(os.path.join(d, "kv.npy"))
        assert got.shape == want.shape and same_bits(got, want), (layer, c)
        with open(os.path.join(d, "tokens.txt")) as f:
            toks = [int(x) for x in f.read().split()]
        assert toks == store.cluster_tokens(layer, c).tolist()
        with open(os.path.join(d, "info.json")) as f:
            info = json.load(f)
        ref = store.layer(layer).cluster_info(c)
        assert {k: info[k] for k in ref} == ref
    # the flat name is one path away
    for layer, c in picks[:20]:
        got = np.load(_cdir(mnt, layer, c) + ".npy")
        assert same_bits(got, store.read_cluster(layer, c)), (layer, c)


def _mmap_both_ways(mnt, store, *, shared_ok):
    """np.load / np.memmap / mmap.mmap of cluster files: shared mappings work
    in page cache mode and fail with ENODEV under --direct-io (the kernel's
    rule without FUSE_DIRECT_IO_ALLOW_MMAP); private mappings work in both."""
    import mmap
    want = store.read_cluster(1, 0)
    npy, kvbin = _cdir(mnt, 1, 0) + ".npy", os.path.join(_cdir(mnt, 1, 0), "kv.bin")
    m = np.load(npy, mmap_mode="c")
    assert same_bits(np.asarray(m), want)
    del m
    mm = np.memmap(kvbin, dtype=np.uint8, mode="c")
    assert bytes(mm[:1 << 16]) == want.tobytes()[:1 << 16]
    del mm
    with open(kvbin, "rb") as f:
        if shared_ok:
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mp:
                assert mp[:4096] == want.tobytes()[:4096]
            m = np.load(npy, mmap_mode="r")
            assert same_bits(np.asarray(m), want)
            del m
        else:
            with pytest.raises(OSError) as ei:
                mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            assert ei.value.errno == errno.ENODEV
            with pytest.raises(OSError) as ei:
                np.load(npy, mmap_mode="r")
            assert ei.value.errno == errno.ENODEV


def test_mmap_in_page_cache_mode(mnt, store):
    _mmap_both_ways(mnt, store, shared_ok=True)


def test_cat_dd_stat_du_agree(mnt, store):
    d = _cdir(mnt, 1, 0)
    want = store.read_cluster(1, 0).tobytes()
    kvbin = os.path.join(d, "kv.bin")
    cat = subprocess.run(["cat", kvbin], capture_output=True, check=True).stdout
    assert cat == want
    dd = subprocess.run(["dd", f"if={kvbin}", "bs=1M", "status=none"], capture_output=True,
                        check=True).stdout
    assert dd == want
    # a partial dd: 3 blocks of 4 KiB from block 100
    dd = subprocess.run(["dd", f"if={kvbin}", "bs=4k", "skip=100", "count=3", "status=none"],
                        capture_output=True, check=True).stdout
    assert dd == want[100 * 4096:103 * 4096]
    sizes = {}
    for name in ("kv.bin", "kv.npy", "tokens.txt", "info.json"):
        p = os.path.join(d, name)
        st_ = os.stat(p)
        with open(p, "rb") as f:
            data = f.read()
        assert st_.st_size == len(data), name
        assert st_.st_blocks == -(-len(data) // 512), name
        assert st_.st_blksize > 0
        out = subprocess.run(["stat", "-c", "%s %b %B", p], capture_output=True, text=True,
                             check=True).stdout.split()
        assert int(out[0]) == len(data) and int(out[1]) * int(out[2]) == st_.st_blocks * 512
        sizes[name] = len(data)
    assert sizes["kv.bin"] == BIG * store.entry_bytes
    du = subprocess.run(["du", "-sb", d], capture_output=True, text=True, check=True).stdout
    assert int(du.split()[0]) == sum(sizes.values())
    du = subprocess.run(["du", "-s", "-B1", d], capture_output=True, text=True,
                        check=True).stdout
    assert int(du.split()[0]) == sum(-(-n // 512) * 512 for n in sizes.values())
    cp = os.path.join(os.path.dirname(mnt), "copy.bin")
    subprocess.run(["cp", kvbin, cp], check=True)
    with open(cp, "rb") as f:
        assert f.read() == want
    os.unlink(cp)


def test_random_preads_and_eof(mnt, store):
    want = store.read_cluster(1, 1).tobytes()
    hdr = T.npy_header("<f2", (len(want) // store.entry_bytes, 2, 2, 16))
    rng = np.random.default_rng(5)
    for name, ref in (("kv.bin", want), ("kv.npy", hdr + want)):
        fd = os.open(os.path.join(_cdir(mnt, 1, 1), name), os.O_RDONLY)
        try:
            for o, n in zip(rng.integers(0, len(ref), 100), rng.integers(1, 70_000, 100),
                            strict=True):
                assert os.pread(fd, int(n), int(o)) == ref[o:o + n]
            assert os.pread(fd, 1 << 20, len(ref) - 10) == ref[-10:]     # short only at EOF
            assert os.pread(fd, 100, len(ref)) == b""
            assert os.pread(fd, 100, len(ref) + 12345) == b""
        finally:
            os.close(fd)


def test_read_only_and_errors(mnt):
    d = _cdir(mnt, 0, 3)
    f = os.path.join(d, "kv.bin")

    def err(fn, *a):
        with pytest.raises(OSError) as ei:
            fn(*a)
        return ei.value.errno

    assert err(open, f, "r+b") == errno.EROFS
    assert err(open, f, "ab") == errno.EROFS
    assert err(open, os.path.join(d, "new"), "wb") == errno.EROFS
    assert err(os.mkdir, os.path.join(d, "sub")) == errno.EROFS
    assert err(os.unlink, f) == errno.EROFS
    assert err(os.rmdir, d) == errno.EROFS
    assert err(os.rename, f, os.path.join(d, "x")) == errno.EROFS
    assert err(os.chmod, f, 0o644) == errno.EROFS
    assert err(os.truncate, f, 0) == errno.EROFS
    assert err(os.utime, f) == errno.EROFS
    assert err(os.symlink, "kv.bin", os.path.join(d, "ln")) == errno.EROFS
    assert err(os.link, f, os.path.join(d, "hl")) == errno.EROFS
    assert err(os.setxattr, f, "user.x", b"1") == errno.EROFS
    for missing in ("nope", "layers/02", "layers/1", "layers/00/clusters/42",
                    f"layers/00/clusters/{C0:06d}", "layers/00/clusters/000001/kv.txt",
                    "disks/4", "disks/00"):
        assert err(os.stat, os.path.join(mnt, missing)) == errno.ENOENT, missing
    assert err(os.stat, os.path.join(mnt, "manifest.json", "x")) == errno.ENOTDIR
    assert err(lambda: pathlib.Path(d).read_bytes()) == errno.EISDIR
    assert err(os.stat, os.path.join(mnt, "layers", "00", "clusters", "000001.npy",
                                     "x")) == errno.ENOTDIR
    r = subprocess.run(["cat", d], capture_output=True, text=True)
    assert r.returncode != 0 and "Is a directory" in r.stderr
    r = subprocess.run(["sh", "-c", f"echo x > {f}"], capture_output=True, text=True)
    assert r.returncode != 0 and "Read-only file system" in r.stderr


def test_stats_and_disk_info_are_live(mnt, store):
    def stats():
        with open(os.path.join(mnt, "stats.json")) as f:
            return json.load(f)

    a = stats()
    assert a["engine"] in ("io_uring", "threads") and a["verify_checksums"] is True
    assert len(a["disks"]) == store.num_disks
    with open(os.path.join(_cdir(mnt, 0, 11), "kv.bin"), "rb") as f:
        f.read()
    b = stats()
    assert b["mount"]["kv_bytes_returned"] > a["mount"]["kv_bytes_returned"]
    assert sum(x["bytes"] for x in b["disks"]) > sum(x["bytes"] for x in a["disks"])
    assert b["mount"]["kernel_lookups"] > 0 and "hits" in b["cache"]
    for i in range(store.num_disks):
        p = os.path.join(mnt, "disks", str(i), "info.json")
        with open(p) as f:
            info = json.load(f)
        assert info["index"] == i and info["path"] == store.disk_paths[i]
        assert info["size"] == os.path.getsize(store.disk_paths[i])
        assert info["block_size"] == store.block_size and info["bytes_read"] >= 0


def test_concurrent_readers_get_correct_bytes(mnt, store, workdir):
    want = {c: _sha(store.read_cluster(1, c).tobytes()) for c in (0, 1)}
    files = [os.path.join(_cdir(mnt, 1, c), "kv.bin") for c in (0, 1, 0, 1, 0)]
    # a second store handle reads the fast path while the cats run
    fast_ok = []

    def fast():
        with Store.open(store.path) as s2:
            for _ in range(5):
                fast_ok.append(_sha(s2.read_cluster(1, 0).tobytes()) == want[0])

    t = threading.Thread(target=fast)
    t.start()
    procs = [subprocess.Popen(["sh", "-c", f"cat {p} | sha256sum"], stdout=subprocess.PIPE)
             for p in files]
    outs = [p.communicate(timeout=DEADLINE)[0].split()[0].decode() for p in procs]
    t.join(DEADLINE)
    assert outs == [want[0], want[1], want[0], want[1], want[0]]
    assert fast_ok == [True] * 5


# -- mounts of their own -------------------------------------------------------------

def test_bfloat16_descr_and_checksum_failure_gives_eio(workdir, rng):
    import ml_dtypes
    path = str(workdir / "bf16")
    s = Store.create(path, disks=3, num_layers=1, num_kv_heads=2, head_dim=8,
                     dtype="bfloat16")
    S = 600
    s.write_layer(0, random_kv(rng, S, 2, 8, "bfloat16"),
                  [np.arange(0, 400), np.arange(400, 600), np.array([1, 401])])
    good = s.read_cluster(0, 1)
    bad = s.read_cluster(0, 0).tobytes()
    info = s.layer(0).cluster_info(0)
    eb = s.entry_bytes
    s.close()
    with Mount(path, workdir / "mnt-bf16") as m:
        got = np.load(os.path.join(_cdir(m.mnt, 0, 1), "kv.npy"))
        assert got.dtype == np.dtype("<u2") and got.shape == good.shape
        assert (got.view(ml_dtypes.bfloat16).view(np.uint16) == good.view(np.uint16)).all()
        # flip a byte of an entry in the middle of cluster 0 (on its first extent)
        ext = info["extents"][0]
        slot = ext["entries"] // 2
        with open(os.path.join(path, "disks", f"disk-{ext['disk']}.img"), "r+b") as f:
            f.seek(ext["offset"] + slot * eb + 3)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
            f.flush()
            os.fsync(f.fileno())
        j = ((ext["disk"] - info["start_disk"]) % 3) + 3 * slot     # cluster-order index
        kvbin = os.path.join(_cdir(m.mnt, 0, 0), "kv.bin")
        fd = os.open(kvbin, os.O_RDONLY)
        try:
            with pytest.raises(OSError) as ei:
                os.pread(fd, eb, j * eb)
            assert ei.value.errno == errno.EIO
            # a page that does not hold the bad entry still reads (only the
            # entries a request covers are read and verified)
            page = 0 if j * eb >= 4096 else len(bad) // 4096
            assert (j * eb) // 4096 != page
            assert os.pread(fd, 100, page * 4096) == bad[page * 4096:page * 4096 + 100]
        finally:
            os.close(fd)
        r = subprocess.run(["cat", kvbin], capture_output=True)
        assert r.returncode != 0 and b"Input/output error" in r.stderr
        with open(os.path.join(_cdir(m.mnt, 0, 1), "kv.bin"), "rb") as f:
            assert f.read() == good.tobytes()
        with open(os.path.join(m.mnt, "stats.json")) as f:
            assert json.load(f)["mount"]["checksum_failures"] >= 1
        wait_until(lambda: "checksum" in m.output(), timeout=DEADLINE,
                   what="the checksum failure in the log")


def test_sigterm_unmounts_cleanly(store, workdir):
    m = Mount(store.path, workdir / "mnt-term").start()
    try:
        assert os.listdir(m.mnt)
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(timeout=DEADLINE) == 0
        assert not _in_mountinfo(m.mnt)
        assert os.listdir(m.mnt) == []
    finally:
        m.stop()


def test_dead_mount_point_gives_a_way_out(store, workdir):
    m = Mount(store.path, workdir / "mnt-dead").start()
    try:
        m.proc.send_signal(signal.SIGKILL)        # no chance to unmount
        m.proc.wait(timeout=DEADLINE)
        with pytest.raises(OSError) as ei:
            os.statvfs(m.mnt)                     # stat may be answered from cache
        assert ei.value.errno == errno.ENOTCONN
        r = subprocess.run([sys.executable, "-m", "swarmfs.mount._fuse", store.path, m.mnt,
                            "--foreground"], capture_output=True, text=True, timeout=DEADLINE)
        assert r.returncode == 1
        assert "Transport endpoint is not connected" in r.stderr
        assert "umount --lazy" in r.stderr
        umount(m.mnt, lazy=True)
        assert not _in_mountinfo(m.mnt) and os.listdir(m.mnt) == []
        with pytest.raises(MountError, match="not mounted"):
            umount(m.mnt)
    finally:
        m.stop()


def test_bad_store_fails_before_mounting(workdir):
    mnt = str(workdir / "mnt-bad")
    os.makedirs(mnt, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "swarmfs.mount._fuse", str(workdir / "no-store"), mnt,
                        "--foreground"], capture_output=True, text=True, timeout=DEADLINE)
    assert r.returncode == 1 and "swarmfs: error:" in r.stderr
    assert not _in_mountinfo(mnt)


def test_background_mount_and_umount(store, workdir):
    mnt = str(workdir / "mnt-bg")
    os.makedirs(mnt, exist_ok=True)
    code = ("import sys; from swarmfs.mount._fuse import mount; "
            "print(mount(sys.argv[1], sys.argv[2], foreground=False, log_file=sys.argv[3]))")
    try:
        r = subprocess.run([sys.executable, "-c", code, store.path, mnt,
                            str(workdir / "mnt-bg.log")], capture_output=True,
                           text=True, timeout=DEADLINE)
        assert r.returncode == 0, r.stderr
        pid = int(r.stdout.split()[-1])
        assert _mounted(mnt)                 # up when mount() returned
        with open(os.path.join(mnt, "manifest.json"), "rb") as f:
            assert json.loads(f.read())["uuid"] == store.uuid
        umount(mnt)
        assert not _in_mountinfo(mnt)

        def gone():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().split(") ")[1].startswith("Z")
            except FileNotFoundError:
                return True
        wait_until(gone, what="the mount daemon to exit", timeout=DEADLINE)
    finally:
        if _in_mountinfo(mnt):
            subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)
        with contextlib.suppress(NameError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_direct_io_mode(store, workdir):
    want = store.read_cluster(1, 0).tobytes()
    with Mount(store.path, workdir / "mnt-direct", "--direct-io") as m:
        kvbin = os.path.join(_cdir(m.mnt, 1, 0), "kv.bin")
        dd = subprocess.run(["dd", f"if={kvbin}", "bs=1M", "status=none"],
                            capture_output=True, check=True).stdout
        assert dd == want
        procs = [subprocess.Popen(["sh", "-c", f"cat {kvbin} | sha256sum"],
                                  stdout=subprocess.PIPE) for _ in range(3)]
        assert {p.communicate(timeout=DEADLINE)[0].split()[0].decode() for p in procs} == \
            {_sha(want)}
        got = np.load(os.path.join(_cdir(m.mnt, 0, 9), "kv.npy"))
        assert same_bits(got, store.read_cluster(0, 9))
        fd = os.open(kvbin, os.O_RDONLY)
        try:
            assert os.pread(fd, 10_000, 123_457) == want[123_457:133_457]
        finally:
            os.close(fd)
        _mmap_both_ways(m.mnt, store, shared_ok=False)


@pytest.mark.slow
def test_readers_sharing_one_open_file_get_correct_bytes(store, workdir):
    """The stream contract (issue 26): reads of one open file share its
    read-ahead windows but wait only for their own entries.  On one file
    handle, six threads read the file front to back in turn (a shared
    cursor: read-ahead windows are made, hit, consumed and dropped under
    them) while two read at random offsets and sizes (misses that read
    without the stream's lock and recycle their buffers); three passes:
    every read returns the file's bytes, and both kinds of read happened."""
    want = store.read_cluster(1, 0).tobytes()
    n, chunk = len(want), 16_384
    with Mount(store.path, workdir / "mnt-shared", "--direct-io") as m:
        fd = os.open(os.path.join(_cdir(m.mnt, 1, 0), "kv.bin"), os.O_RDONLY)
        bad, cursor, lock, done = [], [0], threading.Lock(), threading.Event()

        def sequential():
            while True:
                with lock:
                    off = cursor[0]
                    if off >= 3 * n:
                        return
                    cursor[0] += chunk
                off %= n
                got = os.pread(fd, chunk, off)
                if got != want[off:off + chunk]:
                    bad.append(("seq", off))

        def random_reader(k):
            r = np.random.default_rng(k)
            while not done.is_set():
                off, size = int(r.integers(0, n - 1)), int(r.integers(1, 70_000))
                if os.pread(fd, size, off) != want[off:off + size]:
                    bad.append(("rand", off, size))
                time.sleep(0.002)
        try:
            rnd = [threading.Thread(target=random_reader, args=(k,)) for k in range(2)]
            seq = [threading.Thread(target=sequential) for _ in range(6)]
            for t in rnd + seq:
                t.start()
            for t in seq:
                t.join(DEADLINE)
            done.set()
            for t in rnd:
                t.join(DEADLINE)
            assert not any(t.is_alive() for t in rnd + seq)
            st = json.loads(pathlib.Path(m.mnt, "stats.json").read_text())["mount"]["kv_reader"]
        finally:
            os.close(fd)
    assert bad == []
    assert st["readahead_hits"] > 0 and st["readahead_misses"] > 0


def test_refused_mount_names_dev_fuse_once(workdir, rng):
    """Issue 9 item 8: --allow-other as a user who cannot open /dev/fuse gets
    the /dev/fuse cause (not /etc/fuse.conf), with the context printed once."""
    import tempfile
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as another user")
    if os.access("/dev/fuse", os.R_OK | os.W_OK, effective_ids=False) and \
            os.stat("/dev/fuse").st_mode & 0o006:
        pytest.skip("/dev/fuse is open to every user here")
    top = tempfile.mkdtemp(prefix="swarmfs-nobody-")
    try:
        os.chmod(top, 0o755)
        path = os.path.join(top, "store")
        _random_store(path, rng, 64, 4)
        for root, dirs, files in os.walk(top):
            for n in dirs:
                os.chmod(os.path.join(root, n), 0o755)
            for n in files:
                os.chmod(os.path.join(root, n), 0o644)
        mnt = os.path.join(top, "mnt")
        os.makedirs(mnt)
        os.chown(mnt, 65534, 65534)
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            sys.executable, "-m", "swarmfs.mount._fuse", path, mnt, "--foreground",
                            "--allow-other"], capture_output=True, text=True, timeout=DEADLINE,
                           cwd="/")
        assert r.returncode == 1, r.stderr
        err = [line for line in r.stderr.splitlines() if line.startswith("swarmfs: error:")]
        assert len(err) == 1, r.stderr
        assert "cannot open /dev/fuse" in err[0] and "fuse.conf" not in err[0]
        assert err[0].count(f"store {path}") == 1 and err[0].count("[") == 1
        assert not _in_mountinfo(mnt)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _random_store(path, rng, S, n):
    """A closed 2-disk store of one float16 layer (2 KV heads x 16): S random
    entries in n random clusters."""
    with Store.create(path, disks=2, num_layers=1, num_kv_heads=2, head_dim=16) as s:
        s.write_layer(0, random_kv(rng, S, 2, 16, "float16"), random_clusters(rng, S, n))


def _cluster_bytes(path):
    """{cluster: bytes} of layer 0 as the fast path reads it now, and the
    generation."""
    with Store.open(path) as s:
        return {c: s.read_cluster(0, c).tobytes() for c in range(s.num_clusters(0))}, \
            s.manifest["generation"]


@pytest.mark.slow
def test_follow_shows_appends_and_open_files_keep_their_generation(workdir, rng):
    path = str(workdir / "follow")
    H, d = 2, 16
    s = Store.create(path, disks=3, num_layers=2, num_kv_heads=H, head_dim=d)
    s.write_layer(0, random_kv(rng, 3000, H, d, "float16"),
                  [np.arange(i * 100, (i + 1) * 100) for i in range(30)])
    s.close()
    gens = {}
    g0, gen = _cluster_bytes(path)
    gens[gen] = g0
    with Mount(path, workdir / "mnt-follow", "--poll-interval", "0.05") as m:
        cl = os.path.join(m.mnt, "layers", "00", "clusters")
        assert len(os.listdir(cl)) == 30
        assert not os.path.exists(os.path.join(cl, "000030.npy"))   # negative lookup
        # held open across the commits below (closed after them)
        held = open(os.path.join(cl, "000000", "kv.bin"), "rb")  # noqa: SIM115 - cluster 0, gen 0
        held_npy = open(os.path.join(cl, "000001.npy"), "rb")    # noqa: SIM115
        first = held.read(4096)
        stop = threading.Event()
        bad, seen = [], []

        def reader():          # whole files, each equal to one generation's bytes
            r = np.random.default_rng(0)
            while not stop.is_set():
                c = int(r.integers(0, 30))
                try:
                    with open(os.path.join(cl, f"{c:06d}", "kv.bin"), "rb") as f:
                        got = f.read()
                except OSError as exc:      # ESTALE is a clean failure; nothing else is
                    if exc.errno != errno.ESTALE:
                        bad.append((c, repr(exc)))
                    continue
                seen.append((c, _sha(got)))  # checked against every generation below

        t = threading.Thread(target=reader)
        t.start()
        try:
            w = Store.open(path, writable=True)
            try:
                for _ in range(3):
                    n = 150
                    joins = [np.array([0]) if i % 3 == 0 else np.array([], dtype=np.int64)
                             for i in range(n)]
                    w.append(0, random_kv(rng, n, H, d, "float16"), joins, new_cluster_size=64)
                    t_commit = time.monotonic()
                    cs, gen = _cluster_bytes(path)
                    gens[gen] = cs
                    C = len(cs)
                    # new clusters appear, within a second of the commit
                    wait_until(lambda C=C: os.path.exists(os.path.join(cl, f"{C - 1:06d}.npy")),
                               timeout=1.0, what=f"cluster {C - 1} of generation {gen}")
                    assert time.monotonic() - t_commit < 1.0
                    names = os.listdir(cl)
                    assert len(names) == C and f"{C - 1:06d}.npy" in names
                    for c in (0, C - 1, C - 2):       # changed and new clusters, both paths
                        # cluster 0 changed: its old names are invalidated right
                        # after the new generation is shown
                        def current(c=c, cs=cs):
                            with open(os.path.join(cl, f"{c:06d}", "kv.bin"), "rb") as f:
                                a = f.read()
                            b = np.load(os.path.join(cl, f"{c:06d}.npy")).tobytes()
                            return a == cs[c] and b == cs[c]
                        wait_until(current,
                                   timeout=max(0.05, 1.0 - (time.monotonic() - t_commit)),
                                   what=f"cluster {c} of generation {gen}")
                        assert os.stat(os.path.join(cl, f"{c:06d}.npy")).st_size == \
                            len(T.npy_header("<f2", (len(cs[c]) // w.entry_bytes, 2, H, d))) \
                            + len(cs[c])
                    with open(os.path.join(m.mnt, "manifest.json"), "rb") as f:
                        assert json.loads(f.read())["generation"] == gen
                # a layer written while mounted appears too
                w.write_layer(1, random_kv(rng, 200, H, d, "float16"),
                              [np.arange(0, 120), np.arange(120, 200)])
                wait_until(lambda: os.path.isdir(os.path.join(m.mnt, "layers", "01")),
                           timeout=1.0, what="layer 1")
                assert os.listdir(os.path.join(m.mnt, "layers", "01", "clusters")) == \
                    ["000000.npy", "000001.npy"] or sorted(
                        os.listdir(os.path.join(m.mnt, "layers", "01", "clusters"))) == \
                    ["000000.npy", "000001.npy"]
            finally:
                w.close()
        finally:
            stop.set()
            t.join(DEADLINE)
        # the files held open across four commits read their own generation
        rest = held.read()
        held.close()
        assert first + rest == g0[0] and len(g0[0]) != len(gens[gen][0])
        got = np.load(held_npy)
        held_npy.close()
        assert got.tobytes() == g0[1]
        assert not bad, bad[:5]
        shas = {c: {_sha(cs[c]) for cs in gens.values() if c in cs} for c in range(30)}
        mixed = [(c, h) for c, h in seen if h not in shas[c]]
        assert not mixed and len(seen) > 0, (len(mixed), len(seen))
        with open(os.path.join(m.mnt, "stats.json")) as f:
            st_ = json.load(f)["mount"]
        assert st_["generations_seen"] >= 5 and st_["follow"] is True


def test_snapshot_keeps_the_mount_time_view(workdir, rng):
    path = str(workdir / "snap")
    _random_store(path, rng, 400, 8)
    g0, gen0 = _cluster_bytes(path)
    with Mount(path, workdir / "mnt-snap", "--snapshot") as m, \
            Mount(path, workdir / "mnt-snap-follow", "--poll-interval", "0.05") as f:
        cl = os.path.join(m.mnt, "layers", "00", "clusters")
        with Store.open(path, writable=True) as w:
            w.append(0, random_kv(rng, 100, 2, 16, "float16"), new_cluster_size=50)
        # the following mount is the witness that the commit is visible
        wait_until(lambda: os.path.exists(os.path.join(f.mnt, "layers", "00", "clusters",
                                                       "000009.npy")),
                   timeout=DEADLINE, what="the append")
        assert len(os.listdir(cl)) == 8 and not os.path.exists(os.path.join(cl, "000008.npy"))
        with open(os.path.join(m.mnt, "manifest.json")) as fh:
            assert json.load(fh)["generation"] == gen0
        assert np.load(os.path.join(cl, "000003.npy")).tobytes() == g0[3]


def test_a_damaged_new_manifest_keeps_the_shown_generation(workdir, rng):
    path = str(workdir / "damaged")
    _random_store(path, rng, 300, 6)
    g0, _ = _cluster_bytes(path)
    mf = os.path.join(path, "manifest.json")
    with open(mf, "rb") as f:
        good = f.read()
    with Mount(path, workdir / "mnt-damaged", "--poll-interval", "0.05") as m:
        cl = os.path.join(m.mnt, "layers", "00", "clusters")
        tmp = mf + ".bad"
        with open(tmp, "wb") as f:
            f.write(good[:len(good) // 2])          # a torn manifest, committed by rename
        os.replace(tmp, mf)
        wait_until(lambda: "cannot show the store's new generation" in m.output(),
                   what="the refresh failure in the log", timeout=DEADLINE)
        assert sorted(os.listdir(cl)) == [f"{c:06d}.npy" for c in range(6)]
        assert np.load(os.path.join(cl, "000002.npy")).tobytes() == g0[2]
        with open(os.path.join(m.mnt, "stats.json")) as f:
            st_ = json.load(f)["mount"]
        assert st_["refresh_errors"] >= 1 and st_["generations_seen"] == 1
        assert m.output().count("cannot show the store's new generation") == 1  # once per cause
        with open(tmp, "wb") as f:
            f.write(good)
        os.replace(tmp, mf)
        with Store.open(path, writable=True) as w:
            w.append(0, random_kv(rng, 10, 2, 16, "float16"), new_cluster_size=10)
        wait_until(lambda: os.path.exists(os.path.join(cl, "000006.npy")), timeout=5.0,
                   what="the next good generation")
