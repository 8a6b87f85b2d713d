"""The validation layer (swarmfs/_validate.py): one rule per kind of value, one
error class per rule, at every public entry point (issue 25)."""

from __future__ import annotations

import inspect
import json
import math
import os
import pathlib

import numpy as np
import pytest
from click.testing import CliRunner

import swarmfs
import swarmfs.layout
from swarmfs import DecodeSession, Retriever, Store, _demo
from swarmfs import _errors as E
from swarmfs import _validate as V
from swarmfs.store import _format as F

H, D = 2, 8


@pytest.fixture
def store(tmp_path):
    rng = np.random.default_rng(5)
    s = Store.create(tmp_path / "st", disks=2, num_layers=1, num_kv_heads=H, head_dim=D,
                     dtype="float16")
    kv = rng.standard_normal((64, 2, H, D)).astype(np.float16)
    s.write_layer(0, kv, np.array_split(np.arange(64), 8))
    yield s
    s.close()


# -- the rules ----------------------------------------------------------------------

@pytest.mark.parametrize("rule, good, bad, error", [
    (lambda x: V.parse_bool(x, "flag"), [(True, True), (np.bool_(False), False)],
     [1, 0, "yes", None, 1.0], E.InvalidBoolError),
    (lambda x: V.parse_int(x, "n", 1, 3), [(1, 1), (np.int64(3), 3)],
     [0, 4, True, 2.0, "2", None, np.float32(2)], E.InvalidIntegerError),
    (lambda x: V.parse_nonneg_int(x, "n"), [(0, 0), (2 ** 70, 2 ** 70)],
     [-1, False], E.InvalidIntegerError),
    (lambda x: V.parse_positive_int(x, "n"), [(1, 1)], [0, -3], E.InvalidIntegerError),
    (lambda x: V.parse_number(x, "t", 0, unit="µs"), [(0, 0.0), (np.float32(2.5), 2.5)],
     [-0.1, math.nan, math.inf, True, "1", None], E.InvalidNumberError),
    (lambda x: V.parse_number(x, "s", 0, lo_open=True), [(1e-9, 1e-9)], [0, 0.0],
     E.InvalidNumberError),
    (lambda x: V.parse_ratio(x, "ratio"), [(1, 1.0), (0.1, 0.1), (np.float16(0.5), 0.5)],
     [0, 0.0, -0.1, 1.0000001, math.nan, math.inf, True, "0.1", None, [0.1]],
     E.InvalidRatioError),
    (lambda x: V.parse_fraction(x, "f"), [(0, 0.0), (1, 1.0)], [-0.01, 1.01, math.nan, False],
     E.InvalidFractionError),
    (lambda x: V.parse_choice(x, "policy", ("balanced", "first")),
     [("first", "first")], ["x", None, ["first"], np.array(["first", "first"])],
     E.InvalidChoiceError),
    (lambda x: V.parse_choice(x, "levels", (1, 2)), [(2, 2), (np.int64(1), 1)], [True, 3, "1"],
     E.InvalidChoiceError),
    (lambda x: V.parse_dtype(x, "dtype", F.DTYPES), [("float16", "float16"),
                                                       (np.float32, "float32")],
     ["int8", "", None, np.int8], E.InvalidDtypeError),
    (lambda x: V.parse_path(x, "path"), [("a", "a"), (os.path.join("x", "y"), "x/y")],
     ["", "a\0b", b"a", 3, None], E.InvalidPathError),
    (lambda x: V.parse_instance(x, "store", Store), [], [3, "st"], E.InvalidTypeError),
    (lambda x: V.parse_callable(x, "attend"), [(len, len)], [3, None], E.InvalidTypeError),
    (lambda x: V.parse_index(x, "layer"), [(3, 3), (np.uint8(2), 2)], [1.0, True, "0", None],
     E.InvalidIndexError),
])
def test_each_rule_accepts_its_values_and_raises_its_own_class(rule, good, bad, error):
    for x, want in good:
        got = rule(x)
        assert got == want and type(got) is type(want), (x, got)
    for x in bad:
        with pytest.raises(error) as ei:
            rule(x)
        exc = ei.value
        assert isinstance(exc, E.InvalidArgumentError)
        assert isinstance(exc, ValueError) and isinstance(exc, TypeError)
        assert exc.argument in str(exc) and exc.argument


