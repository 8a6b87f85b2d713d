"""Native data kernels (``native/kernels.c``): gather/scatter of entry rows,
XXH3-64 checksums, the §6.1 entry-bucket assignment, and the medoid-scoring
kernels (fp16/bf16 GEMV, per-head logits, softmax sums).

Each wrapper checks its arguments before C touches memory and raises only
:class:`~swarmfs.InvalidArgumentError` for bad ones.
"""

from __future__ import annotations

import os

import numpy as np

from ._errors import InvalidArgumentError
from ._native import ffi, lib

__all__ = ["gather_rows", "scatter_rows", "xxh3_rows", "xxh3_ranges", "verify_rows",
           "assign_buckets", "gemv_half", "head_logits_half", "softmax_sum"]


# -- data kernels (vectorised, in C) --------------------------------------

def gather_rows(src: np.ndarray, src_off: np.ndarray, row: int,
                out: np.ndarray | None = None) -> np.ndarray:
    """Copy ``n`` rows of ``row`` bytes from byte offsets ``src_off`` of the
    uint8 buffer ``src`` into a new (or given) uint8 [n, row] array."""
    src_off = np.ascontiguousarray(src_off, dtype=np.uint64)
    n = src_off.shape[0]
    if out is None:
        out = np.empty((n, row), dtype=np.uint8)
    if n:
        if int(src_off.max()) + row > src.nbytes:
            raise InvalidArgumentError("gather outside the source buffer")
        lib.se_gather_rows(ffi.from_buffer("char[]", out, require_writable=True),
                           ffi.from_buffer("char[]", src),
                           ffi.from_buffer("uint64_t[]", src_off), n, row)
    return out


def scatter_rows(dst: np.ndarray, dst_off: np.ndarray, src: np.ndarray,
                 src_row: np.ndarray, row: int) -> None:
    """``dst[dst_off[i]:+row] = src_rows[src_row[i]]`` for the uint8 buffer
    ``dst`` and the C-contiguous row array ``src`` (rows of ``row`` bytes)."""
    dst_off = np.ascontiguousarray(dst_off, dtype=np.uint64)
    src_row = np.ascontiguousarray(src_row, dtype=np.int64)
    n = dst_off.shape[0]
    if not n:
        return
    if int(dst_off.max()) + row > dst.nbytes or int(src_row.max()) * row + row > src.nbytes:
        raise InvalidArgumentError("scatter outside a buffer")
    lib.se_scatter_rows(ffi.from_buffer("char[]", dst, require_writable=True),
                        ffi.from_buffer("uint64_t[]", dst_off),
                        ffi.from_buffer("char[]", np.ascontiguousarray(src)),
                        ffi.from_buffer("int64_t[]", src_row), n, row)


def xxh3_rows(buf: np.ndarray, row: int) -> np.ndarray:
    """XXH3-64 of each ``row``-byte row of a C-contiguous buffer: uint64 [n]."""
    buf = np.ascontiguousarray(buf)
    n = buf.nbytes // row
    out = np.empty(n, dtype=np.uint64)
    if n:
        lib.se_xxh3_rows(ffi.from_buffer("char[]", buf), n, row,
                         ffi.from_buffer("uint64_t[]", out, require_writable=True))
    return out


def xxh3_ranges(buf: np.ndarray, off: np.ndarray, length: np.ndarray) -> np.ndarray:
    """XXH3-64 of each byte range ``buf[off[i]:off[i]+length[i]]``: uint64 [n]."""
    off = np.ascontiguousarray(off, dtype=np.uint64)
    length = np.ascontiguousarray(length, dtype=np.uint64)
    n = off.shape[0]
    out = np.empty(n, dtype=np.uint64)
    if n:
        if int((off + length).max()) > buf.nbytes:
            raise InvalidArgumentError("checksum range outside the buffer")
        lib.se_xxh3_ranges(ffi.from_buffer("char[]", buf),
                           ffi.from_buffer("uint64_t[]", off),
                           ffi.from_buffer("uint64_t[]", length), n,
                           ffi.from_buffer("uint64_t[]", out, require_writable=True))
    return out


def verify_rows(buf: np.ndarray, off: np.ndarray, row: int,
                expected: np.ndarray) -> np.ndarray:
    """Indices i where XXH3-64(buf[off[i]:+row]) != expected[i] (int64 array)."""
    off = np.ascontiguousarray(off, dtype=np.uint64)
    expected = np.ascontiguousarray(expected, dtype=np.uint64)
    n = off.shape[0]
    if not n:
        return np.empty(0, dtype=np.int64)
    bad = np.empty(min(n, 1024), dtype=np.int64)
    nbad = lib.se_verify_rows(ffi.from_buffer("char[]", buf),
                              ffi.from_buffer("uint64_t[]", off), n, row,
                              ffi.from_buffer("uint64_t[]", expected),
                              ffi.from_buffer("int64_t[]", bad, require_writable=True),
                              bad.shape[0])
    return bad[:min(nbad, bad.shape[0])]


