"""Decode-time maintenance (SWARM §6.2): new entries, eq. 9 joins, cache replacement."""

import numpy as np
import pytest
from conftest import random_clusters, random_kv, same_bits

from swarmfs import Retriever, Store
from swarmfs import _errors as E
from swarmfs._online import DecodeSession

S, H, HQ, D = 1200, 2, 4, 16


@pytest.fixture
def store(tmp_path, rng):
    s = Store.create(tmp_path / "st", disks=3, num_layers=1, num_kv_heads=H, head_dim=D,
                     num_query_heads=HQ, dtype="float16")
    kv = random_kv(rng, S, H, D, "float16")
    cl = random_clusters(rng, S, 60, 100)
    hot = np.zeros(60, bool)
    hot[:4] = True
    s.write_layer(0, kv, cl, hot=hot, freq=np.ones(60), local_window=32)
    yield s, kv, cl
    s.close()


def test_pending_entries_are_served_then_placed_by_eq9(store, rng):
    s, kv, cl = store
    r = Retriever(s, sparsity=0.2)
    sess = DecodeSession(r, 0, window=8, flush_batch=4, tau=0.7, max_joins=2)
    new_kv = random_kv(rng, 20, H, D, "float16")
    flushed = []
    for t in range(20):
        q = rng.standard_normal((HQ, D)).astype(np.float32)
        out = sess.step(q, new_kv[t, 0], new_kv[t, 1])
        # every pending entry (the previous steps' tokens not yet placed) is served
        n_stored = s.num_tokens(0)
        pend = out.positions[out.positions >= n_stored]
        assert len(pend) == sess.pending - 1 or len(out.flushed)
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
    r = Retriever(s, sparsity=0.15)
    budget = sum(len(cl[c]) for c in range(4)) * s.entry_bytes
    sess = DecodeSession(r, 0, hot_budget_bytes=budget)
    changed = 0
    for _ in range(30):
        out = sess.step(rng.standard_normal((HQ, D)).astype(np.float32))
        st = r.layer_state(0)
        assert st.li.sizes[st.hot].sum() * s.entry_bytes <= budget
        changed += len(out.admitted) + len(out.evicted)
        # resident rows are the right bytes
        toks = np.flatnonzero(st.resident)
        assert same_bits(st.rows[st.slot[toks]],
                         kv[toks].reshape(len(toks), -1).view(np.uint8))
        assert same_bits(out.k, kv[out.positions][:, 0].transpose(1, 0, 2))
    assert changed > 0
    assert 0.0 <= sess.hit_rate <= 1.0


def test_bad_session_input(store, rng):
    s, _, _ = store
    with pytest.raises(E.LayoutError):
        DecodeSession(Retriever(s), 0, tau=0)
    sess = DecodeSession(Retriever(s), 0)
    with pytest.raises(E.ShapeError):
        sess.step(rng.standard_normal((HQ, D)), np.zeros((H, D), np.float32),
                  np.zeros((H, D), np.float32))
