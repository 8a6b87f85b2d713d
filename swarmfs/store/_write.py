"""Writing: input validation, free-space bookkeeping, and the write
transaction that stages, writes and commits a layer.

:class:`Transaction` is one write of a store: it holds the store's write
lock (threads of one Store wait, another process gets an error) from the
moment it re-reads the committed manifest to its commit, keeps the
generation's free-extent bookkeeping (where each disk's new segment goes,
what the commit stops referencing), stages and writes the extents
(checksummed, batched), and commits: index file, prepared commit records,
the manifest, the records marked committed.  A transaction that fails
commits nothing and gives growing file disks back their space.  ``Store``
creates it (``Store.write_layer``, ``Store.append``) and is told of the
manifests it adopts and commits through two callbacks; nothing here reaches
into the Store's private state.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import types
import warnings
from collections.abc import Sequence
from typing import Literal, cast

import msgspec
import numpy as np

from .. import _errors as E
from .. import _validate as V
from . import _format as F
from ._disks import truncate_to, write_commit_records
from ._engine import WRITE
from ._index import concat_ranges, unique_ints
from ._kernels import scatter_rows, xxh3_ranges, xxh3_rows
from ._manifest import LAYER_RECORD_KEYS, IndexRecord, LayerRecord, Manifest, read_manifest
from ._placement import PLACEMENTS, copy_locations, place_clusters

__all__ = ["as_bytes_rows", "clusters_csr", "chunk_bounds", "append_tokens", "allocate",
           "free_extents", "check_finite", "check_layer_input", "Transaction", "write_layer"]

#: a range freed by commit f is reused from commit f + REUSE_AFTER on: the
#: committed manifest (f + 1 onwards) and the previous one, whose index files
#: are kept for readers, never reference it
REUSE_AFTER = 2

_EXP_MASK = {2: (np.uint16, 0x7C00), 4: (np.uint32, 0x7F800000)}


def check_finite(rows: np.ndarray, dtype_name: str, entry_shape: tuple, *, layer=None,
                 store=None, first_token: int = 0) -> None:
    """Refuse NaN or infinite K/V values (one NaN key would poison every
    medoid score).  Works on the raw bytes: an all-ones exponent field.

    Raises:
        ShapeError: naming the layer, the first bad token, K or V, and the
            KV head.
    """
    if dtype_name == "bfloat16":
        ut, mask = np.uint16, 0x7F80
    else:
        ut, mask = _EXP_MASK[F.DTYPES[dtype_name]]
    bits = rows.view(ut)
    bad = (bits & ut(mask)) == ut(mask)
    if not bad.any():
        return
    r, c = np.argwhere(bad)[0]
    per = bits.shape[1] // 2
    kv = "K" if c < per else "V"
    head = (c % per) // entry_shape[2]
    raise E.ShapeError(f"{kv} of token {first_token + int(r)} (KV head {int(head)}) is NaN "
                       f"or infinite; refusing to store non-finite values "
                       f"({int(bad.any(axis=1).sum())} token(s) affected)",
                       store=store, layer=layer)


def _reusable(r, gen: int, oldest_reader: int | None = None) -> bool:
    """A range freed by commit r[2] may be written by commit ``gen``: the two
    newest manifests do not reference it, and no open reader holds a
    generation older than r[2] (which could)."""
    return r[2] + REUSE_AFTER <= gen and (oldest_reader is None or r[2] <= oldest_reader)


def allocate(disks: Sequence, seg: np.ndarray, gen: int,
             oldest_reader: int | None = None) -> tuple[np.ndarray, list]:
    """Where each disk's contiguous segment of ``seg[d]`` bytes goes: the
    smallest reusable free range that holds it (best fit), else the disk's
    end.  Only space no committed manifest references is handed out.

    Args:
        disks: the manifest's disk records (:class:`DiskRecord`, or their
            JSON dicts).
        seg: uint64 [N] bytes needed per disk (block aligned).
        gen: the generation being written.
        oldest_reader: the oldest generation an open Store still reads
            (None: no reader).

    Returns:
        (uint64 [N] base offset per disk, new disk records of the same kind
        with ``end`` and ``free`` updated; the caller's are not changed).
    """
    base = np.zeros(len(disks), dtype=np.uint64)
    out = []
    for d, rec in enumerate(disks):
        end, free = _end_free(rec)
        need = int(seg[d])
        fit = [k for k, r in enumerate(free) if _reusable(r, gen, oldest_reader) and
               r[1] >= need] \
            if need else []
        if fit:
            k = min(fit, key=lambda k: free[k][1])
            base[d] = free[k][0]
            if free[k][1] == need:
                free.pop(k)
            else:
                free[k] = [free[k][0] + need, free[k][1] - need, free[k][2]]
        else:
            base[d] = end
            end += need
        out.append(_with_end_free(rec, end, free))
    return base, out


def free_extents(disks: Sequence, cc, dd, off, nbytes, gen: int, block_size: int,
                 oldest_reader: int | None = None) -> list:
    """Add extents (disk ``dd``, offset ``off``, ``nbytes`` of entries) that
    commit ``gen`` stops referencing to the disks' free lists (sorted,
    adjacent ranges merged), and give back reusable space at a disk's end.
    Returns new disk records of the kind given (:class:`DiskRecord` or dicts)."""
    bs = int(block_size)
    out = []
    for d, rec in enumerate(disks):
        sel = np.flatnonzero(np.asarray(dd) == d)
        end, free = _end_free(rec)
        for k in sel:
            ln = -(-int(nbytes[k]) // bs) * bs
            if ln:
                free.append([int(off[k]), ln, int(gen)])
        # reusable ranges lose their generation (0), so they merge with each
        # other; a range still in quarantine merges only with its own kind
        free = sorted([r[0], r[1], 0 if _reusable(r, gen, oldest_reader) else r[2]]
                      for r in free)
        merged: list[list[int]] = []
        for r in free:
            if merged and merged[-1][0] + merged[-1][1] == r[0] and merged[-1][2] == r[2]:
                merged[-1][1] += r[1]
            else:
                merged.append(r)
        while merged and merged[-1][0] + merged[-1][1] >= end and \
                _reusable(merged[-1], gen, oldest_reader):
            end = merged.pop()[0]
        out.append(_with_end_free(rec, end, merged))
    return out


def _end_free(rec) -> tuple[int, list]:
    """A disk record's end and a mutable copy of its free ranges."""
    if isinstance(rec, dict):
        return int(rec["end"]), [list(r) for r in rec.get("free", [])]
    return rec.end, [list(r) for r in rec.free]


