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

All take the GQA-summed query ``qg`` [B, H_kv*d] (see ``group_queries``) and
return float32 scores [B, C] (tokens: [B, S]).
"""

from __future__ import annotations

import numpy as np

__all__ = ["MedoidSelector", "VectorSelector", "MultiVectorSelector", "BoundSelector",
           "TokenSelector"]


def _gemv(m: np.ndarray, qg: np.ndarray) -> np.ndarray:
    from ._retrieve import score_medoids
    return score_medoids(m, qg)


class MedoidSelector:
    """SWARM §5.2: score each cluster by its medoid's key (store dtype)."""

    kind = "clusters"
    name = "swarm"

    def __init__(self, store):
        self.store = store
        self._m = {}

    def _medoids(self, layer):
        m = self._m.get(layer)
        if m is None:
            li = self.store.layer(layer)
            m = np.ascontiguousarray(self.store.medoid_keys(layer)).reshape(li.num_clusters, -1)
            self._m[layer] = m
        return m

    def scores(self, layer: int, qg: np.ndarray) -> np.ndarray:
        return _gemv(self._medoids(layer), qg)

    def dram_bytes(self, layer: int) -> int:
        return int(self._medoids(layer).nbytes)


class VectorSelector:
    """One vector per cluster (e.g. k-means centroids): {layer: [C, H_kv*d]}."""

    kind = "clusters"

    def __init__(self, vectors: dict, name: str = "centroid"):
        self.vectors = {k: np.ascontiguousarray(v) for k, v in vectors.items()}
        self.name = name

    def scores(self, layer, qg):
        return _gemv(self.vectors[layer], qg)

    def dram_bytes(self, layer):
        return int(self.vectors[layer].nbytes)


class MultiVectorSelector:
    """R representative keys per cluster, {layer: [C, R, H_kv*d]}; a cluster
    scores its best representative (InfLLM)."""

    kind = "clusters"

    def __init__(self, reps: dict, name: str = "representatives"):
        self.reps = {k: np.ascontiguousarray(v) for k, v in reps.items()}
        self.name = name

    def scores(self, layer, qg):
        r = self.reps[layer]
        C, R, D = r.shape
        return _gemv(r.reshape(C * R, D), qg).reshape(qg.shape[0], C, R).max(axis=2)

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

    def scores(self, layer, qg):
        lo, hi = self.bounds[layer]
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

    def scores(self, layer, qg):
        return _gemv(self.keys[layer], qg)

    def dram_bytes(self, layer):
        return int(self.keys[layer].nbytes)
