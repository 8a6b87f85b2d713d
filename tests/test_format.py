"""On-disk format: manifest schema and bounded reads, superblock identity,
commit records and generations (issue 9, items 2-4)."""

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as hst

from conftest import random_clusters, random_kv, same_bits
from swarmfs import Store
from swarmfs import _errors as E
from swarmfs.store import _format as F
from swarmfs.store._manifest import IndexRecord
from tools.fuzz_store import _raw_manifest, reseal_manifest


@pytest.fixture
def st(tmp_path, rng):
    """A closed 3-disk store, layers 0 and 1 of 3 written, then one append."""
    path = str(tmp_path / "st")
    s = Store.create(path, disks=3, num_layers=3, num_kv_heads=2, head_dim=8)
    kv = random_kv(rng, 200, 2, 8, "float16")
    s.write_layer(0, kv, random_clusters(rng, 200, 12, 20))
    s.write_layer(1, kv, random_clusters(rng, 200, 12, 20))
    old = s.manifest
    s.append(0, kv[:3], [[0], [], []])
    s.close()
    return path, np.concatenate([kv, kv[:3]]), old


def _mpath(path):
    return os.path.join(path, F.MANIFEST)


def _opens_equal(path, kv):
    with Store.open(path) as s:
        return same_bits(s.read_entries(0, np.arange(kv.shape[0])), kv)


# -- item 2: bounded metadata reads ------------------------------------------

def test_manifest_symlink_to_dev_zero_is_a_bounded_error(st):
    path, _, _ = st
    os.unlink(_mpath(path))
    os.symlink("/dev/zero", _mpath(path))
    code = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30));"
            f"from swarmfs import Store, _errors as E\n"
            f"try:\n Store.open({path!r})\nexcept E.ManifestError as e: print('OK', e)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.startswith("OK") and "not a regular file" in p.stdout, p.stderr


def test_manifest_fifo_does_not_block(st):
    path, _, _ = st
    os.unlink(_mpath(path))
    os.mkfifo(_mpath(path))
    with pytest.raises(E.ManifestError, match="not a regular file") as ei:
        Store.open(path)
    assert ei.value.path.endswith(F.MANIFEST)


