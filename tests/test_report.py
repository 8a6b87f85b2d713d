"""The one recall definition (SWARM §8.2): attention mass of the distinct
retrieved entries over the oracle's top max(budget, n)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmfs.decode._report import (
    attention_logits,
    attention_recall,
    evaluate_query,
    summarize,
    token_mass,
)


def test_each_position_counts_once():
    mass = np.array([0.5, 0.2, 0.1, 0.1, 0.1])
    once, got, top = attention_recall(mass, [0, 1], budget=2)
    twice, got2, _ = attention_recall(mass, [0, 0, 1, 1, 1], budget=2)
    assert once == twice == 1.0 and got == got2 == 0.7 and top == 0.7
    # an overshoot is compared with an oracle of the same size
    r, _, top = attention_recall(mass, [1, 2, 3], budget=2)
    assert top == 0.8 and abs(r - 0.4 / 0.8) < 1e-12


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60), st.integers(0, 2**31))
def test_recall_is_the_definition(S, seed):
    """Recall = mass of the distinct positions / mass of the oracle's top
    max(budget, n distinct) tokens, written out with a sort."""
    rng = np.random.default_rng(seed)
    mass = rng.random(S)
    pos = rng.integers(0, S, rng.integers(0, 2 * S + 1))
    budget = int(rng.integers(1, S + 1))
    r, got, top = attention_recall(mass, pos, budget)
    distinct = np.unique(pos)
    want_got = mass[distinct].sum()
    want_top = np.sort(mass)[::-1][:min(max(budget, distinct.size), S)].sum()
    assert abs(got - want_got) < 1e-9 and abs(top - want_top) < 1e-9
    assert abs(r - want_got / want_top) < 1e-9 and r <= 1.0 + 1e-12
    # the oracle's own selection has recall 1
    oracle = np.argsort(-mass, kind="stable")[:budget]
    assert abs(attention_recall(mass, oracle, budget)[0] - 1.0) < 1e-12


def test_evaluate_query_ignores_duplicate_copies(rng):
    Hq, H, S, d = 4, 2, 50, 8
    q = rng.standard_normal((Hq, d)).astype(np.float32)
    k = rng.standard_normal((H, S, d)).astype(np.float32)
    v = rng.standard_normal((H, S, d)).astype(np.float32)
    pos = np.arange(0, 50, 3)
    a = evaluate_query(q, k, v, pos, scaling=d ** -0.5, ratio=0.2)
    b = evaluate_query(q, k, v, np.sort(np.concatenate([pos, pos[:5]])),
                       scaling=d ** -0.5, ratio=0.2)
    assert a["recall"] == b["recall"] <= 1.0 and a["entries"] == b["entries"] == len(pos)
    full = evaluate_query(q, k, v, np.arange(S), scaling=d ** -0.5, ratio=1.0)
    assert full["recall"] == 1.0 and full["rel_error"] < 1e-6


def test_logits_and_mass_follow_gqa(rng):
    """Query head h reads KV head h // (H_q / H_kv); mass = softmax over keys,
    mean over query heads."""
    Hq, H, n, S, d = 6, 2, 3, 11, 4
    q = rng.standard_normal((Hq, n, d)).astype(np.float32)
    k = rng.standard_normal((H, S, d)).astype(np.float32)
    lg = attention_logits(q, k, 0.5)
    assert lg.shape == (Hq, n, S) and lg.dtype == np.float32
    for h in range(Hq):
        assert np.allclose(lg[h], 0.5 * q[h] @ k[h // 3].T, rtol=1e-5, atol=1e-5)
    m = token_mass(lg)
    e = np.exp(lg.astype(np.float64) - lg.max(axis=2, keepdims=True))
    assert np.allclose(m, (e / e.sum(axis=2, keepdims=True)).mean(axis=0), atol=1e-6)
    assert np.allclose(m.sum(axis=1), 1.0, atol=1e-5)


def test_relative_error_is_that_of_the_restricted_attention(rng):
    Hq, H, S, d = 4, 2, 40, 8
    q = rng.standard_normal((Hq, d)).astype(np.float32)
    k = rng.standard_normal((H, S, d)).astype(np.float32)
    v = rng.standard_normal((H, S, d)).astype(np.float32)
    pos = np.array([3, 7, 20, 21, 39])
    out = evaluate_query(q, k, v, pos, scaling=d ** -0.5, ratio=0.25)

    def attend(idx):
        o = []
        for h in range(Hq):
            x = (k[h // 2, idx] @ q[h]) * d ** -0.5
            p = np.exp(x - x.max())
            o.append((p / p.sum()) @ v[h // 2, idx])
        return np.stack(o)
    full = attend(np.arange(S))
    want = np.linalg.norm(attend(pos) - full) / np.linalg.norm(full)
    assert abs(out["rel_error"] - want) < 1e-5 and out["budget"] == 10
    assert out["entries"] == 5 and out["recall"] < 1.0
    # the K/V read back from a store are what is scored: wrong bytes show
    bad = evaluate_query(q, k, v, pos, k_ret=k[:, pos], v_ret=v[:, pos] + 1.0,
                         scaling=d ** -0.5, ratio=0.25)
    assert bad["rel_error"] > out["rel_error"] + 0.1 and bad["recall"] == out["recall"]


def test_summarize_averages_numbers_only():
    rows = [{"recall": 0.5, "entries": 4, "name": "a"}, {"recall": 1.0, "entries": 6,
                                                          "name": "b"}]
    assert summarize(rows) == {"recall": 0.75, "entries": 5.0}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_query_token_mass_equals_the_numpy_definition(rng, each_path, dtype):
    """query_token_mass (C kernels on 2-byte keys, no fp32 copy of K) equals
    token_mass(attention_logits(...)) for one query up to float rounding, on
    every kernel path, with GQA groups, for fp16, bf16 and fp32 keys, and
    for K that is a column slice of a larger buffer (as DecodeSession's)."""
    import ml_dtypes

    from swarmfs.decode._report import attention_logits, query_token_mass, token_mass
    from swarmfs.store._kernels import set_kernel_path
    H, G, n, d = 4, 3, 700, 64
    np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    buf = (rng.standard_normal((H, n + 50, d)) * 2).astype(np_dt)
    k = buf[:, :n]
    q = rng.standard_normal((H * G, d)).astype(np.float32)
    want = token_mass(attention_logits(q[:, None, :], k.astype(np.float32), d ** -0.5))[0]
    for path in each_path:
        set_kernel_path(path)
        got = query_token_mass(q, k, d ** -0.5)
        assert got.shape == (n,) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9, err_msg=path)
        assert abs(float(got.sum()) - 1.0) < 1e-4
        # K as an EntryBuffer gives it: strided views of stored entry rows
        # [n, 2, H, d] (K heads side by side in each row), read in place
        rows = np.zeros((n, 2, H, d), np_dt)
        rows[:, 0] = k.transpose(1, 0, 2)
        rows[:, 1] = -k.transpose(1, 0, 2)                  # V: must not be read as K
        kv = rows[:, 0].transpose(1, 0, 2)
        assert not kv.flags.c_contiguous
        np.testing.assert_allclose(query_token_mass(q, kv, d ** -0.5), want, rtol=2e-5,
                                   atol=1e-9, err_msg=path)