def test_messages_name_the_argument_the_range_and_the_context():
    with pytest.raises(E.InvalidRatioError) as ei:
        V.parse_ratio(1.5, "ratio", store="st", layer=3)
    assert str(ei.value) == "ratio must be a number in (0, 1], got 1.5 [store st, layer 3]"
    assert (ei.value.argument, ei.value.store, ei.value.layer) == ("ratio", "st", 3)
    with pytest.raises(E.InvalidIntegerError) as ei:
        V.parse_int(7, "max_gap", 0, 5)
    assert str(ei.value) == "max_gap must be an integer in [0, 5], got 7"
    with pytest.raises(E.InvalidNumberError) as ei:
        V.parse_number(-1, "t_base_us", 0, unit="µs")
    assert str(ei.value) == "t_base_us (µs) must be a finite number >= 0, got -1"
    with pytest.raises(E.InvalidChoiceError) as ei:
        V.parse_choice("x", "policy", ("balanced", "first"))
    assert str(ei.value) == "policy must be one of 'balanced', 'first'; got 'x'"
    with pytest.raises(E.InvalidIndexError) as ei:
        V.parse_index(2.0, "layer")
    assert isinstance(ei.value, E.OutOfRangeError)          # as a layer outside the store
    long = "x" * 10_000
    with pytest.raises(E.InvalidChoiceError) as ei:
        V.parse_choice(long, "metric", ("eq2",))
    assert len(str(ei.value)) < 200


def test_parse_indices():
    assert V.parse_indices([], "t").dtype == np.int64
    np.testing.assert_array_equal(V.parse_indices(np.array([[1], [2]], np.uint8), "t"), [1, 2])
    for bad in ([1.0], [True], np.array([2 ** 63], np.uint64)):
        with pytest.raises(E.InvalidIndexError):
            V.parse_indices(bad, "tokens")


# -- the call rule ----------------------------------------------------------------

def test_checked_turns_only_binding_errors_into_invalid_call_error():
    @V.checked
    def f(a, *, b=1):
        """f."""
        return len(a) + b

    assert f([1, 2], b=3) == 5
    assert f.__doc__ == "f." and f.__name__ == "f"
    assert str(inspect.signature(f)) == "(a, *, b=1)"
    with pytest.raises(E.InvalidCallError) as ei:
        f([1], c=2)
    assert ei.value.argument == "c"
    assert str(ei.value).endswith(".<locals>.f(): got an unexpected keyword argument 'c'")
    with pytest.raises(E.InvalidCallError, match=r"\.f\(\): missing 1 required positional "
                                                 r"argument: 'a'$") as ei:
        f()
    assert ei.value.argument == "a"
    with pytest.raises(E.InvalidCallError, match="positional argument"):
        f(1, 2)
    with pytest.raises(TypeError) as ei:          # raised inside f: not the caller's call
        f(5)
    assert not isinstance(ei.value, E.SwarmError)


def test_boundary_also_checks_the_call():
    @E.boundary
    def g(a):
        """g."""
        return {}[a]

    with pytest.raises(E.InvalidCallError, match="unexpected keyword argument 'zz'"):
        g(1, zz=2)
    with pytest.raises(E.InternalError):          # a bug inside stays an InternalError
        g(1)


def test_unknown_keyword_arguments_of_the_entry_points(store, tmp_path):
    """Each case of issue 25: a SwarmError (InvalidCallError) naming the call
    and the argument, where a raw TypeError or an InternalError escaped."""
    r = Retriever(store)
    q = np.zeros((H, D), np.float32)
    cases = [
        (lambda: Retriever(store, foo=1), "Retriever()", "foo"),
        (lambda: r.retrieve(0, q, foo=1), "Retriever.retrieve()", "foo"),
        (lambda: DecodeSession(r, 0).step(), "DecodeSession.step()", "q"),
        (lambda: Store.open(store.path, foo=1), "Store.open()", "foo"),
        (lambda: Store.create(tmp_path / "x", num_layers=1, num_kv_heads=1, head_dim=4,
                              foo=1), "Store.create()", "foo"),
        (lambda: DecodeSession(r, 0, group=4), "DecodeSession()", "group"),
        (lambda: store.append(0, None, group=4), "Store.append()", "group"),
        (lambda: swarmfs.plan_reads([0], [0], [0], ndisks=1, entry_bytes=8, block_size=512,
                                    foo=1), "plan_reads()", "foo"),
        (lambda: swarmfs.layout.cluster(None, foo=1), "cluster()", "foo"),
        (lambda: swarmfs.layout.lay_out_layer(q, q, scaling=1.0), "lay_out_layer()",
         "entry_bytes"),
    ]
    for call, name, arg in cases:
        with pytest.raises(E.InvalidCallError) as ei:
            call()
        assert str(ei.value).startswith(name), str(ei.value)
        assert ei.value.argument == arg
    assert not (tmp_path / "x").exists()


