"""One layer's whole offline layout (SWARM §5.1-5.2): profile, cluster, hot set.

:func:`lay_out_layer` is what ``swarmfs build``, ``swarmfs demo --minilm``
and :class:`swarmfs.hf.SwarmCache`'s prefill run per layer: the activation
profile of the context's own queries (causal, at the sparsity ratio r),
Algorithm 1 clustering with replication, and the eq. 6 hot clusters under a
DRAM budget.  Placement (eq. 7) is the store's, at ``Store.write_layer``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import _defaults as defaults
from .._validate import (
    checked,
    checked_methods,
    parse_choice,
    parse_fraction,
    parse_instance,
    parse_nonneg_int,
    parse_number,
    parse_positive_int,
    parse_ratio,
)
from ..decode._hot import hot_clusters
from ..store._write import REPRESENTATIVES
from ._cluster import METRICS, Clustering, cluster
from ._profile import profile_layer

__all__ = ["LayoutParams", "lay_out_layer"]


@checked_methods
@dataclasses.dataclass(frozen=True)
class LayoutParams:
    """Offline layout parameters, checked when made.

    Attributes:
        ratio: sparsity ratio r used for the activation profile and the
            retrieval budget, in (0, 1] (§8.1: 0.10).
        tau: clustering radius in (0, 1] (None: the layout default).
        metric: co-activation distance (``"jaccard"`` or ``"eq2"``; None:
            the layout default).
        max_queries: profiled queries per layer (a deterministic sample;
            None: the profile's default).
        max_cluster_size: cap on entries per cluster, >= 1 (None: the
            layout default, 64).
        local_window: W, tokens kept in DRAM (§5.2), >= 0.
        hot_fraction: DRAM budget for hot clusters, as a fraction in [0, 1]
            of the layer's KV bytes (eq. 6 chooses which clusters fill it).
        t_base_us, t_transfer_us: eq. 6 costs (µs, >= 0): SSD access latency
            and per-entry transfer time.
        representative: the key the DRAM index keeps per cluster, passed to
            ``Store.write_layer``: ``"medoid"`` (§5.2) or ``"centroid"`` (the
            members' mean K); None: the writer's default (``"medoid"``, and
            ``defaults.DECODER_REPRESENTATIVE`` in ``swarmfs.hf``).

    Raises:
        InvalidRatioError: ratio or tau outside (0, 1].
        InvalidChoiceError: an unknown metric or representative.
        InvalidIntegerError: max_queries below 1, local_window below 0.
        InvalidFractionError: hot_fraction outside [0, 1].
        InvalidNumberError: a negative or non-finite cost.
    """
    ratio: float = defaults.RATIO
    tau: float | None = None
    metric: str | None = None
    max_queries: int | None = None
    max_cluster_size: int | None = None
    local_window: int = defaults.LOCAL_WINDOW
    hot_fraction: float = defaults.HOT_FRACTION
    t_base_us: float = defaults.T_BASE_US
    t_transfer_us: float = defaults.T_TRANSFER_US
    representative: str | None = None

    def __post_init__(self):
        parse_ratio(self.ratio, "ratio")
        if self.tau is not None:
            parse_ratio(self.tau, "tau")
        if self.metric is not None:
            parse_choice(self.metric, "metric", METRICS)
        if self.max_queries is not None:
            parse_positive_int(self.max_queries, "max_queries")
        if self.max_cluster_size is not None:
            parse_positive_int(self.max_cluster_size, "max_cluster_size")
        parse_nonneg_int(self.local_window, "local_window")
        parse_fraction(self.hot_fraction, "hot_fraction")
        parse_number(self.t_base_us, "t_base_us", 0, unit="µs")
        parse_number(self.t_transfer_us, "t_transfer_us", 0, unit="µs")
        if self.representative is not None:
            parse_choice(self.representative, "representative", REPRESENTATIVES)


@checked
def lay_out_layer(q, k, *, params: LayoutParams = LayoutParams(), scaling: float,
                  entry_bytes: int, layer: int | None = None
                  ) -> tuple[Clustering, np.ndarray]:
    """Lay out one layer's context (SWARM §5.1-5.2): profile its own queries,
    cluster by co-activation (Algorithm 1), choose the hot clusters (eq. 6).

    Args:
        q: [H_q, S, d] the context's queries (post-RoPE; any float dtype).
        k: [H_kv, S, d] the context's keys.
        params: :class:`LayoutParams` (ratio, tau, metric, profiled queries,
            DRAM fraction for hot clusters, eq. 6 costs).
        scaling: attention logit scale (e.g. d**-0.5, ``Capture.scaling``).
        entry_bytes: bytes of one stored KV entry (``Store.entry_bytes``):
            the hot set fills ``hot_fraction x S x entry_bytes`` bytes.
        layer: recorded in the profile and named in errors.

    Returns:
        ``(clustering, hot)``: the :class:`~swarmfs.layout.Clustering` and a
        bool [C] hot mask, as ``Store.write_layer(layer, kv, (c.ptr,
        c.members), c.medoids, hot=hot, freq=c.freq)`` takes them.

    Raises:
        InvalidTypeError: ``params`` is not a LayoutParams.
        InvalidNumberError: ``scaling`` not a finite positive number.
        InvalidIntegerError: ``entry_bytes`` below 1.
        ShapeError: q and k do not fit each other.
        LayoutError: an empty profile (as :func:`~swarmfs.layout.cluster`).
    """
    parse_instance(params, "params", LayoutParams)
    scaling = parse_number(scaling, "scaling", 0, lo_open=True, layer=layer)
    entry_bytes = parse_positive_int(entry_bytes, "entry_bytes", layer=layer)
    kw = {} if params.max_queries is None else {"max_queries": params.max_queries}
    prof = profile_layer(q, k, ratio=params.ratio, scaling=scaling, layer=layer, **kw)
    ckw: dict[str, Any] = {}
    if params.tau is not None:
        ckw["tau"] = params.tau
    if params.metric is not None:
        ckw["metric"] = params.metric
    if params.max_cluster_size is not None:
        ckw["max_cluster_size"] = params.max_cluster_size
    cl = cluster(prof, keys=k, **ckw)
    S = int(np.shape(k)[1])
    budget = int(params.hot_fraction * S * entry_bytes)
    hot = hot_clusters(cl.freq, cl.sizes, entry_bytes=entry_bytes, budget_bytes=budget,
                       t_base_us=params.t_base_us, t_transfer_us=params.t_transfer_us)
    return cl, hot
