"""The manifest model (swarmfs/_manifest.py): one validating loader, one
serialiser, byte-compatible with format version 2 (issue 12).

``tests/data/store-v2`` is a store written by swarmfs before the model
existed (main at 0cb505d), with::

    rng = np.random.default_rng(3)
    s = Store.create(root, disks=3, num_layers=3, num_kv_heads=2, head_dim=8,
                     dtype="float16", model_name="golden", num_query_heads=4)
    kv = rng.standard_normal((50, 2, 2, 8)).astype(np.float16)
    s.write_layer(0, kv, np.array_split(np.arange(50), 5), hot=[1, 0, 0, 0, 0],
                  local_window=16, extra={"note": "first", "profile": {"queries": 7}})
    s.write_layer(2, kv[:20], [np.arange(20)])
    s.append(0, kv[:3], [[1], [], [0, 2]])
    s.write_layer(2, kv[:30], [np.arange(30)])          # rewrite: frees extents
    s.append(0, kv[:2], [[4], []])
"""

import copy
import json
import os
import pathlib
import re
import shutil

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmfs import Store
from swarmfs import _errors as E
from swarmfs.store import _format as F
from swarmfs.store._manifest import LAYER_RECORD_KEYS as Manifest_LAYER_KEYS
from swarmfs.store._manifest import Manifest, read_manifest, write_manifest
from tools.fuzz_store import _paths, _raw_manifest, reseal_manifest

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "store-v2")


def _golden_kv():
    rng = np.random.default_rng(3)
    kv = rng.standard_normal((50, 2, 2, 8)).astype(np.float16)
    return {0: np.concatenate([kv, kv[:3], kv[:2]]), 2: kv[:30]}


@pytest.fixture
def golden(tmp_path):
    path = str(tmp_path / "st")
    shutil.copytree(GOLDEN, path)
    return path


# -- byte compatibility with format v2 ------------------------------------------------

def test_an_existing_v2_store_opens_and_reads_back_every_byte(golden):
    kv = _golden_kv()
    with Store.open(golden) as s:
        assert s.layers == [0, 2] and s.committed.generation == 5
        assert s.model.name == "golden" and s.model.num_query_heads == 4
        assert s.layer_info(0)["note"] == "first"
        assert s.layer_info(0)["profile"] == {"queries": 7}
        for layer, want in kv.items():
            got = s.read_entries(layer, np.arange(want.shape[0]))
            assert got.tobytes() == want.tobytes()


def test_the_serialiser_writes_the_v2_bytes(golden):
    raw = pathlib.Path(golden, F.MANIFEST).read_bytes()
    m = read_manifest(golden)
    assert m.to_json() == raw
    assert m.to_dict() == json.loads(raw)
    assert F.manifest_checksum(m.to_dict()) == m.checksum == json.loads(raw)["checksum"]
    assert m.sealed() == m


def test_writing_an_existing_store_keeps_the_format(golden):
    kv = _golden_kv()
    new = np.full((4, 2, 2, 8), 0.5, np.float16)
    with Store.open(golden, writable=True) as s:
        s.append(2, new, [[0], [], [0], []])
        assert s.committed.generation == 6
    raw = pathlib.Path(golden, F.MANIFEST).read_bytes()
    d = json.loads(raw)
    assert read_manifest(golden).to_json() == raw
    # the checksum rule of format 2: XXH3-64 of the rest, keys sorted
    import xxhash
    body = {k: v for k, v in d.items() if k != "checksum"}
    assert d["checksum"] == xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())
    # untouched layer records and their extra fields survive
    assert d["layers"]["0"]["note"] == "first" and d["layers"]["0"]["local_window"] == 16
    assert list(d["layers"]["0"])[:3] == ["local_window", "note", "profile"]
    with Store.open(golden) as s:
        assert s.read_entries(0, np.arange(55)).tobytes() == kv[0].tobytes()
        want = np.concatenate([kv[2], new])
        assert s.read_entries(2, np.arange(34)).tobytes() == want.tobytes()


