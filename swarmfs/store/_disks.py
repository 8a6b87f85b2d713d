"""The disk set of a store: creating superblocks, opening and checking disks,
and the per-disk commit records that pin the manifest's generation."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import shutil
import stat
import threading
import warnings

import numpy as np

from .. import _errors as E
from . import _format as F
from ._engine import WRITE, Engine, device_size, logical_block_size

__all__ = ["create_disks", "open_disks", "read_superblock", "read_header", "open_disk",
           "write_commit_records", "check_header", "truncate_to", "ReaderLease"]

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFCHR:
          "a character device", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symlink"}


def open_disk(path, *, write: bool = False, create: bool = False, disk=None,
              store=None) -> int:
    """Open a disk (regular file or block device) with ``O_DIRECT``, never
    blocking: opened ``O_NONBLOCK`` and checked with ``fstat`` first, so a
    FIFO or a directory is refused at once.

    Raises:
        DiskMissingError: the path does not exist (and ``create`` is False).
        DiskError: not a regular file or block device (naming what it is), a
            symlink loop, no permission, or no ``O_DIRECT`` on its file system.
    """
    kw = dict(disk=disk, path=path, store=store)
    if isinstance(path, str) and "\0" in path:
        raise E.DiskError("a disk path cannot contain NUL bytes", disk=disk, store=store)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
        if not create:
            raise E.DiskMissingError("disk not found", **kw) from None
    except OSError as exc:
        raise E.DiskError(f"cannot open disk: {_why(exc)}", **kw) from None
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        raise E.DiskError(f"a disk must be a regular file or a block device, this is "
                          f"{_KINDS.get(stat.S_IFMT(st.st_mode), 'something else')}", **kw)
    flags = os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | (os.O_RDWR if write else os.O_RDONLY)
    if create:
        flags |= os.O_CREAT
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        raise E.DiskMissingError("disk not found", **kw) from None
    except OSError as exc:
        raise E.DiskError(f"cannot open disk: {_why(exc)}", **kw) from None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise E.DiskError(f"a disk must be a regular file or a block device, this is "
                              f"{_KINDS.get(stat.S_IFMT(st.st_mode), 'something else')}",
                              **kw)
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, (fl & ~os.O_NONBLOCK) | os.O_DIRECT)
        except OSError as exc:
            raise E.DiskError(f"cannot open disk with O_DIRECT: {exc.strerror} (its file "
                              "system does not support direct I/O)", **kw) from None
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise E.DiskError("cannot open disk with O_DIRECT (its file system does not "
                              "support direct I/O)", **kw)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _why(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "symlink loop"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return exc.strerror or str(exc)


def read_header(fd: int, nbytes: int = F.HEADER_BYTES, *, disk=None, path=None,
                store=None) -> bytes:
    """The first ``nbytes`` of a disk (superblock and commit slots), read
    with an aligned buffer (O_DIRECT-safe); short on a short disk.

    Raises:
        IOFailedError: the kernel failed the read (EIO ...).
    """
    m = mmap.mmap(-1, nbytes)
    try:
        try:
            n = os.preadv(fd, [m], 0)
        except OSError as exc:
            raise E.IOFailedError(f"cannot read the disk header: {exc.strerror}",
                                  errno=exc.errno, disk=disk, path=path,
                                  store=store) from None
        return bytes(m[:n])
    finally:
        m.close()


def read_superblock(fd: int) -> bytes:
    """The first 4096 bytes of a disk (O_DIRECT-safe aligned read)."""
    return read_header(fd, F.SUPERBLOCK_SIZE)


def check_reusable(fd, p, i, store, force):
    """Refuse to overwrite anything that holds data unless forced: a disk of
    another store, a non-empty regular file, or a block device with non-zero
    bytes in its first MiB.

    Raises:
        StoreExistsError: naming the disk.
    """
    if force:
        return
    size = device_size(fd)
    if size == 0:
        return
    raw = read_superblock(fd) if size >= F.SUPERBLOCK_SIZE else b""
    if raw[:8] == F.MAGIC:
        raise E.StoreExistsError("disk belongs to another swarmfs store "
                                 "(use --force / force=True to overwrite)",
                                 disk=i, path=p, store=store)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        raise E.StoreExistsError(f"file exists and holds {size} bytes "
                                 "(use --force / force=True to overwrite)",
                                 disk=i, path=p, store=store)
    probe = min(size, 1 << 20) // F.SUPERBLOCK_SIZE * F.SUPERBLOCK_SIZE
    m = mmap.mmap(-1, max(probe, F.SUPERBLOCK_SIZE))
    try:
        os.preadv(fd, [memoryview(m)[:probe]], 0)
        busy = any(m[:probe])
    finally:
        m.close()
    if busy:
        raise E.StoreExistsError("block device holds data in its first MiB "
                                 "(use --force / force=True to overwrite)",
                                 disk=i, path=p, store=store)


def prepare_store_dir(path: str, force: bool) -> bool:
    """Make ``path`` an empty store directory for ``Store.create``: refuse a
    non-empty one unless ``force`` (then remove what a store keeps there).
    Returns whether the directory was created (so a failed create removes it).

    Raises:
        StoreExistsError: a file, a store or other files at ``path``, no ``force``.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise E.StoreExistsError("store path exists and is not a directory", store=path)
    if os.path.isdir(path) and os.listdir(path):
        if not force:
            what = ("a store already exists here" if os.path.exists(
                os.path.join(path, F.MANIFEST)) else "store path is not empty")
            raise E.StoreExistsError(f"{what} (replace it with --force / force=True)",
                                     store=path)
        for sub in (F.MANIFEST, F.INDEX_DIR, "disks", ReaderLease.NAME):
            p = os.path.join(path, sub)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.unlink(p)
    created = not os.path.exists(path)
    os.makedirs(path, exist_ok=True)
    return created


