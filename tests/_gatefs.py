"""A one-file FUSE file system whose reads can be held: the stuck disk of
``tests/test_fuse_isolation.py``.

    python tests/_gatefs.py BACKING MOUNTPOINT

serves the file BACKING (opened before mounting, so it may lie under
MOUNTPOINT) as ``MOUNTPOINT/<basename of BACKING>``, read-only, every read
passed to the file (``FOPEN_DIRECT_IO``; O_DIRECT opens work).  It prints
``ready`` once mounted, then answers one line per command read from stdin:

* ``hold`` -> ``held``: reads that arrive from now on wait;
* ``release`` -> ``released``: the waiting reads, and later ones, go through;
* ``waiting`` -> ``waiting N``: reads waiting now.

It unmounts and exits at the end of stdin, on SIGTERM, or when unmounted.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys

import pyfuse3
import trio

_FILE_INODE = pyfuse3.ROOT_INODE + 1


class GateFS(pyfuse3.Operations):
    """The root directory and one read-only file, whose reads wait while the
    gate is held."""

    def __init__(self, fd: int, name: str):
        super().__init__()
        self.fd, self.name = fd, os.fsencode(name)
        self.size = os.fstat(fd).st_size
        self.gate = trio.Event()
        self.gate.set()
        self.waiting = 0

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = inode
        if inode == pyfuse3.ROOT_INODE:
            e.st_mode, e.st_nlink, e.st_size = stat.S_IFDIR | 0o755, 2, 0
        elif inode == _FILE_INODE:
            e.st_mode, e.st_nlink, e.st_size = stat.S_IFREG | 0o444, 1, self.size
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        e.st_uid, e.st_gid = os.getuid(), os.getgid()
        e.st_blksize = 4096
        e.st_blocks = (e.st_size + 511) // 512
        e.entry_timeout = e.attr_timeout = 3600.0
        return e

    async def getattr(self, inode, ctx=None):
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode != pyfuse3.ROOT_INODE or name != self.name:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(_FILE_INODE)

    async def opendir(self, inode, ctx):
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        if start_id == 0:
            pyfuse3.readdir_reply(token, self.name, self._attr(_FILE_INODE), 1)

    async def open(self, inode, flags, ctx):
        if inode != _FILE_INODE:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        fi = pyfuse3.FileInfo(fh=inode)
        fi.direct_io = True
        return fi

    async def read(self, fh, off, size):
        if not self.gate.is_set():
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        return os.pread(self.fd, size, off)

    async def release(self, fh):
        pass


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def _control(fs: GateFS) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    pending = b""
    while True:
        data = await stdin.receive_some()
        if not data:
            pyfuse3.terminate()
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            cmd = line.strip().decode()
            if cmd == "hold":
                if fs.gate.is_set():
                    fs.gate = trio.Event()
                _say("held")
            elif cmd == "release":
                fs.gate.set()
                _say("released")
            elif cmd == "waiting":
                _say(f"waiting {fs.waiting}")
            else:
                _say(f"unknown command {cmd!r}")


async def _serve(fs: GateFS) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_control, fs)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async def on_signal():
                async for _ in sigs:
                    pyfuse3.terminate()
                    return
            nursery.start_soon(on_signal)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()


def main(argv) -> int:
    backing, mountpoint = argv
    fd = os.open(backing, os.O_RDONLY | os.O_CLOEXEC)
    fs = GateFS(fd, os.path.basename(backing))
    opts = set(pyfuse3.default_options) | {"fsname=swarmfs-test-gate", "ro"}
    pyfuse3.init(fs, mountpoint, opts)
    try:
        _say("ready")
        trio.run(_serve, fs)
    finally:
        pyfuse3.close(unmount=True)
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
