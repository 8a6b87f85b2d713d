"""Writing a layer: input validation and batched extent writes."""

from __future__ import annotations

import numpy as np

from . import _errors as E
from . import _format as F
from ._engine import WRITE, scatter_rows, xxh3_ranges
from .layout._place import copy_locations

__all__ = ["as_bytes_rows", "clusters_csr", "write_extents", "chunk_bounds"]

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
    if isinstance(clusters, tuple) and len(clusters) == 2:
        ptr = np.asarray(clusters[0], dtype=np.int64)
        members = np.asarray(clusters[1], dtype=np.int64)
    else:
        lists = [np.asarray(c, dtype=np.int64).reshape(-1) for c in clusters]
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
