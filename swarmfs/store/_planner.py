"""The read planner: deduplication, entry-bucket scheduling, coalescing.

``plan_reads`` is a pure function of numpy arrays (SWARM §6.1, eq. 8): it
turns candidate copies of KV entries into block-aligned read requests, one
batch for the engine.  Nothing here does I/O; the steps below run in one C
call (``se_plan_reads``: token and (disk, offset) bitmaps in place of sorts
where the values' spans allow, radix sorts else, the greedy bucket choice,
one pass to coalesce), so a 13K-entry step costs no Python per entry.

Steps:
  1. Dedup (eq. 8): group candidate copies by token; each token is read once.
  2. Entry buckets: tokens in ascending order of copy count; a token with one
     copy goes to that copy's disk, the others to the disk whose bucket is
     currently smallest (first candidate on a tie).
  3. Coalesce: per disk, sort chosen copies by offset and merge neighbours
     whose gap is at most ``max_gap`` bytes into one request, up to
     ``max_request`` bytes.
  4. Align: expand each request to the block size (O_DIRECT) and merge
     requests that then overlap.
  5. Order: interleave the disks' requests round-robin (head of each bucket in
     turn) and lay them out back to back in a staging buffer.
"""

from __future__ import annotations

import dataclasses
import errno
import os

import numpy as np

from .. import _validate as V
from .._errors import InternalError, InvalidArgumentError
from .._native import ffi, lib

__all__ = ["Plan", "plan_reads", "POLICIES", "MAX_REQUEST"]

POLICIES = ("balanced", "first")

#: Default cap on one coalesced request (bytes).  512 KiB: NVMe drives split
#: larger transfers at their MDTS anyway (commonly 128 KiB-2 MiB), and the
#: emulated testbed's loop devices split above 128 pages (512 KiB), which
#: blk-throttle then charges twice (docs/benchmarks.md).
MAX_REQUEST = 512 << 10


@V.checked_methods
@dataclasses.dataclass(frozen=True)
class Plan:
    """A read plan.

    Attributes:
        disk: int32 [R] disk of each request, in submission order.
        offset: uint64 [R] byte offset on the disk (block aligned).
        length: uint32 [R] bytes (block aligned).
        dst: uint64 [R] byte offset of the request in the staging buffer.
        staging_bytes: total bytes of the staging buffer.
        tokens: int64 [U] token positions read, ascending and unique (or, with
            ``dedup=False``, one per candidate copy, sorted).
        src: uint64 [U] byte offset of each token's entry in the staging buffer.
        copy: int64 [U] index (into the candidate arrays) of the copy read.
        disk_entries: int64 [N] entries per disk bucket.
        disk_bytes: int64 [N] bytes requested per disk (after alignment/gaps).
        entry_bytes: bytes per entry.
    """
    disk: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    dst: np.ndarray
    staging_bytes: int
    tokens: np.ndarray
    src: np.ndarray
    copy: np.ndarray
    disk_entries: np.ndarray
    disk_bytes: np.ndarray
    entry_bytes: int

    @property
    def num_requests(self) -> int:
        """Read requests of the plan (after coalescing)."""
        return int(self.disk.shape[0])

    @property
    def num_entries(self) -> int:
        """Distinct entries the plan reads."""
        return int(self.tokens.shape[0])

    @property
    def max_mean_load(self) -> float:
        """Max over mean of per-disk bytes (1.0 = perfect balance)."""
        b = self.disk_bytes
        return float(b.max() / b.mean()) if b.size and b.sum() else 1.0


def _ints(x, dtype, what: str) -> np.ndarray:
    """A 1-D integer array as ``dtype`` (as it is for ``None``; floats, bools,
    negatives for unsigned types refused)."""
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what} is not an array: {exc}") from None
    if a.size == 0 and a.ndim <= 1:
        return np.empty(0, dtype=dtype)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what} must be a 1-D integer array, got {a.dtype} "
                                   f"{a.shape}")
    if dtype is None:
        return a
    if np.dtype(dtype).kind == "u" and a.dtype.kind == "i" and a.min() < 0:
        raise InvalidArgumentError(f"{what} holds a negative value")
    return a.astype(dtype, copy=False)


