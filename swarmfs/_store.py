"""The cluster-addressed store: KV clusters striped over N disks.

``Store.create`` makes a store (superblocks, empty manifest); ``write_layer``
places a layer's clusters by eq. 7, writes them with batched O_DIRECT writes
and commits a new manifest atomically; ``read_cluster``/``read_entries`` read
back with one batched submission per call.  See ``_format`` for the on-disk
format and ``_planner`` for read planning.
"""

from __future__ import annotations

import collections.abc
import contextlib
import json
import dataclasses
import fcntl
import os
import shutil
import threading
import time

import numpy as np

from . import _errors as E
from . import _format as F
from ._engine import (READ, Engine, EngineStats, device_size, gather_rows,
                      verify_rows,
                      xxh3_ranges, xxh3_rows)
from ._index import LayerIndex
from ._planner import MAX_REQUEST, Plan, plan_reads
from ._disks import create_disks, open_disks
from ._write import append_tokens, as_bytes_rows, chunk_bounds, clusters_csr, write_extents
from .layout._place import PLACEMENTS, place_clusters

__all__ = ["Store", "StoreStats"]

_POOL_KEEP = 4               # staging buffers kept for reuse


#: fields of a layer's manifest record that write_layer sets itself
_LAYER_RECORD_KEYS = frozenset({"num_tokens", "num_clusters", "num_copies", "replication",
                                "hot_clusters", "index", "generation", "local_window"})


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


