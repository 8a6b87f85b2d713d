"""KV reads for the mount: byte ranges of cluster files, with read-ahead for
sequential streams.

A range read plans exactly the entries the byte range covers
(``Store.plan_copies``) and executes that plan with ``Store.execute`` -- the
fast path's planner, engine and per-entry checksum verification -- gathering
into a reusable buffer instead of fresh memory (a fresh 1 MiB result costs as
much in page faults as the I/O itself).

Sequential streams (two reads in a row on one open file, each starting where
the previous ended) get read-ahead: windows of the byte stream that double
from twice the request size up to ``window_max`` are read in worker threads,
at most ``depth`` ahead of the reader, while the reader is served from memory.
A single or random read never reads more than the entries it covers, and all
read-ahead memory comes from one pool bounded by ``budget`` bytes; when the
pool is exhausted, reads simply go without read-ahead.

Per-disk queues (:class:`DiskAdmission`): every read reserves a slot on each
disk it reads before it takes a worker thread, and at most ``per_disk`` reads
in flight touch any one disk (default: half the worker threads).  A read over
several disks runs whole, one batched submission, while each of its disks has
fewer than ``per_disk // 2`` reads in flight; otherwise it is split into one
part per disk, each queued on its own disk.  So readers stuck on one slow
disk hold at most ``per_disk`` threads, and of any other disk's slots at most
the ``per_disk // 2`` whole reads that were admitted before the disk stalled:
readers of the other disks always find a slot and (with at least two worker
threads) a thread.

Buffer lifetime: ``read`` returns a memoryview into a pooled buffer, which
pyfuse3 copies to the kernel before any other trio task runs (there is no
``await`` between our return and its reply).  Buffers are therefore recycled
only at the start of a later ``read`` or when a dropped window's fill ends,
never while a returned view may still be pending.
"""

from __future__ import annotations

import collections
import logging

import numpy as np
import trio

from .. import _errors as E
from .. import _validate as V
from ..store._kernels import scatter_rows

__all__ = ["BufferPool", "DiskAdmission", "KVReader", "Stream"]

log = logging.getLogger("swarmfs.fuse")

_MIN_BUFFER = 64 << 10
_MIN_WINDOW = 256 << 10