@V.checked
def plan_reads(tok, cdisk, coff, *, ndisks: int, entry_bytes: int,
               block_size: int, max_gap: int = 0, max_request: int = MAX_REQUEST,
               policy: str = "balanced", dedup: bool = True) -> Plan:
    """Plan block-aligned reads of KV entries from candidate copies.

    Args:
        tok: int [m] token position of each candidate copy.
        cdisk: int [m] disk of each candidate copy.
        coff: uint64 [m] byte offset of each candidate copy on its disk.
        ndisks: number of disks N.
        entry_bytes: bytes per KV entry.
        block_size: O_DIRECT alignment in bytes (a power of two).
        max_gap: merge two entries on a disk into one request when the bytes
            between them are at most this many (read and discarded).
        max_request: cap, in bytes, on a coalesced request before alignment.
        policy: ``"balanced"`` (SWARM §6.1 entry buckets) or ``"first"``
            (static routing: the first candidate copy of each token).
        dedup: eq. 8 deduplication; ``False`` reads every candidate copy (the
            No-Dedup ablation of §8.3).

    Returns:
        A :class:`Plan`.

    Raises:
        InvalidArgumentError: inconsistent or out-of-range inputs (its
            subclasses of :mod:`swarmfs._validate` for one bad argument:
            InvalidBoolError, InvalidChoiceError for an unknown policy,
            InvalidIntegerError).
    """
    V.parse_bool(dedup, "dedup")
    V.parse_choice(policy, "policy", POLICIES)
    ndisks = V.parse_positive_int(ndisks, "ndisks", 1 << 62)
    # a request's length is 32-bit (uint32 in the plan and the engine): no
    # request, merged or single-entry, may reach 4 GiB
    entry_bytes = V.parse_positive_int(entry_bytes, "entry_bytes", 1 << 30)
    block_size = V.parse_positive_int(block_size, "block_size", 1 << 30)
    max_gap = V.parse_nonneg_int(max_gap, "max_gap", 1 << 30)
    max_request = V.parse_positive_int(max_request, "max_request", 1 << 30)
    tok = np.ascontiguousarray(_ints(tok, np.int64, "tok"))
    cdisk = _ints(cdisk, None, "cdisk")
    if cdisk.dtype != np.int32:
        # ranges checked before narrowing, so that no disk wraps into range
        if cdisk.size and (int(cdisk.min()) < 0 or int(cdisk.max()) >= ndisks):
            raise InvalidArgumentError(f"a candidate's disk is outside [0, {ndisks})")
        cdisk = cdisk.astype(np.int32)
    cdisk = np.ascontiguousarray(cdisk)
    coff = np.ascontiguousarray(_ints(coff, np.uint64, "coff"))
    if not (tok.shape == cdisk.shape == coff.shape):
        raise InvalidArgumentError("tok, cdisk and coff must be 1-D arrays of one length")
    if tok.shape[0] >= 2**32:
        raise InvalidArgumentError("candidates must be fewer than 2**32")
    if ndisks >= 1 << 12:
        raise InvalidArgumentError(f"at most 4095 disks, got {ndisks}")
    if block_size & (block_size - 1):
        raise InvalidArgumentError(f"block_size must be a power of two, got {block_size}")
    eb = int(entry_bytes)
    m = tok.shape[0]
    cap = max(m, 1)
    # the outputs in one allocation per type (slices: cheaper than views)
    i64, u64 = np.empty(2 * cap + 2 * ndisks, np.int64), np.empty(3 * cap, np.uint64)
    utok, chosen = i64[:cap], i64[cap:2 * cap]
    disk_entries, disk_bytes = i64[2 * cap:2 * cap + ndisks], i64[2 * cap + ndisks:]
    src, roff, rdst = u64[:cap], u64[cap:2 * cap], u64[2 * cap:]
    rdisk, rlen = np.empty(cap, np.int32), np.empty(cap, np.uint32)
    w = ffi.from_buffer
    args = ffi.new("se_plan_in *", {
        "m": m, "tok": w("int64_t[]", tok), "cdisk": w("int32_t[]", cdisk),
        "coff": w("uint64_t[]", coff), "ndisks": ndisks, "E": eb, "bs": block_size,
        "max_gap": max_gap, "max_request": max_request,
        "balanced": int(policy == "balanced"), "dedup": int(bool(dedup))})
    out = ffi.new("se_plan_out *", {
        "utok": w("int64_t[]", utok), "chosen": w("int64_t[]", chosen),
        "src": w("uint64_t[]", src), "rdisk": w("int32_t[]", rdisk),
        "roff": w("uint64_t[]", roff), "rlen": w("uint32_t[]", rlen),
        "rdst": w("uint64_t[]", rdst), "disk_entries": w("int64_t[]", disk_entries),
        "disk_bytes": w("int64_t[]", disk_bytes)})
    R = lib.se_plan_reads(args, out)
    if R == -errno.EDOM:
        raise InvalidArgumentError("token ids must be in [0, 2**31)")
    if R == -errno.ERANGE:
        raise InvalidArgumentError(f"a candidate's disk is outside [0, {ndisks})")
    if R == -errno.EOVERFLOW:
        raise InvalidArgumentError("a candidate's offset is at or beyond 2**52 bytes")
    if R < 0:
        raise InternalError(f"plan_reads failed: {os.strerror(-R)}")
    n, staging = int(out.n_entries), int(out.staging)
    if int(rlen[:R].sum(dtype=np.uint64)) != staging:
        # requests are laid back to back in staging: a sum that differs means
        # a request (runs merged where their blocks overlap) reached 4 GiB
        raise InvalidArgumentError(
            f"a read request would reach 4 GiB (entries of {eb} bytes, max_request "
            f"{max_request}, block size {block_size}): use block-aligned entries or a "
            "smaller max_request")
    return Plan(disk=rdisk[:R], offset=roff[:R], length=rlen[:R], dst=rdst[:R],
                staging_bytes=staging, tokens=utok[:n], src=src[:n], copy=chosen[:n],
                disk_entries=disk_entries, disk_bytes=disk_bytes, entry_bytes=eb)