def test_a_new_store_writes_what_the_loader_reads_back(tmp_path):
    s = Store.create(tmp_path / "st", disks=2, num_layers=2, num_kv_heads=1, head_dim=4,
                     dtype="float32")
    s.write_layer(1, np.ones((8, 2, 1, 4), np.float32), [np.arange(8)], extra={"x": [1]})
    raw = (tmp_path / "st" / F.MANIFEST).read_bytes()
    assert s.committed.to_json() == raw and s.manifest == json.loads(raw)
    assert s.committed == read_manifest(tmp_path / "st")
    s.close()


# -- a strategy of valid manifests -------------------------------------------------

@st.composite
def manifests(draw):
    """A valid manifest dict, sealed, keys in swarmfs's order."""
    dtype = draw(st.sampled_from(sorted(F.DTYPES)))
    hkv = draw(st.integers(1, 8))
    hd = draw(st.sampled_from([4, 8, 64, 128]))
    L = draw(st.integers(1, 6))
    bs = draw(st.sampled_from([512, 1024, 4096]))
    gen = draw(st.integers(0, 50))
    ndisks = draw(st.integers(1, 5))
    disks = []
    for i in range(ndisks):
        end = F.DATA_START + bs * draw(st.integers(0, 64))
        free, off = [], F.DATA_START
        for _ in range(draw(st.integers(0, 3))):
            gap, ln = draw(st.integers(0, 4)) * bs, draw(st.integers(1, 4)) * bs
            if off + gap + ln > end:
                break
            free.append([off + gap, ln, draw(st.integers(0, gen))])
            off += gap + ln
        cap = draw(st.sampled_from([0, end, end + 1 << 20]))
        disks.append({"index": i, "path": draw(st.sampled_from(
            [f"disks/disk-{i}.img", f"/dev/nvme{i}n1"])), "end": end, "capacity": cap,
            "free": free})
    layers = {}
    if gen:
        for layer in sorted(draw(st.sets(st.integers(0, L - 1), max_size=L))):
            S = draw(st.integers(1, 10_000))
            C = draw(st.integers(1, S))
            M = S + draw(st.integers(0, S))
            lgen = draw(st.integers(1, gen))
            rec = {"local_window": draw(st.integers(0, 4096))}
            rec.update(draw(st.dictionaries(st.sampled_from(["note", "method", "tau"]),
                                            st.one_of(st.integers(), st.text(max_size=5),
                                                      st.lists(st.integers(), max_size=3)),
                                            max_size=2)))
            rec.update({"num_tokens": S, "num_clusters": C, "num_copies": M,
                        "replication": round(M / S, 6),
                        "hot_clusters": draw(st.integers(0, C)),
                        "index": {"file": F.index_name(layer, lgen),
                                  "xxh3": draw(st.from_regex(r"[0-9a-f]{16}", fullmatch=True)),
                                  "bytes": draw(st.integers(1, 1 << 30))},
                        "generation": lgen})
            layers[str(layer)] = rec
    m = {"format": "swarmfs", "format_version": F.FORMAT_VERSION,
         "uuid": draw(st.from_regex(r"[0-9a-f]{32}", fullmatch=True)), "generation": gen,
         "created": "2026-12-01T00:00:00Z",
         "model": {"name": draw(st.one_of(st.none(), st.text(max_size=8))), "num_layers": L,
                   "num_kv_heads": hkv, "head_dim": hd,
                   "num_query_heads": hkv * draw(st.integers(1, 4)), "dtype": dtype,
                   "entry_bytes": 2 * hkv * hd * F.DTYPES[dtype]},
         "block_size": bs, "p_global": draw(st.integers(0, 1 << 40)), "disks": disks,
         "layers": layers, "dram": {"local_window": draw(st.integers(0, 4096))}}
    return F.seal_manifest(m)