def create_disks(path: str, disk_paths: list, *, force: bool, disk_size, block_size,
                 engine, make_manifest) -> dict:
    """Open (creating files as needed), size and stamp every disk with its
    superblock and the generation-0 commit record.

    Args:
        make_manifest: callable(uuid bytes, capacities, block size) -> the
            sealed generation-0 :class:`~swarmfs.store._manifest.Manifest` (its
            model goes into the superblocks, its checksum into the commit
            records).

    Returns:
        The manifest to write.

    Raises:
        StoreExistsError, DiskError, DiskFullError, ShapeError.
    """
    uid = F.new_uuid()
    fds, caps, bss, created = [], [], [], []
    done = False
    try:
        # every disk is checked before any is changed: a refused disk leaves
        # the others as they were (files this call created are removed)
        for i, p in enumerate(disk_paths):
            new = not os.path.exists(p)
            fd = open_disk(p, write=True, create=new, disk=i, store=path)
            fds.append(fd)
            if new:
                created.append(p)
            check_reusable(fd, p, i, path, force)
            bss.append(logical_block_size(fd))
        for i, (p, fd) in enumerate(zip(disk_paths, fds, strict=True)):
            if stat.S_ISBLK(os.fstat(fd).st_mode):
                caps.append(device_size(fd))
            else:
                os.ftruncate(fd, 0)
                if disk_size:
                    try:
                        os.posix_fallocate(fd, 0, int(disk_size))
                    except OSError as exc:
                        raise E.DiskFullError(f"cannot preallocate {disk_size} bytes: "
                                              f"{exc.strerror}", disk=i, path=p,
                                              store=path) from exc
                caps.append(int(disk_size or 0))
        bs = int(block_size or max(bss + [512]))
        if bs & (bs - 1) or bs < max(bss) or bs > F.SUPERBLOCK_SIZE:
            raise E.ShapeError(f"block size {bs} must be a power of two between the "
                               f"disks' logical block size ({max(bss)}) and "
                               f"{F.SUPERBLOCK_SIZE}", store=path)
        for i, c in enumerate(caps):
            if c and c < F.DATA_START:
                raise E.DiskFullError(f"disk holds {c} bytes, less than the "
                                      f"{F.DATA_START}-byte header", disk=i,
                                      path=disk_paths[i], store=path)
        m = make_manifest(uid, caps, bs)
        tmp = Engine(fds, kind=engine, queue_depth=8, block_sizes=[bs] * len(fds),
                     names=disk_paths, store=path)
        try:
            n = len(fds)
            buf = tmp.alloc(F.SUPERBLOCK_SIZE * n, register=False)
            for i in range(n):
                sb = F.pack_superblock(store_uuid=uid, disk_index=i, disk_count=n,
                                       block_size=bs, capacity=caps[i],
                                       model=m.model.to_dict())
                buf.array[i * F.SUPERBLOCK_SIZE:(i + 1) * F.SUPERBLOCK_SIZE] = \
                    np.frombuffer(sb, dtype=np.uint8)
            tmp.execute(WRITE, np.arange(n), np.zeros(n), [F.SUPERBLOCK_SIZE] * n,
                        np.arange(n) * F.SUPERBLOCK_SIZE, buf)
            write_commit_records(tmp, fds, uid, m, F.COMMITTED, both=True)
        finally:
            tmp.close()
        done = True
    finally:
        for fd in fds:
            os.close(fd)
        if not done:
            for p in created:
                with contextlib.suppress(OSError):
                    os.unlink(p)
    return m


