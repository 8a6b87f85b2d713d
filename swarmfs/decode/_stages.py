"""The decode-time data path, one function per stage (SWARM §5.2, §6.1).

    query -> score -> select -> plan -> submit -> assemble

* :func:`queries` -- a query (or a batch) as float32 [B, H_q, d], checked.
* :func:`score` -- the selector's scores: [B, C] per cluster ([B, S] per
  token for the oracle).
* :func:`select` -- the clusters (and their stored copies) a query reads:
  the one cluster-choice rule (:func:`choose`, in C) after the scores, or the
  selector's fused score-and-choose pass.
* :func:`plan` -- the pure read plan of the copies not in DRAM: union,
  dedup (eq. 8), entry buckets (§6.1), coalescing.
* :func:`submit` -- the plan's reads in one batched submission; each entry is
  placed into K and V as its bytes arrive (no intermediate copy).
* :func:`assemble` -- the DRAM rows (local window, hot clusters) into K and V.

:meth:`~swarmfs.Retriever.retrieve` is these calls in this order (plus the
DRAM residency under the layer lock); the layout's quality evaluation
(``layout._quality``) uses :func:`choose` and :func:`~swarmfs.decode._window.window_size`,
so what it measures is what decoding reads.  Nothing loops in Python per
entry or per request.
"""

from __future__ import annotations

import time
from typing import TypeGuard

import numpy as np

from .. import _errors as errors
from ..store._index import unique_ints
from ..store._kernels import gather_kv, gather_rows, thread_count
from ._selectors import FusedSelector, Selector, _select

__all__ = ["queries", "score", "fuses", "select", "choose", "plan", "merge_positions",
           "submit", "assemble"]