class BufferPool:
    """Reusable uint8 buffers in power-of-two size classes, at most ``budget``
    bytes in total (allocated lazily, kept until the mount ends)."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.allocated = 0
        self._free: dict[int, list] = collections.defaultdict(list)
        self._owned: set[int] = set()      # ids of pool buffers (never freed)

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return max(_MIN_BUFFER, 1 << max(int(nbytes) - 1, 1).bit_length())

    def get(self, nbytes: int) -> np.ndarray | None:
        """A buffer of at least ``nbytes``, or None when the budget is spent."""
        size = self._size_class(nbytes)
        free = self._free[size]
        if free:
            return free.pop()
        if self.allocated + size > self.budget:
            return None
        self.allocated += size
        buf = np.empty(size, dtype=np.uint8)
        self._owned.add(id(buf))
        return buf

    def put(self, buf: np.ndarray) -> None:
        """Return a buffer; buffers the pool did not hand out are ignored."""
        if id(buf) in self._owned:
            self._free[buf.shape[0]].append(buf)

    @property
    def idle_bytes(self) -> int:
        """Bytes held by free buffers kept for reuse."""
        return sum(k * len(v) for k, v in self._free.items())


class _Waiter:
    """A read part queued for a slot on one disk."""
    __slots__ = ("event", "admitted")

    def __init__(self):
        self.event = trio.Event()
        self.admitted = False


class DiskAdmission:
    """Per-disk queues: which reads of the mount may be in flight.

    Every read holds a slot on each disk it reads while it runs, and a disk
    has ``per_disk`` slots.  A read over several disks is admitted whole
    (:meth:`try_whole`) only while each of its disks has fewer than
    ``whole`` reads in flight; otherwise the caller splits it into one part
    per disk, and each part waits for a slot on its own disk
    (:meth:`acquire`, first come first served per disk).  Hence, with
    ``whole < per_disk``: reads stuck on one disk hold at most ``per_disk``
    slots in all, and at most ``whole`` slots of any other disk, so every
    other disk keeps ``per_disk - whole`` slots for its own readers.

    Args:
        num_disks: disks of the store.
        per_disk: slots per disk (>= 1).
        whole: in-flight reads per disk up to which a read over several disks
            still runs whole (0: such reads are always split).

    Concurrency: trio tasks of one thread; no locks (nothing here awaits
    except :meth:`acquire`, and a cancelled :meth:`acquire` leaves no slot
    behind).
    """

    def __init__(self, num_disks: int, per_disk: int, whole: int):
        self.num_disks = int(num_disks)
        self.per_disk = int(per_disk)
        self.whole = min(int(whole), self.per_disk)
        self.in_flight = np.zeros(self.num_disks, dtype=np.int64)
        self._queues: list[collections.deque] = [collections.deque()
                                                 for _ in range(self.num_disks)]
        self.waits = 0

    def try_whole(self, disks: np.ndarray) -> bool:
        """Take a slot on every disk of ``disks`` (int [k], distinct) if each
        has fewer than ``whole`` reads in flight; False (nothing taken)
        otherwise."""
        if not (self.in_flight[disks] < self.whole).all():
            return False
        self.in_flight[disks] += 1
        return True

    async def acquire(self, d: int) -> None:
        """Wait for a slot on disk ``d`` (behind the parts already queued
        there).  Release it with :meth:`release`."""
        q = self._queues[d]
        if not q and self.in_flight[d] < self.per_disk:
            self.in_flight[d] += 1
            return
        w = _Waiter()
        q.append(w)
        self.waits += 1
        try:
            await w.event.wait()
        except BaseException:
            if w.admitted:                  # the slot came with the cancellation
                self.release((d,))
            else:
                q.remove(w)
            raise

    def release(self, disks) -> None:
        """Give back one slot on each disk of ``disks`` (ints) and hand it to
        the next part queued there."""
        for d in disks:
            self.in_flight[d] -= 1
            q = self._queues[d]
            while q and self.in_flight[d] < self.per_disk:
                w = q.popleft()
                w.admitted = True
                self.in_flight[d] += 1
                w.event.set()

    def stats(self) -> dict:
        """Slots per disk (``per_disk``), the whole-read limit
        (``whole_per_disk``), reads in flight and parts waiting per disk
        (``disk_in_flight``, ``disk_waiting``: lists in disk order) and the
        parts that had to wait so far (``disk_waits``)."""
        return {"per_disk": self.per_disk, "whole_per_disk": self.whole,
                "disk_in_flight": self.in_flight.tolist(),
                "disk_waiting": [len(q) for q in self._queues], "disk_waits": self.waits}


class _Window:
    """Bytes [start, end) of a cluster file, being read into ``buf`` (which
    holds whole entries from byte ``base`` on)."""
    __slots__ = ("start", "end", "buf", "base", "done", "error", "dropped")

    def __init__(self, start: int, end: int, buf: np.ndarray):
        self.start, self.end, self.buf = start, end, buf
        self.base = 0
        self.done = trio.Event()
        self.error: BaseException | None = None
        self.dropped = False


class Stream:
    """Read state of one open cluster file: the layer index of the generation
    it was opened on (``li``; default: the store's current one, looked up per
    read) and its read-ahead windows."""

    def __init__(self, layer: int, cluster: int, nbytes: int, li=None):
        self.layer, self.cluster, self.nbytes = layer, cluster, int(nbytes)
        self.li = li
        self.windows: collections.deque = collections.deque()
        self.next_off = 0
        self.sequential = 0
        self.window = 0
        self.closed = False
        self.lock = trio.Lock()


class KVReader:
    """Serves byte ranges of cluster files (kv.bin's byte stream).

    Args:
        store: the open store.
        limiter: trio CapacityLimiter for worker threads.
        budget: bytes of buffers for reads and read-ahead.
        window_max: largest read-ahead window (bytes); 0 disables read-ahead.
        depth: read-ahead windows kept in flight ahead of the reader.
        engines: stores (open on the same disks) whose engines serve reads,
            ``store`` included (default: ``[store]``); reads take them in
            turn (an engine serves any number of threads at once).
        per_disk: reads in flight that may touch one disk (default: half
            the limiter's threads, at least 1); see :class:`DiskAdmission`
            (whole reads over several disks: up to ``per_disk // 2`` per disk).

    Concurrency: ``read`` may run concurrently for any streams (trio tasks of
    one thread); the blocking reads run in worker threads.  Reads wait for
    a slot on each disk they read (per-disk queues) before they take a
    thread, so reads stuck on one disk hold at most ``per_disk`` of the
    limiter's threads: with ``per_disk`` below the thread count (the
    default), readers of the other disks keep being served.
    """

    def __init__(self, store, *, limiter, budget: int = 256 << 20,
                 window_max: int = 16 << 20, depth: int = 2, engines=None,
                 per_disk: int | None = None):
        self.store = store
        self.engines = list(engines) if engines else [store]
        self._turn = 0
        # windows hold whole stripes: a multiple of N entries spans every disk
        self.stripe_bytes = int(store.entry_bytes) * int(store.num_disks)
        self.entry_bytes = int(store.entry_bytes)
        self.limiter = limiter
        if per_disk is None:
            per_disk = max(1, int(limiter.total_tokens) // 2)
        per_disk = V.parse_positive_int(per_disk, "per_disk", 1 << 20)
        self.admission = DiskAdmission(store.num_disks, per_disk, per_disk // 2)
        self.pool = BufferPool(budget)
        self.window_max = int(window_max)
        self.depth = int(depth)
        self.nursery: trio.Nursery | None = None
        self._recycle: list = []
        self.counters = dict(readahead_hits=0, readahead_misses=0, readahead_windows=0,
                             readahead_bytes=0, readahead_failed=0, split_reads=0)

    # -- blocking part (worker threads) ----------------------------------------------
    @staticmethod
    def _read_rows(li, copies: np.ndarray, cid: int, rows: np.ndarray, store) -> None:
        """Read the entries of ``copies`` into ``rows`` (uint8 [k, entry
        bytes]) in one batched submission of ``store``'s engine, checksums
        verified.

        Raises:
            ChecksumError, IOFailedError, DiskTruncatedError: from the store.
        """
        plan = store.plan_copies(li, copies, key=np.arange(copies.shape[0]))
        store.execute(li, plan, copies, out=rows, cluster=cid)

    def _read_scattered(self, li, copies: np.ndarray, sel: np.ndarray, cid: int,
                        rows: np.ndarray, tmp: np.ndarray, store) -> None:
        """One disk's part of a split read: its entries into ``tmp`` (uint8
        [k, entry bytes]), then each to its row ``sel`` of ``rows``."""
        self._read_rows(li, copies, cid, tmp, store)
        Eb = self.entry_bytes
        scatter_rows(rows.reshape(-1), sel * Eb, tmp, np.arange(sel.shape[0]), Eb)

    async def _run(self, fn, *args):
        """``fn(*args, store)`` in a worker thread, ``store`` the next engine."""
        store = self.engines[self._turn % len(self.engines)]
        self._turn += 1
        return await trio.to_thread.run_sync(fn, *args, store, limiter=self.limiter)

    async def _read_into(self, stream: Stream, start: int, end: int,
                         buf: np.ndarray) -> int:
        """Read the entries covering bytes [start, end) of the stream's
        cluster file into ``buf`` in worker threads, through the per-disk
        queues; returns the byte offset (in the file) of ``buf[0]``.

        Raises:
            ChecksumError, IOFailedError, DiskTruncatedError: from the store
                (the first failing part's, once every part has ended).
        """
        li = stream.li
        if li is None:
            li = await trio.to_thread.run_sync(self.store.layer, stream.layer,
                                               limiter=self.limiter)
        Eb = self.entry_bytes
        j0, j1 = start // Eb, -(-end // Eb)
        copies = li.cluster_copies([stream.cluster])[j0:j1]
        rows = buf[:(j1 - j0) * Eb].reshape(j1 - j0, Eb)
        on = li.copy_disk[copies]
        disks = np.flatnonzero(np.bincount(on, minlength=self.admission.num_disks))
        adm = self.admission
        if disks.size > 1 and adm.try_whole(disks):
            try:
                await self._run(self._read_rows, li, copies, stream.cluster, rows)
            finally:
                adm.release(disks.tolist())
        elif disks.size == 1:
            await self._part(li, copies, None, int(disks[0]), stream.cluster, rows)
        else:
            self.counters["split_reads"] += 1
            failures = []

            async def part(d):
                try:
                    sel = np.flatnonzero(on == d)
                    await self._part(li, copies[sel], sel, d, stream.cluster, rows)
                except Exception as exc:        # the other parts still end first
                    failures.append(exc)

            async with trio.open_nursery() as nursery:
                for d in disks.tolist():
                    nursery.start_soon(part, d)
            if failures:
                raise failures[0]
        return j0 * Eb

    async def _part(self, li, copies: np.ndarray, sel, d: int, cid: int,
                    rows: np.ndarray) -> None:
        """The entries of ``copies`` (all on disk ``d``) into rows ``sel`` of
        ``rows`` (None: all of them, in order), once disk ``d`` has a slot."""
        await self.admission.acquire(d)
        tmp = None
        try:
            if sel is None:
                await self._run(self._read_rows, li, copies, cid, rows)
            else:
                k = sel.shape[0]
                tmp = self._buffer(k * self.entry_bytes)
                await self._run(self._read_scattered, li, copies, sel, cid, rows,
                                tmp[:k * self.entry_bytes].reshape(k, self.entry_bytes))
        finally:
            self.admission.release((d,))
            if tmp is not None:
                self.pool.put(tmp)

    # -- trio part ---------------------------------------------------------------------
    def _buffer(self, nbytes: int) -> np.ndarray:
        buf = self.pool.get(nbytes)
        return buf if buf is not None else np.empty(nbytes, dtype=np.uint8)

    def _drop(self, w: _Window) -> None:
        if w.done.is_set():
            self.pool.put(w.buf)
        else:
            w.dropped = True

    async def read(self, stream: Stream, off: int, size: int):
        """Bytes [off, off+size) of the stream's cluster file (shorter only at
        EOF), as a buffer object valid until the reply is sent.

        Raises:
            ChecksumError, IOFailedError, DiskTruncatedError: from the store,
                only when an entry the range covers cannot be read.
        """
        for buf in self._recycle:
            self.pool.put(buf)
        self._recycle.clear()
        end = min(off + size, stream.nbytes)
        if off >= end:
            return b""
        Eb = self.entry_bytes
        async with stream.lock:
            wins = stream.windows
            while wins and wins[0].end <= off:          # consumed windows
                self._drop(wins.popleft())
            hit = None
            for w in wins:
                if w.start <= off < w.end:
                    if w.end >= end:
                        hit = w
                    break
            if hit is not None:
                # a read-ahead window (its buffer is the stream's: under the lock)
                await hit.done.wait()
                if hit.error is None:
                    self.counters["readahead_hits"] += 1
                    self._advance(stream, off, end, True)
                    return memoryview(hit.buf)[off - hit.base:end - hit.base]
                self.counters["readahead_failed"] += 1
                for w in wins:
                    self._drop(w)
                wins.clear()
        # a miss reads into a buffer of its own without the stream's lock, so a
        # read stuck on one disk does not hold up the stream's other reads
        # (several readers of one open file: issue 26's isolation)
        self.counters["readahead_misses"] += 1
        buf = self._buffer(end - off + 2 * Eb)
        base = await self._read_into(stream, off, end, buf)
        async with stream.lock:
            self._advance(stream, off, end, hit is not None)
        # recycled at the next read's start, once this reply is sent: nothing
        # may await between here and the return
        self._recycle.append(buf)
        return buf.data[off - base:end - base]

    def _advance(self, stream: Stream, off: int, end: int, hit: bool) -> None:
        """A read of [off, end) ended: the sequential count and read-ahead
        (the stream's lock held)."""
        if off == stream.next_off or hit:
            stream.sequential += 1
        else:
            stream.sequential = 0
        stream.next_off = end
        if stream.sequential >= 2 and self.window_max > 0 and not stream.closed:
            self._read_ahead(stream, end, end - off)

    def _read_ahead(self, stream: Stream, pos: int, req: int) -> None:
        wins = stream.windows
        ahead = sum(1 for w in wins if w.end > pos)
        nxt = wins[-1].end if wins else pos
        nxt = max(nxt, pos)
        while ahead < self.depth and nxt < stream.nbytes and self.nursery is not None:
            stream.window = min(self.window_max,
                                max(2 * stream.window, 2 * req, _MIN_WINDOW))
            span = max(stream.window // self.stripe_bytes, 1) * self.stripe_bytes
            wend = min(nxt + span, stream.nbytes)
            buf = self.pool.get(wend - nxt + 2 * self.entry_bytes)
            if buf is None:
                return
            w = _Window(nxt, wend, buf)
            wins.append(w)
            self.counters["readahead_windows"] += 1
            self.counters["readahead_bytes"] += wend - nxt
            self.nursery.start_soon(self._fill, stream, w)
            ahead += 1
            nxt = wend

    async def _fill(self, stream: Stream, w: _Window) -> None:
        try:
            w.base = await self._read_into(stream, w.start, w.end, w.buf)
        except (E.SwarmError, OSError) as exc:
            # the reader re-reads the range itself and gets the error if it
            # covers the bad entries
            w.error = exc
            log.debug("read-ahead of layer %d cluster %d bytes [%d, %d) failed: %s",
                      stream.layer, stream.cluster, w.start, w.end, exc)
        except Exception as exc:
            w.error = exc
            log.exception("read-ahead failed")
        except BaseException as exc:          # cancelled at unmount
            w.error = exc
            raise
        finally:
            w.done.set()
            if w.dropped:
                self.pool.put(w.buf)

    def close(self, stream: Stream) -> None:
        """Drop a stream's windows (their buffers return to the pool)."""
        stream.closed = True
        while stream.windows:
            self._drop(stream.windows.popleft())

    def stats(self) -> dict:
        """Counters of the reader (read-ahead hits, misses, windows, bytes and
        failures; ``split_reads``: reads over several disks split per disk),
        pool usage, its settings and :meth:`DiskAdmission.stats` (a dict
        copy, JSON-ready)."""
        out = dict(self.counters)
        out.update(pool_budget=self.pool.budget, pool_allocated=self.pool.allocated,
                   window_max=self.window_max, depth=self.depth, engines=len(self.engines))
        out.update(self.admission.stats())
        return out
