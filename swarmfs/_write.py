"""Writing a layer: input validation and batched extent writes."""

from __future__ import annotations

import os

import numpy as np

from . import _errors as E
from . import _format as F
from ._engine import WRITE, scatter_rows, xxh3_ranges, xxh3_rows
from ._index import concat_ranges
from .layout._place import copy_locations, place_clusters

__all__ = ["as_bytes_rows", "clusters_csr", "write_extents", "chunk_bounds", "append_tokens"]

WRITE_CHUNK = 64 << 20      # bytes of staged layer data per write batch
WRITE_REQUEST = 1 << 20     # bytes per write request


def as_bytes_rows(kv, entry_shape: tuple, dtype_name: str, *, layer=None,
                   store=None) -> np.ndarray:
    """KV array [S, 2, H, d] (numpy or torch) -> uint8 [S, entry_bytes] view."""
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
        arr = np.asarray(kv)
        if arr.dtype != want:
            raise E.ShapeError(f"KV dtype {arr.dtype} does not match the store dtype "
                               f"{dtype_name}", store=store, layer=layer)
        shape = arr.shape
        arr = np.ascontiguousarray(arr)
    if len(shape) != 4 or tuple(shape[1:]) != entry_shape:
        raise E.ShapeError(f"KV shape {tuple(shape)} is not [S, {', '.join(map(str, entry_shape))}]",
                           store=store, layer=layer)
    if shape[0] == 0:
        raise E.ShapeError("KV array has no tokens", store=store, layer=layer)
    return arr.reshape(shape[0], -1).view(np.uint8)


def clusters_csr(clusters, *, layer=None, store=None) -> tuple[np.ndarray, np.ndarray]:
    kw = dict(store=store, layer=layer)
    if isinstance(clusters, tuple) and len(clusters) == 2:
        ptr = E.as_int_array(clusters[0], "cluster pointers", **kw)
        members = E.as_int_array(clusters[1], "cluster members", **kw)
    else:
        try:
            lists = [E.as_int_array(c, "cluster members", **kw) for c in clusters]
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



def write_extents(store, rows, ptr, members, pl, layer) -> np.ndarray:
    """Stage and write all extents of a layer in batches of clusters (about
    ``WRITE_CHUNK`` bytes each, requests of ``WRITE_REQUEST`` bytes); returns
    the XXH3-64 of every extent, uint64 [C, N]."""
    N, Eb = store.num_disks, store.entry_bytes
    C = ptr.shape[0] - 1
    ext = pl.extent_bytes
    cl_bytes = ext.sum(axis=1)
    extent_xxh = np.zeros((C, N), dtype=np.uint64)
    cuts = chunk_bounds(cl_bytes, WRITE_CHUNK)
    for c0, c1 in zip(cuts[:-1], cuts[1:]):
        c0, c1 = int(c0), int(c1)
        lo = pl.extent_off[c0]
        hi = pl.extent_off[c1 - 1] + ext[c1 - 1]
        seg = hi - lo
        base = np.zeros(N, dtype=np.uint64)
        np.cumsum(seg[:-1], out=base[1:])
        total = int(seg.sum())
        with store._staging(total) as buf:
            buf.array[:total] = 0
            m0, m1 = int(ptr[c0]), int(ptr[c1])
            sub_ptr = ptr[c0:c1 + 1] - m0
            _, cdisk, coff = copy_locations(sub_ptr, pl.start_disk[c0:c1],
                                            pl.extent_off[c0:c1], ndisks=N, entry_bytes=Eb)
            dst = base[cdisk] + (coff - lo[cdisk])
            scatter_rows(buf.array, dst, rows, members[m0:m1], Eb)
            cnt = pl.counts[c0:c1]
            has = cnt > 0
            cc, dd = np.nonzero(has)
            off_in = base[dd] + (pl.extent_off[c0:c1][cc, dd] - lo[dd])
            extent_xxh[c0 + cc, dd] = xxh3_ranges(buf.array, off_in,
                                                  cnt[cc, dd].astype(np.uint64) * np.uint64(Eb))
            # requests: each disk's segment in pieces of WRITE_REQUEST bytes
            npieces = (seg + np.uint64(WRITE_REQUEST - 1)) // np.uint64(WRITE_REQUEST)
            rd = np.repeat(np.arange(N), npieces.astype(np.int64))
            k = np.arange(rd.shape[0]) - np.repeat(np.cumsum(npieces) - npieces,
                                                   npieces.astype(np.int64)).astype(np.int64)
            roff = lo[rd] + k.astype(np.uint64) * np.uint64(WRITE_REQUEST)
            rlen = np.minimum(np.uint64(WRITE_REQUEST), hi[rd] - roff)
            rdst = base[rd] + (roff - lo[rd])
            store.engine.execute(WRITE, rd, roff, rlen, rdst, buf, layer=layer)
    return extent_xxh


def append_tokens(store, layer: int, kv, joins, *, group: int,
                  expect_tokens: int | None = None) -> np.ndarray:
    """The work of :meth:`Store.append` (see there): new cluster table, rows of
    the clusters that grow (read back, verified) and of the new entries,
    copy-on-write extents keeping each cluster's start disk, one commit."""
    with store._write_lock():       # the whole append sees one committed state
        return _append_locked(store, layer, kv, joins, group=group,
                              expect_tokens=expect_tokens)


