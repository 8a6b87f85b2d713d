"""Offload-friendly partition between DRAM and the SSDs (SWARM §5.2).

DRAM holds three things: the medoids (the index, kept by the store), the
local window (the last ``W`` context entries) and the *hot clusters*.  Hot
clusters are chosen by the cost-benefit score of eq. 6,

    S(C_i) = (f_i * T_base + s_i * T_transfer) / s_i,

where ``f_i`` is the cluster's activation frequency (``Clustering.freq``),
``s_i`` its size in entries, ``T_base`` the SSD access latency and
``T_transfer`` the transfer cost of one entry.  Clusters are cached in
descending score while they fit in the DRAM budget.  (``T_transfer`` adds
the same constant to every score, so the order is that of ``f_i / s_i``:
the I/O latency saved per byte of DRAM.)
"""

from __future__ import annotations

import numpy as np

from .._errors import LayoutError, ShapeError

__all__ = ["DEFAULT_LOCAL_WINDOW", "DEFAULT_SSD_GBPS", "DEFAULT_T_BASE_US", "cluster_scores",
           "hot_clusters", "local_window", "local_window_mask"]

#: Local window W in tokens (§5.2: "e.g. 256 tokens").
DEFAULT_LOCAL_WINDOW = 256
#: Default SSD access latency T_base in microseconds (a 4 KiB random read on a
#: datacenter NVMe SSD takes ~70-100 us).
DEFAULT_T_BASE_US = 80.0
#: Default sequential SSD bandwidth used to derive T_transfer (GB/s).
DEFAULT_SSD_GBPS = 3.0


def _transfer_us(entry_bytes: int, t_transfer_us: float | None) -> float:
    if t_transfer_us is not None:
        return float(t_transfer_us)
    return entry_bytes / (DEFAULT_SSD_GBPS * 1e3)      # bytes / (GB/s) -> us


def cluster_scores(freq, sizes, *, t_base_us: float = DEFAULT_T_BASE_US,
                   t_transfer_us: float) -> np.ndarray:
    """Cost-benefit score of each cluster (SWARM §5.2, eq. 6).

    Args:
        freq: float [C] activation frequency f_i (e.g. ``Clustering.freq``:
            activations per profiled query).
        sizes: int [C] cluster sizes s_i in entries (> 0).
        t_base_us: SSD access latency T_base (microseconds).
        t_transfer_us: transfer cost of one entry T_transfer (microseconds).

    Returns:
        float64 [C] ``(f_i T_base + s_i T_transfer) / s_i`` (microseconds per
        entry).

    Raises:
        ShapeError: freq and sizes differ in length, or a size is not positive.
        LayoutError: negative latency or frequency.
    """
    f = np.asarray(freq, np.float64).reshape(-1)
    s = np.asarray(sizes, np.float64).reshape(-1)
    if f.shape != s.shape:
        raise ShapeError(f"freq has {f.shape[0]} clusters but sizes has {s.shape[0]}")
    if s.size and s.min() <= 0:
        raise ShapeError("cluster sizes must be positive")
    if t_base_us < 0 or t_transfer_us < 0:
        raise LayoutError(f"latencies must be >= 0 (T_base={t_base_us}, "
                          f"T_transfer={t_transfer_us})")
    if f.size and (f.min() < 0 or not np.isfinite(f).all()):
        raise LayoutError("activation frequencies must be finite and >= 0")
    return (f * t_base_us + s * t_transfer_us) / s


def hot_clusters(freq, sizes, *, budget_bytes: int, entry_bytes: int,
                 t_base_us: float = DEFAULT_T_BASE_US,
                 t_transfer_us: float | None = None, exclude=None) -> np.ndarray:
    """Choose the hot clusters cached in DRAM (SWARM §5.2, eq. 6).

    Clusters are visited in descending eq. 6 score (ties: lower cluster id
    first); each is taken if its bytes (``s_i * entry_bytes``) still fit in
    the remaining budget, otherwise skipped (a smaller one later may fit).
    Clusters with zero frequency are never cached.

    Args:
        freq: float [C] activation frequency per cluster.
        sizes: int [C] cluster sizes in entries.
        budget_bytes: DRAM bytes for hot clusters (>= 0).
        entry_bytes: bytes of one KV entry (2 x H_kv x head_dim x itemsize).
        t_base_us: SSD access latency (microseconds).
        t_transfer_us: per-entry transfer cost (microseconds); default
            ``entry_bytes`` at :data:`DEFAULT_SSD_GBPS`.
        exclude: optional bool [C] clusters never to cache (e.g. already in
            the local window).

    Returns:
        bool [C] hot mask (``Store.write_layer(..., hot=mask)``).

    Raises:
        LayoutError: negative budget, non-positive entry size, bad latencies.
        ShapeError: array lengths disagree.
    """
    if budget_bytes < 0:
        raise LayoutError(f"DRAM budget must be >= 0 bytes, got {budget_bytes}")
    if entry_bytes <= 0:
        raise LayoutError(f"entry_bytes must be positive, got {entry_bytes}")
    t_tr = _transfer_us(entry_bytes, t_transfer_us)
    score = cluster_scores(freq, sizes, t_base_us=t_base_us, t_transfer_us=t_tr)
    f = np.asarray(freq, np.float64).reshape(-1)
    nbytes = np.asarray(sizes, np.int64).reshape(-1) * int(entry_bytes)
    eligible = f > 0
    if exclude is not None:
        exclude = np.asarray(exclude, bool).reshape(-1)
        if exclude.shape != f.shape:
            raise ShapeError(f"exclude has {exclude.shape[0]} clusters, expected {f.shape[0]}")
        eligible &= ~exclude
    order = np.argsort(-score, kind="stable")
    order = order[eligible[order]]
    hot = np.zeros(f.shape[0], bool)
    left = int(budget_bytes)
    # Fast path: the longest prefix that fits; then one pass over the rest.
    cum = np.cumsum(nbytes[order])
    n = int(np.searchsorted(cum, left, side="right"))
    hot[order[:n]] = True
    left -= int(cum[n - 1]) if n else 0
    for c in order[n:]:
        if left <= 0:
            break
        if nbytes[c] <= left:
            hot[c] = True
            left -= int(nbytes[c])
    return hot


def local_window(num_tokens: int, window: int = DEFAULT_LOCAL_WINDOW) -> np.ndarray:
    """Token positions of the local window kept in DRAM (SWARM §5.2).

    Returns:
        int64 ``[max(0, S - W), S)`` ascending (all tokens if S <= W).

    Raises:
        LayoutError: negative S or W.
    """
    if num_tokens < 0 or window < 0:
        raise LayoutError(f"num_tokens and window must be >= 0, got {num_tokens}, {window}")
    return np.arange(max(0, num_tokens - window), num_tokens, dtype=np.int64)


def local_window_mask(num_tokens: int, window: int = DEFAULT_LOCAL_WINDOW) -> np.ndarray:
    """bool [S]: True for the last ``window`` tokens (see :func:`local_window`)."""
    idx = local_window(num_tokens, window)
    mask = np.zeros(num_tokens, bool)
    mask[idx] = True
    return mask
