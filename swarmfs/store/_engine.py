"""The I/O engine: executes a whole plan of block requests in one native call.

Two back ends sit behind one interface (see ``native/engine.c``):

* ``io_uring`` (default): liburing through cffi, **one ring per calling
  thread** (as liburing's documentation and 3FS USRBIO recommend).  A thread's
  ring is set up the first time it reads or writes, with
  ``IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN | COOP_TASKRUN`` where the
  kernel has them; the disks are registered files of every ring; the ring
  is torn down when the thread exits or the engine closes.  All SQEs of a plan
  are filled in C and submitted with as few ``io_uring_enter`` calls as the
  ring allows (one when the plan fits in the queue depth); CQEs are reaped in
  batches; short transfers are resubmitted and ``-EAGAIN``/``-EINTR`` retried.
  Buffers from :meth:`Engine.alloc` are registered as fixed buffers in every
  ring that uses them, where the kernel and ``RLIMIT_MEMLOCK`` allow.
* ``threads`` (fallback): pthreads issuing ``pread``/``pwrite``, also
  entirely in C.  It takes over, with a one-line warning, when io_uring is
  unavailable (``ENOSYS``, ``EPERM`` from ``kernel.io_uring_disabled`` or
  seccomp, ``ENOMEM`` from a too small ``RLIMIT_MEMLOCK``).
  ``SWARMFS_ENGINE=threads`` (or ``engine="threads"``) forces it.

Concurrency contract: any number of threads may call :meth:`Engine.execute`,
:meth:`Engine.alloc` and :meth:`Engine.stats` at the same time.  No lock is
held while requests are in flight, so a reader of healthy disks never waits
for a reader of a slow one, and :meth:`Engine.stats` never waits for I/O.
:meth:`Engine.close` waits until the calls in flight have returned (each is
bounded: transient errors are retried a bounded number of times); calls that
start after ``close`` began raise :class:`SwarmError` ("the engine is closed").

Never spinning: a transient failure (``io_uring_enter`` failing with EINTR,
EAGAIN, EBUSY or EIO, a request or ``pread`` ending with EAGAIN/EINTR) is
retried with exponential backoff (1 µs doubling up to 1 ms) at most
``retry_limit`` times in a row without progress (default 200, about 0.2 s),
then the read fails with :class:`IOFailedError` naming the disk.  A wait for
requests already in the kernel that a signal interrupts (EINTR) is not a
failure (timer signals must not fail a read of a slow disk), but requests in
the kernel with no completion at all for 60 s fail with ETIMEDOUT.

Disks are opened with ``O_DIRECT``: offsets, lengths and buffer addresses must
be multiples of the disk's logical block size; :meth:`Engine.execute` checks
this (vectorised) before anything is submitted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os
import resource
import stat
import threading
import warnings
import weakref

import numpy as np

from .. import _errors as E
from .. import _validate as V

try:
    from .._native import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "swarmfs._native is not built; run `pip install -e .` (needs liburing-dev, "
        "libxxhash-dev and a C compiler)") from exc

__all__ = ["Engine", "EngineStats", "DiskStats", "AlignedBuffer", "open_disk",
           "logical_block_size", "READ", "WRITE", "ENGINE_KINDS", "BLOCKING_MODES"]

#: the engine kinds (``Engine(kind=)``, ``Store.open(engine=)``, ``$SWARMFS_ENGINE``)
ENGINE_KINDS = ("auto", "io_uring", "threads")
#: Where an io_uring engine runs requests to disks that cannot read without
#: blocking (tmpfs): on its own threads, or on io_uring's io-wq workers.
BLOCKING_MODES = ("threads", "io_uring")

READ = lib.SE_OP_READ
WRITE = lib.SE_OP_WRITE
_KINDS = {lib.SE_KIND_URING: "io_uring", lib.SE_KIND_THREADS: "threads"}
_FALLBACK_ERRNOS = {errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EOPNOTSUPP, errno.ENOMEM}
_RING_FLAGS = ((lib.SE_RING_SINGLE_ISSUER, "SINGLE_ISSUER"),
               (lib.SE_RING_DEFER_TASKRUN, "DEFER_TASKRUN"),
               (lib.SE_RING_COOP_TASKRUN, "COOP_TASKRUN"),
               (lib.SE_RING_SUBMIT_ALL, "SUBMIT_ALL"))
_BLKSSZGET = 0x1268
_BLKGETSIZE64 = 0x80081272
_warned: set[str] = set()           # one-line warnings already given, by kind
_MAX_REQUEST = (1 << 31) - 4096     # statuses are int32 byte counts
_QUARANTINE: list[tuple] = []       # memory abandoned requests may still write to


def _uring_open(pp, cfds, nfds, queue_depth):
    """``se_uring_open`` (a seam where tests inject ENOSYS/EPERM faults)."""
    return lib.se_uring_open(pp, cfds, nfds, queue_depth)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def memlock_limit() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def memlock_hint(what: str) -> str:
    """``what`` plus the locked-memory limit and how to raise it (one line)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def fmt(v):
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v // 1024} KiB"
    return (f"{what}: the locked-memory limit RLIMIT_MEMLOCK is {fmt(soft)} (hard {fmt(hard)}) "
            "and io_uring rings and registered buffers count against it; raise it with "
            "`ulimit -l unlimited` (or a size in KiB), LimitMEMLOCK=infinity in a systemd "
            "unit, or a memlock line in /etc/security/limits.conf")


