"""Native data kernels (``native/``: data.c, scoring.c, index_i8.c, select.c,
gather.c): gather/scatter of entry rows, XXH3-64 checksums, the §6.1
entry-bucket assignment, the medoid-scoring kernels (fp16/bf16 GEMV,
per-head logits, softmax sums) and the cluster choice, alone or fused with
the scoring.  The scoring kernels have AVX-512, AVX2 + FMA + F16C, NEON
(aarch64) and scalar paths, chosen at run time from the CPU's features;
:func:`set_kernel_path` (or ``SWARMFS_KERNEL_PATH``) forces one.

Each wrapper checks its arguments before C touches memory and raises only
:class:`~swarmfs.InvalidArgumentError` for bad ones.
"""

from __future__ import annotations

import math
import operator
import os
from typing import NamedTuple, NoReturn

import numpy as np

from .._errors import InvalidArgumentError, boundary
from .._native import ffi, lib
from .._validate import parse_int

__all__ = ["gather_rows", "scatter_rows", "xxh3_rows", "xxh3_ranges", "verify_rows",
           "assign_buckets", "gemv_half", "head_logits_half", "softmax_sum",
           "choose_clusters", "select_fused", "pack_medoids", "gather_kv", "gather_kv_mode",
           "kv_rows",
           "empty_aligned",
           "kernel_path",
           "thread_count",
           "set_kernel_path", "supported_paths", "cpu_flags", "KERNEL_PATHS"]


# -- argument checks (before C touches memory) ---------------------------------

def _fail(msg: str) -> NoReturn:
    raise InvalidArgumentError(msg)


def _arr(x, what: str, *, writable: bool = False) -> np.ndarray:
    """A C-contiguous numpy array (``writable`` when C writes into it)."""
    if not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except (TypeError, ValueError, RuntimeError) as exc:   # RuntimeError: torch grads
            _fail(f"{what} is not an array: {exc}")
    if x.dtype.hasobject:              # C reads and writes raw bytes: never object pointers
        _fail(f"{what} holds Python objects ({x.dtype}), not numbers")
    if not x.flags.c_contiguous:
        if writable:
            _fail(f"{what} must be C-contiguous")
        x = np.ascontiguousarray(x)
    if writable and not x.flags.writeable:
        _fail(f"{what} is read-only")
    return x


def _row_strided(x, what: str) -> np.ndarray:
    """A 2-D array whose rows are contiguous and lie a positive whole number
    of items apart, at least a row long (copied to C order otherwise): what
    a kernel taking a leading dimension reads in place.  The caller keeps
    it alive while C reads it."""
    if not isinstance(x, np.ndarray) or x.dtype.hasobject:
        return _arr(x, what)                 # converts, or refuses object arrays
    it = x.itemsize
    if x.ndim != 2 or x.shape[1] == 0 or x.strides[1] != it or x.strides[0] % it or \
            x.strides[0] < x.shape[1] * it:
        x = np.ascontiguousarray(x)
    return x


def _vec(x, dtype, what: str) -> np.ndarray:
    """A 1-D integer array as ``dtype`` (refusing floats, bools and negatives
    for unsigned types)."""
    a = np.asarray(x)
    if a.size == 0:
        return np.empty(0, dtype=dtype)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        _fail(f"{what} must be a 1-D integer array, got {a.dtype} {a.shape}")
    if np.dtype(dtype).kind == "u" and a.dtype.kind == "i" and a.min() < 0:
        _fail(f"{what} holds a negative value")
    return np.ascontiguousarray(a, dtype=dtype)


def _pair(a, ta, name_a: str, b, tb, name_b: str, where: str = ""):
    """Two vectors (:func:`_vec`) of one length, or InvalidArgumentError
    naming both lengths."""
    a, b = _vec(a, ta, name_a), _vec(b, tb, name_b)
    if a.shape[0] != b.shape[0]:
        _fail(f"{where}{name_a} has {a.shape[0]} values but {name_b} has {b.shape[0]}")
    return a, b


def _floats(x, what: str) -> np.ndarray:
    """A C-contiguous float32 array."""
    try:
        return np.ascontiguousarray(x, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        _fail(f"{what} is not a float array: {exc}")


def _native_failure(what: str, ret: int):
    import errno
    if -ret == errno.EINVAL:
        _fail(f"{what}: {os.strerror(-ret)}")
    from .._errors import InternalError
    raise InternalError(f"{what} failed: {os.strerror(-ret)}")


def _pos(x, what: str) -> int:
    import numbers
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or int(x) <= 0:
        _fail(f"{what} must be a positive integer, got {x!r}")
    return int(x)


# -- data kernels (vectorised, in C) --------------------------------------

def gather_rows(src: np.ndarray, src_off: np.ndarray, row: int,
                out: np.ndarray | None = None) -> np.ndarray:
    """Copy ``n`` rows of ``row`` bytes from byte offsets ``src_off`` of the
    uint8 buffer ``src`` into a new (or given) uint8 [n, row] array.

    Raises:
        InvalidArgumentError: a row outside ``src`` or an ``out`` that does
            not hold n rows.
    """
    row = _pos(row, "row")
    src = _arr(src, "src")
    src_off = _vec(src_off, np.uint64, "src_off")
    n = src_off.shape[0]
    if out is None:
        out = np.empty((n, row), dtype=np.uint8)
    else:
        out = _arr(out, "out", writable=True)
        if out.nbytes != n * row:
            _fail(f"out holds {out.nbytes} bytes, not {n} rows of {row}")
    if n:
        if int(src_off.max()) + row > src.nbytes:
            _fail("gather outside the source buffer")
        lib.se_gather_rows(ffi.from_buffer("char[]", out, require_writable=True),
                           ffi.from_buffer("char[]", src),
                           ffi.from_buffer("uint64_t[]", src_off), n, row)
    return out


def scatter_rows(dst: np.ndarray, dst_off: np.ndarray, src: np.ndarray,
                 src_row: np.ndarray, row: int) -> None:
    """``dst[dst_off[i]:+row] = src_rows[src_row[i]]`` for the uint8 buffer
    ``dst`` and the C-contiguous row array ``src`` (rows of ``row`` bytes).

    Raises:
        InvalidArgumentError: a row outside a buffer, arrays of different
            lengths, or a buffer of Python objects.
    """
    row = _pos(row, "row")
    dst = _arr(dst, "dst", writable=True)
    src = _arr(src, "src")
    dst_off, src_row = _pair(dst_off, np.uint64, "dst_off", src_row, np.int64, "src_row")
    n = dst_off.shape[0]
    if not n:
        return
    if int(dst_off.max()) + row > dst.nbytes or src_row.min() < 0 or \
            int(src_row.max()) * row + row > src.nbytes:
        _fail("scatter outside a buffer")
    lib.se_scatter_rows(ffi.from_buffer("char[]", dst, require_writable=True),
                        ffi.from_buffer("uint64_t[]", dst_off),
                        ffi.from_buffer("char[]", src),
                        ffi.from_buffer("int64_t[]", src_row), n, row)


def _kv_pair(k, v, where: str) -> None:
    """K and V as the assembly kernels take them: [H, n, d] numpy arrays of
    one shape and one 2- or 4-byte dtype (the rule of gather_kv, kv_rows and
    gather_kv_mode)."""
    if not (isinstance(k, np.ndarray) and isinstance(v, np.ndarray)) or k.ndim != 3 or \
            v.ndim != 3:
        _fail(f"{where}: k and v must be [H, n, d] arrays of 2- or 4-byte numbers")
    if k.shape != v.shape or k.dtype != v.dtype:
        _fail(f"{where}: k {k.shape} {k.dtype} and v {v.shape} {v.dtype} differ")
    if k.dtype.hasobject or k.itemsize not in (2, 4):
        _fail(f"{where}: K and V must hold 2- or 4-byte numbers, got {k.dtype}")


def gather_kv(src: np.ndarray, src_off: np.ndarray, dst_idx: np.ndarray, k: np.ndarray,
              v: np.ndarray, *, threads: int = 1) -> bool:
    """Write entries straight into K and V: entry i (its K heads then its V
    heads, as stored) at byte ``src_off[i]`` of ``src`` goes to
    ``k[:, dst_idx[i]]`` and ``v[:, dst_idx[i]]`` (in C, no intermediate copy).

    Args:
        src: uint8 buffer (staging buffer or DRAM pool).
        src_off: uint64 [n] byte offsets of the entries.
        dst_idx: int64 [n] output columns in [0, n_total).
        k, v: C-contiguous writable [H, n_total, d] arrays of one 2- or 4-byte
            dtype (entry bytes = 2 * H * d * itemsize).
        threads: 1 or 2.  With 2, a call that writes at least 4 MiB places
            the second half of its entries on a second thread started for
            the call and joined before it returns (both cores for one step's
            assembly, issue 10): at 4-54 MB 0.6-0.8x the one-thread time on a
            2-core VM; below 4 MiB the thread's start costs more than it
            saves, so such calls stay on one thread, as do calls whose
            ``dst_idx`` repeats a column (where the later entry wins).

    Returns:
        True if the call was split over two threads.

    A call that writes at least 16 MiB, with rows (d * itemsize) a multiple
    of 64 bytes and 64-byte aligned K and V, stores around the cache
    (non-temporal stores of whole lines, AVX-512 or AVX2 path;
    :func:`gather_kv_mode`; torch CPU tensors and :func:`empty_aligned` are
    aligned, plain ``np.empty`` arrays usually are not), which spares the
    read-for-ownership of each output line: at 54 MB the gather takes 0.6x
    the time and, with the read that consumes K and V, 0.84x
    (docs/benchmarks.md section 9).  The bytes written are the same.

    Concurrency: calls may run at the same time on different outputs; two
    calls writing one output at once are the caller's race (a split call's
    two threads write disjoint columns: it splits only when ``dst_idx``
    holds no repeats).

    Raises:
        InvalidArgumentError: shapes, bounds or dtypes that do not fit
            (object arrays included), K and V that overlap, or threads not
            1 or 2.
    """
    threads = thread_count(threads, "gather_kv threads")
    k = _arr(k, "k", writable=True)
    v = _arr(v, "v", writable=True)
    src = _arr(src, "src")
    _kv_pair(k, v, "gather_kv")
    if np.may_share_memory(k, v):            # C-contiguous: the byte ranges decide
        _fail("gather_kv: k and v share memory (V would overwrite K)")
    H, nt, d = k.shape
    db = d * k.itemsize
    src_off, dst_idx = _pair(src_off, np.uint64, "src_off", dst_idx, np.int64, "dst_idx",
                             "gather_kv: ")
    n = src_off.shape[0]
    if not n:
        return False
    if int(src_off.max()) + 2 * H * db > src.nbytes or dst_idx.min() < 0 or \
            dst_idx.max() >= nt:
        _fail("gather_kv: an entry outside the source or the output")
    return bool(lib.se_gather_kv(ffi.from_buffer("char[]", src),
                                 ffi.from_buffer("uint64_t[]", src_off), n, H, db,
                                 ffi.from_buffer("int64_t[]", dst_idx), nt,
                                 ffi.from_buffer("char[]", k, require_writable=True),
                                 ffi.from_buffer("char[]", v, require_writable=True), threads))



def kv_rows(k: np.ndarray, v: np.ndarray, idx) -> np.ndarray:
    """Columns ``idx`` of K and V as stored entry rows, the inverse of
    :func:`gather_kv`, in one pass in C: row i is K[:, idx[i]] of every head,
    then V[:, idx[i]].

    Args:
        k, v: [H, n, d] arrays of one 2- or 4-byte dtype whose rows are
            contiguous (each head's [n, d] block may sit inside a larger
            buffer, e.g. ``kb[:, :n]`` of a reused output).
        idx: int [m] columns in [0, n).

    Returns:
        uint8 [m, 2 * H * d * itemsize], a new array.

    Raises:
        InvalidArgumentError: shapes or dtypes that do not match, rows that
            are not contiguous, or a column outside [0, n).
    """
    _kv_pair(k, v, "kv_rows")
    H, n, d = k.shape
    db = d * k.itemsize
    for name, x in (("k", k), ("v", v)):
        if x.size and (x.strides[2] != x.itemsize or x.strides[1] != db or x.strides[0] < 0):
            _fail(f"kv_rows: {name}'s rows are not contiguous (strides {x.strides})")
    idx = _vec(idx, np.int64, "kv_rows: idx")
    m = idx.shape[0]
    out = np.empty((m, 2 * H * db), dtype=np.uint8)
    if m == 0:
        return out
    if idx.min() < 0 or idx.max() >= n:
        _fail(f"kv_rows: a column outside [0, {n})")
    lib.se_kv_rows(ffi.cast("char *", k.ctypes.data), ffi.cast("char *", v.ctypes.data), H, db,
                   k.strides[0], v.strides[0], ffi.from_buffer("int64_t[]", idx), m,
                   ffi.from_buffer("char[]", out, require_writable=True))
    return out

@boundary
def empty_aligned(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``align``-byte
    boundary (numpy's own allocations are only 16-byte aligned), so that
    :func:`gather_kv` can store whole cache lines into it.  Thread-safe.

    Raises:
        InvalidArgumentError: a shape that is not non-negative integers, an
            unknown dtype, an align that is not a power of two, or more
            memory than can be had."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        _fail(f"empty_aligned: unknown dtype {dtype!r}")
    dims = tuple(shape) if np.iterable(shape) else (shape,)
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0
               for x in dims):
        _fail(f"empty_aligned: shape {shape!r} must be non-negative integers")
    if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or align <= 0 \
            or align & (align - 1):
        _fail(f"empty_aligned: align {align!r} must be a power of two")
    shape = tuple(int(x) for x in dims)
    nbytes = math.prod(shape) * dt.itemsize                 # Python ints: no overflow
    if nbytes > 1 << 62:
        _fail(f"empty_aligned: {nbytes} bytes is more than any memory")
    raw = np.empty(nbytes + align, np.uint8)
    at = (-raw.ctypes.data) % align
    return raw[at:at + nbytes].view(dt).reshape(shape)


def gather_kv_mode(k: np.ndarray, v: np.ndarray, n: int) -> str:
    """How :func:`gather_kv` stores ``n`` entries into these K and V on the
    current kernel path: ``"stream512"`` or ``"stream256"`` (non-temporal
    stores of whole 64-byte lines) or ``"copy"`` (memcpy).

    Raises:
        InvalidArgumentError: K and V are not [H, n_total, d] arrays of one
            shape and dtype, or n is not a count."""
    _kv_pair(k, v, "gather_kv_mode")
    n = _count_arg(n, "gather_kv_mode: n")
    H, _, d = k.shape
    if n * 2 * H * d * k.itemsize >= 1 << 63:               # Python ints: no overflow
        _fail(f"gather_kv_mode: {n} entries of {2 * H * d * k.itemsize} bytes is more than "
              "any memory")
    mode = lib.se_gather_kv_mode(d * k.itemsize, int(n), H, ffi.cast("char *", k.ctypes.data),
                                 ffi.cast("char *", v.ctypes.data))
    return ("copy", "stream256", "stream512")[int(mode)]


def xxh3_rows(buf: np.ndarray, row: int) -> np.ndarray:
    """XXH3-64 of each ``row``-byte row of a C-contiguous buffer: uint64 [n]."""
    row = _pos(row, "row")
    buf = _arr(buf, "buf")
    n = buf.nbytes // row
    out = np.empty(n, dtype=np.uint64)
    if n:
        lib.se_xxh3_rows(ffi.from_buffer("char[]", buf), n, row,
                         ffi.from_buffer("uint64_t[]", out, require_writable=True))
    return out


def xxh3_ranges(buf: np.ndarray, off: np.ndarray, length: np.ndarray) -> np.ndarray:
    """XXH3-64 of each byte range ``buf[off[i]:off[i]+length[i]]``: uint64 [n]."""
    buf = _arr(buf, "buf")
    off = _vec(off, np.uint64, "off")
    length = _vec(length, np.uint64, "length")
    n = off.shape[0]
    if length.shape[0] != n:
        _fail(f"{n} offsets but {length.shape[0]} lengths")
    out = np.empty(n, dtype=np.uint64)
    if n:
        if int((off + length).max()) > buf.nbytes or (off + length < off).any():
            _fail("checksum range outside the buffer")
        lib.se_xxh3_ranges(ffi.from_buffer("char[]", buf),
                           ffi.from_buffer("uint64_t[]", off),
                           ffi.from_buffer("uint64_t[]", length), n,
                           ffi.from_buffer("uint64_t[]", out, require_writable=True))
    return out


def verify_rows(buf: np.ndarray, off: np.ndarray, row: int,
                expected: np.ndarray) -> np.ndarray:
    """Indices i where XXH3-64(buf[off[i]:+row]) != expected[i] (int64 array).

    Raises:
        InvalidArgumentError: a row outside ``buf`` or ``expected`` of
            another length.
    """
    row = _pos(row, "row")
    buf = _arr(buf, "buf")
    off = _vec(off, np.uint64, "off")
    expected = _vec(expected, np.uint64, "expected") if np.asarray(expected).dtype.kind != "u" \
        else np.ascontiguousarray(expected, dtype=np.uint64).reshape(-1)
    n = off.shape[0]
    if expected.shape[0] != n:
        _fail(f"{n} rows but {expected.shape[0]} checksums")
    if not n:
        return np.empty(0, dtype=np.int64)
    if int(off.max()) + row > buf.nbytes:
        _fail("verify outside the buffer")
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
    ndisks = _pos(ndisks, "ndisks")
    ptr = _vec(ptr, np.int64, "ptr")
    cdisk = _vec(cdisk, np.int32, "cdisk")
    if load is None:
        load = np.zeros(ndisks, dtype=np.int64)
    elif not isinstance(load, np.ndarray) or load.dtype != np.int64 or \
            load.shape != (ndisks,) or not load.flags.c_contiguous or not load.flags.writeable:
        _fail(f"load must be a writable int64 [{ndisks}] array")
    n = ptr.shape[0] - 1
    if n < 0 or ptr[0] != 0 or ptr[-1] != cdisk.shape[0] or (np.diff(ptr) < 1).any():
        _fail("ptr must start at 0, grow by at least 1 and end at len(cdisk)")
    if cdisk.size and (cdisk.min() < 0 or cdisk.max() >= ndisks):
        _fail(f"a copy's disk is outside [0, {ndisks})")
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
    m = _arr(m, "m")
    q = _floats(q, "q")
    if m.ndim != 2 or m.itemsize != 2:
        _fail(f"gemv_half: rows must be 2-D 2-byte floats, got {m.shape} {m.dtype}")
    rows, width = m.shape
    cols = width - col0 if cols is None else int(cols)
    if q.ndim != 2 or q.shape[1] != cols or col0 < 0 or col0 + cols > width:
        _fail(f"gemv_half: rows {m.shape} {m.dtype} and queries {q.shape} do not match")
    out = np.empty((q.shape[0], rows), dtype=np.float32)
    if rows:
        base = ffi.cast("uint16_t *", ffi.from_buffer("uint16_t[]", m.view(np.uint16))) + col0
        ret = lib.se_gemv_half(base, rows, cols, width, 2 if bf16 else 1,
                               ffi.from_buffer("float[]", q), q.shape[0],
                               ffi.from_buffer("float[]", out, require_writable=True))
        if ret < 0:
            _native_failure("gemv_half", ret)
    return out


def head_logits_half(m: np.ndarray, q: np.ndarray, num_kv_heads: int, *,
                     bf16: bool) -> np.ndarray:
    """Per-query-head logits against fp16/bf16 rows in one pass over them (C).

    Args:
        m: [rows, H_kv * d] 2-byte floats, each row contiguous; the rows may
            lie a fixed stride apart (e.g. the K halves of stored entry rows,
            uint8 [n, entry_bytes] viewed as 2-byte floats), read in place.
        q: float32 [B, H_q, d]; query head h uses KV head h // (H_q / H_kv).

    Returns:
        float32 [B, H_q, rows] of q_h . m[:, g(h)] (fp32 accumulation).
    """
    m = _row_strided(m, "m")
    q = _floats(q, "q")
    num_kv_heads = _pos(num_kv_heads, "num_kv_heads")
    if m.ndim != 2 or m.itemsize != 2 or q.ndim != 3 or \
            m.shape[1] != num_kv_heads * q.shape[2] or q.shape[1] % num_kv_heads:
        _fail(f"head_logits: rows {m.shape} {m.dtype} and queries {q.shape} do not match "
              f"{num_kv_heads} KV heads")
    B, Hq, d = q.shape
    rows = m.shape[0]
    out = np.empty((B, Hq, rows), dtype=np.float32)
    if rows:
        ld = m.strides[0] // 2
        ret = lib.se_head_logits(ffi.cast("uint16_t *", m.ctypes.data), rows, ld,
                                 num_kv_heads, d, 2 if bf16 else 1,
                                 ffi.from_buffer("float[]", q), B, Hq,
                                 ffi.from_buffer("float[]", out, require_writable=True))
        if ret < 0:
            _native_failure("head_logits", ret)
    return out


def softmax_sum(x: np.ndarray, scale: float) -> np.ndarray:
    """Sum over rows of softmax(scale * row): float32 [n] for x float32 [nh, n]
    (C, vectorised exp).

    Raises:
        InvalidArgumentError: x not 2-D or not finite (the vector paths and
            the scalar one would treat NaN and inf differently), or scale
            not a number.
    """
    x = _floats(x, "x")
    if x.ndim != 2:
        _fail(f"softmax_sum: x must be 2-D, got {x.shape}")
    if not np.isfinite(x).all():
        _fail("softmax_sum: x holds NaN or inf")
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        _fail(f"softmax_sum: scale {scale!r} is not a number")
    nh, n = x.shape
    out = np.zeros(n, dtype=np.float32)
    if nh and n:
        ret = lib.se_softmax_sum(ffi.from_buffer("float[]", x), nh, n, scale,
                                 ffi.from_buffer("float[]", out, require_writable=True))
        if ret < 0:
            _native_failure("softmax_sum", ret)
    return out


# -- kernel paths (run-time CPU dispatch) ------------------------------------------

#: Scoring-kernel paths by name (``native/engine.h`` SE_PATH_*).
KERNEL_PATHS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3, "neon": 4}
_PATH_NAMES = {v: k for k, v in KERNEL_PATHS.items()}


def kernel_path() -> str:
    """The path the scoring kernels use now: ``"avx512"`` (AVX-512F/DQ),
    ``"avx2"`` (AVX2 + FMA + F16C), ``"neon"`` (aarch64) or ``"scalar"``."""
    return _PATH_NAMES[int(lib.se_kernel_path())]


def supported_paths() -> list[str]:
    """Every path this CPU and build can run (the scalar reference first)."""
    return [name for name in ("scalar", "avx2", "avx512", "neon")
            if lib.se_kernel_path_supported(KERNEL_PATHS[name])]


def set_kernel_path(name: str) -> str:
    """Force a scoring-kernel path (process-wide, for benchmarks and tests:
    calls already running keep the path they started with), or ``"auto"``
    for the best this CPU has.  ``SWARMFS_KERNEL_PATH=avx2``
    (etc.) does the same at import.

    Returns:
        The path now used.

    Raises:
        InvalidArgumentError: an unknown name, or a path this CPU lacks.
    """
    code = KERNEL_PATHS.get(name) if isinstance(name, str) else None
    if code is None:
        _fail(f"unknown kernel path {name!r}; use one of {sorted(KERNEL_PATHS)}")
    ret = lib.se_set_kernel_path(code)
    if ret < 0:
        _fail(f"this CPU cannot run the {name} kernel path (supported: "
              f"{', '.join(supported_paths())})")
    return _PATH_NAMES[int(ret)]


def cpu_flags() -> list[str]:
    """The SIMD features of this CPU that the kernels care about (from
    /proc/cpuinfo; empty where it is unreadable)."""
    want = ("avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
            "avx512_fp16", "avx2", "fma", "f16c", "asimd", "fphp", "asimdhp", "sve")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in want if x in have]
    except OSError:
        pass
    return []


if os.environ.get("SWARMFS_KERNEL_PATH"):
    try:
        set_kernel_path(os.environ["SWARMFS_KERNEL_PATH"])
    except InvalidArgumentError as _exc:   # a bad variable must not break `import swarmfs`
        import warnings
        warnings.warn(f"SWARMFS_KERNEL_PATH ignored: {_exc}; using {kernel_path()}",
                      stacklevel=2)


# -- cluster choice (SWARM §5.2, eq. 8) --------------------------------------------

def _check_csr(C: int, ptr: np.ndarray, members: np.ndarray, num_tokens: int,
               full: bool) -> None:
    """The cluster table fits the scores (and, with ``full``, every member
    is a token of the context: O(M))."""
    if ptr.shape != (C + 1,) or (C >= 0 and ptr.shape[0] and
                                 (ptr[0] != 0 or ptr[-1] != members.shape[0])):
        _fail(f"{ptr.shape[0]} cluster pointers covering {members.shape[0]} members do "
              f"not fit {C} clusters")
    if int(num_tokens) < 0 or int(num_tokens) >= 2**31:
        _fail(f"num_tokens {num_tokens} outside [0, 2**31)")
    if full and np.any(np.diff(ptr) < 0):
        _fail("cluster pointers are not in order (they must start at 0, never decrease "
              "and end at the member count)")
    if full and members.size and (members.min() < 0 or members.max() >= num_tokens):
        _fail("a cluster member is outside the context")


