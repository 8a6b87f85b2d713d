"""The disk set of a store: creating superblocks, opening and checking disks."""

from __future__ import annotations

import mmap
import os
import stat

import numpy as np

from . import _errors as E
from . import _format as F
from ._engine import WRITE, Engine, device_size, logical_block_size, open_disk

__all__ = ["create_disks", "open_disks", "read_superblock"]


def read_superblock(fd: int) -> bytes:
    """The first 4096 bytes of a disk (O_DIRECT-safe aligned read)."""
    m = mmap.mmap(-1, F.SUPERBLOCK_SIZE)
    try:
        os.preadv(fd, [m], 0)
        return bytes(m)
    finally:
        m.close()


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


def create_disks(path: str, disk_paths: list, *, force: bool, disk_size, block_size,
                 engine) -> tuple[bytes, list, int]:
    """Open (creating files as needed), size and stamp every disk with its
    superblock.  Returns (store UUID, capacity per disk, block size).

    Raises:
        StoreExistsError, DiskError, DiskFullError, ShapeError.
    """
    uid = F.new_uuid()
    fds, caps, bss = [], [], []
    try:
        for i, p in enumerate(disk_paths):
            fd = open_disk(p, write=True, create=not os.path.exists(p), disk=i, store=path)
            fds.append(fd)
            check_reusable(fd, p, i, path, force)
            bss.append(logical_block_size(fd))
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
        if bs & (bs - 1) or bs < max(bss) or bs > F.DATA_START:
            raise E.ShapeError(f"block size {bs} must be a power of two between the "
                               f"disks' logical block size ({max(bss)}) and {F.DATA_START}",
                               store=path)
        tmp = Engine(fds, kind=engine, queue_depth=8, block_sizes=[bs] * len(fds),
                     names=disk_paths, store=path)
        buf = tmp.alloc(F.SUPERBLOCK_SIZE * len(fds), register=False)
        for i in range(len(fds)):
            sb = F.pack_superblock(store_uuid=uid, disk_index=i, disk_count=len(fds),
                                   block_size=bs, capacity=caps[i])
            buf.array[i * F.SUPERBLOCK_SIZE:(i + 1) * F.SUPERBLOCK_SIZE] = \
                np.frombuffer(sb, dtype=np.uint8)
        n = len(fds)
        tmp.execute(WRITE, np.arange(n), np.zeros(n), [F.SUPERBLOCK_SIZE] * n,
                    np.arange(n) * F.SUPERBLOCK_SIZE, buf)
        tmp.close()
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return uid, caps, bs


def open_disks(path: str, manifest: dict, *, writable: bool) -> list[int]:
    """Open every disk of a manifest and check superblock, UUID, index, block
    size and length.  Returns the file descriptors, in disk order.

    Raises:
        DiskMissingError, DiskMismatchError, DiskTruncatedError, ManifestError.
    """
    m = manifest
    try:
        uid = bytes.fromhex(m["uuid"])
        disks = m["disks"]
        bs = int(m["block_size"])
        n = len(disks)
    except (KeyError, ValueError, TypeError) as exc:
        raise E.ManifestError(f"manifest lacks a field: {exc}", store=path) from exc
    fds = []
    try:
        for i, rec in enumerate(disks):
            p = rec["path"] if os.path.isabs(rec["path"]) else os.path.join(path, rec["path"])
            fd = open_disk(p, write=writable, disk=i, store=path)
            fds.append(fd)
            size = device_size(fd)
            if size < F.SUPERBLOCK_SIZE:
                raise E.DiskTruncatedError(f"disk is {size} bytes, smaller than a "
                                           "superblock", disk=i, path=p, store=path)
            sb = F.unpack_superblock(read_superblock(fd), disk=i, path=p, store=path)
            if sb["uuid"] != uid:
                raise E.DiskMismatchError("disk belongs to another store "
                                          f"(UUID {sb['uuid'].hex()}, manifest "
                                          f"{uid.hex()})", disk=i, path=p, store=path)
            if sb["disk_index"] != i or sb["disk_count"] != n:
                raise E.DiskMismatchError(
                    f"disk carries index {sb['disk_index']} of {sb['disk_count']} but "
                    f"is listed as {i} of {n} (disks swapped?)", disk=i, path=p,
                    store=path)
            if sb["block_size"] != bs:
                raise E.DiskMismatchError("superblock block size differs from the "
                                          "manifest", disk=i, path=p, store=path)
            if size < int(rec["end"]):
                raise E.DiskTruncatedError(
                    f"disk is {size} bytes but holds data up to byte {rec['end']} "
                    "(truncated)", disk=i, path=p, store=path)
            if logical_block_size(fd) > bs:
                raise E.DiskMismatchError(f"disk's logical block size exceeds the "
                                          f"store block size {bs}", disk=i, path=p,
                                          store=path)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds
