"""Decode-time maintenance (SWARM §6.2): new entries, eq. 9 joins, cache replacement."""

import numpy as np
import pytest

from conftest import random_clusters, random_kv, random_layer_store, same_bits
from swarmfs import Retriever, Store
from swarmfs import _errors as E
from swarmfs.decode._online import DecodeSession

S, H, HQ, D = 1200, 2, 4, 16


@pytest.fixture
def store(tmp_path, rng):
    s, kv, cl = random_layer_store(tmp_path / "st", rng, S=S, H=H, HQ=HQ, D=D, disks=3,
                                   clusters=60, extra_copies=100, hot=range(4),
                                   freq=np.ones(60), local_window=32)
    yield s, kv, cl
    s.close()


def test_pending_entries_are_served_then_placed_by_eq9(store, rng):
    s, kv, cl = store
    r = Retriever(s, ratio=0.2)
    sess = DecodeSession(r, 0, window=8, flush_batch=4, tau=0.7, max_joins=2)
    new_kv = random_kv(rng, 20, H, D, "float16")
    flushed = []
    for t in range(20):
        q = rng.standard_normal((HQ, D)).astype(np.float32)
        n_stored, n_pending = s.num_tokens(0), sess.pending
        out = sess.step(q, new_kv[t, 0], new_kv[t, 1])
        # every pending entry (the previous steps' tokens not yet placed) is served
        pend = out.positions[out.positions >= n_stored]
        assert pend.tolist() == list(range(n_stored, n_stored + n_pending))
        assert (np.diff(out.positions) > 0).all()
        flushed.extend(out.flushed.tolist())
    assert flushed == list(range(S, S + len(flushed))) and len(flushed) >= 8
    flushed += sess.flush().tolist()
    assert flushed == list(range(S, S + 20)) and sess.pending == 0
    assert s.num_tokens(0) == S + 20
    all_kv = np.concatenate([kv, new_kv])
    assert same_bits(s.read_entries(0, np.arange(S + 20)), all_kv)
    assert s.verify() == []
    # after placement, retrieval still returns bit-exact rows
    out = r.retrieve(0, rng.standard_normal((HQ, D)), torch=False)
    assert same_bits(out.rows, all_kv[out.positions].reshape(len(out.positions), -1)
                     .view(np.uint8))



def test_many_pending_entries_grow_the_buffers_and_stay_exact(store, rng):
    """A window of 40 steps keeps up to 47 entries pending, past the pending
    buffers' first two capacities (16, 32): every step serves each pending
    entry's exact K and V, flushes (with new clusters made in between) keep
    the rest and their counts, and everything reads back bit-exact."""
    s, kv, cl = store
    r = Retriever(s, ratio=0.2)
    sess = DecodeSession(r, 0, window=40, flush_batch=8, tau=0.7, max_joins=2,
                         new_cluster_size=3)
    steps = 70
    new_kv = random_kv(rng, steps, H, D, "float16")
    flushed, most = [], 0
    for t in range(steps):
        q = rng.standard_normal((HQ, D)).astype(np.float32)
        n_stored, n_pending = s.num_tokens(0), sess.pending
        most = max(most, n_pending)
        out = sess.step(q, new_kv[t, 0], new_kv[t, 1])
        at = np.flatnonzero(out.positions >= n_stored)
        assert (out.positions[at] - S).tolist() == list(range(n_stored - S, n_stored - S +
                                                              n_pending))
        assert same_bits(out.k[:, at], new_kv[out.positions[at] - S, 0].transpose(1, 0, 2))
        assert same_bits(out.v[:, at], new_kv[out.positions[at] - S, 1].transpose(1, 0, 2))
        assert sess.pend_f.shape == (sess.pending, s.num_clusters(0))
        assert sess.pend_age.tolist() == sorted(sess.pend_age.tolist(), reverse=True)
        flushed.extend(out.flushed.tolist())
    assert most > 32 and len(flushed) >= 16
    flushed += sess.flush().tolist()
    assert flushed == list(range(S, S + steps)) and sess.pending == 0
    all_kv = np.concatenate([kv, new_kv])
    assert same_bits(s.read_entries(0, np.arange(S + steps)), all_kv)
    assert s.verify() == []

def test_eq9_joins_follow_the_counts(store):
    s, _, _ = store
    sess = DecodeSession(Retriever(s), 0, window=10, tau=0.5, max_joins=2)
    f = np.zeros((3, 60), np.int32)
    f[0, [5, 9, 11]] = [9, 6, 8]      # d = 0.1, 0.4, 0.2: joins 5 then 11 (max 2)
    f[1, 7] = 5                      # d = 0.5: not < tau
    f[2, 3] = 10
    ptr, cl = sess.joins(f)
    assert list(ptr) == [0, 2, 2, 3] and list(cl) == [5, 11, 3]


def test_cache_replacement_stays_in_budget_and_serves_bit_exact(store, rng):
    s, kv, cl = store
    r = Retriever(s, ratio=0.15)
    budget = sum(len(cl[c]) for c in range(4)) * s.entry_bytes
    sess = DecodeSession(r, 0, hot_budget_bytes=budget)
    changed = hits = lookups = 0
    for _ in range(30):
        hot_before = r.layer_state(0).hot.copy()
        out = sess.step(rng.standard_normal((HQ, D)).astype(np.float32))
        hits += int(hot_before[out.retrieval.clusters].sum())
        lookups += len(out.retrieval.clusters)
        st = r.layer_state(0)
        assert st.li.sizes[st.hot].sum() * s.entry_bytes <= budget
        changed += len(out.admitted) + len(out.evicted)
        # resident rows are the right bytes
        toks = np.flatnonzero(st.resident)
        assert same_bits(st.rows[st.slot[toks]],
                         kv[toks].reshape(len(toks), -1).view(np.uint8))
        assert same_bits(out.k, kv[out.positions][:, 0].transpose(1, 0, 2))
    assert changed > 0
    assert hits > 0 and sess.hit_rate == hits / lookups


def test_choose_hot_is_the_replacement_policy_hook(store, rng):
    """A subclass's choose_hot decides the hot set (the Fig. 15 LRU baseline
    relies on it): a policy that caches nothing empties DRAM, and one that
    caches exactly this step's clusters holds them after the step."""
    s, _, _ = store

    class Nothing(DecodeSession):
        def choose_hot(self, hot, ret):
            return np.zeros_like(hot)

    class Latest(DecodeSession):
        def choose_hot(self, hot, ret):
            want = np.zeros_like(hot)
            want[ret.clusters] = True
            return want

    r = Retriever(s, ratio=0.05)
    big = 10 * S * s.entry_bytes
    out = Nothing(r, 0, hot_budget_bytes=big).step(rng.standard_normal((HQ, D)))
    assert not r.layer_state(0).hot.any() and len(out.evicted) == 4
    r2 = Retriever(s, ratio=0.05)
    out = Latest(r2, 0, hot_budget_bytes=big).step(rng.standard_normal((HQ, D)))
    assert np.flatnonzero(r2.layer_state(0).hot).tolist() == \
        sorted(set(out.retrieval.clusters.tolist()))


def test_bad_session_input(store, rng):
    s, _, _ = store
    with pytest.raises(E.InvalidRatioError, match="tau"):
        DecodeSession(Retriever(s), 0, tau=0)
    sess = DecodeSession(Retriever(s), 0)
    with pytest.raises(E.ShapeError):
        sess.step(rng.standard_normal((HQ, D)), np.zeros((H, D), np.float32),
                  np.zeros((H, D), np.float32))


# -- concurrency (issue 9 item 0) --------------------------------------------------

def _hook_execute(s, during):
    """Run ``during()`` while a retrieval is inside its disk read (fault
    injection at the one racy point: between the residency decision and the
    use of the DRAM rows)."""
    real = type(s).execute

    def execute(li, plan, copies, **kw):
        during()
        return real(s, li, plan, copies, **kw)
    s.execute = execute


def test_eviction_during_a_read_returns_the_stored_rows(tmp_path, rng):
    # the smallest input: 64 tokens, 8 clusters of 8, clusters 0 and 1
    # hot; cluster 0 is evicted while a retrieve that counted it resident reads
    S, H_, HQ_, D_ = 64, 2, 4, 8
    s = Store.create(tmp_path / "st", disks=2, num_layers=1, num_kv_heads=H_, head_dim=D_,
                     num_query_heads=HQ_, dtype="float16")
    kv = random_kv(rng, S, H_, D_, "float16")
    hot = np.zeros(8, bool)
    hot[[0, 1]] = True
    s.write_layer(0, kv, [np.arange(8 * i, 8 * i + 8) for i in range(8)], hot=hot,
                  local_window=8)
    r = Retriever(s, ratio=1.0)
    st = r.layer_state(0)
    import threading
    evicted = []

    def evict_in_another_thread():
        if not evicted:
            t = threading.Thread(target=lambda: (st.evict([0]), evicted.append(0)))
            t.start()
            t.join(timeout=30)
    _hook_execute(s, evict_in_another_thread)
    out = r.retrieve(0, rng.standard_normal((HQ_, D_)), torch=False)
    assert evicted == [0] and not st.hot[0]
    assert out.positions.tolist() == list(range(S))
    assert same_bits(out.rows, kv.reshape(S, -1).view(np.uint8))
    s.close()


def test_second_concurrent_step_raises_and_changes_nothing(store, rng):
    s, kv, cl = store
    r = Retriever(s, ratio=0.15)
    sess = DecodeSession(r, 0, window=4, flush_batch=2)
    import threading
    inside, release = threading.Event(), threading.Event()

    def block_once():
        if not inside.is_set():
            inside.set()
            release.wait(30)
    _hook_execute(s, block_once)
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("out", sess.step(
        rng.standard_normal((HQ, D)).astype(np.float32))))
    t.start()
    assert inside.wait(30)
    freq, hot = sess.freq.copy(), r.layer_state(0).hot.copy()
    new = random_kv(rng, 1, H, D, "float16")[0]
    for call in (lambda: sess.step(np.ones((HQ, D), np.float32), new[0], new[1]),
                 lambda: DecodeSession(r, 0).step(np.ones((HQ, D), np.float32)),
                 sess.flush):
        with pytest.raises(E.ConcurrentUseError):
            call()
        assert np.array_equal(sess.freq, freq) and sess.pending == 0
        assert np.array_equal(r.layer_state(0).hot, hot)
    release.set()
    t.join(30)
    assert "out" in first and same_bits(first["out"].k,
                                        kv[first["out"].positions][:, 0].transpose(1, 0, 2))


@pytest.mark.slow
@pytest.mark.parametrize("reuse", [False, True])
def test_stress_prefetch_and_retrieve_beside_stepping(store, rng, reuse):
    """Readers (retrieve and prefetch) on the layer a DecodeSession steps,
    evicts, admits and appends to: every returned row equals the store's
    truth; also with the session building K/V in its reused buffers
    (reuse_outputs, include_new) while the readers run."""
    import threading
    s, kv, cl = store
    r = Retriever(s, ratio=0.15)
    budget = sum(len(cl[c]) for c in range(3)) * s.entry_bytes
    sess = DecodeSession(r, 0, window=4, flush_batch=3, hot_budget_bytes=budget,
                         reuse_outputs=reuse)
    steps = 60
    new_kv = random_kv(rng, steps, H, D, "float16")
    truth = np.concatenate([kv, new_kv]).reshape(S + steps, -1).view(np.uint8)
    done = threading.Event()
    errors, checked = [], [0]
    qs = np.random.default_rng(7).standard_normal((64, HQ, D)).astype(np.float32)

    def reader(i):
        j = 0
        try:
            while not done.is_set():
                q = qs[(i * 13 + j) % len(qs)]
                out = r.prefetch(0, q, torch=False).result(60) if j % 2 else \
                    r.retrieve(0, q, torch=False)
                if not same_bits(out.rows, truth[out.positions]):
                    bad = np.flatnonzero((out.rows != truth[out.positions]).any(axis=1))
                    errors.append(f"positions {out.positions[bad][:8].tolist()} wrong")
                checked[0] += len(out.positions)
                j += 1
        except Exception as exc:       # noqa: BLE001 - reported below
            errors.append(repr(exc))
    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    moved = 0
    try:
        for t_ in range(steps):
            out = sess.step(rng.standard_normal((HQ, D)).astype(np.float32),
                            new_kv[t_, 0], new_kv[t_, 1], include_new=reuse)
            moved += len(out.admitted) + len(out.evicted)
            want = truth[out.positions].view(np.float16).reshape(-1, 2, H, D)
            assert same_bits(out.k, want[:, 0].transpose(1, 0, 2))
            assert same_bits(out.v, want[:, 1].transpose(1, 0, 2))
    finally:
        done.set()
        for t in threads:
            t.join(120)
    r.close()
    assert errors == []
    assert checked[0] > 10_000 and moved > 0 and s.num_tokens(0) > S
    st = r.layer_state(0)
    assert st.refs.min() >= 0
    assert len(np.unique(st.free)) == len(st.free)
    assert st.li.sizes[st.hot].sum() * s.entry_bytes <= budget
    toks = np.flatnonzero(st.resident)
    assert same_bits(st.rows[st.slot[toks]], truth[toks])


