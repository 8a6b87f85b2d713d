"""Tests for swarmfs.layout._profile: activated sets and sparse co-activation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmfs._errors import InvalidIntegerError, InvalidRatioError, LayoutError, ShapeError
from swarmfs.layout._capture import Capture
from swarmfs.layout._profile import (
    DEFAULT_MAX_QUERIES,
    Profile,
    aggregate_scores,
    entry_bitsets,
    pair_intersections,
    profile_capture,
    profile_layer,
    sample_queries,
)


@pytest.fixture
def real_qk(minilm_layer2):
    """Layer-2 queries/keys of MiniLM over 1024 tokens of real text."""
    q, k, scaling = minilm_layer2
    return q[:, :1024], k[:, :1024], scaling


def brute_force(q, k, scaling, ratio, positions):
    """Per query t: keys 0..t, sum over heads of softmax probs, top ceil(r(t+1))."""
    H_q = q.shape[0]
    g = H_q // k.shape[0]
    out = []
    for t in positions:
        agg = np.zeros(t + 1)
        for h in range(H_q):
            s = (k[h // g, :t + 1].astype(np.float64) @ q[h, t].astype(np.float64)) * scaling
            e = np.exp(s - s.max())
            agg += e / e.sum()
        kt = math.ceil(ratio * (t + 1))
        out.append((agg, kt))
    return out


def check_topk(profile, ref):
    """Activated sets are a top-k of the brute-force scores (ties may differ)."""
    for row, (agg, kt) in enumerate(ref):
        sel = profile.acts.indices[profile.acts.indptr[row]:profile.acts.indptr[row + 1]]
        assert sel.shape[0] == kt
        assert np.all(np.diff(sel) > 0)
        kth = np.sort(agg)[::-1][kt - 1]
        assert agg[sel].min() >= kth - 1e-5
        unsel = np.setdiff1d(np.arange(agg.shape[0]), sel)
        if unsel.size:
            assert agg[unsel].max() <= kth + 1e-5


@pytest.mark.slow
def test_matches_brute_force_on_real_queries(real_qk):
    q, k, scaling = real_qk
    pos = np.array([0, 1, 9, 10, 11, 100, 511, 512, 700, 1023])
    prof = profile_layer(q, k, queries=pos, scaling=scaling, ratio=0.1, batch=4)
    np.testing.assert_array_equal(prof.queries, pos)
    check_topk(prof, brute_force(q, k, scaling, 0.1, pos))


def test_gqa_aggregation_matches_brute_force():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 50, 8)).astype(np.float32)
    k = rng.standard_normal((2, 50, 8)).astype(np.float32)
    prof = profile_layer(q, k, ratio=0.25, batch=7)
    assert prof.num_queries == 50
    check_topk(prof, brute_force(q, k, 8 ** -0.5, 0.25, range(50)))


def test_aggregate_scores_rows_and_mask():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((6, 5, 4)).astype(np.float32)
    k = rng.standard_normal((3, 9, 4)).astype(np.float32)
    lim = np.array([0, 2, 8, 4, 6])
    agg = aggregate_scores(q, k, limits=lim)
    np.testing.assert_allclose(agg.sum(1), 6.0, rtol=1e-5)
    for r, t in enumerate(lim):
        assert np.all(agg[r, t + 1:] == 0)
    np.testing.assert_allclose(aggregate_scores(q, k).sum(1), 6.0, rtol=1e-5)


@pytest.mark.slow
def test_causal_counts_and_default_sample(real_qk):
    q, k, scaling = real_qk
    prof = profile_layer(q, k, scaling=scaling, max_queries=300, ratio=0.1)
    assert prof.num_queries == 300
    np.testing.assert_array_equal(prof.queries, sample_queries(1024, 300, 0))
    sizes = np.diff(prof.acts.indptr)
    np.testing.assert_array_equal(sizes, np.ceil(0.1 * (prof.queries + 1)).astype(int))
    coo = prof.acts.tocoo()
    assert np.all(coo.col <= prof.queries[coo.row])          # causal: key <= query
    # all positions when S is small
    assert profile_layer(q[:, :64], k[:, :64], scaling=scaling).num_queries == 64


@pytest.mark.slow
def test_profile_capture(real_qk):
    q, k, scaling = real_qk
    cap = Capture(k=k[None], v=k[None], q=q[None], token_ids=np.zeros(k.shape[1], np.int32),
                  meta={"layers": [2], "scaling": scaling})
    prof = profile_capture(cap, 0, max_queries=100)
    ref = profile_layer(q, k, scaling=scaling, max_queries=100)
    assert prof.layer == 2
    assert (prof.acts != ref.acts).nnz == 0
    with pytest.raises(LayoutError):
        profile_capture(cap, 1)


def test_sample_queries_deterministic():
    a = sample_queries(100_000)
    assert a.shape == (DEFAULT_MAX_QUERIES,)
    np.testing.assert_array_equal(a, sample_queries(100_000))
    assert np.all(np.diff(a) > 0) and a[0] >= 0 and a[-1] < 100_000
    assert not np.array_equal(a, sample_queries(100_000, seed=1))
    np.testing.assert_array_equal(sample_queries(10, 64), np.arange(10))
    with pytest.raises(InvalidIntegerError, match="max_queries"):
        sample_queries(10, 0)


def random_profile(rng, S, n, density):
    acts = sp.random(n, S, density=density, format="csr", random_state=rng,
                     data_rvs=lambda m: np.ones(m)).astype(bool)
    acts.sort_indices()
    return Profile(num_tokens=S, queries=np.arange(n), acts=acts, ratio=0.1)


@settings(max_examples=30, deadline=None)
@given(S=st.integers(1, 60), n=st.integers(1, 130), density=st.floats(0.0, 0.6),
       seed=st.integers(0, 2 ** 16))
def test_coactivation_is_sparse_and_exact(S, n, density, seed):
    prof = random_profile(np.random.default_rng(seed), S, n, density)
    A = prof.acts.toarray().astype(np.int64)
    F = A.T @ A                                    # dense reference, small S only
    np.testing.assert_array_equal(prof.activation_counts(), A.sum(0))
    assert prof.total_coactivation() == F.sum()
    i, j = np.meshgrid(np.arange(S), np.arange(S), indexing="ij")
    np.testing.assert_array_equal(prof.coactivation(i.ravel(), j.ravel()), F.ravel())
    bits = entry_bitsets(prof)
    assert bits.shape == (S, max(1, (n + 63) // 64)) and bits.dtype == np.uint64
    np.testing.assert_array_equal(pair_intersections(bits, i.ravel(), j.ravel(), chunk=7),
                                  F.ravel())
    np.testing.assert_array_equal(prof.by_entry().toarray(), A.T.astype(bool))


def test_visible_counts():
    acts = sp.csr_matrix((3, 10), dtype=bool)
    prof = Profile(num_tokens=10, queries=np.array([2, 5, 9]), acts=acts, ratio=0.1)
    np.testing.assert_array_equal(prof.visible_counts(),
                                  [3, 3, 3, 2, 2, 2, 1, 1, 1, 1])


def test_errors():
    q = np.zeros((4, 10, 8), np.float32)
    k = np.zeros((2, 10, 8), np.float32)
    for r in (0.0, -0.1, 1.5):
        with pytest.raises(InvalidRatioError, match="ratio"):
            profile_layer(q, k, ratio=r)
    with pytest.raises(ShapeError):
        profile_layer(q, np.zeros((3, 10, 8), np.float32))
    with pytest.raises(ShapeError):
        profile_layer(q, np.zeros((2, 11, 8), np.float32))
    with pytest.raises(ShapeError):
        profile_layer(q[0], k)
    with pytest.raises(LayoutError, match="query positions"):
        profile_layer(q, k, queries=[3, 10])
    with pytest.raises(LayoutError, match="query positions"):
        profile_layer(q, k, queries=[])
