"""The cluster-addressed store: KV clusters striped over N disks.

``Store`` is the facade: ``Store.create`` makes a store (superblocks, empty
manifest), ``Store.open`` checks it (manifest, disks, index headers) and
holds the reader lease; ``write_layer``/``append`` run a write transaction
(``_write.Transaction``: placement by eq. 7, batched O_DIRECT writes, one
atomic commit); ``read_cluster``/``read_entries`` plan (``_planner``) and
hand the plan to the executor (``_executor.Executor``: one batched
submission, checksums, damage location).  The manifest is a frozen
``_manifest.Manifest``; ``_format`` has the bytes on the disks.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import shutil
import threading
import time
import weakref

import numpy as np

from .. import _defaults
from .. import _errors as E
from .. import _validate as V
from . import _format as F
from . import _inspect, _write
from ._disks import ReaderLease, create_disks, open_disks, prepare_store_dir
from ._engine import AlignedBuffer, Engine, EngineStats
from ._executor import Executor
from ._index import LayerIndex, unique_ints
from ._manifest import LayerRecord, Manifest, ModelIdentity, read_manifest, write_manifest
from ._planner import MAX_REQUEST, Plan, plan_reads

__all__ = ["Store", "StoreStats"]

_OPEN_RETRIES = 8            # opens that race a writer's commits


@V.checked_methods
@dataclasses.dataclass(frozen=True)
class StoreStats:
    """Store-level counters plus the engine's.

    Attributes:
        engine: engine counters (:class:`EngineStats`), incl. per-disk bytes,
            requests and busy time.
        verify_checksums: whether reads verify XXH3-64 checksums.
        cluster_reads: ``read_cluster`` calls.
        entry_reads: ``read_entries`` and plan executions.
        entries_returned: KV entries handed back to callers.
        bytes_returned: bytes of KV entries handed back (bytes).
        bytes_read: bytes read from the disks, incl. alignment and gaps (bytes).
        checksum_failures: entries or extents whose checksum did not match.
    """
    engine: EngineStats
    verify_checksums: bool
    cluster_reads: int
    entry_reads: int
    entries_returned: int
    bytes_returned: int
    bytes_read: int
    checksum_failures: int


@V.checked_methods
class Store:
    """A KV-cache store: clusters of KV entries striped over several disks.

    Open with :meth:`open` or create with :meth:`create`; do not call the
    constructor.

    Concurrency: a Store is safe to read from several threads.  Writes
    (``write_layer``, ``append``) serialise across the Store's threads and
    across processes (a second writing process gets a SwarmError).  Other
    Stores (threads, processes, the mount) may read while a writer commits:
    each holds a reader lease on the generation it opened, and the space
    that generation references is not reused while the lease is held, so
    they keep reading correct bytes.  A read in flight on the writing Store
    itself reads the generation current when it started: every LayerIndex
    the Store loaded claims its generation until it is garbage, so the
    space it references is not reused meanwhile (also with verify=False).
    Public methods raise only SwarmError subclasses (an unexpected exception
    is an :class:`InternalError`).

    Attributes:
        path: the store directory.
        model: the model identity (:class:`~swarmfs.store._manifest.ModelIdentity`:
            name, shape, dtype, entry bytes).
        num_layers, num_kv_heads, head_dim: model shape.
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
        entry_bytes: bytes of one KV entry: 2 x num_kv_heads x head_dim x itemsize.
        entry_shape: ``(2, num_kv_heads, head_dim)``.
        block_size: store block size in bytes (extent alignment).
        num_disks: N.
        disk_paths: paths of the disks, in disk order.
        engine: the :class:`Engine` in use.
        verify_checksums: whether reads verify checksums.
    """

    def __init__(self, path, manifest, fds, *, engine_kind, queue_depth, verify,
                 writable):
        self.path = os.path.abspath(path)
        self._m: Manifest = manifest
        self._fds = fds
        self.writable = writable
        model = manifest.model
        self.model = model
        self.num_layers = model.num_layers
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.dtype = model.dtype
        self.np_dtype = F.numpy_dtype(self.dtype)
        self.entry_shape = (2, self.num_kv_heads, self.head_dim)
        self.entry_bytes = model.entry_bytes
        self.block_size = manifest.block_size
        self.num_disks = len(manifest.disks)
        self.disk_paths = [manifest.disk_path(self.path, d) for d in range(self.num_disks)]
        self.verify_checksums = bool(verify)
        self.engine = Engine(fds, kind=engine_kind, queue_depth=queue_depth,
                             block_sizes=[self.block_size] * self.num_disks,
                             names=self.disk_paths, store=self.path)
        self._executor = Executor(self.engine, fds, path=self.path,
                                  disk_paths=self.disk_paths, entry_bytes=self.entry_bytes,
                                  block_size=self.block_size)
        self._layers: dict[int, LayerIndex] = {}
        self._lock = threading.RLock()
        self._writer_mutex = threading.Lock()
        self._closed = False
        self.disk_problems: dict = {}
        self._lease = ReaderLease(self.path)

    # -- construction --------------------------------------------------------
    @classmethod
    @E.boundary
    def create(cls, path, *, disks=4, num_layers: int, num_kv_heads: int,
               head_dim: int, dtype: str = "float16", model_name: str | None = None,
               num_query_heads: int | None = None, disk_size: int | None = None,
               block_size: int | None = None, force: bool = False,
               engine: str | None = None, queue_depth: int = 128,
               verify: bool = True) -> Store:
        """Create an empty store.

        Args:
            path: store directory (created; must be absent or empty).
            disks: a number N (file disks ``STORE/disks/disk-I.img``) or a list
                of paths (regular files, created if absent, or block devices).
            num_layers, num_kv_heads, head_dim: model shape.
            dtype: KV dtype name: float16, bfloat16 or float32.
            model_name: free text recorded in the manifest.
            num_query_heads: query heads (GQA), recorded for retrieval.
            disk_size: bytes to preallocate per file disk (``posix_fallocate``);
                it becomes the disk's capacity.  Default: files grow.
            block_size: extent alignment in bytes; default the largest logical
                block size of the disks (at least 512).
            force: replace an existing store at ``path`` and overwrite disks
                that belong to another store.
            engine, queue_depth, verify: as for :meth:`open`.

        Raises:
            StoreExistsError: ``path`` holds files and ``force`` is False, or a
                disk belongs to another store.
            ShapeError: bad model shape or dtype.
            DiskError: a disk cannot be opened with O_DIRECT.
            DiskFullError: preallocation failed for lack of space.
        """
        path = os.path.abspath(V.parse_path(path, "path"))
        force = V.parse_bool(force, "force", store=path)
        model = ModelIdentity.new(name=model_name, num_layers=num_layers,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  num_query_heads=num_query_heads, dtype=dtype)
        if disk_size is not None:
            disk_size = V.parse_nonneg_int(disk_size, "disk_size", 1 << 62)
            if disk_size and disk_size < F.DATA_START:
                raise E.InvalidIntegerError(f"disk_size {disk_size} is smaller than the "
                                            f"{F.DATA_START}-byte disk header",
                                            argument="disk_size")
        if block_size is not None:
            block_size = V.parse_nonneg_int(block_size, "block_size", 1 << 62)
        if isinstance(disks, (str, bytes, os.PathLike)) or not isinstance(
                disks, (bool, int, np.integer, collections.abc.Iterable)):
            raise E.InvalidTypeError(f"disks must be a number of disk files or a list of "
                                     f"paths, got {disks!r}"[:300], argument="disks")
        if not isinstance(disks, collections.abc.Iterable):
            disks = V.parse_int(disks, "disks", 1, 256)
        else:
            disks = [V.parse_path(p, "disks") for p in disks]
        V.parse_int(queue_depth, "queue_depth", 1, 32768)
        V.parse_bool(verify, "verify")
        created = prepare_store_dir(path, force)
        try:
            return cls._create(path, disks=disks, model=model, disk_size=disk_size,
                               block_size=block_size, force=force, engine=engine,
                               queue_depth=queue_depth, verify=verify)
        except BaseException:
            if created:      # leave nothing behind for a store that never existed
                shutil.rmtree(path, ignore_errors=True)
            raise

    @classmethod
    def _create(cls, path, *, disks, model, disk_size, block_size, force, engine, queue_depth,
                verify):
        if isinstance(disks, int):
            os.makedirs(os.path.join(path, "disks"), exist_ok=True)
            disk_paths = [os.path.join(path, "disks", f"disk-{i}.img") for i in range(disks)]
        else:
            disk_paths = [os.path.abspath(str(p)) for p in disks]
            if not 1 <= len(disk_paths) <= 256 or len(set(disk_paths)) != len(disk_paths):
                raise E.InvalidArgumentError("disks must be 1 to 256 distinct paths",
                                             argument="disks", store=path)

        def make_manifest(uid, caps, bs):
            return Manifest.new(path, uuid=uid.hex(), model=model, block_size=bs,
                                disk_paths=[cls._rel(path, p) for p in disk_paths],
                                capacities=caps)

        manifest = create_disks(path, disk_paths, force=force, disk_size=disk_size,
                                block_size=block_size, engine=engine,
                                make_manifest=make_manifest)
        write_manifest(path, manifest)
        return cls.open(path, engine=engine, queue_depth=queue_depth, verify=verify,
                        writable=True)

    @staticmethod
    def _rel(store, p):
        rp = os.path.relpath(p, store)
        return rp if not rp.startswith("..") else p

    @classmethod
    @E.boundary
    def open(cls, path, *, engine: str | None = None, queue_depth: int = 128,
             verify: bool = True, writable: bool = False,
             preload: bool = False, damaged: bool = False) -> Store:
        """Open a store and check every disk against the manifest.

        The manifest is schema-checked; each disk's superblock must carry
        this store's UUID, its disk index and the model identity (dtype, KV
        heads, head_dim, entry bytes) the manifest claims; each disk's commit
        records must hold the manifest's generation and checksum, and none a
        newer committed generation; each layer's index-file header must
        agree with the manifest's counts.  An open that races a writer's
        commit re-reads the manifest and tries again, so it sees one
        consistent generation.

        Args:
            path: store directory.
            engine: ``"auto"``, ``"io_uring"`` or ``"threads"`` (default
                ``$SWARMFS_ENGINE`` or auto).
            queue_depth: io_uring queue depth (threads for the fallback).
            verify: verify XXH3-64 checksums of everything read (default on).
            writable: open the disks read-write (needed for ``write_layer``).
            preload: load every layer's index now instead of on first use
                (long-lived readers: a writer deletes index files two
                generations old, which a lazy reader could still need).
            damaged: open a damaged store for :meth:`verify`: a disk that is
                missing, foreign, from another generation or truncated is
                recorded in ``disk_problems`` instead of refusing the open
                (reads that touch it fail; ``verify`` reports what is lost).
                Read-only.

        Raises:
            StoreNotFoundError, ManifestError: no or bad manifest, or one
                the disks contradict (rolled back, edited).
            DiskMissingError: a disk path is gone.
            DiskMismatchError: a disk is foreign, swapped, from another
                generation or has no superblock.
            DiskTruncatedError: a disk is shorter than its committed data.
            DiskError: a disk path is not a regular file or block device.
        """
        path = V.parse_path(path, "path")
        V.parse_int(queue_depth, "queue_depth", 1, 32768)
        for name, v in (("verify", verify), ("writable", writable), ("preload", preload),
                        ("damaged", damaged)):
            V.parse_bool(v, name)
        if damaged and writable:
            raise E.InvalidArgumentError("a damaged store can only be opened read-only",
                                         argument="damaged")
        path = os.path.abspath(path)
        for attempt in range(_OPEN_RETRIES):
            m = read_manifest(path)
            try:
                return cls._open_once(path, m, engine=engine, queue_depth=queue_depth,
                                      verify=verify, writable=writable, preload=preload,
                                      damaged=damaged)
            except (E.ManifestError, E.DiskMismatchError):
                # a writer may have committed between our manifest read and the
                # disk/index checks: retry on the newer manifest, else report
                now = read_manifest(path)
                if now.checksum == m.checksum or attempt == _OPEN_RETRIES - 1:
                    raise
                time.sleep(0.001 * (attempt + 1))
        raise E.InternalError("unreachable: the last open attempt returns or raises")

    @classmethod
    def _open_once(cls, path, m, *, engine, queue_depth, verify, writable, preload,
                   damaged):
        fds, problems = open_disks(path, m, writable=writable, damaged=damaged)
        try:
            store = cls(path, m, fds, engine_kind=engine, queue_depth=queue_depth,
                        verify=verify, writable=writable)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        store.disk_problems = problems
        try:
            # claim the generation, then make sure no writer could have reused
            # its space before the claim was visible (two commits later)
            store._lease.hold(m.generation)
            now = read_manifest(path)
            if now.generation > m.generation + 1:
                raise E.ManifestError("the store moved on while opening", store=path)
            for layer in store.layers:
                store._check_index_header(layer)
            F.check_orphan_indexes(path, m.layers, m.generation)
            if preload:
                for layer in store.layers:
                    store.layer(layer)
        except BaseException:
            store.close()
            raise
        return store

    @E.boundary
    def close(self) -> None:
        """Close the engine and the disks."""
        with self._writer_mutex:    # a write in progress finishes first
            if self._closed:
                return
            self._closed = True
            self._executor.close()
            self.engine.close()
            for fd in self._fds:
                os.close(fd)
            self._lease.close()

    def __enter__(self):
        if self._closed:
            raise E.SwarmError("the store is closed", store=self.path)
        return self

    def __exit__(self, *exc):
        self.close()

    # -- description ----------------------------------------------------------
    @property
    def uuid(self) -> str:
        """The store's UUID (32 hex digits), as in every superblock."""
        return self._m.uuid

    @property
    def manifest(self) -> dict:
        """A copy of the committed manifest, as its JSON dict."""
        return self._m.to_dict()

    @property
    def committed(self) -> Manifest:
        """The committed manifest this Store reads (frozen; a commit replaces it)."""
        return self._m

    @property
    def layers(self) -> list[int]:
        """Layers that hold data, ascending."""
        return sorted(self._m.layers)

    def _check_layer(self, layer) -> int:
        if self._closed:
            raise E.SwarmError("the store is closed", store=self.path)
        layer = V.parse_index(layer, "layer", store=self.path)
        if not 0 <= layer < self.num_layers:
            raise E.OutOfRangeError(f"layer {layer} outside [0, {self.num_layers})",
                                    store=self.path, layer=layer)
        if layer not in self._m.layers:
            raise E.OutOfRangeError("layer holds no data", store=self.path, layer=layer)
        return layer

    def _index_expect(self, layer: int) -> dict:
        """What a layer's index-file metadata must say (manifest counts and
        generation; identity as the superblocks pinned it at open)."""
        rec = self._m.layers[layer]
        return dict(uuid=self._m.uuid, generation=rec.generation,
                    num_tokens=rec.num_tokens, num_clusters=rec.num_clusters,
                    num_copies=rec.num_copies, hot_clusters=rec.hot_clusters,
                    num_disks=self.num_disks,
                    dtype=self.dtype, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim, entry_bytes=self.entry_bytes)

    def _check_index_header(self, layer: int) -> None:
        F.check_index_header(self.path, layer, self._m.layers[layer].index,
                             expect=self._index_expect(layer))

    @E.boundary
    def layer(self, layer: int) -> LayerIndex:
        """The :class:`LayerIndex` of a layer (loaded on first use).

        Raises:
            OutOfRangeError: the layer does not exist or holds no data.
            ManifestError: its index file is missing, corrupt or disagrees
                with the manifest (counts, generation, identity, extents
                outside the disks' allocated space or inside free space).
        """
        layer = self._check_layer(layer)
        li = self._layers.get(layer)
        if li is not None:
            return li
        with self._lock:
            li = self._layers.get(layer)
            if li is None:
                m = self._m
                gen = m.generation
                self._lease.acquire(gen)      # released when the LayerIndex is garbage
                try:
                    li = self._load_layer(layer, m)
                except BaseException:
                    self._lease.release(gen)
                    raise
                li._claim = claim = [gen]
                weakref.finalize(li, _drop_claim, self._lease, claim)
                self._layers[layer] = li
        return li

    def _load_layer(self, layer: int, m: Manifest) -> LayerIndex:
        """Load and check a layer's index as manifest ``m`` records it."""
        rec = m.layers[layer]
        name = rec.index.file
        if not os.path.lexists(os.path.join(self.path, F.INDEX_DIR, name)):
            try:
                now = read_manifest(self.path)
            except E.SwarmError:
                now = None
            if now is not None and now.generation != m.generation:
                raise E.ManifestError(
                    f"index file {name} is gone: the store was rewritten (now "
                    f"generation {now.generation}) since this Store was opened "
                    f"at generation {m.generation}; open it again",
                    store=self.path, layer=layer)
            raise E.ManifestError(f"index file {name} is missing (deleted?); the "
                                  "layer cannot be read", store=self.path,
                                  layer=layer)
        arrays = F.load_index(self.path, layer, rec.index,
                              expect=self._index_expect(layer))
        try:
            li = LayerIndex(layer, arrays, num_tokens=rec.num_tokens,
                            ndisks=self.num_disks, entry_bytes=self.entry_bytes,
                            block_size=self.block_size, store=self.path,
                            disk_end=[d.end for d in m.disks],
                            free=[d.free for d in m.disks])
        except (ValueError, IndexError, TypeError, OverflowError) as exc:
            raise E.ManifestError(f"index of the layer is inconsistent: {exc}",
                                  store=self.path, layer=layer) from exc
        if li.num_clusters != rec.num_clusters or li.num_copies != rec.num_copies or \
                int(li.hot.astype(np.int64).sum()) != rec.hot_clusters:
            raise E.ManifestError("index arrays disagree with the manifest's "
                                  "cluster/copy counts", store=self.path, layer=layer)
        return li

    @E.boundary
    def layer_record(self, layer: int) -> LayerRecord:
        """The manifest record of a layer (:class:`~swarmfs.store._manifest.LayerRecord`).

        Raises:
            OutOfRangeError: the layer does not exist or holds no data.
        """
        return self._m.layers[self._check_layer(layer)]

    @E.boundary
    def layer_info(self, layer: int) -> dict:
        """The manifest record of a layer, as its JSON dict."""
        return self._m.layers[self._check_layer(layer)].to_dict()

    @E.boundary
    def num_clusters(self, layer: int) -> int:
        """C, the number of clusters of a stored layer (NotFoundError if none)."""
        return self._m.layers[self._check_layer(layer)].num_clusters

    @E.boundary
    def num_tokens(self, layer: int) -> int:
        """S, the number of tokens (KV entries) of a stored layer."""
        return self._m.layers[self._check_layer(layer)].num_tokens

    @E.boundary
    def cluster_tokens(self, layer: int, cid: int) -> np.ndarray:
        """Token positions of a cluster's entries, in cluster order: int32 [n]."""
        li = self.layer(layer)
        cid = li.check_cluster(cid)
        return li.members[li.members_ptr[cid]:li.members_ptr[cid + 1]].copy()

    @E.boundary
    def medoid_keys(self, layer: int) -> np.ndarray:
        """K of each cluster's medoid: [C, num_kv_heads, head_dim] store dtype."""
        li = self.layer(layer)
        return li.medoid_keys.view(self.np_dtype).reshape(
            li.num_clusters, self.num_kv_heads, self.head_dim)

    # -- writing -------------------------------------------------------------
    @E.boundary
    def write_layer(self, layer: int, kv, clusters, medoids=None, *, hot=None,
                    freq=None, local_window: int | None = None, extra: dict | None = None,
                    placement: str = "eq7", representative: str = "medoid") -> None:
        """Write (or rewrite) one layer and commit it.

        Clusters are placed by eq. 7 after the data already on the disks and
        striped entry by entry; each cluster's share of each disk is one
        extent.  The new manifest is committed only after every byte is on
        the disks (fdatasync); a failure leaves the previous state in place.

        Args:
            layer: layer number.
            kv: [S, 2, num_kv_heads, head_dim] KV entries of every token, the
                store dtype (numpy, ml_dtypes bfloat16 or torch).
            clusters: ``(ptr int64 [C+1], members int [M])`` CSR, or a list of
                int arrays; every token in [0, S) must be in some cluster, a
                token may be in several (replicas).
            medoids: int [C] medoid token of each cluster (must be a member);
                default the first member.
            hot: bool [C] hot clusters kept in DRAM (SWARM §5.2, eq. 6).
            freq: float [C] profile activation frequency f_i per cluster.
            local_window: DRAM local window W in tokens (SWARM §5.2).
            extra: JSON-ready dict stored in the layer's manifest record.
            placement: ``"eq7"`` (SWARM §5.2) or ``"disk0"`` (every cluster
                starts at disk 0: the No-Balance ablation of §8.3).
            representative: the key the index keeps per cluster (what a
                ``MedoidSelector`` scores): ``"medoid"`` (SWARM §5.2: the
                medoid's K) or ``"centroid"`` (the mean K of the members,
                rounded to the store dtype; appends keep it exact).  The same
                DRAM either way; docs/deviations.md says when each wins.

        Raises:
            InvalidChoiceError: an unknown ``representative``.
            ShapeError: kv shape/dtype or cluster definitions are wrong.
            OutOfRangeError: layer outside the model.
            DiskFullError: a disk ran out of space (nothing is committed).
            IOFailedError: a write failed (nothing is committed).
        """
        layer = V.parse_index(layer, "layer", store=self.path)
        if not 0 <= layer < self.num_layers:
            raise E.OutOfRangeError(f"layer {layer} outside [0, {self.num_layers})",
                                    store=self.path, layer=layer)
        if local_window is not None:
            local_window = V.parse_nonneg_int(local_window, "local_window", store=self.path,
                                              layer=layer)
        V.parse_choice(representative, "representative", _write.REPRESENTATIVES,
                       store=self.path, layer=layer)
        rows, ptr, members, medoids, hot, freq = _write.check_layer_input(
            kv, clusters, medoids, hot, freq, extra, placement, entry_shape=self.entry_shape,
            dtype=self.dtype, layer=layer, store=self.path)
        with self._transaction() as tx:
            old = None
            if layer in self._m.layers:
                try:
                    old = self.layer(layer)
                except E.SwarmError:
                    old = None       # an unreadable old index: leave its space alone
            _write.write_layer(tx, old, layer, rows, ptr, members, medoids, hot, freq,
                               local_window, extra, placement, representative)

    # -- the write transaction -------------------------------------------------
    def _transaction(self) -> _write.Transaction:
        """A :class:`~swarmfs.store._write.Transaction` on this store (enter it)."""
        if self._closed:
            raise E.SwarmError("the store is closed", store=self.path)
        if not self.writable:
            raise E.SwarmError("store is open read-only (open with writable=True)",
                               store=self.path)
        return _write.Transaction(self.path, fds=self._fds, engine=self.engine,
                                  staging=self._executor.staging, lease=self._lease,
                                  writer_mutex=self._writer_mutex,
                                  disk_paths=self.disk_paths, adopt=self._adopt,
                                  publish=self._publish, is_open=lambda: not self._closed,
                                  check_base=self._check_live_layers)

    def _adopt(self, m: Manifest) -> None:
        """Take the committed manifest a writer re-read under the lock as the
        base (another writer may have committed since this Store read it)."""
        if m != self._m:
            if m.uuid != self._m.uuid or len(m.disks) != self.num_disks:
                raise E.ManifestError("the store was replaced since it was opened; reopen it",
                                      store=self.path)
            self._m = m
            self._lease.hold(m.generation)
            with self._lock:
                self._layers.clear()

    def _check_live_layers(self, m: Manifest) -> None:
        """Before a writer allocates space from ``m`` (its base): load every
        stored layer's index, which checks that its extents lie inside the
        disks' allocated space and outside the free ranges ``m`` records, so
        a manifest whose disk ends or free lists were edited (checksums and
        commit records recomputed) is refused before new extents could
        overwrite a live one.  Indexes already loaded are reused.

        Raises:
            ManifestError: a layer's index disagrees with ``m``.
        """
        for layer in sorted(m.layers):
            self.layer(layer)

    def _publish(self, m: Manifest, layer: int) -> None:
        """A transaction committed ``m`` (which rewrote ``layer``)."""
        self._m = m
        self._lease.hold(m.generation)
        with self._lock:
            self._layers.pop(layer, None)
            for li in self._layers.values():    # other layers: still current at gen
                self._lease.move(li._claim, m.generation)

    @E.boundary
    def append(self, layer: int, kv, joins=None, *,
               new_cluster_size: int | None = None, medoids=None,
               expect_tokens: int | None = None) -> np.ndarray:
        """Append new tokens to a layer (SWARM §6.2, cluster maintenance).

        The new entries get positions S..S+n-1.  A token joins the existing
        clusters listed for it in ``joins`` (several: replicas); tokens that
        join none form new clusters of up to ``new_cluster_size`` consecutive tokens
        (medoid: the first, or ``medoids``), placed by eq. 7.  Every cluster that grows is
        rewritten copy-on-write: its old entries and the new ones go to fresh
        extents at the end of the disks, keeping its start disk, so the entry
        appended at slot |C_i| lands on disk (id_i + |C_i|) mod N as §6.2
        places it.  Nothing committed is overwritten and one manifest commit
        makes the change visible; the old extents become unreferenced space.

        Args:
            layer: a layer that holds data.
            kv: [n, 2, num_kv_heads, head_dim] new entries (store dtype).
            joins: ``(ptr int64 [n+1], clusters int [k])`` CSR: new token i
                joins clusters ``clusters[ptr[i]:ptr[i+1]]``; or a list of n
                int arrays; None = no token joins an existing cluster.
            new_cluster_size: size of the new clusters made of unassigned
                tokens (default ``_defaults.NEW_CLUSTER_SIZE``).
            expect_tokens: refuse (SwarmError) unless the layer holds exactly
                this many tokens when the append commits, e.g. because the
                caller already promised positions S..S+n-1 to its users.
            medoids: int [k] position of each new cluster's medoid, one of
                its own new tokens, in the order the clusters are made
                (default: the first token of each; a baseline's rule may
                choose another, e.g. InfLLM's best representative).

        Returns:
            int64 [n] positions of the new tokens.

        Raises:
            ShapeError: kv shape/dtype, a bad joins list, or ``medoids``
                that are not one token of each new cluster.
            OutOfRangeError: a cluster id that does not exist.
            InvalidIntegerError: ``new_cluster_size`` below 1 or
                ``expect_tokens`` below 0, or not integers.
            DiskFullError, IOFailedError: nothing is committed.
        """
        if new_cluster_size is None:
            new_cluster_size = _defaults.NEW_CLUSTER_SIZE
        return _write.append_tokens(self, layer, kv, joins, new_cluster_size=new_cluster_size,
                                    expect_tokens=expect_tokens, medoids=medoids,
                                    begin=self._transaction)

    @E.boundary
    def plan(self, layer: int, tokens, *, max_gap: int = 0, max_request: int = MAX_REQUEST,
             policy: str = "balanced", dedup: bool = True) -> Plan:
        """Plan reading the entries of ``tokens`` from any of their copies.

        A thin wrapper over :func:`swarmfs.plan_reads` (pure, SWARM §6.1).

        Args:
            tokens: int [n] token positions (duplicates allowed).

        Raises:
            OutOfRangeError: a token outside the layer.
        """
        li = self.layer(layer)
        t = li.check_tokens(tokens)
        self._check_plan_args(max_gap, max_request, policy, dedup)
        copies = li.token_copies(unique_ints(t))
        return self.plan_copies(li, copies, key=li.members[copies], max_gap=max_gap,
                                max_request=max_request, policy=policy, dedup=dedup)

    @E.boundary
    def plan_copies(self, li: LayerIndex, copies: np.ndarray, *, key=None,
                    max_gap: int = 0, max_request: int = MAX_REQUEST,
                    policy: str = "balanced", dedup: bool = True) -> Plan:
        """Plan reads of the given copies (``key`` groups copies of one entry;
        default the token).  ``Plan.copy`` indexes ``copies``."""
        key = li.members[copies] if key is None else key
        return plan_reads(key, li.copy_disk[copies], li.copy_off[copies],
                          ndisks=self.num_disks, entry_bytes=self.entry_bytes,
                          block_size=self.block_size, max_gap=max_gap,
                          max_request=max_request, policy=policy, dedup=dedup)

    @E.boundary
    def execute(self, li: LayerIndex, plan: Plan, copies: np.ndarray, *,
                order=None, out: np.ndarray | None = None,
                verify: bool | None = None, cluster=None,
                consume=None, into=None) -> np.ndarray | None:
        """Execute a plan in one batched submission and return entry rows.

        Args:
            li: the layer.
            plan: a plan over ``copies`` (from :meth:`plan_copies`).
            copies: the copy ids the plan was made from.
            order: int [k] indices into ``plan.tokens`` giving the output
                order (default: ``plan.tokens`` order).
            out: optional uint8 [k, entry_bytes] destination.
            verify: check per-entry XXH3-64 (default: the store setting).
            consume: instead of returning rows, call ``consume(staging, src)``
                with the staging buffer (uint8) and each entry's byte offset in
                it (uint64 [k], ``order`` applied), after verification and while
                the buffer is valid; returns None then (the Retriever writes K
                and V straight into its output this way).
            into: ``(buffer, base)``: put the entries, as rows of
                ``entry_bytes``, into ``buffer`` (an :meth:`Engine.alloc`
                buffer, e.g. a Retriever's :class:`~swarmfs.EntryBuffer`)
                from byte ``base``, and return where each landed.  When the
                plan's requests are exactly its entries (entries a multiple of
                the block size, no coalescing gap) and ``base`` is block
                aligned, the reads land there directly (no staging buffer, no
                copy; issue 26); otherwise they are staged and copied.
                Checksums are verified where the entries lie either way.
                ``order`` and ``out`` do not apply.

        Returns:
            uint8 [k, entry_bytes] rows (None with ``consume``); with
            ``into``: uint64 [U] byte offset in the buffer of each entry, in
            plan order (``plan.tokens``), the U entries filling
            ``[base, base + U * entry_bytes)``.

        Raises:
            ChecksumError: an entry does not match its checksum (names the
                disk, layer and cluster).
            DiskTruncatedError, IOFailedError: the read failed.
            DiskError (its subclass as recorded): the plan touches a disk that
                ``Store.open(damaged=True)`` recorded in ``disk_problems`` as
                wrong, missing or with an unreadable header: its bytes are not
                trusted, whatever ``verify`` says (a truncated disk is read up
                to its end).
        """
        # a truncated disk's intact part is read (the short read names the
        # cluster and the damage offset); any other recorded problem refuses
        untrusted = [d for d, exc in self.disk_problems.items()
                     if not isinstance(exc, E.DiskTruncatedError)]
        if untrusted and plan.disk.size:
            bad = np.intersect1d(np.unique(plan.disk), untrusted)
            if bad.size:
                exc = self.disk_problems[int(bad[0])]
                raise type(exc)(f"read touches a damaged disk: {exc.message}",
                                store=self.path, layer=li.layer, disk=int(bad[0]),
                                path=getattr(exc, "path", None))
        verify = self.verify_checksums if verify is None else verify
        if into is not None:
            into = self._check_into(into, plan, li)
        return self._executor.execute(li, plan, copies, verify=bool(verify), order=order,
                                      out=out, cluster=cluster, consume=consume, into=into)

    def _check_into(self, into, plan: Plan, li: LayerIndex) -> tuple[AlignedBuffer, int]:
        """``execute(into=)``: a (buffer of this store's engine, base) pair
        whose buffer holds the plan's entries from base, with base an int
        (InvalidArgumentError)."""
        try:
            buf, base = into
        except (TypeError, ValueError):
            raise E.InvalidArgumentError("into must be a (buffer, base) pair",
                                         store=self.path, layer=li.layer) from None
        if not isinstance(buf, AlignedBuffer):
            raise E.InvalidArgumentError(f"into's buffer is a {type(buf).__name__}, not a "
                                         "buffer from Engine.alloc", store=self.path,
                                         layer=li.layer)
        if buf.registered_elsewhere(self.engine):
            raise E.InvalidArgumentError("into's buffer is registered with another engine "
                                         "(allocate it from this store's engine)",
                                         store=self.path, layer=li.layer)
        base = V.parse_int(base, "into base", 0, 1 << 62, store=self.path, layer=li.layer)
        if base + plan.num_entries * self.entry_bytes > buf.size:
            raise E.InvalidArgumentError(
                f"into's buffer holds {buf.size} bytes; {plan.num_entries} entries of "
                f"{self.entry_bytes} from byte {base} need "
                f"{base + plan.num_entries * self.entry_bytes}", store=self.path,
                layer=li.layer)
        return buf, base

    def _check_plan_args(self, max_gap, max_request, policy, dedup=True) -> None:
        """Planner options, checked before planning (InvalidArgumentError)."""
        from ._planner import POLICIES
        V.parse_int(max_gap, "max_gap", 0, 1 << 30, store=self.path)
        V.parse_int(max_request, "max_request", self.block_size, 1 << 30, store=self.path)
        V.parse_choice(policy, "policy", sorted(POLICIES), store=self.path)
        V.parse_bool(dedup, "dedup", store=self.path)

    def _rows_to_entries(self, rows: np.ndarray, *, torch: bool, pinned: bool):
        n = rows.shape[0]
        if pinned:
            buf = self.engine.alloc(rows.nbytes, pinned=True, register=False)
            arr = buf.array[:rows.nbytes].reshape(rows.shape)
            arr[...] = rows
            rows = arr
            torch = True
        arr = rows.view(self.np_dtype).reshape((n,) + self.entry_shape)
        if not torch:
            return arr
        return F.to_torch(arr, self.dtype)

    @E.boundary
    def read_cluster(self, layer: int, cid: int, *, torch: bool = False,
                     pinned: bool = False, verify: bool | None = None):
        """Read a whole cluster: at most N requests, one batched submission.

        Returns:
            [n, 2, num_kv_heads, head_dim] in the store dtype, entries in
            cluster order (numpy; torch with ``torch=True``, in pinned host
            memory with ``pinned=True``).  Tokens: :meth:`cluster_tokens`.

        Raises:
            OutOfRangeError: no such layer or cluster.
            ChecksumError: stored bytes do not match their checksums.
        """
        li = self.layer(layer)
        cid = li.check_cluster(cid)
        copies = li.cluster_copies([cid])
        plan = plan_reads(np.arange(copies.shape[0]), li.copy_disk[copies],
                          li.copy_off[copies], ndisks=self.num_disks,
                          entry_bytes=self.entry_bytes, block_size=self.block_size,
                          max_request=MAX_REQUEST)
        rows = self.execute(li, plan, copies, verify=verify, cluster=cid)
        self._executor.count(cluster_reads=1)
        return self._rows_to_entries(rows, torch=torch, pinned=pinned)

    @E.boundary
    def read_cluster_range(self, layer: int, cid: int, start: int, length: int,
                           *, verify: bool | None = None) -> bytes:
        """Bytes ``[start, start+length)`` of a cluster file (its entries in
        cluster order, raw).  Reads only the entries the range covers."""
        li = self.layer(layer)
        cid = li.check_cluster(cid)
        start = V.parse_index(start, "start", store=self.path, layer=layer, cluster=cid)
        length = V.parse_index(length, "length", store=self.path, layer=layer, cluster=cid)
        Eb = self.entry_bytes
        n = int(li.sizes[cid])
        if start < 0 or length < 0:
            raise E.InvalidArgumentError(f"start and length must be >= 0, got {start} and "
                                         f"{length}", store=self.path, layer=layer,
                                         cluster=cid)
        end = min(int(start) + int(length), n * Eb)
        if start >= end:
            return b""
        j0, j1 = start // Eb, -(-end // Eb)
        copies = li.cluster_copies([cid])[j0:j1]
        plan = plan_reads(np.arange(copies.shape[0]), li.copy_disk[copies],
                          li.copy_off[copies], ndisks=self.num_disks,
                          entry_bytes=Eb, block_size=self.block_size)
        rows = self.execute(li, plan, copies, verify=verify, cluster=cid)
        a = start - j0 * Eb
        return rows.reshape(-1)[a:a + (end - start)].tobytes()

    @E.boundary
    def read_entries(self, layer: int, tokens, *, torch: bool = False,
                     pinned: bool = False, verify: bool | None = None,
                     policy: str = "balanced", max_gap: int = 0):
        """Read the KV entries of arbitrary tokens, in the order given.

        Copies are chosen by entry-bucket scheduling (SWARM §6.1), adjacent
        entries on a disk are coalesced, and the whole plan goes to the engine
        in one batched submission.

        Args:
            tokens: int [n] token positions (duplicates allowed).

        Returns:
            [n, 2, num_kv_heads, head_dim] in the store dtype.

        Raises:
            OutOfRangeError: a token outside the layer.
            ChecksumError: an entry does not match its checksum.
        """
        li = self.layer(layer)
        t = li.check_tokens(tokens)
        self._check_plan_args(max_gap, MAX_REQUEST, policy)
        copies = li.token_copies(unique_ints(t))
        plan = plan_reads(li.members[copies], li.copy_disk[copies], li.copy_off[copies],
                          ndisks=self.num_disks, entry_bytes=self.entry_bytes,
                          block_size=self.block_size, policy=policy, max_gap=max_gap)
        order = np.searchsorted(plan.tokens, t)
        rows = self.execute(li, plan, copies, order=order, verify=verify)
        self._executor.count(entry_reads=1)
        return self._rows_to_entries(rows, torch=torch, pinned=pinned)

    # -- verification -----------------------------------------------------------
    @E.boundary
    def verify(self, *, layers=None, progress=None, max_batch: int = 64 << 20) -> list[dict]:
        """Read every extent and check its XXH3-64; locate every damaged entry.

        Every damaged extent is reported, whatever else failed in the same
        batch: a batch whose read fails is re-read extent by extent, extents
        past a disk's end or on a disk that could not be opened (see
        ``Store.open(damaged=True)``) are reported without reading, and a
        mismatching extent is checked entry by entry (per-entry XXH3-64).

        Args:
            layers: layers to check (default all).
            progress: optional callable(bytes_done) for progress bars.
            max_batch: bytes per batched submission (>= the block size).

        Returns:
            A list of failures, one per damaged extent (or unreadable layer
            index), each a dict: ``layer``, ``cluster``, ``disk``, ``path``,
            ``offset`` (byte offset of the damage itself: the first damaged
            entry, or the disk's end), ``extent_offset``, ``error``,
            ``entries`` (damaged entries in the extent), ``tokens`` (their
            token positions) and ``lost`` (those of them with no intact
            replica anywhere in the layer).  Empty when the store is intact.

        Raises:
            InvalidArgumentError: bad ``layers`` or ``max_batch``.
            OutOfRangeError: a layer that holds no data.
        """
        V.parse_int(max_batch, "max_batch", self.block_size, store=self.path)
        if progress is not None:
            V.parse_callable(progress, "progress", store=self.path)
        if layers is not None and (isinstance(layers, (str, bytes, dict)) or
                                   not isinstance(layers, collections.abc.Iterable)):
            raise E.InvalidTypeError(f"layers must be a list of layer numbers, got "
                                     f"{layers!r}"[:300], argument="layers", store=self.path)
        todo = self.layers if layers is None else [self._check_layer(x) for x in layers]
        return _inspect.verify_layers(self, todo, progress, max_batch)

    @E.boundary
    def stats(self) -> StoreStats:
        """Counters since open, as a :class:`StoreStats`."""
        return StoreStats(engine=self.engine.stats(), verify_checksums=self.verify_checksums,
                          **self._executor.counters())

    @E.boundary
    def info(self) -> dict:
        """JSON-ready summary: disks, sizes, layers, clusters, replication, engine."""
        return _inspect.store_info(self)


def _drop_claim(lease, claim: list) -> None:
    """Release a garbage LayerIndex's claim on its generation."""
    lease.release(claim[0])