_SETTINGS = settings(max_examples=150, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(manifests())
def test_round_trip_is_exact(d):
    m = Manifest.load(copy.deepcopy(d), "st")
    assert m.to_dict() == d
    assert list(m.to_dict()) == list(d)                       # key order too
    assert m.to_json() == json.dumps(d, indent=1).encode() + b"\n"
    assert Manifest.load(m.to_dict(), "st") == m
    assert m.sealed().checksum == d["checksum"]
    assert m.checksum_u64 == int(d["checksum"], 16)
    assert sorted(m.layers) == sorted(int(k) for k in d["layers"])
    for k, rec in d["layers"].items():
        r = m.layers[int(k)]
        assert (r.num_tokens, r.num_clusters, r.index.file) == \
            (rec["num_tokens"], rec["num_clusters"], rec["index"]["file"])
    assert [x.end for x in m.disks] == [x["end"] for x in d["disks"]]
    assert m.model.entry_bytes == d["model"]["entry_bytes"]


@_SETTINGS
@given(manifests())
def test_the_model_is_immutable(d):
    m = Manifest.load(d, "st")
    with pytest.raises(AttributeError, match="immutable"):     # frozen msgspec Structs
        m.generation = 1
    with pytest.raises(TypeError):
        m.layers[0] = None
    with pytest.raises(AttributeError, match="immutable"):
        m.disks[0].end = 0
    out = m.to_dict()
    out["disks"][0]["free"].append([0, 0, 0])            # a copy: the model is unchanged
    assert m.to_dict() == d


_BAD = [None, True, -1, 1.5, "", "x", [], {}, 2 ** 64, "\u00b2"]


@_SETTINGS
@given(manifests(), st.data())
def test_a_corrupted_field_is_refused_or_round_trips(d, data):
    """Any field replaced by a value of another type or range: the loader
    raises ManifestError (nothing else), or accepts a manifest that still
    round-trips exactly (e.g. a free-text field)."""
    paths = [p for p in _paths(d) if p and p[0] != "checksum"]
    path = data.draw(st.sampled_from(paths))
    bad = data.draw(st.sampled_from(_BAD))
    x = copy.deepcopy(d)
    tgt = x
    for p in path[:-1]:
        tgt = tgt[p]
    tgt[path[-1]] = bad
    try:
        m = Manifest.load(x, "st")
    except E.ManifestError as exc:
        assert exc.store == "st" and exc.message
        return
    assert m.to_dict() == x


def _small_manifest() -> dict:
    """A valid one-layer manifest, unsealed, keys in swarmfs's order."""
    return {"format": "swarmfs", "format_version": 2, "uuid": "ab" * 16, "generation": 1,
            "created": "t",
            "model": {"name": None, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                      "num_query_heads": 2, "dtype": "float16", "entry_bytes": 64},
            "block_size": 512, "p_global": 0,
            "disks": [{"index": 0, "path": "d", "end": 16384, "capacity": 0, "free": []}],
            "layers": {"0": {"local_window": 4, "num_tokens": 4, "num_clusters": 1,
                             "num_copies": 4, "replication": 1.0, "hot_clusters": 0,
                             "index": {"file": "layer-000.g00000001.safetensors",
                                       "xxh3": "0" * 16, "bytes": 10}, "generation": 1}},
            "dram": {"local_window": 256}}


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["model"].update(dtype=["float16"]), "model.dtype"),
    (lambda m: m["model"].update(num_kv_heads=True), "model.num_kv_heads"),
    (lambda m: m["model"].update(entry_bytes=7), "entry_bytes does not match"),
    (lambda m: m.update(block_size=1000), "block_size"),
    (lambda m: m["disks"][0].update(path="a\0b"), r"disks\[0\]\.path"),
    (lambda m: m["disks"][0].update(path=""), r"disks\[0\]\.path"),
    (lambda m: m["disks"][0].update(index=True), r"disks\[0\]\.index"),
    (lambda m: m["disks"][0].update(free=[[16384, 512]]), r"disks\[0\]\.free\[0\]"),
    (lambda m: m["layers"]["0"].update(hot_clusters=2), "hot_clusters"),
    (lambda m: m["layers"]["0"]["index"].update(xxh3="0" * 15 + "\n"), "index.xxh3"),
    (lambda m: m.update(uuid="AB" * 16), "uuid"),
    (lambda m: m["disks"][0].update(end=F.DATA_START + 1), "not block aligned"),
    (lambda m: m["layers"].update({"\u00b2": m["layers"]["0"]}), "layer key"),
    (lambda m: m["layers"]["0"].update(num_copies=1), "fewer copies"),
    (lambda m: m["layers"]["0"].update(replication=9.0), "replication"),
    (lambda m: m["layers"]["0"]["index"].update(file="layer-001.g00000001.safetensors"),
     "index.file"),
    (lambda m: m["dram"].update(local_window=-1), "dram.local_window"),
    # null was accepted, then dropped on the way back (hypothesis found it)
    (lambda m: m.update(created=None), "created: Expected `str`, got `null`"),
    (lambda m: m.update(created=5), "created: Expected `str`, got `int`"),
])
def test_named_rejections(edit, match):
    d = _small_manifest()
    Manifest.load(F.seal_manifest(d), "st")                 # the base is valid
    edit(d)
    with pytest.raises(E.ManifestError, match=match):
        Manifest.load(F.seal_manifest(d), "st")