def _csr_args(C: int, ptr, members, num_tokens: int, check: bool):
    """The cluster table as the C kernels take it: (int64 ptr, int32
    members), checked by :func:`_check_csr`; with ``check`` the members'
    range is checked before they are narrowed to int32 (2**32 + 1 would
    become 1)."""
    members = np.asarray(members)
    if check and members.size and (members.dtype.kind not in "iu" or members.min() < 0 or
                                   members.max() >= min(int(num_tokens), 2**31)):
        _fail("a cluster member is outside the context")
    ptr = np.ascontiguousarray(ptr, dtype=np.int64)
    members = np.ascontiguousarray(members, dtype=np.int32)
    _check_csr(C, ptr, members, num_tokens, check)
    return ptr, members


def _count_arg(x, what: str) -> int:
    """An entry count (budget, window) for the C kernels: a non-negative
    integer, capped at 2**62 (any count above the context means the whole
    context)."""
    try:
        v = operator.index(x)
    except TypeError:
        _fail(f"{what} must be an integer, got {x!r}")
    if v < 0:
        _fail(f"{what} must be >= 0, got {v}")
    return min(v, 1 << 62)


# -- the structs of the scoring and selection calls (engine.h) -------------------
# Each holds pointers into numpy arrays that the caller keeps alive for the call.

