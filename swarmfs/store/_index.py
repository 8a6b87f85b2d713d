"""One layer's index: the cluster table and the entry index, as numpy arrays.

The stored arrays (see ``_format.INDEX_ARRAYS``) describe clusters; everything
else is derived here, vectorised, once per layer:

* per copy (a stored instance of a KV entry inside one cluster, in cluster
  order): its cluster, slot, disk and byte offset (eq. 7 striping);
* per token: the CSR list of its copies (``tok_ptr``/``tok_copy``), so
  ``(layer, token)`` maps to every ``(disk, offset)`` that holds it.
"""

from __future__ import annotations

import numpy as np

from .. import _errors as errors
from .. import _validate as V
from ._placement import copy_locations, stripe_counts

__all__ = ["LayerIndex", "concat_ranges", "unique_ints", "union_ints"]


@errors.boundary
def concat_ranges(lo: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(lo[i], lo[i] + n[i])`` for all i, vectorised:
    int64 [sum(n)]."""
    lo = np.asarray(lo, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    if lo.shape != n.shape or lo.ndim != 1 or (n.size and n.min() < 0):
        raise errors.InvalidArgumentError("lo and n must be 1-D of one length, n >= 0")
    total = int(n.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    return np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(total, dtype=np.int64)


def unique_ints(x) -> np.ndarray:
    """The sorted distinct values of an integer array (``np.unique``'s
    result: flattened, same dtype), by one sort and a comparison of
    neighbours.  numpy 2.3+ takes a hash-based path in ``np.unique`` that
    costs 2x-12x as much on the 50-20,000 positions of one decode step (a
    measured 41 against 6 µs at 500 int64), and every step's stages (pinning
    DRAM rows, admitting hot clusters, uniting a batch's clusters) take
    distinct positions several times.

    Not for object or float arrays (NaN never equals itself).
    """
    s = np.sort(np.asarray(x).reshape(-1))
    if s.shape[0] < 2:
        return s
    keep = np.empty(s.shape[0], dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def union_ints(a, b) -> np.ndarray:
    """``np.union1d`` of two integer arrays by :func:`unique_ints`."""
    return unique_ints(np.concatenate([np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)]))


@V.checked_methods
class LayerIndex:
    """Arrays of one layer plus derived lookups.

    Attributes:
        layer: layer number.
        num_tokens: S, tokens in the layer's context.
        num_clusters: C.
        num_copies: M, stored copies (M >= S; M / S is the replication factor).
        members_ptr, members, medoid, start_disk, extent_off, extent_xxh,
        token_xxh, medoid_keys, hot, freq: the stored arrays.
        counts: int64 [C, N] entries per cluster per disk.
        copy_cluster, copy_disk, copy_off: per-copy location arrays [M].
        tok_ptr: int64 [S+1], tok_copy: int64 [M] copies of each token.
    """

    # the stored arrays (``_format.INDEX_ARRAYS``), set from ``arrays``
    members_ptr: np.ndarray
    members: np.ndarray
    medoid: np.ndarray
    start_disk: np.ndarray
    extent_off: np.ndarray
    extent_xxh: np.ndarray
    token_xxh: np.ndarray
    medoid_keys: np.ndarray
    hot: np.ndarray
    freq: np.ndarray
    #: the store's reader-lease claim on the index's generation (set by Store.layer)
    _claim: list[int]

    def __init__(self, layer: int, arrays: dict, *, num_tokens: int, ndisks: int,
                 entry_bytes: int, block_size: int, store=None, disk_end=None,
                 free=None):
        """Check the stored arrays and derive the lookups.

        Args:
            disk_end: per disk the end of allocated space (bytes); every
                extent must lie in ``[DATA_START, end)``.
            free: per disk the manifest's free ranges ``[off, len, gen]``;
                no extent may overlap one.

        Raises:
            ManifestError: the arrays are inconsistent with each other or
                with the disks' allocated space.
        """
        self.layer = layer
        self._disk_end = disk_end
        self._free = free
        self.ndisks = ndisks
        self.entry_bytes = entry_bytes
        self.block_size = block_size
        self.store = store
        self.num_tokens = int(num_tokens)
        for k, v in arrays.items():
            setattr(self, k, v)
        self.num_clusters = int(self.members_ptr.shape[0] - 1)
        self.num_copies = int(self.members.shape[0])
        self._check_shapes()
        self.sizes = np.diff(self.members_ptr)
        self.counts = stripe_counts(self.sizes, self.start_disk, ndisks)
        self.copy_cluster, self.copy_disk, self.copy_off = copy_locations(
            self.members_ptr, self.start_disk, self.extent_off, ndisks=ndisks,
            entry_bytes=entry_bytes)
        self.copy_slot = np.arange(self.num_copies, dtype=np.int64) - \
            np.repeat(self.members_ptr[:-1], self.sizes)
        order = np.argsort(self.members, kind="stable")
        self.tok_copy = order.astype(np.int64)
        self.tok_ptr = np.zeros(self.num_tokens + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.members, minlength=self.num_tokens),
                  out=self.tok_ptr[1:])

    def _fail(self, msg):
        raise errors.ManifestError(f"inconsistent index: {msg}", store=self.store,
                                   layer=self.layer)

    def _check_shapes(self) -> None:
        C, N, S = self.num_clusters, self.ndisks, self.num_tokens
        p = self.members_ptr
        if C < 0 or p.shape[0] < 2 or p[0] != 0 or np.any(np.diff(p) <= 0) \
                or p[-1] != self.members.shape[0]:
            self._fail("cluster pointers are not increasing or do not cover the members")
        for name, shape in (("medoid", (C,)), ("start_disk", (C,)),
                            ("extent_off", (C, N)), ("extent_xxh", (C, N)),
                            ("token_xxh", (S,)), ("hot", (C,)), ("freq", (C,))):
            if getattr(self, name).shape != shape:
                self._fail(f"{name} has shape {getattr(self, name).shape}, expected {shape}")
        if self.medoid_keys.shape[0] != C:
            self._fail("medoid_keys does not have one row per cluster")
        if self.members.size and (self.members.min() < 0 or self.members.max() >= S):
            self._fail("a member token is outside [0, num_tokens)")
        if C and (self.start_disk.min() < 0 or self.start_disk.max() >= N):
            self._fail("a start disk is outside [0, ndisks)")
        if np.any(self.extent_off % np.uint64(self.block_size)):
            self._fail("an extent is not block aligned")
        if S and np.bincount(self.members, minlength=S).min() == 0:
            self._fail("a token has no stored copy")
        if self.medoid_keys.shape[1] * 2 != self.entry_bytes:
            self._fail("medoid_keys rows are not half an entry (K) wide")
        if C and (self.medoid.min() < 0 or self.medoid.max() >= S):
            self._fail("a medoid token is outside [0, num_tokens)")
        if C:
            self._check_medoids()
        if self.hot.size and self.hot.max() > 1:
            self._fail("hot holds values other than 0/1")
        if not np.isfinite(self.freq).all() or (self.freq.size and self.freq.min() < 0):
            self._fail("freq holds negative or non-finite values")
        if self._disk_end is not None and C:
            self._check_extents()

    def _check_medoids(self) -> None:
        """Each cluster's medoid is one of its own members (SWARM §5.1: the
        medoid represents its cluster in the DRAM index; one outside it would
        select the cluster for another token's score)."""
        p = self.members_ptr
        own = np.repeat(self.medoid.astype(np.int64, copy=False), np.diff(p))
        found = np.logical_or.reduceat(self.members == own, p[:-1])
        if not found.all():
            c = int(np.flatnonzero(~found)[0])
            raise errors.ManifestError(f"inconsistent index: the medoid of cluster {c} (token "
                                       f"{int(self.medoid[c])}) is not a member of the "
                                       "cluster", store=self.store, layer=self.layer,
                                       cluster=c)

    def _check_extents(self) -> None:
        """Every extent inside its disk's allocated space, outside free space,
        and no two extents of the layer overlap."""
        from ._format import DATA_START
        sizes = np.diff(self.members_ptr)
        counts = stripe_counts(sizes, self.start_disk, self.ndisks)
        cc, dd = np.nonzero(counts > 0)
        bs = np.uint64(self.block_size)
        off = self.extent_off[cc, dd]
        ln = (counts[cc, dd].astype(np.uint64) * np.uint64(self.entry_bytes) + bs -
              np.uint64(1)) // bs * bs
        end = np.asarray(self._disk_end, dtype=np.uint64)[dd]
        if np.any(off < np.uint64(DATA_START)) or np.any(off > end) or \
                np.any(ln > end - np.minimum(off, end)):
            k = int(np.flatnonzero((off < np.uint64(DATA_START)) | (off > end) |
                                   (ln > end - np.minimum(off, end)))[0])
            raise errors.ManifestError(f"inconsistent index: extent at offset {int(off[k])} lies "
                                       "outside the disk's allocated space", store=self.store,
                                       layer=self.layer, cluster=int(cc[k]), disk=int(dd[k]))
        # overlaps: sort by (disk, offset); each extent must end before the next
        key = np.lexsort((off, dd))
        d_s, o_s, l_s = dd[key], off[key], ln[key]
        same = d_s[1:] == d_s[:-1]
        if np.any(same & (o_s[:-1] + l_s[:-1] > o_s[1:])):
            k = int(key[1:][np.flatnonzero(same & (o_s[:-1] + l_s[:-1] > o_s[1:]))[0]])
            raise errors.ManifestError(f"inconsistent index: two extents overlap at offset "
                                       f"{int(off[k])}", store=self.store, layer=self.layer,
                                       cluster=int(cc[k]), disk=int(dd[k]))
        for d, fr in enumerate(self._free or []):
            if not fr:
                continue
            fo = np.array([r[0] for r in fr], dtype=np.uint64)
            fe = fo + np.array([r[1] for r in fr], dtype=np.uint64)
            sel = dd == d
            o, e = off[sel], off[sel] + ln[sel]
            j = np.searchsorted(fo, e, side="left") - 1      # last free range starting < e
            hit = (j >= 0) & (fe[np.maximum(j, 0)] > o)
            if np.any(hit):
                k = int(np.flatnonzero(sel)[np.flatnonzero(hit)[0]])
                raise errors.ManifestError(f"inconsistent index: extent at offset {int(off[k])} "
                                           "lies in space the manifest lists as free",
                                           store=self.store, layer=self.layer,
                                           cluster=int(cc[k]), disk=d)

    # -- lookups -----------------------------------------------------------
    @errors.boundary
    def check_cluster(self, cid: int) -> int:
        """``cid`` as an int, or OutOfRangeError naming the layer if no such cluster."""
        cid = V.parse_index(cid, "cluster id", store=self.store, layer=self.layer)
        if not 0 <= cid < self.num_clusters:
            raise errors.OutOfRangeError(f"cluster {cid} does not exist "
                                         f"(layer has {self.num_clusters})",
                                         store=self.store, layer=self.layer)
        return cid

    @errors.boundary
    def check_tokens(self, tokens) -> np.ndarray:
        """``tokens`` as int64 [n], or OutOfRangeError naming the first outside [0, S)."""
        t = V.parse_indices(tokens, "token positions", store=self.store, layer=self.layer)
        if t.size and (t.min() < 0 or t.max() >= self.num_tokens):
            bad = t[(t < 0) | (t >= self.num_tokens)][0]
            raise errors.OutOfRangeError(f"token {int(bad)} is outside [0, {self.num_tokens})",
                                         store=self.store, layer=self.layer)
        return t

    @errors.boundary
    def cluster_copies(self, cids) -> np.ndarray:
        """Copy ids of the given clusters, concatenated in cluster order."""
        cids = np.asarray(cids, dtype=np.int64).reshape(-1)
        lo = self.members_ptr[cids]
        return concat_ranges(lo, self.members_ptr[cids + 1] - lo)

    @errors.boundary
    def token_copies(self, tokens) -> np.ndarray:
        """Every copy id of the given tokens (tokens assumed valid)."""
        t = np.asarray(tokens, dtype=np.int64)
        lo = self.tok_ptr[t]
        return self.tok_copy[concat_ranges(lo, self.tok_ptr[t + 1] - lo)]

    @property
    def replication(self) -> float:
        """Copies per token (M / S)."""
        return self.num_copies / max(self.num_tokens, 1)

    @errors.boundary
    def cluster_info(self, cid: int) -> dict:
        """JSON-ready description of one cluster (for ``info.json`` and the CLI)."""
        cid = self.check_cluster(cid)
        lo, hi = int(self.members_ptr[cid]), int(self.members_ptr[cid + 1])
        toks = self.members[lo:hi]
        copies = self.tok_ptr[toks + 1] - self.tok_ptr[toks]
        exts = []
        for d in range(self.ndisks):
            c = int(self.counts[cid, d])
            if c:
                exts.append({"disk": d, "offset": int(self.extent_off[cid, d]),
                             "entries": c, "bytes": c * self.entry_bytes,
                             "xxh3": f"{int(self.extent_xxh[cid, d]):016x}"})
        return {
            "layer": self.layer, "cluster": cid, "size": hi - lo,
            "medoid_token": int(self.medoid[cid]),
            "start_disk": int(self.start_disk[cid]),
            "bytes": (hi - lo) * self.entry_bytes,
            "hot": bool(self.hot[cid]), "frequency": float(self.freq[cid]),
            "extents": exts,
            "replicated_entries": int((copies > 1).sum()),
        }
