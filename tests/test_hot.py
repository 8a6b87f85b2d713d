"""Eq. 6 hot clusters (swarmfs/_hot.py): one score, one fill rule, used
offline (``layout.hot_clusters``) and online (``DecodeSession``)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_clusters, random_kv
from swarmfs import DecodeSession, Retriever, Store
from swarmfs._errors import InvalidIntegerError, ShapeError
from swarmfs.decode._hot import cluster_scores, hot_clusters, transfer_us


def test_eq6_hand_checked():
    # (f T_base + s T_transfer) / s
    got = cluster_scores([2.0, 1.0, 0.0], [4, 1, 2], t_base_us=80.0, t_transfer_us=1.5)
    assert np.allclose(got, [(160 + 6) / 4, (80 + 1.5) / 1, 1.5])
    assert transfer_us(3000) == pytest.approx(1.0)        # 3000 B at 3 GB/s
    assert transfer_us(3000, 2.0) == 2.0


def test_first_fit_skips_what_does_not_fit_and_takes_a_smaller_one():
    # order by f/s: c0 (1.0), c1 (0.5), c2 (0.25); budget 5 entries
    freq = np.array([3.0, 2.0, 1.0])
    sizes = np.array([3, 4, 2])
    hot = hot_clusters(freq, sizes, budget_bytes=5, entry_bytes=1, t_transfer_us=1.0)
    assert hot.tolist() == [True, False, True]            # c1 skipped, c2 fits


def test_zero_frequency_and_excluded_clusters_are_never_cached():
    hot = hot_clusters([0.0, 1.0, 1.0], [1, 1, 1], budget_bytes=100, entry_bytes=1,
                       t_transfer_us=1.0, exclude=[False, True, False])
    assert hot.tolist() == [False, False, True]
    with pytest.raises(ShapeError):
        hot_clusters([1.0], [1], budget_bytes=1, entry_bytes=1, exclude=[True, False])
    with pytest.raises(InvalidIntegerError, match="budget_bytes"):
        hot_clusters([1.0], [1], budget_bytes=-1, entry_bytes=1)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fill_fits_and_no_skipped_cluster_would_fit(data):
    C = data.draw(st.integers(1, 40))
    freq = np.array(data.draw(st.lists(st.integers(0, 9), min_size=C, max_size=C)), float)
    sizes = np.array(data.draw(st.lists(st.integers(1, 20), min_size=C, max_size=C)))
    excl = np.array(data.draw(st.lists(st.booleans(), min_size=C, max_size=C)))
    budget = data.draw(st.integers(0, 200))
    hot = hot_clusters(freq, sizes, budget_bytes=budget, entry_bytes=1, t_transfer_us=1.0,
                       exclude=excl)
    used = int(sizes[hot].sum())
    assert used <= budget and not hot[excl].any() and not hot[freq == 0].any()
    # greedy in score order: a skipped eligible cluster did not fit when visited,
    # so it does not fit in what is left now either
    left = budget - used
    skipped = ~hot & ~excl & (freq > 0)
    assert not np.any(sizes[skipped] <= left)
    # the highest-scoring eligible cluster that fits the whole budget is taken
    score = cluster_scores(freq, sizes, t_transfer_us=1.0)
    fits = ~excl & (freq > 0) & (sizes <= budget)
    if fits.any():
        first = np.flatnonzero(fits)[np.argmax(score[fits])]
        ids = np.arange(C)
        bigger = ~excl & (freq > 0) & ((score > score[first]) |
                                       ((score == score[first]) & (ids < first)))
        if sizes[bigger].sum() + sizes[first] <= budget:
            assert hot[first]


def test_decode_session_uses_the_same_rule(tmp_path, rng):
    """Online cache replacement is hot_clusters over the cached and the
    selected clusters, with this step's frequencies."""
    S, H, Hq, D = 512, 2, 4, 16
    kv = random_kv(rng, S, H, D, "float16")
    cl = random_clusters(rng, S, 32)
    s = Store.create(tmp_path / "st", disks=2, num_layers=1, num_kv_heads=H, head_dim=D,
                     dtype="float16", num_query_heads=Hq)
    s.write_layer(0, kv, cl)
    r = Retriever(s, ratio=0.15)
    budget = 3 * 16 * s.entry_bytes
    sess = DecodeSession(r, 0, hot_budget_bytes=budget)
    sizes = r.index(0).sizes
    changed = 0
    for _ in range(12):
        before = r.hot(0)
        out = sess.step(rng.standard_normal((Hq, D)).astype(np.float32))
        cand = before.copy()
        cand[out.retrieval.clusters] = True
        want = hot_clusters(sess.freq, sizes, budget_bytes=budget, entry_bytes=s.entry_bytes,
                            t_base_us=sess.t_base, t_transfer_us=sess.t_transfer,
                            exclude=~cand)
        assert np.array_equal(r.hot(0), want)
        changed += len(out.admitted) + len(out.evicted)
    assert changed > 0
    s.close()
