"""Retrieval: selection, DRAM partition, dedup and the baselines' selectors."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_clusters, random_kv, random_layer_store, same_bits
from swarmfs import Retriever, Store
from swarmfs import _errors as E
from swarmfs.decode._selectors import (
    BoundSelector,
    MultiVectorSelector,
    TokenSelector,
    group_queries,
    score_medoids,
)

S, H, HQ, D = 2000, 2, 8, 16


@pytest.fixture
def store(tmp_path, rng):
    s, kv, cl = random_layer_store(tmp_path / "st", rng, S=S, H=H, HQ=HQ, D=D, disks=4,
                                   clusters=100, extra_copies=300, hot=[3, 17],
                                   local_window=64)
    yield s, kv, cl
    s.close()


def test_group_sum_equals_sum_of_head_scores(rng):
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    keys = rng.standard_normal((50, H, D)).astype(np.float16)
    qg = group_queries(q, H)
    fast = score_medoids(keys.reshape(50, H * D), qg)[0]
    g = HQ // H
    slow = sum(keys[:, h // g].astype(np.float32) @ q[h] for h in range(HQ))
    assert np.allclose(fast, slow, rtol=1e-4, atol=1e-3)


def test_retrieve_returns_window_and_selected_clusters_bit_exact(store, rng):
    s, kv, cl = store
    r = Retriever(s, ratio=0.1)
    q = rng.standard_normal((HQ, D))
    out = r.retrieve(0, q, torch=False)
    li = s.layer(0)
    win = r.window(0)
    assert list(win) == list(range(S - 50, S))           # min(64, budget 200 // 4)
    want = set(win.tolist())
    for c in out.clusters:
        want |= set(cl[c].tolist())
    assert set(out.positions.tolist()) == want                 # union, deduplicated
    assert (np.diff(out.positions) > 0).all()
    assert same_bits(out.k, kv[out.positions][:, 0].transpose(1, 0, 2))
    assert same_bits(out.v, kv[out.positions][:, 1].transpose(1, 0, 2))
    st_ = out.stats
    # entries are distinct (a token in several selected clusters counts once)
    assert st_.entries == len(want) == st_.entries_dram + st_.entries_ssd
    assert sum(st_.disk_bytes) == st_.bytes_read
    # the clusters are the best-scoring ones
    sc = r.score(0, q)[0]
    assert sc[out.clusters].min() >= np.delete(sc, out.clusters).max()
    # the budget ceil(r S) is met by the last cluster chosen, not before it
    # (distinct entries: counting replicas twice would stop early)
    assert out.clusters.size < li.num_clusters
    last = out.clusters[np.argmin(sc[out.clusters])]
    before = set(win.tolist()).union(*(cl[c].tolist() for c in out.clusters if c != last))
    assert len(before) < r.budget(0) <= len(want)


def test_budget_counts_distinct_entries(tmp_path, rng):
    """Every cluster repeats 20 tokens of the local window (replicas): the
    budget ceil(r S) counts each entry once, so a selection that counted the
    copies again would stop after half the clusters it needs."""
    s = Store.create(tmp_path / "st", disks=3, num_layers=1, num_kv_heads=H, head_dim=D,
                     num_query_heads=HQ, dtype="float16")
    kv = random_kv(rng, S, H, D, "float16")
    own = np.array_split(np.arange(S), 40)                      # disjoint, 50 each
    cl = [np.concatenate([o, np.setdiff1d(S - 1 - rng.choice(48, 20, replace=False), o)])
          for o in own]
    s.write_layer(0, kv, cl, local_window=64)
    r = Retriever(s, ratio=0.2)
    for _ in range(3):
        q = rng.standard_normal((HQ, D))
        out = r.retrieve(0, q, torch=False)
        win = set(r.window(0).tolist())
        got = set(out.positions.tolist())
        assert got == win.union(*(cl[c].tolist() for c in out.clusters))
        assert out.stats.entries == len(got) == out.positions.shape[0]
        sc = r.score(0, q)[0]
        last = out.clusters[np.argmin(sc[out.clusters])]
        before = win.union(*(cl[c].tolist() for c in out.clusters if c != last))
        assert len(before) < r.budget(0) <= len(got)
    s.close()


def test_hot_clusters_and_window_are_served_from_dram(store, rng):
    s, kv, cl = store
    r = Retriever(s, ratio=0.5)
    out = r.retrieve(0, rng.standard_normal((HQ, D)), torch=False)
    resident = set(range(S - 64, S)) | set(cl[3].tolist()) | set(cl[17].tolist())
    on_ssd = set(out.positions.tolist()) - resident
    assert out.stats.entries_ssd == len(on_ssd)


def test_batch_retrieval_unites_queries_in_one_read(store, rng):
    s, kv, cl = store
    r = Retriever(s, ratio=0.05)
    qs = rng.standard_normal((4, HQ, D))
    singles = [set(r.retrieve(0, q, torch=False).positions.tolist()) for q in qs]
    before = s.stats().engine.executes
    out = r.retrieve(0, qs, torch=False)
    assert s.stats().engine.executes == before + 1           # one batched submission
    assert set(out.positions.tolist()) == set().union(*singles)


def test_no_dedup_reads_duplicates(store, rng):
    s, kv, cl = store
    q = rng.standard_normal((HQ, D))
    a = Retriever(s, ratio=0.3).retrieve(0, q, torch=False)
    b = Retriever(s, ratio=0.3, dedup=False).retrieve(0, q, torch=False)
    assert a.stats.duplicates_removed > 0
    assert b.stats.entries_ssd == a.stats.entries_ssd + a.stats.duplicates_removed
    assert set(b.positions.tolist()) == set(a.positions.tolist())


def test_token_selector_is_the_exact_top_k(store, rng):
    s, kv, cl = store
    keys = kv[:, 0].reshape(S, H * D)
    r = Retriever(s, ratio=0.1, selector=TokenSelector({0: keys}))
    q = rng.standard_normal((HQ, D))
    out = r.retrieve(0, q, torch=False)
    sc = group_queries(q, H)[0] @ keys.astype(np.float32).T
    W = len(r.window(0))
    sc[S - W:] = -np.inf
    k = r.budget(0) - W
    assert set(np.argsort(-sc)[:k].tolist()) <= set(out.positions.tolist())
    assert out.stats.entries == r.budget(0)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31))
def test_quest_bound_is_an_upper_bound(seed):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((40, 8)).astype(np.float32)
    groups = np.array_split(np.arange(40), 5)
    lo = np.stack([keys[g].min(0) for g in groups])
    hi = np.stack([keys[g].max(0) for g in groups])
    qg = rng.standard_normal((1, 8)).astype(np.float32)
    ub = BoundSelector({0: (lo, hi)}).scores(0, qg)[0]
    for c, g in enumerate(groups):
        assert ub[c] >= (keys[g] @ qg[0]).max() - 1e-4


def test_multi_vector_selector_takes_best_representative(rng):
    reps = rng.standard_normal((10, 3, 8)).astype(np.float16)
    qg = rng.standard_normal((1, 8)).astype(np.float32)
    got = MultiVectorSelector({0: reps}).scores(0, qg)[0]
    want = (reps.astype(np.float32) @ qg[0]).max(axis=1)
    assert np.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_bad_queries(store):
    s, _, _ = store
    r = Retriever(s)
    with pytest.raises(E.ShapeError):
        r.retrieve(0, np.zeros((3, D)))          # 3 query heads for 2 KV heads
    with pytest.raises(E.InvalidRatioError):
        Retriever(s, ratio=0)


def test_prefetch_overlaps_and_matches_retrieve(store, rng):
    s, kv, cl = store
    r = Retriever(s, ratio=0.1)
    q = rng.standard_normal((HQ, D))
    fut = r.prefetch(0, q, torch=False)
    direct = r.retrieve(0, q, torch=False)
    got = fut.result(timeout=30)
    assert np.array_equal(got.positions, direct.positions)
    assert same_bits(got.k, direct.k)
    r.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_and_pinned_outputs_are_the_stored_entries(tmp_path, rng, dtype):
    torch = pytest.importorskip("torch")
    s = Store.create(tmp_path / "t", disks=3, num_layers=1, num_kv_heads=H, head_dim=D,
                     num_query_heads=HQ, dtype=dtype)
    kv = random_kv(rng, 500, H, D, dtype)
    hot = np.zeros(40, bool)
    hot[:3] = True
    s.write_layer(0, kv, random_clusters(rng, 500, 40, 60), hot=hot, local_window=16)
    r = Retriever(s, ratio=0.3)
    q = rng.standard_normal((2, HQ, D))
    for kw in ({"torch": True}, {"torch": True, "pinned": True}, {"torch": False,
                                                                  "pinned": True}):
        out = r.retrieve(0, q, **kw)
        assert out.stats.entries_dram > 0 and out.stats.entries_ssd > 0
        k = out.k.view(torch.int16).numpy() if kw["torch"] else out.k.view(np.int16)
        v = out.v.view(torch.int16).numpy() if kw["torch"] else out.v.view(np.int16)
        want = kv[out.positions].view(np.int16)
        assert np.array_equal(k, want[:, 0].transpose(1, 0, 2))
        assert np.array_equal(v, want[:, 1].transpose(1, 0, 2))
        if kw["torch"]:
            assert str(out.k.dtype) == f"torch.{dtype}"
            assert out.k.shape == (H, len(out.positions), D)
    s.close()


def test_retrieve_into_caller_buffers(store, rng):
    s, kv, cl = store
    r = Retriever(s, ratio=0.1)
    kb = np.zeros((H, S, D), np.float16)
    vb = np.zeros((H, S, D), np.float16)
    for q in rng.standard_normal((3, HQ, D)):
        out = r.retrieve(0, q, torch=False, out=(kb, vb))
        n = len(out.positions)
        assert np.shares_memory(out.k, kb) and out.k.shape == (H, n, D)
        assert same_bits(kb[:, :n], kv[out.positions][:, 0].transpose(1, 0, 2))
        assert same_bits(vb[:, :n], kv[out.positions][:, 1].transpose(1, 0, 2))
    for bad in ((kb[:, :10], vb[:, :10]),                       # too small
                (kb.astype(np.float32), vb.astype(np.float32)),  # wrong dtype
                (kb[:, ::2], vb[:, ::2]), kb):                  # not contiguous, not a pair
        with pytest.raises(E.InvalidArgumentError):
            r.retrieve(0, rng.standard_normal((HQ, D)), torch=False, out=bad)
    st_ = r.layer_state(0)
    pinned_left = st_.refs.copy()
    r2 = Retriever(s, ratio=0.1)               # a fresh state: the references it starts with
    assert np.array_equal(pinned_left, r2.layer_state(0).refs)   # failed calls unpinned
    toks = np.flatnonzero(st_.resident)
    assert same_bits(st_.rows[st_.slot[toks]], kv[toks].reshape(len(toks), -1).view(np.uint8))


@pytest.mark.slow
def test_retrieve_into_kv_buffers_stores_whole_lines_on_every_path(tmp_path, rng, each_path):
    """A step large enough for streaming stores (>= 16 MiB of K and V, 256-byte
    rows, 64-byte aligned kv_buffers) returns the stored bytes on every kernel
    path, placed by one thread or split over two (assembly_threads), from SSD
    and from the DRAM pool, into the reused buffers."""
    from swarmfs.store._kernels import gather_kv_mode, set_kernel_path
    S_, H_, D_ = 4096, 16, 128                      # 8 KiB entries
    s, kv, _ = random_layer_store(tmp_path / "big", rng, S=S_, H=H_, HQ=16, D=D_, disks=4,
                                  clusters=96, hot=(0, 1), local_window=64)
    try:
        r = Retriever(s, ratio=0.75)
        assert r.assembly_threads == 1                  # the default
        kb, vb = r.kv_buffers(S_)
        assert kb.shape == (H_, S_, D_) and kb.dtype == np.float16 and not kb.any()
        assert kb.ctypes.data % 64 == 0 and vb.ctypes.data % 64 == 0
        for path, threads in itertools.product(each_path, (1, 2)):
            set_kernel_path(path)
            r.assembly_threads = threads            # both ways place the same bytes
            q = rng.standard_normal((16, D_)).astype(np.float32)
            out = r.retrieve(0, q, torch=False, out=(kb, vb))
            n = len(out.positions)
            assert out.stats.entries_dram > 0 and out.stats.entries_ssd * 8192 >= 16 << 20
            if path in ("avx2", "avx512"):
                assert gather_kv_mode(kb, vb, out.stats.entries_ssd) != "copy"
            assert same_bits(kb[:, :n], kv[out.positions][:, 0].transpose(1, 0, 2)), path
            assert same_bits(vb[:, :n], kv[out.positions][:, 1].transpose(1, 0, 2)), path
        for bad in (0, -3, 2.5, True):
            with pytest.raises(E.InvalidArgumentError):
                r.kv_buffers(bad)
        torch = pytest.importorskip("torch")
        kg = torch.zeros((H_, S_, D_), dtype=torch.float16, requires_grad=True)
        with pytest.raises(E.InvalidArgumentError, match="requires grad"):
            r.retrieve(0, q, torch=False, out=(kg, torch.zeros_like(kg)))
        for bad in (0, 3, 1.5, True, "2"):
            with pytest.raises(E.InvalidArgumentError, match="assembly_threads") as ei:
                Retriever(s, assembly_threads=bad)
            assert ei.value.store == str(s.path)
    finally:
        s.close()


@pytest.mark.slow
@pytest.mark.parametrize("verify", [False, True])
def test_retriever_state_of_an_older_generation_never_reads_reclaimed_space(tmp_path, rng,
                                                                             verify):
    """A Retriever's layer state (and any retrieval in flight) holds the
    LayerIndex of the generation it started with.  When the same Store
    appends many times, the space that generation references must not be
    handed to later commits while it is still read: before the fix, 128 of
    512 rows came back as other entries' bytes with verify=False (and a false
    ChecksumError with verify=True)."""
    S_ = 512
    s, kv, _ = random_layer_store(tmp_path / "st", rng, S=S_, H=H, HQ=HQ, D=D, disks=4,
                                  clusters=32, local_window=8)
    s.close()
    s = Store.open(tmp_path / "st", verify=verify, writable=True)
    try:
        r = Retriever(s, ratio=1.0)
        q = rng.standard_normal((HQ, D)).astype(np.float32)
        r.retrieve(0, q, torch=False)                  # state of generation 1
        for i in range(10):                            # each append frees one cluster's
            s.append(0, random_kv(rng, 8, H, D, "float16"), [[i]] * 8)    # extents
        out = r.retrieve(0, q, torch=False)            # still the generation-1 state
        assert out.positions.shape[0] == S_
        assert same_bits(out.k, kv[out.positions][:, 0].transpose(1, 0, 2))
        assert same_bits(out.v, kv[out.positions][:, 1].transpose(1, 0, 2))
        # once nothing reads the old generation, its space is reused again
        import gc
        del out
        r.refresh(0)
        gc.collect()
        end = [d["end"] for d in s.manifest["disks"]]
        for i in range(10):
            s.append(0, random_kv(rng, 8, H, D, "float16"), [[i]] * 8)
        grew = sum(d["end"] for d in s.manifest["disks"]) - sum(end)
        assert grew < 10 * 4 * s.block_size        # reclaimed ranges took most extents
        li = s.layer(0)
        assert same_bits(s.read_entries(0, np.arange(S_)), kv)
        assert li.num_tokens == S_ + 160
    finally:
        s.close()


def test_retrieve_out_with_k_and_v_sharing_memory_is_refused(store, rng):
    """out=(buf, buf) used to return V in both K and V (V overwrote K), no error."""
    s, kv, _ = store
    r = Retriever(s, ratio=0.1)
    q = rng.standard_normal((HQ, D))
    buf = np.empty((H, S, D), np.float16)
    with pytest.raises(E.InvalidArgumentError, match="share memory"):
        r.retrieve(0, q, torch=False, out=(buf, buf))
    big = np.empty((H, 2 * S, D), np.float16)
    with pytest.raises(E.InvalidArgumentError):     # not contiguous views of one buffer
        r.retrieve(0, q, torch=False, out=(big[:, :S], big[:, S:]))
    kb, vb = np.empty((H, S, D), np.float16), np.empty((H, S, D), np.float16)
    out = r.retrieve(0, q, torch=False, out=(kb, vb))
    assert same_bits(out.k, kv[out.positions][:, 0].transpose(1, 0, 2))
    assert same_bits(out.v, kv[out.positions][:, 1].transpose(1, 0, 2))


def test_set_hot_with_a_retrieval_of_a_rewritten_layer_is_refused(tmp_path, rng):
    """set_hot filled the DRAM pool from a retrieval taken before the layer
    was rewritten: afterwards 504 of 512 rows came back with the old bytes,
    on every retrieval, with no error."""
    S_ = 512
    s = Store.create(tmp_path / "st", disks=4, num_layers=1, num_kv_heads=H, head_dim=D,
                     num_query_heads=HQ, dtype="float16")
    kv, cl = random_kv(rng, S_, H, D, "float16"), random_clusters(rng, S_, 32)
    s.write_layer(0, kv, cl, local_window=8)
    r = Retriever(s, ratio=1.0)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    old = r.retrieve(0, q, torch=False)
    kv2 = random_kv(rng, S_, H, D, "float16")
    s.write_layer(0, kv2, cl, local_window=8)
    r.refresh(0)
    with pytest.raises(E.InvalidArgumentError, match="current index"):
        r.set_hot(0, np.ones(32, bool), old)
    assert not r.layer_state(0).hot.any()
    new = r.retrieve(0, q, torch=False)
    admitted, _ = r.set_hot(0, np.ones(32, bool), new)          # the current one works
    assert admitted.tolist() == list(range(32))
    out = r.retrieve(0, q, torch=False)
    assert out.stats.entries_dram == S_
    assert same_bits(out.rows, kv2.reshape(S_, -1).view(np.uint8))
    s.close()


def test_layer_state_built_while_the_layer_is_rewritten_serves_one_generation(tmp_path, rng):
    """The DRAM partition took the LayerIndex of generation g, then read the
    window and hot rows with ``read_entries``, which uses the Store's current
    index: a rewrite committed in between put generation g+1's bytes in DRAM
    beside generation g's SSD reads (mixed rows, no error)."""
    S_ = 512
    s = Store.create(tmp_path / "st", disks=4, num_layers=1, num_kv_heads=H, head_dim=D,
                     num_query_heads=HQ, dtype="float16")
    kv, cl = random_kv(rng, S_, H, D, "float16"), random_clusters(rng, S_, 32)
    hot = np.zeros(32, bool)
    hot[:8] = True
    s.write_layer(0, kv, cl, hot=hot, local_window=16)
    kv2 = random_kv(rng, S_, H, D, "float16")
    import threading
    real_layer, fired = s.layer, []

    def layer(i):                  # fault injection: commit a rewrite right after the
        li = real_layer(i)         # DRAM partition picked its LayerIndex
        if not fired:
            fired.append(1)
            t = threading.Thread(target=s.write_layer, args=(0, kv2, cl),
                                 kwargs=dict(hot=hot, local_window=16))
            t.start()
            t.join(timeout=60)
        return li
    s.layer = layer
    r = Retriever(s, ratio=1.0)
    out = r.retrieve(0, rng.standard_normal((HQ, D)), torch=False)
    assert fired and s.manifest["generation"] == 2
    assert out.stats.entries_dram > 0 and out.positions.tolist() == list(range(S_))
    assert same_bits(out.rows, kv.reshape(S_, -1).view(np.uint8))     # all generation 1
    s.close()


def test_loaded_indexes_of_other_layers_do_not_stop_space_reuse(tmp_path, rng):
    """Claims follow the commits that leave a layer unchanged: a Retriever
    holding layer 1 while layer 0 is appended to does not pin generation 1
    (which would stop every reuse of layer 0's freed extents)."""
    S_ = 256
    kv = random_kv(rng, S_, H, D, "float16")
    s = Store.create(tmp_path / "st", disks=4, num_layers=2, num_kv_heads=H, head_dim=D,
                     num_query_heads=HQ, dtype="float16")
    for layer in (0, 1):
        s.write_layer(layer, kv, random_clusters(rng, S_, 16), local_window=8)
    r = Retriever(s, ratio=1.0)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    r.retrieve(1, q, torch=False)                      # layer 1's state stays loaded
    ends = []
    for i in range(20):
        s.append(0, random_kv(rng, 8, H, D, "float16"), [[i % 16]] * 8)
        ends.append(sum(d["end"] for d in s.manifest["disks"]))
    assert ends[-1] - ends[5] < 14 * 4 * s.block_size  # freed extents were reused
    out = r.retrieve(1, q, torch=False)
    assert same_bits(out.rows, kv.reshape(S_, -1).view(np.uint8))
    s.close()
