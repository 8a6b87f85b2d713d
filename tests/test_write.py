"""Writing: non-finite values refused, free-space allocation (issue 9, items 11, 13);
the write transaction (issue 12)."""

import os

import numpy as np
import pytest

from swarmfs import _errors as E
from swarmfs.store._write import allocate, check_finite, free_extents


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_check_finite_names_token_k_or_v_and_head(dtype):
    x = np.zeros((5, 2, 3, 4), dtype)
    check_finite(x.reshape(5, -1).view(np.uint8), dtype, (2, 3, 4))
    x[3, 1, 2, 1] = np.inf
    with pytest.raises(E.ShapeError, match="V of token 13 .KV head 2."):
        check_finite(x.reshape(5, -1).view(np.uint8), dtype, (2, 3, 4), first_token=10)
    x[3, 1, 2, 1] = 0
    x[0, 0, 0, 0] = np.nan
    with pytest.raises(E.ShapeError, match="K of token 0 .KV head 0."):
        check_finite(x.reshape(5, -1).view(np.uint8), dtype, (2, 3, 4))


def test_check_finite_bfloat16_bit_patterns():
    ml = pytest.importorskip("ml_dtypes")
    x = np.ones((2, 2, 1, 2), ml.bfloat16)
    x[1, 0, 0, 1] = np.float32("nan")
    with pytest.raises(E.ShapeError, match="token 1"):
        check_finite(x.reshape(2, -1).view(np.uint8), "bfloat16", (2, 1, 2))
    big = np.array([3.0e38], np.float32).astype(ml.bfloat16)   # finite, large
    y = np.full((1, 2, 1, 2), big[0], ml.bfloat16)
    check_finite(y.reshape(1, -1).view(np.uint8), "bfloat16", (2, 1, 2))


def _disk(end, free=()):
    return {"index": 0, "path": "d", "end": end, "capacity": 0, "free": [list(r) for r in free]}


def test_allocate_best_fit_then_end():
    disks = [_disk(100 << 10, [[12288, 4096, 0], [20480, 8192, 0], [40960, 2048, 0]])]
    base, out = allocate(disks, np.array([2048], np.uint64), gen=5)
    assert int(base[0]) == 40960 and out[0]["free"] == [[12288, 4096, 0], [20480, 8192, 0]]
    base, out = allocate(disks, np.array([16384], np.uint64), gen=5)
    assert int(base[0]) == 100 << 10 and out[0]["end"] == (100 << 10) + 16384


def test_allocate_respects_quarantine_and_readers():
    disks = [_disk(1 << 20, [[12288, 8192, 5]])]
    assert int(allocate(disks, np.array([4096], np.uint64), gen=6)[0][0]) == 1 << 20
    assert int(allocate(disks, np.array([4096], np.uint64), gen=7)[0][0]) == 12288
    # a reader still at generation 4 may read what commit 5 freed
    assert int(allocate(disks, np.array([4096], np.uint64), gen=9,
                        oldest_reader=4)[0][0]) == 1 << 20
    assert int(allocate(disks, np.array([4096], np.uint64), gen=9,
                        oldest_reader=5)[0][0]) == 12288


def test_free_extents_merges_and_gives_back_the_tail():
    disks = [_disk(65536, [[12288, 4096, 1]])]
    out = free_extents(disks, [0, 1], [0, 0], [16384, 61440], [4000, 4096], gen=3,
                       block_size=512)
    # [12288, 4096] is reusable at 3 (gen 0), [16384, 4096] just freed (3): not merged
    assert out[0]["free"] == [[12288, 4096, 0], [16384, 4096, 3], [61440, 4096, 3]]
    assert out[0]["end"] == 65536            # the tail range is still in quarantine
    out = free_extents(out, [], [], [], [], gen=5, block_size=512)
    assert out[0]["free"] == [[12288, 8192, 0]] and out[0]["end"] == 61440
    out = free_extents([_disk(65536, [[61440, 4096, 0]])], [], [], [], [], gen=5,
                       block_size=512)
    assert out[0]["free"] == [] and out[0]["end"] == 61440


# -- the write transaction (issue 12) -------------------------------------------------

def test_write_module_reaches_into_no_store_private_state():
    """_write.py uses the Store only through its public API: no attribute
    starting with an underscore on ``store`` (the Transaction gets what it
    needs passed in)."""
    import ast
    import inspect

    from swarmfs.store import _write
    tree = ast.parse(inspect.getsource(_write))
    private = [f"line {n.lineno}: {n.value.id}.{n.attr}" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id in ("store", "s") and n.attr.startswith("_")]
    assert private == []
    # and the bound-store idiom is gone
    assert "self = store" not in inspect.getsource(_write)