def test_step_with_torch_bfloat16_on_a_bf16_store(tmp_path, rng):
    torch = pytest.importorskip("torch")
    S_, H_, HQ_, D_ = 300, 2, 4, 16
    s = Store.create(tmp_path / "bf", disks=2, num_layers=1, num_kv_heads=H_, head_dim=D_,
                     num_query_heads=HQ_, dtype="bfloat16")
    kv = random_kv(rng, S_, H_, D_, "bfloat16")
    s.write_layer(0, kv, random_clusters(rng, S_, 20, 20), local_window=8)
    r = Retriever(s, ratio=0.2)
    sess = DecodeSession(r, 0, window=2, flush_batch=2)
    new = random_kv(rng, 6, H_, D_, "bfloat16")
    for t in range(6):
        q = torch.randn(HQ_, D_, dtype=torch.bfloat16)
        k_t = torch.from_numpy(new[t, 0].view(np.int16).copy()).view(torch.bfloat16)
        v_t = torch.from_numpy(new[t, 1].view(np.int16).copy()).view(torch.bfloat16)
        out = sess.step(q, k_t, v_t)
        assert same_bits(out.k[:, out.positions < S_], kv[out.positions[out.positions < S_]]
                         [:, 0].transpose(1, 0, 2))
    sess.flush()
    assert s.num_tokens(0) == S_ + 6
    assert same_bits(s.read_entries(0, np.arange(S_, S_ + 6)), new)
    # a float32 tensor on a bf16 store is refused before anything changes
    freq = sess.freq.copy()
    with pytest.raises(E.ShapeError):
        sess.step(torch.randn(HQ_, D_), torch.zeros(H_, D_), torch.zeros(H_, D_))
    assert np.array_equal(sess.freq, freq) and sess.pending == 0
    s.close()


def test_rejected_step_changes_nothing(store, rng):
    s, kv, cl = store
    r = Retriever(s, ratio=0.15)
    sess = DecodeSession(r, 0, window=4)
    sess.step(rng.standard_normal((HQ, D)).astype(np.float32))
    freq, hot, hits = sess.freq.copy(), r.layer_state(0).hot.copy(), sess.lookups
    good = np.zeros((H, D), np.float16)
    nan = good.copy()
    nan[0, 0] = np.nan
    for args in ((np.zeros((HQ + 1, D)),),                               # bad query
                 (np.zeros((2, HQ, D)),),                                # a batch
                 (np.zeros((HQ, D)), good, None),                        # V missing
                 (np.zeros((HQ, D)), good.astype(np.float32), good),     # wrong dtype
                 (np.zeros((HQ, D)), good[:1], good),                    # wrong shape
                 (np.zeros((HQ, D)), nan, good)):                        # NaN
        with pytest.raises(E.ShapeError):
            sess.step(*args)
        assert np.array_equal(sess.freq, freq) and sess.lookups == hits
        assert np.array_equal(r.layer_state(0).hot, hot) and sess.pending == 0


def test_pipelined_step_over_layers_equals_stepping_each(tmp_path, rng):
    from swarmfs import pipelined_step
    L, S_ = 3, 400
    s = Store.create(tmp_path / "p", disks=3, num_layers=L, num_kv_heads=H, head_dim=D,
                     num_query_heads=HQ, dtype="float16")
    kvs = [random_kv(rng, S_, H, D, "float16") for _ in range(L)]
    for layer in range(L):
        hot = np.zeros(30, bool)
        hot[:2] = True
        s.write_layer(layer, kvs[layer], random_clusters(rng, S_, 30, 40), hot=hot,
                      local_window=8)
    r = Retriever(s, ratio=0.2)
    sessions = [DecodeSession(r, layer, window=2, flush_batch=2) for layer in range(L)]
    truth = [k.reshape(S_, -1).view(np.uint8) for k in kvs]
    new = [random_kv(rng, 6, H, D, "float16") for _ in range(L)]
    truth = [np.concatenate([truth[i], new[i].reshape(6, -1).view(np.uint8)]) for i in range(L)]
    for t in range(6):
        qs = rng.standard_normal((L, HQ, D)).astype(np.float32)
        out = pipelined_step(sessions, list(qs), lambda i, res: res.k.shape[1],
                             new_kv=[(new[i][t, 0], new[i][t, 1]) for i in range(L)])
        assert len(out.steps) == L and out.step_us > 0
        assert out.max_us <= out.sum_us
        for i, res in enumerate(out.steps):
            assert out.results[i] == len(res.positions)
            want = truth[i][res.positions].view(np.float16).reshape(-1, 2, H, D)
            assert same_bits(res.k, want[:, 0].transpose(1, 0, 2))
            assert same_bits(res.v, want[:, 1].transpose(1, 0, 2))
    for sess in sessions:
        sess.flush()
    assert [s.num_tokens(i) for i in range(L)] == [S_ + 6] * L
    # a retrieval of another layer, or of an index the session no longer has, is refused
    stale = r.retrieve(1, rng.standard_normal((HQ, D)), torch=False)
    with pytest.raises(E.SwarmError):
        sessions[0].step(rng.standard_normal((HQ, D)), retrieval=stale)
    r.close()
    s.close()


