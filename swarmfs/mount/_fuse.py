"""A read-only FUSE view of a store (pyfuse3 on trio).

``mount(store, mountpoint)`` serves the tree of ``_fuse_tree`` (see its module
docstring for the names) with the operations of ``_fuse_ops``;
``umount(mountpoint)`` takes it down.  KV bytes are read in worker threads by
``_fuse_stream``: a request reads only the entries it covers, through the
fast path's planner, engine and checksum verification (``Store.plan_copies``
+ ``Store.execute``, what ``Store.read_cluster_range`` does); a failed checksum
is logged and the reader gets EIO.

Start-up is ``pyfuse3.init`` -> ``trio.run(pyfuse3.main)`` ->
``pyfuse3.close(unmount=True)`` in a ``finally``, so a crash or a signal does
not leave a dead mount behind.

Run as ``python -m swarmfs.mount._fuse STORE MOUNTPOINT [--foreground] ...``.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pyfuse3
import trio

from .. import _errors as E
from ..store._store import Store
from ._fuse_ops import MAX_READ, SwarmFS

__all__ = ["mount", "umount", "default_log_file", "MountError", "SwarmFS", "MAX_READ"]

log = logging.getLogger("swarmfs.fuse")

#: Kernel read-ahead of a mount (bytes): one ``MAX_READ`` request ahead of a
#: sequential reader (the kernel default is 128 KiB: eight times the requests);
#: the deep prefetch is the daemon's own read-ahead windows.  Measured in
#: docs/benchmarks.md §5 (``bench_mount.py --readahead-sweep``).
KERNEL_READAHEAD = MAX_READ


MountError = E.MountError


# -- mounting -------------------------------------------------------------------

def _dead_mount_error(mountpoint: str) -> MountError:
    return MountError(
        "mount point is a dead FUSE mount (Transport endpoint is not connected): the "
        f"process that served it is gone.  Run `swarmfs umount --lazy {mountpoint}` "
        f"(fusermount3 -u -z {mountpoint}) and mount again", path=mountpoint)


def _check_mountpoint(mountpoint: str) -> None:
    try:
        st = os.stat(mountpoint)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise _dead_mount_error(mountpoint) from None
        if exc.errno == errno.ENOENT:
            raise MountError("mount point does not exist", path=mountpoint) from None
        raise MountError(f"mount point is unusable: {exc.strerror}",
                         path=mountpoint) from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError("mount point is not a directory", path=mountpoint)
    if os.path.ismount(mountpoint):
        # stat may come from cached attributes; statfs always asks the server
        try:
            os.statvfs(mountpoint)
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                raise _dead_mount_error(mountpoint) from None
        raise MountError("something is already mounted here (`swarmfs umount "
                         f"{mountpoint}` first)", path=mountpoint)


def _fuse_options(store_path: str, *, allow_other: bool, debug: bool) -> set:
    opts = set(pyfuse3.default_options)
    opts |= {"ro", "subtype=swarmfs"}
    if any(c in store_path for c in ",\\ \t\n"):
        opts.add("fsname=swarmfs")
    else:
        opts.add(f"fsname={store_path}")
    if allow_other:
        opts.add("allow_other")
    if debug:
        opts.add("debug")
    return opts


def _mountinfo(mountpoint: str):
    """The last record of /proc/self/mountinfo for ``mountpoint``, as (fields
    before the " - " separator, fields after it), or None (no FUSE request)."""
    want = os.path.abspath(mountpoint)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) > 4 and re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                                      fields[4]) == want:
            found = (fields, right.split())
    return found


def _bdi_of(mountpoint: str) -> str | None:
    """``MAJOR:MINOR`` of the mount at ``mountpoint`` (its backing device
    info in /sys/class/bdi), from /proc/self/mountinfo: no FUSE request."""
    rec = _mountinfo(mountpoint)
    return rec[0][2] if rec else None


def _set_kernel_readahead(mountpoint: str, nbytes: int) -> None:
    """Set the kernel's read-ahead of the mount (``read_ahead_kb`` of its
    bdi) so that a sequential reader in page cache mode asks in ``MAX_READ``
    requests (the daemon's windows prefetch behind them), and raise the FUSE
    connection's ``max_background`` (asynchronous read-ahead requests in
    flight; libfuse 3.14 offers no mount option for it) so that several such
    readers do not queue behind the default of 12.  Needs write access to
    /sys (root); otherwise the kernel defaults stay, logged."""
    bdi = _bdi_of(mountpoint)
    if not bdi or nbytes <= 0:
        return
    minor = bdi.split(":")[-1]
    for p, value in ((f"/sys/class/bdi/{bdi}/read_ahead_kb", max(nbytes >> 10, 4)),
                     (f"/sys/fs/fuse/connections/{minor}/max_background", 64),
                     (f"/sys/fs/fuse/connections/{minor}/congestion_threshold", 48)):
        try:
            with open(p, "w") as f:
                f.write(str(value))
            log.info("%s of %s: %d", os.path.basename(p), mountpoint, value)
        except OSError as exc:
            log.info("%s of %s left at the kernel default (%s: %s)", os.path.basename(p),
                     mountpoint, p, exc.strerror)


async def _run(ops: SwarmFS, signals: bool, mountpoint: str | None = None,
               kernel_readahead: int = 0) -> None:
    async with trio.open_nursery() as nursery:
        ops.kv.nursery = nursery
        if mountpoint and kernel_readahead:
            nursery.start_soon(trio.to_thread.run_sync, _set_kernel_readahead, mountpoint,
                               kernel_readahead)
        if signals:
            await nursery.start(_unmount_on_signal)
        if ops.follow_store:
            await nursery.start(ops.follow)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


async def _unmount_on_signal(task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as sigs:
        task_status.started()
        async for signum in sigs:
            log.info("%s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _refusal(exc: BaseException, *, allow_other: bool, dev: str = "/dev/fuse",
             conf: str = "/etc/fuse.conf") -> str:
    """Why the kernel refused a mount, in one sentence, checked in the order
    fusermount3 checks: /dev/fuse missing, /dev/fuse that this user cannot
    open, then (only with ``allow_other``, as non-root) ``user_allow_other``
    missing from ``conf``; else the library's message."""
    head = "the kernel refused the mount: "
    if not os.path.exists(dev):
        return head + f"{dev} does not exist (load the fuse module, or give the " \
            "container the device)"
    if not os.access(dev, os.R_OK | os.W_OK):
        return head + f"this user cannot open {dev} (Permission denied; it needs read " \
            f"and write access to {dev}, e.g. membership in the group that owns it)"
    if allow_other and os.geteuid() != 0:
        try:
            with open(conf) as f:
                allowed = any(line.split("#", 1)[0].strip() == "user_allow_other"
                              for line in f)
        except OSError:
            allowed = False
        if not allowed:
            return head + f"--allow-other as non-root needs user_allow_other in {conf}"
    return head + str(exc)