def test_write_manifest_seals_and_returns_the_written_model(tmp_path):
    with Store.create(tmp_path / "st", disks=1, num_layers=1, num_kv_heads=1,
                      head_dim=4) as s:
        m = s.committed
    edited = msgspec.structs.replace(m, p_global=77, checksum="")
    out = write_manifest(str(tmp_path / "st"), edited)
    assert out.checksum and out.checksum != m.checksum
    assert read_manifest(tmp_path / "st") == out and out.p_global == 77


# -- keys format version 2 does not have ------------------------------------------------

@pytest.mark.parametrize("where, field", [
    ((), "'zz'"), (("model",), "'model.zz'"), (("dram",), "'dram.zz'"),
    (("disks", 0), "'disks[0].zz'"), (("layers", "0", "index"), "'layers[0].index.zz'")])
def test_an_unknown_key_is_refused_by_name(tmp_path, where, field):
    """Format 2 is a closed schema, checked like format_version: a key it does
    not know is refused (naming the file and the key), never dropped or carried
    through a commit."""
    d = _small_manifest()
    tgt = d
    for p in where:
        tgt = tgt[p]
    tgt["zz"] = [1]
    with pytest.raises(E.ManifestError,
                       match=re.escape(f"manifest.json: unknown field {field}")):
        Manifest.load(F.seal_manifest(d), "st")
    # and a store whose (resealed) manifest has one does not open
    with Store.create(tmp_path / "st", disks=1, num_layers=1, num_kv_heads=1,
                      head_dim=4) as s:
        s.write_layer(0, np.ones((4, 2, 1, 4), np.float16), [np.arange(4)])
    raw = _raw_manifest(str(tmp_path / "st"))
    tgt = raw
    for p in where:
        tgt = tgt[p]
    tgt["zz"] = [1]
    reseal_manifest(str(tmp_path / "st"), raw, deep=True)
    with pytest.raises(E.ManifestError, match=re.escape(f"unknown field {field}")):
        Store.open(tmp_path / "st")