def _public_callables():
    """(name, object) of every public function and class of swarmfs.__all__,
    swarmfs.hf.__all__ and swarmfs.layout.__all__ (exceptions and protocols
    aside: an error's constructor is not an entry point)."""
    import swarmfs.hf
    out = {}
    for mod in (swarmfs, swarmfs.hf, swarmfs.layout):
        for n in mod.__all__:
            obj = getattr(mod, n)
            if inspect.isclass(obj) and (issubclass(obj, BaseException) or
                                         getattr(obj, "_is_protocol", False)):
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                out[f"{mod.__name__}.{n}"] = obj
    return sorted(out.items())


def _methods(cls):
    for m, f in vars(cls).items():
        if m.startswith("_") and m != "__init__":
            continue
        f = f.__func__ if isinstance(f, (staticmethod, classmethod)) else f
        if inspect.isfunction(f):
            yield m, f


def test_every_public_callable_checks_its_calls():
    found = _public_callables()
    assert len(found) >= 50
    unchecked = []
    for name, obj in found:
        fns = dict(_methods(obj)) if inspect.isclass(obj) else {"": obj}
        for m, f in fns.items():
            if not getattr(f, E.CHECKED, False):
                unchecked.append(f"{name}.{m}".rstrip("."))
    assert not unchecked, f"calls not checked: {unchecked}"


@pytest.mark.parametrize("name, obj", _public_callables())
def test_an_unknown_keyword_is_an_invalid_call_error(name, obj):
    """Calling any public function or class with a keyword no signature has:
    InvalidCallError before the body runs (a method: called on a dummy self,
    which its body would trip over)."""
    bad = {"_swarmfs_no_such_argument": 1}
    targets = [(obj, ())]
    if inspect.isclass(obj):
        targets += [(getattr(obj, m), (object(),)) for m, f in _methods(obj)
                    if m != "__init__" and not isinstance(vars(obj)[m], classmethod)
                    and not isinstance(vars(obj)[m], staticmethod)]
    for fn, args in targets:
        params = inspect.signature(fn).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            continue                   # takes any keyword (checked by the marker above)
        with pytest.raises(E.InvalidCallError, match="_swarmfs_no_such_argument"):
            fn(*args, **bad)


# -- one rule, one class: a bad ratio at every entry point ------------------------------

@pytest.mark.parametrize("ratio", [0, -0.5, 1.5, math.nan, True, "0.1"])
def test_a_bad_ratio_raises_invalid_ratio_error_at_every_entry_point(store, tmp_path, ratio):
    from swarmfs.layout import LayoutParams, evaluate_recall, profile_layer
    q = np.zeros((H, 16, D), np.float32)
    entry_points = {
        "Retriever": lambda: Retriever(store, ratio=ratio),
        "LayoutParams": lambda: LayoutParams(ratio=ratio),
        "profile_layer": lambda: profile_layer(q, q, ratio=ratio),
        "evaluate_recall": lambda: evaluate_recall(swarmfs.layout.block_clustering(16, 4), q,
                                                   q, ratio=ratio),
        "DecodeSession tau": lambda: DecodeSession(Retriever(store), 0, tau=ratio),
        "cluster tau": lambda: swarmfs.layout.cluster(profile_layer(q, q), tau=ratio),
        "demo": lambda: _demo.run_demo(("python",), ratio=ratio),
    }
    for name, call in entry_points.items():
        with pytest.raises(E.InvalidRatioError) as ei:
            call()
        assert ei.value.argument in ("ratio", "tau"), name


@pytest.mark.parametrize("ratio", [0, 1.5, math.nan])
def test_a_bad_ratio_in_swarm_cache_is_the_same_class(tmp_path, ratio):
    pytest.importorskip("transformers")
    from swarmfs.hf import SwarmCache
    with pytest.raises(E.InvalidRatioError, match="ratio"):
        SwarmCache(tmp_path / "st", None, ratio=ratio)
    with pytest.raises(E.InvalidRatioError, match="tau"):
        SwarmCache(tmp_path / "st", None, tau=ratio)
    with pytest.raises(E.InvalidCallError, match="foo"):
        SwarmCache(tmp_path / "st", None, foo=1)
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("argv", [["build", "x.safetensors", "st", "--ratio", "1.5"],
                                  ["build", "x.safetensors", "st", "--tau", "0"],
                                  ["demo", "--ratio", "0", "--dir", "d"]])
