"""The pyfuse3 operations of the mount: a read-only file system over a Store.

Shaped like pyfuse3's passthrough example: lookup counts with ``forget``,
``readdir`` with stable ``next_id``s (the cluster id in ``clusters/``), reads
that return the full length except at EOF, and long entry/attribute timeouts
because stored KV is immutable.  Names and inode numbers come from
``_fuse_tree``; KV bytes from ``_fuse_stream``.  Every handler turns failures
into ``pyfuse3.FUSEError`` (store errors: EIO, logged); ``forget`` never
raises; everything that would change the tree fails with EROFS.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time

import pyfuse3
import trio

from . import _errors as E
from ._fuse_stream import KVReader, Stream
from ._fuse_tree import (CLUSTER_DIR, DIR_KINDS, INDEX_KINDS, KV_KINDS, KV_NPY, LIVE_KINDS,
                         LookupCounts, Node, Tree, decode, encode)

__all__ = ["SwarmFS", "MAX_READ", "TIMEOUT"]

log = logging.getLogger("swarmfs.fuse")

#: Largest FUSE read request (bytes): libfuse negotiates ``max_pages`` = 256
#: (its 1 MiB ``max_write``), the kernel's default ``fs.fuse.max_pages_limit``.
#: Used as ``st_blksize`` of KV files so cat/cp issue reads of this size.  (The
#: ``max_read=`` mount option cannot be used: libfuse 3 rejects it unless the
#: init callback sets the same value, which pyfuse3's does not.)
MAX_READ = 1 << 20
#: Entry and attribute timeout of immutable nodes (seconds).
TIMEOUT = 24 * 3600.0
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


def _handler(fn):
    """Turn every failure inside a FUSE handler into ``FUSEError``: store
    errors become EIO (logged), anything unexpected EIO with a traceback."""
    @functools.wraps(fn)
    async def wrapper(self, *args):
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except E.SwarmError as exc:
            self._count("io_errors")
            if isinstance(exc, E.ChecksumError):
                self._count("checksum_failures")
            log.error("%s: %s -> EIO", fn.__name__, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception:
            self._count("io_errors")
            log.exception("%s failed -> EIO", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


def _erofs(name):
    async def refuse(self, *args):
        raise pyfuse3.FUSEError(errno.EROFS)
    refuse.__name__ = name
    refuse.__doc__ = "The mount is read-only: EROFS."
    return refuse


class SwarmFS(pyfuse3.Operations):
    """pyfuse3 operations serving a :class:`Store` read-only.

    Args:
        store: an open store; the file system reads it, never closes it.
        direct_io: serve KV files with ``FOPEN_DIRECT_IO`` (no page cache: each
            read() goes to the store as one request of up to ``MAX_READ``
            bytes; mmap of KV files is refused).  Default False: page cache,
            kept across opens.
        threads: worker threads for blocking store reads (a trio
            ``CapacityLimiter``).
        readahead: largest read-ahead window for sequential readers of KV
            files (bytes; 0 disables read-ahead).
        buffer_budget: bytes of reusable buffers for KV reads and read-ahead.
    """

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, store, *, direct_io: bool = False, threads: int = 8,
                 readahead: int = 4 << 20, buffer_budget: int = 256 << 20):
        super().__init__()
        self.store = store
        self.direct_io = bool(direct_io)
        self.threads = int(threads)
        self.tree = Tree(store, kv_blksize=MAX_READ, mount_stats=self.mount_stats)
        self.counts = LookupCounts(store)
        self._limiter = trio.CapacityLimiter(self.threads)
        self.kv = KVReader(store, limiter=self._limiter, budget=buffer_budget,
                           window_max=readahead)
        self._handles: dict[int, tuple] = {}
        self._next_fh = 1
        self._uid, self._gid = os.getuid(), os.getgid()
        try:
            self._mtime_ns = os.stat(os.path.join(store.path, "manifest.json")).st_mtime_ns
        except OSError:
            self._mtime_ns = time.time_ns()
        self._started = time.monotonic()
        self._c = dict(lookups=0, forgets=0, getattrs=0, readdirs=0, opens=0, reads=0,
                       bytes_returned=0, kv_reads=0, kv_bytes_returned=0, io_errors=0,
                       checksum_failures=0, refused_writes=0)

    # -- bookkeeping -------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        self._c[key] += n

    def mount_stats(self) -> dict:
        """The file system's counters (JSON-ready; part of stats.json).

        Keys: lookups, forgets, getattrs, readdirs, opens, reads (FUSE
        requests); bytes_returned (all files) and kv_bytes_returned (kv.bin,
        kv.npy) in bytes; kv_reads (store reads); io_errors and
        checksum_failures (reads answered with EIO); refused_writes (EROFS);
        open_handles; kernel_lookups (sum of lookup counts the kernel holds);
        lookup_underflows (forgets below zero, ignored); direct_io; threads;
        uptime_s.
        """
        out = dict(self._c)
        out.update(open_handles=len(self._handles), kernel_lookups=self.counts.total,
                   lookup_underflows=self.counts.underflows, direct_io=self.direct_io,
                   threads=self.threads,
                   uptime_s=round(time.monotonic() - self._started, 3))
        out["kv_reader"] = self.kv.stats()
        return out

    async def _thread(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def _node(self, ino: int) -> Node:
        node = decode(ino)
        if not self.tree.valid(node):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    async def _ready(self, node: Node) -> None:
        """Load the node's layer index (in a worker thread) if it needs it."""
        if node.kind in INDEX_KINDS and not self.tree.is_loaded(node.layer):
            await self._thread(self.tree.load_layer, node.layer)

    def _entry_from(self, node: Node, attr, live: bool) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = encode(node)
        e.generation = 0
        e.entry_timeout = TIMEOUT
        e.attr_timeout = 0.0 if live else TIMEOUT
        e.st_mode = attr.mode
        e.st_nlink = attr.nlink
        e.st_uid = self._uid
        e.st_gid = self._gid
        e.st_rdev = 0
        e.st_size = attr.size
        e.st_blksize = attr.blksize
        e.st_blocks = (attr.size + 511) // 512
        t = time.time_ns() if live else self._mtime_ns
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = t
        return e

    async def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        if node.kind in LIVE_KINDS:
            attr = await self._thread(self.tree.attr, node)
            return self._entry_from(node, attr, True)
        await self._ready(node)
        return self._entry_from(node, self.tree.attr(node), False)

    # -- namespace ---------------------------------------------------------------
    @_handler
    async def lookup(self, parent_inode, name, ctx=None):
        parent = self._node(parent_inode)
        if parent.kind not in DIR_KINDS:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        self._count("lookups")
        node = self.tree.lookup(parent, name)
        if node is None:
            neg = pyfuse3.EntryAttributes()
            neg.st_ino = 0                     # negative entry, cached by the kernel
            neg.entry_timeout = TIMEOUT
            return neg
        e = await self._entry(node)
        self.counts.add(e.st_ino)
        return e

    async def forget(self, inode_list):
        """Lower lookup counts; never raises."""
        try:
            for ino, n in inode_list:
                self.counts.forget(ino, n)
                self._c["forgets"] += 1
        except Exception:
            log.exception("forget failed (ignored)")

    @_handler
    async def getattr(self, inode, ctx=None):
        self._count("getattrs")
        return await self._entry(self._node(inode))

    @_handler
    async def opendir(self, inode, ctx):
        node = self._node(inode)
        if node.kind not in DIR_KINDS:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_handler
    async def readdir(self, fh, start_id, token):
        parent = self._node(fh)
        self._count("readdirs")
        if parent.kind == CLUSTER_DIR and not self.tree.is_loaded(parent.layer):
            await self._thread(self.tree.load_layer, parent.layer)
        for name, node, next_id in self.tree.entries(parent, start_id):
            if node.kind in LIVE_KINDS:
                e = await self._entry(node)
            else:
                e = self._entry_from(node, self.tree.attr(node), False)
            if not pyfuse3.readdir_reply(token, name, e, next_id):
                return
            self.counts.add(e.st_ino)

    async def releasedir(self, fh):
        pass

    @_handler
    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        bs = int(self.store.block_size)
        s.f_bsize = MAX_READ
        s.f_frsize = bs
        s.f_blocks = -(-self.tree.total_kv_bytes // bs)
        s.f_bfree = s.f_bavail = 0
        s.f_files = 5 + 2 * self.tree.num_disks + sum(
            3 + 5 * self.tree.num_clusters(l) for l in self.tree.layers)
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # -- files ---------------------------------------------------------------------
    @_handler
    async def open(self, inode, flags, ctx):
        node = self._node(inode)
        if node.kind in DIR_KINDS:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & _WRITE_FLAGS:
            self._count("refused_writes")
            raise pyfuse3.FUSEError(errno.EROFS)
        live = node.kind in LIVE_KINDS
        snapshot = stream = None
        if live:
            snapshot = await self._thread(self.tree.render_live, node)
        else:
            await self._ready(node)
        if node.kind in KV_KINDS:
            li = self.tree.load_layer(node.layer)
            stream = Stream(node.layer, node.cluster,
                            int(li.sizes[node.cluster]) * self.tree.entry_bytes)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = (node, snapshot, stream)
        self._count("opens")
        fi = pyfuse3.FileInfo(fh=fh)
        fi.direct_io = live or (self.direct_io and node.kind in KV_KINDS)
        fi.keep_cache = not live
        return fi

    @_handler
    async def read(self, fh, off, size):
        try:
            node, snapshot, stream = self._handles[fh]
        except KeyError:
            raise pyfuse3.FUSEError(errno.EBADF) from None
        self._count("reads")
        if snapshot is not None:
            data = snapshot[off:off + size]
        elif stream is not None:
            data = await self._read_kv(node, stream, off, size)
            self._c["kv_reads"] += 1
            self._c["kv_bytes_returned"] += len(data)
        else:
            data = self.tree.read_static(node, off, size)
        self._c["bytes_returned"] += len(data)
        return data

    async def _read_kv(self, node: Node, stream: Stream, off: int, size: int):
        """kv.bin bytes come from the reader; kv.npy is the npy header followed
        by kv.bin's bytes."""
        if node.kind != KV_NPY:
            return await self.kv.read(stream, off, size)
        h = self.tree.kv_npy_header(node.layer, node.cluster)
        if off >= len(h):
            return await self.kv.read(stream, off - len(h), size)
        head = h[off:off + size]
        if off + size <= len(h):
            return head
        return head + bytes(await self.kv.read(stream, 0, size - len(head)))

    async def flush(self, fh):
        pass

    async def release(self, fh):
        entry = self._handles.pop(fh, None)
        if entry is not None and entry[2] is not None:
            self.kv.close(entry[2])

    # -- everything that would change the tree ----------------------------------
    setattr = _erofs("setattr")
    mknod = _erofs("mknod")
    mkdir = _erofs("mkdir")
    unlink = _erofs("unlink")
    rmdir = _erofs("rmdir")
    symlink = _erofs("symlink")
    rename = _erofs("rename")
    link = _erofs("link")
    write = _erofs("write")
    create = _erofs("create")
    setxattr = _erofs("setxattr")
    removexattr = _erofs("removexattr")