def test_retrieval_in_flight_across_many_appends_reads_its_generation(tmp_path, rng):
    """A retrieval inside its disk read while the same Store commits ten
    appends (each freeing a cluster's extents, which later appends reuse):
    it returns the generation it started with, bit exact, also with
    verify=False (before the fix: other entries' bytes, no error)."""
    S_ = 512
    s, kv, _ = random_layer_store(tmp_path / "st", rng, S=S_, H=H, HQ=HQ, D=D, disks=4,
                                  clusters=32, local_window=8)
    s.close()
    s = Store.open(tmp_path / "st", verify=False, writable=True)
    r = Retriever(s, ratio=1.0)
    import threading
    done = []

    def append_in_another_thread():
        if done:
            return
        done.append(0)

        def appends():
            for i in range(10):
                s.append(0, random_kv(rng, 8, H, D, "float16"), [[i]] * 8)
            done.append(1)
        t = threading.Thread(target=appends)
        t.start()
        t.join(timeout=60)
    _hook_execute(s, append_in_another_thread)
    out = r.retrieve(0, rng.standard_normal((HQ, D)), torch=False)
    assert done == [0, 1] and s.num_tokens(0) == S_ + 80
    assert any(d["free"] for d in s.manifest["disks"])
    assert out.positions.tolist() == list(range(S_))
    assert same_bits(out.rows, kv.reshape(S_, -1).view(np.uint8))
    s.close()


def test_pipelined_step_bad_arguments_raise_invalid_argument(store, rng):
    from swarmfs import pipelined_step
    s, kv, _ = store
    r = Retriever(s)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    sess = DecodeSession(r, 0)
    for args in ((5, 5, lambda i, x: 0), (["x"], [q], lambda i, x: 0),
                 ([sess], [q], None), ((x for x in [sess]), [q, q], lambda i, x: 0)):
        with pytest.raises(E.InvalidArgumentError):
            pipelined_step(*args)
    with pytest.raises(E.InvalidArgumentError):
        pipelined_step([sess], [q], lambda i, x: 0, new_kv=[5])
    with pytest.raises(E.InvalidRatioError, match="tau"):
        DecodeSession(r, 0, tau="x")
    with pytest.raises(E.SwarmError):
        sess.step(q, retrieval="not a retrieval")
    with pytest.raises(E.InvalidArgumentError):
        r.set_hot(0, np.ones(60, bool), None)
    assert sess.lookups == 0 and not r.layer_state(0).hot[4:].any()


def test_session_knobs_out_of_range_are_refused(store):
    """window=-1, flush_batch=0, max_joins=-1, hot_budget_bytes=-5 were accepted
    (window=-1 made every entry mature at once and never join a cluster)."""
    s, _, _ = store
    r = Retriever(s)
    for kw in (dict(window=-1), dict(window=0), dict(flush_batch=0), dict(max_joins=-1),
               dict(new_cluster_size=0), dict(hot_budget_bytes=-5), dict(window=2.5)):
        with pytest.raises(E.InvalidArgumentError):
            DecodeSession(r, 0, **kw)
    assert DecodeSession(r, 0, window=1, flush_batch=1, max_joins=0).window == 1


def test_new_cluster_size_and_no_deprecated_group_alias(store, rng):
    s, _, _ = store
    assert DecodeSession(Retriever(s), 0, new_cluster_size=5).new_cluster_size == 5
    with pytest.raises(E.InvalidCallError, match="'group'"):
        DecodeSession(Retriever(s), 0, group=5)
    kv = random_kv(rng, 10, H, D, "float16")
    c0 = s.num_clusters(0)
    s.append(0, kv, new_cluster_size=5)          # 10 lone tokens: 2 new clusters of 5
    assert s.num_clusters(0) == c0 + 2
    with pytest.raises(E.InvalidCallError, match="'group'"):
        s.append(0, kv, group=5)
    assert s.num_clusters(0) == c0 + 2


