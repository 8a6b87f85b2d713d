"""Hot clusters: the eq. 6 cost-benefit score and the one rule that fills
DRAM with it (SWARM §5.2, §6.2).

    S(C_i) = (f_i * T_base + s_i * T_transfer) / s_i,

``f_i`` the cluster's activation frequency, ``s_i`` its size in entries,
``T_base`` the SSD access latency and ``T_transfer`` the transfer cost of one
entry.  Clusters are cached in descending score while they fit in the DRAM
budget.  (``T_transfer`` adds the same constant to every score, so the order
is that of ``f_i / s_i``: the I/O latency saved per byte of DRAM.)

The offline layout (``layout._partition``, at write time) and the online
cache replacement (:class:`~swarmfs.DecodeSession`, each decode step, over
the cached and just-selected clusters) both call :func:`hot_clusters`.
"""

from __future__ import annotations

import numpy as np

from .._defaults import SSD_GBPS, T_BASE_US
from .._errors import LayoutError, ShapeError
from .._validate import checked, parse_nonneg_int, parse_number, parse_positive_int

__all__ = ["cluster_scores", "hot_clusters", "transfer_us"]


def transfer_us(entry_bytes: int, t_transfer_us: float | None = None) -> float:
    """T_transfer of one entry (µs): ``t_transfer_us`` if given, else
    ``entry_bytes`` at :data:`~swarmfs._defaults.SSD_GBPS`."""
    if t_transfer_us is not None:
        return float(t_transfer_us)
    return entry_bytes / (SSD_GBPS * 1e3)      # bytes / (GB/s) -> µs


@checked
def cluster_scores(freq, sizes, *, t_base_us: float = T_BASE_US,
                   t_transfer_us: float) -> np.ndarray:
    """Cost-benefit score of each cluster (SWARM §5.2, eq. 6).

    Args:
        freq: float [C] activation frequency f_i (e.g. ``Clustering.freq``:
            activations per profiled query).
        sizes: int [C] cluster sizes s_i in entries (> 0).
        t_base_us: SSD access latency T_base (µs).
        t_transfer_us: transfer cost of one entry T_transfer (µs).

    Returns:
        float64 [C] ``(f_i T_base + s_i T_transfer) / s_i`` (µs per entry).

    Raises:
        ShapeError: freq and sizes differ in length, or a size is not positive.
        InvalidNumberError: a negative or non-finite latency.
        LayoutError: a negative or non-finite frequency.
    """
    f = np.asarray(freq, np.float64).reshape(-1)
    s = np.asarray(sizes, np.float64).reshape(-1)
    if f.shape != s.shape:
        raise ShapeError(f"freq has {f.shape[0]} clusters but sizes has {s.shape[0]}")
    if s.size and s.min() <= 0:
        raise ShapeError("cluster sizes must be positive")
    parse_number(t_base_us, "t_base_us", 0, unit="µs")
    parse_number(t_transfer_us, "t_transfer_us", 0, unit="µs")
    if f.size and (f.min() < 0 or not np.isfinite(f).all()):
        raise LayoutError("activation frequencies must be finite and >= 0")
    return (f * t_base_us + s * t_transfer_us) / s


@checked
def hot_clusters(freq, sizes, *, budget_bytes: int, entry_bytes: int,
                 t_base_us: float = T_BASE_US,
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
        t_base_us: SSD access latency (µs).
        t_transfer_us: per-entry transfer cost (µs); default ``entry_bytes``
            at :data:`~swarmfs._defaults.SSD_GBPS`.
        exclude: optional bool [C] clusters never to cache (e.g. already in
            the local window, or, online, neither cached nor just selected).

    Returns:
        bool [C] hot mask (``Store.write_layer(..., hot=mask)``).

    Raises:
        InvalidIntegerError: a negative budget, an entry size below 1.
        InvalidNumberError: a negative or non-finite latency.
        LayoutError: a negative or non-finite frequency.
        ShapeError: array lengths disagree.
    """
    parse_nonneg_int(budget_bytes, "budget_bytes")
    parse_positive_int(entry_bytes, "entry_bytes")
    t_tr = transfer_us(entry_bytes, t_transfer_us)
    score = cluster_scores(freq, sizes, t_base_us=t_base_us, t_transfer_us=t_tr)
    f = np.asarray(freq, np.float64).reshape(-1)
    nbytes = np.asarray(sizes, np.int64).reshape(-1) * int(entry_bytes)
    eligible = f > 0
    if exclude is not None:
        exclude = np.asarray(exclude, bool).reshape(-1)
        if exclude.shape != f.shape:
            raise ShapeError(f"exclude has {exclude.shape[0]} clusters, expected {f.shape[0]}")
        eligible &= ~exclude
    order = np.flatnonzero(eligible)
    order = order[np.argsort(-score[order], kind="stable")]
    hot = np.zeros(f.shape[0], bool)
    left = int(budget_bytes)
    # the longest prefix that fits, then first fit over the rest (a loop over
    # the clusters that did not fit, ending when none of them can)
    cum = np.cumsum(nbytes[order])
    n = int(np.searchsorted(cum, left, side="right"))
    hot[order[:n]] = True
    left -= int(cum[n - 1]) if n else 0
    rest = order[n:]
    smallest = int(nbytes[rest].min()) if rest.size else 0
    for c in rest:
        if left < smallest:
            break
        if nbytes[c] <= left:
            hot[c] = True
            left -= int(nbytes[c])
    return hot