def test_the_cli_reports_a_bad_ratio_by_the_same_class(tmp_path, monkeypatch, argv):
    from swarmfs._cli import main
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2 or r.exit_code == 1, r.output
    assert "must be a number in (0, 1]" in r.output
    assert not os.listdir(tmp_path)


def test_other_rules_at_the_entry_points(store):
    r = Retriever(store)
    q = np.zeros((H, D), np.float32)
    for call, error, arg in [
        (lambda: Retriever(store, policy="x"), E.InvalidChoiceError, "policy"),
        (lambda: Retriever(store, dedup=1), E.InvalidBoolError, "dedup"),
        (lambda: Retriever(store, max_gap=-1), E.InvalidIntegerError, "max_gap"),
        (lambda: Retriever(store, local_window=2.0), E.InvalidIntegerError, "local_window"),
        (lambda: Retriever(store, score="max"), E.InvalidChoiceError, "score"),
        (lambda: Retriever(store, assembly_threads=3), E.InvalidIntegerError,
         "assembly_threads"),
        (lambda: Retriever("st"), E.InvalidTypeError, "store"),
        (lambda: r.retrieve(0, q, torch="yes"), E.InvalidBoolError, "torch"),
        (lambda: r.retrieve(0, q, budget=0), E.InvalidIntegerError, "budget"),
        (lambda: r.retrieve(1.0, q), E.InvalidIndexError, "layer"),
        (lambda: r.kv_buffers(0), E.InvalidIntegerError, "cap"),
        (lambda: DecodeSession(r, 0, t_base_us=-1), E.InvalidNumberError, "t_base_us"),
        (lambda: DecodeSession(r, 0, adapt_cache=None), E.InvalidBoolError, "adapt_cache"),
        (lambda: DecodeSession(object(), 0), E.InvalidTypeError, "retriever"),
        (lambda: DecodeSession(r, 0).step(q, retrieval=5), E.InvalidTypeError, "retrieval"),
        (lambda: swarmfs.pipelined_step([DecodeSession(r, 0)], [q], 5), E.InvalidTypeError,
         "attend"),
        (lambda: Store.open(5), E.InvalidPathError, "path"),
        (lambda: Store.open(store.path, writable="no"), E.InvalidBoolError, "writable"),
        (lambda: Store.open(store.path, queue_depth=0), E.InvalidIntegerError, "queue_depth"),
        (lambda: Store.open(store.path, engine="spdk"), E.InvalidChoiceError, "engine"),
        (lambda: store.plan(0, [1], max_gap=-1), E.InvalidIntegerError, "max_gap"),
        (lambda: store.write_layer(0, np.zeros((4, 2, H, D), np.float16), [np.arange(4)],
                                   placement="x"), E.InvalidChoiceError, "placement"),
        (lambda: store.write_layer(0, np.zeros((4, 2, H, D), np.float16), [np.arange(4)],
                                   local_window=-1), E.InvalidIntegerError, "local_window"),
        (lambda: store.verify(progress=3), E.InvalidTypeError, "progress"),
        (lambda: store.append(0, None, new_cluster_size=0), E.InvalidIntegerError,
         "new_cluster_size"),
    ]:
        with pytest.raises(error) as ei:
            call()
        if arg is not None:
            assert ei.value.argument == arg, (arg, str(ei.value))


def test_layout_params_are_checked_when_made():
    from swarmfs.layout import LayoutParams
    for kw, error in [({"tau": 0}, E.InvalidRatioError),
                      ({"metric": "cosine"}, E.InvalidChoiceError),
                      ({"max_queries": 0}, E.InvalidIntegerError),
                      ({"local_window": -1}, E.InvalidIntegerError),
                      ({"hot_fraction": 1.5}, E.InvalidFractionError),
                      ({"t_transfer_us": math.inf}, E.InvalidNumberError)]:
        with pytest.raises(error, match=next(iter(kw))):
            LayoutParams(**kw)
    p = LayoutParams(tau=0.5, metric="eq2", max_queries=8, hot_fraction=0)
    assert (p.tau, p.metric, p.max_queries, p.hot_fraction) == (0.5, "eq2", 8, 0)


# -- published: swarmfs.layout.lay_out_layer ------------------------------------------

