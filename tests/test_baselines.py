"""Baseline layouts (layout/_baselines.py): groupings, index data, and a store round trip
through the selectors that score them."""

import numpy as np
import pytest

from conftest import random_kv
from swarmfs import Retriever, Store
from swarmfs import _errors as E
from swarmfs.decode._selectors import (
    BoundSelector,
    MultiVectorSelector,
    TokenSelector,
    VectorSelector,
)
from swarmfs.layout import _baselines as B
from swarmfs.layout._profile import profile_layer

H, D, S = 2, 8, 600


@pytest.fixture
def qk(rng):
    # keys with some structure: a few directions plus noise, so attention is peaked
    base = rng.standard_normal((6, H, D)).astype(np.float32)
    k = base[rng.integers(0, 6, S)].transpose(1, 0, 2) * 2 + \
        rng.standard_normal((H, S, D)).astype(np.float32) * 0.5
    q = base[rng.integers(0, 6, S)].transpose(1, 0, 2) * 2 + \
        rng.standard_normal((H, S, D)).astype(np.float32) * 0.5
    return q.astype(np.float16), k.astype(np.float16)


def covers_once(lay, S):
    return np.array_equal(np.sort(lay.members), np.arange(S))


def test_token_order_groups_consecutive_tokens():
    lay = B.token_order(130, group=64)
    assert lay.kind == "tokens" and lay.num_clusters == 3
    assert np.array_equal(lay.members, np.arange(130))
    assert lay.sizes.tolist() == [64, 64, 2]
    assert np.array_equal(lay.medoids, [0, 64, 128])


def test_quest_bounds_contain_every_key_and_bound_the_score(qk, rng):
    _, k = qk
    lay = B.quest_pages(k, page=16)
    assert covers_once(lay, S) and lay.sizes.max() == 16
    fk = B.flat_keys(k)
    lo, hi = lay.index["lo"], lay.index["hi"]
    page = np.repeat(np.arange(lay.num_clusters), lay.sizes)
    assert (fk >= lo[page]).all() and (fk <= hi[page]).all()
    q = rng.standard_normal((3, H * D)).astype(np.float32)
    ub = BoundSelector({0: (lo, hi)}).scores(0, q)                # [3, C]
    exact = q @ fk.T                                              # [3, S]
    for c in range(lay.num_clusters):
        sl = slice(lay.ptr[c], lay.ptr[c + 1])
        assert (ub[:, c] >= exact[:, sl].max(axis=1) - 1e-3).all()


def test_representative_scores_match_brute_force(qk):
    q, k = qk
    r = B.representative_scores(q, k, window=5)
    qf, kf = q.astype(np.float64), k.astype(np.float64)
    for m in (0, 7, S - 3, S - 1):
        want = sum(float((qf[:, j] * kf[:, m]).sum()) for j in range(m + 1, min(m + 6, S)))
        assert r[m] == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_infllm_representatives_are_the_blocks_best_members(qk):
    q, k = qk
    lay = B.infllm_blocks(q, k, block=64, reps=4)
    assert covers_once(lay, S) and lay.kind == "multivector"
    reps = lay.index["reps"]
    assert reps.shape == (lay.num_clusters, 4, H * D)
    r = B.representative_scores(q, k, window=64)
    fk = B.flat_keys(k)
    for c in (0, lay.num_clusters - 1):
        toks = np.arange(lay.ptr[c], lay.ptr[c + 1])
        best = toks[np.argsort(-r[toks], kind="stable")[:4]]
        assert np.allclose(reps[c][:len(best)], fk[best])
        assert lay.medoids[c] == best[0]


