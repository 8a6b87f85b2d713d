"""Tests for swarmfs.layout._quality: recall of medoid-based cluster retrieval."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from swarmfs._errors import InvalidChoiceError, InvalidIntegerError, InvalidRatioError, ShapeError
from swarmfs.layout._cluster import cluster
from swarmfs.layout._profile import profile_layer
from swarmfs.layout._quality import block_clustering, evaluate_recall


@pytest.fixture
def real_layer(minilm_layer2):
    """MiniLM layer 2 over 2304 tokens of real text: 2048 context + 256 held out."""
    return minilm_layer2


def hand_layout():
    """c0 = [0 1 2 3], c1 = [4 0] (0 replicated), c2 = [5 .. 19]; medoid keys rank c0 > c1 > c2."""
    ptr = np.array([0, 4, 6, 21])
    members = np.array([0, 1, 2, 3, 4, 0] + list(range(5, 20)))
    k = np.zeros((1, 20, 1), np.float32)
    k[0, [0, 4, 5], 0] = [3.0, 2.0, 1.0]
    return types.SimpleNamespace(ptr=ptr, members=members, medoids=np.array([0, 4, 5])), k


@pytest.mark.parametrize("score", ["logit", "prob"])
def test_budget_replicas_and_window(score):
    layout, k = hand_layout()
    q = np.ones((1, 3, 1), np.float32)
    # budget ceil(.25 * 20) = 5: c0 brings 4 entries, c1 one new (0 is a replica).
    rep = evaluate_recall(layout, q, k, ratio=0.25, local_window=0, score=score)
    assert rep.budget == 5
    np.testing.assert_array_equal(rep.clusters_read, 2)
    np.testing.assert_array_equal(rep.selected, 5)
    # the window counts against the budget; it is capped at a quarter of the
    # budget (the Retriever's rule, window_size): W = 1 (token 19), c0 is enough.
    for W in (2, 5):
        rep = evaluate_recall(layout, q, k, ratio=0.25, local_window=W, score=score)
        np.testing.assert_array_equal(rep.clusters_read, 1)
        np.testing.assert_array_equal(rep.selected, 5)
    # budget 8 allows W = 2 (tokens 18, 19): c0 gives 6, c1 one more (0 is a
    # replica), so c2 is needed and brings the rest
    rep = evaluate_recall(layout, q, k, ratio=0.4, local_window=2, score=score)
    np.testing.assert_array_equal(rep.clusters_read, 3)
    np.testing.assert_array_equal(rep.selected, 20)
    assert np.all(rep.recall <= rep.window_bound + 1e-12)


@pytest.mark.model
def test_recall_on_held_out_queries(real_layer):
    """Clusters retrieved by medoid score recover most of the attention mass of
    queries never used in profiling, and beat position-contiguous blocks of the
    same mean size (an InfLLM-like layout)."""
    q, k, scaling = real_layer
    ctx = 2048
    prof = profile_layer(q[:, :ctx], k[:, :ctx], scaling=scaling)
    cl = cluster(prof, keys=k[:, :ctx])
    held = q[:, ctx:]
    rep = evaluate_recall(cl, held, k[:, :ctx], scaling=scaling, local_window=0)
    size = max(2, round(cl.stats.size_mean))
    blocks = evaluate_recall(block_clustering(ctx, size), held, k[:, :ctx],
                             scaling=scaling, local_window=0)
    assert rep.recall.shape == (256,) and rep.budget == 205
    assert np.all(rep.recall <= 1 + 1e-9) and np.all(rep.selected >= rep.budget)
    assert rep.mean > 0.85
    assert rep.mean > blocks.mean + 0.1
    win = evaluate_recall(cl, held, k[:, :ctx], scaling=scaling, local_window=64)
    assert np.all(win.recall <= win.window_bound + 1e-9)
    assert win.overshoot >= 1.0


@pytest.mark.model
def test_singletons_recall_is_exact(real_layer):
    """One cluster per token, scored by summed probabilities: the oracle top-k."""
    q, k, scaling = real_layer
    S = 512
    ones = block_clustering(S, 1)
    rep = evaluate_recall(ones, q[:, S:S + 64], k[:, :S], scaling=scaling, local_window=0)
    np.testing.assert_allclose(rep.recall, 1.0, atol=1e-6)
    assert np.all(rep.selected == math.ceil(0.1 * S))


def test_errors():
    layout, k = hand_layout()
    q = np.ones((1, 2, 1), np.float32)
    with pytest.raises(ShapeError):
        evaluate_recall(layout, q, np.zeros((1, 21, 1), np.float32))   # not over S tokens
    with pytest.raises(ShapeError):
        evaluate_recall(layout, np.ones((1, 2, 2), np.float32), k)
    with pytest.raises(InvalidChoiceError, match="score"):
        evaluate_recall(layout, q, k, score="max")
    with pytest.raises(InvalidRatioError, match="ratio"):
        evaluate_recall(layout, q, k, ratio=0)
    with pytest.raises(InvalidIntegerError, match="local_window"):
        evaluate_recall(layout, q, k, local_window=-1)
    b = block_clustering(10, 4)
    np.testing.assert_array_equal(b.ptr, [0, 4, 8, 10])
    np.testing.assert_array_equal(b.medoids, [2, 6, 9])