def test_lay_out_layer_is_public_and_lays_out_a_layer(tmp_path):
    from swarmfs.layout import LayoutParams, lay_out_layer
    rng = np.random.default_rng(1)
    S = 96
    k = rng.standard_normal((H, S, D)).astype(np.float32)
    q = rng.standard_normal((2 * H, S, D)).astype(np.float32)
    eb = 2 * H * D * 2
    cl, hot = lay_out_layer(q, k, params=LayoutParams(ratio=0.2, hot_fraction=0.1),
                            scaling=D ** -0.5, entry_bytes=eb, layer=0)
    assert np.array_equal(np.unique(cl.members), np.arange(S))     # every entry stored
    assert hot.dtype == bool and hot.shape == (cl.ptr.shape[0] - 1,)
    assert int(cl.sizes[hot].sum()) * eb <= int(0.1 * S * eb)       # within the budget
    for c in range(cl.ptr.shape[0] - 1):                            # medoid in its cluster
        assert cl.medoids[c] in cl.members[cl.ptr[c]:cl.ptr[c + 1]]
    with pytest.raises(E.InvalidNumberError, match="scaling"):
        lay_out_layer(q, k, scaling=0.0, entry_bytes=eb)
    with pytest.raises(E.InvalidTypeError, match="params"):
        lay_out_layer(q, k, params={"ratio": 0.1}, scaling=1.0, entry_bytes=eb)
    s = Store.create(tmp_path / "st", disks=2, num_layers=1, num_kv_heads=H, head_dim=D)
    kv = np.ascontiguousarray(np.stack([k, k], 0).transpose(2, 0, 1, 3)).astype(np.float16)
    s.write_layer(0, kv, (cl.ptr, cl.members), cl.medoids, hot=hot, freq=cl.freq)
    assert s.num_clusters(0) == cl.ptr.shape[0] - 1
    s.close()


# -- the index's own invariant: a medoid is a member of its cluster --------------------

def test_an_index_whose_medoid_is_not_a_member_is_refused_even_resealed(tmp_path):
    """Issue 25: an index file edited so that cluster 1's medoid is a token of
    cluster 0, with its XXH3 and the manifest resealed (every checksum
    valid), opened: a ManifestError naming the layer and the cluster."""
    import xxhash
    from safetensors.numpy import load_file, save_file

    from tools.fuzz_store import _raw_manifest, reseal_manifest
    path = str(tmp_path / "st")
    kv = np.ones((6, 2, 1, 4), np.float16)
    with Store.create(path, disks=2, num_layers=1, num_kv_heads=1, head_dim=4) as s:
        s.write_layer(0, kv, [np.arange(3), np.arange(3, 6)])
        assert s.layer(0).medoid.tolist() == [0, 3]
    raw = _raw_manifest(path)
    ip = os.path.join(path, F.INDEX_DIR, raw["layers"]["0"]["index"]["file"])
    from safetensors import safe_open
    with safe_open(ip, framework="numpy") as f:
        meta = f.metadata()
    arrays = load_file(ip)
    arrays["medoid"] = arrays["medoid"].copy()
    arrays["medoid"][1] = 1                      # token 1 is in cluster 0 only
    save_file(arrays, ip, metadata=meta)
    data = pathlib.Path(ip).read_bytes()
    raw["layers"]["0"]["index"].update(xxh3=xxhash.xxh3_64_hexdigest(data), bytes=len(data))
    reseal_manifest(path, raw, deep=True)
    with Store.open(path) as s, pytest.raises(E.ManifestError) as ei:
        s.layer(0)
    assert "medoid of cluster 1 (token 1) is not a member" in str(ei.value)
    assert ei.value.layer == 0
    # the same file with the medoid put back opens (the edit, not the path, is refused)
    arrays["medoid"][1] = 4
    save_file(arrays, ip, metadata=meta)
    data = pathlib.Path(ip).read_bytes()
    raw["layers"]["0"]["index"].update(xxh3=xxhash.xxh3_64_hexdigest(data), bytes=len(data))
    reseal_manifest(path, raw, deep=True)
    with Store.open(path) as s:
        assert s.layer(0).medoid.tolist() == [0, 4]
        assert s.read_entries(0, np.arange(6)).tobytes() == kv.tobytes()


def test_the_manifest_schema_is_msgspec_structs():
    import msgspec

    from swarmfs.store import _manifest as M
    for cls in (M.ModelIdentity, M.DiskRecord, M.IndexRecord, M.LayerRecord):
        assert issubclass(cls, msgspec.Struct)
        assert cls.__struct_config__.frozen and cls.__struct_config__.forbid_unknown_fields
    assert not hasattr(M, "_check")
    d = json.loads(json.dumps({"index": 0, "path": "d", "end": F.DATA_START, "capacity": 0,
                               "free": [], "zz": 1}))
    with pytest.raises(msgspec.ValidationError, match="unknown field `zz`"):
        msgspec.convert(d, M.DiskRecord, strict=True)
