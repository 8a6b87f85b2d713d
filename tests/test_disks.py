"""Disks that are not disks: FIFOs, directories, devices, loops (issue 9 item 1),
and giving back space (item 13)."""

import os
import threading
import types

import numpy as np
import pytest

from conftest import random_clusters, random_kv
from swarmfs import Store
from swarmfs import _errors as E
from swarmfs.store import _disks as D
from swarmfs.store import _format as F
from swarmfs.store._manifest import DiskRecord
from tools.fuzz_store import _raw_manifest


def _store(tmp_path, rng, ndisks=2):
    s = Store.create(tmp_path / "st", disks=ndisks, num_layers=1, num_kv_heads=2, head_dim=8)
    s.write_layer(0, random_kv(rng, 100, 2, 8, "float16"), random_clusters(rng, 100, 5))
    paths = s.disk_paths
    s.close()
    return str(tmp_path / "st"), paths


def _open_in_thread(path, **kw):
    """Store.open in a thread with a deadline: a hang fails the test instead
    of blocking it."""
    out = {}

    def run():
        try:
            out["store"] = Store.open(path, **kw)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["exc"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "Store.open hung"
    if "store" in out:
        out["store"].close()
    return out.get("exc")


@pytest.mark.parametrize("kind,match", [("fifo", "a FIFO"), ("dir", "a directory"),
                                        ("devnull", "a character device"),
                                        ("loop", "symlink loop")])
def test_a_disk_that_is_not_a_disk_is_a_clear_disk_error(tmp_path, rng, kind, match):
    path, paths = _store(tmp_path, rng)
    os.unlink(paths[1])
    if kind == "fifo":
        os.mkfifo(paths[1])
    elif kind == "dir":
        os.mkdir(paths[1])
    elif kind == "devnull":
        os.symlink("/dev/null", paths[1])
    else:
        os.symlink(paths[1], paths[1])
    exc = _open_in_thread(path)
    assert isinstance(exc, E.DiskError) and match in str(exc), exc
    assert exc.disk == 1 and exc.path == paths[1]


def test_create_on_a_fifo_or_directory_is_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p, match in ((fifo, "FIFO"), (tmp_path, "directory")):
        with pytest.raises(E.DiskError, match=match):
            Store.create(tmp_path / "st", disks=[p], num_layers=1, num_kv_heads=1,
                         head_dim=8)


def test_damaged_open_substitutes_missing_disks(tmp_path, rng):
    path, paths = _store(tmp_path, rng, ndisks=3)
    os.unlink(paths[2])
    with Store.open(path, damaged=True) as s:
        assert set(s.disk_problems) == {2}
        assert isinstance(s.disk_problems[2], E.DiskMissingError)
        bad = s.verify()
        on_disk2 = int(s.layer(0).counts[:, 2].sum())
    with pytest.raises(E.DiskMissingError):
        Store.open(path)
    assert bad and all(f["disk"] == 2 and "unavailable" in f["error"] for f in bad)
    assert sum(f["entries"] for f in bad) == on_disk2


def test_a_failed_write_gives_its_space_back(tmp_path, rng, monkeypatch):
    """DiskFullError mid-write: growing file disks are cut back to the
    committed end (item 13)."""
    from test_store import _FailingWrites
    monkeypatch.setattr("swarmfs.store._write.WRITE_CHUNK", 64 << 10)
    path, paths = _store(tmp_path, rng)
    s = Store.open(path, writable=True)
    ends = [d["end"] for d in s.manifest["disks"]]
    s.engine = _FailingWrites(s.engine, ok=3)
    with pytest.raises(E.DiskFullError):
        s.write_layer(0, random_kv(rng, 3000, 2, 8, "float16"), random_clusters(rng, 3000, 40))
    s.engine = s.engine.engine
    s.close()
    assert [os.path.getsize(p) for p in paths] == ends
    with Store.open(path) as s2:
        assert s2.verify() == []


def test_rewrites_and_appends_reuse_freed_space(tmp_path, rng):
    """Rewriting a layer and copy-on-write appends free extents; they are
    reused two commits later, so a store rewritten many times stays bounded
    (without reuse it grows by a layer per rewrite)."""
    path, paths = _store(tmp_path, rng)
    kv = random_kv(rng, 400, 2, 8, "float16")
    cl = random_clusters(rng, 400, 20, 20)
    with Store.open(path, writable=True) as s:
        s.write_layer(0, kv, cl)
        one = max(d["end"] for d in s.manifest["disks"])
        for _ in range(8):
            s.write_layer(0, kv, cl)
        for i in range(20):
            s.append(0, kv[:2], [[i % 20], []])
        m = s.manifest
        total = np.concatenate([kv] + [kv[:2]] * 20)
        assert np.array_equal(s.read_entries(0, np.arange(440)).view(np.uint8),
                              total.view(np.uint8))
        assert s.verify() == []
    layer_bytes = one - 12288
    assert max(d["end"] for d in m["disks"]) < 12288 + 4 * layer_bytes
    assert any(d["free"] for d in m["disks"])
    # freed space is never inside what the manifest references (checked at load)
    with Store.open(path) as s:
        assert s.verify() == []


def test_freed_space_is_not_reused_while_the_previous_generation_may_be_read(tmp_path, rng):
    from swarmfs.store._write import allocate
    disks = [{"index": 0, "end": 1 << 20, "capacity": 0, "free": [[12288, 8192, 5]]}]
    base, out = allocate(disks, np.array([4096], np.uint64), gen=6)
    assert int(base[0]) == 1 << 20                   # freed by 5: not yet at 6
    base, out = allocate(disks, np.array([4096], np.uint64), gen=7)
    assert int(base[0]) == 12288 and out[0]["free"] == [[16384, 4096, 5]]
    assert disks[0]["free"] == [[12288, 8192, 5]]    # the input is not changed


def test_manifest_free_list_overlapping_data_is_refused(tmp_path, rng):
    from tools.fuzz_store import reseal_manifest
    path, _ = _store(tmp_path, rng)
    m = _raw_manifest(path)
    m["disks"][0]["free"] = [[12288, 512, 0]]
    reseal_manifest(path, m, deep=True)
    with Store.open(path) as s, pytest.raises(E.ManifestError, match="free"):
        s.layer(0)


def test_open_disk_never_blocks_on_a_fifo(tmp_path):
    p = tmp_path / "f"
    os.mkfifo(p)
    with pytest.raises(E.DiskError, match="FIFO"):
        D.open_disk(str(p), disk=0)


def test_an_open_reader_keeps_its_generation_readable(tmp_path, rng):
    """A Store opened at generation g (its lease) keeps reading correct bytes
    while a writer rewrites the layer many times: the space g references is
    not reused until the reader closes; then it is."""
    path, _ = _store(tmp_path, rng)
    kv = random_kv(rng, 300, 2, 8, "float16")
    cl = random_clusters(rng, 300, 10, 10)
    w = Store.open(path, writable=True)
    w.write_layer(0, kv, cl)
    r = Store.open(path, preload=True)
    other = random_kv(rng, 300, 2, 8, "float16")
    for _ in range(6):
        w.write_layer(0, other, cl)
    assert np.array_equal(r.read_entries(0, np.arange(300)).view(np.uint8), kv.view(np.uint8))
    assert r.verify() == []
    held = max(d["end"] for d in w.manifest["disks"])
    r.close()
    for _ in range(4):
        w.write_layer(0, other, cl)
    assert max(d["end"] for d in w.manifest["disks"]) <= held     # reused once released
    w.close()


# -- _disks on its own: what may be overwritten, headers, giving space back ------

def test_check_reusable_refuses_data_unless_forced(tmp_path, rng):
    empty, data = tmp_path / "empty.img", tmp_path / "data.img"
    empty.write_bytes(b"")
    payload = rng.integers(0, 256, 10000, dtype=np.uint8).tobytes()
    data.write_bytes(payload)
    _, paths = _store(tmp_path, rng)
    theirs = paths[1]
    for path, ok in ((empty, True), (data, False), (theirs, False)):
        fd = os.open(path, os.O_RDONLY)
        try:
            if ok:
                D.check_reusable(fd, str(path), 3, "st", False)
            else:
                with pytest.raises(E.StoreExistsError) as ei:
                    D.check_reusable(fd, str(path), 3, "st", False)
                assert ei.value.disk == 3 and ei.value.path == str(path)
                assert ("another swarmfs store" in str(ei.value)) == (path == theirs)
                assert ("holds 10000 bytes" in str(ei.value)) == (path == data)
            D.check_reusable(fd, str(path), 3, "st", True)      # force: anything goes
        finally:
            os.close(fd)
    # through Store.create: refused, the file untouched, no store left behind,
    # and the new disk d0.img it created first removed again
    with pytest.raises(E.StoreExistsError) as ei:
        Store.create(tmp_path / "new", disks=[tmp_path / "d0.img", data], num_layers=1,
                     num_kv_heads=1, head_dim=8)
    assert ei.value.disk == 1 and data.read_bytes() == payload
    assert not (tmp_path / "new").exists()
    assert not (tmp_path / "d0.img").exists()
    # an existing empty disk before the refused one is left as it was
    (tmp_path / "d0.img").write_bytes(b"")
    with pytest.raises(E.StoreExistsError):
        Store.create(tmp_path / "new", disks=[tmp_path / "d0.img", data], num_layers=1,
                     num_kv_heads=1, head_dim=8, disk_size=1 << 20)
    assert (tmp_path / "d0.img").stat().st_size == 0 and data.read_bytes() == payload


def test_read_header_reads_the_superblock_and_commit_slots(tmp_path, rng):
    _, paths = _store(tmp_path, rng)
    path = paths[0]
    with open(path, "rb") as f:
        want = f.read(F.HEADER_BYTES)
    fd = D.open_disk(path)
    try:
        raw = D.read_header(fd)
        assert raw == want and len(raw) == F.HEADER_BYTES
        assert F.unpack_superblock(raw)["disk_index"] == 0
        slots = [F.unpack_commit(raw[F.COMMIT_OFF + i * F.COMMIT_SIZE:][:F.COMMIT_SIZE])
                 for i in range(2)]
        assert max(c["generation"] for c in slots if c) >= 1
    finally:
        os.close(fd)
    short = tmp_path / "short.img"
    short.write_bytes(want[:1000])
    fd = os.open(short, os.O_RDONLY)
    try:
        assert D.read_header(fd) == want[:1000]           # short disk: short read
    finally:
        os.close(fd)


def test_truncate_to_cuts_growing_file_disks_back_to_their_end(tmp_path):
    paths = [tmp_path / f"d{i}.img" for i in range(3)]
    for p in paths:
        p.write_bytes(b"\1" * 20000)
    disks = [DiskRecord(0, "d0.img", 12288, 0, ()),        # grown past its end: cut
             DiskRecord(1, "d1.img", 12288, 20000, ()),    # fixed capacity: kept
             DiskRecord(2, "d2.img", 30000, 0, ())]        # shorter than its end: kept
    fds = [os.open(p, os.O_RDWR) for p in paths]
    try:
        D.truncate_to(fds, types.SimpleNamespace(disks=disks))
    finally:
        for fd in fds:
            os.close(fd)
    assert [p.stat().st_size for p in paths] == [12288, 20000, 20000]
    assert paths[0].read_bytes() == b"\1" * 12288