def _small_store(tmp_path, **kw):
    from swarmfs import Store
    s = Store.create(tmp_path / "st", disks=2, num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype="float32", **kw)
    kv = np.arange(40 * 16, dtype=np.float32).reshape(40, 2, 1, 8)
    s.write_layer(0, kv, np.array_split(np.arange(40), 4))
    return s, kv


def test_a_transaction_holds_the_write_lock_against_other_writers(tmp_path):
    from swarmfs import Store
    s, kv = _small_store(tmp_path)
    other = Store.open(tmp_path / "st", writable=True)
    with s._transaction() as tx:
        assert tx.base == s.committed and tx.generation == s.committed.generation + 1
        with pytest.raises(E.SwarmError, match="another process is writing"):
            other.append(0, kv[:1], [[0]])
    other.append(0, kv[:1], [[0]])                 # released on exit
    assert other.committed.generation == s.committed.generation + 1
    other.close()
    s.close()


def test_a_failed_transaction_commits_nothing_and_gives_space_back(tmp_path):
    s, kv = _small_store(tmp_path)
    before = s.committed
    sizes = [os.path.getsize(p) for p in s.disk_paths]
    with pytest.raises(RuntimeError, match="boom"), s._transaction() as tx:
        rows = kv.reshape(40, -1).view(np.uint8)
        ptr = np.array([0, 40], np.int64)
        pl = tx.place(np.array([40]), p_global=tx.base.p_global, layer=0)
        assert [d.end for d in tx.disks] != [d.end for d in before.disks]
        tx.write_extents(rows, ptr, np.arange(40), pl, 0)
        assert max(os.path.getsize(p) for p in s.disk_paths) > max(sizes)
        raise RuntimeError("boom")
    assert s.committed == before
    assert [os.path.getsize(p) for p in s.disk_paths] == [d.end for d in before.disks]
    assert s.read_entries(0, np.arange(40)).tobytes() == kv.tobytes()
    s.close()


def test_a_transaction_commit_publishes_the_new_manifest(tmp_path):
    s, kv = _small_store(tmp_path)
    before = s.committed
    s.append(0, kv[:3], [[1], [], [1, 2]])
    m = s.committed
    assert m.generation == before.generation + 1
    assert m.layers[0].num_tokens == 43 and m.layers[0].generation == m.generation
    # cluster 1 and 2 grew: their old extents are free (quarantined at this generation)
    freed = [r for d in m.disks for r in d.free if r[2] == m.generation]
    assert freed and all(r not in before.disks[i].free for i, d in enumerate(m.disks)
                         for r in d.free if r[2] == m.generation)
    from swarmfs.store._manifest import read_manifest
    assert read_manifest(s.path) == m
    s.close()


def test_allocate_and_free_keep_manifest_records(tmp_path):
    """The free-extent bookkeeping works on the manifest's frozen records as
    on their JSON dicts, with the same result."""
    from swarmfs.store._manifest import DiskRecord
    dicts = [_disk(100 << 10, [[12288, 4096, 0], [20480, 8192, 0], [40960, 2048, 0]])]
    recs = [DiskRecord(index=0, path="d", end=100 << 10, capacity=0,
                       free=((12288, 4096, 0), (20480, 8192, 0), (40960, 2048, 0)))]
    for need in (2048, 8192, 16384):
        b1, o1 = allocate(dicts, np.array([need], np.uint64), gen=5)
        b2, o2 = allocate(recs, np.array([need], np.uint64), gen=5)
        assert int(b1[0]) == int(b2[0]) and o2[0].to_dict() == o1[0]
        assert isinstance(o2[0], DiskRecord)
    f1 = free_extents(dicts, [0], [0], [61440], [4096], gen=3, block_size=512)
    f2 = free_extents(recs, [0], [0], [61440], [4096], gen=3, block_size=512)
    assert f2[0].to_dict() == f1[0] and recs[0].free[0] == (12288, 4096, 0)


def test_a_transaction_commits_once_and_only_inside_its_lock(tmp_path):
    s, kv = _small_store(tmp_path)
    tx = s._transaction()
    with pytest.raises(E.InternalError, match="outside an open write transaction"):
        tx.commit(0, {}, p_global=0)
    with tx:
        pass
    with pytest.raises(E.InternalError, match="entered once"), tx:
        pass
    s.append(0, kv[:1], [[0]])                     # the lock was released both times
    assert s.num_tokens(0) == 41
    s.close()


# -- the index's representative keys (issue 23) ------------------------------------

def _mean_keys(kv, li):
    """Each cluster's mean K from the members, float64 -> rounded like the writer."""
    k = kv[:, 0].astype(np.float64)
    return np.stack([k[li.members[li.members_ptr[c]:li.members_ptr[c + 1]]].mean(0)
                     for c in range(li.num_clusters)])