def write_commit_records(engine, fds, uid: bytes, manifest, state: int, *,
                         both: bool = False) -> None:
    """Write the commit record of ``manifest`` (its generation, checksum and
    disk ends) to slot ``generation mod 2`` of every disk (both slots with
    ``both``, at creation) in one batched submission, then fdatasync.

    Raises:
        DiskFullError, IOFailedError: a write failed.
    """
    n = len(fds)
    gen = manifest.generation
    slots = [0, 1] if both else [gen % 2]
    buf = engine.alloc(F.COMMIT_SIZE * n * len(slots), register=False)
    try:
        disk: list[int] = []
        off: list[int] = []
        dst: list[int] = []
        for i in range(n):
            rec = F.pack_commit(store_uuid=uid, disk_index=i, generation=gen,
                                manifest_sum=manifest.checksum_u64,
                                disk_end=manifest.disks[i].end, state=state)
            for s in slots:
                k = len(disk)
                buf.array[k * F.COMMIT_SIZE:(k + 1) * F.COMMIT_SIZE] = \
                    np.frombuffer(rec, dtype=np.uint8)
                disk.append(i)
                off.append(F.COMMIT_OFF + s * F.COMMIT_SIZE)
                dst.append(k * F.COMMIT_SIZE)
        engine.execute(WRITE, np.array(disk), np.array(off, dtype=np.uint64),
                       [F.COMMIT_SIZE] * len(disk), np.array(dst, dtype=np.uint64), buf)
        for fd in fds:
            os.fdatasync(fd)
    finally:
        buf.release()