def _serve(store: Store, mountpoint: str, *, allow_other: bool, debug: bool,
           direct_io: bool, threads: int, readahead: int, snapshot: bool = False,
           poll_interval: float = 0.2, kernel_readahead: int = KERNEL_READAHEAD,
           ready=None) -> None:
    """Mount ``store`` and serve it until unmounted or signalled."""
    ops = SwarmFS(store, direct_io=direct_io, threads=threads, readahead=readahead,
                  follow=not snapshot, poll_interval=poll_interval,
                  engines=min(4, max(threads, 1)))
    opts = _fuse_options(store.path, allow_other=allow_other, debug=debug)
    main_thread = threading.current_thread() is threading.main_thread()
    # until trio's signal receiver takes over, SIGTERM/SIGHUP unwind through
    # the finally below (SIGINT does so as KeyboardInterrupt)
    old = {sig: signal.signal(sig, _raise_exit) for sig in (signal.SIGTERM, signal.SIGHUP)} \
        if main_thread else {}
    try:
        try:
            pyfuse3.init(ops, mountpoint, opts)
        except RuntimeError as exc:
            raise MountError(_refusal(exc, allow_other=allow_other),
                             path=mountpoint, store=store.path) from None
        try:
            log.info("mounted %s on %s (engine %s, checksums %s, direct_io %s, %s)",
                     store.path, mountpoint, store.engine.kind,
                     "on" if store.verify_checksums else "off", direct_io,
                     "snapshot" if snapshot else "following the store")
            if ready is not None:
                ready("ok")
            trio.run(_run, ops, main_thread, mountpoint, kernel_readahead)
        finally:
            pyfuse3.close(unmount=True)
            log.info("unmounted %s", mountpoint)
    finally:
        ops.close()
        for sig, handler in old.items():
            signal.signal(sig, handler)