def _query(q: np.ndarray, num_kv_heads: int, scale: float = 0.0):
    """``se_query *`` of one C-contiguous float32 query [H_q, d]."""
    return ffi.new("se_query *", {"q": ffi.from_buffer("float[]", q), "Hq": q.shape[0],
                                  "H": num_kv_heads, "d": q.shape[1], "scale": scale})


def _choice(ptr: np.ndarray, members: np.ndarray, num_tokens: int, budget: int,
            window: int, out: np.ndarray):
    """``se_choice *`` of a cluster table (:func:`_csr_args`), the chosen ids
    to ``out`` (the distinct entries come back in its ``entries``)."""
    return ffi.new("se_choice *", {"ptr": ffi.from_buffer("int64_t[]", ptr),
                                   "members": ffi.from_buffer("int32_t[]", members),
                                   "S": int(num_tokens), "budget": budget, "w": window,
                                   "out": ffi.from_buffer("int64_t[]", out,
                                                          require_writable=True)})


def _i8_fields(ix, rows: int) -> dict:
    """The ``se_i8_index`` fields of an :class:`Int8Index` (``rows`` per head)."""
    return {"data": ffi.from_buffer("int8_t[]", ix.data),
            "scales": ffi.from_buffer("float[]", ix.scales),
            "sums": ffi.from_buffer("int32_t[]", ix.sums), "rows": rows}


