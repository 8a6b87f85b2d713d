"""The read planner: deduplication, entry-bucket scheduling, coalescing.

``plan_reads`` is a pure function of numpy arrays (SWARM §6.1, eq. 8): it
turns candidate copies of KV entries into block-aligned read requests, one
batch for the engine.  Nothing here does I/O, and nothing loops in Python per
entry or per request; the only sequential step (the greedy bucket choice) runs
in C (``se_assign_buckets``).

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

import numpy as np

from ._errors import ConfigError, InvalidArgumentError
from ._kernels import assign_buckets

__all__ = ["Plan", "plan_reads", "POLICIES", "MAX_REQUEST"]

POLICIES = ("balanced", "first")

#: Default cap on one coalesced request (bytes).  512 KiB: NVMe drives split
#: larger transfers at their MDTS anyway (commonly 128 KiB-2 MiB), and the
#: emulated testbed's loop devices split above 128 pages (512 KiB), which
#: blk-throttle then charges twice (docs/benchmarks.md).
MAX_REQUEST = 512 << 10


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
        return int(self.disk.shape[0])

    @property
    def num_entries(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_mean_load(self) -> float:
        """Max over mean of per-disk bytes (1.0 = perfect balance)."""
        b = self.disk_bytes
        return float(b.max() / b.mean()) if b.size and b.sum() else 1.0


def _positive(x, what: str, *, zero: bool = False) -> int:
    import numbers
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < (0 if zero else 1):
        raise InvalidArgumentError(f"{what} must be an integer >= {0 if zero else 1}, "
                                   f"got {x!r}")
    return int(x)


def _ints(x, dtype, what: str) -> np.ndarray:
    """A 1-D integer array as ``dtype`` (floats, bools, negatives for
    unsigned types refused)."""
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what} is not an array: {exc}") from None
    if a.size == 0 and a.ndim <= 1:
        return np.empty(0, dtype=dtype)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what} must be a 1-D integer array, got {a.dtype} "
                                   f"{a.shape}")
    if np.dtype(dtype).kind == "u" and a.dtype.kind == "i" and a.min() < 0:
        raise InvalidArgumentError(f"{what} holds a negative value")
    return a.astype(dtype, copy=False)


def _choose_copies(tok: np.ndarray, cdisk: np.ndarray, ndisks: int, policy: str):
    """Dedup + bucket assignment.  Returns (unique sorted tokens, chosen copy idx)."""
    m = tok.shape[0]
    # sort (token, candidate index) pairs packed in one int64: a value sort is
    # several times faster than a stable argsort and keeps candidate order
    key = (tok << np.int64(32)) | np.arange(m, dtype=np.int64)
    key.sort()
    order = key & np.int64(0xFFFFFFFF)
    tok_s = key >> np.int64(32)
    first = np.empty(m, dtype=bool)
    first[0] = True
    np.not_equal(tok_s[1:], tok_s[:-1], out=first[1:])
    u_start = np.flatnonzero(first)
    utok = tok_s[u_start]
    if u_start.shape[0] == m or policy == "first":
        # every token has one candidate (or static routing): take the first
        return utok, order[u_start]
    ucount = np.diff(np.append(u_start, m))
    chosen = order[u_start]                 # single-copy entries: their only copy
    multi = np.flatnonzero(ucount > 1)
    # single-copy entries fill their buckets first; the rest, in ascending copy
    # count, go to the smallest bucket among their copies (C, sequential greedy)
    first_disk = cdisk[chosen]
    load = np.bincount(first_disk, weights=ucount == 1, minlength=ndisks).astype(np.int64)
    mc = ucount[multi]
    porder = multi[np.argsort(mc.astype(np.uint8 if mc.max() < 256 else np.int64),
                              kind="stable")]     # radix sort on small counts
    cnt_p = ucount[porder]
    ptr = np.zeros(porder.shape[0] + 1, dtype=np.int64)
    np.cumsum(cnt_p, out=ptr[1:])
    rep = np.repeat(u_start[porder] - ptr[:-1], cnt_p) + np.arange(int(ptr[-1]))
    cand = order[rep]                       # candidate copies, in processing order
    choice, _ = assign_buckets(ptr, cdisk[cand], ndisks, load)
    chosen[porder] = cand[choice]
    return utok, chosen


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
        InvalidArgumentError: inconsistent or out-of-range inputs.
        ConfigError: an unknown policy.
    """
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; use one of {POLICIES}")
    ndisks = _positive(ndisks, "ndisks")
    entry_bytes = _positive(entry_bytes, "entry_bytes")
    block_size = _positive(block_size, "block_size")
    max_gap = _positive(max_gap, "max_gap", zero=True)
    max_request = _positive(max_request, "max_request")
    tok = _ints(tok, np.int64, "tok")
    cdisk = _ints(cdisk, np.int64, "cdisk")
    coff = _ints(coff, np.uint64, "coff")
    if not (tok.shape == cdisk.shape == coff.shape):
        raise InvalidArgumentError("tok, cdisk and coff must be 1-D arrays of one length")
    if tok.size and (tok.min() < 0 or tok.max() >= 2**31 or tok.shape[0] >= 2**32):
        raise InvalidArgumentError("token ids must be in [0, 2**31) and candidates fewer "
                                   "than 2**32")
    if cdisk.size and (cdisk.min() < 0 or cdisk.max() >= ndisks):
        raise InvalidArgumentError(f"a candidate's disk is outside [0, {ndisks})")
    if ndisks >= 1 << 12:
        raise InvalidArgumentError(f"at most 4095 disks, got {ndisks}")
    cdisk = cdisk.astype(np.int32)
    if coff.size and int(coff.max()) >= 1 << 52:
        raise InvalidArgumentError("a candidate's offset is at or beyond 2**52 bytes")
    if block_size & (block_size - 1):
        raise InvalidArgumentError(f"block_size must be a power of two, got {block_size}")
    E = int(entry_bytes)
    zeros = np.zeros(ndisks, dtype=np.int64)
    if tok.shape[0] == 0:
        e64, eu = np.empty(0, np.int64), np.empty(0, np.uint64)
        return Plan(np.empty(0, np.int32), eu, np.empty(0, np.uint32), eu, 0,
                    e64, eu, e64, zeros, zeros.copy(), E)

    if dedup:
        utok, chosen = _choose_copies(tok, cdisk, ndisks, policy)
    else:
        chosen = np.argsort(tok, kind="stable")
        utok = tok[chosen]
    d = cdisk[chosen]
    o = coff[chosen]
    n = chosen.shape[0]

    # coalesce per disk, in offset order
    key = (d.astype(np.uint64) << np.uint64(52)) | o
    srt = np.argsort(key)   # equal keys are the same copy: order among them is moot
    ds, os_ = d[srt], o[srt]
    newrun = np.empty(n, dtype=bool)
    newrun[0] = True
    gap_ok = os_[1:] <= os_[:-1] + np.uint64(E + max_gap)
    np.logical_or(ds[1:] != ds[:-1], ~gap_ok, out=newrun[1:])
    run = np.cumsum(newrun) - 1
    rs = np.flatnonzero(newrun)
    re = np.append(rs[1:], n) - 1
    if max_request > 0 and (os_[re] - os_[rs]).max() + np.uint64(E) > np.uint64(max_request):
        # split runs longer than max_request (only runs that need it pay)
        run_base = os_[rs][run]
        chunk = (os_ - run_base) // np.uint64(max(max_request, E))
        split = np.empty(n, dtype=bool)
        split[0] = False
        split[1:] = (chunk[1:] != chunk[:-1]) & ~newrun[1:]
        newrun |= split
        run = np.cumsum(newrun) - 1
        rs = np.flatnonzero(newrun)
        re = np.append(rs[1:], n) - 1
    bs = np.uint64(block_size)
    rstart = os_[rs] // bs * bs
    rend = (os_[re] + np.uint64(E) + bs - np.uint64(1)) // bs * bs
    rdisk = ds[rs]
    # merge runs whose aligned ranges now overlap or touch across a shared block
    if rs.shape[0] > 1:
        newreq = np.empty(rs.shape[0], dtype=bool)
        newreq[0] = True
        np.logical_or(rdisk[1:] != rdisk[:-1], rstart[1:] >= rend[:-1], out=newreq[1:])
        if not newreq.all():
            grp = np.cumsum(newreq) - 1
            qs = np.flatnonzero(newreq)
            qe = np.append(qs[1:], rs.shape[0]) - 1
            rstart, rend, rdisk = rstart[qs], rend[qe], rdisk[qs]
            run = grp[run]
    nreq = rstart.shape[0]
    length = rend - rstart

    # round-robin submission order: rank within disk, then disk
    per_disk = np.bincount(rdisk, minlength=ndisks)
    rank = np.arange(nreq) - np.repeat(np.cumsum(per_disk) - per_disk, per_disk)
    sub = np.argsort(rank * ndisks + rdisk)
    pos = np.empty(nreq, dtype=np.int64)
    pos[sub] = np.arange(nreq)
    lens_sub = length[sub]
    dst_sub = np.zeros(nreq, dtype=np.uint64)
    if nreq > 1:
        np.cumsum(lens_sub[:-1], out=dst_sub[1:])
    dst = dst_sub[pos]                       # per request, in sorted order
    src_sorted = dst[run] + (os_ - rstart[run])
    src = np.empty(n, dtype=np.uint64)
    src[srt] = src_sorted

    disk_entries = np.bincount(d, minlength=ndisks).astype(np.int64)
    disk_bytes = np.bincount(rdisk, weights=length.astype(np.float64),
                             minlength=ndisks).astype(np.int64)
    return Plan(disk=rdisk[sub].astype(np.int32), offset=rstart[sub],
                length=lens_sub.astype(np.uint32), dst=dst_sub,
                staging_bytes=int(lens_sub.sum()), tokens=utok, src=src,
                copy=chosen, disk_entries=disk_entries, disk_bytes=disk_bytes,
                entry_bytes=E)