def test_manifest_symlink_loop_and_directory(st):
    path, _, _ = st
    os.unlink(_mpath(path))
    os.symlink(_mpath(path), _mpath(path))
    with pytest.raises(E.ManifestError, match="symlink loop") as ei:
        Store.open(path)
    assert F.MANIFEST in str(ei.value)
    os.unlink(_mpath(path))
    os.mkdir(_mpath(path))
    with pytest.raises(E.ManifestError, match="directory"):
        Store.open(path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files regardless of mode")
def test_manifest_without_permission(st):
    path, _, _ = st
    os.chmod(_mpath(path), 0)
    with pytest.raises(E.ManifestError, match="permission denied"):
        Store.open(path)


def test_unreadable_manifest_eio_is_a_swarm_error(st, monkeypatch):
    """EIO while reading (injected at os.read) names the file."""
    path, _, _ = st
    import errno
    real = os.read

    def failing(fd, n):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(F.os, "read", failing)
    with pytest.raises(E.IOFailedError) as ei:
        F.read_manifest(path)
    monkeypatch.setattr(F.os, "read", real)
    assert ei.value.errno == errno.EIO and ei.value.path.endswith(F.MANIFEST)


def test_oversized_manifest_is_refused_without_reading_it(st, monkeypatch):
    path, _, _ = st
    monkeypatch.setattr(F, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(E.ManifestError, match="limit"):
        Store.open(path)


# -- item 3: nested JSON -------------------------------------------------------

@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_manifest_is_a_manifest_error(st, depth):
    path, _, _ = st
    with open(_mpath(path), "w") as f:
        f.write("[" * depth + "]" * depth)
    with pytest.raises(E.ManifestError, match="nested"):
        Store.open(path)


def test_nested_extra_is_refused_on_write(tmp_path, rng):
    s = Store.create(tmp_path / "st", disks=1, num_layers=1, num_kv_heads=1, head_dim=8)
    deep = {}
    for _ in range(20):
        deep = {"x": deep}
    with pytest.raises(E.ShapeError, match="nested"):
        s.write_layer(0, random_kv(rng, 10, 1, 8, "float16"), [np.arange(10)], extra=deep)
    s.close()


# -- item 4: a manifest with a valid checksum is still checked ----------------------

@pytest.mark.parametrize("edit,match", [
    (lambda m: m["layers"].__setitem__("\u00b2", m["layers"].pop("1")), "layer key"),
    (lambda m: m["model"].__setitem__("dtype", ["float16"]), "dtype"),
    (lambda m: m["model"].__setitem__("dtype", {"a": 1}), "dtype"),
    (lambda m: m["disks"][1].__setitem__("path", "disks/disk-1\0.img"), "path"),
    (lambda m: m["layers"]["0"].__setitem__("num_clusters", 99), "num_clusters|copies"),
    (lambda m: m["layers"]["0"].__setitem__("num_tokens", 150), "num_tokens|replication"),
    (lambda m: m.__setitem__("generation", 2**70), "generation"),
    (lambda m: m["disks"][0].__setitem__("free", [[4096, 512, 0]]), "free"),
])
@pytest.mark.parametrize("deep", [False, True])
def test_resealed_manifest_edits_are_refused(st, edit, match, deep):
    """Edited with the checksum recomputed (and, deep, the disks' commit
    records rewritten to match): a ManifestError naming what is wrong."""
    path, _, _ = st
    m = _raw_manifest(path)
    edit(m)
    reseal_manifest(path, m, deep=deep)
    with pytest.raises(E.ManifestError) as ei:
        Store.open(path)
    if deep:                         # only the deeper checks can catch it
        assert any(w in str(ei.value) for w in match.split("|")), str(ei.value)


@pytest.mark.parametrize("deep", [False, True])
def test_wrong_counts_are_caught_against_the_index_files(st, deep):
    path, _, _ = st
    m = _raw_manifest(path)
    rec = m["layers"]["1"]
    rec["num_clusters"] += 1
    rec["num_copies"] += 1
    rec["replication"] = round(rec["num_copies"] / rec["num_tokens"], 6)
    reseal_manifest(path, m, deep=deep)
    with pytest.raises(E.ManifestError, match="num_clusters" if deep else "generation"):
        Store.open(path)


@pytest.mark.parametrize("deep", [False, True])
def test_a_removed_or_added_layer_record_is_caught(st, deep):
    path, _, _ = st
    m = _raw_manifest(path)
    removed = json.loads(json.dumps(m))
    del removed["layers"]["1"]
    reseal_manifest(path, removed, deep=deep)
    with pytest.raises(E.ManifestError, match="layer record removed" if deep else
                       "generation"):
        Store.open(path)
    added = json.loads(json.dumps(m))
    added["layers"]["2"] = json.loads(json.dumps(m["layers"]["1"]))
    reseal_manifest(path, added, deep=deep)
    with pytest.raises(E.ManifestError):
        Store.open(path)


@pytest.mark.parametrize("change", ["bf16", "heads"])
@pytest.mark.parametrize("deep", [False, True])
def test_identity_edits_are_caught_by_the_superblocks(st, change, deep):
    """float16 -> bfloat16, or 2x8 heads -> 4x4 (same entry bytes): the bytes
    would be reinterpreted; the superblocks pin the identity."""
    path, _, _ = st
    m = _raw_manifest(path)
    if change == "bf16":
        m["model"]["dtype"] = "bfloat16"
    else:
        m["model"].update(num_kv_heads=4, head_dim=4, num_query_heads=4)
    reseal_manifest(path, m, deep=deep)
    with pytest.raises(E.ManifestError) as ei:
        Store.open(path)
    if deep:
        assert "superblocks say" in str(ei.value) and ei.value.disk == 0


def test_rolled_back_manifest_is_detected(st):
    path, kv, old = st
    assert _opens_equal(path, kv)
    good = pathlib.Path(_mpath(path)).read_text()
    F.write_manifest(path, old)                  # an older, valid manifest
    with pytest.raises(E.ManifestError, match="rolled back"):
        Store.open(path)
    with open(_mpath(path), "w") as f:
        f.write(good)
    assert _opens_equal(path, kv)


def test_a_disk_from_an_older_generation_is_detected(st, tmp_path, rng):
    """A disk image restored from an older copy: its commit records name an
    older generation."""
    path, kv, _ = st
    with Store.open(path, writable=True) as s:
        disk1 = s.disk_paths[1]
        shutil.copy(disk1, tmp_path / "disk1.old")
        s.append(0, kv[:2], [[1], []])
        s.append(0, kv[:2], [[2], []])
    shutil.copy(tmp_path / "disk1.old", disk1)
    with pytest.raises(E.DiskMismatchError, match="generation") as ei:
        Store.open(path)
    assert ei.value.disk == 1


def test_crash_after_prepare_before_rename_opens_the_previous_generation(st, rng,
                                                                        monkeypatch):
    """Commit records prepared for generation g+1, then a crash before the
    manifest rename: the store opens at g with its data."""
    path, kv, _ = st
    s = Store.open(path, writable=True)

    def crash(*a, **k):
        raise KeyboardInterrupt("crash before the rename")
    monkeypatch.setattr(F, "atomic_write", crash)
    with pytest.raises(KeyboardInterrupt):
        s.append(0, kv[:2], [[1], []])
    s.close()
    monkeypatch.undo()
    assert _opens_equal(path, kv)
    with Store.open(path, writable=True) as s:      # and the next commit works
        s.append(0, kv[:2], [[1], []])
    assert _opens_equal(path, np.concatenate([kv, kv[:2]]))


def test_torn_commit_record_of_the_newest_generation_is_tolerated(st):
    path, kv, _ = st
    m = _raw_manifest(path)
    g = m["generation"]
    for p in _disk_paths(path):
        with open(p, "r+b") as f:           # the newest slot torn by a crash
            f.seek(F.COMMIT_OFF + (g % 2) * F.COMMIT_SIZE + 100)
            f.write(b"\xff" * 8)
    assert _opens_equal(path, kv)


def _disk_paths(path):
    m = _raw_manifest(path)
    return [os.path.join(path, d["path"]) for d in m["disks"]]


def test_superblock_carries_identity_and_commit_slots_hold_generations(st):
    path, _, _ = st
    m = _raw_manifest(path)
    with open(_disk_paths(path)[2], "rb") as f:
        raw = f.read(F.HEADER_BYTES)
    sb = F.unpack_superblock(raw)
    assert sb["model"] == {k: m["model"][k] for k in sb["model"]}
    assert sb["disk_index"] == 2 and sb["data_start"] == F.DATA_START
    recs = [F.unpack_commit(raw[F.COMMIT_OFF + s * F.COMMIT_SIZE:][:F.COMMIT_SIZE])
            for s in (0, 1)]
    gens = sorted(r["generation"] for r in recs)
    assert gens == [m["generation"] - 1, m["generation"]]
    newest = max(recs, key=lambda r: r["generation"])
    assert newest["state"] == F.COMMITTED and newest["manifest_sum"] == int(m["checksum"], 16)
    assert newest["disk_end"] == m["disks"][2]["end"]


def test_format_1_stores_are_refused_cleanly(st):
    path, _, _ = st
    m = _raw_manifest(path)
    m["format_version"] = 1
    reseal_manifest(path, m)
    with pytest.raises(E.ManifestError, match="older swarmfs.*rebuild"):
        Store.open(path)
    for wrong in (True, 2.0, "2", None):         # True == 1 and 2.0 == 2 in Python
        m["format_version"] = wrong
        reseal_manifest(path, m)
        with pytest.raises(E.ManifestError, match="format version .* is not supported"):
            Store.open(path)
    raw = bytearray(F.pack_superblock(store_uuid=b"x" * 16, disk_index=0, disk_count=1,
                                      block_size=512, model=m["model"]))
    raw[8:12] = struct.pack("<I", 1)
    raw[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(raw[:-8])))
    with pytest.raises(E.DiskMismatchError, match="older swarmfs"):
        F.unpack_superblock(bytes(raw))


def test_index_file_metadata_is_cross_checked(st):
    """An index file of another layer copied over (its XXH3 and the manifest
    resealed): its own metadata says which layer it is."""
    path, _, _ = st
    m = _raw_manifest(path)
    d = os.path.join(path, F.INDEX_DIR)
    f0, f1 = m["layers"]["0"]["index"]["file"], m["layers"]["1"]["index"]["file"]
    shutil.copy(os.path.join(d, f0), os.path.join(d, f1))
    data = pathlib.Path(d, f1).read_bytes()
    m["layers"]["1"]["index"].update(xxh3=xxhash.xxh3_64_hexdigest(data), bytes=len(data))
    reseal_manifest(path, m, deep=True)
    with pytest.raises(E.ManifestError, match="layer"):
        Store.open(path)


def test_index_file_replaced_by_a_fifo(st):
    path, _, _ = st
    m = _raw_manifest(path)
    p = os.path.join(path, F.INDEX_DIR, m["layers"]["1"]["index"]["file"])
    os.unlink(p)
    os.mkfifo(p)
    with pytest.raises(E.ManifestError, match="regular file"):
        Store.open(path)


# -- records: round trip and single-byte corruption (hypothesis) -----------------

_MODELS = hst.fixed_dictionaries({
    "dtype": hst.sampled_from(sorted(F.DTYPES)),
    "num_layers": hst.integers(1, 2**16), "num_kv_heads": hst.integers(1, 64),
    "head_dim": hst.sampled_from([8, 16, 64, 128, 256]),
    "num_query_heads": hst.integers(1, 128)})


def _superblock_args(draw_model, count, idx, bs_log2, uuid, cap, created):
    model = dict(draw_model, entry_bytes=2 * draw_model["num_kv_heads"] *
                 draw_model["head_dim"] * F.DTYPES[draw_model["dtype"]])
    return dict(store_uuid=uuid, disk_index=idx % count, disk_count=count,
                block_size=1 << bs_log2, model=model, capacity=cap, created_ns=created)


@settings(max_examples=60, deadline=None)
@given(_MODELS, hst.integers(1, 256), hst.integers(0, 255), hst.integers(9, 12),
       hst.binary(min_size=16, max_size=16), hst.integers(0, 2**63), hst.integers(0, 2**63))
def test_superblock_round_trip(model, count, idx, bs_log2, uuid, cap, created):
    a = _superblock_args(model, count, idx, bs_log2, uuid, cap, created)
    raw = F.pack_superblock(**a)
    assert len(raw) == F.SUPERBLOCK_SIZE
    got = F.unpack_superblock(raw)
    assert got == dict(uuid=uuid, disk_index=a["disk_index"], disk_count=count,
                       block_size=a["block_size"], data_start=F.DATA_START,
                       created_ns=created, capacity=cap, model=a["model"])


@settings(max_examples=5, deadline=None)
@given(_MODELS, hst.integers(1, 256), hst.integers(0, 255), hst.integers(9, 12),
       hst.binary(min_size=16, max_size=16), hst.integers(1, 255))
def test_every_single_byte_corruption_of_a_superblock_is_detected(model, count, idx,
                                                                  bs_log2, uuid, xor):
    raw = F.pack_superblock(**_superblock_args(model, count, idx, bs_log2, uuid, 0, 1))
    buf = bytearray(raw)
    for pos in range(F.SUPERBLOCK_SIZE):       # every byte: fields, padding, checksum
        buf[pos] ^= xor
        with pytest.raises(E.DiskMismatchError):
            F.unpack_superblock(bytes(buf), disk=3)
        buf[pos] ^= xor
    assert F.unpack_superblock(bytes(buf))["disk_count"] == count


@settings(max_examples=60, deadline=None)
@given(hst.binary(min_size=16, max_size=16), hst.integers(0, 255), hst.integers(0, 2**64 - 1),
       hst.integers(0, 2**64 - 1), hst.integers(0, 2**64 - 1),
       hst.sampled_from([F.PREPARED, F.COMMITTED]))
def test_commit_record_round_trip(uuid, idx, gen, msum, end, state):
    raw = F.pack_commit(store_uuid=uuid, disk_index=idx, generation=gen, manifest_sum=msum,
                        disk_end=end, state=state)
    assert len(raw) == F.COMMIT_SIZE
    assert F.unpack_commit(raw) == dict(state=state, uuid=uuid, disk_index=idx,
                                        generation=gen, manifest_sum=msum, disk_end=end)


@settings(max_examples=5, deadline=None)
@given(hst.binary(min_size=16, max_size=16), hst.integers(0, 2**64 - 1), hst.integers(1, 255))
def test_every_single_byte_corruption_of_a_commit_record_is_detected(uuid, gen, xor):
    raw = F.pack_commit(store_uuid=uuid, disk_index=1, generation=gen, manifest_sum=7,
                        disk_end=F.DATA_START, state=F.COMMITTED)
    buf = bytearray(raw)
    for pos in range(F.COMMIT_SIZE):
        buf[pos] ^= xor
        assert F.unpack_commit(bytes(buf)) is None, pos      # torn or corrupt: ignored
        buf[pos] ^= xor
    assert F.unpack_commit(bytes(buf))["generation"] == gen


def _index_arrays(rng, C, N, S, width):
    sizes = rng.integers(1, 9, C)
    ptr = np.concatenate([[0], np.cumsum(sizes)])
    members = rng.integers(0, S, ptr[-1])
    return {"members_ptr": ptr, "members": members, "medoid": members[ptr[:-1]],
            "start_disk": rng.integers(0, N, C),
            "extent_off": F.DATA_START + 512 * rng.integers(0, 1 << 20, (C, N)),
            "extent_xxh": rng.integers(0, 2**63, (C, N), dtype=np.uint64),
            "token_xxh": rng.integers(0, 2**63, S, dtype=np.uint64),
            "medoid_keys": rng.integers(0, 256, (C, width), dtype=np.uint8),
            "hot": rng.integers(0, 2, C), "freq": rng.random(C)}


_META = dict(uuid="ab" * 16, num_disks=3, dtype="float16", num_kv_heads=2, head_dim=8,
             entry_bytes=64)


@settings(max_examples=25, deadline=None)
@given(hst.integers(1, 12), hst.integers(1, 40), hst.integers(0, 2**31), hst.integers(0, 10**6))
def test_index_file_extent_records_round_trip(C, S, seed, gen):
    """Every array of a layer's index file (cluster table, extents, checksums)
    comes back bit-exact, in the stored dtype."""
    rng = np.random.default_rng(seed)
    d = tempfile.mkdtemp()
    try:
        a = _index_arrays(rng, C, 3, S, 16)
        rec = IndexRecord(**F.save_index(d, 4, gen, a, meta=_META))
        expect = dict(_META, generation=gen, num_tokens=S, num_clusters=C,
                      num_copies=len(a["members"]), hot_clusters=int(a["hot"].sum()))
        got = F.load_index(d, 4, rec, expect=expect)
        for k, dt in F.INDEX_ARRAYS.items():
            assert got[k].dtype == np.dtype(dt)
            assert np.array_equal(got[k], np.asarray(a[k]).astype(dt)), k
    finally:
        shutil.rmtree(d)


@pytest.fixture(scope="module")
def index_file(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("index"))
    a = _index_arrays(np.random.default_rng(5), 6, 3, 20, 16)
    rec = IndexRecord(**F.save_index(d, 2, 9, a, meta=_META))
    path = os.path.join(d, F.INDEX_DIR, rec.file)
    with open(path, "rb") as f:
        data = f.read()
    expect = dict(_META, generation=9, num_tokens=20, num_clusters=6,
                  num_copies=len(a["members"]), hot_clusters=int(a["hot"].sum()))
    return d, rec, path, data, expect


@settings(max_examples=150, deadline=None)
@given(hst.data())
def test_every_single_byte_corruption_of_an_index_file_is_detected(index_file, data):
    d, rec, path, raw, expect = index_file
    pos = data.draw(hst.integers(0, len(raw) - 1), label="byte")
    xor = data.draw(hst.integers(1, 255), label="xor")
    bad = bytearray(raw)
    bad[pos] ^= xor
    with open(path, "wb") as f:
        f.write(bad)
    try:
        with pytest.raises(E.ManifestError):
            F.load_index(d, 2, rec, expect=expect)
    finally:
        with open(path, "wb") as f:
            f.write(raw)
    assert F.load_index(d, 2, rec, expect=expect)["members_ptr"][-1] == expect["num_copies"]
