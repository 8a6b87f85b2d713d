"""Cluster placement over the disks: SWARM §5.2, eq. 7 (the runtime's striping contract).

A global disk pointer ``p_global`` walks the clusters in order.  Cluster
``C_i`` starts at disk ``id_i = p_global mod N`` and then ``p_global`` advances
by ``|C_i|``.  The cluster's entries are striped round-robin entry by entry
from its start disk: entry ``j`` of the cluster lives on disk
``(id_i + j) mod N`` at slot ``j // N`` of the cluster's extent on that disk.
Each cluster's share of each disk is one contiguous extent, aligned to (and
padded to) the store block size, so a whole-cluster read is at most N requests.
All functions are pure and vectorised.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _validate as V
from .._errors import InvalidArgumentError, boundary

__all__ = ["Placement", "PLACEMENTS", "start_disks", "stripe_counts", "place_clusters",
           "copy_locations"]


def _sizes(sizes) -> np.ndarray:
    a = np.asarray(sizes)
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.dtype.kind not in "iu" or a.ndim != 1 or a.min() < 0:
        raise InvalidArgumentError(f"sizes must be a 1-D array of non-negative integers, got "
                                   f"{a.dtype} of shape {a.shape}")
    return a.astype(np.int64)


@boundary
def start_disks(sizes: np.ndarray, ndisks: int, p_global: int = 0) -> tuple[np.ndarray, int]:
    """Start disk of each cluster by eq. 7, and the advanced global pointer.

    Args:
        sizes: int [C] cluster sizes |C_i| in entries, in placement order.
        ndisks: number of disks N.
        p_global: the global disk pointer before the first cluster.

    Returns:
        (int32 [C] start disk id_i, new p_global).

    Raises:
        InvalidArgumentError: negative or non-integer sizes, ndisks < 1.
    """
    sizes = _sizes(sizes)
    ndisks = V.parse_int(ndisks, "ndisks", 1, (1 << 62) - 1)
    p_global = V.parse_int(p_global, "p_global", 0, (1 << 62) - 1)
    before = p_global + np.cumsum(sizes) - sizes
    p_new = int(p_global + sizes.sum())
    return (before % ndisks).astype(np.int32), p_new


@boundary
def stripe_counts(sizes: np.ndarray, start: np.ndarray, ndisks: int) -> np.ndarray:
    """Entries of each cluster on each disk under round-robin striping.

    Returns:
        int64 [C, N]: ``counts[c, d] = |{j < n_c : (start_c + j) mod N = d}|``.

    Raises:
        InvalidArgumentError: sizes and start differ in length, ndisks < 1.
    """
    ndisks = V.parse_int(ndisks, "ndisks", 1, (1 << 62) - 1)
    if np.shape(sizes) != np.shape(start):
        raise InvalidArgumentError("sizes and start need one value per cluster")
    sizes = np.asarray(sizes, dtype=np.int64)[:, None]
    r = (np.arange(ndisks)[None, :] - np.asarray(start, dtype=np.int64)[:, None]) % ndisks
    return np.maximum(0, (sizes - r + ndisks - 1) // ndisks)


@V.checked_methods
@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a batch of clusters lands.

    Attributes:
        start_disk: int32 [C] eq. 7 start disk per cluster.
        counts: int64 [C, N] entries per cluster per disk.
        extent_off: uint64 [C, N] byte offset of each extent (valid where
            counts > 0; extents with no entries get the disk's current end).
        extent_bytes: uint64 [C, N] allocated bytes of each extent (a multiple
            of the block size; 0 where counts == 0).
        p_global: the global pointer after these clusters.
        disk_end: uint64 [N] end of allocated space on each disk afterwards.
    """
    start_disk: np.ndarray
    counts: np.ndarray
    extent_off: np.ndarray
    extent_bytes: np.ndarray
    p_global: int
    disk_end: np.ndarray


PLACEMENTS = ("eq7", "disk0")