def _append_locked(store, layer: int, kv, joins, *, group: int,
                   expect_tokens: int | None) -> np.ndarray:

    self = store
    li = self.layer(layer)
    if expect_tokens is not None and li.num_tokens != expect_tokens:
        raise E.SwarmError(
            f"layer holds {li.num_tokens} tokens, expected {expect_tokens}: another writer "
            "appended since this one read it", store=self.path, layer=layer)
    rows_new = as_bytes_rows(kv, self.entry_shape, self.dtype, layer=layer, store=self.path)
    n = rows_new.shape[0]
    S, C = li.num_tokens, li.num_clusters
    if joins is None:
        jptr, jcl = np.zeros(n + 1, np.int64), np.empty(0, np.int64)
    elif isinstance(joins, tuple):
        jptr = E.as_int_array(joins[0], "joins pointers", store=self.path, layer=layer)
        jcl = E.as_int_array(joins[1], "joined clusters", store=self.path, layer=layer)
    else:
        lists = [E.as_int_array(j, "joined clusters", store=self.path, layer=layer)
                 for j in joins]
        jptr = np.zeros(len(lists) + 1, np.int64)
        np.cumsum([x.shape[0] for x in lists], out=jptr[1:])
        jcl = np.concatenate(lists) if lists else np.empty(0, np.int64)
    if jptr.shape[0] != n + 1 or jptr[0] != 0 or jptr[-1] != jcl.shape[0] or \
            np.any(np.diff(jptr) < 0):
        raise E.ShapeError(f"joins must list clusters for each of the {n} new tokens",
                           store=self.path, layer=layer)
    if jcl.size and (jcl.min() < 0 or jcl.max() >= C):
        raise E.OutOfRangeError(f"cluster {int(jcl[(jcl < 0) | (jcl >= C)][0])} does not "
                                "exist", store=self.path, layer=layer)
    jtok = np.repeat(np.arange(n, dtype=np.int64), np.diff(jptr))
    if np.unique(jtok * C + jcl).shape[0] != jtok.shape[0]:
        raise E.ShapeError("a new token joins the same cluster twice", store=self.path,
                           layer=layer)
    # new clusters for tokens that join nothing: runs of `group` tokens
    lone = np.flatnonzero(np.diff(jptr) == 0)
    gid = np.arange(lone.shape[0]) // max(int(group), 1)
    k_new = int(gid[-1]) + 1 if lone.size else 0
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
    old_tok = np.unique(w_tok[w_tok < S])
    rows = np.empty((old_tok.shape[0] + n, self.entry_bytes), np.uint8)
    if old_tok.size:
        rows[:old_tok.shape[0]] = self.read_entries(layer, old_tok).reshape(
            old_tok.shape[0], -1).view(np.uint8)
    rows[old_tok.shape[0]:] = rows_new
    local = np.where(w_tok < S, np.searchsorted(old_tok, w_tok), old_tok.shape[0] + w_tok - S)
    w_sizes = sizes[write]
    w_ptr = np.zeros(write.shape[0] + 1, np.int64)
    np.cumsum(w_sizes, out=w_ptr[1:])
    disk_end = np.array([d["end"] for d in self._m["disks"]], dtype=np.uint64)
    p0 = int(self._m["p_global"])
    start = np.concatenate([li.start_disk[grow],
                            place_clusters(sizes[C:], ndisks=self.num_disks,
                                           entry_bytes=self.entry_bytes,
                                           block_size=self.block_size,
                                           disk_end=disk_end, p_global=p0).start_disk])
    p_new = p0 + int(sizes[C:].sum())
    pl = place_clusters(w_sizes, ndisks=self.num_disks, entry_bytes=self.entry_bytes,
                        block_size=self.block_size, disk_end=disk_end, p_global=p0,
                        start=start)
    self._check_capacity(pl.disk_end, layer)
    xxh = write_extents(self, rows, w_ptr, local, pl, layer)
    for fd in self._fds:
        os.fdatasync(fd)
    N = self.num_disks
    extent_off = np.concatenate([li.extent_off, np.zeros((k_new, N), np.uint64)])
    extent_xxh = np.concatenate([li.extent_xxh, np.zeros((k_new, N), np.uint64)])
    start_disk = np.concatenate([li.start_disk, start[grow.shape[0]:]]).astype(np.int32)
    extent_off[write] = pl.extent_off
    extent_xxh[write] = xxh
    medoid = np.concatenate([li.medoid, S + lone[np.searchsorted(gid, np.arange(k_new))]])
    half = self.entry_bytes // 2
    new_keys = rows_new[medoid[C:] - S, :half]
    arrays = dict(
        members_ptr=ptr, members=members, medoid=medoid, start_disk=start_disk,
        extent_off=extent_off, extent_xxh=extent_xxh,
        token_xxh=np.concatenate([li.token_xxh, xxh3_rows(rows_new, self.entry_bytes)]),
        medoid_keys=np.concatenate([li.medoid_keys, new_keys]),
        hot=np.concatenate([li.hot, np.zeros(k_new, np.uint8)]),
        freq=np.concatenate([li.freq, np.zeros(k_new, np.float32)]))
    self._commit_layer(layer, arrays, disk_end=pl.disk_end, p_global=p_new,
                       record={})
    return np.arange(S, S + n, dtype=np.int64)