def _with_end_free(rec, end: int, free: list):
    if isinstance(rec, dict):
        return {**rec, "end": end, "free": free}
    return msgspec.structs.replace(rec, end=end, free=tuple(tuple(r) for r in free))

WRITE_CHUNK = 64 << 20      # bytes of staged layer data per write batch
WRITE_REQUEST = 1 << 20     # bytes per write request


def as_bytes_rows(kv, entry_shape: tuple, dtype_name: str, *, layer=None,
                   store=None, first_token: int = 0) -> np.ndarray:
    """KV array [S, 2, H, d] (numpy or torch) -> uint8 [S, entry_bytes] view.

    Raises:
        ShapeError: wrong dtype or shape, no tokens, or a NaN/inf value
            (naming the token, counted from ``first_token``).
    """
    want = F.numpy_dtype(dtype_name)
    if hasattr(kv, "detach"):  # torch
        import torch
        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16,
               "float32": torch.float32}[dtype_name]
        if kv.dtype != tdt:
            raise E.ShapeError(f"KV dtype {kv.dtype} does not match the store dtype "
                               f"{dtype_name}", store=store, layer=layer)
        shape = tuple(kv.shape)
        arr = kv.detach().cpu().contiguous().view(torch.uint8).numpy()
    else:
        try:
            arr = np.asarray(kv)
        except (ValueError, TypeError) as exc:
            raise E.ShapeError(f"KV is not an array: {exc}", store=store,
                               layer=layer) from None
        if arr.dtype != want:
            raise E.ShapeError(f"KV dtype {arr.dtype} does not match the store dtype "
                               f"{dtype_name}", store=store, layer=layer)
        shape = arr.shape
        arr = np.ascontiguousarray(arr)
    if len(shape) != 4 or tuple(shape[1:]) != entry_shape:
        raise E.ShapeError(f"KV shape {tuple(shape)} is not "
                           f"[S, {', '.join(map(str, entry_shape))}]", store=store, layer=layer)
    if shape[0] == 0:
        raise E.ShapeError("KV array has no tokens", store=store, layer=layer)
    rows = arr.reshape(shape[0], -1).view(np.uint8)
    check_finite(rows, dtype_name, entry_shape, layer=layer, store=store,
                 first_token=first_token)
    return rows


def clusters_csr(clusters, *, layer=None, store=None) -> tuple[np.ndarray, np.ndarray]:
    """Clusters as CSR ``(ptr int64 [C+1], members int64 [M])`` from a
    ``(ptr, members)`` pair or a list of C int arrays.

    Raises:
        ShapeError, InvalidArgumentError: not one of those forms.
    """
    kw = dict(store=store, layer=layer)
    if isinstance(clusters, tuple) and len(clusters) == 2:
        ptr = V.parse_indices(clusters[0], "cluster pointers", **kw)
        members = V.parse_indices(clusters[1], "cluster members", **kw)
    else:
        try:
            lists = [V.parse_indices(c, "cluster members", **kw) for c in clusters]
        except E.SwarmError:
            raise
        except TypeError:
            raise E.ShapeError("clusters must be a CSR (ptr, members) or a list of token "
                               "arrays", **kw) from None
        ptr = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in lists], out=ptr[1:])
        members = np.concatenate(lists) if lists else np.empty(0, np.int64)
    if ptr.ndim != 1 or ptr.shape[0] < 2 or ptr[0] != 0 or ptr[-1] != members.shape[0]:
        raise E.ShapeError("clusters must be a non-empty CSR (ptr, members) or list",
                           store=store, layer=layer)
    if np.any(np.diff(ptr) <= 0):
        c = int(np.flatnonzero(np.diff(ptr) <= 0)[0])
        raise E.ShapeError("clusters must not be empty", store=store, layer=layer,
                           cluster=c)
    return ptr, members


