"""The two-level int8 medoid index (``swarmfs.decode._index2``): its layout, its
scores on every kernel path against the scalar reference and against the
one-level int8 score, its choice rule, and bad arguments."""

import numpy as np
import pytest

from conftest import replicated_csr
from swarmfs._errors import InvalidArgumentError
from swarmfs.decode._index2 import groups_to_score, pack_medoids_i8x2, select_i8x2
from swarmfs.store._kernels import (
    choose_clusters,
    head_logits_i8,
    pack_medoids_i8,
    set_kernel_path,
    softmax_sum,
)


def _clustered(rng, C, H, d, centres=12):
    """Medoid keys around a few centres per head (as real keys are), fp16."""
    c = rng.standard_normal((centres, H, d)) * 3
    x = c[rng.integers(0, centres, C)] + rng.standard_normal((C, H, d))
    return x.reshape(C, H * d).astype(np.float16)


@pytest.mark.parametrize("bf16", [False, True])
def test_every_medoid_is_in_one_group_per_head(rng, bf16):
    """Groups of exactly group_size medoids (the last one smaller), each
    medoid in one group per head, each with its own quantised row."""
    H, d, C = 3, 16, 203
    m = _clustered(rng, C, H, d)
    if bf16:
        m = (m.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    ix = pack_medoids_i8x2(m, H, group_size=10, bf16=bf16)
    K = ix.gblk.shape[1] - 1
    assert K == 21 and ix.fine.rows % 16 == 0
    again = pack_medoids_i8x2(m, H, group_size=10, bf16=bf16)      # deterministic
    assert np.array_equal(again.rowmed, ix.rowmed) and np.array_equal(again.mgrp, ix.mgrp)
    for h in range(H):
        rows = ix.rowmed[h]
        assert sorted(rows[rows >= 0].tolist()) == list(range(C))
        counts = np.exp(ix.glogn[h][np.isfinite(ix.glogn[h])]).round()
        assert counts.sum() == C
        assert (counts[:-1] == 10).all() and counts[-1] == 3     # balanced: 20 x 10 + 3
        for k in range(K):                   # a group's rows: its members, then padding
            seg = rows[ix.gblk[h, k] * 16: ix.gblk[h, k + 1] * 16]
            n = int(round(np.exp(ix.glogn[h, k]))) if np.isfinite(ix.glogn[h, k]) else 0
            assert (seg[:n] >= 0).all() and (seg[n:] == -1).all()
    # the fine level holds each medoid's own quantised row
    one = pack_medoids_i8(m, H, bf16=bf16)
    for h in range(H):
        r = int(np.flatnonzero(ix.rowmed[h] == 5)[0])
        a = ix.fine.data[h, r // 16, :, r % 16, :]
        b = one.data[h, 0, :, 5, :]
        assert np.array_equal(a, b)


@pytest.mark.parametrize("G", [1, 8])
def test_all_groups_scored_is_the_one_level_score_on_every_path(each_path, rng, G):
    H, d, C = 2, 32, 157
    m = _clustered(rng, C, H, d)
    q = rng.standard_normal((H * G, d)).astype(np.float32) * 2
    ix1, ix2 = pack_medoids_i8(m, H), pack_medoids_i8x2(m, H, group_size=9)
    for path in each_path:
        set_kernel_path(path)
        want = softmax_sum(head_logits_i8(ix1, q, H), d ** -0.5)
        got = select_i8x2(ix2, q, H, scale=d ** -0.5)            # scores, every group
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7, err_msg=path)


def test_partial_scores_match_scalar_and_keep_each_heads_mass(each_path, rng):
    H, G, d, C = 4, 8, 64, 400
    m = _clustered(rng, C, H, d)
    q = rng.standard_normal((H * G, d)).astype(np.float32) * 2
    ix = pack_medoids_i8x2(m, H, group_size=16)
    K = ix.gblk.shape[1] - 1
    ref = {}
    for path in each_path:
        set_kernel_path(path)
        for ng in (1, K // 4, K - 1):
            s = select_i8x2(ix, q, H, scale=d ** -0.5, ngroups=ng)
            # every head's softmax spreads mass 1 over all medoids
            assert abs(float(s.sum()) - H * G) < 1e-3 * H * G, (path, ng)
            assert (s >= 0).all()
            if path == "scalar":
                ref[ng] = s
            else:
                np.testing.assert_allclose(s, ref[ng], rtol=1e-4, atol=1e-7,
                                           err_msg=f"{path} {ng}")
    # skipping groups changes scores (a kernel that ignored ngroups would not)
    assert not np.allclose(ref[1], ref[K - 1])


def test_two_level_selection_is_the_rule_on_its_scores(each_path, rng):
    H, Hq, d, C = 4, 32, 64, 301
    m = _clustered(rng, C, H, d)
    q = rng.standard_normal((Hq, d)).astype(np.float32)
    ptr, members, S = replicated_csr(rng, C)   # the last cluster holds 200 replicas
    ix = pack_medoids_i8x2(m, H, group_size=12)
    for path in each_path:
        set_kernel_path(path)
        for budget, w in ((S // 5, 7), (S, 0), (S, 30)):
            ng = groups_to_score(ix, budget, S, 3.0)
            sc = select_i8x2(ix, q, H, scale=d ** -0.5, ngroups=ng)
            got = select_i8x2(ix, q, H, scale=d ** -0.5, ptr=ptr, members=members,
                              num_tokens=S, budget=budget, window=w)
            want = choose_clusters(sc, ptr, members, num_tokens=S, budget=budget, window=w)
            assert got[0].tolist() == want[0].tolist() and got[1] == want[1], path
            assert got[1] >= budget
            if budget == S:                  # the whole context: every token, once
                assert got[1] == S and ng == ix.gblk.shape[1] - 1


def test_two_level_refuses_what_does_not_fit(rng):
    m = _clustered(rng, 50, 2, 8)
    ix = pack_medoids_i8x2(m, 2, group_size=8)
    q = rng.standard_normal((4, 8)).astype(np.float32)
    for bad in (lambda: pack_medoids_i8x2(m, 3),
                lambda: pack_medoids_i8x2(m, 2, group_size=0),
                lambda: pack_medoids_i8x2(m.astype(np.float32), 2),
                lambda: select_i8x2(ix, q[:, :4], 2, scale=0.3),
                lambda: select_i8x2(ix, q, 4, scale=0.3),
                lambda: select_i8x2(ix, q, 2, scale=0.0),
                lambda: select_i8x2(pack_medoids_i8(m, 2), q, 2, scale=0.3),
                lambda: select_i8x2(ix, q, 2, scale=0.3, ptr=np.array([0, 1]),
                                    members=np.array([0]), num_tokens=1, budget=1)):
        with pytest.raises(InvalidArgumentError):
            bad()


def test_selector_option(rng, tmp_path):
    from swarmfs import Store
    from swarmfs.decode._selectors import MedoidSelector
    H, Hq, d, S = 2, 8, 32, 2048
    kv = rng.standard_normal((S, 2, H, d)).astype(np.float16)
    clusters = np.array_split(rng.permutation(S), 128)
    with Store.create(tmp_path / "st", disks=2, num_layers=1, num_kv_heads=H, head_dim=d,
                      dtype="float16", num_query_heads=Hq) as s:
        s.write_layer(0, kv, clusters)
        q = rng.standard_normal((2, Hq, d)).astype(np.float32)
        one, two = MedoidSelector(s), MedoidSelector(s, levels=2, group_size=8)
        for budget in (S // 10, S):
            a = one.select(0, q, budget=budget, window=16)
            b = two.select(0, q, budget=budget, window=16)
            for x, y in zip(a, b, strict=True):
                assert y.entries >= budget
                if budget == S:
                    assert x.entries == y.entries == S
        with pytest.raises(InvalidArgumentError):
            MedoidSelector(s, levels=3)


@pytest.mark.parametrize("kw", [dict(levels=True), dict(levels=2.0), dict(levels=3),
                                dict(group_size=0), dict(group_size=2.5),
                                dict(coverage=float("nan")), dict(coverage=float("inf")),
                                dict(coverage="x"), dict(coverage=None), dict(coverage=0),
                                dict(coverage=-1)])
def test_selector_options_are_checked_at_construction(tmp_path, kw):
    from swarmfs import Store
    from swarmfs.decode._selectors import MedoidSelector
    s = Store.create(tmp_path / "s", disks=1, num_layers=1, num_kv_heads=2, head_dim=8,
                     num_query_heads=4)
    with s, pytest.raises(InvalidArgumentError):
        MedoidSelector(s, **kw)