@pytest.mark.parametrize("include_new", [False, True])
def test_reused_outputs_equal_fresh_ones_step_by_step(tmp_path, rng, include_new):
    """DecodeSession(reuse_outputs=True) builds K/V in its own EntryBuffer in
    place (retrieved, pending, and with include_new this step's entry) and
    returns what a session without it returns, step by step, across buffer
    growth by appends and flushes, up to the order of the retrieved entries
    (landing order; the same entries, positions and bytes); its K/V are views
    of one buffer reused from step to step; a step given a prefetched
    retrieval copies as before."""
    outs = {}
    for reuse in (False, True):
        r2 = np.random.default_rng(7)
        s, kv, cl = random_layer_store(tmp_path / f"st{reuse}", r2, S=S, H=H, HQ=HQ, D=D,
                                       disks=3, clusters=60, extra_copies=100, hot=range(4),
                                       freq=np.ones(60), local_window=32)
        r = Retriever(s, ratio=0.2)
        sess = DecodeSession(r, 0, window=12, flush_batch=5, tau=0.7, max_joins=2,
                             reuse_outputs=reuse)
        new_kv = random_kv(r2, 40, H, D, "float16")
        res = []
        for t in range(40):
            q = r2.standard_normal((HQ, D)).astype(np.float32)
            given = r.retrieve(0, q, torch=False) if t % 7 == 3 else None
            x = sess.step(q, new_kv[t, 0], new_kv[t, 1], retrieval=given,
                          include_new=include_new)
            if include_new:
                assert x.positions[-1] == s.num_tokens(0) + sess.pending - 1
                assert same_bits(x.k[:, -1], new_kv[t, 0]) and same_bits(x.v[:, -1], new_kv[t, 1])
            if reuse and given is None:
                assert x.k.base is not None and np.shares_memory(x.k, sess._eb.rows)
            o = np.argsort(x.positions, kind="stable")
            if not reuse:
                assert np.array_equal(o, np.arange(o.size))     # ascending already
            res.append((x.k[:, o], x.v[:, o], x.positions[o], x.admitted, x.evicted,
                        x.flushed))
        outs[reuse] = res
        s.close()
    for t, (a, b) in enumerate(zip(outs[False], outs[True], strict=True)):
        for u, w in zip(a, b, strict=True):
            assert u.shape == w.shape and same_bits(u, w), t


def test_reuse_and_include_new_refuse_bad_values(store, rng):
    s, kv, cl = store
    r = Retriever(s, ratio=0.2)
    for bad in ("yes", 1, None):
        with pytest.raises(E.InvalidArgumentError, match="reuse_outputs"):
            DecodeSession(r, 0, reuse_outputs=bad)
    sess = DecodeSession(r, 0, reuse_outputs=True)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    new_kv = random_kv(rng, 1, H, D, "float16")
    with pytest.raises(E.ShapeError, match="include_new"):
        sess.step(q, include_new=True)
    with pytest.raises(E.InvalidArgumentError, match="include_new"):
        sess.step(q, new_kv[0, 0], new_kv[0, 1], include_new="yes")
    assert sess.pending == 0


def test_a_foreign_append_is_refused_before_the_step_changes_anything(tmp_path, rng):
    """Another writer appends to the layer (the Retriever not refreshed):
    the session's next step raises SwarmError at once, before adding its
    entry or touching counts and frequencies (its pending positions would
    collide with the other writer's tokens), and keeps refusing."""
    s, kv, cl = random_layer_store(tmp_path / "st", rng, S=300, H=H, HQ=HQ, D=D, disks=2,
                                   clusters=20, local_window=16)
    try:
        r = Retriever(s, ratio=0.3)
        for reuse in (False, True):
            sess = DecodeSession(r, 0, window=2, flush_batch=1, reuse_outputs=reuse)
            new = random_kv(rng, 4, H, D, "float16")
            q = rng.standard_normal((HQ, D)).astype(np.float32)
            sess.step(q, new[0, 0], new[0, 1])
            n0 = s.num_tokens(0)
            s.append(0, random_kv(rng, 3, H, D, "float16"), (np.array([0, 1, 2, 3]),
                                                             np.array([0, 0, 0])))
            pend, freq, age = sess.pending, sess.freq.copy(), sess.pend_age.copy()
            for t in (1, 2):
                with pytest.raises(E.SwarmError, match="changed under this DecodeSession"):
                    sess.step(q, new[t, 0], new[t, 1], include_new=True)
                assert sess.pending == pend and np.array_equal(sess.freq, freq)
                assert np.array_equal(sess.pend_age, age)
            assert s.num_tokens(0) == n0 + 3
            r.refresh(0)                        # a new session on the new layer works
            DecodeSession(r, 0, reuse_outputs=reuse).step(q, new[3, 0], new[3, 1])
    finally:
        s.close()