def queries(q, num_kv_heads: int, head_dim: int, *, store=None) -> np.ndarray:
    """Stage 1: one query [H_q, d] or a batch [B, H_q, d] (numpy or torch, any
    float dtype incl. bfloat16) as float32 [B, H_q, d], C-contiguous.

    Raises:
        ShapeError: not a query of this shape (H_q a multiple of
            ``num_kv_heads``, d = ``head_dim``), or not finite; names ``store``.
    """
    if hasattr(q, "detach"):
        q = q.detach().float().cpu().numpy()
    try:
        q = np.asarray(q, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise errors.ShapeError(f"query is not a float array: {exc}", store=store) from None
    if q.ndim == 2:
        q = q[None]
    H, d = int(num_kv_heads), int(head_dim)
    if q.ndim != 3 or q.shape[0] == 0 or q.shape[2] != d or q.shape[1] == 0 or \
            q.shape[1] % H:
        raise errors.ShapeError(f"query shape {q.shape} is not [B >= 1, H_q, {d}] with H_q "
                                f"a multiple of {H}", store=store)
    if not np.isfinite(q).all():
        raise errors.ShapeError("query holds NaN or inf", store=store)
    return np.ascontiguousarray(q)


def score(selector: Selector, layer: int, q: np.ndarray, li=None) -> np.ndarray:
    """Stage 2: the selector's scores of queries ``q`` float32 [B, H_q, d]:
    float32 [B, C] (medoid scores for SWARM, §5.2) or [B, S] for a token
    selector; ``li`` the :class:`~swarmfs.LayerIndex` the caller works on."""
    return selector.scores(layer, q, li)


def choose(scores, members_ptr, members, num_tokens: int, budget: int,
           window: int) -> np.ndarray:
    """The cluster-choice rule on trusted arrays (SWARM §5.2, eq. 8): per
    query, clusters in descending score until the window and the chosen
    clusters hold ``budget`` distinct entries (the last one may overshoot);
    united over a batch.

    Args:
        scores: float [C] or [B, C].
        members_ptr: int64 [C+1] CSR pointers; members: int32/int64 [M]
            token positions in [0, num_tokens).
        num_tokens: S; budget: entries, 0 <= budget <= S; window: tokens of
            the local window (:func:`~swarmfs.decode._window.window_size`).

    Returns:
        int64 [c] cluster ids: best score first for one query, ascending for
        a batch.  (:func:`swarmfs.decode._selectors.select_clusters` is the checked
        public form for one query.)
    """
    scores = np.atleast_2d(scores)
    sel = [_select(s, members_ptr, members, num_tokens, budget, window).clusters
           for s in scores]
    return unique_ints(np.concatenate(sel)) if len(sel) > 1 else sel[0]


def _top_tokens(li, scores: np.ndarray, window: np.ndarray, budget: int) -> np.ndarray:
    """Token selector: exact top-(budget - |window|) over all keys outside the
    window, united over the batch; any copy may serve.  int64 copies."""
    want = budget - window.shape[0]
    sc = scores.copy()
    sc[:, window] = -np.inf
    top = np.argpartition(-sc, want - 1, axis=1)[:, :want] if want > 0 else \
        np.empty((sc.shape[0], 0), np.int64)
    return li.token_copies(unique_ints(top))


def fuses(selector: Selector) -> TypeGuard[FusedSelector]:
    """Whether ``selector`` scores and chooses clusters in one pass (a
    cluster :class:`~swarmfs.decode._selectors.FusedSelector`).  A plain attribute
    test: ``isinstance`` against a runtime-checkable protocol costs ~20 µs,
    too much for every decode step."""
    return selector.kind == "clusters" and callable(getattr(selector, "select", None))


def select(selector: Selector, layer: int, q: np.ndarray, li, *, budget: int,
           window: np.ndarray, scores: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """Stage 3: what queries ``q`` float32 [B, H_q, d] read of layer index
    ``li`` (SWARM §5.2).

    With ``scores`` (stage 2's output), cluster selectors take :func:`choose`
    and the token selector its exact top-k; without, the selector runs its
    fused score-and-choose pass (:class:`~swarmfs.decode._selectors.FusedSelector`,
    SWARM's medoid index: one native call per query, the same clusters).

    Args:
        window: int64 ascending positions of the local window in use.
        budget: entries per query, window included, 1 <= budget <= S.

    Returns:
        (clusters int64 [c], copies int64 [m]): the chosen clusters (empty for
        the token selector) and the stored copies to serve.
    """
    if scores is None:
        if not fuses(selector):
            scores = score(selector, layer, q, li)
        else:
            sel = [x.clusters for x in selector.select(layer, q, budget=budget,
                                                       window=window.shape[0], li=li)]
            clusters = unique_ints(np.concatenate(sel)) if len(sel) > 1 else sel[0]
            return clusters, li.cluster_copies(clusters)
    if selector.kind == "tokens":
        return np.empty(0, dtype=np.int64), _top_tokens(li, scores, window, budget)
    clusters = choose(scores, li.members_ptr, li.members, li.num_tokens, budget,
                      window.shape[0])
    return clusters, li.cluster_copies(clusters)


def plan(store, li, copies: np.ndarray, *, policy: str = "balanced", dedup: bool = True,
         max_gap: int = 0):
    """Stage 4: the pure read plan (:class:`~swarmfs.Plan`) of stored copies
    ``copies`` int64 of layer index ``li``: union and dedup (eq. 8), entry
    buckets (§6.1), coalescing up to ``max_gap`` bytes; ``plan.tokens`` the
    distinct positions it reads, ascending."""
    return store.plan_copies(li, copies, policy=policy, dedup=dedup, max_gap=max_gap)


def merge_positions(dram: np.ndarray, ssd: np.ndarray):
    """Places of two ascending, disjoint position lists in their merge.

    Returns:
        (positions int64 [nd + ns] ascending, places of ``dram`` int64 [nd],
        places of ``ssd`` int64 [ns]) -- by counting, no sort.
    """
    nd, ns = dram.shape[0], ssd.shape[0]
    d_idx = np.arange(nd) + np.searchsorted(ssd, dram)
    s_idx = np.arange(ns) + np.searchsorted(dram, ssd, side="right")
    pos = np.empty(nd + ns, dtype=np.int64)
    pos[d_idx] = dram
    pos[s_idx] = ssd
    return pos, d_idx, s_idx


def assembly_threads(threads, store=None) -> int:
    """Threads that place a retrieval's entries (``Retriever(assembly_threads=)``):
    ``threads`` checked (1 or 2); None is 1.

    Raises:
        InvalidIntegerError: anything but None, 1 or 2 (naming the store).
    """
    if threads is None:
        return 1
    return thread_count(threads, "assembly_threads", store=store)


def submit(store, li, plan, copies: np.ndarray, s_idx: np.ndarray, k: np.ndarray,
           v: np.ndarray, *, threads: int = 1) -> float:
    """Stage 5: read ``plan`` (of ``copies``) in one batched submission,
    checksum-verified, and place plan entry i at index ``s_idx[i]`` of K and V
    [H_kv, n, d] (the C kernel ``gather_kv`` on ``threads`` threads, straight
    from the staging buffer).

    Returns:
        Seconds spent placing entries (assembly inside the read's time).

    Raises:
        ChecksumError, IOFailedError, DiskTruncatedError: the read failed;
        nothing is placed from a failed read.
    """
    placed = [0.0]

    def place(buf, src):
        t = time.perf_counter()
        gather_kv(buf, src, s_idx, k, v, threads=threads)
        placed[0] = time.perf_counter() - t
    store.execute(li, plan, copies, consume=place)
    return placed[0]


def land(store, li, plan, copies: np.ndarray, out, dram: np.ndarray) -> np.ndarray:
    """Stage 5 into an :class:`~swarmfs.EntryBuffer`: read ``plan`` (of
    ``copies``) in one batched submission, checksum-verified, into the rows
    after the ``dram`` positions' (``Store.execute(into=)``: straight from
    the disks when the entries are block multiples).

    Returns:
        int64 [nd + U] the token position of each row: ``dram`` (ascending),
        then the read entries in the order they landed.

    Raises:
        ChecksumError, IOFailedError, DiskTruncatedError: the read failed.
    """
    nd, eb = dram.shape[0], store.entry_bytes
    where = store.execute(li, plan, copies, into=(out._buf, nd * eb))
    pos = np.empty(nd + plan.num_entries, dtype=np.int64)
    pos[:nd] = dram
    pos[(where // np.uint64(eb)).astype(np.int64)] = plan.tokens
    return pos


def copy_rows(pool: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
    """Stage 6 into an EntryBuffer: DRAM pool rows ``slots`` (uint8 [*,
    entry_bytes]) into ``out`` uint8 [len(slots), entry_bytes] (memcpy per
    row, in C)."""
    if slots.size:
        eb = pool.shape[1]
        gather_rows(pool.reshape(-1), slots.astype(np.uint64) * np.uint64(eb), eb, out)


def assemble(pool: np.ndarray, slots: np.ndarray, entry_bytes: int, d_idx: np.ndarray,
             k: np.ndarray, v: np.ndarray, *, threads: int = 1) -> None:
    """Stage 6: rows ``slots`` of the DRAM pool uint8 [*, entry_bytes] (local
    window and hot clusters) into K and V [H_kv, n, d] at indices ``d_idx``
    (the C kernel ``gather_kv`` on ``threads`` threads)."""
    eb = np.uint64(entry_bytes)
    gather_kv(pool.reshape(-1), slots.astype(np.uint64) * eb, d_idx, k, v, threads=threads)