def test_kmeans_partitions_each_chunk(qk):
    _, k = qk
    lay = B.kmeans_clusters(k, mean_size=10, chunk=256, iters=5)
    assert covers_once(lay, S) and lay.kind == "vectors"
    assert lay.index["vectors"].shape == (lay.num_clusters, H * D)
    cl = np.repeat(np.arange(lay.num_clusters), lay.sizes)
    chunk_of_cluster = lay.members[lay.ptr[:-1]] // 256
    assert np.array_equal(lay.members // 256, chunk_of_cluster[cl])   # never across chunks
    assert abs(lay.num_clusters - S / 10) <= 6
    fk = B.flat_keys(k)
    # members are ordered by distance to the centroid: the medoid is the nearest
    for c in range(0, lay.num_clusters, 7):
        mem = lay.members[lay.ptr[c]:lay.ptr[c + 1]]
        d = ((fk[mem] - lay.index["vectors"][c]) ** 2).sum(1)
        assert d[0] == pytest.approx(d.min(), rel=1e-5) and lay.medoids[c] == mem[0]


def test_swarm_ablations_follow_their_rules(qk):
    q, k = qk
    sw = B.swarm(q, k, ratio=0.1, tau=0.7)
    nr = B.no_replica(q, k, ratio=0.1, tau=0.7)
    mo = B.medoid_only(q, k, ratio=0.1, tau=0.7)
    for lay in (sw, nr, mo):
        assert np.array_equal(np.unique(lay.members), np.arange(S))
        assert np.array_equal(lay.medoids, lay.members[lay.ptr[:-1]])
        assert lay.kind == "medoid" and lay.freq.shape == (lay.num_clusters,)
    assert nr.members.shape[0] == S                            # one copy per entry
    assert sw.summary()["replication"] >= 1.0
    # Medoid Only: every member of a multi-entry cluster is within tau of its medoid
    from swarmfs.layout._cluster import _ProfileDistance
    prof = profile_layer(q, k, ratio=0.1)
    dist = _ProfileDistance(prof, "jaccard")
    n_act = prof.activation_counts()
    for c in range(mo.num_clusters):
        mem = mo.members[mo.ptr[c]:mo.ptr[c + 1]]
        if mem.shape[0] > 1 and n_act[mem[0]] > 0:
            assert (dist(int(mem[0]), mem[1:]) < 0.7).all()


def test_layout_arrays_round_trip(qk):
    _, k = qk
    lay = B.quest_pages(k, page=16)
    back = B.Layout.from_arrays(lay.name, lay.kind, lay.arrays(), lay.params, lay.seconds)
    assert np.array_equal(back.ptr, lay.ptr) and np.array_equal(back.index["hi"], lay.index["hi"])


def test_bad_arguments_raise():
    with pytest.raises(E.ShapeError):
        B.quest_pages(np.zeros((4, 8)))
    with pytest.raises(E.LayoutError):
        B.token_order(10, group=0)


def test_each_layout_stores_and_retrieves_with_its_selector(tmp_path, qk, rng):
    q, k = qk
    v = random_kv(rng, S, H, D, "float16")[:, 1]                          # [S, H, D]
    kv = np.stack([k.transpose(1, 0, 2), v], axis=1)                      # [S, 2, H, D]
    lays = {"no_cluster": B.token_order(S, group=32), "quest": B.quest_pages(k, page=16),
            "infllm": B.infllm_blocks(q, k, block=32, reps=2),
            "pqcache": B.kmeans_clusters(k, mean_size=8, chunk=200, iters=3)}
    st = Store.create(tmp_path / "st", disks=3, num_layers=len(lays), num_kv_heads=H,
                      head_dim=D, dtype="float16")
    with st:
        sel = {}
        for i, (name, lay) in enumerate(lays.items()):
            st.write_layer(i, kv, (lay.ptr, lay.members), lay.medoids, local_window=8)
            if lay.kind == "tokens":
                sel[name] = TokenSelector({i: B.flat_keys(k).astype(np.float16)})
            elif lay.kind == "bounds":
                sel[name] = BoundSelector({i: (lay.index["lo"], lay.index["hi"])})
            elif lay.kind == "multivector":
                sel[name] = MultiVectorSelector({i: lay.index["reps"]})
            else:
                sel[name] = VectorSelector({i: lay.index["vectors"]})
        qq = q[:, S - 1].astype(np.float32)
        for i, (name, lay) in enumerate(lays.items()):
            ret = Retriever(st, ratio=0.1, selector=sel[name]).retrieve(i, qq, torch=False)
            assert ret.positions.shape[0] >= int(np.ceil(0.1 * S))
            got = ret.k.transpose(1, 0, 2)
            assert np.array_equal(got.view(np.uint16), kv[ret.positions, 0].view(np.uint16))
            if lay.kind != "tokens":                               # whole groups are read
                for c in ret.clusters:
                    assert set(lay.members[lay.ptr[c]:lay.ptr[c + 1]]) <= set(ret.positions)