def mount(store_path, mountpoint, *, foreground: bool = True, allow_other: bool = False,
          debug: bool = False, direct_io: bool = False, threads: int = 8,
          readahead: int = 16 << 20, verify: bool = True, engine: str | None = None, log_file=None,
          timeout: float = 30.0, snapshot: bool = False, poll_interval: float = 0.2):
    """Mount a store read-only at ``mountpoint`` (``swarmfs mount``).

    The store is opened (superblocks, manifest, disks) before anything is
    mounted, so a bad store raises here with nothing left behind.

    Foreground: serves in this process until ``swarmfs umount`` /
    ``fusermount3 -u`` or SIGINT, SIGTERM or SIGHUP, then unmounts and returns
    None.  Must run in the main thread for the signals to be caught.

    Background: after the store opened, starts a new session running
    ``python -m swarmfs.mount._fuse ... --foreground`` (a fresh process, which opens
    the store again, so no io_uring ring crosses a fork), waits until it
    reports the mount and ``os.path.ismount`` is true (deadline ``timeout``
    seconds), and returns its pid.  Its log goes to ``log_file`` (appended),
    by default ``$TMPDIR/swarmfs-mount-<mountpoint with / as ->.log``
    (:func:`default_log_file`).

    Args:
        store_path: the store directory.
        mountpoint: an existing empty directory.
        allow_other: let other users read the mount (FUSE ``allow_other``).
        debug: log every request (libfuse ``debug``) and debug messages.
        direct_io: bypass the page cache for KV files (see :class:`SwarmFS`).
        threads: worker threads for store reads; the KV reads that touch one
            disk hold at most half of them (per-disk queues), so readers
            stuck on one disk never starve the readers of the others.
        readahead: largest read-ahead window of a sequential reader of a KV
            file, in bytes (0: none; see ``_fuse_stream``).
        verify: verify checksums of everything read (default on).
        engine: engine kind for ``Store.open`` (default: auto).
        snapshot: show the generation committed at mount time for ever.
            Default: follow the store -- a newly committed generation (a
            ``write_layer`` or ``append``) becomes visible within about
            ``poll_interval`` seconds without remounting; open files keep
            reading the generation they were opened on.
        poll_interval: seconds between polls of the manifest (following).

    Raises:
        SwarmError subclasses from ``Store.open``: the store cannot be opened.
        MountError: the mount point is unusable (missing, already mounted, a
            dead FUSE mount -- the message names ``swarmfs umount --lazy``),
            the kernel refused the mount, or the background process failed.
    """
    store_path = os.path.abspath(os.fspath(store_path))
    mountpoint = os.path.abspath(os.fspath(mountpoint))
    _check_mountpoint(mountpoint)
    if not foreground:
        Store.open(store_path, verify=verify, engine=engine).close()
        return _spawn(store_path, mountpoint, allow_other=allow_other, debug=debug,
                      direct_io=direct_io, threads=threads, readahead=readahead,
                      verify=verify, engine=engine, log_file=log_file, timeout=timeout,
                      snapshot=snapshot, poll_interval=poll_interval)
    store = Store.open(store_path, verify=verify, engine=engine, preload=True)
    try:
        _serve(store, mountpoint, allow_other=allow_other, debug=debug,
               direct_io=direct_io, threads=threads, readahead=readahead,
               snapshot=snapshot, poll_interval=poll_interval)
    finally:
        store.close()
    return None


def _spawn(store_path, mountpoint, *, allow_other, debug, direct_io, threads, readahead,
           verify, engine, log_file, timeout, snapshot, poll_interval) -> int:
    r, w = os.pipe()
    cmd = [sys.executable, "-m", "swarmfs.mount._fuse", store_path, mountpoint, "--foreground",
           "--ready-fd", str(w), "--threads", str(threads), "--readahead", str(readahead),
           "--poll-interval", repr(float(poll_interval))] + ["--snapshot"] * snapshot
    cmd += ["--allow-other"] * allow_other + ["--debug"] * debug + \
        ["--direct-io"] * direct_io + ["--no-verify"] * (not verify)
    if engine:
        cmd += ["--engine", engine]
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, env.get("PYTHONPATH")]))
    if log_file is None:     # keep the daemon's log (checksum failures, errors) somewhere
        log_file = default_log_file(mountpoint)
    try:
        with open(log_file, "ab") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    pass_fds=(w,), start_new_session=True, cwd="/", env=env)
    finally:
        os.close(w)
    deadline = time.monotonic() + timeout
    msg = b""
    try:
        while not msg.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                break
            chunk = os.read(r, 4096)
            if not chunk:
                break
            msg += chunk
    finally:
        os.close(r)
    text = msg.decode(errors="replace").strip()
    if text == "ok":
        while time.monotonic() < deadline:
            if os.path.ismount(mountpoint):
                return proc.pid
            if proc.poll() is not None:
                break
            time.sleep(0.01)
    if proc.poll() is None:
        proc.terminate()            # it unmounts (if it got that far) and exits
    try:
        rc = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        rc = None
    if text.startswith("error: "):          # a SwarmError: its text names its context
        raise MountError(text[len("error: "):])
    if text.startswith("crash: "):
        raise MountError(f"the mount process failed: {text[len('crash: '):]} (see "
                         f"{log_file})", path=mountpoint, store=store_path)
    raise MountError(f"the mount process did not come up within {timeout:g} s "
                     f"(exit status {rc}; see {log_file})",
                     path=mountpoint, store=store_path)