def assign_buckets(ptr: np.ndarray, cdisk: np.ndarray, ndisks: int,
                   load: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Entry-bucket assignment of SWARM §6.1 (see ``se_assign_buckets``).

    Args:
        ptr: int64 [n+1] CSR pointers: entry i may use copies ptr[i]:ptr[i+1].
        cdisk: int32 [m] disk of each copy.
        ndisks: number of disks.
        load: int64 [ndisks] initial bucket sizes (entries), updated in place.

    Returns:
        (choice int64 [n] chosen copy per entry, load int64 [ndisks]).
    """
    ptr = np.ascontiguousarray(ptr, dtype=np.int64)
    cdisk = np.ascontiguousarray(cdisk, dtype=np.int32)
    if load is None:
        load = np.zeros(ndisks, dtype=np.int64)
    n = ptr.shape[0] - 1
    choice = np.empty(n, dtype=np.int64)
    if n > 0:
        lib.se_assign_buckets(n, ffi.from_buffer("int64_t[]", ptr),
                              ffi.from_buffer("int32_t[]", cdisk),
                              ffi.from_buffer("int64_t[]", load, require_writable=True),
                              ndisks,
                              ffi.from_buffer("int64_t[]", choice, require_writable=True))
    return choice, load


def gemv_half(m: np.ndarray, q: np.ndarray, *, bf16: bool, col0: int = 0,
              cols: int | None = None) -> np.ndarray:
    """Scores of float32 queries against fp16/bf16 rows, in C, one thread.

    Args:
        m: C-contiguous [rows, width] fp16 or bf16 (any 2-byte dtype; the bits
            are read).
        q: float32 [B, cols].
        bf16: the rows are bfloat16 (else IEEE fp16).
        col0, cols: use columns ``col0:col0+cols`` of each row (default all),
            e.g. one KV head of a [C, H_kv*d] medoid matrix.

    Returns:
        float32 [B, rows]: ``q @ m[:, col0:col0+cols].T`` accumulated in fp32
        (AVX-512 or AVX2+F16C when the CPU has them).
    """
    if not m.flags.c_contiguous:
        m = np.ascontiguousarray(m)
    q = np.ascontiguousarray(q, dtype=np.float32)
    rows, width = m.shape
    cols = width - col0 if cols is None else int(cols)
    if m.itemsize != 2 or q.ndim != 2 or q.shape[1] != cols or col0 < 0 or \
            col0 + cols > width:
        raise InvalidArgumentError(f"gemv_half: rows {m.shape} {m.dtype} and queries {q.shape} "
                         "do not match")
    out = np.empty((q.shape[0], rows), dtype=np.float32)
    if rows:
        base = ffi.cast("uint16_t *", ffi.from_buffer("uint16_t[]", m.view(np.uint16))) + col0
        ret = lib.se_gemv_half(base, rows, cols, width, 2 if bf16 else 1,
                               ffi.from_buffer("float[]", q), q.shape[0],
                               ffi.from_buffer("float[]", out, require_writable=True))
        if ret < 0:
            raise InvalidArgumentError(f"gemv_half failed: {os.strerror(-ret)}")
    return out


def head_logits_half(m: np.ndarray, q: np.ndarray, num_kv_heads: int, *,
                     bf16: bool) -> np.ndarray:
    """Per-query-head logits against fp16/bf16 rows in one pass over them (C).

    Args:
        m: C-contiguous [rows, H_kv * d] 2-byte floats.
        q: float32 [B, H_q, d]; query head h uses KV head h // (H_q / H_kv).

    Returns:
        float32 [B, H_q, rows] of q_h . m[:, g(h)] (fp32 accumulation).
    """
    if not m.flags.c_contiguous:
        m = np.ascontiguousarray(m)
    q = np.ascontiguousarray(q, dtype=np.float32)
    B, Hq, d = q.shape
    rows = m.shape[0]
    if m.itemsize != 2 or m.shape[1] != num_kv_heads * d or Hq % num_kv_heads:
        raise InvalidArgumentError(f"head_logits: rows {m.shape} and queries {q.shape} do not match "
                         f"{num_kv_heads} KV heads")
    out = np.empty((B, Hq, rows), dtype=np.float32)
    if rows:
        ret = lib.se_head_logits(ffi.from_buffer("uint16_t[]", m.view(np.uint16)), rows,
                                 num_kv_heads, d, 2 if bf16 else 1,
                                 ffi.from_buffer("float[]", q), B, Hq,
                                 ffi.from_buffer("float[]", out, require_writable=True))
        if ret < 0:
            raise InvalidArgumentError(f"head_logits failed: {os.strerror(-ret)}")
    return out


def softmax_sum(x: np.ndarray, scale: float) -> np.ndarray:
    """Sum over rows of softmax(scale * row): float32 [n] for x float32 [nh, n]
    (C, vectorised exp)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    nh, n = x.shape
    out = np.zeros(n, dtype=np.float32)
    if nh and n:
        ret = lib.se_softmax_sum(ffi.from_buffer("float[]", x), nh, n, float(scale),
                                 ffi.from_buffer("float[]", out, require_writable=True))
        if ret < 0:
            raise InvalidArgumentError(f"softmax_sum failed: {os.strerror(-ret)}")
    return out