class Store:
    """A KV-cache store: clusters of KV entries striped over several disks.

    Open with :meth:`open` or create with :meth:`create`; do not call the
    constructor.  A Store is safe to read from several threads.

    Attributes:
        path: the store directory.
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
        self._m = manifest
        self._fds = fds
        self.writable = writable
        model = manifest["model"]
        self.model = dict(model)
        self.num_layers = int(model["num_layers"])
        self.num_kv_heads = int(model["num_kv_heads"])
        self.head_dim = int(model["head_dim"])
        self.dtype = model["dtype"]
        self.np_dtype = F.numpy_dtype(self.dtype)
        self.entry_shape = (2, self.num_kv_heads, self.head_dim)
        self.entry_bytes = int(model["entry_bytes"])
        self.block_size = int(manifest["block_size"])
        self.num_disks = len(manifest["disks"])
        self.disk_paths = [self._disk_path(d) for d in manifest["disks"]]
        self.verify_checksums = bool(verify)
        self.engine = Engine(fds, kind=engine_kind, queue_depth=queue_depth,
                             block_sizes=[self.block_size] * self.num_disks,
                             names=self.disk_paths, store=self.path)
        self._layers: dict[int, LayerIndex] = {}
        self._lock = threading.RLock()
        self._pool: list = []
        self._pool_lock = threading.Lock()
        self._counters = dict(cluster_reads=0, entry_reads=0, entries_returned=0,
                              bytes_returned=0, bytes_read=0, checksum_failures=0)
        self._counter_lock = threading.Lock()
        self._writer_mutex = threading.Lock()
        self._closed = False

    # -- construction --------------------------------------------------------
    @classmethod
    def create(cls, path, *, disks=4, num_layers: int, num_kv_heads: int,
               head_dim: int, dtype: str = "float16", model_name: str | None = None,
               num_query_heads: int | None = None, disk_size: int | None = None,
               block_size: int | None = None, force: bool = False,
               engine: str | None = None, queue_depth: int = 128,
               verify: bool = True) -> "Store":
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
        path = os.path.abspath(path)
        if dtype not in F.DTYPES:
            raise E.ShapeError(f"unsupported dtype {dtype!r}; use one of {sorted(F.DTYPES)}")
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise E.ShapeError(f"{name} must be a positive integer, got {v!r}")
        if num_query_heads is not None and (
                not isinstance(num_query_heads, (int, np.integer)) or num_query_heads <= 0
                or num_query_heads % num_kv_heads):
            raise E.ShapeError(f"num_query_heads must be a positive multiple of "
                               f"num_kv_heads, got {num_query_heads!r}")
        if 2 * int(num_kv_heads) * int(head_dim) * F.DTYPES[dtype] > 1 << 30:
            raise E.ShapeError(f"an entry of 2 x {num_kv_heads} x {head_dim} {dtype} is over "
                               "1 GiB")
        if isinstance(disks, (bool, str, bytes, os.PathLike)) or not isinstance(
                disks, (int, np.integer, collections.abc.Iterable)):
            raise E.ShapeError(f"disks must be a number of disk files or a list of paths, "
                               f"got {disks!r}")
        if os.path.exists(path) and not os.path.isdir(path):
            raise E.StoreExistsError("store path exists and is not a directory", store=path)
        if os.path.isdir(path) and os.listdir(path):
            if not force:
                what = ("a store already exists here" if os.path.exists(
                    os.path.join(path, F.MANIFEST)) else "store path is not empty")
                raise E.StoreExistsError(f"{what} (replace it with --force / force=True)",
                                         store=path)
            for sub in (F.MANIFEST, F.INDEX_DIR, "disks"):
                p = os.path.join(path, sub)
                if os.path.isdir(p):
                    shutil.rmtree(p)
                elif os.path.exists(p):
                    os.unlink(p)
        created = not os.path.exists(path)
        os.makedirs(path, exist_ok=True)
        try:
            return cls._create(path, disks=disks, num_layers=num_layers,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                               model_name=model_name, num_query_heads=num_query_heads,
                               disk_size=disk_size, block_size=block_size, force=force,
                               engine=engine, queue_depth=queue_depth, verify=verify)
        except BaseException:
            if created:      # leave nothing behind for a store that never existed
                shutil.rmtree(path, ignore_errors=True)
            raise

    @classmethod
    def _create(cls, path, *, disks, num_layers, num_kv_heads, head_dim, dtype, model_name,
                num_query_heads, disk_size, block_size, force, engine, queue_depth, verify):
        if isinstance(disks, (int, np.integer)):
            disks = int(disks)
            if not 1 <= disks <= 256:
                raise E.ShapeError(f"a store has 1 to 256 disks, got {disks}", store=path)
            os.makedirs(os.path.join(path, "disks"), exist_ok=True)
            disk_paths = [os.path.join(path, "disks", f"disk-{i}.img") for i in range(disks)]
        else:
            disk_paths = [os.path.abspath(str(p)) for p in disks]
            if not 1 <= len(disk_paths) <= 256 or len(set(disk_paths)) != len(disk_paths):
                raise E.ShapeError("disks must be 1 to 256 distinct paths", store=path)
        uid, caps, bs = create_disks(path, disk_paths, force=force, disk_size=disk_size,
                                     block_size=block_size, engine=engine)
        entry_bytes = 2 * int(num_kv_heads) * int(head_dim) * F.DTYPES[dtype]
        manifest = {
            "format": "swarmfs",
            "format_version": F.FORMAT_VERSION,
            "uuid": uid.hex(),
            "generation": 0,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": {"name": model_name, "num_layers": int(num_layers),
                      "num_kv_heads": int(num_kv_heads), "head_dim": int(head_dim),
                      "num_query_heads": int(num_query_heads or num_kv_heads),
                      "dtype": dtype, "entry_bytes": entry_bytes},
            "block_size": bs,
            "p_global": 0,
            "disks": [{"index": i, "path": cls._rel(path, p), "end": F.DATA_START,
                       "capacity": caps[i]} for i, p in enumerate(disk_paths)],
            "layers": {},
            "dram": {"local_window": 256},
        }
        F.write_manifest(path, manifest)
        return cls.open(path, engine=engine, queue_depth=queue_depth, verify=verify,
                        writable=True)

    @staticmethod
    def _rel(store, p):
        rp = os.path.relpath(p, store)
        return rp if not rp.startswith("..") else p

    def _disk_path(self, rec):
        p = rec["path"]
        return p if os.path.isabs(p) else os.path.join(self.path, p)

    @classmethod
    def open(cls, path, *, engine: str | None = None, queue_depth: int = 128,
             verify: bool = True, writable: bool = False,
             preload: bool = False) -> "Store":
        """Open a store and check every disk.

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

        Raises:
            StoreNotFoundError, ManifestError: no or bad manifest.
            DiskMissingError: a disk path is gone.
            DiskMismatchError: a disk is foreign, swapped or has no superblock.
            DiskTruncatedError: a disk is shorter than its committed data.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise E.StoreNotFoundError(f"a store path must be a string or path, got {path!r}")
        path = os.path.abspath(path)
        m = F.read_manifest(path)
        fds = open_disks(path, m, writable=writable)
        try:
            store = cls(path, m, fds, engine_kind=engine, queue_depth=queue_depth,
                        verify=verify, writable=writable)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if preload:
            try:
                for layer in store.layers:
                    store.layer(layer)
            except BaseException:
                store.close()
                raise
        return store

    def close(self) -> None:
        """Close the engine and the disks."""
        if self._closed:
            return
        self._closed = True
        with self._pool_lock:
            for b in self._pool:
                b.release()
            self._pool.clear()
        self.engine.close()
        for fd in self._fds:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- description ----------------------------------------------------------
    @property
    def uuid(self) -> str:
        return self._m["uuid"]

    @property
    def manifest(self) -> dict:
        """A copy of the committed manifest."""
        import copy
        return copy.deepcopy(self._m)

    @property
    def layers(self) -> list[int]:
        """Layers that hold data, ascending."""
        return sorted(int(k) for k in self._m["layers"])

    def _check_layer(self, layer) -> int:
        if self._closed:
            raise E.SwarmError("the store is closed", store=self.path)
        layer = E.as_index(layer, "layer", store=self.path)
        if not 0 <= layer < self.num_layers:
            raise E.OutOfRangeError(f"layer {layer} outside [0, {self.num_layers})",
                                    store=self.path, layer=layer)
        if str(layer) not in self._m["layers"]:
            raise E.OutOfRangeError("layer holds no data", store=self.path, layer=layer)
        return layer

    def layer(self, layer: int) -> LayerIndex:
        """The :class:`LayerIndex` of a layer (loaded on first use).

        Raises:
            OutOfRangeError: the layer does not exist or holds no data.
            ManifestError: its index file is missing or corrupt.
        """
        layer = self._check_layer(layer)
        li = self._layers.get(layer)
        if li is not None:
            return li
        with self._lock:
            li = self._layers.get(layer)
            if li is None:
                rec = self._m["layers"][str(layer)]
                if not os.path.exists(os.path.join(self.path, F.INDEX_DIR,
                                                   rec["index"]["file"])):
                    raise E.ManifestError(
                        f"index file {rec['index']['file']} is gone: the store was "
                        "rewritten since this Store was opened; open it again",
                        store=self.path, layer=layer)
                arrays = F.load_index(self.path, layer, rec["index"])
                try:
                    li = LayerIndex(layer, arrays, num_tokens=rec["num_tokens"],
                                    ndisks=self.num_disks, entry_bytes=self.entry_bytes,
                                    block_size=self.block_size, store=self.path)
                except (ValueError, IndexError, TypeError) as exc:
                    raise E.ManifestError(f"index of the layer is inconsistent: {exc}",
                                          store=self.path, layer=layer) from exc
                self._layers[layer] = li
        return li

    def layer_info(self, layer: int) -> dict:
        """The manifest record of a layer."""
        return dict(self._m["layers"][str(self._check_layer(layer))])

    def num_clusters(self, layer: int) -> int:
        return int(self._m["layers"][str(self._check_layer(layer))]["num_clusters"])

    def num_tokens(self, layer: int) -> int:
        return int(self._m["layers"][str(self._check_layer(layer))]["num_tokens"])

    def cluster_tokens(self, layer: int, cid: int) -> np.ndarray:
        """Token positions of a cluster's entries, in cluster order: int32 [n]."""
        li = self.layer(layer)
        cid = li.check_cluster(cid)
        return li.members[li.members_ptr[cid]:li.members_ptr[cid + 1]].copy()

    def medoid_keys(self, layer: int) -> np.ndarray:
        """K of each cluster's medoid: [C, num_kv_heads, head_dim] store dtype."""
        li = self.layer(layer)
        return li.medoid_keys.view(self.np_dtype).reshape(
            li.num_clusters, self.num_kv_heads, self.head_dim)

    # -- writing -------------------------------------------------------------
    @contextlib.contextmanager
    def _write_lock(self):
        """Serialise writers: threads of this Store wait for each other, another
        process holding the store's flock makes this one fail.  Inside, the
        manifest is re-read, so a writer always extends the latest committed
        state, also when another process committed since this Store opened."""
        if not self.writable:
            raise E.SwarmError("store is open read-only (open with writable=True)",
                               store=self.path)
        with self._writer_mutex:
            fd = os.open(os.path.join(self.path, ".lock"),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise E.SwarmError("another process is writing this store",
                                       store=self.path)
                self._adopt_latest()
                yield
            finally:
                os.close(fd)

    def _adopt_latest(self) -> None:
        """Take the committed manifest as the base (another writer may have
        committed since this Store read it)."""
        m = F.read_manifest(self.path)
        if m.get("generation") != self._m.get("generation") or m != self._m:
            if m.get("uuid") != self._m.get("uuid") or len(m["disks"]) != self.num_disks:
                raise E.ManifestError("the store was replaced since it was opened; reopen it",
                                      store=self.path)
            self._m = m
            with self._lock:
                self._layers.clear()

    def write_layer(self, layer: int, kv, clusters, medoids=None, *, hot=None,
                    freq=None, local_window: int | None = None, extra: dict | None = None,
                    placement: str = "eq7") -> None:
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

        Raises:
            ShapeError: kv shape/dtype or cluster definitions are wrong.
            OutOfRangeError: layer outside the model.
            DiskFullError: a disk ran out of space (nothing is committed).
            IOFailedError: a write failed (nothing is committed).
        """
        layer = E.as_index(layer, "layer", store=self.path)
        if not 0 <= layer < self.num_layers:
            raise E.OutOfRangeError(f"layer {layer} outside [0, {self.num_layers})",
                                    store=self.path, layer=layer)
        if local_window is not None:
            local_window = E.as_index(local_window, "local_window", store=self.path,
                                      layer=layer)
            if local_window < 0:
                raise E.OutOfRangeError(f"local_window must be >= 0, got {local_window}",
                                        store=self.path, layer=layer)
        if extra is not None:
            if not isinstance(extra, dict):
                raise E.ShapeError(f"extra must be a dict, got {type(extra).__name__}",
                                   store=self.path, layer=layer)
            clash = sorted(set(extra) & _LAYER_RECORD_KEYS)
            if clash:
                raise E.ShapeError(f"extra may not set the layer record's own fields {clash} "
                                   "(use the keyword arguments)", store=self.path, layer=layer)
            try:
                json.dumps(extra)
            except (TypeError, ValueError) as exc:
                raise E.ShapeError(f"extra is not JSON-serialisable: {exc}",
                                   store=self.path, layer=layer) from None
        rows = as_bytes_rows(kv, self.entry_shape, self.dtype, layer=layer, store=self.path)
        S = rows.shape[0]
        ptr, members = clusters_csr(clusters, layer=layer, store=self.path)
        C = ptr.shape[0] - 1
        if members.min() < 0 or members.max() >= S:
            raise E.ShapeError(f"a cluster member is outside [0, {S})", store=self.path,
                               layer=layer)
        if np.bincount(members, minlength=S).min() == 0:
            t = int(np.flatnonzero(np.bincount(members, minlength=S) == 0)[0])
            raise E.ShapeError(f"token {t} is in no cluster (every entry must be stored)",
                               store=self.path, layer=layer)
        cl = np.repeat(np.arange(C), np.diff(ptr))
        key = cl * np.int64(S) + members
        if np.unique(key).shape[0] != key.shape[0]:
            raise E.ShapeError("a token appears twice in one cluster", store=self.path,
                               layer=layer)
        medoids = (members[ptr[:-1]] if medoids is None
                   else E.as_int_array(medoids, "medoids", store=self.path, layer=layer))
        if medoids.shape[0] != C:
            raise E.ShapeError(f"{medoids.shape[0]} medoids for {C} clusters",
                               store=self.path, layer=layer)
        is_med = members == medoids[cl]
        if np.bincount(cl[is_med], minlength=C).min() == 0:
            c = int(np.flatnonzero(np.bincount(cl[is_med], minlength=C) == 0)[0])
            raise E.ShapeError("medoid is not a member of its cluster", store=self.path,
                               layer=layer, cluster=c)
        if hot is None:
            hot = np.zeros(C, np.uint8)
        else:
            hot = np.asarray(hot).reshape(-1)
            if hot.size and (hot.dtype.kind not in "biu" or not np.isin(hot, (0, 1)).all()):
                raise E.ShapeError("hot must be a boolean (0/1) mask", store=self.path,
                                   layer=layer)
            hot = hot.astype(np.uint8)
        try:
            freq = np.zeros(C, np.float32) if freq is None else \
                np.asarray(freq, dtype=np.float32).reshape(-1)
        except (TypeError, ValueError):
            raise E.ShapeError("freq must be numbers", store=self.path, layer=layer) from None
        if freq.size and (not np.isfinite(freq).all() or freq.min() < 0):
            raise E.ShapeError("freq must be finite and >= 0", store=self.path, layer=layer)
        if placement not in PLACEMENTS:
            raise E.LayoutError(f"unknown placement {placement!r}; use one of {PLACEMENTS}",
                                store=self.path, layer=layer)
        if hot.shape[0] != C or freq.shape[0] != C:
            raise E.ShapeError("hot and freq need one value per cluster", store=self.path,
                               layer=layer)

        with self._write_lock():
            token_xxh = xxh3_rows(rows, self.entry_bytes)
            half = self.entry_bytes // 2
            medoid_keys = np.ascontiguousarray(rows[medoids, :half])
            disk_end = np.array([d["end"] for d in self._m["disks"]], dtype=np.uint64)
            pl = place_clusters(np.diff(ptr), ndisks=self.num_disks,
                                entry_bytes=self.entry_bytes, block_size=self.block_size,
                                disk_end=disk_end, p_global=int(self._m["p_global"]),
                                policy=placement)
            self._check_capacity(pl.disk_end, layer)
            extent_xxh = write_extents(self, rows, ptr, members, pl, layer)
            for fd in self._fds:
                os.fdatasync(fd)
            arrays = dict(members_ptr=ptr, members=members, medoid=medoids,
                          start_disk=pl.start_disk, extent_off=pl.extent_off,
                          extent_xxh=extent_xxh, token_xxh=token_xxh,
                          medoid_keys=medoid_keys, hot=hot, freq=freq)
            lw = local_window if local_window is not None else self._m["dram"]["local_window"]
            self._commit_layer(layer, arrays, disk_end=pl.disk_end, p_global=pl.p_global,
                               record={"local_window": int(lw), **(extra or {})})

    def _commit_layer(self, layer: int, arrays: dict, *, disk_end, p_global: int,
                      record: dict) -> None:
        """Make a layer's new arrays the committed state: index file (fsync),
        then the manifest (atomic rename).  Caller holds the write lock and
        has fdatasync'ed the disks."""
        m = self.manifest
        gen = int(m["generation"]) + 1
        try:
            rec = F.save_index(self.path, layer, gen, arrays)
        except OSError as exc:
            raise _metadata_error(exc, self.path, layer) from exc
        old = m["layers"].get(str(layer))
        S = int(arrays["token_xxh"].shape[0])
        M = int(arrays["members"].shape[0])
        m["generation"] = gen
        m["p_global"] = int(p_global)
        for i, d in enumerate(m["disks"]):
            d["end"] = int(disk_end[i])
        m["layers"][str(layer)] = {
            **(old or {}), **record,
            "num_tokens": S, "num_clusters": int(arrays["members_ptr"].shape[0] - 1),
            "num_copies": M, "replication": round(M / S, 6),
            "hot_clusters": int(np.asarray(arrays["hot"]).sum()),
            "index": rec, "generation": gen,
        }
        keep = {r["index"]["file"] for r in m["layers"].values()}
        if old is not None:
            keep.add(old["index"]["file"])   # readers of the previous generation
        try:
            F.check_manifest(m, self.path)      # never commit what open() would refuse
        except E.ManifestError as exc:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.path, F.INDEX_DIR, rec["file"]))
            raise E.ShapeError(f"refusing to commit layer {layer}: {exc}", store=self.path,
                               layer=layer) from None
        try:
            self._m = F.write_manifest(self.path, m)
        except OSError as exc:
            try:
                os.unlink(os.path.join(self.path, F.INDEX_DIR, rec["file"]))
            except OSError:
                pass
            raise _metadata_error(exc, self.path, layer) from exc
        with self._lock:
            self._layers.pop(layer, None)
        F.remove_stale_indexes(self.path, keep)

    def append(self, layer: int, kv, joins=None, *, group: int = 64,
               expect_tokens: int | None = None) -> np.ndarray:
        """Append new tokens to a layer (SWARM §6.2, cluster maintenance).

        The new entries get positions S..S+n-1.  A token joins the existing
        clusters listed for it in ``joins`` (several: replicas); tokens that
        join none form new clusters of up to ``group`` consecutive tokens
        (medoid: the first), placed by eq. 7.  Every cluster that grows is
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
            group: size of the new clusters made of unassigned tokens.
            expect_tokens: refuse (SwarmError) unless the layer holds exactly
                this many tokens when the append commits, e.g. because the
                caller already promised positions S..S+n-1 to its users.

        Returns:
            int64 [n] positions of the new tokens.

        Raises:
            ShapeError: kv shape/dtype, or a bad joins list.
            OutOfRangeError: a cluster id that does not exist.
            DiskFullError, IOFailedError: nothing is committed.
        """
        return append_tokens(self, layer, kv, joins, group=group, expect_tokens=expect_tokens)

    def _check_capacity(self, new_end, layer):
        for i, d in enumerate(self._m["disks"]):
            cap = int(d["capacity"])
            if cap and int(new_end[i]) > cap:
                raise E.DiskFullError(f"layer needs bytes up to {int(new_end[i])} but the "
                                      f"disk holds {cap}", disk=i, path=self.disk_paths[i],
                                      store=self.path, layer=layer)

    # -- reading ---------------------------------------------------------------
    @contextlib.contextmanager
    def _staging(self, nbytes: int):
        """A page-aligned (registered where possible) buffer of >= nbytes."""
        buf = None
        with self._pool_lock:
            for i, b in enumerate(self._pool):
                if b.size >= nbytes:
                    buf = self._pool.pop(i)
                    break
        if buf is None:
            size = max(1 << 20, 1 << max(int(nbytes) - 1, 1).bit_length())
            buf = self.engine.alloc(size)
        try:
            yield buf
        finally:
            with self._pool_lock:
                self._pool.append(buf)
                if len(self._pool) > _POOL_KEEP:
                    self._pool.sort(key=lambda b: b.size)
                    self._pool.pop(0).release()

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
        copies = li.token_copies(np.unique(t))
        return self.plan_copies(li, copies, key=li.members[copies], max_gap=max_gap,
                                max_request=max_request, policy=policy, dedup=dedup)

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

    def execute(self, li: LayerIndex, plan: Plan, copies: np.ndarray, *,
                order=None, out: np.ndarray | None = None,
                verify: bool | None = None, cluster=None, consume=None) -> np.ndarray:
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

        Returns:
            uint8 [k, entry_bytes] rows.

        Raises:
            ChecksumError: an entry does not match its checksum (names the
                disk, layer and cluster).
            DiskTruncatedError, IOFailedError: the read failed.
        """
        verify = self.verify_checksums if verify is None else verify
        Eb = self.entry_bytes
        with self._staging(plan.staging_bytes) as buf:
            if plan.num_requests:
                self.engine.execute(READ, plan.disk, plan.offset, plan.length, plan.dst,
                                    buf, layer=li.layer, cluster=cluster, check=False)
            copy_ids = copies[plan.copy]
            if verify and plan.num_entries:
                bad = verify_rows(buf.array, plan.src, Eb, li.token_xxh[li.members[copy_ids]])
                if bad.size:
                    self._count(checksum_failures=int(bad.size))
                    c = int(copy_ids[bad[0]])
                    raise E.ChecksumError(
                        f"entry of token {int(li.members[c])} at offset "
                        f"{int(li.copy_off[c])} fails its checksum"
                        + (f" ({bad.size} entries)" if bad.size > 1 else ""),
                        store=self.path, disk=int(li.copy_disk[c]),
                        path=self.disk_paths[int(li.copy_disk[c])], layer=li.layer,
                        cluster=int(li.copy_cluster[c]))
            src = plan.src if order is None else plan.src[order]
            if consume is not None:     # the caller places the entries itself
                consume(buf.array, src)
                self._count(bytes_read=int(plan.staging_bytes),
                            entries_returned=int(src.shape[0]),
                            bytes_returned=int(src.shape[0]) * Eb)
                return None
            rows = gather_rows(buf.array, src, Eb, out)
        self._count(bytes_read=int(plan.staging_bytes), entries_returned=rows.shape[0],
                    bytes_returned=rows.nbytes)
        return rows

    def _count(self, **kw) -> None:
        with self._counter_lock:
            for k, v in kw.items():
                self._counters[k] += v

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
        return to_torch(arr, self.dtype)

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
        self._count(cluster_reads=1)
        return self._rows_to_entries(rows, torch=torch, pinned=pinned)

    def read_cluster_range(self, layer: int, cid: int, start: int, length: int,
                           *, verify: bool | None = None) -> bytes:
        """Bytes ``[start, start+length)`` of a cluster file (its entries in
        cluster order, raw).  Reads only the entries the range covers."""
        li = self.layer(layer)
        cid = li.check_cluster(cid)
        start = E.as_index(start, "start", store=self.path, layer=layer, cluster=cid)
        length = E.as_index(length, "length", store=self.path, layer=layer, cluster=cid)
        Eb = self.entry_bytes
        n = int(li.sizes[cid])
        end = min(int(start) + int(length), n * Eb)
        if start < 0 or start >= end:
            return b""
        j0, j1 = start // Eb, -(-end // Eb)
        copies = li.cluster_copies([cid])[j0:j1]
        plan = plan_reads(np.arange(copies.shape[0]), li.copy_disk[copies],
                          li.copy_off[copies], ndisks=self.num_disks,
                          entry_bytes=Eb, block_size=self.block_size)
        rows = self.execute(li, plan, copies, verify=verify, cluster=cid)
        a = start - j0 * Eb
        return rows.reshape(-1)[a:a + (end - start)].tobytes()

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
        copies = li.token_copies(np.unique(t))
        plan = plan_reads(li.members[copies], li.copy_disk[copies], li.copy_off[copies],
                          ndisks=self.num_disks, entry_bytes=self.entry_bytes,
                          block_size=self.block_size, policy=policy, max_gap=max_gap)
        order = np.searchsorted(plan.tokens, t)
        rows = self.execute(li, plan, copies, order=order, verify=verify)
        self._count(entry_reads=1)
        return self._rows_to_entries(rows, torch=torch, pinned=pinned)

    # -- verification -----------------------------------------------------------
    def verify(self, *, layers=None, progress=None, max_batch: int = 64 << 20) -> list[dict]:
        """Read every extent and check its XXH3-64.

        Args:
            layers: layers to check (default all).
            progress: optional callable(bytes_done) for progress bars.
            max_batch: bytes per batched submission.

        Returns:
            A list of failures, each ``{"layer", "cluster", "disk", "path",
            "offset", "error"}``; empty when the store is intact.
        """
        failures = []
        Eb = self.entry_bytes
        for layer in (self.layers if layers is None else layers):
            li = self.layer(layer)
            cc, dd = np.nonzero(li.counts > 0)
            nbytes = li.counts[cc, dd].astype(np.uint64) * np.uint64(Eb)
            alen = (nbytes + np.uint64(self.block_size - 1)) // np.uint64(self.block_size) \
                * np.uint64(self.block_size)
            cuts = chunk_bounds(alen, max_batch)
            for a, b in zip(cuts[:-1], cuts[1:]):
                sl = slice(int(a), int(b))
                lens = alen[sl]
                dst = np.zeros(lens.shape[0], dtype=np.uint64)
                np.cumsum(lens[:-1], out=dst[1:])
                offs = li.extent_off[cc[sl], dd[sl]]
                with self._staging(int(lens.sum())) as buf:
                    try:
                        self.engine.execute(READ, dd[sl], offs, lens, dst, buf, layer=layer)
                    except E.SwarmError as exc:
                        failures.append({"layer": layer, "cluster": None, "disk": exc.disk,
                                         "path": exc.path, "offset": None,
                                         "error": exc.message})
                        continue
                    got = xxh3_ranges(buf.array, dst, nbytes[sl])
                bad = np.flatnonzero(got != li.extent_xxh[cc[sl], dd[sl]])
                for k in bad[:1000]:
                    d = int(dd[sl][k])
                    failures.append({"layer": layer, "cluster": int(cc[sl][k]), "disk": d,
                                     "path": self.disk_paths[d], "offset": int(offs[k]),
                                     "error": "extent checksum mismatch"})
                self._count(checksum_failures=int(bad.size))
                if progress is not None:
                    progress(int(lens.sum()))
        return failures

    def stats(self) -> StoreStats:
        """Counters since open, as a :class:`StoreStats`."""
        with self._counter_lock:
            counters = dict(self._counters)
        return StoreStats(engine=self.engine.stats(), verify_checksums=self.verify_checksums,
                          **counters)

    def info(self) -> dict:
        """JSON-ready summary: disks, sizes, layers, clusters, replication, engine."""
        m = self._m
        layers = {}
        for k, rec in sorted(m["layers"].items(), key=lambda kv: int(kv[0])):
            layers[k] = {x: rec[x] for x in ("num_tokens", "num_clusters", "num_copies",
                                             "replication", "local_window", "hot_clusters")}
        disks = []
        for i, d in enumerate(m["disks"]):
            disks.append({"index": i, "path": self.disk_paths[i], "used_bytes": int(d["end"]),
                          "capacity": int(d["capacity"]) or None,
                          "size": _size_or_none(self.disk_paths[i])})
        copies = sum(r["num_copies"] for r in m["layers"].values())
        tokens = sum(r["num_tokens"] for r in m["layers"].values())
        return {
            "path": self.path, "uuid": m["uuid"], "format_version": m["format_version"],
            "generation": m["generation"], "model": m["model"],
            "block_size": self.block_size, "entry_bytes": self.entry_bytes,
            "allocated_bytes": sum(int(d["end"]) - F.DATA_START for d in m["disks"]),
            "engine": self.engine.kind, "queue_depth": self.engine.queue_depth,
            "verify_checksums": self.verify_checksums,
            "num_disks": self.num_disks, "disks": disks,
            "num_layers_stored": len(m["layers"]),
            "clusters": sum(r["num_clusters"] for r in m["layers"].values()),
            "entries": tokens, "copies": copies,
            "replication": round(copies / tokens, 4) if tokens else None,
            "kv_bytes": copies * self.entry_bytes,
            "layers": layers,
        }


def _metadata_error(exc: OSError, store, layer) -> E.SwarmError:
    """An OSError while writing the index or manifest, as a SwarmError."""
    import errno
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return E.DiskFullError(f"no space for the index or manifest in the store "
                               f"directory: {exc.strerror}", store=store, layer=layer)
    return E.IOFailedError(f"cannot write the index or manifest: {exc.strerror}",
                           errno=exc.errno, store=store, layer=layer)


def _size_or_none(p):
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return None
    try:
        return device_size(fd)
    finally:
        os.close(fd)


def to_torch(arr: np.ndarray, dtype_name: str):
    """numpy array (store dtype; ml_dtypes bfloat16 allowed) -> torch tensor,
    sharing memory."""
    import torch
    if dtype_name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)