@boundary
def place_clusters(sizes: np.ndarray, *, ndisks: int, entry_bytes: int,
                   block_size: int, disk_end: np.ndarray, p_global: int = 0,
                   policy: str = "eq7", start: np.ndarray | None = None) -> Placement:
    """Allocate extents for clusters appended after ``disk_end`` (eq. 7).

    Args:
        sizes: int [C] cluster sizes in entries.
        ndisks: N.
        entry_bytes: bytes per KV entry (2 x H_kv x head_dim x itemsize).
        block_size: store block size in bytes; extents are aligned to it.
        disk_end: uint64 [N] first free byte on each disk (block aligned).
        p_global: global disk pointer before these clusters.
        policy: ``"eq7"`` (SWARM) or ``"disk0"``: every cluster starts at
            disk 0 (the No-Balance placement ablation of §8.3, Fig. 13).
        start: explicit start disk per cluster (relocating existing clusters
            keeps their start disk, so entry j stays on disk (id_i + j) mod N,
            as §6.2 requires of appended entries); p_global is left as is.

    Raises:
        InvalidArgumentError: unknown policy, negative sizes, a block size
            that is not a power of two, ndisks < 1, disk_end of the wrong
            length, or start of the wrong length or outside [0, N).
    """
    sizes = _sizes(sizes)
    explicit = start
    ndisks = V.parse_int(ndisks, "ndisks", 1, (1 << 62) - 1)
    V.parse_int(entry_bytes, "entry_bytes", 1, (1 << 62) - 1)
    bsz = V.parse_int(block_size, "block_size", 1, (1 << 62) - 1)
    if bsz & (bsz - 1):
        raise InvalidArgumentError(f"block_size must be a power of two, got {bsz}")
    if np.shape(disk_end) != (ndisks,):
        raise InvalidArgumentError(f"disk_end needs one offset per disk ({ndisks})")
    V.parse_choice(policy, "policy", PLACEMENTS)
    start, p_new = start_disks(sizes, ndisks, p_global)
    if explicit is not None:
        start, p_new = np.asarray(explicit, dtype=np.int32).reshape(-1), p_global
        if start.shape != sizes.shape or (start.size and (start.min() < 0 or
                                                           start.max() >= ndisks)):
            raise InvalidArgumentError("start needs one disk in [0, N) per cluster")
    if policy == "disk0":
        start = np.zeros_like(start)
        p_new = p_global
    counts = stripe_counts(sizes, start, ndisks)
    bs = np.uint64(block_size)
    raw = counts.astype(np.uint64) * np.uint64(entry_bytes)
    ext = (raw + bs - np.uint64(1)) // bs * bs
    disk_end = np.asarray(disk_end, dtype=np.uint64)
    cum = np.cumsum(ext, axis=0, dtype=np.uint64)
    off = disk_end[None, :] + cum - ext
    return Placement(start_disk=start, counts=counts, extent_off=off,
                     extent_bytes=ext, p_global=p_new,
                     disk_end=disk_end + (cum[-1] if len(sizes) else np.uint64(0)))


@boundary
def copy_locations(members_ptr: np.ndarray, start_disk: np.ndarray,
                   extent_off: np.ndarray, *, ndisks: int,
                   entry_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disk and byte offset of every stored copy, in cluster order.

    Args:
        members_ptr: int64 [C+1] CSR pointers (cluster c holds copies
            ptr[c]:ptr[c+1]).
        start_disk: int [C] start disk per cluster.
        extent_off: uint64 [C, N] extent offsets.

    Returns:
        (cluster int32 [M], disk int32 [M], offset uint64 [M]).
    """
    ptr = np.asarray(members_ptr, dtype=np.int64)
    sizes = np.diff(ptr)
    m = int(ptr[-1]) if len(ptr) else 0
    cluster = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    slot = np.arange(m, dtype=np.int64) - np.repeat(ptr[:-1], sizes)
    disk = ((np.asarray(start_disk, dtype=np.int64)[cluster] + slot) % ndisks).astype(np.int32)
    off = np.asarray(extent_off, dtype=np.uint64)[cluster, disk] + \
        (slot // ndisks).astype(np.uint64) * np.uint64(entry_bytes)
    return cluster, disk, off