def choose_clusters(scores: np.ndarray, ptr: np.ndarray, members: np.ndarray, *,
                    num_tokens: int, budget: int, window: int,
                    check: bool = True) -> tuple[np.ndarray, int]:
    """Clusters by descending score until window + clusters hold ``budget``
    distinct entries, in C (``se_choose_clusters``; the rule is documented at
    :func:`swarmfs.decode._selectors.select_clusters`, which checks the arguments).
    Scores are compared as float32.  ``check=False`` skips the O(M) check
    of the members (for an index that was checked when it was loaded).

    Returns:
        (int64 [c] cluster ids best first, distinct entries).
    """
    sc = np.ascontiguousarray(scores, dtype=np.float32)
    C = sc.shape[0]
    ptr, members = _csr_args(C, ptr, members, num_tokens, check)
    out = np.empty(max(C, 1), dtype=np.int64)
    ch = _choice(ptr, members, num_tokens, _count_arg(budget, "budget"),
                 _count_arg(window, "window"), out)
    n = lib.se_choose_clusters(ffi.from_buffer("float[]", sc), C, ch)
    if n < 0:
        _native_failure("choose_clusters", n)
    return out[:n].copy(), int(ch.entries)


def pack_medoids(m: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """The medoid index [C, H_kv*d] (2-byte floats) in the layout the
    AVX-512/AVX2 "prob" scoring reads: uint16 [H_kv, ceil(C/16), d, 16]
    (per KV head, blocks of 16 medoids, dimension-major; same bytes, padded)."""
    m = _arr(m, "m")
    H = _pos(num_kv_heads, "num_kv_heads")
    if m.ndim != 2 or m.itemsize != 2 or m.shape[1] % H:
        _fail(f"pack_medoids: rows {m.shape} {m.dtype} do not split into {H} heads")
    C, d = m.shape[0], m.shape[1] // H
    out = np.empty((H, (C + 15) // 16, d, 16), dtype=np.uint16)
    if C:
        lib.se_pack_medoids(ffi.from_buffer("uint16_t[]", m.view(np.uint16)), C, H, d,
                            ffi.from_buffer("uint16_t[]", out, require_writable=True))
    return out


def select_fused(m: np.ndarray, q: np.ndarray, num_kv_heads: int, *, scale: float,
                 score: str, bf16: bool, ptr: np.ndarray, members: np.ndarray,
                 num_tokens: int, budget: int, window: int,
                 packed: np.ndarray | None = None, check: bool = True
                 ) -> tuple[np.ndarray, int]:
    """Score one query against the fp16/bf16 medoid index and choose clusters,
    in one native call (``se_select_fused``): per-head logits (or the
    GQA-summed logit), softmax sums, then :func:`choose_clusters`'s rule.

    Args:
        m: C-contiguous [C, H_kv * d] 2-byte floats (the medoid keys).
        q: float32 [H_q, d] one query.
        score: ``"prob"`` or ``"logit"`` (see ``MedoidSelector``).
        packed: ``pack_medoids(m, num_kv_heads)`` (faster "prob" scoring on
            the AVX-512 and AVX2 paths), or None.

    Returns:
        (int64 [c] cluster ids best first, distinct entries).
    """
    if not isinstance(m, np.ndarray) or m.ndim != 2 or m.itemsize != 2 or \
            not m.flags.c_contiguous:
        _fail(f"select_fused: medoids must be C-contiguous 2-byte [C, H*d], got "
              f"{getattr(m, 'shape', type(m).__name__)}")
    q = np.ascontiguousarray(q, dtype=np.float32)
    H = int(num_kv_heads)
    if q.ndim != 2 or m.shape[1] != H * q.shape[1] or q.shape[0] % H:
        _fail(f"select_fused: query {q.shape} does not match medoids {m.shape} "
              f"with {H} KV heads")
    Hq, d = q.shape
    C = m.shape[0]
    ptr, members = _csr_args(C, ptr, members, num_tokens, check)
    work = np.empty(C * (Hq + 1) + 1, dtype=np.float32)
    out = np.empty(max(C, 1), dtype=np.int64)
    if packed is not None and (packed.dtype != np.uint16 or not packed.flags.c_contiguous or
                               packed.shape != (H, (C + 15) // 16, d, 16)):
        _fail(f"select_fused: packed index {packed.shape} does not match {m.shape}")
    pk = ffi.from_buffer("uint16_t[]", packed) if packed is not None and C else ffi.NULL
    ix = ffi.new("se_half_index *", {"m": ffi.from_buffer("uint16_t[]", m.view(np.uint16)),
                                     "packed": pk, "C": C, "kind": 2 if bf16 else 1})
    ch = _choice(ptr, members, num_tokens, _count_arg(budget, "budget"),
                 _count_arg(window, "window"), out)
    n = lib.se_select_fused(ix, _query(q, H, float(scale)), 0 if score == "prob" else 1,
                            ffi.from_buffer("float[]", work, require_writable=True), ch)
    if n < 0:
        _native_failure("select_fused", n)
    return out[:n].copy(), int(ch.entries)


class Int8Index(NamedTuple):
    """The int8 medoid index (``pack_medoids_i8``): SWARM §5.2's medoid keys
    quantised per row (one medoid, one KV head) to int8 with an fp32 scale.

    Attributes:
        data: int8 [H_kv, ceil(C/16), d/4, 16, 4] (per KV head, blocks of 16
            medoids, groups of 4 dimensions: the vpdpbusd operand layout).
        scales: float32 [H_kv, Cp] (max |row| / 127; 0 for padding rows;
            Cp = 16 ceil(C/16)).
        sums: int32 [H_kv, Cp] (each row's int8 sum).
        rows: C, the number of medoids.
    """
    data: np.ndarray
    scales: np.ndarray
    sums: np.ndarray
    rows: int


def pack_medoids_i8(m: np.ndarray, num_kv_heads: int, *, bf16: bool = False) -> Int8Index:
    """Quantise the medoid index [C, H_kv*d] (fp16, or bf16 as uint16 with
    ``bf16=True``) to int8 per row (round(x * 127 / max|row|)), made once per
    layer as ``MedoidSelector`` does.  Half the bytes of the fp16 index.

    Raises:
        InvalidArgumentError: rows that do not split into ``num_kv_heads``
            heads of a multiple of 4 dimensions.
    """
    m = _arr(m, "m")
    H = _pos(num_kv_heads, "num_kv_heads")
    if m.ndim != 2 or m.itemsize != 2 or m.shape[1] % H or (m.shape[1] // H) % 4:
        _fail(f"pack_medoids_i8: rows {m.shape} {m.dtype} do not split into {H} heads "
              f"of a multiple of 4 dimensions")
    C, d = m.shape[0], m.shape[1] // H
    nblk = (C + 15) // 16
    data = np.empty((H, nblk, d // 4, 16, 4), dtype=np.int8)
    scales = np.zeros((H, nblk * 16), dtype=np.float32)
    sums = np.zeros((H, nblk * 16), dtype=np.int32)
    if C:
        lib.se_pack_medoids_i8(ffi.from_buffer("uint16_t[]", m.view(np.uint16)), C, H, d,
                               2 if bf16 else 1,
                               ffi.from_buffer("int8_t[]", data, require_writable=True),
                               ffi.from_buffer("float[]", scales, require_writable=True),
                               ffi.from_buffer("int32_t[]", sums, require_writable=True))
    return Int8Index(data, scales, sums, C)


def _check_i8(ix: Int8Index, q: np.ndarray, num_kv_heads: int, what: str):
    if not isinstance(ix, Int8Index):
        _fail(f"{what}: index must be an Int8Index from pack_medoids_i8, got {type(ix)}")
    H = _pos(num_kv_heads, "num_kv_heads")
    q = np.ascontiguousarray(q, dtype=np.float32)
    C = int(ix.rows)
    nblk = (C + 15) // 16
    if q.ndim != 2 or q.shape[0] % H or q.shape[1] % 4:
        _fail(f"{what}: query {q.shape} does not fit {H} KV heads")
    d = q.shape[1]
    if (ix.data.dtype != np.int8 or ix.data.shape != (H, nblk, d // 4, 16, 4)
            or not ix.data.flags.c_contiguous
            or ix.scales.dtype != np.float32 or ix.scales.shape != (H, nblk * 16)
            or not ix.scales.flags.c_contiguous
            or ix.sums.dtype != np.int32 or ix.sums.shape != (H, nblk * 16)
            or not ix.sums.flags.c_contiguous):
        _fail(f"{what}: int8 index {ix.data.shape} does not match query {q.shape} "
              f"with {H} KV heads and {C} medoids")
    return q, H, C, d


def head_logits_i8(ix: Int8Index, q: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Per-head logits float32 [H_q, C] (unscaled q.k) of one query float32
    [H_q, d] against the int8 index, the query quantised per head to int8:
    exact integer dot products times the two scales, so every kernel path
    returns bit-identical floats.

    Raises:
        InvalidArgumentError: shapes that do not match.
    """
    q, H, C, d = _check_i8(ix, q, num_kv_heads, "head_logits_i8")
    Hq = q.shape[0]
    out = np.empty((Hq, C), dtype=np.float32)
    if C:
        ret = lib.se_head_logits_i8(ffi.new("se_i8_index *", _i8_fields(ix, C)), _query(q, H),
                                    ffi.from_buffer("float[]", out, require_writable=True))
        if ret < 0:
            _native_failure("head_logits_i8", ret)
    return out


def thread_count(threads, what: str = "threads", **where) -> int:
    """``threads`` of a native call that can use both cores (the int8
    selection, the assembly) checked: 1 or 2 (an int, not a bool).

    Raises:
        InvalidIntegerError: anything else, naming ``what``.
    """
    return parse_int(threads, what, 1, 2, **where)


def select_i8(ix: Int8Index, q: np.ndarray, num_kv_heads: int, *, scale: float,
              ptr: np.ndarray, members: np.ndarray, num_tokens: int, budget: int,
              window: int, check: bool = True, threads: int = 1) -> tuple[np.ndarray, int]:
    """:func:`select_fused`'s "prob" score from the int8 index, in one native
    call (``se_select_i8``: :func:`head_logits_i8`, softmax sums over heads,
    then :func:`choose_clusters`'s rule).

    ``threads=2`` scores half the KV heads on a second thread started for
    the call (both cores for one query, issue 10); the scores equal the
    one-thread scores up to the order of one float addition, and the
    cluster choice after them is the same rule.  Any number of calls may run
    at the same time (no state is shared between calls).

    Returns:
        (int64 [c] cluster ids best first, distinct entries).

    Raises:
        InvalidArgumentError: shapes that do not match, a bad cluster table.
    """
    q, H, C, d = _check_i8(ix, q, num_kv_heads, "select_i8")
    if not float(scale) > 0:
        _fail(f"select_i8: scale {scale} must be positive")
    threads = thread_count(threads, "select_i8 threads")
    Hq = q.shape[0]
    ptr, members = _csr_args(C, ptr, members, num_tokens, check)
    work = np.empty(C * (Hq // H + 1) + 1, dtype=np.float32)
    out = np.empty(max(C, 1), dtype=np.int64)
    ch = _choice(ptr, members, num_tokens, _count_arg(budget, "select_i8: budget"),
                 _count_arg(window, "select_i8: window"), out)
    n = lib.se_select_i8(ffi.new("se_i8_index *", _i8_fields(ix, C)), _query(q, H, float(scale)),
                         int(threads), ffi.from_buffer("float[]", work, require_writable=True),
                         ch)
    if n < 0:
        _native_failure("select_i8", n)
    return out[:n].copy(), int(ch.entries)
