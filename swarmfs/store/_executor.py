"""The executor: turns a read plan into one batched engine submission,
verifies what came back, and locates damage.

:class:`Executor` owns the staging buffers (page-aligned, registered where
possible, a few kept for reuse), the store's read counters, the per-entry
XXH3-64 checks of every read, the location of a failed read (which entry,
disk, layer, cluster, token and byte offset) and the extent-by-extent check
behind :meth:`Store.verify`.  It knows the disks (file descriptors, paths)
and the engine, not the manifest: the plans come from ``_planner`` and the
copies' locations from a :class:`LayerIndex`.  ``Store`` is the facade that
builds plans and calls it; a write transaction (``_write.Transaction``)
borrows its staging buffers.

Concurrency: any number of threads may call :meth:`Executor.execute` and
:meth:`Executor.staging` at once (the pool and the counters take short
locks; the engine holds none while requests are in flight).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

import numpy as np

from .. import _errors as E
from ._engine import READ, device_size
from ._index import LayerIndex
from ._kernels import gather_rows, verify_rows, xxh3_ranges
from ._planner import Plan
from ._write import chunk_bounds

__all__ = ["Executor", "COUNTERS"]

_POOL_KEEP = 4               # staging buffers kept for reuse
_PROBE_LIMIT = 4096          # per-entry probes when locating a failed read

#: the read counters (see ``StoreStats``)
COUNTERS = ("cluster_reads", "entry_reads", "entries_returned", "bytes_returned",
            "bytes_read", "checksum_failures")


class Executor:
    """Plan execution, checksum verification and damage location for one
    open store.

    Args:
        engine: the store's :class:`Engine`.
        fds: the disks' file descriptors, in disk order.
        path: the store directory (named in errors).
        disk_paths: the disks' paths, in disk order (named in errors).
        entry_bytes: bytes of one KV entry.
        block_size: the store's block size (bytes).
    """

    def __init__(self, engine, fds, *, path: str, disk_paths: list, entry_bytes: int,
                 block_size: int):
        self.engine = engine
        self._fds = fds
        self.path = path
        self.disk_paths = disk_paths
        self.num_disks = len(fds)
        self.entry_bytes = int(entry_bytes)
        self.block_size = int(block_size)
        self._pool: list = []
        self._pool_lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._counter_lock = threading.Lock()

    def close(self) -> None:
        """Release the pooled staging buffers (before the engine closes)."""
        with self._pool_lock:
            for b in self._pool:
                b.release()
            self._pool.clear()

    def counters(self) -> dict:
        """A snapshot of the read counters."""
        with self._counter_lock:
            return dict(self._counters)

    @contextlib.contextmanager
    def staging(self, nbytes: int):
        """A page-aligned (registered where possible) buffer of >= nbytes."""
        buf = None
        with self._pool_lock:
            for i, b in enumerate(self._pool):
                if b.size >= nbytes:
                    buf = self._pool.pop(i)
                    break
        if buf is None:
            size = max(1 << 20, 1 << max(int(nbytes) - 1, 1).bit_length())
            buf = self.engine.alloc(size)
        try:
            yield buf
        finally:
            with self._pool_lock:
                self._pool.append(buf)
                if len(self._pool) > _POOL_KEEP:
                    self._pool.sort(key=lambda b: b.size)
                    self._pool.pop(0).release()

    def execute(self, li: LayerIndex, plan: Plan, copies: np.ndarray, *, verify: bool,
                order=None, out: np.ndarray | None = None, cluster=None,
                consume=None, into=None) -> np.ndarray | None:
        """Execute a plan in one batched submission and return entry rows:
        the work behind :meth:`Store.execute`, whose docstring gives the
        arguments, return value and errors (here ``verify`` is a bool, not
        None for the store's setting, and ``li`` is the layer's index).
        """
        Eb = self.entry_bytes
        if into is not None:
            return self._execute_into(li, plan, copies, verify, into, cluster)
        with self.staging(plan.staging_bytes) as buf:
            self._read(li, plan, copies, buf, plan.dst, cluster)
            self._verify(li, buf.array, plan.src, copies[plan.copy], verify)
            src = plan.src if order is None else plan.src[order]
            if consume is not None:     # the caller places the entries itself
                consume(buf.array, src)
                self.count(bytes_read=int(plan.staging_bytes),
                           entries_returned=int(src.shape[0]),
                           bytes_returned=int(src.shape[0]) * Eb)
                return None
            rows = gather_rows(buf.array, src, Eb, out)
        self.count(bytes_read=int(plan.staging_bytes), entries_returned=rows.shape[0],
                   bytes_returned=rows.nbytes)
        return rows

    def _execute_into(self, li: LayerIndex, plan: Plan, copies: np.ndarray, verify: bool,
                      into, cluster) -> np.ndarray:
        """``Store.execute(into=(buf, base))``: the plan's entries as rows of
        ``buf`` from byte ``base``; returns each entry's byte offset in
        ``buf`` (uint64 [U], plan order).  A plan whose requests are exactly
        its entries (no block padding, no coalescing gap: entries a multiple
        of the block size), at a block-aligned ``base``, is read straight
        there (O_DIRECT into the caller's buffer); any other plan goes
        through a staging buffer and its entries are copied there."""
        Eb = self.entry_bytes
        buf, base = into
        U = plan.num_entries
        if plan.staging_bytes == U * Eb and base % self.block_size == 0:
            self._read(li, plan, copies, buf, plan.dst + np.uint64(base), cluster)
            where = plan.src + np.uint64(base)
            self._verify(li, buf.array, where, copies[plan.copy], verify)
        else:
            with self.staging(plan.staging_bytes) as stage:
                self._read(li, plan, copies, stage, plan.dst, cluster)
                self._verify(li, stage.array, plan.src, copies[plan.copy], verify)
                gather_rows(stage.array, plan.src, Eb,
                            buf.array[base:base + U * Eb].reshape(U, Eb))
            where = np.uint64(base) + np.arange(U, dtype=np.uint64) * np.uint64(Eb)
        self.count(bytes_read=int(plan.staging_bytes), entries_returned=U,
                   bytes_returned=U * Eb)
        return where

    def _read(self, li: LayerIndex, plan: Plan, copies: np.ndarray, buf, dst: np.ndarray,
              cluster) -> None:
        """The plan's requests into ``buf`` at byte offsets ``dst``, in one
        batched submission; a failed read names the damaged copy's disk,
        layer and cluster (:meth:`locate_damage`)."""
        if not plan.num_requests:
            return
        try:
            self.engine.execute(READ, plan.disk, plan.offset, plan.length, dst, buf,
                                layer=li.layer, cluster=cluster, check=False)
        except (E.DiskTruncatedError, E.IOFailedError) as exc:
            raise self.locate_damage(li, copies[plan.copy], exc) from exc

    def _verify(self, li: LayerIndex, buf: np.ndarray, where: np.ndarray,
                copy_ids: np.ndarray, verify: bool) -> None:
        """Per-entry XXH3-64 of the entries at byte offsets ``where`` of
        ``buf`` (copies ``copy_ids``); ChecksumError naming the first bad one."""
        if not verify or not where.size:
            return
        bad = verify_rows(buf, where, self.entry_bytes, li.token_xxh[li.members[copy_ids]])
        if bad.size:
            self.count(checksum_failures=int(bad.size))
            c = int(copy_ids[bad[0]])
            raise E.ChecksumError(
                f"entry of token {int(li.members[c])} at offset "
                f"{int(li.copy_off[c])} fails its checksum"
                + (f" ({bad.size} entries)" if bad.size > 1 else ""),
                store=self.path, disk=int(li.copy_disk[c]),
                path=self.disk_paths[int(li.copy_disk[c])], layer=li.layer,
                cluster=int(li.copy_cluster[c]), offset=int(li.copy_off[c]))

    def disk_size(self, d: int) -> int:
        """Disk ``d``'s size in bytes (``device_size`` of its open fd)."""
        try:
            return device_size(self._fds[d])
        except OSError:
            return 0

    def locate_damage(self, li: LayerIndex, copy_ids: np.ndarray,
                      exc: E.SwarmError) -> E.SwarmError:
        """The error of a failed batched read, located: which entry (disk,
        layer, cluster, token) and the byte offset of the damage itself, not
        the start of the merged request that failed.  Truncation is found
        from the disk's size; other failures by re-reading the batch's
        entries on the failing disk one at a time (error path only)."""
        d = exc.disk
        if d is None or not 0 <= d < self.num_disks:
            return exc
        Eb, bs = self.entry_bytes, self.block_size
        on = copy_ids[li.copy_disk[copy_ids] == d]
        on = on[np.argsort(li.copy_off[on], kind="stable")]
        kw = dict(store=self.path, disk=d, path=self.disk_paths[d], layer=li.layer)
        size = self.disk_size(d)
        past = on[li.copy_off[on] + np.uint64(Eb) > np.uint64(size)]
        if past.size:
            c = int(past[0])
            off = int(li.copy_off[c])
            return E.DiskTruncatedError(
                f"disk ends at byte {size} (truncated): the entry of token "
                f"{int(li.members[c])} at offset {off} needs bytes up to {off + Eb}"
                + (f"; {past.size} entries of this read lie past the end"
                   if past.size > 1 else ""),
                cluster=int(li.copy_cluster[c]), offset=max(off, size), **kw)
        for c in on[:_PROBE_LIMIT]:
            off = int(li.copy_off[c])
            a, e = off // bs * bs, -(-(off + Eb) // bs) * bs
            m = mmap.mmap(-1, e - a)
            err: OSError | str | None = None
            n = 0
            try:
                n = os.preadv(self._fds[d], [m], a)
                if n != e - a:
                    err = "short read"
            except OSError as oe:
                err = oe
            finally:
                m.close()
            if err is None:
                continue
            what = (f"read of the entry of token {int(li.members[c])} at offset {off} "
                    "failed: ")
            if isinstance(err, OSError):
                return E.IOFailedError(what + (err.strerror or str(err)), errno=err.errno,
                                       cluster=int(li.copy_cluster[c]), offset=off, **kw)
            return E.DiskTruncatedError(what + f"the disk ends at byte {a + n}",
                                        cluster=int(li.copy_cluster[c]),
                                        offset=max(off, a + n), **kw)
        return exc


    def count(self, **kw) -> None:
        """Add to the read counters (keyword = counter name; thread-safe)."""
        with self._counter_lock:
            for k, v in kw.items():
                self._counters[k] += v


    def verify_layer(self, li: LayerIndex, sizes, gone, problems: dict, max_batch: int,
                     progress) -> list:
        """Every damaged extent of one layer (see :meth:`Store.verify`):
        ``sizes`` uint64 [N] the disks' sizes (bytes), ``gone`` bool [N] the
        disks that could not be opened, ``problems`` {disk: SwarmError}."""
        Eb, bs = self.entry_bytes, np.uint64(self.block_size)
        cc, dd = np.nonzero(li.counts > 0)
        nbytes = li.counts[cc, dd].astype(np.uint64) * np.uint64(Eb)
        alen = (nbytes + bs - np.uint64(1)) // bs * bs
        offs = li.extent_off[cc, dd]
        # (extent k) -> error text and damage offset; entries damaged per extent
        errors: dict[int, tuple[str, int]] = {}
        bad_entries: dict[int, np.ndarray] = {}
        past = offs + nbytes > sizes[dd]
        for k in np.flatnonzero(gone[dd]).tolist():
            errors[int(k)] = (f"disk unavailable: {problems[int(dd[k])].message}",
                              int(offs[k]))
        for k in np.flatnonzero(past & ~gone[dd]):
            k, size = int(k), int(sizes[dd[k]])
            cp = self.extent_copies(li, int(cc[k]), int(dd[k]))
            inside = cp[li.copy_off[cp] + np.uint64(Eb) <= np.uint64(size)]
            bad = np.setdiff1d(cp, inside[~self._bad_entries(li, inside)])
            bad_entries[k] = bad[np.argsort(li.copy_off[bad], kind="stable")]
            errors[k] = (f"{bad.size} of {cp.size} entries lie past the end of the disk "
                         f"or fail their checksums (disk is {size} bytes: truncated)",
                         _damage_offset(int(li.copy_off[bad_entries[k][0]]), Eb, size))
        readable = np.flatnonzero(~past & ~gone[dd])
        cuts = chunk_bounds(alen[readable], max_batch)
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            ks = readable[int(a):int(b)]
            lens = alen[ks]
            dst = np.zeros(ks.shape[0], dtype=np.uint64)
            np.cumsum(lens[:-1], out=dst[1:])
            with self.staging(int(lens.sum())) as buf:
                try:
                    self.engine.execute(READ, dd[ks], offs[ks], lens, dst, buf,
                                        layer=li.layer)
                    ok = np.ones(ks.shape[0], bool)
                except E.SwarmError:
                    ok = self._reread_each(li, ks, cc, dd, offs, lens, dst, buf, errors)
                got = xxh3_ranges(buf.array, dst, nbytes[ks])
                mism = np.flatnonzero(ok & (got != li.extent_xxh[cc[ks], dd[ks]]))
                for j in mism:
                    k = int(ks[j])
                    cp = self.extent_copies(li, int(cc[k]), int(dd[k]))
                    src = dst[j] + (li.copy_off[cp] - offs[k])
                    eh = xxh3_ranges(buf.array, src, np.full(cp.shape[0], Eb, np.uint64))
                    badc = cp[eh != li.token_xxh[li.members[cp]]]
                    if badc.size:
                        bad_entries[k] = badc
                        errors[k] = (f"{badc.size} of {cp.size} entries fail their checksums",
                                     int(li.copy_off[badc[0]]))
                    else:
                        errors[k] = ("extent checksum mismatch, but every entry matches its "
                                     "own checksum (the stored extent checksum is wrong)",
                                     int(offs[k]))
            if progress is not None:
                progress(int(lens.sum()))
        self.count(checksum_failures=len(errors))
        # entries damaged per extent, and tokens with no intact copy left
        bad_copy = np.zeros(li.num_copies, bool)
        for k in errors:
            if k not in bad_entries:
                bad_entries[k] = self.extent_copies(li, int(cc[k]), int(dd[k]))
            bad_copy[bad_entries[k]] = True
        intact = np.bincount(li.members[~bad_copy], minlength=li.num_tokens)
        out = []
        for k in sorted(errors, key=lambda k: (int(cc[k]), int(dd[k]))):
            d = int(dd[k])
            toks = np.unique(li.members[bad_entries[k]])
            out.append(dict(layer=li.layer, cluster=int(cc[k]), disk=d,
                            path=self.disk_paths[d], offset=errors[k][1],
                            extent_offset=int(offs[k]), error=errors[k][0],
                            entries=int(bad_entries[k].size), tokens=toks.tolist(),
                            lost=toks[intact[toks] == 0].tolist()))
        return out

    def _reread_each(self, li, ks, cc, dd, offs, lens, dst, buf, errors) -> np.ndarray:
        """A failed batch, read again one extent at a time (error path):
        returns which extents read; failures go to ``errors``."""
        ok = np.zeros(ks.shape[0], bool)
        for j, k in enumerate(ks):
            try:
                self.engine.execute(READ, dd[k:k + 1], offs[k:k + 1], lens[j:j + 1],
                                    dst[j:j + 1], buf)
                ok[j] = True
            except E.SwarmError as exc:
                exc = self.locate_damage(
                    li, self.extent_copies(li, int(cc[k]), int(dd[k])), exc)
                errors[int(k)] = (f"read failed: {exc.message}",
                                  exc.offset if exc.offset is not None else int(offs[k]))
        return ok

    def _bad_entries(self, li: LayerIndex, cp: np.ndarray) -> np.ndarray:
        """Entry-by-entry check of copies ``cp`` (error path: one batched
        read of their blocks); returns a bool mask of the damaged ones."""
        if not cp.size:
            return np.zeros(0, bool)
        Eb, bs = self.entry_bytes, self.block_size
        off = li.copy_off[cp].astype(np.int64)
        a = off // bs * bs
        ln = -(-(off + Eb) // bs) * bs - a
        dst = np.zeros(cp.shape[0], np.uint64)
        np.cumsum(ln[:-1], out=dst[1:])
        with self.staging(int(ln.sum())) as buf:
            try:
                self.engine.execute(READ, li.copy_disk[cp], a.astype(np.uint64), ln, dst, buf,
                                    layer=li.layer)
            except E.SwarmError:
                return np.ones(cp.shape[0], bool)
            eh = xxh3_ranges(buf.array, dst + (off - a).astype(np.uint64),
                             np.full(cp.shape[0], Eb, np.uint64))
        return eh != li.token_xxh[li.members[cp]]

    @staticmethod
    def extent_copies(li: LayerIndex, c: int, d: int) -> np.ndarray:
        """int64 copy ids of cluster ``c``'s extent on disk ``d``."""
        cp = li.cluster_copies([c])
        return cp[li.copy_disk[cp] == d]


def _damage_offset(off: int, entry_bytes: int, disk_size: int) -> int:
    """First damaged byte of an entry at ``off``: inside the disk, the entry
    itself (a checksum failure); cut by the disk's end, the end."""
    return off if off + entry_bytes <= disk_size else max(off, disk_size)