def check_header(raw: bytes, i: int, p: str, m, *, store) -> dict:
    """Check one disk's superblock and commit records against the manifest:
    UUID, disk index and count, block size, capacity, the model identity
    (dtype, KV heads, head_dim, entry bytes, layers), and the generation.

    Returns:
        The parsed superblock.

    Raises:
        DiskMismatchError: not this store's disk, swapped, or from another
            (older) generation.
        ManifestError: the manifest disagrees with what the disks pin: an
            edited identity, a rolled-back manifest (a disk committed a newer
            generation), or an edited manifest with a recomputed checksum.
    """
    kw = dict(disk=i, path=p, store=store)
    sb = F.unpack_superblock(raw, **kw)
    uid = bytes.fromhex(m.uuid)
    n = len(m.disks)
    if sb["uuid"] != uid:
        raise E.DiskMismatchError(f"disk belongs to another store (UUID {sb['uuid'].hex()}, "
                                  f"manifest {uid.hex()})", **kw)
    if sb["disk_index"] != i or sb["disk_count"] != n:
        raise E.DiskMismatchError(
            f"disk carries index {sb['disk_index']} of {sb['disk_count']} but is listed "
            f"as {i} of {n} (disks swapped?)", **kw)
    if sb["block_size"] != m.block_size:
        raise E.ManifestError(f"manifest block size {m.block_size} differs from the "
                              f"superblock's {sb['block_size']} (manifest edited?)", **kw)
    if sb["capacity"] != m.disks[i].capacity:
        raise E.ManifestError(f"manifest capacity {m.disks[i].capacity} differs from "
                              f"the superblock's {sb['capacity']} (manifest edited?)", **kw)
    for k, v in sb["model"].items():
        if getattr(m.model, k) != v:
            raise E.ManifestError(f"manifest says model.{k} = {getattr(m.model, k)!r} but the "
                                  f"disks' superblocks say {v!r} (manifest edited?); the "
                                  "bytes would be misread, so the store is refused", **kw)
    g, h = m.generation, m.checksum_u64
    recs = []
    for s in (0, 1):
        lo = F.COMMIT_OFF + s * F.COMMIT_SIZE
        r = F.unpack_commit(raw[lo:lo + F.COMMIT_SIZE])
        if r is not None and (r["uuid"] != uid or r["disk_index"] != i):
            r = None
        recs.append(r)
    valid = [r for r in recs if r is not None]
    newest_committed = max((r["generation"] for r in valid if r["state"] == F.COMMITTED),
                           default=-1)
    if newest_committed > g or any(r["generation"] > g + 1 for r in valid):
        newest = max(r["generation"] for r in valid)
        raise E.ManifestError(f"manifest is generation {g} but the disk recorded "
                              f"generation {newest}: the manifest was rolled back "
                              "(restored from an older copy?); restore the newest "
                              "manifest.json", **kw)
    mine = [r for r in valid if r["generation"] == g]
    if mine:
        if all(r["manifest_sum"] != h for r in mine):
            raise E.ManifestError(f"manifest generation {g} differs from the one committed "
                                  "to the disks (edited and its checksum recomputed?)", **kw)
        return sb
    slot, other = recs[g % 2], recs[1 - g % 2]
    if slot is None and other is not None and other["generation"] == g - 1:
        return sb          # the commit-record write of generation g was torn by a crash
    newest = max((r["generation"] for r in valid), default=None)
    if newest is None:
        raise E.DiskMismatchError("disk has no valid commit record (corrupt header)", **kw)
    raise E.DiskMismatchError(f"disk holds generation {newest} but the manifest is at "
                              f"generation {g} (a disk from another copy or time?)", **kw)


def open_disks(path: str, manifest, *, writable: bool,
               damaged: bool = False) -> tuple[list[int], dict]:
    """Open every disk of a (schema-checked) manifest and check superblock,
    commit records and length.

    Args:
        damaged: instead of raising, record each disk's problem and carry
            on (a disk that cannot be opened gets an empty stand-in file), so
            ``Store.verify`` can say what is lost on a damaged store.

    Returns:
        (file descriptors in disk order, {disk: problem message}).

    Raises:
        DiskMissingError, DiskMismatchError, DiskTruncatedError, DiskError,
        ManifestError (only without ``damaged``).
    """
    m = manifest
    fds, problems = [], {}
    try:
        for i, rec in enumerate(m.disks):
            p = m.disk_path(path, i)
            fd = None
            try:
                fd = open_disk(p, write=writable, disk=i, store=path)
                size = device_size(fd)
                if size < F.SUPERBLOCK_SIZE:
                    raise E.DiskTruncatedError(f"disk is {size} bytes, smaller than a "
                                               "superblock", disk=i, path=p, store=path)
                raw = read_header(fd, disk=i, path=p, store=path)
                check_header(raw, i, p, m, store=path)
                if size < rec.end:
                    raise E.DiskTruncatedError(
                        f"disk is {size} bytes but holds data up to byte {rec.end} "
                        "(truncated)", disk=i, path=p, store=path, offset=size)
                if logical_block_size(fd) > m.block_size:
                    raise E.DiskMismatchError(f"disk's logical block size exceeds the "
                                              f"store block size {m.block_size}",
                                              disk=i, path=p, store=path)
            except E.SwarmError as exc:
                if not damaged:
                    if fd is not None:
                        os.close(fd)
                    raise
                problems[i] = exc
                if fd is None:
                    fd = os.memfd_create(f"swarmfs-missing-disk-{i}", os.MFD_CLOEXEC)
            fds.append(fd)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds, problems