def logical_block_size(fd: int) -> int:
    """Logical block size in bytes that O_DIRECT I/O on ``fd`` must respect.

    Block devices: the ``BLKSSZGET`` ioctl.  Regular files: 512 when the file
    system accepts a 512-byte O_DIRECT read at offset 512, else 4096.
    """
    st = os.fstat(fd)
    if stat.S_ISBLK(st.st_mode):
        import fcntl
        import struct
        buf = fcntl.ioctl(fd, _BLKSSZGET, b"\0" * 4)
        return struct.unpack("i", buf)[0]
    return 512 if _probe_direct(fd, 512) else 4096


def _probe_direct(fd: int, size: int) -> bool:
    m = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        try:
            os.preadv(fd, [memoryview(m)[:size]], size)
            return True
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
    finally:
        m.close()


def device_size(fd: int) -> int:
    """Size in bytes of a block device or regular file."""
    st = os.fstat(fd)
    if stat.S_ISBLK(st.st_mode):
        import fcntl
        import struct
        buf = fcntl.ioctl(fd, _BLKGETSIZE64, b"\0" * 8)
        return struct.unpack("Q", buf)[0]
    return st.st_size


def open_disk(path, *, write: bool = False, create: bool = False, disk=None,
              store=None) -> int:
    """Open a disk (regular file or block device) with ``O_DIRECT``.

    Raises:
        DiskMissingError: the path does not exist (and ``create`` is False).
        DiskError: the path cannot be opened with O_DIRECT (e.g. tmpfs before
            Linux 6.6), or is neither a regular file nor a block device.
    """
    flags = os.O_DIRECT | os.O_CLOEXEC | (os.O_RDWR if write else os.O_RDONLY)
    if create:
        flags |= os.O_CREAT
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError as exc:
        raise E.DiskMissingError("disk not found", disk=disk, path=path,
                                 store=store) from exc
    except OSError as exc:
        raise E.DiskError(f"cannot open disk with O_DIRECT: {exc.strerror}",
                          disk=disk, path=path, store=store) from exc
    st = os.fstat(fd)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        os.close(fd)
        raise E.DiskError("a disk must be a regular file or a block device",
                          disk=disk, path=path, store=store)
    return fd