def _mount_entry(mountpoint: str):
    """``(fstype, source)`` of the mount at ``mountpoint`` from
    /proc/self/mountinfo, or None."""
    rec = _mountinfo(mountpoint)
    if rec is None:
        return None
    rf = rec[1]
    return (rf[0] if rf else "", rf[1] if len(rf) > 1 else "")


def default_log_file(mountpoint) -> str:
    """Where a background mount logs when no log file is given."""
    tag = os.path.abspath(os.fspath(mountpoint)).strip("/").replace("/", "-") or "root"
    return os.path.join(tempfile.gettempdir(), f"swarmfs-mount-{tag}.log")


def umount(mountpoint, lazy: bool = False) -> None:
    """Unmount a FUSE mount (``swarmfs umount``): ``fusermount3 -u``, with
    ``lazy`` ``-z`` (detach now, clean up when no longer busy; also clears a
    dead mount whose process is gone).  The serving process then unmounts
    cleanly and exits.

    Raises:
        MountError: nothing FUSE is mounted there, the mount is busy (use
            ``lazy``), or the unmount tool failed.
    """
    mountpoint = os.path.abspath(os.fspath(mountpoint))
    entry = _mount_entry(mountpoint)
    if entry is None:
        if not os.path.lexists(mountpoint):
            raise MountError("does not exist", path=mountpoint)
        raise MountError("not mounted", path=mountpoint)
    if not entry[0].startswith("fuse"):
        raise MountError(f"not a FUSE mount (type {entry[0]})", path=mountpoint)
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool:
        cmd = [tool, "-u"] + (["-z"] if lazy else []) + ["--", mountpoint]
    elif os.geteuid() == 0 and shutil.which("umount"):
        cmd = ["umount"] + (["-l"] if lazy else []) + [mountpoint]
    else:
        raise MountError("neither fusermount3 nor fusermount is installed (package fuse3)",
                         path=mountpoint)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip() or f"{cmd[0]} exited with {r.returncode}"
        hint = "" if lazy or "busy" not in msg.lower() else \
            " (files are open under it: close them, or use --lazy)"
        raise MountError(f"cannot unmount: {msg}{hint}", path=mountpoint)


# -- python -m swarmfs.mount._fuse ---------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m swarmfs.mount._fuse",
                                description="Mount a swarmfs store read-only.")
    p.add_argument("store")
    p.add_argument("mountpoint")
    p.add_argument("-f", "--foreground", action="store_true")
    p.add_argument("--allow-other", action="store_true")
    p.add_argument("--debug", action="store_true")
    p.add_argument("--direct-io", action="store_true")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--readahead", type=int, default=16 << 20,
                   help="largest read-ahead window in bytes (0: off)")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--snapshot", action="store_true",
                   help="show the generation at mount time (default: follow the store)")
    p.add_argument("--poll-interval", type=float, default=0.2,
                   help="seconds between polls of the manifest when following")
    p.add_argument("--engine", default=None)
    p.add_argument("--log-file", default=None)
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.debug else logging.INFO,
                        format="%(asctime)s swarmfs[%(process)d] %(levelname)s %(message)s")
    kw = dict(allow_other=a.allow_other, debug=a.debug, direct_io=a.direct_io,
              threads=a.threads, readahead=a.readahead, snapshot=a.snapshot,
              poll_interval=a.poll_interval)
    if a.ready_fd is None:
        try:
            pid = mount(a.store, a.mountpoint, foreground=a.foreground, verify=not a.no_verify,
                        engine=a.engine, log_file=a.log_file, **kw)
        except E.SwarmError as exc:
            print(f"swarmfs: error: {exc}", file=sys.stderr)
            return 1
        if pid is not None:
            print(pid)
        return 0
    # the background child: report success or the error through the pipe
    fd = a.ready_fd
    os.set_inheritable(fd, False)

    def ready(msg):
        nonlocal fd
        if fd is not None:
            os.write(fd, (msg.replace("\n", " ") + "\n").encode())
            os.close(fd)
            fd = None

    try:
        mountpoint = os.path.abspath(a.mountpoint)
        _check_mountpoint(mountpoint)
        store = Store.open(os.path.abspath(a.store), verify=not a.no_verify, engine=a.engine,
                           preload=True)
        try:
            _serve(store, mountpoint, ready=ready, **kw)
        finally:
            store.close()
    except E.SwarmError as exc:
        log.error("%s", exc)
        ready(f"error: {exc}")
        return 1
    except BaseException as exc:
        ready(f"crash: {type(exc).__name__}: {exc}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
