"""Tests for the layout names of eq. 6 and the local window (SWARM §5.2):
``swarmfs.layout.hot_clusters``, ``cluster_scores``, ``local_window``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from swarmfs._defaults import LOCAL_WINDOW as DEFAULT_LOCAL_WINDOW
from swarmfs._errors import InvalidIntegerError, InvalidNumberError, LayoutError, ShapeError
from swarmfs.layout import cluster_scores, hot_clusters, local_window, local_window_mask


def test_eq6_as_written():
    f = np.array([0.5, 0.1, 0.0])
    s = np.array([10, 2, 4])
    got = cluster_scores(f, s, t_base_us=80.0, t_transfer_us=1.5)
    np.testing.assert_allclose(got, (f * 80.0 + s * 1.5) / s)


def test_hot_clusters_follow_score_order():
    # f/s: c0 .05, c1 .05 (tie -> lower id first), c2 .2, c3 .01, c4 .5
    freq = np.array([0.5, 0.1, 0.4, 0.1, 0.5])
    sizes = np.array([10, 2, 2, 10, 1])
    order = np.argsort(-cluster_scores(freq, sizes, t_transfer_us=1.0), kind="stable")
    np.testing.assert_array_equal(order, [4, 2, 0, 1, 3])
    eb = 100
    # room for c4 (1 entry) + c2 (2 entries) only
    hot = hot_clusters(freq, sizes, budget_bytes=3 * eb, entry_bytes=eb)
    np.testing.assert_array_equal(np.flatnonzero(hot), [2, 4])
    # c0 (10 entries) does not fit in 9 more; c1 (2) does: skipped, then taken
    hot = hot_clusters(freq, sizes, budget_bytes=12 * eb, entry_bytes=eb)
    np.testing.assert_array_equal(np.flatnonzero(hot), [1, 2, 4])
    # everything fits
    assert hot_clusters(freq, sizes, budget_bytes=10 ** 6, entry_bytes=eb).all()
    assert not hot_clusters(freq, sizes, budget_bytes=0, entry_bytes=eb).any()


def test_hot_clusters_exclusions():
    freq = np.array([0.0, 0.3, 0.3])
    sizes = np.array([1, 1, 1])
    hot = hot_clusters(freq, sizes, budget_bytes=10 ** 6, entry_bytes=8)
    np.testing.assert_array_equal(hot, [False, True, True])      # f = 0 never cached
    hot = hot_clusters(freq, sizes, budget_bytes=10 ** 6, entry_bytes=8,
                       exclude=[False, True, False])
    np.testing.assert_array_equal(hot, [False, False, True])


@settings(max_examples=100, deadline=None)
@given(data=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 50)), min_size=1, max_size=40),
       budget=st.integers(0, 2000), entry=st.integers(1, 64))
@example(data=[(1.0, 13), (1.0, 50), (4.86e-76, 49), (1.66e-61, 1)], budget=1120, entry=10)
def test_hot_clusters_fit_budget_greedily(data, budget, entry):
    freq = np.array([d[0] for d in data])
    sizes = np.array([d[1] for d in data])
    hot = hot_clusters(freq, sizes, budget_bytes=budget, entry_bytes=entry, t_transfer_us=1.0)
    used = int((sizes[hot] * entry).sum())
    assert used <= budget
    assert not hot[freq == 0].any()
    # greedy: every skipped positive-frequency cluster was too big when visited
    score = cluster_scores(freq, sizes, t_transfer_us=1.0)
    left = budget
    for c in np.argsort(-score, kind="stable"):
        if freq[c] == 0:
            continue
        if hot[c]:
            left -= sizes[c] * entry
        else:
            assert sizes[c] * entry > left


def test_errors():
    with pytest.raises(ShapeError):
        cluster_scores([0.1, 0.2], [1], t_transfer_us=1)
    with pytest.raises(ShapeError):
        cluster_scores([0.1], [0], t_transfer_us=1)
    with pytest.raises(InvalidNumberError, match="t_base_us"):
        cluster_scores([0.1], [1], t_base_us=-1, t_transfer_us=1)
    with pytest.raises(LayoutError):
        cluster_scores([-0.1], [1], t_transfer_us=1)
    with pytest.raises(InvalidIntegerError, match="budget_bytes"):
        hot_clusters([0.1], [1], budget_bytes=-1, entry_bytes=8)
    with pytest.raises(InvalidIntegerError, match="entry_bytes"):
        hot_clusters([0.1], [1], budget_bytes=8, entry_bytes=0)
    with pytest.raises(ShapeError):
        hot_clusters([0.1], [1], budget_bytes=8, entry_bytes=8, exclude=[True, False])
    with pytest.raises(InvalidIntegerError, match="num_tokens"):
        local_window(-1)
    with pytest.raises(InvalidIntegerError, match="window"):
        local_window(10, -1)


def test_local_window():
    assert DEFAULT_LOCAL_WINDOW == 256
    np.testing.assert_array_equal(local_window(1000), np.arange(744, 1000))
    np.testing.assert_array_equal(local_window(100), np.arange(100))
    assert local_window(10, 0).shape == (0,)
    m = local_window_mask(300, 16)
    assert m.dtype == bool and m.sum() == 16 and m[-16:].all() and not m[:-16].any()
    assert local_window_mask(5).all()
