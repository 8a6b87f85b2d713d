"""Store round trips and failure modes (the storage core)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import swarmfs
from conftest import is_root, random_clusters, random_kv, same_bits
from swarmfs import Store
from swarmfs import _errors as E
from swarmfs.store import _format as F


def make_store(path, rng, *, S=600, H=2, d=16, dtype="float16", ndisks=4, clusters=40,
               extra=60, layers=(0,), engine=None, **kw):
    s = Store.create(path, disks=ndisks, num_layers=max(layers) + 1, num_kv_heads=H,
                     head_dim=d, dtype=dtype, engine=engine, **kw)
    kvs, cls = {}, {}
    for layer in layers:
        kv = random_kv(rng, S, H, d, dtype)
        c = random_clusters(rng, S, clusters, extra)
        s.write_layer(layer, kv, c)
        kvs[layer], cls[layer] = kv, c
    return s, kvs, cls


@pytest.mark.slow
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(S=st.integers(1, 300), H=st.sampled_from([1, 2, 3, 8]), d=st.sampled_from([4, 16, 32, 64]),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]), ndisks=st.integers(1, 8),
       nclusters=st.integers(1, 30), extra=st.integers(0, 100), seed=st.integers(0, 2**31),
       engine=st.sampled_from(["io_uring", "threads"]))
def test_every_entry_round_trips_bit_exact(tmp_path_factory, S, H, d, dtype, ndisks,
                                           nclusters, extra, seed, engine):
    rng = np.random.default_rng(seed)
    nclusters = min(nclusters, S)
    path = tmp_path_factory.mktemp("rt")
    s, kvs, cls = make_store(path, rng, S=S, H=H, d=d, dtype=dtype, ndisks=ndisks,
                             clusters=nclusters, extra=extra, engine=engine)
    kv, clusters = kvs[0], cls[0]
    with s:
        for cid, members in enumerate(clusters):
            got = s.read_cluster(0, cid)
            assert same_bits(got, kv[members])
            assert list(s.cluster_tokens(0, cid)) == list(members)
        toks = rng.integers(0, S, size=min(3 * S, 500))
        assert same_bits(s.read_entries(0, toks), kv[toks])
        assert s.stats().engine.engine == engine
    with Store.open(path, engine=engine) as s2:
        assert same_bits(s2.read_entries(0, np.arange(S)), kv)
        assert s2.verify() == []


def test_replica_index_maps_every_copy(tmp_path, rng):
    s, kvs, cls = make_store(tmp_path / "st", rng)
    li = s.layer(0)
    counts = np.zeros(600, dtype=int)
    for c in cls[0]:
        counts[c] += 1
    assert (np.diff(li.tok_ptr) == counts).all()
    # every copy of token t holds t's bytes
    t = int(np.argmax(counts))
    for c in li.token_copies([t]):
        assert li.members[c] == t
    assert s.info()["replication"] == pytest.approx(counts.sum() / 600, abs=1e-3)
    s.close()


@pytest.mark.slow
def test_torch_and_pinned_output(tmp_path, rng):
    torch = pytest.importorskip("torch")
    for dtype in ("float16", "bfloat16"):
        s, kvs, cls = make_store(tmp_path / dtype, rng, dtype=dtype)
        t = s.read_cluster(0, 3, torch=True)
        assert isinstance(t, torch.Tensor) and tuple(t.shape[1:]) == (2, 2, 16)
        assert t.dtype == {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        want = torch.from_numpy(kvs[0][cls[0][3]].view(np.int16)).view(t.dtype)
        assert torch.equal(t.view(torch.int16), want.view(torch.int16))
        p = s.read_entries(0, [5, 1, 5], torch=True, pinned=True)
        assert same_bits(p.view(torch.int16).numpy(), kvs[0][[5, 1, 5]].view(np.int16))
        s.close()


def test_multiple_layers_and_rewrite(tmp_path, rng):
    s, kvs, cls = make_store(tmp_path / "st", rng, layers=(0, 2))
    assert s.layers == [0, 2]
    with pytest.raises(E.OutOfRangeError):
        s.read_cluster(1, 0)
    kv_new = random_kv(rng, 100, 2, 16, "float16")
    s.write_layer(0, kv_new, [np.arange(50), np.arange(50, 100)])
    assert same_bits(s.read_cluster(0, 1), kv_new[50:])
    assert same_bits(s.read_cluster(2, 0), kvs[2][cls[2][0]])
    s.close()
    with Store.open(tmp_path / "st") as s2:
        assert s2.num_tokens(0) == 100 and s2.verify() == []
    # only the referenced index files (and the previous generation) remain
    names = os.listdir(tmp_path / "st" / F.INDEX_DIR)
    assert len(names) <= 3


# -- bad input and faults ----------------------------------------------------

def test_store_path_present_is_refused_without_force(tmp_path, rng):
    s, _, _ = make_store(tmp_path / "st", rng)
    s.close()
    with pytest.raises(E.StoreExistsError) as ei:
        Store.create(tmp_path / "st", disks=2, num_layers=1, num_kv_heads=1, head_dim=8)
    assert "st" in str(ei.value)
    s = Store.create(tmp_path / "st", disks=2, num_layers=1, num_kv_heads=1, head_dim=8,
                     force=True)
    assert s.layers == [] and s.num_disks == 2
    s.close()


def test_foreign_disk_is_refused(tmp_path, rng):
    s, _, _ = make_store(tmp_path / "a", rng)
    disk0 = s.disk_paths[0]
    s.close()
    with pytest.raises(E.StoreExistsError) as ei:
        Store.create(tmp_path / "b", disks=[disk0, tmp_path / "x.img"], num_layers=1,
                     num_kv_heads=1, head_dim=8)
    assert ei.value.disk == 0


def test_flipped_byte_is_caught_naming_disk_and_cluster(tmp_path, rng):
    s, kvs, cls = make_store(tmp_path / "st", rng)
    li = s.layer(0)
    cid = 7
    copies = li.cluster_copies([cid])
    c = int(copies[2])
    disk, off = int(li.copy_disk[c]), int(li.copy_off[c])
    path = s.disk_paths[disk]
    s.close()
    with open(path, "r+b") as f:
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 0x40]))
    with Store.open(tmp_path / "st") as s:
        with pytest.raises(E.ChecksumError) as ei:
            s.read_cluster(0, cid)
        assert ei.value.disk == disk and ei.value.layer == 0
        # the token may live in several clusters; the copy read belongs to cid here
        assert ei.value.cluster == cid
        bad = s.verify()
        assert len(bad) == 1 and bad[0]["disk"] == disk and bad[0]["cluster"] == cid
        # reads that avoid the bad entry still work: every cluster without
        # the damaged token reads back bit-exact
        bad_token = int(li.members[c])
        others = [o for o in range(len(cls[0])) if o != cid and bad_token not in cls[0][o]]
        assert len(others) >= len(cls[0]) // 2
        for o in others:
            assert same_bits(s.read_cluster(0, o), kvs[0][cls[0][o]])
    with Store.open(tmp_path / "st", verify=False) as s:
        s.read_cluster(0, cid)  # checksums off: the read succeeds
        assert s.stats().verify_checksums is False


def test_truncated_disk(tmp_path, rng):
    s, _, _ = make_store(tmp_path / "st", rng)
    path = s.disk_paths[2]
    s.close()
    os.truncate(path, os.path.getsize(path) - 4096)
    with pytest.raises(E.DiskTruncatedError) as ei:
        Store.open(tmp_path / "st")
    assert ei.value.disk == 2 and path in str(ei.value)


def test_swapped_missing_and_foreign_disks(tmp_path, rng):
    s, _, _ = make_store(tmp_path / "st", rng)
    p0, p1 = s.disk_paths[0], s.disk_paths[1]
    s.close()
    tmp = p0 + ".tmp"
    os.rename(p0, tmp)
    with pytest.raises(E.DiskMissingError) as ei:
        Store.open(tmp_path / "st")
    assert ei.value.disk == 0
    os.rename(p1, p0)
    os.rename(tmp, p1)
    with pytest.raises(E.DiskMismatchError) as ei:
        Store.open(tmp_path / "st")
    assert ei.value.disk == 0 and "swapped" in str(ei.value)
    os.rename(p0, tmp)
    os.rename(p1, p0)
    os.rename(tmp, p1)
    other, _, _ = make_store(tmp_path / "other", rng)
    other.close()
    shutil.copy(other.disk_paths[3], s.disk_paths[3])
    with pytest.raises(E.DiskMismatchError) as ei:
        Store.open(tmp_path / "st")
    assert ei.value.disk == 3 and "another store" in str(ei.value)
    with open(s.disk_paths[3], "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(E.DiskMismatchError):
        Store.open(tmp_path / "st")


def test_shape_and_dtype_mismatch_on_write(tmp_path, rng):
    s = Store.create(tmp_path / "st", disks=2, num_layers=2, num_kv_heads=2, head_dim=8)
    kv = random_kv(rng, 10, 2, 8, "float16")
    with pytest.raises(E.ShapeError, match="dtype"):
        s.write_layer(0, kv.astype(np.float32), [np.arange(10)])
    with pytest.raises(E.ShapeError, match="shape"):
        s.write_layer(0, kv[:, :, :1], [np.arange(10)])
    with pytest.raises(E.ShapeError, match="no cluster"):
        s.write_layer(0, kv, [np.arange(9)])
    with pytest.raises(E.ShapeError, match="twice"):
        s.write_layer(0, kv, [np.array([0, 1, 1]), np.arange(10)])
    with pytest.raises(E.ShapeError, match="medoid"):
        s.write_layer(0, kv, [np.arange(5), np.arange(5, 10)], medoids=[0, 1])
    with pytest.raises(E.OutOfRangeError):
        s.write_layer(5, kv, [np.arange(10)])
    assert s.layers == [] and s.manifest["generation"] == 0
    s.close()


#: (what, call(store, kvs, clusters), the error): reads out of range, and
#: arguments of the wrong type (strict: a float or bool is not an index)
REFUSED = [
    ("cluster out of range", lambda s, kvs, cls: s.read_cluster(0, 10_000), E.OutOfRangeError),
    ("token past the end", lambda s, kvs, cls: s.read_entries(0, [0, 600]), E.OutOfRangeError),
    ("negative token", lambda s, kvs, cls: s.read_entries(0, [-1]), E.OutOfRangeError),
    ("layer out of range", lambda s, kvs, cls: s.read_cluster(7, 0), E.OutOfRangeError),
    ("float cluster", lambda s, kvs, cls: s.read_cluster(0, 1.9), E.OutOfRangeError),
    ("bool layer", lambda s, kvs, cls: s.read_cluster(True, 1), E.OutOfRangeError),
    ("float tokens", lambda s, kvs, cls: s.read_entries(0, [1.0, 2.0]), E.OutOfRangeError),
    ("negative hot", lambda s, kvs, cls: s.write_layer(
        0, kvs[0], cls[0], hot=np.full(len(cls[0]), -1)), E.ShapeError),
    ("float clusters", lambda s, kvs, cls: s.write_layer(
        0, kvs[0], [c.astype(float) for c in cls[0]]), E.OutOfRangeError),
    ("unknown policy", lambda s, kvs, cls: s.plan(0, [1], policy="x"), E.InvalidChoiceError),
]


@pytest.mark.parametrize("call, error", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_bad_reads_and_argument_types(tmp_path, rng, call, error):
    s, kvs, cls = make_store(tmp_path / "st", rng)
    with pytest.raises(error):
        call(s, kvs, cls)
    assert s.read_entries(0, []).shape == (0, 2, 2, 16)      # an empty read is no error
    s.close()


def test_bad_manifest(tmp_path, rng):
    s, _, _ = make_store(tmp_path / "st", rng)
    s.close()
    with pytest.raises(E.StoreNotFoundError):
        Store.open(tmp_path / "none")
    mpath = tmp_path / "st" / F.MANIFEST
    good = mpath.read_text()
    m = json.loads(good)
    m["format_version"] = 99
    mpath.write_text(json.dumps(m))
    with pytest.raises(E.ManifestError, match="version"):
        Store.open(tmp_path / "st")
    mpath.write_text("{not json")
    with pytest.raises(E.ManifestError):
        Store.open(tmp_path / "st")
    mpath.write_text(good)
    idx = tmp_path / "st" / F.INDEX_DIR / m["layers"]["0"]["index"]["file"]
    raw = bytearray(idx.read_bytes())
    raw[-3] ^= 1
    idx.write_bytes(bytes(raw))
    with Store.open(tmp_path / "st") as s2, pytest.raises(E.ManifestError, match="checksum"):
        s2.read_cluster(0, 0)


class _FailingWrites:
    """Fault injection: a wrapper of the real engine whose writes fail with
    ENOSPC after ``ok`` successful write batches (reads pass through)."""

    def __init__(self, engine, ok):
        self.engine, self.ok = engine, ok

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def execute(self, op, disk, *a, **kw):
        from swarmfs.store._engine import WRITE
        if op == WRITE:
            if self.ok == 0:
                raise E.DiskFullError("injected ENOSPC", disk=int(np.asarray(disk)[0]))
            self.ok -= 1
        return self.engine.execute(op, disk, *a, **kw)


def test_disk_full_mid_write_commits_nothing(tmp_path, rng, monkeypatch):
    monkeypatch.setattr("swarmfs.store._write.WRITE_CHUNK", 64 << 10)
    s, kvs, cls = make_store(tmp_path / "st", rng, S=300)
    before = s.manifest
    s.engine = _FailingWrites(s.engine, ok=2)
    big = random_kv(rng, 3000, 2, 16, "float16")
    with pytest.raises(E.DiskFullError):
        s.write_layer(1 if s.num_layers > 1 else 0, big, random_clusters(rng, 3000, 50))
    assert s.manifest == before
    s.close()
    with Store.open(tmp_path / "st") as s2:
        assert s2.manifest == before
        assert same_bits(s2.read_entries(0, np.arange(300)), kvs[0])
        assert s2.verify() == []


def test_capacity_is_enforced_before_writing(tmp_path, rng):
    s = Store.create(tmp_path / "st", disks=2, num_layers=1, num_kv_heads=2, head_dim=16,
                     disk_size=64 << 10)
    kv = random_kv(rng, 100, 2, 16, "float16")   # 100 x 128 bytes: fits
    s.write_layer(0, kv, [np.arange(100)])
    big = random_kv(rng, 2000, 2, 16, "float16")  # 256 KiB: does not
    with pytest.raises(E.DiskFullError) as ei:
        s.write_layer(0, big, [np.arange(2000)])
    assert ei.value.disk in (0, 1)
    assert same_bits(s.read_cluster(0, 0), kv)
    s.close()


@pytest.mark.skipif(not is_root(), reason="mounting a small tmpfs needs root")
def test_real_enospc_on_a_full_filesystem(rng):
    mnt = tempfile.mkdtemp(prefix="swarmfs-full-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", mnt], check=True)
    try:
        disks = [os.path.join(mnt, f"d{i}") for i in range(2)]
        store = os.path.join(mnt, "st")
        s = Store.create(store, disks=disks, num_layers=2, num_kv_heads=2, head_dim=16)
        kv = random_kv(rng, 1000, 2, 16, "float16")   # 128 KB
        s.write_layer(0, kv, random_clusters(rng, 1000, 20))
        big = random_kv(rng, 40000, 2, 16, "float16")  # 5 MB: cannot fit
        with pytest.raises(E.DiskFullError) as ei:
            s.write_layer(1, big, random_clusters(rng, 40000, 100))
        assert ei.value.disk in (0, 1)
        s.close()
        with Store.open(store) as s2:
            assert s2.layers == [0]
            assert same_bits(s2.read_entries(0, np.arange(1000)), kv)
            assert s2.verify() == []
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)
        os.rmdir(mnt)


def test_public_names_are_exported():
    for name in ("Store", "StoreStats", "Engine", "EngineStats", "Plan", "plan_reads",
                 "SwarmError", "ChecksumError", "DiskFullError", "LayerIndex"):
        assert hasattr(swarmfs, name)
    for name in E.__all__:
        assert issubclass(getattr(E, name), E.SwarmError)
        assert getattr(swarmfs, name) is getattr(E, name)
    for name in ("Retriever", "Retrieval", "RetrievalStats", "DecodeSession", "StepResult"):
        assert hasattr(swarmfs, name)
    import swarmfs.layout as L
    for name in ("capture", "save_capture", "load_capture", "profile_layer", "cluster",
                 "Clustering", "hot_clusters", "place_clusters", "evaluate_recall"):
        assert hasattr(L, name), name


# -- appending (SWARM §6.2) ----------------------------------------------------

@pytest.mark.slow
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 60), seed=st.integers(0, 2**31), ndisks=st.integers(1, 5),
       dtype=st.sampled_from(["float16", "float32"]))
def test_append_grows_clusters_and_adds_new_ones(tmp_path_factory, n, seed, ndisks, dtype):
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("app")
    s, kvs, cls = make_store(path, rng, S=200, clusters=15, extra=20, ndisks=ndisks,
                             dtype=dtype)
    kv_new = random_kv(rng, n, 2, 16, dtype)
    joins = [rng.choice(15, size=rng.integers(0, 3), replace=False) for _ in range(n)]
    gen = s.manifest["generation"]
    pos = s.append(0, kv_new, joins, new_cluster_size=8)
    assert list(pos) == list(range(200, 200 + n))
    assert s.manifest["generation"] == gen + 1
    kv_all = np.concatenate([kvs[0], kv_new])
    li = s.layer(0)
    for c in range(15):
        added = [200 + i for i in range(n) if c in set(joins[i].tolist())]
        want = list(cls[0][c]) + added
        assert list(s.cluster_tokens(0, c)) == want
        assert same_bits(s.read_cluster(0, c), kv_all[want])
        # §6.2: appended entry j = |C_i| lands on disk (id_i + j) mod N
        for j in range(len(cls[0][c]), len(want)):
            copy = li.members_ptr[c] + j
            assert li.copy_disk[copy] == (li.start_disk[c] + j) % ndisks
    lone = [200 + i for i in range(n) if len(joins[i]) == 0]
    assert s.num_clusters(0) == 15 + -(-len(lone) // 8)
    assert same_bits(s.read_entries(0, np.arange(200 + n)), kv_all)
    assert s.verify() == []
    s.close()
    with Store.open(path) as s2:
        assert s2.num_tokens(0) == 200 + n
        assert same_bits(s2.read_entries(0, np.arange(200 + n)), kv_all)


def test_append_bad_input_commits_nothing(tmp_path, rng):
    s, kvs, cls = make_store(tmp_path / "st", rng, S=100, clusters=5, extra=0)
    before = s.manifest
    kv = random_kv(rng, 3, 2, 16, "float16")
    with pytest.raises(E.OutOfRangeError):
        s.append(0, kv, [[0], [99], []])
    with pytest.raises(E.ShapeError):
        s.append(0, kv, [[0], [1]])
    with pytest.raises(E.ShapeError):
        s.append(0, kv.astype(np.float32), None)
    with pytest.raises(E.ShapeError):
        s.append(0, kv, [[1, 1], [], []])
    assert s.manifest == before
    s.close()


# -- defects found by adversarial testing ----------------------------------------

def test_a_second_writer_builds_on_the_first_writers_commit(tmp_path, rng):
    s1, kvs, cls = make_store(tmp_path / "st", rng, layers=(0, 1, 2))
    s2 = Store.open(tmp_path / "st", writable=True)      # opened before s1's next commit
    kv1 = random_kv(rng, 50, 2, 16, "float16")
    s1.write_layer(1, kv1, [np.arange(50)])
    kv2 = random_kv(rng, 60, 2, 16, "float16")
    s2.write_layer(2, kv2, [np.arange(60)])              # must not drop layer 1's commit
    s1.close()
    s2.close()
    with Store.open(tmp_path / "st") as s:
        assert s.layers == [0, 1, 2]
        assert same_bits(s.read_entries(1, np.arange(50)), kv1)
        assert same_bits(s.read_entries(2, np.arange(60)), kv2)
        assert same_bits(s.read_entries(0, np.arange(600)), kvs[0])
        assert s.verify() == []


def test_appends_from_threads_are_serialised(tmp_path, rng):
    import threading
    s, kvs, cls = make_store(tmp_path / "st", rng, S=100, clusters=5, extra=0)
    news = [random_kv(np.random.default_rng(i), 8, 2, 16, "float16") for i in range(6)]
    got = {}

    def go(i):
        got[i] = s.append(0, news[i], None)
    ts = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(int(p[0]) for p in got.values()) == list(range(100, 148, 8))
    for i, pos in got.items():
        assert same_bits(s.read_entries(0, pos), news[i])
    assert s.num_tokens(0) == 148
    s.close()


def test_edited_manifest_is_refused(tmp_path, rng):
    s, _, _ = make_store(tmp_path / "st", rng)
    s.close()
    mpath = tmp_path / "st" / F.MANIFEST
    m = json.loads(mpath.read_text())
    m["disks"][0]["end"] = 4096                          # would let a write clobber data
    mpath.write_text(json.dumps(m))
    with pytest.raises(E.ManifestError, match="checksum"):
        Store.open(tmp_path / "st")


def test_create_refuses_to_clobber_a_file_with_data(tmp_path):
    f = tmp_path / "precious.bin"
    f.write_bytes(b"x" * 100_000)
    with pytest.raises(E.StoreExistsError) as ei:
        Store.create(tmp_path / "st", disks=[f], num_layers=1, num_kv_heads=1, head_dim=8)
    assert ei.value.disk == 0
    assert f.read_bytes() == b"x" * 100_000
    assert not (tmp_path / "st").exists()                # nothing left behind


def test_store_used_after_fork_refuses_instead_of_misreading(tmp_path, rng):
    s, kvs, _ = make_store(tmp_path / "st", rng)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            s.read_entries(0, [1, 2, 3])
        except E.SwarmError as exc:
            code = 0 if "fork" in str(exc) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert same_bits(s.read_entries(0, [1, 2, 3]), kvs[0][[1, 2, 3]])
    s.close()


def test_a_float_head_dim_is_refused(tmp_path):
    with pytest.raises(E.InvalidIntegerError, match="head_dim"):
        Store.create(tmp_path / "b", disks=1, num_layers=1, num_kv_heads=1, head_dim=2.5)


# -- inputs that once got past the checks (adversarial review) ---------------------

def _small(tmp_path, rng, layers=2):
    s = Store.create(tmp_path / "st", disks=2, num_layers=layers, num_kv_heads=2, head_dim=16)
    kv = random_kv(rng, 200, 2, 16, "float16")
    s.write_layer(0, kv, random_clusters(rng, 200, 10, 30))
    return s, kv


@pytest.mark.parametrize("kw", [{"local_window": -1}, {"local_window": "x"},
                                {"extra": {"local_window": -3}}, {"extra": {"index": 1}},
                                {"extra": [1]}])
def test_bad_layer_record_is_refused_before_commit(tmp_path, rng, kw):
    s, kv = _small(tmp_path, rng)
    with pytest.raises(E.SwarmError) as ei:
        s.write_layer(1, kv, random_clusters(rng, 200, 10, 30), **kw)
    assert "layer 1" in str(ei.value)
    s.close()
    with Store.open(tmp_path / "st") as t:          # the store still opens, layer 0 intact
        assert t.layers == [0] and same_bits(t.read_entries(0, np.arange(200)), kv)


def test_append_expect_tokens_is_enforced(tmp_path, rng):
    s, kv = _small(tmp_path, rng, layers=1)
    s.close()
    a = Store.open(tmp_path / "st", writable=True)
    b = Store.open(tmp_path / "st", writable=True)
    new = random_kv(rng, 4, 2, 16, "float16")
    assert list(a.append(0, new)) == [200, 201, 202, 203]
    with pytest.raises(E.SwarmError, match="expected 200"):
        b.append(0, new, expect_tokens=200)
    assert list(b.append(0, new, expect_tokens=204)) == [204, 205, 206, 207]
    a.close()
    b.close()


@pytest.mark.parametrize("kw, error", [
    ({"disks": "xyz"}, E.InvalidTypeError), ({"disks": True}, E.InvalidIntegerError),
    ({"disks": 2.0}, E.InvalidTypeError), ({"disks": 0}, E.InvalidIntegerError),
    ({"head_dim": 2 ** 62}, E.InvalidIntegerError), ({"num_kv_heads": 0}, E.InvalidIntegerError),
    ({"dtype": "int8"}, E.InvalidDtypeError), ({"num_query_heads": 3}, E.ShapeError)])
def test_create_refuses_bad_shapes_and_disk_specs(tmp_path, kw, error, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = {"disks": 2, "num_layers": 1, "num_kv_heads": 2, "head_dim": 16, **kw}
    with pytest.raises(error):
        Store.create(tmp_path / "st", **args)
    assert os.listdir(tmp_path) == []               # no stray disk files, no store dir


def test_closed_store_says_so(tmp_path, rng):
    s, _ = _small(tmp_path, rng)
    s.close()
    for call in (lambda: s.read_cluster(0, 0), lambda: s.read_entries(0, [1]), s.stats):
        with pytest.raises(E.SwarmError, match="closed"):
            call()


# -- issue 9: damage reports, NaN, consistent opens, argument edges --------------

def _cut_store(tmp_path, rng, cut=4096, zero_cluster=None):
    """A 3-disk store; disk 0 cut short by ``cut`` bytes at its end and,
    optionally, one extent on disk 1 overwritten."""
    s = Store.create(tmp_path / "st", disks=3, num_layers=1, num_kv_heads=2, head_dim=16)
    kv = random_kv(rng, 3000, 2, 16, "float16")
    cl = random_clusters(rng, 3000, 100, 300)
    s.write_layer(0, kv, cl)
    li = s.layer(0)
    paths = s.disk_paths
    s.close()
    if zero_cluster is not None:
        with open(paths[1], "r+b") as f:
            f.seek(int(li.extent_off[zero_cluster, 1]))
            f.write(b"\0" * 64)
    size = os.path.getsize(paths[0])
    os.truncate(paths[0], size - cut)
    return str(tmp_path / "st"), kv, cl, li, size - cut


def _past_end(li, size, Eb=128):
    on0 = np.flatnonzero((li.copy_disk == 0) & (li.copy_off + np.uint64(Eb) > size))
    return on0[np.argsort(li.copy_off[on0])]


def test_truncated_disk_reads_name_cluster_and_damage_offset(tmp_path, rng):
    """read_entries, Retriever.retrieve (via Store.execute) and execute: the
    error names disk, path, layer, the cluster and the offset of the damage
    itself (the disk's end), not the start of a merged request."""
    path, kv, cl, li, size = _cut_store(tmp_path, rng)
    first = int(_past_end(li, size)[0])
    want_cluster, want_off = int(li.copy_cluster[first]), max(int(li.copy_off[first]), size)
    with Store.open(path, damaged=True) as s:
        for read in (lambda: s.read_entries(0, np.arange(3000)),
                     lambda: s.read_cluster(0, want_cluster),
                     lambda: s.execute(s.layer(0), s.plan(0, np.arange(3000)),
                                       s.layer(0).token_copies(np.arange(3000)))):
            with pytest.raises(E.DiskTruncatedError) as ei:
                read()
            e = ei.value
            assert (e.disk, e.layer, e.cluster, e.offset) == (0, 0, want_cluster, want_off)
            assert e.path.endswith("disk-0.img") and f"offset {want_off}" in str(e)
        from swarmfs import Retriever
        r = Retriever(s, ratio=1.0)
        q = rng.standard_normal((2, 16)).astype(np.float32)
        with pytest.raises(E.DiskTruncatedError) as ei:
            r.retrieve(0, q)
        assert ei.value.offset is not None and ei.value.cluster is not None
        assert ei.value.offset >= size


def test_verify_reports_every_damaged_extent_of_a_batch(tmp_path, rng):
    """A cut disk and a zeroed extent elsewhere in the same batch: both are
    reported, each with its cluster and the offset of the first damaged
    entry; the store that no longer opens is verified with damaged=True."""
    path, kv, cl, li, size = _cut_store(tmp_path, rng, zero_cluster=5)
    with pytest.raises(E.DiskTruncatedError):
        Store.open(path)
    with Store.open(path, damaged=True) as s:
        assert isinstance(s.disk_problems[0], E.DiskTruncatedError)
        bad = s.verify()
    by = {(f["cluster"], f["disk"]): f for f in bad}
    assert (5, 1) in by and by[(5, 1)]["offset"] == int(li.extent_off[5, 1])
    assert by[(5, 1)]["entries"] == 1
    past = _past_end(li, size)
    cut_clusters = set(li.copy_cluster[past].tolist())
    assert {c for c, d in by if d == 0} == cut_clusters
    for f in bad:
        assert f["path"] and f["layer"] == 0 and f["offset"] >= f["extent_offset"]
    # the damaged tokens are exactly those past the end plus the zeroed one;
    # a token is lost when no intact replica is left
    damaged = set(li.members[past].tolist()) | set(by[(5, 1)]["tokens"])
    assert set().union(*(f["tokens"] for f in bad)) == damaged
    counts = np.bincount(li.members, minlength=3000)
    for f in bad:
        for t in f["tokens"]:
            assert (t in f["lost"]) == (counts[t] == 1 or all(
                c in set(past.tolist()) for c in li.token_copies([t])))


def test_verify_of_a_read_error_names_the_entry(tmp_path, rng, monkeypatch):
    """An EIO in one batch (injected): the batch is re-read extent by extent,
    the failing extent is named and the other extents are still checked."""
    s, kvs, cls = make_store(tmp_path / "st", rng)
    li = s.layer(0)
    bad_off = int(li.extent_off[3, 2])
    real = s.engine.execute

    def execute(op, disk, off, length, *a, **kw):
        off_a = np.asarray(off, np.uint64)
        if np.any((np.asarray(disk) == 2) & (off_a == bad_off)):
            import errno
            raise E.IOFailedError("injected EIO", errno=errno.EIO, disk=2)
        return real(op, disk, off, length, *a, **kw)
    monkeypatch.setattr(s.engine, "execute", execute)
    monkeypatch.setattr(os, "preadv", _failing_preadv(bad_off, os.preadv))
    bad = s.verify()
    assert [(f["cluster"], f["disk"]) for f in bad] == [(3, 2)]
    assert bad[0]["offset"] == bad_off and "read failed" in bad[0]["error"]
    s.close()


def _failing_preadv(bad_off, real):
    import errno

    def preadv(fd, bufs, off, *a):
        if off == bad_off:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, off, *a)
    return preadv


