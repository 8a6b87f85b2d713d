"""What a query selects: the DRAM index that scores clusters (or tokens).

SWARM scores a query against the medoid key of every cluster (§5.2, the index
in DRAM).  The baselines of §8 differ only in this step, so the
:class:`~swarmfs.Retriever` takes any selector:

* :class:`MedoidSelector` -- SWARM: the medoid keys stored with the clusters.
* :class:`VectorSelector` -- one vector per cluster (k-means centroids:
  PQCache / ClusterKV style).
* :class:`MultiVectorSelector` -- several representative keys per cluster,
  the cluster's score is their best (InfLLM style blocks).
* :class:`BoundSelector` -- per-channel min/max keys per cluster, the score is
  the upper bound sum_c max(q_c lo_c, q_c hi_c) (Quest pages).
* :class:`TokenSelector` -- every key: the exact top-k tokens (the oracle,
  "No Cluster" in §8.1, which pays for scoring all keys).

All take the queries ``q`` float32 [B, H_q, d] and return float32 scores
[B, C] (tokens: [B, S]).  Selectors that score by a dot product sum the query
heads of each GQA group first (``group_queries``), which is equivalent; they
also accept such an already summed ``qg`` [B, H_kv*d].
"""

from __future__ import annotations

import numpy as np

__all__ = ["MedoidSelector", "VectorSelector", "MultiVectorSelector", "BoundSelector",
           "TokenSelector"]


