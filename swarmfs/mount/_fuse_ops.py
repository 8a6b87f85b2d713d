"""The pyfuse3 operations of the mount: a read-only file system over a Store.

Shaped like pyfuse3's passthrough example: lookup counts with ``forget``,
``readdir`` with stable ``next_id``s (the cluster id in ``clusters/``), reads
that return the full length except at EOF, and long entry/attribute timeouts
because stored KV is immutable.  Names and inode numbers come from
``_fuse_tree``; KV bytes from ``_fuse_stream``.  Every handler turns failures
into ``pyfuse3.FUSEError`` (store errors: EIO, logged); ``forget`` never
raises; everything that would change the tree fails with EROFS.

The view follows the store (:meth:`SwarmFS.follow`): a new committed
generation becomes visible within ``poll_interval`` plus the time to load the
changed layers' indexes, while open files keep reading the generation they
were opened on.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from typing import Any

import numpy as np
import pyfuse3
import trio

from .. import _errors as E
from ..store._store import Store
from ._fuse_stream import KVReader, Stream
from ._fuse_tree import (
    CLUSTER_BASE,
    CLUSTER_INFO,
    CLUSTER_STRIDE,
    CLUSTERS,
    DIR_KINDS,
    DOTS,
    KV_BIN,
    KV_KINDS,
    KV_NPY,
    KV_NPY_FILE,
    LAYER_DIR,
    LAYER_SHIFT,
    LAYERS,
    LIVE_KINDS,
    ROOT_INODE,
    VER_SHIFT,
    LookupCounts,
    Node,
    Tree,
    decode,
    encode,
    sum_stats,
)

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
            bytes).  The kernel then refuses shared mmap (``MAP_SHARED``,
            ``np.load(mmap_mode='r')``) with ENODEV; private mappings
            (``mmap_mode='c'``) work.  Default False: page cache, kept across
            opens.
        threads: worker threads for blocking store reads (a trio
            ``CapacityLimiter``).
        readahead: largest read-ahead window for sequential readers of KV
            files (bytes; 0 disables read-ahead).
        buffer_budget: bytes of reusable buffers for KV reads and read-ahead.
        follow: follow the store: poll its manifest every ``poll_interval``
            seconds and show each new committed generation (see
            :meth:`follow`).  False: the generation at mount time for ever
            (``--snapshot``).
        poll_interval: seconds between manifest polls.
        engines: engines serving KV reads: the store's own plus ``engines -
            1`` more opened on the same store, taken in turn.  Closed by
            :meth:`close`.

    Concurrency: every handler runs in the trio thread; store reads and
    renderings run in worker threads (``threads`` of them).  KV reads queue
    per disk (``_fuse_stream.DiskAdmission``): the reads that touch one disk
    hold at most half the threads, so readers stuck on one slow or hung disk
    never starve the readers of the other disks.  The current generation
    (``tree``) is replaced in one assignment; an open file keeps the
    generation it was opened on until it is closed.
    """

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, store, *, direct_io: bool = False, threads: int = 8,
                 readahead: int = 16 << 20, buffer_budget: int = 256 << 20,
                 follow: bool = True, poll_interval: float = 0.2, engines: int = 4):
        super().__init__()
        self.store = store
        self._extra = []
        try:
            for _ in range(max(int(engines), 1) - 1):
                self._extra.append(Store.open(store.path, engine=store.engine.kind,
                                              verify=store.verify_checksums))
        except BaseException:
            self.close()
            raise
        self.engines = [store] + self._extra
        self.direct_io = bool(direct_io)
        self.threads = int(threads)
        self.follow_store = bool(follow)
        self.poll_interval = float(poll_interval)
        self._manifest_path = os.path.join(store.path, "manifest.json")
        self._mkey = self._manifest_key()
        mtime = self._mkey[1] if self._mkey else time.time_ns()
        self.tree = Tree(store, kv_blksize=MAX_READ, mount_stats=self.mount_stats,
                         mtime_ns=mtime, store_stats=self.store_stats)
        self.counts = LookupCounts(store)
        self._limiter = trio.CapacityLimiter(self.threads)
        self._refresh_limiter = trio.CapacityLimiter(1)
        self.kv = KVReader(store, limiter=self._limiter, budget=buffer_budget,
                           window_max=readahead, engines=self.engines)
        self._handles: dict[int, tuple] = {}
        self._pinned: dict[int, list] = {}      # id(tree) -> [tree, open handles]
        self._next_fh = 1
        self._uid, self._gid = os.getuid(), os.getgid()
        self._rendered = LIVE_KINDS | ({CLUSTER_INFO} if self.follow_store else frozenset())
        self._neg_timeout = 0.0 if self.follow_store else TIMEOUT
        self._started = time.monotonic()
        self._last_refresh_error: str | None = None
        self._c = dict(lookups=0, forgets=0, getattrs=0, readdirs=0, opens=0, reads=0,
                       bytes_returned=0, kv_reads=0, kv_bytes_returned=0, io_errors=0,
                       checksum_failures=0, refused_writes=0, stale=0, generations_seen=1,
                       refresh_errors=0, invalidations=0)

    def close(self) -> None:
        """Close the extra engines' stores (not ``store``)."""
        while self._extra:
            self._extra.pop().close()

    def store_stats(self):
        """The store's counters summed over the mount's engines."""
        return sum_stats([s.stats() for s in self.engines])

    # -- bookkeeping -------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        self._c[key] += n

    def mount_stats(self) -> dict:
        """The file system's counters (JSON-ready; part of stats.json).

        Keys: lookups, forgets, getattrs, readdirs, opens, reads (FUSE
        requests); bytes_returned (all files) and kv_bytes_returned (kv.bin,
        kv.npy) in bytes; kv_reads (store reads); io_errors and
        checksum_failures (reads answered with EIO); refused_writes (EROFS);
        stale (requests for an inode of an older generation: ESTALE);
        generations_seen, refresh_errors and invalidations (following the
        store); generation (the one shown); follow; open_handles;
        kernel_lookups (sum of lookup counts the kernel holds);
        lookup_underflows (forgets below zero, ignored); direct_io; threads;
        uptime_s.
        """
        out: dict[str, Any] = dict(self._c)
        out.update(open_handles=len(self._handles), kernel_lookups=self.counts.total,
                   lookup_underflows=self.counts.underflows, direct_io=self.direct_io,
                   threads=self.threads, generation=self.tree.generation,
                   follow=self.follow_store,
                   uptime_s=round(time.monotonic() - self._started, 3))
        out["kv_reader"] = self.kv.stats()
        return out

    async def _thread(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def _resolve(self, ino: int):
        """``(tree, node)`` of an inode: the current generation, or the older
        one an open file keeps alive.  ENOENT for a number that names
        nothing, ESTALE for a node of a generation no longer shown."""
        node = decode(ino)
        tree = self.tree
        if tree.valid(node):
            return tree, node
        if node is not None:
            for t, _ in self._pinned.values():
                if t.valid(node):
                    return t, node
            self._count("stale")
            raise pyfuse3.FUSEError(errno.ESTALE)
        raise pyfuse3.FUSEError(errno.ENOENT)

    def _entry_from(self, tree: Tree, node: Node, attr, live: bool) -> pyfuse3.EntryAttributes:
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
        t = time.time_ns() if live else tree.mtime_ns
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = t
        return e

    async def _entry(self, tree: Tree, node: Node) -> pyfuse3.EntryAttributes:
        if node.kind in self._rendered:
            attr = await self._thread(tree.attr, node)
            return self._entry_from(tree, node, attr, True)
        return self._entry_from(tree, node, tree.attr(node), False)

    # -- namespace ---------------------------------------------------------------
    @_handler
    async def lookup(self, parent_inode, name, ctx=None):
        """FUSE lookup: the entry of ``name`` in directory ``parent_inode``
        (lookup count +1); ENOENT if none."""
        tree, parent = self._resolve(parent_inode)
        if parent.kind not in DIR_KINDS:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        self._count("lookups")
        node = tree.lookup(parent, name)
        if node is None:
            neg = pyfuse3.EntryAttributes()
            neg.st_ino = 0                     # negative entry
            neg.entry_timeout = self._neg_timeout
            return neg
        e = await self._entry(tree, node)
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
        """FUSE getattr: the attributes of ``inode``."""
        self._count("getattrs")
        tree, node = self._resolve(inode)
        return await self._entry(tree, node)

    @_handler
    async def opendir(self, inode, ctx):
        """FUSE opendir: a handle for reading directory ``inode``; ENOTDIR if not one."""
        _, node = self._resolve(inode)
        if node.kind not in DIR_KINDS:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_handler
    async def readdir(self, fh, start_id, token):
        """List a directory, ``.`` and ``..`` first, with every entry's
        attributes (READDIRPLUS: the kernel needs no lookup afterwards)."""
        tree, parent = self._resolve(fh)
        self._count("readdirs")
        if start_id < DOTS:
            for name, node, next_id in tree.entries(parent, start_id):
                if next_id > DOTS:
                    break
                e = self._entry_from(tree, node, tree.attr(node), False)
                if not pyfuse3.readdir_reply(token, name, e, next_id):
                    return
            start_id = DOTS
        if parent.kind == CLUSTERS:
            self._readdir_clusters(tree, parent.layer, start_id - DOTS, token)
            return
        for name, node, next_id in tree.entries(parent, start_id):
            if node.kind in self._rendered:
                e = await self._entry(tree, node)
            else:
                e = self._entry_from(tree, node, tree.attr(node), False)
            if not pyfuse3.readdir_reply(token, name, e, next_id):
                return
            self.counts.add(e.st_ino)

    def _readdir_clusters(self, tree: Tree, layer: int, first: int, token) -> None:
        """``clusters/``: one ``CCCCCC.npy`` per cluster from cluster ``first``
        on.  Inode numbers and sizes come from the Tree's arrays a chunk at a
        time; one EntryAttributes is filled per entry and copied into the
        reply by ``readdir_reply``."""
        C = tree.num_clusters(layer)
        if first >= C:
            return
        w = tree.cluster_width(layer)
        f = KV_NPY_FILE
        e = self._entry_from(tree, Node(KV_NPY, layer=layer, cluster=first,
                                        ver=int(tree.cluster_ver[layer][first])),
                             tree.attr(Node(KV_NPY, layer=layer, cluster=first)), False)
        base = ((layer + 1) << LAYER_SHIFT) + CLUSTER_BASE + f
        ver, sizes = tree.cluster_ver[layer], tree.npy_sizes(layer)
        reply = pyfuse3.readdir_reply
        c = first
        while c < C:
            stop = min(C, c + 512)
            cs = np.arange(c, stop, dtype=np.int64)
            inos = (base + (ver[c:stop] << VER_SHIFT) + CLUSTER_STRIDE * cs).tolist()
            szs = sizes[c:stop].tolist()
            for i in range(stop - c):
                sz = szs[i]
                e.st_ino = inos[i]
                e.st_size = sz
                e.st_blocks = (sz + 511) >> 9
                if not reply(token, b"%0*d.npy" % (w, c + i), e, DOTS + c + i + 1):
                    self.counts.add_clusters(layer, c, c + i, f)
                    return
            self.counts.add_clusters(layer, c, stop, f)
            c = stop

    async def releasedir(self, fh):
        """FUSE releasedir: nothing to free (directory handles hold no state)."""
        pass

    @_handler
    async def statfs(self, ctx):
        """FUSE statfs: sizes of the store (read-only filesystem)."""
        tree = self.tree
        s = pyfuse3.StatvfsData()
        bs = int(self.store.block_size)
        s.f_bsize = MAX_READ
        s.f_frsize = bs
        s.f_blocks = -(-tree.total_kv_bytes // bs)
        s.f_bfree = s.f_bavail = 0
        s.f_files = 5 + 2 * tree.num_disks + sum(
            3 + 6 * tree.num_clusters(layer) for layer in tree.layers)
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # -- files ---------------------------------------------------------------------
    def _pin(self, tree: Tree) -> None:
        ent = self._pinned.setdefault(id(tree), [tree, 0])
        ent[1] += 1

    def _unpin(self, tree: Tree) -> None:
        ent = self._pinned.get(id(tree))
        if ent is not None:
            ent[1] -= 1
            if ent[1] <= 0:
                del self._pinned[id(tree)]

    @_handler
    async def open(self, inode, flags, ctx):
        """FUSE open: a handle for reading ``inode`` (read-only: EACCES/EROFS for writes)."""
        tree, node = self._resolve(inode)
        if node.kind in DIR_KINDS:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & _WRITE_FLAGS:
            self._count("refused_writes")
            raise pyfuse3.FUSEError(errno.EROFS)
        rendered = node.kind in self._rendered
        snapshot = stream = None
        if rendered:
            snapshot = await self._thread(self._render, tree, node)
        elif node.kind in KV_KINDS:
            stream = Stream(node.layer, node.cluster, tree.size(Node(KV_BIN, layer=node.layer,
                                                                     cluster=node.cluster)),
                            li=tree.load_layer(node.layer))
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = (node, tree, snapshot, stream)
        self._pin(tree)
        self._count("opens")
        fi = pyfuse3.FileInfo(fh=fh)
        fi.direct_io = rendered or (self.direct_io and node.kind in KV_KINDS)
        fi.keep_cache = not rendered
        return fi

    @staticmethod
    def _render(tree: Tree, node: Node) -> bytes:
        if node.kind in LIVE_KINDS:
            return tree.render_live(node)
        return tree.render_small(node)

    @_handler
    async def read(self, fh, off, size):
        """FUSE read: ``size`` bytes at ``off`` of the open file ``fh`` (the
        full length except at EOF)."""
        try:
            node, tree, snapshot, stream = self._handles[fh]
        except KeyError:
            raise pyfuse3.FUSEError(errno.EBADF) from None
        self._count("reads")
        if snapshot is not None:
            data = snapshot[off:off + size]
        elif stream is not None:
            data = await self._read_kv(tree, node, stream, off, size)
            self._c["kv_reads"] += 1
            self._c["kv_bytes_returned"] += len(data)
        else:
            data = tree.read_static(node, off, size)
        self._c["bytes_returned"] += len(data)
        return data

    async def _read_kv(self, tree: Tree, node: Node, stream: Stream, off: int, size: int):
        """kv.bin bytes come from the reader; kv.npy is the npy header followed
        by kv.bin's bytes."""
        if node.kind != KV_NPY:
            return await self.kv.read(stream, off, size)
        h = tree.kv_npy_header(node.layer, node.cluster)
        if off >= len(h):
            return await self.kv.read(stream, off - len(h), size)
        head = h[off:off + size]
        if off + size <= len(h):
            return head
        return head + bytes(await self.kv.read(stream, 0, size - len(head)))

    async def flush(self, fh):
        """FUSE flush: nothing to write back (read-only)."""
        pass

    async def release(self, fh):
        """FUSE release: free the open file ``fh``."""
        entry = self._handles.pop(fh, None)
        if entry is not None:
            if entry[3] is not None:
                self.kv.close(entry[3])
            self._unpin(entry[1])

    # -- following the store ---------------------------------------------------------
    def _manifest_key(self):
        """What changes when a new manifest is committed (atomic rename): its
        inode, mtime and size; None when it cannot be stat'ed."""
        try:
            st = os.stat(self._manifest_path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    async def follow(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Poll the manifest every ``poll_interval`` s; on a change, load the
        new generation in a worker thread (only the layers whose record
        changed), make it current, then invalidate in the kernel what it
        may have cached of the old one (in a worker thread: the calls block).

        Nodes whose contents changed have new inode numbers, so the kernel
        never mixes two generations' pages of one file; names that now point
        elsewhere (``manifest.json``, ``medoids.npy``, changed clusters the
        kernel knows) and directory attributes are invalidated.  A refresh
        that fails (a torn or damaged store) is logged and retried at the
        next poll; the old generation stays visible meanwhile.
        """
        task_status.started()
        while True:
            await trio.sleep(self.poll_interval)
            key = self._manifest_key()
            if key is None or key == self._mkey:
                continue
            await self.refresh(key)

    async def refresh(self, key=None) -> bool:
        """Load and show the store's latest committed generation now; True
        if it differed from the one shown."""
        old = self.tree
        try:
            new = await trio.to_thread.run_sync(self._load_generation, old,
                                                limiter=self._refresh_limiter)
        except Exception as exc:          # retried at the next poll; never ends the mount
            self._count("refresh_errors")
            text = str(exc)
            if text != self._last_refresh_error:       # once per distinct cause
                self._last_refresh_error = text
                log.warning("cannot show the store's new generation (keeping generation "
                            "%d): %s", old.generation, exc,
                            exc_info=not isinstance(exc, E.SwarmError))
            return False
        self._last_refresh_error = None
        self._mkey = key if key is not None else self._manifest_key()
        if new is None:
            return False
        self.tree = new
        self._count("generations_seen")
        log.info("showing generation %d (was %d)", new.generation, old.generation)
        items = self._invalidations(old, new)
        if items:
            n = await trio.to_thread.run_sync(_invalidate, items,
                                              limiter=self._refresh_limiter)
            self._count("invalidations", n)
        return True

    def _load_generation(self, old: Tree) -> Tree | None:
        """The store's committed generation as a Tree continuing ``old``'s
        versions, or None if it is ``old``'s.  Blocking (worker thread)."""
        last: E.ManifestError       # each of the attempts returns, raises or sets it
        for _ in range(5):
            try:
                side = Store.open(self.store.path, engine="threads", queue_depth=1,
                                  verify=self.store.verify_checksums)
            except E.ManifestError as exc:       # torn by a concurrent commit: retry
                last = exc
                continue
            try:
                m = side.committed
                if m.uuid != old.uuid or len(m.disks) != old.num_disks:
                    raise E.MountError("the store was replaced since it was mounted; "
                                       "remount to see it", store=self.store.path)
                if m.generation == old.generation and \
                        all(m.layers.get(layer) == r for layer, r in old.layer_records.items()) \
                        and len(m.layers) == len(old.layer_records):
                    return None
                indexes = {}
                for layer, rec in m.layers.items():
                    if old.layer_records.get(layer) == rec:
                        indexes[layer] = old.load_layer(layer)
                    else:
                        indexes[layer] = side.layer(layer)
                mkey = self._manifest_key()
                return Tree(self.store, m, indexes, prev=old, kv_blksize=MAX_READ,
                            mtime_ns=mkey[1] if mkey else time.time_ns())
            except E.ManifestError as exc:       # an index removed under us: retry
                last = exc
            finally:
                side.close()
        raise last

    def _invalidations(self, old: Tree, new: Tree) -> list:
        """What the kernel may have cached of ``old`` that ``new`` changes:
        ``(parent inode, name)`` entries and ``(inode, None)`` attributes."""
        items: list[tuple[int, bytes | None]] = []
        if new.manifest_ver != old.manifest_ver:
            items.append((ROOT_INODE, b"manifest.json"))
        layers_ino = encode(Node(LAYERS))
        if new.layers != old.layers:
            items.append((layers_ino, None))
            for layer in set(old.layers) - set(new.layers):
                items.append((layers_ino, old.layer_name(layer)))
        for layer in old.layers:
            li = new.load_layer(layer) if layer in new.layers else None
            if li is old.load_layer(layer):
                continue
            layer_ino = encode(Node(LAYER_DIR, layer=layer))
            clusters_ino = encode(Node(CLUSTERS, layer=layer))
            items.append((layer_ino, b"medoids.npy"))
            items.append((clusters_ino, None))
            Cold = old.num_clusters(layer)
            changed = np.ones(Cold, dtype=bool)
            if li is not None and new.cluster_width(layer) == old.cluster_width(layer):
                k = min(Cold, new.num_clusters(layer))
                changed[:k] = new.changed[layer][:k]
            for c in np.flatnonzero(changed & self.counts.known_clusters(layer, Cold)).tolist():
                name = old.cluster_name(layer, c)
                items.append((clusters_ino, name))
                items.append((clusters_ino, name + b".npy"))
        return items

    # -- everything that would change the tree: EROFS (set below) --------------


#: The operations that would change the tree; each refuses with EROFS.
_CHANGING = ("setattr", "mknod", "mkdir", "unlink", "rmdir", "symlink", "rename", "link",
             "write", "create", "setxattr", "removexattr")
for _op in _CHANGING:
    setattr(SwarmFS, _op, _erofs(_op))
del _op


def _invalidate(items) -> int:
    """Tell the kernel to drop cached entries and attributes (blocking: call
    in a worker thread, never while handling a request).  Entries the kernel
    does not hold are skipped.  Returns the number of calls that took effect."""
    n = 0
    for ino, name in items:
        try:
            if name is None:
                pyfuse3.invalidate_inode(ino, attr_only=True)
            else:
                pyfuse3.invalidate_entry(ino, name)
            n += 1
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                log.warning("invalidating %s %r failed: %s", ino, name, exc)
    return n
