"""Tests for swarmfs.layout._cluster (SWARM §5.1, eqs. 2-5, Algorithm 1)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from swarmfs._errors import (
    InvalidChoiceError,
    InvalidIntegerError,
    InvalidNumberError,
    InvalidRatioError,
    LayoutError,
    ShapeError,
)
from swarmfs.layout._cluster import (
    _lsh_params,
    build_clusters,
    cluster,
    coactivation_distance,
    eq2_tau,
    graph_from_distances,
    neighbour_graph,
)
from swarmfs.layout._profile import Profile, profile_layer

# -- a literal transcription of Algorithm 1, for reference --------------------

def algorithm1(D, tau, max_size=None, max_replicas=None):
    """BUILD_CLUSTERS exactly as the paper's pseudo-code (with eq. 4's '<')."""
    N = len(D)
    rho = [sum(1 for j in range(N) if j != i and D[i][j] < tau) for i in range(N)]
    queue = sorted(range(N), key=lambda i: (-rho[i], i))
    covered, copies, clusters = [False] * N, [0] * N, []
    for m in queue:
        if covered[m]:
            continue
        C = [m]
        cand = sorted((e for e in range(N) if e != m and D[m][e] < tau),
                      key=lambda e: (D[m][e], e))
        for c in cand:
            if max_size is not None and len(C) >= max_size:
                break
            if max_replicas is not None and copies[c] >= max_replicas:
                continue
            if sum(D[c][e] for e in C) < tau * len(C):        # eq. 5: mean < tau
                C.append(c)
        clusters.append(C)
        for e in C:
            covered[e] = True
            copies[e] += 1
        if all(covered):
            break
    return clusters


def as_lists(ptr, members):
    return [members[ptr[c]:ptr[c + 1]].tolist() for c in range(len(ptr) - 1)]


def profile_from_sets(query_sets, S):
    """A Profile from the query set A_i of every entry (hand-made co-activation)."""
    n = max((max(s) for s in query_sets if s), default=0) + 1
    rows = [q for i, s in enumerate(query_sets) for q in s]
    cols = [i for i, s in enumerate(query_sets) for q in s]
    acts = sp.csr_matrix((np.ones(len(rows), bool), (rows, cols)), shape=(n, S))
    acts.sort_indices()
    return Profile(num_tokens=S, queries=np.arange(n) + S, acts=acts, ratio=0.1)


# -- hand-made graphs with known answers -------------------------------------

def test_abc_replication_example():
    """§5.1: A co-activates with B and with C, B and C never together.

    A = entry 0, activated by queries 0..9; B = entry 1 by 0..4; C = entry 2
    by 5..9.  Jaccard: d(A,B) = d(A,C) = 0.5, d(B,C) = 1.  With tau = 0.6,
    A is the densest medoid and takes B (C's mean distance to {A, B} is 0.75);
    C then starts its own cluster and takes A: A is replicated.
    """
    prof = profile_from_sets([set(range(10)), set(range(5)), set(range(5, 10))], 3)
    cl = cluster(prof, tau=0.6)
    assert as_lists(cl.ptr, cl.members) == [[0, 1], [2, 0]]
    np.testing.assert_array_equal(cl.medoids, [0, 2])
    assert cl.stats.replication == pytest.approx(4 / 3)
    # Without replicas A can only be in one cluster: C ends up alone.
    single = cluster(prof, tau=0.6, max_replicas=1)
    assert as_lists(single.ptr, single.members) == [[0, 1], [2]]


def test_eq5_rejects_a_candidate_far_from_the_members():
    # m=0 has candidates 1 (d .25) and 2 (d .375); d(1,2) = 1 -> 2's mean
    # distance to {0, 1} is 0.6875 >= tau = .5: rejected; it becomes its own medoid.
    D = np.array([[0, .25, .375], [.25, 0, 1], [.375, 1, 0]])
    ptr, mem = build_clusters(graph_from_distances(D, 0.5), max_replicas=None)
    assert as_lists(ptr, mem) == [[0, 1], [2, 0]]
    # With tau = .75 it passes (.6875 < .75) and one cluster covers all.
    ptr, mem = build_clusters(graph_from_distances(D, 0.75), max_replicas=None)
    assert as_lists(ptr, mem) == [[0, 1, 2]]


def test_two_groups_bridged_by_one_entry():
    # entries 0-2 tight, 3-5 tight, 6 close to 2 and 3 only; isolated 7.
    D = np.ones((8, 8))
    np.fill_diagonal(D, 0)
    for grp in ((0, 1, 2), (3, 4, 5)):
        for a in grp:
            for b in grp:
                if a != b:
                    D[a, b] = .125
    D[6, 2] = D[2, 6] = D[6, 3] = D[3, 6] = .25
    ptr, mem = build_clusters(graph_from_distances(D, 0.5), max_replicas=None)
    # rho: 2 and 3 have 3 neighbours (first: 2); cluster {2,0,1} (6's mean
    # distance to {2,0,1} is .75); then 3 -> {3,4,5}; then 6 -> {6,2} (3 is
    # farther from {6,2}); then 7 alone.
    assert as_lists(ptr, mem) == [[2, 0, 1], [3, 4, 5], [6, 2], [7]]


def test_ties_break_by_lower_id_and_strict_radius():
    D = np.array([[0, .5, .5], [.5, 0, .5], [.5, .5, 0]])
    # d = .5 is not < .5: no edges, three singletons in id order.
    ptr, mem = build_clusters(graph_from_distances(D, 0.5))
    assert as_lists(ptr, mem) == [[0], [1], [2]]
    ptr, mem = build_clusters(graph_from_distances(D, 0.625))
    assert as_lists(ptr, mem) == [[0, 1, 2]]


def test_size_and_replica_caps():
    D = np.full((6, 6), .125)
    np.fill_diagonal(D, 0)
    ptr, mem = build_clusters(graph_from_distances(D, 0.5), max_cluster_size=4,
                              max_replicas=None)
    assert as_lists(ptr, mem) == [[0, 1, 2, 3], [4, 0, 1, 2], [5, 0, 1, 2]]
    ptr, mem = build_clusters(graph_from_distances(D, 0.5), max_cluster_size=4,
                              max_replicas=1)
    assert as_lists(ptr, mem) == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(InvalidIntegerError, match="max_cluster_size"):
        build_clusters(graph_from_distances(D, 0.5), max_cluster_size=0)
    with pytest.raises(InvalidIntegerError, match="max_replicas"):
        build_clusters(graph_from_distances(D, 0.5), max_replicas=0)


dyadic = st.integers(0, 8).map(lambda x: x / 8)


@st.composite
def distance_matrices(draw):
    n = draw(st.integers(1, 12))
    D = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            D[i, j] = D[j, i] = draw(dyadic)
    return D


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(D=distance_matrices(), tau=st.sampled_from([0.125, 0.25, 0.5, 0.625, 0.75, 1.0]),
       max_size=st.sampled_from([None, 1, 2, 3, 5]),
       max_rep=st.sampled_from([None, 1, 2, 3]))
def test_matches_literal_algorithm1(D, tau, max_size, max_rep):
    """The vectorised scan equals the paper's loop (exact dyadic arithmetic)."""
    ptr, mem = build_clusters(graph_from_distances(D, tau),
                              max_cluster_size=max_size or len(D), max_replicas=max_rep)
    assert as_lists(ptr, mem) == algorithm1(D, tau, max_size, max_rep)


def test_bad_tau_and_metric():
    prof = profile_from_sets([{0, 1}, {1}], 2)
    for tau in (0.0, -0.5, 1.01, float("nan")):
        with pytest.raises(InvalidRatioError, match="tau"):
            cluster(prof, tau=tau)
        with pytest.raises(InvalidRatioError, match="tau"):
            graph_from_distances(np.zeros((2, 2)), tau)
    with pytest.raises(InvalidChoiceError, match="metric"):
        cluster(prof, metric="cosine")
    with pytest.raises(InvalidChoiceError, match="method"):
        cluster(prof, method="kmeans")
    with pytest.raises(LayoutError, match="minhash"):
        neighbour_graph(prof, metric="eq2", method="minhash")
    empty = Profile(num_tokens=4, queries=np.arange(2), acts=sp.csr_matrix((2, 4), dtype=bool),
                    ratio=0.1)
    with pytest.raises(LayoutError, match="no entry"):
        cluster(empty)
    with pytest.raises(ShapeError):
        graph_from_distances(np.array([[0, .1], [.2, 0]]), 0.5)
    with pytest.raises(ShapeError):
        cluster(prof, keys=np.zeros((1, 3, 4)))


def test_distances_as_written():
    f, ni, nj = np.array([3, 0, 5]), np.array([4, 0, 5]), np.array([6, 0, 5])
    np.testing.assert_allclose(coactivation_distance(f, ni, nj, metric="jaccard"),
                               [1 - 3 / 7, 1.0, 0.0])
    np.testing.assert_allclose(coactivation_distance(f, ni, nj, metric="eq2", total=100),
                               [0.97, 1.0, 0.95])                 # eq. 2-3: 1 - f / F
    with pytest.raises(LayoutError):
        coactivation_distance(f, ni, nj, metric="eq2")


def test_eq2_graph_is_a_count_threshold():
    rng = np.random.default_rng(3)
    acts = sp.random(40, 30, density=0.3, format="csr", random_state=rng,
                     data_rvs=lambda m: np.ones(m)).astype(bool)
    prof = Profile(num_tokens=30, queries=np.arange(40), acts=acts, ratio=0.1)
    A = acts.toarray().astype(np.int64)
    F = A.T @ A
    tau = eq2_tau(prof, 4)
    assert tau == pytest.approx(1 - 4 / F.sum())
    g = neighbour_graph(prof, tau=tau, metric="eq2")
    want = (F > 4) & ~np.eye(30, dtype=bool)
    np.testing.assert_array_equal(g.sim.toarray() > 0, want)
    np.testing.assert_allclose(g.sim.toarray()[want], (F / F.sum())[want])
    with pytest.raises(InvalidNumberError, match="min_count"):
        eq2_tau(prof, -1)


# -- invariants on random profiles -------------------------------------------

@st.composite
def profiles(draw):
    S = draw(st.integers(1, 40))
    n = draw(st.integers(1, 50))
    density = draw(st.floats(0.0, 0.5))
    seed = draw(st.integers(0, 2 ** 16))
    acts = sp.random(n, S, density=density, format="csr", random_state=seed,
                     data_rvs=lambda m: np.ones(m)).astype(bool)
    acts.sort_indices()
    return Profile(num_tokens=S, queries=np.arange(n), acts=acts, ratio=0.1)


@pytest.mark.slow
@settings(max_examples=120, deadline=None)
@given(prof=profiles(), tau=st.floats(0.05, 1.0), max_size=st.integers(1, 20),
       max_rep=st.sampled_from([None, 1, 2, 4]), idle_group=st.integers(1, 8))
def test_clustering_invariants(prof, tau, max_size, max_rep, idle_group):
    assume(prof.acts.nnz > 0)
    cl = cluster(prof, tau=tau, max_cluster_size=max_size, max_replicas=max_rep,
                 idle_group_size=idle_group)
    S, ptr, mem = prof.num_tokens, cl.ptr, cl.members
    assert ptr.dtype == np.int64 and mem.dtype == np.int64 and cl.medoids.dtype == np.int64
    assert cl.freq.dtype == np.float32 and ptr[0] == 0 and ptr[-1] == mem.shape[0]
    assert np.all(np.diff(ptr) > 0)
    counts = np.bincount(mem, minlength=S)
    assert counts.shape[0] == S and counts.min() >= 1             # every token covered
    if max_rep is not None:
        assert counts.max() <= max_rep
    np.testing.assert_array_equal(cl.medoids, mem[ptr[:-1]])      # medoid first
    A = prof.acts.toarray().astype(np.int64)
    F = A.T @ A
    n_act = A.sum(0)
    D = coactivation_distance(F, n_act[:, None], n_act[None, :])
    for c in range(cl.num_clusters):
        m = cl.cluster(c)
        assert len(set(m.tolist())) == m.shape[0]                 # no duplicates
        if cl.idle[c]:
            assert np.all(n_act[m] == 0) and m.shape[0] <= idle_group
            assert cl.freq[c] == 0
        else:
            assert m.shape[0] <= max_size
            assert np.all(D[m[0], m[1:]] < tau)                   # within tau of medoid
            assert 0 < cl.freq[c] <= 1
    assert cl.stats.num_copies == mem.shape[0]
    assert cl.stats.idle_entries == int((n_act == 0).sum())


# -- real data: MiniLM over real text ----------------------------------------

@pytest.fixture
def real_layer(minilm_layer2):
    """MiniLM layer 2 over 2304 tokens of real text: 2048 context + 256 held out."""
    return minilm_layer2


@pytest.mark.model
def test_minhash_finds_exact_edges(real_layer):
    q, k, scaling = real_layer
    prof = profile_layer(q[:, :2048], k[:, :2048], scaling=scaling)
    ex = neighbour_graph(prof, tau=0.6, method="exact")
    mh = neighbour_graph(prof, tau=0.6, method="minhash")
    assert ex.method == "exact" and mh.method == "minhash"
    E, M = ex.sim.toarray(), mh.sim.toarray()
    found = M > 0
    assert np.all(E[found] > 0)                                   # no false edges
    np.testing.assert_allclose(M[found], E[found])                # exact distances
    assert found.sum() >= 0.8 * (E > 0).sum()
    np.testing.assert_array_equal(np.diff(ex.sim.indptr), ex.degree)
    capped = neighbour_graph(prof, tau=0.6, method="exact", max_neighbours=3)
    np.testing.assert_array_equal(capped.degree, ex.degree)
    assert capped.num_edges < ex.num_edges
    assert all(set(capped.sim[i].indices) <= set(ex.sim[i].indices) for i in range(0, 2048, 97))


def test_lsh_params_meet_target():
    for s in (0.2, 0.3, 0.4, 0.5, 0.6):
        bands, rows = _lsh_params(s)
        assert bands * rows <= 200
        assert 1 - (1 - min(1, s + 0.1) ** rows) ** bands >= 0.95
