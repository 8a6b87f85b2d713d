"""The decode-time stages (swarmfs/_stages.py) and the Retriever that runs them."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import random_clusters, random_kv, same_bits
from swarmfs import Retriever, Store
from swarmfs._errors import InvalidCallError, InvalidIntegerError, InvalidRatioError, ShapeError
from swarmfs.decode import _stages as stages
from swarmfs.decode._selectors import (
    BoundSelector,
    FusedSelector,
    MedoidSelector,
    MultiVectorSelector,
    Selector,
    TokenSelector,
    VectorSelector,
    select_clusters,
)

S, H, HQ, D = 600, 2, 4, 16


@pytest.fixture
def store(tmp_path, rng):
    kv = random_kv(rng, S, H, D, "float16")
    cl = random_clusters(rng, S, 40, extra_copies=30)
    s = Store.create(tmp_path / "st", disks=3, num_layers=1, num_kv_heads=H, head_dim=D,
                     dtype="float16", num_query_heads=HQ)
    s.write_layer(0, kv, cl)
    yield s, kv, cl
    s.close()


def test_queries_shapes_and_errors():
    q = np.ones((HQ, D), np.float16)
    out = stages.queries(q, H, D)
    assert out.shape == (1, HQ, D) and out.dtype == np.float32 and out.flags.c_contiguous
    assert stages.queries(np.ones((3, HQ, D)), H, D).shape == (3, HQ, D)
    for bad in (np.ones((3, D)), np.ones((HQ, D + 1)), np.ones((0, HQ, D)), "x"):
        with pytest.raises(ShapeError):
            stages.queries(bad, H, D)
    q = np.ones((HQ, D))
    q[1, 2] = np.nan
    with pytest.raises(ShapeError, match="NaN"):
        stages.queries(q, H, D)


def test_choose_is_select_clusters_and_unites_a_batch(rng):
    cl = random_clusters(rng, 200, 20, extra_copies=10)
    ptr = np.zeros(21, np.int64)
    ptr[1:] = np.cumsum([len(c) for c in cl])
    members = np.concatenate(cl).astype(np.int32)
    sc = rng.standard_normal((3, 20)).astype(np.float32)
    one = [select_clusters(s, ptr, members, num_tokens=200, budget=50, window=8).clusters
           for s in sc]
    assert np.array_equal(stages.choose(sc[0], ptr, members, 200, 50, 8), one[0])
    assert np.array_equal(stages.choose(sc, ptr, members, 200, 50, 8),
                          np.unique(np.concatenate(one)))


@given(a=st.sets(st.integers(0, 500)), b=st.sets(st.integers(0, 500)))
def test_merge_positions_places_both_lists(a, b):
    b = b - a
    dram = np.array(sorted(a), np.int64)
    ssd = np.array(sorted(b), np.int64)
    pos, d_idx, s_idx = stages.merge_positions(dram, ssd)
    assert np.array_equal(pos, np.array(sorted(a | b), np.int64))
    assert np.array_equal(pos[d_idx], dram) and np.array_equal(pos[s_idx], ssd)


def test_selectors_meet_the_protocol(store):
    s, _, _ = store
    m = MedoidSelector(s)
    assert isinstance(m, Selector) and isinstance(m, FusedSelector)
    C = s.num_clusters(0)
    for sel in (VectorSelector({0: np.zeros((C, H * D), np.float32)}),
                MultiVectorSelector({0: np.zeros((C, 2, H * D), np.float32)}),
                BoundSelector({0: (np.zeros((C, H * D)), np.zeros((C, H * D)))}),
                TokenSelector({0: np.zeros((S, H * D), np.float32)})):
        assert isinstance(sel, Selector) and not isinstance(sel, FusedSelector)
        sel.invalidate(0)                       # a given index: nothing to drop
        assert sel.dram_bytes(0) > 0


@pytest.mark.parametrize("index", ["int8", "exact"])
def test_retriever_select_is_what_retrieve_reads(store, rng, index):
    s, kv, _ = store
    r = Retriever(s, ratio=0.2, selector=MedoidSelector(s, index=index))
    for _ in range(5):
        q = rng.standard_normal((HQ, D)).astype(np.float32)
        ret = r.retrieve(0, q, torch=False)
        assert np.array_equal(r.select(0, q), ret.clusters)
        # the stages by hand give the same selection and the same bytes
        li = r.index(0)
        qf = stages.queries(q, H, D)
        b = r.budget(0)
        win = r.window(0)
        clusters, copies = stages.select(r.selector, 0, qf, li, budget=b, window=win)
        assert np.array_equal(clusters, ret.clusters)
        scored, _ = stages.select(r.selector, 0, qf, li, budget=b, window=win,
                                  scores=stages.score(r.selector, 0, qf, li))
        assert np.array_equal(np.sort(scored), np.sort(ret.clusters))
        want = np.union1d(win, li.members[copies])
        assert np.array_equal(ret.positions, want)
        assert same_bits(ret.k, kv[want][:, 0].transpose(1, 0, 2))
        assert same_bits(ret.v, kv[want][:, 1].transpose(1, 0, 2))
    with pytest.raises(InvalidIntegerError, match="budget"):
        r.select(0, q, budget=S + 1)


def test_token_selector_takes_the_exact_top_k_outside_the_window(store, rng):
    s, kv, _ = store
    keys = kv[:, 0].reshape(S, -1).astype(np.float32)
    r = Retriever(s, ratio=0.1, selector=TokenSelector({0: keys}))
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    ret = r.retrieve(0, q, torch=False)
    win = r.window(0)
    sc = r.score(0, q)[0]
    sc[win] = -np.inf
    top = np.argsort(-sc, kind="stable")[:r.budget(0) - win.shape[0]]
    assert ret.clusters.size == 0
    assert np.array_equal(ret.positions, np.union1d(win, top))


def test_refresh_invalidates_the_selector(store, rng):
    s, kv, _ = store
    r = Retriever(s, ratio=0.2)
    r.retrieve(0, rng.standard_normal((HQ, D)).astype(np.float32), torch=False)
    assert any(k[1] == 0 for k in r.selector._derived)
    r.refresh(0)
    assert not any(k[1] == 0 for k in r.selector._derived)


def test_ratio_and_no_deprecated_sparsity_alias(store):
    s, _, _ = store
    assert Retriever(s).ratio == 0.1
    assert Retriever(s, ratio=0.3).ratio == 0.3
    assert not hasattr(Retriever(s), "sparsity")
    with pytest.raises(InvalidCallError, match="'sparsity'"):
        Retriever(s, sparsity=0.3)
    with pytest.raises(InvalidRatioError):
        Retriever(s, ratio=0.0)


def test_replace_hot_applies_the_choice_under_the_lock(store, rng):
    s, _, _ = store
    r = Retriever(s, ratio=0.3)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    ret = r.retrieve(0, q, torch=False)
    seen = []

    def choose(hot):
        seen.append(hot.copy())
        want = np.zeros_like(hot)
        want[ret.clusters[:2]] = True
        return want
    admitted, evicted = r.replace_hot(0, ret, choose)
    assert len(seen) == 1 and not seen[0].any()
    assert sorted(admitted.tolist()) == sorted(ret.clusters[:2].tolist())
    assert np.flatnonzero(r.hot(0)).tolist() == sorted(ret.clusters[:2].tolist())
    # the admitted rows serve the stored bytes
    again = r.retrieve(0, q, torch=False)
    assert again.stats.hot_clusters_selected == 2