class AlignedBuffer:
    """Page-aligned host memory for O_DIRECT transfers.

    Anonymous ``mmap`` memory (page-aligned, zero-filled).  With
    ``pinned=True`` the pages are locked (``mlock``); when torch with CUDA is
    available the buffer is a CUDA pinned host tensor instead, so that the
    transfer to the GPU can be a DMA.  ``array`` is a uint8 numpy view.
    The buffer is registered with the engine as an io_uring fixed buffer when
    possible (``slot >= 0``).
    """

    def __init__(self, nbytes: int, *, pinned: bool = False):
        self.nbytes = max(int(nbytes), 1)
        self.size = -(-self.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.pinned = pinned
        self._map()
        self.slot = -1
        self._engine: weakref.ref[Engine] | None = None
        self._unreg: weakref.finalize | None = None

    def _map(self) -> None:
        self.tensor = None
        self._mmap = None
        if self.pinned and _cuda_available():
            import torch
            self.tensor = torch.empty(self.size, dtype=torch.uint8).pin_memory()
            self.array = self.tensor.numpy()
        else:
            # private: a fork()ed child must not share staging memory with us
            self._mmap = mmap.mmap(-1, self.size,
                                   flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.array = np.frombuffer(self._mmap, dtype=np.uint8)
            if self.pinned:
                _mlock(self.array)
        self.address = self.array.ctypes.data

    def registered_elsewhere(self, engine) -> bool:
        """Whether the buffer is a fixed buffer of an engine other than
        ``engine`` (one that is closed counts as other)."""
        return self.slot >= 0 and (self._engine is None or self._engine() is not engine)

    def cdata(self):
        """The buffer as a cffi ``char *`` (for the native calls)."""
        return ffi.cast("char *", self.address)

    def release(self) -> None:
        """Unregister the buffer from its engine (if it still runs)."""
        if self._unreg is not None:
            self._unreg()            # runs at most once; also the GC path
            self._unreg = None
        self.slot = -1
        self._engine = None

    def _quarantine(self) -> None:
        """Requests the engine gave up on may still be in the kernel and write
        into this memory later: keep it mapped for ever (leaked on purpose,
        only after an engine failure) and give the buffer fresh memory."""
        self.release()
        _QUARANTINE.append((self._mmap, self.tensor, self.array))
        self._map()


def _unregister(engine_ref, slot: int) -> None:
    """Finalizer of a registered buffer: unregister it if its engine is open."""
    eng = engine_ref()
    if eng is None or os.getpid() != eng._pid:
        return
    with contextlib.suppress(E.SwarmError), eng._call() as ptr:
        lib.se_unregister_buffer(ptr, slot)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _mlock(arr: np.ndarray) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlock(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(arr.nbytes)) != 0:
        err = ctypes.get_errno()
        warnings.warn(f"swarmfs: mlock of a {arr.nbytes}-byte buffer failed "
                      f"({os.strerror(err)}); using unpinned memory", stacklevel=3)


@V.checked_methods
@dataclasses.dataclass(frozen=True)
class DiskStats:
    """Per-disk counters.

    Attributes:
        requests: requests completed on this disk.
        bytes: bytes transferred (bytes).
        busy_us: summed, per execute call, time from the first submission to
            the last completion on this disk (microseconds).  Completions
            are timestamped per reaped batch, so when a plan completes in one
            batch every disk shows the same time; per-disk ``bytes`` and
            ``requests`` show the balance.  Calls from several threads each
            add their own time (busy time can exceed wall time).
    """
    requests: int
    bytes: int
    busy_us: float


@V.checked_methods
@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Engine counters since the engine was opened (a consistent-enough
    snapshot: each counter is read atomically; taking it never waits for I/O).

    Attributes:
        engine: ``"io_uring"`` or ``"threads"``.
        queue_depth: SQ entries per ring (io_uring) or worker threads per call
            (threads).
        registered_files: whether disks are io_uring registered files.
        executes: plan executions.
        requests: requests completed (including failed ones).
        bytes: bytes transferred.
        submit_calls: ``io_uring_enter`` calls (io_uring) or thread batches.
        sqes / cqes: submission / completion queue entries processed.
        retries: ``-EAGAIN``/``-EINTR`` resubmissions plus failed
            ``io_uring_enter`` calls that were retried.
        short_resubmits: resubmissions of the remainder of a short transfer.
        errors: requests that ended with an error.
        fixed_requests: requests that used a registered (fixed) buffer.
        disks: per-disk :class:`DiskStats`.
        ring_flags: io_uring setup flags in use, e.g.
            ``("SINGLE_ISSUER", "DEFER_TASKRUN", "COOP_TASKRUN", "SUBMIT_ALL")``.
        rings: rings alive now (one per thread that used the engine).
        in_flight: execute calls running now.
        enter_errors: ``io_uring_enter`` calls that failed.
        gave_up: calls that stopped retrying a transient error and failed.
        long_waits: waits for requests in the kernel that took a second or
            more (each ``io_uring_enter`` waits at most a second, then the
            engine waits again; requests with no completion for 60 s fail with
            ETIMEDOUT): a slow disk, or a completion whose wake-up came late.
        fallback_executes: io_uring executes that ran with ``pread`` because
            the calling thread's ring could not be set up (e.g.
            ``RLIMIT_MEMLOCK``).
        buffers_registered: whether staging buffers are io_uring fixed
            buffers: at least one is registered and no registration failed.
        registered_buffers: buffers in the engine's fixed-buffer table.
        buffer_register_errors: per-ring registrations that failed.
        buffer_error: why the last registration failed (None: none did),
            naming ``RLIMIT_MEMLOCK`` when that was the cause.
        memlock_limit: the soft ``RLIMIT_MEMLOCK`` in bytes (None: unlimited).
        blocking_disks: disks whose files cannot read without blocking
            (``RWF_NOWAIT`` gives EOPNOTSUPP, e.g. tmpfs), where io_uring
            would hand every request to its io-wq workers.  An io_uring
            engine runs their requests on its own threads (``pread``) beside
            the ring, or with ``IOSQE_ASYNC`` (``Engine(blocking="io_uring")``).
        thread_requests: requests to blocking disks that an io_uring engine
            ran on its own threads.
    """
    engine: str
    queue_depth: int
    registered_files: bool
    executes: int
    requests: int
    bytes: int
    submit_calls: int
    sqes: int
    cqes: int
    retries: int
    short_resubmits: int
    errors: int
    fixed_requests: int
    disks: tuple
    ring_flags: tuple = ()
    rings: int = 0
    in_flight: int = 0
    enter_errors: int = 0
    gave_up: int = 0
    long_waits: int = 0
    fallback_executes: int = 0
    buffers_registered: bool = False
    registered_buffers: int = 0
    buffer_register_errors: int = 0
    buffer_error: str | None = None
    memlock_limit: int | None = None
    blocking_disks: int = 0
    thread_requests: int = 0


@V.checked_methods
class Engine:
    """Batched block I/O over a fixed set of open disks.

    Concurrency: ``execute``, ``alloc``, ``check`` and ``stats`` may run from
    any number of threads at the same time; with io_uring each thread uses a
    ring of its own, so no lock is held while requests are in flight and
    readers of different disks never wait for each other.  ``close`` waits
    for calls in flight to return; calls that begin after it raise
    :class:`SwarmError`.  An engine belongs to the process that opened it (a
    ``fork`` child gets SwarmError).

    Args:
        fds: open file descriptors (O_DIRECT), one per disk, in disk order;
            the engine reads through duplicates of its own (closed by
            :meth:`close`), so closing or reusing these numbers later does
            not change what it reads.
        kind: ``"auto"`` (io_uring, else threads), ``"io_uring"`` or
            ``"threads"``.  Default: ``$SWARMFS_ENGINE`` or ``"auto"``.
        queue_depth: io_uring SQ size per ring (CQ is twice that); halved
            (down to 8, with a warning) when ``RLIMIT_MEMLOCK`` is too small
            for the ring.  The fallback engine runs min(queue_depth, 32)
            worker threads per call.
        block_sizes: logical block size (bytes) of each disk, for the
            alignment checks.
        retry_limit: transient failures retried in a row without progress
            before a call fails (see the module docstring).
        blocking: where an io_uring engine runs requests to disks that cannot
            read without blocking (tmpfs; :attr:`EngineStats.blocking_disks`):
            ``"threads"`` (default: ``pread``/``pwrite`` on up to
            min(queue_depth, 32) threads per call, one per 32 such requests,
            while the caller drives the ring; 2.2-2.4x io-wq's rate on tmpfs
            at 4 KiB, docs/bench/engine.md) or ``"io_uring"`` (SQEs with
            ``IOSQE_ASYNC``, run by io-wq).

    Raises:
        InvalidChoiceError: an unknown ``kind`` or ``blocking``.
        InvalidIntegerError: a queue depth outside [1, 32768] or a retry
            limit outside [0, 2**20].
        ConfigError: an unknown ``$SWARMFS_ENGINE``, or no disks.
        IOFailedError: io_uring was requested explicitly and cannot be set up
            (the message names ``RLIMIT_MEMLOCK`` when that is the cause).
    """

    def __init__(self, fds, *, kind: str | None = None, queue_depth: int = 128,
                 block_sizes=None, names=None, store=None, retry_limit: int | None = None,
                 blocking: str = "threads"):
        self.fds = list(fds)
        self.store = store
        self.names = list(names) if names is not None else [None] * len(self.fds)
        self.block_sizes = np.asarray(block_sizes if block_sizes is not None
                                      else [512] * len(self.fds), dtype=np.uint64)
        if kind is not None:
            V.parse_choice(kind, "engine", ENGINE_KINDS, store=store)
        kind = kind or os.environ.get("SWARMFS_ENGINE", "auto")
        if kind not in ENGINE_KINDS:
            raise E.ConfigError(f"unknown engine kind {kind!r} in SWARMFS_ENGINE: "
                                "use auto, io_uring or threads", store=store)
        V.parse_int(queue_depth, "queue_depth", 1, 32768, store=store)
        if retry_limit is not None:
            V.parse_int(retry_limit, "retry_limit", 0, 1 << 20, store=store)
        V.parse_choice(blocking, "blocking", BLOCKING_MODES, store=store)
        if not self.fds:
            raise E.ConfigError("an engine needs at least one disk", store=store)
        cfds = ffi.new("int[]", self.fds)
        pp = ffi.new("se_engine **")
        self._ptr = None
        self.fallback_reason = None
        if kind in ("auto", "io_uring"):
            ret = _uring_open(pp, cfds, len(self.fds), queue_depth)
            if ret == 0:
                self._ptr = pp[0]
            else:
                reason = f"io_uring setup failed: {os.strerror(-ret)}"
                if -ret == errno.ENOMEM:
                    reason = memlock_hint(reason)
                if kind == "io_uring" or -ret not in _FALLBACK_ERRNOS:
                    raise E.IOFailedError(reason, errno=-ret, store=store)
                self.fallback_reason = reason
                _warn_once("fallback", f"swarmfs: io_uring unavailable ({reason}); using "
                                       "the thread-pool pread/pwrite engine")
        if self._ptr is None:
            # a thread per in-flight request: more threads than this only contend
            ret = lib.se_threads_open(pp, cfds, len(self.fds), min(queue_depth, 32))
            if ret != 0:
                raise E.IOFailedError(f"engine setup failed: {os.strerror(-ret)}",
                                      errno=-ret, store=store)
            self._ptr = pp[0]
        self.kind = _KINDS[lib.se_kind(self._ptr)]
        self._pid = os.getpid()
        self._registered: weakref.WeakSet[AlignedBuffer] = weakref.WeakSet()
        # reentrant: a buffer finalizer (GC) may run inside close() in this thread
        self._cv = threading.Condition(threading.RLock())
        self._calls = 0
        self._closing = False
        self._buffer_error: str | None = None
        self.retry_limit = int(lib.SE_DEFAULT_RETRY_LIMIT if retry_limit is None
                               else retry_limit)
        lib.se_set_retry_limit(self._ptr, self.retry_limit)
        self.blocking = blocking
        lib.se_set_blocking_mode(self._ptr, lib.SE_BLOCKING_THREADS if blocking == "threads"
                                 else lib.SE_BLOCKING_IOWQ)
        self.queue_depth = int(lib.se_queue_depth(self._ptr))
        flags = int(lib.se_ring_flags(self._ptr))
        self.ring_flags = tuple(name for bit, name in _RING_FLAGS if flags & bit)
        self._finalizer = weakref.finalize(self, lib.se_close, self._ptr)
        if self.kind == "io_uring" and self.queue_depth < queue_depth:
            _warn_once("depth", "swarmfs: " + memlock_hint(
                f"io_uring queue depth reduced from {queue_depth} to {self.queue_depth}"))

    # -- liveness ----------------------------------------------------------
    @contextlib.contextmanager
    def _call(self):
        """Count a native call in flight (``close`` waits for it); raise
        SwarmError if the engine is closed or closing."""
        with self._cv:
            if self._ptr is None or self._closing:
                raise E.SwarmError("the engine is closed", store=self.store)
            self._calls += 1
        try:
            yield self._ptr
        finally:
            with self._cv:
                self._calls -= 1
                if self._calls == 0:
                    self._cv.notify_all()

    def _check_process(self) -> None:
        """Raise SwarmError in a fork child: the rings and registered buffers
        belong to the process that opened the engine."""
        if os.getpid() != self._pid:
            raise E.SwarmError("this Store/Engine was opened in another process (fork); "
                               "open the store again in this process", store=self.store)

    def _live(self) -> None:
        """Raise SwarmError if :meth:`close` has run or is running."""
        if self._ptr is None or self._closing:
            raise E.SwarmError("the engine is closed", store=self.store)

    # -- buffers ---------------------------------------------------------
    def alloc(self, nbytes: int, *, pinned: bool = False,
              register: bool = True) -> AlignedBuffer:
        """Allocate a page-aligned buffer of at least ``nbytes`` bytes and
        register it as a fixed buffer when the engine supports it.

        A registration that fails (e.g. ``RLIMIT_MEMLOCK`` too small) leaves
        an unregistered buffer that works with plain reads; the first such
        failure gives a one-line warning and ``stats().buffer_error`` says why.

        Raises:
            SwarmError: the engine is closed, or was opened in another process.
        """
        self._check_process()
        self._live()
        buf = AlignedBuffer(nbytes, pinned=pinned)
        if register and self.kind == "io_uring" and buf.size <= (1 << 30):
            with self._call() as ptr:
                slot = lib.se_register_buffer(ptr, buf.cdata(), buf.size)
            if slot >= 0:
                buf.slot = slot
                buf._engine = weakref.ref(self)
                buf._unreg = weakref.finalize(buf, _unregister, weakref.ref(self), slot)
                self._registered.add(buf)
            elif slot in (-errno.ENOMEM, -errno.EFAULT):
                self._buffer_error = memlock_hint(
                    f"registering a {buf.size}-byte fixed buffer failed: "
                    f"{os.strerror(-slot)}")
                _warn_once("buffers", f"swarmfs: {self._buffer_error}; reading "
                                      "without registered buffers")
        return buf

    # -- execution -------------------------------------------------------
    def check(self, disk, off, length, buf_off=None, *, buf_address: int = 0,
              layer=None, cluster=None) -> None:
        """Vectorised O_DIRECT alignment and disk-index checks.

        Raises:
            OutOfRangeError: a disk index outside [0, ndisks).
            MisalignedRequestError: an offset, length or destination not a
                multiple of the disk's logical block size.
        """
        disk = np.asarray(disk)
        if disk.size == 0:
            return
        bad = (disk < 0) | (disk >= len(self.fds))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise E.OutOfRangeError(f"request {i} names disk {int(disk[i])}, "
                                    f"store has {len(self.fds)}", store=self.store,
                                    layer=layer, cluster=cluster)
        bs = self.block_sizes[disk]
        mis = (np.asarray(off, dtype=np.uint64) % bs != 0) | \
              (np.asarray(length, dtype=np.uint64) % bs != 0)
        if buf_off is not None:
            mis |= (np.asarray(buf_off, dtype=np.uint64) + np.uint64(buf_address)) % bs != 0
        if mis.any():
            i = int(np.flatnonzero(mis)[0])
            d = int(disk[i])
            raise E.MisalignedRequestError(
                f"request {i} (offset {int(off[i])}, length {int(length[i])}"
                + (f", buffer offset {int(buf_off[i])}" if buf_off is not None else "")
                + f") is not aligned to the {int(bs[i])}-byte logical block size",
                store=self.store, disk=d, path=self.names[d], layer=layer,
                cluster=cluster)

    def execute(self, op: int, disk, off, length, buf_off, buf: AlignedBuffer, *,
                layer=None, cluster=None, check: bool = True) -> np.ndarray:
        """Execute a whole plan in one native call.

        Safe to call from several threads at once (each uses its own ring);
        see the class docstring.

        Args:
            op: ``READ`` or ``WRITE``.
            disk: int32 [n] disk index per request.
            off: uint64 [n] byte offset on the disk.
            length: uint32 [n] bytes per request.
            buf_off: uint64 [n] byte offset into ``buf``.
            buf: the buffer all requests read into / write from.

        Returns:
            int32 [n] status: bytes transferred per request.

        Raises:
            MisalignedRequestError, OutOfRangeError: before submission.
            DiskTruncatedError: a read hit the end of a disk.
            DiskFullError: a write failed with ENOSPC/EFBIG/EDQUOT.
            IOFailedError: any other failed request (first failure named),
                including transient errors retried ``retry_limit`` times in a
                row without progress.
            SwarmError: the engine is closed, or was opened in another process.
        """
        self._check_process()
        self._live()
        if not isinstance(buf, AlignedBuffer):
            raise E.InvalidArgumentError(
                f"buf must be an AlignedBuffer from Engine.alloc, not {type(buf).__name__}",
                store=self.store, layer=layer, cluster=cluster)
        length = np.asarray(length)
        if length.size and (length.min() <= 0 or length.max() > _MAX_REQUEST):
            raise E.OutOfRangeError(f"request lengths must be in [1, {_MAX_REQUEST}] bytes",
                                    store=self.store, layer=layer, cluster=cluster)
        disk = np.asarray(disk)
        if disk.size and (disk.dtype.kind not in "iu" or disk.min() < 0 or
                          disk.max() >= len(self.fds)):      # before narrowing to int32
            raise E.OutOfRangeError(f"disk indices must be integers in [0, {len(self.fds)})",
                                    store=self.store, layer=layer, cluster=cluster)
        disk = np.ascontiguousarray(disk, dtype=np.int32)
        off = np.ascontiguousarray(off, dtype=np.uint64)
        length = np.ascontiguousarray(length, dtype=np.uint32)
        buf_off = np.ascontiguousarray(buf_off, dtype=np.uint64)
        n = disk.shape[0]
        if not (off.shape[0] == length.shape[0] == buf_off.shape[0] == n):
            raise E.InvalidArgumentError("plan arrays differ in length", store=self.store,
                                         layer=layer, cluster=cluster)
        if check:
            self.check(disk, off, length, buf_off, buf_address=buf.address,
                       layer=layer, cluster=cluster)
        # always, even with check=False: a request outside buf would fail alone
        # in the kernel after the others ran (a write half done)
        size = np.uint64(buf.size)
        outside = (length > size) | (buf_off > size - np.minimum(length, size))
        if outside.any():
            i = int(np.flatnonzero(outside)[0])
            d = int(disk[i])
            raise E.OutOfRangeError(
                f"request {i} (buffer offset {int(buf_off[i])}, length {int(length[i])}) "
                f"does not fit the {buf.size}-byte buffer", store=self.store, disk=d,
                path=self.names[d] if 0 <= d < len(self.names) else None,
                layer=layer, cluster=cluster)
        status = np.empty(n, dtype=np.int32)
        if n == 0:
            return status
        info = ffi.new("se_exec_info *")
        with self._call() as ptr:
            rq = ffi.new("se_requests *", {
                "op": op, "n": n, "disk": ffi.from_buffer("int32_t[]", disk),
                "off": ffi.from_buffer("uint64_t[]", off),
                "len": ffi.from_buffer("uint32_t[]", length),
                "dst": ffi.from_buffer("uint64_t[]", buf_off), "buf": buf.cdata(),
                "buflen": buf.size, "buf_slot": buf.slot})
            failed = lib.se_execute(
                ptr, rq, ffi.from_buffer("int32_t[]", status, require_writable=True), info)
        if info.abandoned:
            buf._quarantine()
        if info.fallback:
            why = f"a thread could not set up its io_uring ring ({os.strerror(info.ring_errno)})"
            if info.ring_errno == errno.ENOMEM:
                why = memlock_hint(why)
            _warn_once("ring", f"swarmfs: {why}; that thread reads with pread")
        if failed < 0:
            raise E.IOFailedError(f"engine refused the plan: {os.strerror(-failed)}",
                                  errno=-failed, store=self.store, layer=layer,
                                  cluster=cluster)
        if failed:
            self._raise_failure(op, status, disk, off, layer, cluster, info)
        return status

    def _raise_failure(self, op, status, disk, off, layer, cluster, info=None):
        i = int(np.flatnonzero(status < 0)[0])
        code = -int(status[i])
        d = int(disk[i])
        kw = dict(store=self.store, disk=d, path=self.names[d], layer=layer,
                  cluster=cluster)
        what = "read" if op == READ else "write"
        nfail = int((status < 0).sum())
        msg = f"{what} at offset {int(off[i])} failed: {os.strerror(code)}" + \
              (f" ({nfail} requests failed)" if nfail > 1 else "")
        if info is not None and info.enter_errno and not lib.se_disk_on_threads(self._ptr, d):
            raise E.IOFailedError(
                f"{what} at offset {int(off[i])} failed: io_uring_enter failed "
                f"{info.enter_failures} times ({os.strerror(info.enter_errno)})"
                + (f"; gave up after {self.retry_limit} retries without progress"
                   if info.gave_up else "")
                + (f" ({nfail} requests failed)" if nfail > 1 else ""),
                errno=info.enter_errno, **kw)
        if code in (errno.EAGAIN, errno.EINTR):
            raise E.IOFailedError(msg + f"; gave up after {self.retry_limit} retries "
                                  "without progress", errno=code, **kw)
        if code == errno.ENODATA and op == READ:
            raise E.DiskTruncatedError(f"{what} at offset {int(off[i])} hit the end "
                                       "of the disk (disk truncated?)", **kw)
        if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) and op == WRITE:
            raise E.DiskFullError(msg, **kw)
        if code == errno.EINVAL:
            raise E.MisalignedRequestError(msg + " (the kernel rejected the O_DIRECT "
                                           "request)", **kw)
        raise E.IOFailedError(msg, errno=code, **kw)

    # -- counters --------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the counters as an :class:`EngineStats`; never waits
        for I/O in flight (the counters are atomics).

        Raises:
            SwarmError: the engine is closed, or was opened in another process.
        """
        self._check_process()
        c = ffi.new("se_counters *")
        d = ffi.new("se_disk_counters[]", len(self.fds))
        with self._call() as ptr:
            lib.se_get_counters(ptr, c, d)
        disks = tuple(DiskStats(int(d[i].requests), int(d[i].bytes),
                                d[i].busy_ns / 1e3) for i in range(len(self.fds)))
        buffer_error = self._buffer_error
        if buffer_error is None and c.last_buffer_errno:
            buffer_error = memlock_hint("registering a fixed buffer in a thread's ring "
                                        f"failed: {os.strerror(int(c.last_buffer_errno))}")
        nbuf = int(c.buffers)
        return EngineStats(
            engine=self.kind, queue_depth=self.queue_depth,
            registered_files=bool(lib.se_files_registered(self._ptr)),
            executes=int(c.executes), requests=int(c.requests), bytes=int(c.bytes),
            submit_calls=int(c.submit_calls), sqes=int(c.sqes), cqes=int(c.cqes),
            retries=int(c.retries), short_resubmits=int(c.short_resubmits),
            errors=int(c.errors), fixed_requests=int(c.fixed_requests), disks=disks,
            ring_flags=self.ring_flags,
            rings=int(c.rings_created) - int(c.rings_closed), in_flight=int(c.in_flight),
            enter_errors=int(c.enter_errors), gave_up=int(c.gave_up),
            long_waits=int(c.long_waits),
            fallback_executes=int(c.fallback_executes),
            buffers_registered=nbuf > 0 and buffer_error is None,
            registered_buffers=nbuf, buffer_register_errors=int(c.buffer_register_errors),
            buffer_error=buffer_error, memlock_limit=memlock_limit(),
            blocking_disks=int(lib.se_blocking_disks(self._ptr)),
            thread_requests=int(c.thread_requests))

    def close(self) -> None:
        """Tear down every ring (the file descriptors stay open).

        Waits until the calls in flight in other threads have returned (each
        is bounded, see the module docstring); calls that begin after this
        raise SwarmError.  Registered buffers stay usable as plain memory.
        Idempotent.
        """
        with self._cv:
            if self._ptr is None or self._closing:
                return
            self._closing = True
            self._cv.wait_for(lambda: self._calls == 0)
            for buf in list(self._registered):
                if buf._unreg is not None:
                    buf._unreg.detach()      # se_close drops every registration
                    buf._unreg = None
                buf.slot = -1
                buf._engine = None
            self._registered.clear()
            self._finalizer()
            self._ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