def test_cli_verify_on_a_store_that_does_not_open(tmp_path, rng):
    path, kv, cl, li, size = _cut_store(tmp_path, rng, zero_cluster=5)
    p = subprocess.run([sys.executable, "-m", "swarmfs", "verify", path, "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    out = json.loads(p.stdout)
    assert out["disk_problems"][0]["disk"] == 0
    assert "truncated" in out["disk_problems"][0]["error"]
    assert {f["cluster"] for f in out["failures"]} >= {5}
    assert all(f["offset"] is not None for f in out["failures"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_kv_is_refused_naming_layer_and_token(tmp_path, rng, dtype, bad):
    s = Store.create(tmp_path / "st", disks=2, num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype=dtype)
    kv = random_kv(rng, 50, 2, 8, dtype)
    x = kv.astype(np.float32)
    x[17, 0, 1, 3] = bad                      # K, head 1
    with pytest.raises(E.ShapeError, match="K of token 17 .KV head 1. is NaN or infinite") \
            as ei:
        s.write_layer(1, x.astype(kv.dtype), [np.arange(50)])
    assert ei.value.layer == 1 and s.layers == []
    s.write_layer(1, kv, [np.arange(50)])
    y = kv[:3].astype(np.float32)
    y[2, 1, 0, 0] = bad                       # V of the third new token
    with pytest.raises(E.ShapeError, match="V of token 52"):
        s.append(1, y.astype(kv.dtype), [[0], [], []])
    assert s.num_tokens(1) == 50
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(x.astype(np.float32)).to({"float16": torch.float16, "bfloat16":
                                                   torch.bfloat16,
                                                   "float32": torch.float32}[dtype])
    with pytest.raises(E.ShapeError, match="token 17"):
        s.write_layer(0, t, [np.arange(50)])
    s.close()


def test_preload_open_while_a_writer_appends_sees_one_generation(tmp_path, rng):
    """Item 12: readers opening with preload=True while a writer appends
    never get a transient ManifestError (and read what they opened)."""
    import threading
    s, kvs, _ = make_store(tmp_path / "st", rng, S=300, ndisks=2)
    stop = threading.Event()
    errors = []

    appends = []

    def writer():
        k = 0
        try:
            while not stop.is_set():
                i = (k % 150) * 2
                s.append(0, kvs[0][i:i + 2], [[k % 40], []])
                k += 1
                appends.append(k)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion
            errors.append(exc)
    t = threading.Thread(target=writer)
    t.start()
    opens = 0
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            try:
                with Store.open(tmp_path / "st", preload=True) as r:
                    n = r.num_tokens(0)
                    got = r.read_entries(0, np.arange(300))
                    assert same_bits(got, kvs[0]) and n >= 300
                opens += 1
            except E.SwarmError as exc:
                errors.append(exc)
    finally:
        stop.set()
        t.join()
    s.close()
    assert opens >= 20 and len(appends) >= 20 and errors == [], errors[:3]


def test_deleted_index_file_on_a_fresh_open_says_missing(tmp_path, rng):
    s, _, _ = make_store(tmp_path / "st", rng, layers=(0, 1))
    name = s.manifest["layers"]["1"]["index"]["file"]
    s.close()
    with Store.open(tmp_path / "st") as s2:
        os.unlink(tmp_path / "st" / F.INDEX_DIR / name)
        with pytest.raises(E.ManifestError, match="missing") as ei:
            s2.layer(1)
        assert "rewritten" not in str(ei.value)
    with pytest.raises(E.ManifestError, match="missing"):
        Store.open(tmp_path / "st")


@pytest.mark.parametrize("call", [
    lambda s: Store.create(s.path + "x", disks=1, num_layers=1, num_kv_heads=1, head_dim=8,
                           disk_size=-1),
    lambda s: Store.create(s.path + "x", disks=1, num_layers=1, num_kv_heads=1, head_dim=8,
                           disk_size=1.5),
    lambda s: s.append(0, s.read_entries(0, [0]), None, new_cluster_size=1.5),
    lambda s: s.append(0, s.read_entries(0, [0]), None, new_cluster_size=0),
    lambda s: s.read_cluster_range(0, 0, -1, 10),
    lambda s: s.read_cluster_range(0, 0, 0, -10),
    lambda s: s.plan(0, [1], max_request=0),
    lambda s: s.plan(0, [1], max_gap=-1),
    lambda s: s.verify(max_batch=0),
    lambda s: Store.open(s.path, preload="yes"),
])
def test_bad_arguments_are_invalid_argument_errors(tmp_path, rng, call):
    """Item 14's leftovers: refused with InvalidArgumentError (both a
    ValueError and a TypeError), nothing changed."""
    s = Store.create(tmp_path / "st", disks=2, num_layers=1, num_kv_heads=2, head_dim=8)
    kv = random_kv(rng, 40, 2, 8, "float16")
    s.write_layer(0, kv, [np.arange(40)])
    s.close()
    s = Store.open(tmp_path / "st", writable=True)
    before = s.manifest
    with pytest.raises(E.InvalidArgumentError) as ei:
        call(s)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, TypeError)
    assert s.manifest == before and not os.path.exists(s.path + "x")
    s.close()


def test_store_api_raises_only_swarm_errors(tmp_path, rng):
    """Item 15: odd arguments of every kind get a SwarmError, never a raw
    exception (an unexpected one would be an InternalError)."""
    s, kvs, _ = make_store(tmp_path / "st", rng)
    odd = [None, "x", 1.5, [1.5], [[1, 2]], {"a": 1}, -1, 2**70, np.array([np.nan]),
           object(), [None], b"1"]
    calls = [lambda v: s.read_cluster(0, v), lambda v: s.read_entries(0, v),
             lambda v: s.read_entries(v, [1]), lambda v: s.plan(0, v),
             lambda v: s.cluster_tokens(0, v), lambda v: s.read_cluster_range(0, 1, v, 10),
             lambda v: s.verify(layers=v), lambda v: s.write_layer(0, v, [[0]]),
             lambda v: s.append(0, kvs[0][:1], v), lambda v: s.layer(v),
             lambda v: s.read_entries(0, [1], policy=v)]
    for call in calls:
        for v in odd:
            try:
                call(v)
            except E.InternalError:
                raise
            except E.SwarmError:
                pass
    s.close()


def test_boundary_turns_a_bug_into_an_internal_error():
    @E.boundary
    def buggy():
        return {}["x"]
    with pytest.raises(E.InternalError, match="internal error in .*buggy: KeyError") as ei:
        buggy()
    assert isinstance(ei.value.__cause__, KeyError)


def test_writes_on_a_closed_store_touch_no_file(tmp_path, rng):
    """A closed store gives its disk fds back; a later append or write_layer is
    refused before anything is written or cut (the fd numbers may by then
    belong to another file of the process)."""
    s, kvs, cls = make_store(tmp_path / "st", rng, ndisks=2, S=60, clusters=6, extra=0)
    s.close()
    with pytest.raises(E.SwarmError, match="closed"), s:
        pass
    other = tmp_path / "precious"
    other.write_bytes(b"x" * 100_000)
    fds = [os.open(other, os.O_RDWR) for _ in range(4)]    # reuse the freed numbers
    try:
        with pytest.raises(E.SwarmError, match="closed"):
            s.append(0, random_kv(rng, 2, 2, 16, "float16"))
        with pytest.raises(E.SwarmError, match="closed"):
            s.write_layer(0, kvs[0], cls[0])
    finally:
        for fd in fds:
            os.close(fd)
    assert other.read_bytes() == b"x" * 100_000
    with Store.open(tmp_path / "st") as s2:
        assert same_bits(s2.read_entries(0, np.arange(60)), kvs[0])


def test_a_damaged_open_refuses_reads_of_a_swapped_disk(tmp_path, rng):
    """Store.open(damaged=True) records swapped disks; reads that touch them
    fail even with checksums off, instead of returning the other disk's bytes."""
    s, kvs, _ = make_store(tmp_path / "st", rng, ndisks=2, S=60, clusters=6, extra=0)
    paths = list(s.disk_paths)
    s.close()
    os.rename(paths[0], str(tmp_path / "t"))
    os.rename(paths[1], paths[0])
    os.rename(str(tmp_path / "t"), paths[1])
    with Store.open(tmp_path / "st", damaged=True, verify=False) as s2:
        assert sorted(s2.disk_problems) == [0, 1]
        with pytest.raises(E.DiskMismatchError, match="damaged disk") as ei:
            s2.read_entries(0, np.arange(60))
        assert ei.value.disk in (0, 1) and ei.value.layer == 0


@pytest.mark.parametrize("edit", ["end", "free"])
def test_an_edited_allocation_is_refused_before_a_write_overwrites_a_layer(tmp_path, rng, edit):
    """A manifest whose disk end is moved back (or whose free list covers live
    data), resealed with its commit records rewritten, opens; but a writer
    checks every stored layer's extents against it first, so the append is
    refused and the layer it would have overwritten stays intact."""
    from tools.fuzz_store import _raw_manifest, reseal_manifest
    s, kvs, _ = make_store(tmp_path / "st", rng, ndisks=2, S=60, clusters=6, extra=4,
                           layers=(0, 1))
    s.close()
    orig = _raw_manifest(tmp_path / "st")
    m = _raw_manifest(tmp_path / "st")
    if edit == "end":
        m["disks"][0]["end"] -= 512
    else:
        m["disks"][0]["free"] = [[F.DATA_START, 4096, 0]]
    reseal_manifest(tmp_path / "st", m, deep=True)
    with Store.open(tmp_path / "st", writable=True) as s2, pytest.raises(E.ManifestError):
        s2.append(0, random_kv(rng, 3, 2, 16, "float16"))
    reseal_manifest(tmp_path / "st", orig, deep=True)       # undo the edit: nothing was lost
    with Store.open(tmp_path / "st") as s3:
        for layer in (0, 1):
            assert same_bits(s3.read_entries(layer, np.arange(60)), kvs[layer])
        assert s3.verify() == []


@pytest.mark.parametrize("engine", ["io_uring", "threads"])
def test_close_during_appends_and_reads_keeps_the_contract(tmp_path, rng, engine):
    """Stress: 3 appending threads and 2 readers while another thread closes the
    store.  The contract (Store.close): a write in progress commits or fails
    whole, a call after close raises SwarmError, reads return correct bytes or
    SwarmError; nothing else is raised, no other file is touched, and the store
    reopens with every committed append bit-exact."""
    import threading

    from conftest import wait_until
    s, kvs, _ = make_store(tmp_path / "st", rng, ndisks=3, S=120, clusters=12, extra=0,
                           engine=engine)
    s.close()
    s = Store.open(tmp_path / "st", writable=True, engine=engine)
    committed, errors, stop = [], [], threading.Event()
    lock = threading.Lock()

    def writer(seed):
        r = np.random.default_rng(seed)
        while not stop.is_set():
            kv = random_kv(r, 4, 2, 16, "float16")
            try:
                pos = s.append(0, kv, new_cluster_size=4)
            except E.SwarmError as exc:
                if "closed" not in str(exc):
                    errors.append(exc)
                return
            except BaseException as exc:        # noqa: BLE001 - anything else is the defect
                errors.append(exc)
                return
            with lock:
                committed.append((pos, kv))

    def reader():
        while not stop.is_set():
            try:
                got = s.read_entries(0, np.arange(120))
            except E.SwarmError as exc:
                if "closed" not in str(exc):
                    errors.append(exc)
                return
            except BaseException as exc:        # noqa: BLE001
                errors.append(exc)
                return
            if not same_bits(got, kvs[0]):
                errors.append(AssertionError("a read returned wrong bytes"))
                return

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)] + \
        [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: len(committed) >= 6, 60, "six committed appends")
    s.close()
    other = tmp_path / "other"
    other.write_bytes(b"y" * 50_000)
    fds = [os.open(other, os.O_RDWR) for _ in range(6)]        # take the freed fd numbers
    try:
        wait_until(lambda: not any(t.is_alive() for t in threads[:3]), 60,
                   "the writers to see the close")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        for fd in fds:
            os.close(fd)
    assert errors == []
    assert other.read_bytes() == b"y" * 50_000
    with Store.open(tmp_path / "st") as s2:
        assert s2.num_tokens(0) == 120 + 4 * len(committed)
        assert same_bits(s2.read_entries(0, np.arange(120)), kvs[0])
        for pos, kv in committed:
            assert same_bits(s2.read_entries(0, pos), kv)
        assert s2.verify() == []


def _cyclic():
    x = []
    x.append(x)
    return {"a": x}


def _deep(n):
    x = "leaf"
    for _ in range(n):
        x = (x,)
    return {"a": x}


@pytest.mark.parametrize("extra", [
    {1: "a", "1": "b"},                 # two keys that JSON makes one (was InternalError)
    {"a": {1: 2}},                      # read back as {"1": 2}, not as written
    {"a": [{None: 1}]}, {"a": {("t",): 1}},
    _cyclic(),                          # hung in the depth check
    _deep(100_000),                     # tuples were not counted as nesting
    {"x": float("nan")}, {"x": [1, float("-inf")]},   # not JSON: info --json printed NaN
    {"ok": [1, {"deep": None}], "s": "\u00e9"}])
def test_extra_round_trips_exactly_or_is_refused(tmp_path, rng, extra):
    """A layer's caller fields either read back exactly as written, or
    write_layer refuses them with a ShapeError naming the layer (never an
    InternalError, a hang, or fields that read back changed)."""
    import signal
    s, kv = _small(tmp_path, rng)
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("write_layer hung"))
    signal.alarm(20)
    try:
        s.write_layer(1, kv, random_clusters(rng, 200, 10, 30), extra=extra)
    except E.ShapeError as exc:
        assert "layer 1" in str(exc) and "extra" in str(exc)
    else:
        with Store.open(tmp_path / "st") as t:
            assert dict(t.committed.layers[1].extra) == extra
    finally:
        signal.alarm(0)
        s.close()
    with Store.open(tmp_path / "st") as t:          # the store opens, layer 0 intact
        assert same_bits(t.read_entries(0, np.arange(200)), kv)