def test_reused_outputs_hold_every_copy_when_the_retriever_reads_without_dedup(tmp_path, rng):
    """With Retriever(dedup=False) a step returns every stored copy (more
    than S with replicas); reuse_outputs sizes its buffers for that and
    returns what a copying session returns (in landing order)."""
    res = {}
    for reuse in (False, True):
        r2 = np.random.default_rng(3)
        s, kv, cl = random_layer_store(tmp_path / f"st{reuse}", r2, S=300, H=H, HQ=HQ, D=D,
                                       disks=2, clusters=20, extra_copies=250,
                                       local_window=16)
        try:
            r = Retriever(s, ratio=1.0, dedup=False)
            sess = DecodeSession(r, 0, reuse_outputs=reuse)
            new = random_kv(r2, 3, H, D, "float16")
            out = []
            for t in range(3):
                q = r2.standard_normal((HQ, D)).astype(np.float32)
                x = sess.step(q, new[t, 0], new[t, 1], include_new=True)
                o = np.argsort(x.positions, kind="stable")    # reuse: landing order
                out.append((x.k[:, o], x.v[:, o], x.positions[o]))
            assert out[-1][2].shape[0] > s.num_tokens(0)       # copies beyond S
            res[reuse] = out
        finally:
            s.close()
    for a, b in zip(res[False], res[True], strict=True):
        for u, w in zip(a, b, strict=True):
            assert same_bits(u, w)


@pytest.mark.parametrize("bad", [0.0, 1.0, True, "0", None])
def test_a_layer_that_is_not_an_integer_is_refused_everywhere(store, rng, bad):
    """Every Retriever method taking a layer, and DecodeSession, refuse a
    layer that is not an integer: a float or a bool would otherwise find
    another layer's cached state (0.0 == 0, True == 1) once it is loaded."""
    s, kv, cl = store
    r = Retriever(s, ratio=0.2)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    r.retrieve(0, q)                                       # layer 0's state is loaded
    for call in (lambda: r.window(bad), lambda: r.budget(bad), lambda: r.hot(bad),
                 lambda: r.index(bad), lambda: r.dram_window(bad), lambda: r.layer_state(bad),
                 lambda: r.step_lock(bad), lambda: r.refresh(bad), lambda: r.retrieve(bad, q),
                 lambda: r.select(bad, q), lambda: DecodeSession(r, bad)):
        with pytest.raises(E.OutOfRangeError, match="layer must be an integer"):
            call()
    sess = DecodeSession(r, 0)
    with pytest.raises(E.InvalidArgumentError, match="must be a Retrieval"):
        sess.step(q, retrieval="x")
    assert sess.pending == 0


def test_discard_pending_forgets_the_newest_entries_and_their_steps(store, rng):
    """An assisted decoder's rejected drafts (swarmfs.hf's crop): the newest
    pending entries go without being written, the older ones get back the
    steps the drafts aged them by, and the session then runs as if they had
    never been fed: the same flushes, the same stored bytes."""
    s, kv, cl = store
    new_kv = random_kv(rng, 12, H, D, "float16")
    qs = rng.standard_normal((12, HQ, D)).astype(np.float32)
    r = Retriever(s, ratio=0.2)
    sess = DecodeSession(r, 0, window=8, flush_batch=2)
    for t in range(5):
        sess.step(qs[t], new_kv[t, 0], new_kv[t, 1])
    ages = sess.pend_age.copy()
    for t in range(3):                                    # three drafts
        sess.step(qs[5], new_kv[11 - t, 0], new_kv[11 - t, 1])
    assert sess.pending == 8
    sess.discard_pending(3)
    assert sess.pending == 5 and np.array_equal(sess.pend_age, ages)
    assert same_bits(sess.pend_rows.view(np.float16).reshape(5, 2, H, D), new_kv[:5])
    flushed = []
    for t in range(5, 12):
        flushed += sess.step(qs[t], new_kv[t, 0], new_kv[t, 1]).flushed.tolist()
    assert flushed == list(range(S, S + len(flushed)))      # in order, no draft among them
    sess.flush()
    assert same_bits(s.read_entries(0, np.arange(S, S + 12)), new_kv)   # no draft stored
    for bad in (-1, 1, 0.5, True):
        with pytest.raises(E.InvalidArgumentError):
            sess.discard_pending(bad)                       # nothing pending: only 0 is valid
    sess.discard_pending(0)


