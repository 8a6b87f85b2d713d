"""A two-level int8 medoid index: super-centroids over the medoids, per KV head.

SWARM §5.2 scores a query against every cluster's medoid.  At 128K tokens
(Qwen3-32B: 8 KV heads, 64 query heads, d = 128, ~8,800 medoids) that is
72 M multiply-adds per query, ~0.45 ms of AVX512-VNNI on one core
(docs/benchmarks.md §9).  This index does less work per query, as
approximate nearest-neighbour indexes do (IVF): per KV head, the medoid keys
are split into K groups of exactly ``group_size`` medoids (the last one
smaller) by recursive balanced bisection along principal axes (a PCA tree);
equal groups fill whole 16-row blocks of the fine index, so no row is
padding and one coarse logit stands for the same count everywhere; a
query scores the K centroids first, then only the medoids of its best
groups exactly (``se_select_i8x2``).  Groups it skips still count: in each
query head's softmax a skipped group stands as one term, members x
exp(scale x centroid logit) (the centroid's logit is the mean of its
members' logits), so the normaliser covers every medoid and each skipped
medoid gets its group's share.  How many groups are scored follows the
budget: ``coverage`` x (budget / S) of them, so that the scored medoids hold
about ``coverage`` times the entries the budget asks for.

Not in the paper (its index is one level, scored next to a GPU); the
recall it keeps is measured in docs/benchmarks.md §9.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .._errors import InvalidArgumentError
from .._native import ffi, lib
from .._validate import parse_number, parse_positive_int
from ..store._kernels import (
    Int8Index,
    _choice,
    _count_arg,
    _csr_args,
    _i8_fields,
    _native_failure,
    _query,
    pack_medoids_i8,
)

__all__ = ["Int8Index2", "pack_medoids_i8x2", "select_i8x2", "groups_to_score", "check_coverage"]


class Int8Index2(NamedTuple):
    """The two-level index (``pack_medoids_i8x2``).

    Attributes:
        fine: the medoids' int8 index, rows reordered per KV head so that each
            group fills whole blocks of 16 rows: ``Int8Index`` with
            ``rows`` = Crows (a multiple of 16, the largest head's).
        rowmed: int32 [H_kv, Crows] the medoid of each row, -1 for padding.
        coarse: the K group centroids per KV head, as an ``Int8Index``.
        gblk: int32 [H_kv, K + 1] group k's rows are blocks
            [gblk[h, k], gblk[h, k + 1]) of head h.
        glogn: float32 [H_kv, K] log(members of group k) (-inf when empty).
        mgrp: int32 [H_kv, C] the group of each medoid in each head.
        medoids: C.
    """
    fine: Int8Index
    rowmed: np.ndarray
    coarse: Int8Index
    gblk: np.ndarray
    glogn: np.ndarray
    mgrp: np.ndarray
    medoids: int

    @property
    def nbytes(self) -> int:
        """Bytes of both levels' arrays (the DRAM the index holds)."""
        return int(sum(a.nbytes for ix in (self.fine, self.coarse)
                       for a in (ix.data, ix.scales, ix.sums)) + self.rowmed.nbytes
                   + self.gblk.nbytes + self.glogn.nbytes + self.mgrp.nbytes)


def _principal_axis(xs: np.ndarray, iters: int = 6, rows: int = 2048) -> np.ndarray:
    """The first principal axis of centred rows xs float32 [n, d], by power
    iteration from the longest row over at most ``rows`` evenly strided rows
    (deterministic; a few matrix-vector products instead of an
    eigendecomposition per tree node)."""
    if xs.shape[0] > rows:
        xs = xs[::-(-xs.shape[0] // rows)]
    v = xs[int(np.argmax(np.einsum("ij,ij->i", xs, xs)))].copy()
    for _ in range(iters):
        v = xs.T @ (xs @ v)
        nv = float(np.linalg.norm(v))
        if not nv > 0 or not np.isfinite(nv):
            return np.eye(xs.shape[1], 1)[:, 0]
        v /= nv
    return v


def _balanced_groups(x: np.ndarray, group_size: int) -> np.ndarray:
    """Groups of exactly ``group_size`` rows (one last group smaller) of x
    float32 [n, d] by recursive balanced bisection along each part's first
    principal axis (a PCA tree): labels int64 [n], numbered in tree order.
    Deterministic.  Equal groups fill whole 16-row blocks of the fine index
    (no padding) and make one coarse logit stand for the same number of
    medoids everywhere."""
    n = x.shape[0]
    lab = np.zeros(n, np.int64)
    stack = [(np.arange(n), 0)]
    while stack:
        idx, first = stack.pop()
        leaves = -(-idx.shape[0] // group_size)
        if leaves <= 1:
            lab[idx] = first
            continue
        left = group_size * (leaves // 2)               # whole groups on the left
        xs = x[idx] - x[idx].mean(axis=0)
        proj = xs @ _principal_axis(xs)
        order = np.argpartition(proj, left - 1)
        stack.append((idx[order[left:]], first + leaves // 2))
        stack.append((idx[order[:left]], first))
    return lab


def _group_sum(out: np.ndarray, lab: np.ndarray, x: np.ndarray) -> None:
    order = np.argsort(lab, kind="stable")
    ls = lab[order]
    starts = np.flatnonzero(np.r_[True, ls[1:] != ls[:-1]])
    out[ls[starts]] = np.add.reduceat(x[order], starts, axis=0)


def pack_medoids_i8x2(m: np.ndarray, num_kv_heads: int, *, group_size: int = 32,
                      bf16: bool = False) -> Int8Index2:
    """Build the two-level int8 index of a medoid index [C, H_kv*d] (fp16, or
    bf16 as uint16 with ``bf16=True``), made once per layer index as
    ``MedoidSelector(levels=2)`` does: per KV head, the C keys split into
    K = ceil(C / group_size) groups of exactly ``group_size`` (the last one
    smaller) by :func:`_balanced_groups` (deterministic); the
    fine level is :func:`pack_medoids_i8` of the reordered rows (each group
    padded to whole blocks of 16), the coarse level the groups' fp32 mean
    keys, quantised the same way.

    Raises:
        InvalidArgumentError: rows that do not split into ``num_kv_heads``
            heads of a multiple of 4 dimensions, a group size < 1.
    """
    group_size = parse_positive_int(group_size, "group_size")
    m = np.ascontiguousarray(m)
    H = int(num_kv_heads)
    if m.ndim != 2 or m.itemsize != 2 or H < 1 or m.shape[1] % H or (m.shape[1] // H) % 4:
        raise InvalidArgumentError(f"pack_medoids_i8x2: rows {m.shape} {m.dtype} do not split "
                                   f"into {H} heads of a multiple of 4 dimensions")
    C, d = m.shape[0], m.shape[1] // H
    raw = m.view(np.uint16).reshape(C, H, d)
    if bf16:
        xf = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        xf = raw.view(np.float16).astype(np.float32)
    xf = np.nan_to_num(xf, nan=0.0, posinf=65504.0, neginf=-65504.0)
    K = max(1, math.ceil(C / group_size)) if C else 1
    labs, blocks = [], []
    for h in range(H):
        lab = _balanced_groups(xf[:, h], group_size) if C else np.zeros(0, np.int64)
        cnt = np.bincount(lab, minlength=K)
        labs.append((lab, cnt))
        blocks.append((cnt + 15) // 16)
    Crows = 16 * max(int(b.sum()) for b in blocks) if C else 0
    fine = np.zeros((Crows, H, d), np.uint16)
    rowmed = np.full((H, Crows), -1, np.int32)
    gblk = np.zeros((H, K + 1), np.int32)
    glogn = np.full((H, K), -np.inf, np.float32)
    cent = np.zeros((K, H, d), np.float32)
    mgrp = np.zeros((H, C), np.int32)
    for h, ((lab, cnt), nb) in enumerate(zip(labs, blocks, strict=True)):
        np.cumsum(nb, out=gblk[h, 1:])
        glogn[h, cnt > 0] = np.log(cnt[cnt > 0])
        if not C:
            continue
        mgrp[h] = lab
        order = np.argsort(lab, kind="stable")
        ls = lab[order]
        first = np.searchsorted(ls, np.arange(K))          # each group's first in order
        row = gblk[h, ls].astype(np.int64) * 16 + (np.arange(C) - first[ls])
        fine[row, h] = raw[order, h]
        rowmed[h, row] = order
        sums = np.zeros((K, d), np.float32)
        _group_sum(sums, lab, xf[:, h])
        cent[cnt > 0, h] = sums[cnt > 0] / cnt[cnt > 0, None]
    fine_ix = pack_medoids_i8(fine.reshape(Crows, H * d).view(np.float16), H, bf16=bf16)
    coarse_ix = pack_medoids_i8(np.clip(cent, -65504, 65504).astype(np.float16)
                                .reshape(K, H * d), H)
    return Int8Index2(fine_ix, rowmed, coarse_ix, gblk, glogn, mgrp, C)


def groups_to_score(ix: Int8Index2, budget: int, num_tokens: int, coverage: float) -> int:
    """Groups scored exactly per KV head: ceil(K x min(1, coverage x budget /
    S)), at least 1 (all of them when the budget is the whole context)."""
    K = ix.gblk.shape[1] - 1
    if num_tokens <= 0 or budget >= num_tokens:
        return K
    return max(1, min(K, math.ceil(K * coverage * budget / num_tokens)))


def check_coverage(coverage, what: str = "coverage") -> float:
    """The two-level index's ``coverage`` checked: a finite number > 0.

    Raises:
        InvalidNumberError: anything else, naming ``what``.
    """
    return parse_number(coverage, what, 0, lo_open=True)


def select_i8x2(ix: Int8Index2, q: np.ndarray, num_kv_heads: int, *, scale: float,
                ptr=None, members=None, num_tokens: int = 0, budget: int = 0,
                window: int = 0, coverage: float = 3.0, ngroups: int | None = None,
                check: bool = True):
    """The "prob" score (each query head's softmax over the medoids, summed
    over heads) from the two-level index, then the cluster choice of
    ``choose_clusters``, in one native call (``se_select_i8x2``).

    Args:
        ix: :func:`pack_medoids_i8x2`'s index.
        q: float32 [H_q, d] one query.
        scale: softmax scale (1/sqrt(d)).
        ptr, members: the cluster table (int64 [C+1], int32 members); None
            returns the scores only.
        coverage: groups scored exactly per head, as a multiple of the
            budget's share of the context (:func:`groups_to_score`);
            ``ngroups`` overrides it.

    Returns:
        (int64 [c] cluster ids best first, distinct entries), or with
        ``ptr=None`` the scores float32 [C].

    Raises:
        InvalidArgumentError: shapes that do not match, a bad cluster table.
    """
    if not isinstance(ix, Int8Index2):
        raise InvalidArgumentError(f"select_i8x2: index must be an Int8Index2, got {type(ix)}")
    H = int(num_kv_heads)
    q = np.ascontiguousarray(q, dtype=np.float32)
    C = int(ix.medoids)
    fine, coarse = ix.fine, ix.coarse
    K = ix.gblk.shape[1] - 1
    if (q.ndim != 2 or H < 1 or q.shape[0] % H or q.shape[1] % 4
            or fine.data.shape[0] != H or fine.data.shape[2] != q.shape[1] // 4
            or coarse.data.shape[0] != H or ix.rowmed.shape != (H, fine.rows)
            or ix.gblk.shape != (H, K + 1) or ix.glogn.shape != (H, K)
            or ix.mgrp.shape != (H, C)):
        raise InvalidArgumentError(f"select_i8x2: query {q.shape} does not fit the index "
                                   f"({H} KV heads, {C} medoids)")
    if not float(scale) > 0:
        raise InvalidArgumentError(f"select_i8x2: scale {scale} must be positive")
    budget = _count_arg(budget, "select_i8x2: budget")
    window = _count_arg(window, "select_i8x2: window")
    num_tokens = _count_arg(num_tokens, "select_i8x2: num_tokens")
    coverage = check_coverage(coverage, "select_i8x2 coverage")
    if ngroups is None:
        ngroups = groups_to_score(ix, budget, num_tokens, coverage) if ptr is not None else K
    ngroups = min(_count_arg(ngroups, "select_i8x2: ngroups"), K)
    score = np.empty(max(C, 1), np.float32)
    out = np.empty(max(C, 1), np.int64)
    w = ffi.from_buffer
    ch = ffi.NULL                                      # scores only
    if ptr is not None:
        ptr, members = _csr_args(C, ptr, members, num_tokens, check)
        ch = _choice(ptr, members, num_tokens, int(budget), int(window), out)
    cix = ffi.new("se_i8x2_index *", {
        "fine": _i8_fields(fine, fine.rows), "rowmed": w("int32_t[]", ix.rowmed),
        "coarse": _i8_fields(coarse, K), "gblk": w("int32_t[]", ix.gblk),
        "glogn": w("float[]", ix.glogn), "mgrp": w("int32_t[]", ix.mgrp), "C": C})
    n = lib.se_select_i8x2(cix, _query(q, H, float(scale)), int(ngroups),
                           w("float[]", score, require_writable=True), ch)
    if n < 0:
        _native_failure("select_i8x2", n)
    if ptr is None:
        return score[:C].copy()
    return out[:n].copy(), int(ch.entries)