def chunk_bounds(sizes: np.ndarray, limit: int) -> np.ndarray:
    """Cut points [0, ..., n] splitting items of ``sizes`` bytes into
    consecutive groups of about ``limit`` bytes (an item larger than the limit
    forms its own group)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    n = sizes.shape[0]
    if n == 0:
        return np.array([0], dtype=np.int64)
    group = (np.cumsum(sizes) - 1) // max(int(limit), 1)
    cuts = np.flatnonzero(np.diff(group)) + 1
    return np.concatenate([[0], cuts, [n]]).astype(np.int64)



def _non_string_key(x):
    """(where, key) of the first key of a dict inside ``x`` that is not a
    string, or None.  JSON turns such a key into text (1 -> "1"), so it would
    not read back as written, and two keys could become one."""
    stack = [(x, "")]
    while stack:
        v, where = stack.pop()
        if isinstance(v, dict):
            for k, w in v.items():
                if not isinstance(k, str):
                    return where, k
                stack.append((w, f"{where}[{k!r}]"))
        elif isinstance(v, (list, tuple)):
            stack.extend((w, f"{where}[{i}]") for i, w in enumerate(v))
    return None


def check_layer_input(kv, clusters, medoids, hot, freq, extra, placement, *,
                      entry_shape: tuple, dtype: str, layer: int, store=None):
    """Check the arguments of :meth:`Store.write_layer` (see there) before
    anything is written.

    Returns:
        (rows uint8 [S, entry_bytes], ptr int64 [C+1], members int [M],
        medoids int [C], hot uint8 [C], freq float32 [C]).

    Raises:
        ShapeError: kv shape/dtype, cluster definitions, medoids, hot, freq
            or extra are wrong.
        InvalidChoiceError: an unknown placement.
    """
    if extra is not None:
        if not isinstance(extra, dict):
            raise E.ShapeError(f"extra must be a dict, got {type(extra).__name__}",
                               store=store, layer=layer)
        clash = sorted(set(extra) & LAYER_RECORD_KEYS)
        if clash:
            raise E.ShapeError(f"extra may not set the layer record's own fields {clash} "
                               "(use the keyword arguments)", store=store, layer=layer)
        if F.json_depth(extra, 16) > 16:
            raise E.ShapeError("extra is nested deeper than 16 levels (or contains "
                               "itself)", store=store, layer=layer)
        bad = _non_string_key(extra)
        if bad is not None:
            raise E.ShapeError(f"extra's keys must be strings (JSON object keys), got "
                               f"{bad[1]!r} in extra{bad[0]}"[:300], store=store, layer=layer)
        try:
            json.dumps(extra, allow_nan=False)      # NaN/inf are not JSON: refused too
        except (TypeError, ValueError) as exc:
            raise E.ShapeError(f"extra is not JSON-serialisable: {exc}",
                               store=store, layer=layer) from None
    rows = as_bytes_rows(kv, entry_shape, dtype, layer=layer, store=store)
    S = rows.shape[0]
    ptr, members = clusters_csr(clusters, layer=layer, store=store)
    C = ptr.shape[0] - 1
    if members.min() < 0 or members.max() >= S:
        raise E.ShapeError(f"a cluster member is outside [0, {S})", store=store,
                           layer=layer)
    if np.bincount(members, minlength=S).min() == 0:
        t = int(np.flatnonzero(np.bincount(members, minlength=S) == 0)[0])
        raise E.ShapeError(f"token {t} is in no cluster (every entry must be stored)",
                           store=store, layer=layer)
    cl = np.repeat(np.arange(C), np.diff(ptr))
    key = cl * np.int64(S) + members
    if np.unique(key).shape[0] != key.shape[0]:
        raise E.ShapeError("a token appears twice in one cluster", store=store,
                           layer=layer)
    medoids = (members[ptr[:-1]] if medoids is None
               else V.parse_indices(medoids, "medoids", store=store, layer=layer))
    if medoids.shape[0] != C:
        raise E.ShapeError(f"{medoids.shape[0]} medoids for {C} clusters",
                           store=store, layer=layer)
    is_med = members == medoids[cl]
    if np.bincount(cl[is_med], minlength=C).min() == 0:
        c = int(np.flatnonzero(np.bincount(cl[is_med], minlength=C) == 0)[0])
        raise E.ShapeError("medoid is not a member of its cluster", store=store,
                           layer=layer, cluster=c)
    if hot is None:
        hot = np.zeros(C, np.uint8)
    else:
        hot = np.asarray(hot).reshape(-1)
        if hot.size and (hot.dtype.kind not in "biu" or not np.isin(hot, (0, 1)).all()):
            raise E.ShapeError("hot must be a boolean (0/1) mask", store=store,
                               layer=layer)
        hot = hot.astype(np.uint8)
    try:
        freq = np.zeros(C, np.float32) if freq is None else \
            np.asarray(freq, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError):
        raise E.ShapeError("freq must be numbers", store=store, layer=layer) from None
    if freq.size and (not np.isfinite(freq).all() or freq.min() < 0):
        raise E.ShapeError("freq must be finite and >= 0", store=store, layer=layer)
    V.parse_choice(placement, "placement", PLACEMENTS, store=store, layer=layer)
    if hot.shape[0] != C or freq.shape[0] != C:
        raise E.ShapeError("hot and freq need one value per cluster", store=store,
                           layer=layer)

    return rows, ptr, members, medoids, hot, freq


class Transaction:
    """One write of a store: the write lock's hold, the generation's
    free-extent bookkeeping, staging and writing extents, and the commit.

    Use as a context manager.  Entering takes the store's write lock
    (``writer_mutex`` for threads of one Store, ``flock`` on
    ``STORE/.lock`` for other processes: a second writing process gets a
    SwarmError) and re-reads the committed manifest, so a writer always
    extends the latest state; ``adopt(manifest)`` lets the Store take it.
    :meth:`place` and :meth:`free` keep the new generation's disk records,
    :meth:`write_extents` stages and writes, :meth:`commit` makes one layer's
    new index the committed state and calls ``publish(manifest, layer)``.
    Leaving with an exception before the commit gives growing file disks
    back the space the transaction allocated; nothing it wrote is
    referenced.  Leaving releases the lock.

    Concurrency: one transaction per store at a time (the lock); readers
    of the store run concurrently and keep reading the generation they
    hold (the space it references is not reused while a lease holds it).

    Args:
        path: the store directory.
        fds: the disks' file descriptors (opened read-write).
        engine: the store's :class:`Engine`.
        staging: callable(nbytes) -> context manager yielding a staging
            buffer (the executor's pool).
        lease: the Store's :class:`ReaderLease` (oldest reader, claims).
        writer_mutex: the Store's writer lock (threads).
        disk_paths: the disks' paths (named in errors).
        adopt: callable(Manifest): the committed manifest re-read under the
            lock (the Store checks it is still its store and takes it).
        publish: callable(Manifest, layer): the manifest just committed.
        is_open: callable() -> bool: False once the store is closed (checked
            under the writer mutex, which ``Store.close`` also takes).
        check_base: callable(Manifest): raises unless every live extent lies
            inside the base manifest's allocated space (the Store loads every
            layer's index).

    Attributes:
        base: the committed manifest the write extends.
        generation: the generation being written (``base.generation + 1``).
        disks: the new generation's disk records (ends, free ranges).
    """

    def __init__(self, path: str, *, fds, engine, staging, lease, writer_mutex,
                 disk_paths, adopt, publish, is_open=lambda: True,
                 check_base=lambda m: None):
        self.path = path
        self._fds = fds
        self._engine = engine
        self._staging = staging
        self._lease = lease
        self._mutex = writer_mutex
        self._disk_paths = disk_paths
        self._adopt = adopt
        self._publish = publish
        self._is_open = is_open
        self._check_base = check_base
        self._lock_fd: int | None = None
        self.base: Manifest | None = None
        self.committed: Manifest | None = None
        self.generation = 0
        self.disks: tuple = ()

    # -- the lock ----------------------------------------------------------------
    def __enter__(self) -> Transaction:
        if self.base is not None:
            raise E.InternalError("a write transaction is entered once", store=self.path)
        self._mutex.acquire()
        if not self._is_open():     # closed while this writer waited: its fds are gone
            self._mutex.release()
            raise E.SwarmError("the store is closed", store=self.path)
        try:
            fd = os.open(os.path.join(self.path, ".lock"),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._lock_fd = fd
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise E.SwarmError("another process is writing this store",
                                   store=self.path) from None
            m = read_manifest(self.path)
            self._adopt(m)
            self._check_base(m)     # live extents agree with m's allocation
            self.base = m
            self.generation = m.generation + 1
            self.disks = m.disks
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(self, et, exc, tb) -> None:
        try:
            if et is not None and self.committed is None and self.base is not None:
                # nothing this transaction wrote is referenced
                truncate_to(self._fds, self.base)
        finally:
            self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._mutex.release()

    # -- free-extent bookkeeping -------------------------------------------------
    @property
    def base_manifest(self) -> Manifest:
        """:attr:`base`, which an entered transaction has."""
        if self.base is None:
            raise E.InternalError("the write transaction is not entered", store=self.path)
        return self.base

    @property
    def entry_bytes(self) -> int:
        """Bytes of one KV entry (2 x KV heads x head_dim x dtype size)."""
        return self.base_manifest.model.entry_bytes

    @property
    def num_disks(self) -> int:
        """N, the number of disks of the store."""
        return len(self.base_manifest.disks)

    def place(self, sizes, *, p_global: int, start=None, policy="eq7", layer=None):
        """Eq. 7 placement of clusters of ``sizes`` entries, each disk's
        share in one contiguous segment taken from reusable free space or
        the disk's end (updates :attr:`disks`); checks capacity.

        Returns:
            The :class:`Placement`.

        Raises:
            DiskFullError: a disk's capacity would be exceeded (nothing written).
        """
        N = self.num_disks
        kw = dict(ndisks=N, entry_bytes=self.entry_bytes, block_size=self.base_manifest.block_size,
                  p_global=p_global, policy=policy, start=start)
        pl0 = place_clusters(sizes, disk_end=np.zeros(N, np.uint64), **kw)
        base, disks = allocate(self.disks, pl0.disk_end, self.generation,
                               self._lease.oldest_reader())
        pl = place_clusters(sizes, disk_end=base, **kw)
        for i, d in enumerate(disks):
            if d.capacity and d.end > d.capacity:
                raise E.DiskFullError(f"layer needs bytes up to {d.end} but the "
                                      f"disk holds {d.capacity}", disk=i,
                                      path=self._disk_paths[i], store=self.path, layer=layer)
        self.disks = tuple(disks)
        return pl

    def free(self, cc, dd, off, nbytes) -> None:
        """Extents (cluster ``cc``, disk ``dd``, offset ``off``, ``nbytes``
        of entries) this commit stops referencing join the free lists."""
        self.disks = tuple(free_extents(self.disks, cc, dd, off, nbytes, self.generation,
                                        self.base_manifest.block_size,
                                        self._lease.oldest_reader()))

    # -- writing -------------------------------------------------------------------
    def write_extents(self, rows, ptr, members, pl, layer) -> np.ndarray:
        """Stage and write all extents of a layer in batches of clusters (about
        ``WRITE_CHUNK`` bytes each, requests of ``WRITE_REQUEST`` bytes); returns
        the XXH3-64 of every extent, uint64 [C, N]."""
        N, Eb = self.num_disks, self.entry_bytes
        C = ptr.shape[0] - 1
        ext = pl.extent_bytes
        cl_bytes = ext.sum(axis=1)
        extent_xxh = np.zeros((C, N), dtype=np.uint64)
        cuts = chunk_bounds(cl_bytes, WRITE_CHUNK)
        for c0, c1 in zip(cuts[:-1], cuts[1:], strict=True):
            c0, c1 = int(c0), int(c1)
            lo = pl.extent_off[c0]
            hi = pl.extent_off[c1 - 1] + ext[c1 - 1]
            seg = hi - lo
            base = np.zeros(N, dtype=np.uint64)
            np.cumsum(seg[:-1], out=base[1:])
            total = int(seg.sum())
            with self._staging(total) as buf:
                buf.array[:total] = 0
                m0, m1 = int(ptr[c0]), int(ptr[c1])
                sub_ptr = ptr[c0:c1 + 1] - m0
                _, cdisk, coff = copy_locations(sub_ptr, pl.start_disk[c0:c1],
                                                pl.extent_off[c0:c1], ndisks=N,
                                                entry_bytes=Eb)
                dst = base[cdisk] + (coff - lo[cdisk])
                scatter_rows(buf.array, dst, rows, members[m0:m1], Eb)
                cnt = pl.counts[c0:c1]
                has = cnt > 0
                cc, dd = np.nonzero(has)
                off_in = base[dd] + (pl.extent_off[c0:c1][cc, dd] - lo[dd])
                extent_xxh[c0 + cc, dd] = xxh3_ranges(
                    buf.array, off_in, cnt[cc, dd].astype(np.uint64) * np.uint64(Eb))
                # requests: each disk's segment in pieces of WRITE_REQUEST bytes
                npieces = (seg + np.uint64(WRITE_REQUEST - 1)) // np.uint64(WRITE_REQUEST)
                rd = np.repeat(np.arange(N), npieces.astype(np.int64))
                k = np.arange(rd.shape[0]) - np.repeat(np.cumsum(npieces) - npieces,
                                                       npieces.astype(np.int64)).astype(np.int64)
                roff = lo[rd] + k.astype(np.uint64) * np.uint64(WRITE_REQUEST)
                rlen = np.minimum(np.uint64(WRITE_REQUEST), hi[rd] - roff)
                rdst = base[rd] + (roff - lo[rd])
                self._engine.execute(WRITE, rd, roff, rlen, rdst, buf, layer=layer)
        return extent_xxh

    def sync(self) -> None:
        """fdatasync every disk (the data before the commit that references it)."""
        for fd in self._fds:
            os.fdatasync(fd)

    # -- the commit -------------------------------------------------------------------
    def commit(self, layer: int, arrays: dict, *, p_global: int,
               local_window: int | None = None, extra: dict | None = None,
               representative: str | None = None) -> Manifest:
        """Make a layer's new arrays the committed state: index file (fsync),
        prepared commit records on every disk (fdatasync), the manifest
        (atomic rename), then the records marked committed.  The data must
        be on the disks (:meth:`sync`).  The layer record keeps its previous
        ``local_window``, ``representative`` and extra fields unless given.

        Returns:
            The committed manifest (also passed to ``publish``).

        Raises:
            ShapeError: the manifest would not pass the loader (nothing
                committed).
            DiskFullError, IOFailedError: writing the index or manifest failed.
        """
        if self.base is None or self._lock_fd is None or self.committed is not None:
            raise E.InternalError("commit outside an open write transaction, or twice",
                                  store=self.path, layer=layer)
        m = self.base
        gen = self.generation
        meta = dict(uuid=m.uuid, num_disks=self.num_disks, dtype=m.model.dtype,
                    num_kv_heads=m.model.num_kv_heads, head_dim=m.model.head_dim,
                    entry_bytes=m.model.entry_bytes)
        F.remove_uncommitted_indexes(self.path, gen)
        try:
            rec = F.save_index(self.path, layer, gen, arrays, meta=meta)
        except OSError as exc:
            raise _metadata_error(exc, self.path, layer) from exc
        index_path = os.path.join(self.path, F.INDEX_DIR, rec["file"])
        old = m.layers.get(layer)
        S = int(arrays["token_xxh"].shape[0])
        M = int(arrays["members"].shape[0])
        if local_window is None:
            local_window = old.local_window if old is not None else m.local_window
        if representative is None:
            representative = old.representative if old is not None else "medoid"
        layers = dict(m.layers)
        layers[layer] = LayerRecord(
            num_tokens=S, num_clusters=int(arrays["members_ptr"].shape[0] - 1),
            num_copies=M, replication=round(M / S, 6), local_window=int(local_window),
            hot_clusters=int(np.asarray(arrays["hot"]).sum()),
            index=_index_record(rec), generation=gen,
            representative=cast(Literal["medoid", "centroid"], representative),
            extra=types.MappingProxyType({**(old.extra if old is not None else {}),
                                          **(extra or {})}))
        new = msgspec.structs.replace(m, generation=gen, p_global=int(p_global),
                                      disks=tuple(self.disks),
                                      layers=types.MappingProxyType(layers))
        keep = {r.index.file for r in new.layers.values()}
        if old is not None:
            keep.add(old.index.file)   # readers of the previous generation
        sealed = F.seal_manifest(new.to_dict())
        try:
            # never commit what open() would refuse: the one loader checks it
            new = Manifest.load(sealed, self.path)
        except E.ManifestError as exc:
            with contextlib.suppress(OSError):
                os.unlink(index_path)
            raise E.ShapeError(f"refusing to commit layer {layer}: {exc}", store=self.path,
                               layer=layer) from None
        uid = bytes.fromhex(new.uuid)
        try:
            write_commit_records(self._engine, self._fds, uid, new, F.PREPARED)
            F.write_sealed_manifest(self.path, sealed)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(index_path)
            if isinstance(exc, OSError):
                raise _metadata_error(exc, self.path, layer) from exc
            raise
        self.committed = new
        self._publish(new, layer)
        try:
            write_commit_records(self._engine, self._fds, uid, new, F.COMMITTED)
        except (E.SwarmError, OSError) as exc:   # committed already; only weaker checks
            warnings.warn(f"generation {gen} is committed but marking it on the disks "
                          f"failed: {exc}", stacklevel=4)
        F.remove_stale_indexes(self.path, keep)
        return new


def _index_record(rec: dict) -> IndexRecord:
    return IndexRecord(file=rec["file"], xxh3=rec["xxh3"], bytes=rec["bytes"])


def _metadata_error(exc: OSError, store, layer) -> E.SwarmError:
    """An OSError while writing the index or manifest, as a SwarmError."""
    import errno
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return E.DiskFullError(f"no space for the index or manifest in the store "
                               f"directory: {exc.strerror}", store=store, layer=layer)
    return E.IOFailedError(f"cannot write the index or manifest: {exc.strerror}",
                           errno=exc.errno, store=store, layer=layer)


#: what an index's ``medoid_keys`` may hold per cluster (``LayerRecord.representative``)
REPRESENTATIVES = ("medoid", "centroid")


def representative_keys(rows, ptr, local, medoid_rows, kind: str, dtype: str) -> np.ndarray:
    """Each cluster's representative key, as the index's ``medoid_keys`` rows.

    Args:
        rows: uint8 [R, entry_bytes] entries (K first, then V).
        ptr: int64 [C+1] cluster offsets into ``local``.
        local: int [M] row of each cluster member.
        medoid_rows: int [C] row of each cluster's medoid.
        kind: ``"medoid"`` (SWARM §5.2: the medoid's K bytes) or
            ``"centroid"`` (the mean K of the members, accumulated in
            float32 and rounded to the store dtype).
        dtype: the store dtype's name.

    Returns:
        uint8 [C, entry_bytes // 2], contiguous.
    """
    half = rows.shape[1] // 2
    if kind == "medoid":
        return np.ascontiguousarray(rows[medoid_rows, :half])
    nd = F.numpy_dtype(dtype)
    k = np.ascontiguousarray(rows[:, :half]).view(nd).astype(np.float32)
    sums = np.add.reduceat(k[np.asarray(local, np.int64)], ptr[:-1], axis=0)
    mean = sums / np.diff(ptr).astype(np.float32)[:, None]
    return np.ascontiguousarray(mean.astype(nd)).view(np.uint8)


def write_layer(tx: Transaction, old, layer: int, rows, ptr, members, medoids, hot, freq,
                local_window, extra, placement, representative: str = "medoid") -> Manifest:
    """The work of :meth:`Store.write_layer` inside transaction ``tx``
    (arguments checked): place, write, sync, free the layer's previous
    extents (``old``: its :class:`LayerIndex`, or None), commit."""
    Eb = tx.entry_bytes
    token_xxh = xxh3_rows(rows, Eb)
    medoid_keys = representative_keys(rows, ptr, members, medoids, representative,
                                      tx.base_manifest.model.dtype)
    pl = tx.place(np.diff(ptr), p_global=tx.base_manifest.p_global, policy=placement, layer=layer)
    extent_xxh = tx.write_extents(rows, ptr, members, pl, layer)
    tx.sync()
    if old is not None:
        # the layer's previous extents are no longer referenced
        oc, od = np.nonzero(old.counts > 0)
        tx.free(oc, od, old.extent_off[oc, od], old.counts[oc, od] * Eb)
    arrays = dict(members_ptr=ptr, members=members, medoid=medoids,
                  start_disk=pl.start_disk, extent_off=pl.extent_off,
                  extent_xxh=extent_xxh, token_xxh=token_xxh,
                  medoid_keys=medoid_keys, hot=hot, freq=freq)
    return tx.commit(layer, arrays, p_global=pl.p_global,
                     local_window=local_window if local_window is not None
                     else tx.base_manifest.local_window, extra=extra,
                     representative=representative)


def append_tokens(store, layer: int, kv, joins, *, new_cluster_size: int,
                  expect_tokens: int | None = None, medoids=None, begin) -> np.ndarray:
    """The work of :meth:`Store.append` (see there): new cluster table, rows of
    the clusters that grow (read back, verified) and of the new entries,
    copy-on-write extents keeping each cluster's start disk, one commit.

    ``store`` is read through its public API only (``layer``,
    ``read_entries``, its shape attributes); ``begin()`` starts the
    :class:`Transaction` that writes and commits."""
    new_cluster_size = V.parse_positive_int(new_cluster_size, "new_cluster_size",
                                            store=store.path, layer=layer)
    if expect_tokens is not None:
        expect_tokens = V.parse_nonneg_int(expect_tokens, "expect_tokens", store=store.path,
                                           layer=layer)
    with begin() as tx:       # the whole append sees one committed state
        return _append_locked(tx, store, layer, kv, joins,
                              new_cluster_size=int(new_cluster_size),
                              expect_tokens=expect_tokens, medoids=medoids)


def _new_medoids(medoids, lone, gid, k_new: int, S: int, n: int, path, layer) -> np.ndarray:
    """``Store.append``'s ``medoids`` checked: int64 [k_new], each a token of
    its own new cluster (new token ``lone[i]`` is in cluster ``gid[i]``)."""
    m = np.asarray(medoids)
    if m.dtype.kind not in "iu" or m.shape != (k_new,):
        raise E.ShapeError(f"medoids must give one token position per new cluster "
                           f"({k_new}), got {m.dtype} {m.shape}", store=path, layer=layer)
    m = m.astype(np.int64)
    grp = np.full(n, -1, np.int64)
    grp[lone] = gid
    rel = m - S
    if k_new and (rel.min() < 0 or rel.max() >= n or
                  np.any(grp[np.clip(rel, 0, n - 1)] != np.arange(k_new))):
        raise E.ShapeError("each medoid must be one of its own new cluster's tokens",
                           store=path, layer=layer)
    return m


def _append_locked(tx: Transaction, store, layer: int, kv, joins, *, new_cluster_size: int,
                   expect_tokens: int | None, medoids=None) -> np.ndarray:
    li = store.layer(layer)
    if expect_tokens is not None and li.num_tokens != expect_tokens:
        raise E.SwarmError(
            f"layer holds {li.num_tokens} tokens, expected {expect_tokens}: another writer "
            "appended since this one read it", store=store.path, layer=layer)
    rows_new = as_bytes_rows(kv, store.entry_shape, store.dtype, layer=layer, store=store.path,
                             first_token=li.num_tokens)
    n = rows_new.shape[0]
    S, C = li.num_tokens, li.num_clusters
    if joins is None:
        jptr, jcl = np.zeros(n + 1, np.int64), np.empty(0, np.int64)
    elif isinstance(joins, tuple):
        jptr = V.parse_indices(joins[0], "joins pointers", store=store.path, layer=layer)
        jcl = V.parse_indices(joins[1], "joined clusters", store=store.path, layer=layer)
    else:
        if isinstance(joins, (str, bytes, dict)) or not hasattr(joins, "__iter__"):
            raise E.InvalidArgumentError(f"joins must be a CSR (ptr, clusters) or a list of "
                                         f"cluster lists, got {joins!r}"[:200],
                                         store=store.path, layer=layer)
        lists = [V.parse_indices(j, "joined clusters", store=store.path, layer=layer)
                 for j in joins]
        jptr = np.zeros(len(lists) + 1, np.int64)
        np.cumsum([x.shape[0] for x in lists], out=jptr[1:])
        jcl = np.concatenate(lists) if lists else np.empty(0, np.int64)
    if jptr.shape[0] != n + 1 or jptr[0] != 0 or jptr[-1] != jcl.shape[0] or \
            np.any(np.diff(jptr) < 0):
        raise E.ShapeError(f"joins must list clusters for each of the {n} new tokens",
                           store=store.path, layer=layer)
    if jcl.size and (jcl.min() < 0 or jcl.max() >= C):
        raise E.OutOfRangeError(f"cluster {int(jcl[(jcl < 0) | (jcl >= C)][0])} does not "
                                "exist", store=store.path, layer=layer)
    jtok = np.repeat(np.arange(n, dtype=np.int64), np.diff(jptr))
    if unique_ints(jtok * C + jcl).shape[0] != jtok.shape[0]:
        raise E.ShapeError("a new token joins the same cluster twice", store=store.path,
                           layer=layer)
    # new clusters for tokens that join nothing: runs of `new_cluster_size` tokens
    lone = np.flatnonzero(np.diff(jptr) == 0)
    gid = np.arange(lone.shape[0]) // max(int(new_cluster_size), 1)
    k_new = int(gid[-1]) + 1 if lone.size else 0
    new_medoids = S + lone[np.searchsorted(gid, np.arange(k_new))]     # the first of each
    if medoids is not None:
        new_medoids = _new_medoids(medoids, lone, gid, k_new, S, n, store.path, layer)
    # the full new cluster table: old copies, then additions, then new clusters
    old_sizes = li.sizes
    add = np.bincount(jcl, minlength=C)
    grow = np.flatnonzero(add > 0)
    sizes = np.concatenate([old_sizes + add, np.bincount(gid, minlength=k_new)])
    ptr = np.zeros(C + k_new + 1, np.int64)
    np.cumsum(sizes, out=ptr[1:])
    members = np.empty(int(ptr[-1]), np.int64)
    members[ptr[li.copy_cluster] + li.copy_slot] = li.members
    order = np.argsort(jcl * (n + 1) + jtok, kind="stable")   # by cluster, then token
    jc, jt = jcl[order], jtok[order]
    rank = np.arange(jc.shape[0]) - np.searchsorted(jc, jc)
    members[ptr[jc] + old_sizes[jc] + rank] = S + jt
    members[ptr[C + gid] + (np.arange(lone.shape[0]) - np.searchsorted(gid, gid))] = S + lone
    # rows of every entry that is (re)written: old entries of growing clusters
    # are read back from the disks (verified), new ones come from kv
    write = np.concatenate([grow, np.arange(C, C + k_new)])
    w_copies = concat_ranges(ptr[write], sizes[write])
    w_tok = members[w_copies]
    old_tok = unique_ints(w_tok[w_tok < S])
    rows = np.empty((old_tok.shape[0] + n, store.entry_bytes), np.uint8)
    if old_tok.size:
        rows[:old_tok.shape[0]] = store.read_entries(layer, old_tok).reshape(
            old_tok.shape[0], -1).view(np.uint8)
    rows[old_tok.shape[0]:] = rows_new
    local = np.where(w_tok < S, np.searchsorted(old_tok, w_tok), old_tok.shape[0] + w_tok - S)
    w_sizes = sizes[write]
    w_ptr = np.zeros(write.shape[0] + 1, np.int64)
    np.cumsum(w_sizes, out=w_ptr[1:])
    p0 = tx.base_manifest.p_global
    start = np.concatenate([li.start_disk[grow],
                            place_clusters(sizes[C:], ndisks=store.num_disks,
                                           entry_bytes=store.entry_bytes,
                                           block_size=store.block_size,
                                           disk_end=np.zeros(store.num_disks, np.uint64),
                                           p_global=p0).start_disk])
    p_new = p0 + int(sizes[C:].sum())
    pl = tx.place(w_sizes, p_global=p0, start=start, layer=layer)
    xxh = tx.write_extents(rows, w_ptr, local, pl, layer)
    tx.sync()
    # the growing clusters' old extents are no longer referenced
    cnt = li.counts[grow]
    gc, gd = np.nonzero(cnt > 0)
    tx.free(grow[gc], gd, li.extent_off[grow[gc], gd], cnt[gc, gd] * store.entry_bytes)
    N = store.num_disks
    extent_off = np.concatenate([li.extent_off, np.zeros((k_new, N), np.uint64)])
    extent_xxh = np.concatenate([li.extent_xxh, np.zeros((k_new, N), np.uint64)])
    start_disk = np.concatenate([li.start_disk, start[grow.shape[0]:]]).astype(np.int32)
    extent_off[write] = pl.extent_off
    extent_xxh[write] = xxh
    medoid = np.concatenate([li.medoid, new_medoids])
    half = store.entry_bytes // 2
    medoid_keys = np.concatenate([li.medoid_keys, np.empty((k_new, half), np.uint8)])
    if tx.base_manifest.layers[layer].representative == "centroid":
        # every cluster that changed is rewritten from `rows`: its mean again, exactly
        medoid_keys[write] = representative_keys(rows, w_ptr, local, None, "centroid",
                                                 store.dtype)
    else:
        medoid_keys[C:] = rows_new[medoid[C:] - S, :half]
    arrays = dict(
        members_ptr=ptr, members=members, medoid=medoid, start_disk=start_disk,
        extent_off=extent_off, extent_xxh=extent_xxh,
        token_xxh=np.concatenate([li.token_xxh, xxh3_rows(rows_new, store.entry_bytes)]),
        medoid_keys=medoid_keys,
        hot=np.concatenate([li.hot, np.zeros(k_new, np.uint8)]),
        freq=np.concatenate([li.freq, np.zeros(k_new, np.float32)]))
    tx.commit(layer, arrays, p_global=p_new)
    return np.arange(S, S + n, dtype=np.int64)