def test_a_layers_caller_fields_round_trip_byte_for_byte(tmp_path):
    """The one open namespace: a layer record's keys beyond the record's own
    (write_layer's extra) are kept verbatim through a commit that does not
    touch the layer."""
    with Store.create(tmp_path / "st", disks=2, num_layers=2, num_kv_heads=1,
                      head_dim=4) as s:
        s.write_layer(0, np.ones((4, 2, 1, 4), np.float16), [np.arange(4)],
                      extra={"zz": [1, {"deep": None}], "note": "n"})
    raw = _raw_manifest(str(tmp_path / "st"))
    want = json.dumps(raw["layers"]["0"], indent=1)
    m = Manifest.load(copy.deepcopy(raw), "st")
    assert m.layers[0].extra == {"zz": [1, {"deep": None}], "note": "n"}
    assert m.to_json() == json.dumps(raw, indent=1).encode() + b"\n"
    with Store.open(tmp_path / "st", writable=True) as s:
        s.write_layer(1, np.ones((4, 2, 1, 4), np.float16), [np.arange(4)])
    after = _raw_manifest(str(tmp_path / "st"))
    assert json.dumps(after["layers"]["0"], indent=1) == want
    assert list(after["layers"]["0"])[:3] == ["local_window", "zz", "note"]


# -- JSON a parser reads one way or another -------------------------------------------

def _dump_with_duplicate(x, at, path=()):
    """``x`` as JSON text, the object at path ``at`` holding its first key
    twice (same value both times, so the checksum still matches)."""
    if isinstance(x, dict):
        items = [f"{json.dumps(k)}: {_dump_with_duplicate(v, at, path + (k,))}"
                 for k, v in x.items()]
        if path == at:
            items.insert(0, items[0])
        return "{" + ", ".join(items) + "}"
    if isinstance(x, list):
        return "[" + ", ".join(_dump_with_duplicate(v, at, path + (i,))
                               for i, v in enumerate(x)) + "]"
    return json.dumps(x)


def test_a_key_twice_in_any_object_is_refused(golden):
    """JSON parsers differ on a key given twice (Python keeps the last,
    others the first or fail); swarmfs never writes one, so a manifest with
    one is refused, naming the file and the key, in every object of it
    (the layer records' caller fields included)."""
    raw = _raw_manifest(golden)
    objects = [p for p in _paths(raw) if isinstance(_get(raw, p), dict) and _get(raw, p)]
    assert len(objects) >= 8
    for at in objects:
        key = next(iter(_get(raw, at)))
        with open(os.path.join(golden, F.MANIFEST), "w") as f:
            f.write(_dump_with_duplicate(raw, at))
        with pytest.raises(E.ManifestError,
                           match=re.escape(f"manifest.json holds the key {key!r} twice")):
            Store.open(golden)
    with open(os.path.join(golden, F.MANIFEST), "w") as f:
        json.dump(raw, f, indent=1)
    Store.open(golden).close()


def _get(x, path):
    for p in path:
        x = x[p]
    return x


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_number_in_a_swarmfs_field_is_refused(golden, value):
    """Python's JSON parser accepts NaN and Infinity; in every number
    field swarmfs owns they are refused (replication NaN was accepted: NaN
    compares false with the tolerance)."""
    raw = _raw_manifest(golden)
    fields = [p for p in _paths(raw) if p and p[0] != "checksum"
              and not (len(p) >= 3 and p[0] == "layers"
                       and p[2] not in Manifest_LAYER_KEYS)
              and isinstance(_get(raw, p), (int, float))
              and not isinstance(_get(raw, p), bool)]
    assert any(p[-1] == "replication" for p in fields)
    for p in fields:
        x = copy.deepcopy(raw)
        _get(x, p[:-1])[p[-1]] = value
        reseal_manifest(golden, x, deep=True)
        with pytest.raises(E.ManifestError) as ei:
            Store.open(golden)
        name = "format version" if p == ("format_version",) else \
            [k for k in p if isinstance(k, str)][-1]
        assert name in str(ei.value), (p, str(ei.value))


def test_p_global_is_refused_where_the_writer_could_not_place_from_it():
    d = _small_manifest()
    d["p_global"] = (1 << 62) - 1
    Manifest.load(F.seal_manifest(d), "st")
    d["p_global"] = 1 << 62
    with pytest.raises(E.ManifestError, match="p_global"):
        Manifest.load(F.seal_manifest(d), "st")