@pytest.mark.parametrize("include_new", [False, True])
def test_deferred_upkeep_serves_and_stores_what_inline_upkeep_does(tmp_path, rng,
                                                                    include_new):
    """defer_upkeep=True (issue 26): steps return before the eq. 9 counts,
    the §6.2 replacement, the pending entry and the flush; run at the next
    step ("next"), or by ``upkeep()`` on a second thread while the caller
    reads the step's K/V ("thread"), every step serves the same bytes and
    positions as inline upkeep, the upkeeps report the same admissions,
    evictions and flushes, and the store ends the same, across flushes,
    new clusters, prefetched retrievals and reused buffers."""
    from concurrent.futures import ThreadPoolExecutor
    outs, ends = {}, {}
    pool = ThreadPoolExecutor(1)
    for mode in ("inline", "next", "thread"):
        r2 = np.random.default_rng(11)
        s, kv, cl = random_layer_store(tmp_path / mode, r2, S=S, H=H, HQ=HQ, D=D, disks=3,
                                       clusters=60, extra_copies=100, hot=range(4),
                                       freq=np.ones(60), local_window=32)
        r = Retriever(s, ratio=0.2)
        sess = DecodeSession(r, 0, window=12, flush_batch=5, tau=0.7, max_joins=2,
                             new_cluster_size=3, reuse_outputs=True,
                             defer_upkeep=mode != "inline")
        new_kv = random_kv(r2, 45, H, D, "float16")
        res, ups = [], []
        for t in range(45):
            q = r2.standard_normal((HQ, D)).astype(np.float32)
            given = r.retrieve(0, q, torch=False) if t % 9 == 4 and mode == "inline" else None
            if mode != "inline" and t % 9 == 4:
                sess.upkeep()            # a retrieval made ahead sees the upkept layer
                given = r.retrieve(0, q, torch=False)
            x = sess.step(q, new_kv[t, 0], new_kv[t, 1], retrieval=given,
                          include_new=include_new)
            fut = pool.submit(sess.upkeep) if mode == "thread" else None
            res.append((x.k.copy(), x.v.copy(), x.positions.copy()))   # beside the upkeep
            if mode == "inline":
                ups.append((x.admitted, x.evicted, x.flushed))
            elif fut is not None:
                u = fut.result()
                ups.append((u.admitted, u.evicted, u.flushed))
        final = sess.flush()
        outs[mode] = (res, ups)
        li = s.layer(0)
        ends[mode] = (final, li.members_ptr.copy(), li.members.copy(), s.medoid_keys(0).copy(),
                      r.hot(0).copy(), s.read_entries(0, np.arange(li.num_tokens)))
        assert s.verify() == []
        s.close()
    pool.shutdown()
    for mode in ("next", "thread"):
        for t, (a, b) in enumerate(zip(outs["inline"][0], outs[mode][0], strict=True)):
            for u, w in zip(a, b, strict=True):
                assert u.shape == w.shape and same_bits(u, w), (mode, t)
        for u, w in zip(ends["inline"], ends[mode], strict=True):
            assert u.shape == w.shape and same_bits(u, w), mode
    for a, b in zip(outs["inline"][1], outs["thread"][1], strict=True):
        for u, w in zip(a, b, strict=True):
            assert np.array_equal(u, w)
    assert sum(f.size for _, _, f in outs["inline"][1]) >= 20        # flushes happened


def test_deferred_upkeep_is_waited_for_and_guards_the_layer(store, rng):
    """The next step waits for an upkeep running on another thread; a
    second session stepping the layer meanwhile is refused; upkeep with
    nothing due does nothing; a bad defer_upkeep is refused."""
    import threading
    s, kv, cl = store
    r = Retriever(s, ratio=0.2)
    sess = DecodeSession(r, 0, window=4, flush_batch=2, defer_upkeep=True)
    u = sess.upkeep()
    assert u.admitted.size == u.evicted.size == u.flushed.size == 0
    new_kv = random_kv(rng, 8, H, D, "float16")
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    sess.step(q, new_kv[0, 0], new_kv[0, 1])
    assert sess.pending == 1                 # the due entry counts before its upkeep
    gate, entered = threading.Event(), threading.Event()
    orig = sess._upkeep

    def slow(*a):
        entered.set()
        gate.wait(5)
        return orig(*a)
    sess._upkeep = slow
    t = threading.Thread(target=sess.upkeep)
    t.start()
    assert entered.wait(5)
    other = DecodeSession(r, 0)
    with pytest.raises(E.ConcurrentUseError):
        other.step(q)
    done = []
    t2 = threading.Thread(target=lambda: done.append(sess.step(q, new_kv[1, 0],
                                                               new_kv[1, 1])))
    t2.start()
    t2.join(0.3)
    assert not done                          # waiting for the upkeep
    gate.set()
    t.join(5)
    t2.join(5)
    assert done and sess.pending == 2
    for bad in ("yes", 1, None):
        with pytest.raises(E.InvalidArgumentError, match="defer_upkeep"):
            DecodeSession(r, 0, defer_upkeep=bad)
