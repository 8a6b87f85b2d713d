"""The one recall definition (SWARM §8.2): attention mass of the distinct
retrieved entries over the oracle's top max(budget, n)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmfs._report import attention_recall, evaluate_query


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
def test_recall_is_at_most_one(S, seed):
    rng = np.random.default_rng(seed)
    mass = rng.random(S)
    pos = rng.integers(0, S, rng.integers(0, 2 * S + 1))
    r, got, top = attention_recall(mass, pos, int(rng.integers(1, S + 1)))
    assert 0.0 <= r <= 1.0 + 1e-12
    assert abs(got - mass[np.unique(pos)].sum()) < 1e-9


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