class ReaderLease:
    """An open Store's claim on the generation it reads.

    Each Store holds an OFD read lock (``fcntl`` ``F_OFD_SETLK``) on byte
    ``generation`` of ``STORE/.readers``; a writer reuses space freed by
    commit f only when no lock sits below byte f (:meth:`oldest_reader`).
    OFD locks belong to the open file, so several Stores in one process
    are independent, and a crashed process's locks vanish with it.  Every
    LayerIndex a Store loads also claims the generation it was loaded from
    until it is garbage (a Retriever's layer state or a retrieval in flight
    may read it after the Store itself moved on by committing), and the
    Store's own claims count as readers for its own commits.  On a
    store directory where the file cannot be opened (read-only media, no
    writer) there is no lease and nothing to protect.
    """
    NAME = ".readers"
    _FMT = "@hhqqi4x"

    def __init__(self, store_dir: str):
        self.fd = None
        self.generation: int | None = None
        self._held: dict[int, int] = {}     # generation -> claims (the Store's, LayerIndexes')
        self._mutex = threading.Lock()
        try:
            self.fd = os.open(os.path.join(store_dir, self.NAME),
                              os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            try:
                self.fd = os.open(os.path.join(store_dir, self.NAME),
                                  os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.fd = None

    def _lk(self, cmd, kind, start, length):
        import struct
        arg = struct.pack(self._FMT, kind, os.SEEK_SET, start, length, 0)
        return struct.unpack(self._FMT, fcntl.fcntl(self.fd, cmd, arg))

    def hold(self, generation: int) -> None:
        """Move this Store's claim to ``generation`` (new lock first)."""
        with self._mutex:
            if self.fd is None or generation == self.generation:
                return
            self._acquire(int(generation))
            if self.generation is not None:
                self._release(self.generation)
            self.generation = int(generation)

    def acquire(self, generation: int) -> None:
        """One more claim on ``generation`` (e.g. a LayerIndex loaded from it:
        a retrieval may still read its extents after the Store moved on)."""
        with self._mutex:
            if self.fd is not None:
                self._acquire(int(generation))

    def release(self, generation: int) -> None:
        """Drop a claim taken with :meth:`acquire`."""
        with self._mutex:
            if self.fd is not None and self._held.get(int(generation)):
                self._release(int(generation))

    def move(self, claim: list, generation: int) -> None:
        """Move a claim ``[generation]`` (taken with :meth:`acquire`) to a
        newer generation, e.g. a LayerIndex that a commit of another layer
        left current."""
        with self._mutex:
            if self.fd is not None and claim[0] != int(generation) and \
                    self._held.get(claim[0]):
                self._acquire(int(generation))
                self._release(claim[0])
                claim[0] = int(generation)

    def _acquire(self, g: int) -> None:
        if not self._held.get(g):
            self._lk(fcntl.F_OFD_SETLK, fcntl.F_RDLCK, g, 1)
        self._held[g] = self._held.get(g, 0) + 1

    def _release(self, g: int) -> None:
        self._held[g] -= 1
        if not self._held[g]:
            del self._held[g]
            self._lk(fcntl.F_OFD_SETLK, fcntl.F_UNLCK, g, 1)

    def _any_below(self, x: int) -> bool:
        if x <= 0:
            return False
        got = self._lk(fcntl.F_OFD_GETLK, fcntl.F_WRLCK, 0, x)
        return got[0] != fcntl.F_UNLCK

    def oldest_reader(self) -> int | None:
        """The oldest generation another open Store holds (None: none, or
        no lease file).  A binary search with ``F_OFD_GETLK``."""
        if self.fd is None:
            return None
        with self._mutex:
            # this Store's own claims: F_OFD_GETLK does not report locks of
            # the asking open file description itself
            mine = min(self._held, default=None)
        hi = 1 << 62 if mine is None else mine
        if not self._any_below(hi):
            return mine
        lo = 0                       # invariant: no lock below lo, one below hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._any_below(mid):
                hi = mid
            else:
                lo = mid
        return lo

    def close(self) -> None:
        """Release the lease: close its lock file (idempotent)."""
        with self._mutex:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
                self._held.clear()


def truncate_to(fds, manifest) -> None:
    """Give back the space a failed write allocated on growing file disks:
    cut each regular-file disk without a fixed capacity back to its
    committed end (nothing beyond it is referenced).  Best effort."""
    for fd, d in zip(fds, manifest.disks, strict=False):    # best effort: never raise here
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and not d.capacity and st.st_size > d.end:
                os.ftruncate(fd, d.end)
        except OSError as exc:
            warnings.warn(f"could not give back space on disk {d.index}: {exc}",
                          stacklevel=2)