def _ulps_close(got, want, dtype):
    """float32-accumulated means against float64 ones: within one rounding step."""
    eps = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -22}[dtype]
    got = got.astype(np.float64)
    return np.all(np.abs(got - want) <= 2 * eps * np.maximum(np.abs(want), 1e-3) + 1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_centroid_index_holds_the_members_mean_key_through_appends(tmp_path, dtype):
    """representative="centroid": medoid_keys are each cluster's mean K (the
    replicas included), the manifest says so, and appends keep every changed
    cluster's mean exact (joins into old clusters, new clusters) while the
    unchanged clusters keep their bytes."""
    from swarmfs import Store
    if dtype == "bfloat16":
        ml = pytest.importorskip("ml_dtypes")
        npd = ml.bfloat16
    else:
        npd = np.dtype(dtype)
    rng = np.random.default_rng(3)
    s = Store.create(tmp_path / "s", disks=3, num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype=dtype)
    kv = rng.standard_normal((60, 2, 2, 8)).astype(np.float32).astype(npd)
    cl = [np.arange(0, 25), np.arange(20, 45), np.arange(45, 60), np.array([3, 50])]
    s.write_layer(0, kv, cl, representative="centroid")
    s.write_layer(1, kv, cl)                                  # the default: medoids
    li = s.layer(0)
    assert _ulps_close(s.medoid_keys(0), _mean_keys(kv, li), dtype)
    assert np.array_equal(s.medoid_keys(1).view(np.uint8),
                          kv[li.medoid, 0].view(np.uint8))
    assert s.info()["layers"]["0"]["representative"] == "centroid"
    assert s.info()["layers"]["1"]["representative"] == "medoid"
    before = s.medoid_keys(0).copy()
    new = rng.standard_normal((7, 2, 2, 8)).astype(np.float32).astype(npd)
    s.append(0, new, [[1], [1, 3], [], [], [], [2], []], new_cluster_size=2)
    li = s.layer(0)
    allkv = s.read_entries(0, np.arange(li.num_tokens))
    assert _ulps_close(s.medoid_keys(0), _mean_keys(allkv, li), dtype)
    assert np.array_equal(s.medoid_keys(0)[0].view(np.uint8), before[0].view(np.uint8))
    s.close()
    with Store.open(tmp_path / "s", writable=True) as s2:   # persisted, and checks out
        assert s2.info()["layers"]["0"]["representative"] == "centroid"
        assert s2.verify() == []
        s2.write_layer(0, kv, cl)                   # a rewrite says what it holds anew
        assert s2.info()["layers"]["0"]["representative"] == "medoid"


def test_a_medoid_layer_record_is_written_as_before(tmp_path):
    """Stores that never ask for centroids keep their manifest bytes: the
    record gains no key (older readers and checksums see what they always
    did); a centroid layer's record says ``representative``."""
    import json

    from swarmfs import Store
    s = Store.create(tmp_path / "s", disks=2, num_layers=2, num_kv_heads=1, head_dim=4)
    kv = np.ones((8, 2, 1, 4), np.float16)
    s.write_layer(0, kv, [np.arange(8)])
    s.write_layer(1, kv, [np.arange(8)], representative="centroid")
    rec = json.loads((tmp_path / "s" / "manifest.json").read_text())["layers"]
    assert "representative" not in rec["0"]
    assert rec["1"]["representative"] == "centroid"
    s.close()


@pytest.mark.parametrize("bad", ["mean", "", None, 1, "Centroid"])
def test_an_unknown_representative_is_refused_before_writing(tmp_path, bad):
    from swarmfs import Store
    s = Store.create(tmp_path / "s", disks=2, num_layers=1, num_kv_heads=1, head_dim=4)
    with pytest.raises(E.InvalidChoiceError, match="representative"):
        s.write_layer(0, np.ones((4, 2, 1, 4), np.float16), [np.arange(4)],
                      representative=bad)
    assert s.info()["layers"] == {}
    s.close()


def test_a_manifest_with_an_unknown_representative_does_not_open(tmp_path):
    """The field is part of the checked schema: an edited value is a
    ManifestError naming it, not a store that scores the wrong keys."""
    import json

    from swarmfs import Store
    from swarmfs.store import _format as F
    s = Store.create(tmp_path / "s", disks=2, num_layers=1, num_kv_heads=1, head_dim=4)
    s.write_layer(0, np.ones((4, 2, 1, 4), np.float16), [np.arange(4)],
                  representative="centroid")
    s.close()
    p = tmp_path / "s" / "manifest.json"
    doc = json.loads(p.read_text())
    doc["layers"]["0"]["representative"] = "mean"
    doc["checksum"] = F.manifest_checksum(doc)
    p.write_text(json.dumps(doc))
    with pytest.raises(E.ManifestError, match="representative"):
        Store.open(tmp_path / "s")