def test_query_token_mass_refuses_what_does_not_fit_on_every_dtype(rng):
    """Head counts that do not divide, mismatched dimensions, a bad scale:
    SwarmError subclasses on the C path and the numpy path alike; no keys:
    an empty mass."""
    from swarmfs._errors import InvalidArgumentError, ShapeError
    from swarmfs.decode._report import query_token_mass
    for dt in (np.float16, np.float32):
        k = rng.standard_normal((2, 50, 16)).astype(dt)
        q = rng.standard_normal((4, 16)).astype(np.float32)
        for qq, kk in ((q[:3], k), (q[:, :8], k), (q, k[:0]), (q[0], k), (q, k[0])):
            with pytest.raises(ShapeError):
                query_token_mass(qq, kk, 0.25)
        for bad in (0.0, -1.0, np.nan, np.inf, "x"):
            with pytest.raises(InvalidArgumentError):
                query_token_mass(q, k, bad)
        assert query_token_mass(q, k[:, :0], 0.25).shape == (0,)


def test_query_token_mass_of_overflowing_logits_is_the_same_on_every_path(rng, each_path):
    """Keys near float16's largest value with a large query overflow the
    logits to inf: every kernel path then returns the numpy definition's
    result (NaN where softmax of inf is undefined), not a path's own."""
    from swarmfs.decode._report import attention_logits, query_token_mass, token_mass
    from swarmfs.store._kernels import set_kernel_path
    k = rng.standard_normal((2, 37, 16)).astype(np.float16)
    k[1, 20] = 60000.0
    q = np.full((4, 16), 1e35, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = token_mass(attention_logits(q[:, None, :], k.astype(np.float32), 0.25))[0]
    for path in each_path:
        set_kernel_path(path)
        got = query_token_mass(q, k, 0.25)
        assert np.array_equal(np.isnan(got), np.isnan(want)), path
        np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-5)


def test_evaluate_queries_equals_one_query_at_a_time(rng):
    """The batched evaluation (chunks of queries in one GEMM per KV head)
    gives each query what evaluate_query gives it, across chunk edges,
    with returned K/V and without."""
    from swarmfs.decode._report import evaluate_queries
    H, Hq, d, S, n = 2, 8, 16, 300, 11
    k = rng.standard_normal((H, S, d)).astype(np.float32)
    v = rng.standard_normal((H, S, d)).astype(np.float32)
    qs = rng.standard_normal((n, Hq, d)).astype(np.float32)
    pos = [np.sort(rng.choice(S, size=int(rng.integers(5, 80)), replace=False))
           for _ in range(n)]
    noisy = [v[:, p] + 0.1 for p in pos]
    for kw in ({}, {"k_ret": [k[:, p] for p in pos], "v_ret": noisy}):
        got = evaluate_queries(qs, k, v, pos, scaling=d ** -0.5, ratio=0.1, chunk=4, **kw)
        for i in range(n):
            one = {key: x[i] for key, x in kw.items()}
            want = evaluate_query(qs[i], k, v, pos[i], scaling=d ** -0.5, ratio=0.1, **one)
            assert got[i].keys() == want.keys()
            for key in want:
                assert got[i][key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