def _gemv(m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Dot-product scores with the GQA groups summed: [B, rows]."""
    from ._retrieve import group_queries, score_medoids
    if q.ndim == 2:                          # already [B, H_kv*d]
        return score_medoids(m, np.asarray(q, np.float32))
    return score_medoids(m, group_queries(q, m.shape[-1] // q.shape[-1]))


def head_logits(m: np.ndarray, q: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Per-query-head logits q_h . k_{g(h)} of rows ``m`` [C, H_kv*d] (store
    dtype; fp32 may also come head-major as [H_kv, C, d]): float32
    [B, H_q, C]; query head h uses KV head h // (H_q / H_kv)."""
    from ._engine import head_logits_half
    from ._retrieve import single_threaded_blas
    B, Hq, d = q.shape
    H = int(num_kv_heads)
    if m.dtype != np.float32:       # one pass over the index, in C
        return head_logits_half(m, q, H, bf16=m.dtype.name == "bfloat16")
    G = Hq // H
    mt = m if m.ndim == 3 else np.ascontiguousarray(m.reshape(m.shape[0], H, d).transpose(1, 0, 2))
    qh = q.reshape(B, H, G, d).transpose(1, 0, 2, 3).reshape(H, B * G, d)
    with single_threaded_blas():
        out = np.matmul(qh, mt.transpose(0, 2, 1))               # [H, B*G, C], one call
    return np.ascontiguousarray(out.reshape(H, B, G, -1).transpose(1, 0, 2, 3)).reshape(B, Hq, -1)


SCORES = ("prob", "logit")


class MedoidSelector:
    """SWARM §5.2: score each cluster by its medoid's key (store dtype).

    Args:
        store: the store.
        score: ``"prob"`` (default): each query head's softmax over the
            medoids, summed over heads -- a cluster ranks by the attention
            mass its medoid would draw, which is what recall measures (the
            layout benchmark measured mean recall 0.885 against 0.834 for
            ``"logit"`` on WikiText-2 at 16K tokens); ``"logit"``: the scaled
            logits summed over heads, computed on the GQA-summed query (one
            GEMV, the cheapest).
    """

    kind = "clusters"
    name = "swarm"

    def __init__(self, store, score: str = "prob"):
        if score not in SCORES:
            raise ValueError(f"unknown medoid score {score!r}; use one of {SCORES}")
        self.store = store
        self.score = score
        self.scale = float(store.head_dim) ** -0.5
        self._m = {}
        self._mt = {}

    def _medoids(self, layer):
        m = self._m.get(layer)
        if m is None:
            li = self.store.layer(layer)
            m = np.ascontiguousarray(self.store.medoid_keys(layer)).reshape(li.num_clusters, -1)
            self._m[layer] = m
        return m

    def scores(self, layer: int, q: np.ndarray) -> np.ndarray:
        m = self._medoids(layer)
        if self.score == "logit":
            return _gemv(m, q)
        from ._engine import softmax_sum
        if m.dtype == np.float32:        # fp32: a head-major copy, made once per layer
            mt = self._mt.get(layer)
            if mt is None:
                H = self.store.num_kv_heads
                mt = np.ascontiguousarray(m.reshape(m.shape[0], H, -1).transpose(1, 0, 2))
                self._mt[layer] = mt
            m = mt
        logits = head_logits(m, q, self.store.num_kv_heads)
        return np.stack([softmax_sum(x, self.scale) for x in logits])

    def dram_bytes(self, layer: int) -> int:
        mt = self._mt.get(layer)
        return int(self._medoids(layer).nbytes + (mt.nbytes if mt is not None else 0))


class VectorSelector:
    """One vector per cluster (e.g. k-means centroids): {layer: [C, H_kv*d]}."""

    kind = "clusters"

    def __init__(self, vectors: dict, name: str = "centroid"):
        self.vectors = {k: np.ascontiguousarray(v) for k, v in vectors.items()}
        self.name = name

    def scores(self, layer, q):
        return _gemv(self.vectors[layer], q)

    def dram_bytes(self, layer):
        return int(self.vectors[layer].nbytes)


class MultiVectorSelector:
    """R representative keys per cluster, {layer: [C, R, H_kv*d]}; a cluster
    scores its best representative (InfLLM)."""

    kind = "clusters"

    def __init__(self, reps: dict, name: str = "representatives"):
        self.reps = {k: np.ascontiguousarray(v) for k, v in reps.items()}
        self.name = name

    def scores(self, layer, q):
        r = self.reps[layer]
        C, R, D = r.shape
        return _gemv(r.reshape(C * R, D), q).reshape(q.shape[0], C, R).max(axis=2)

    def dram_bytes(self, layer):
        return int(self.reps[layer].nbytes)


class BoundSelector:
    """Quest: per-channel key bounds per cluster, {layer: (lo, hi)} each
    float32 [C, H_kv*d]; score = sum_c max(q_c lo_c, q_c hi_c), an upper bound
    of q . k over the cluster's keys."""

    kind = "clusters"
    name = "quest"

    def __init__(self, bounds: dict):
        self.bounds = {k: (np.ascontiguousarray(lo, np.float32), np.ascontiguousarray(hi, np.float32))
                       for k, (lo, hi) in bounds.items()}

    def scores(self, layer, q):
        from ._retrieve import group_queries
        lo, hi = self.bounds[layer]
        qg = np.asarray(q, np.float32) if q.ndim == 2 else \
            group_queries(q, lo.shape[1] // q.shape[-1])
        pos = np.maximum(qg, 0)
        neg = np.minimum(qg, 0)
        # max(q lo, q hi) = q+ hi + q- lo, summed over channels: two GEMVs
        return (pos @ hi.T + neg @ lo.T).astype(np.float32)

    def dram_bytes(self, layer):
        lo, hi = self.bounds[layer]
        return int(lo.nbytes + hi.nbytes)


class TokenSelector:
    """Every key of the layer, {layer: [S, H_kv*d]}: the exact top-k tokens
    (the oracle / "No Cluster" baseline of §8.1)."""

    kind = "tokens"
    name = "oracle"

    def __init__(self, keys: dict):
        self.keys = {k: np.ascontiguousarray(v) for k, v in keys.items()}

    def scores(self, layer, q):
        return _gemv(self.keys[layer], q)

    def dram_bytes(self, layer):
        return int(self.keys[layer].nbytes)
