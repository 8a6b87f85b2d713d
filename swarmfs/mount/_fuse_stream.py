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

__all__ = ["BufferPool", "KVReader", "Stream"]

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

    @property
    def source(self):
        """What ``KVReader.read_into`` reads from: the pinned layer index, or
        the layer number."""
        return self.layer if self.li is None else self.li


class KVReader:
    """Serves byte ranges of cluster files (kv.bin's byte stream).

    Args:
        store: the open store.
        limiter: trio CapacityLimiter for worker threads.
        budget: bytes of buffers for reads and read-ahead.
        window_max: largest read-ahead window (bytes); 0 disables read-ahead.
        depth: read-ahead windows kept in flight ahead of the reader.
        engines: stores (open on the same disks) whose engines serve reads in
            parallel, ``store`` included (default: ``[store]``).  An engine
            runs one batched submission at a time, so concurrent requests and
            read-ahead windows overlap their I/O only on different engines;
            each read takes an idle one.

    Concurrency: ``read`` may run concurrently for any streams (trio tasks of
    one thread); the blocking reads run in worker threads, at most one per
    engine at a time.
    """

    def __init__(self, store, *, limiter, budget: int = 256 << 20,
                 window_max: int = 16 << 20, depth: int = 2, engines=None):
        self.store = store
        self.engines = list(engines) if engines else [store]
        self._idle = list(self.engines)
        self._engine_sem = trio.Semaphore(len(self.engines))
        # windows hold whole stripes: a multiple of N entries spans every disk
        self.stripe_bytes = int(store.entry_bytes) * int(store.num_disks)
        self.entry_bytes = int(store.entry_bytes)
        self.limiter = limiter
        self.pool = BufferPool(budget)
        self.window_max = int(window_max)
        self.depth = int(depth)
        self.nursery: trio.Nursery | None = None
        self._recycle: list = []
        self.counters = dict(readahead_hits=0, readahead_misses=0, readahead_windows=0,
                             readahead_bytes=0, readahead_failed=0)

    # -- blocking part (worker threads) ----------------------------------------------
    def read_into(self, layer, cid: int, start: int, end: int, buf: np.ndarray,
                  store=None) -> int:
        """Read the entries covering bytes [start, end) of a cluster file into
        ``buf`` with ``store``'s engine (default: the main store); returns the
        byte offset (in the file) of ``buf[0]``.  ``layer`` is a layer number
        or a ``LayerIndex`` (a pinned generation).

        Raises:
            ChecksumError, IOFailedError, DiskTruncatedError: from the store.
        """
        store = self.store if store is None else store
        Eb = self.entry_bytes
        j0, j1 = start // Eb, -(-end // Eb)
        li = self.store.layer(layer) if isinstance(layer, int) else layer
        copies = li.cluster_copies([cid])[j0:j1]
        k = j1 - j0
        plan = store.plan_copies(li, copies, key=np.arange(k))
        store.execute(li, plan, copies, out=buf[:k * Eb].reshape(k, Eb), cluster=cid)
        return j0 * Eb

    async def _read_into(self, stream: "Stream", start: int, end: int,
                         buf: np.ndarray) -> int:
        """:meth:`read_into` in a worker thread, on an idle engine."""
        async with self._engine_sem:
            store = self._idle.pop()
            try:
                return await trio.to_thread.run_sync(
                    self.read_into, stream.source, stream.cluster, start, end, buf, store,
                    limiter=self.limiter)
            finally:
                self._idle.append(store)

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
            out = None
            if hit is not None:
                await hit.done.wait()
                if hit.error is None:
                    self.counters["readahead_hits"] += 1
                    out = memoryview(hit.buf)[off - hit.base:end - hit.base]
                else:
                    self.counters["readahead_failed"] += 1
                    for w in wins:
                        self._drop(w)
                    wins.clear()
            if out is None:
                self.counters["readahead_misses"] += 1
                buf = self._buffer(end - off + 2 * Eb)
                base = await self._read_into(stream, off, end, buf)
                out = memoryview(buf)[off - base:end - base]
                self._recycle.append(buf)
            if off == stream.next_off or hit is not None:
                stream.sequential += 1
            else:
                stream.sequential = 0
            stream.next_off = end
            if stream.sequential >= 2 and self.window_max > 0 and not stream.closed:
                self._read_ahead(stream, end, end - off)
            return out

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
        """Counters of the reader, pool usage and its settings (a dict copy)."""
        out = dict(self.counters)
        out.update(pool_budget=self.pool.budget, pool_allocated=self.pool.allocated,
                   window_max=self.window_max, depth=self.depth, engines=len(self.engines))
        return out
