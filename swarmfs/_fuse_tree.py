"""The namespace of a mounted store: names, inode numbers and file contents.

This module knows nothing about FUSE; ``_fuse`` turns it into a file system.
The tree mirrors the store's addressing and is read-only::

    manifest.json                              the store's committed manifest
    stats.json                                 live counters (engine, disks, mount)
    disks/<i>/info.json                        one disk: path, size, block size, bytes read
    layers/<LL>/medoids.npy                    medoid keys [C, H_kv, d]
    layers/<LL>/clusters/<CCCCCC>/kv.bin       the cluster file: entries in cluster order
    layers/<LL>/clusters/<CCCCCC>/kv.npy       npy header + kv.bin: [n, 2, H_kv, d]
    layers/<LL>/clusters/<CCCCCC>/tokens.txt   token positions, one per line
    layers/<LL>/clusters/<CCCCCC>/info.json    medoid, size, start disk, extents, replicas

Inode numbers are arithmetic, so no table grows with the store: fixed nodes
take small numbers, a layer's nodes take ``(layer + 1) << 44`` plus an offset
(0 the layer directory, 1 ``medoids.npy``, 2 ``clusters/``, ``8 + 8 * c + f``
the cluster directory (f = 0) and its four files).  Lookup counts, which the
kernel raises and ``forget`` lowers, live in one small int32 array per layer.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import stat
import struct
import threading

import numpy as np

__all__ = ["Node", "Tree", "LookupCounts", "encode", "decode", "npy_header", "npy_descr",
           "tokens_text", "tokens_text_size", "ROOT_INODE"]

# -- node kinds -------------------------------------------------------------
ROOT, MANIFEST, STATS, DISKS, LAYERS = 1, 2, 3, 4, 5
DISK_DIR, DISK_INFO = 6, 7
LAYER_DIR, MEDOIDS, CLUSTERS = 8, 9, 10
CLUSTER_DIR, KV_BIN, KV_NPY, TOKENS, CLUSTER_INFO = 11, 12, 13, 14, 15

ROOT_INODE = 1
_DISK_BASE = 0x100              # disk i: 0x100 + 2i (dir), 0x101 + 2i (info.json)
_MAX_DISKS = 256
LAYER_SHIFT = 44
_REST_MASK = (1 << LAYER_SHIFT) - 1
MAX_LAYERS = (1 << (63 - LAYER_SHIFT)) - 1    # keeps every inode below 2**63
_CLUSTER_BASE = 8               # rest = 8 + 8 * cluster + file
_CLUSTER_STRIDE = 8
_CLUSTER_FILES = (("kv.bin", KV_BIN), ("kv.npy", KV_NPY), ("tokens.txt", TOKENS),
                  ("info.json", CLUSTER_INFO))
_CLUSTER_FILE_INDEX = {name.encode(): i + 1 for i, (name, _) in enumerate(_CLUSTER_FILES)}
_FILE_KIND = {i + 1: kind for i, (_, kind) in enumerate(_CLUSTER_FILES)}
_KIND_FILE = {kind: i + 1 for i, (_, kind) in enumerate(_CLUSTER_FILES)}
_ROOT_ENTRIES = ((b"manifest.json", MANIFEST), (b"stats.json", STATS), (b"disks", DISKS),
                 (b"layers", LAYERS))

DIR_KINDS = frozenset({ROOT, DISKS, LAYERS, DISK_DIR, LAYER_DIR, CLUSTERS, CLUSTER_DIR})
#: Files whose contents change while mounted (snapshot per open, no caching).
LIVE_KINDS = frozenset({STATS, DISK_INFO})
#: Files whose bytes are KV data read through the engine.
KV_KINDS = frozenset({KV_BIN, KV_NPY})
#: Nodes whose attributes need the layer's index loaded.
INDEX_KINDS = frozenset({KV_BIN, KV_NPY, TOKENS, CLUSTER_INFO})


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """A decoded inode: its kind and the layer, cluster or disk it names."""
    kind: int
    layer: int = -1
    cluster: int = -1
    disk: int = -1


def encode(node: Node) -> int:
    """Inode number of a node (the inverse of :func:`decode`)."""
    k = node.kind
    if k in (ROOT, MANIFEST, STATS, DISKS, LAYERS):
        return k
    if k == DISK_DIR:
        return _DISK_BASE + 2 * node.disk
    if k == DISK_INFO:
        return _DISK_BASE + 2 * node.disk + 1
    base = (node.layer + 1) << LAYER_SHIFT
    if k == LAYER_DIR:
        return base
    if k == MEDOIDS:
        return base + 1
    if k == CLUSTERS:
        return base + 2
    f = 0 if k == CLUSTER_DIR else _KIND_FILE[k]
    return base + _CLUSTER_BASE + _CLUSTER_STRIDE * node.cluster + f


def decode(ino: int) -> Node | None:
    """The node an inode number names, or None when it names nothing
    (bounds against the store are checked by :meth:`Tree.valid`)."""
    hi = ino >> LAYER_SHIFT
    if hi == 0:
        if ROOT <= ino <= LAYERS:
            return Node(ino)
        if _DISK_BASE <= ino < _DISK_BASE + 2 * _MAX_DISKS:
            i, f = divmod(ino - _DISK_BASE, 2)
            return Node(DISK_INFO if f else DISK_DIR, disk=i)
        return None
    if hi > MAX_LAYERS:
        return None
    layer, rest = hi - 1, ino & _REST_MASK
    if rest < _CLUSTER_BASE:
        kind = {0: LAYER_DIR, 1: MEDOIDS, 2: CLUSTERS}.get(rest)
        return Node(kind, layer=layer) if kind is not None else None
    c, f = divmod(rest - _CLUSTER_BASE, _CLUSTER_STRIDE)
    if f == 0:
        return Node(CLUSTER_DIR, layer=layer, cluster=c)
    kind = _FILE_KIND.get(f)
    return Node(kind, layer=layer, cluster=c) if kind is not None else None


def parent_of(node: Node) -> Node:
    """The directory holding ``node`` (the root is its own parent)."""
    k = node.kind
    if k in (ROOT, MANIFEST, STATS, DISKS, LAYERS):
        return Node(ROOT)
    if k == DISK_DIR:
        return Node(DISKS)
    if k == DISK_INFO:
        return Node(DISK_DIR, disk=node.disk)
    if k == LAYER_DIR:
        return Node(LAYERS)
    if k in (MEDOIDS, CLUSTERS):
        return Node(LAYER_DIR, layer=node.layer)
    if k == CLUSTER_DIR:
        return Node(CLUSTERS, layer=node.layer)
    return Node(CLUSTER_DIR, layer=node.layer, cluster=node.cluster)


# -- npy and text renderings --------------------------------------------------

def npy_descr(dtype_name: str) -> str:
    """The npy ``descr`` used for a store dtype.

    float16 -> ``'<f2'``, float32 -> ``'<f4'``.  bfloat16 has no npy type code
    that plain numpy can load, so it is served as ``'<u2'``: the raw 16-bit
    patterns, exact; ``np.load(p).view(ml_dtypes.bfloat16)`` gives the values.
    """
    return {"float16": "<f2", "float32": "<f4", "bfloat16": "<u2"}[dtype_name]


def npy_header(descr: str, shape: tuple) -> bytes:
    """An npy format 1.0 header (``numpy.lib.format``), padded with spaces so
    that the data starts at a multiple of 64 bytes."""
    shape = tuple(int(x) for x in shape)
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (descr, shape)
    pad = -(10 + len(text) + 1) % 64
    text = text + " " * pad + "\n"
    if len(text) > 0xFFFF:
        raise ValueError("npy header too long for format 1.0")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


_POW10 = 10 ** np.arange(1, 19, dtype=np.int64)


def tokens_text(tokens: np.ndarray) -> bytes:
    """``tokens.txt``: decimal token positions, one per line."""
    if tokens.shape[0] == 0:
        return b""
    return ("\n".join(map(str, tokens.tolist())) + "\n").encode()


def tokens_text_size(tokens: np.ndarray) -> int:
    """``len(tokens_text(tokens))`` without rendering (tokens are >= 0)."""
    t = np.asarray(tokens, dtype=np.int64)
    digits = np.searchsorted(_POW10, t, side="right") + 1
    return int(digits.sum()) + int(t.shape[0])


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1).encode() + b"\n"


class LookupCounts:
    """Kernel lookup counts of every inode, without a per-inode dict.

    Fixed nodes (root, disks) use a small array; each layer gets an int32
    array of ``8 + 8 * C`` counters on first use.  Only the FUSE thread
    touches it.  ``total`` is the sum of all counts (inodes the kernel holds
    references to, with multiplicity).
    """

    def __init__(self, store):
        self._store = store
        self._fixed = np.zeros(_DISK_BASE + 2 * _MAX_DISKS, dtype=np.int64)
        self._layers: dict[int, np.ndarray] = {}
        self.total = 0
        self.underflows = 0

    def _slot(self, ino: int, create: bool):
        hi = ino >> LAYER_SHIFT
        if hi == 0:
            return (self._fixed, ino) if ino < self._fixed.shape[0] else (None, 0)
        arr = self._layers.get(hi - 1)
        if arr is None:
            if not create:
                return None, 0
            n = _CLUSTER_BASE + _CLUSTER_STRIDE * self._store.num_clusters(hi - 1)
            arr = self._layers[hi - 1] = np.zeros(n, dtype=np.int32)
        rest = ino & _REST_MASK
        return (arr, rest) if rest < arr.shape[0] else (None, 0)

    def add(self, ino: int, n: int = 1) -> None:
        arr, i = self._slot(ino, True)
        if arr is not None:
            arr[i] += n
            self.total += n

    def forget(self, ino: int, n: int) -> None:
        """Lower a count by ``n`` (clamped at zero; an underflow is counted,
        never raised)."""
        arr, i = self._slot(ino, False)
        have = int(arr[i]) if arr is not None else 0
        take = min(have, int(n))
        if take < n:
            self.underflows += 1
        if take:
            arr[i] -= take
            self.total -= take

    def get(self, ino: int) -> int:
        arr, i = self._slot(ino, False)
        return int(arr[i]) if arr is not None else 0


@dataclasses.dataclass(frozen=True, slots=True)
class Attr:
    """What the file system needs to fill ``struct stat`` for a node."""
    mode: int
    nlink: int
    size: int
    blksize: int


class Tree:
    """The mount's namespace over an open :class:`Store`.

    Methods that need a layer's index (sizes of cluster files, renderings)
    call ``store.layer`` and may block on first use of a layer; the FUSE layer
    calls :meth:`load_layer` in a worker thread before touching such nodes.

    Args:
        store: the open store (read-only).
        kv_blksize: ``st_blksize`` of KV files (bytes): the read size tools
            such as ``cat`` and ``cp`` use.
        cache_entries: rendered small files (info.json, tokens.txt) kept.
        mount_stats: callable returning the file system's own counters (a
            JSON-ready dict) for stats.json.
    """

    def __init__(self, store, *, kv_blksize: int = 1 << 20, cache_entries: int = 4096,
                 mount_stats=None):
        self.store = store
        self._mount_stats = mount_stats or dict
        self.kv_blksize = int(kv_blksize)
        self.entry_bytes = int(store.entry_bytes)
        self.descr = npy_descr(store.dtype)
        self.num_disks = int(store.num_disks)
        if self.num_disks > _MAX_DISKS:
            raise ValueError(f"a mount serves at most {_MAX_DISKS} disks")
        self.layers = list(store.layers)
        if self.layers and max(self.layers) >= MAX_LAYERS:
            raise ValueError(f"a mount serves layers below {MAX_LAYERS}")
        self._layer_set = set(self.layers)
        self._num_clusters = {l: int(store.num_clusters(l)) for l in self.layers}
        self.layer_width = max(2, len(str(max(int(store.num_layers) - 1, 0))))
        self._cluster_width = {l: max(6, len(str(c - 1))) for l, c in self._num_clusters.items()}
        m = store.manifest
        self._disk_recs = m["disks"]
        self.manifest_bytes = json.dumps(m, indent=1, sort_keys=False).encode() + b"\n"
        self.total_kv_bytes = sum(int(r["num_copies"]) for r in m["layers"].values()) \
            * self.entry_bytes
        self._loaded: dict[int, object] = {}
        self._info_size: dict[int, np.ndarray] = {}   # info.json sizes, -1 = unknown
        self._hdr_cache: dict[tuple, bytes] = {}
        self._medoid_hdr = {l: npy_header(self.descr, (c, store.num_kv_heads, store.head_dim))
                            for l, c in self._num_clusters.items()}
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_entries = int(cache_entries)
        self._cache_lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0

    # -- layers ---------------------------------------------------------------
    def num_clusters(self, layer: int) -> int:
        return self._num_clusters[layer]

    def is_loaded(self, layer: int) -> bool:
        return layer in self._loaded

    def load_layer(self, layer: int):
        """The layer's index (blocking on first use: reads the index file)."""
        li = self._loaded.get(layer)
        if li is None:
            li = self._loaded[layer] = self.store.layer(layer)
        return li

    # -- names ----------------------------------------------------------------
    def layer_name(self, layer: int) -> bytes:
        return b"%0*d" % (self.layer_width, layer)

    def cluster_name(self, layer: int, cid: int) -> bytes:
        return b"%0*d" % (self._cluster_width[layer], cid)

    @staticmethod
    def _parse_number(name: bytes, width: int) -> int:
        """The number a canonical zero-padded name spells, or -1."""
        if len(name) < width or not name.isdigit() or (len(name) > width and name[:1] == b"0"):
            return -1
        return int(name)

    def valid(self, node: Node | None) -> bool:
        """Whether a decoded node exists in this store."""
        if node is None:
            return False
        if node.kind in (DISK_DIR, DISK_INFO):
            return 0 <= node.disk < self.num_disks
        if node.layer >= 0:
            if node.layer not in self._layer_set:
                return False
            if node.cluster >= 0:
                return node.cluster < self._num_clusters[node.layer]
        return True

    def lookup(self, parent: Node, name: bytes) -> Node | None:
        """The child ``name`` of directory ``parent``, or None."""
        k = parent.kind
        if name == b".":
            return parent
        if name == b"..":
            return parent_of(parent)
        if k == ROOT:
            for n, kind in _ROOT_ENTRIES:
                if n == name:
                    return Node(kind)
            return None
        if k == DISKS:
            i = self._parse_number(name, 1)
            return Node(DISK_DIR, disk=i) if 0 <= i < self.num_disks and \
                name == b"%d" % i else None
        if k == DISK_DIR:
            return Node(DISK_INFO, disk=parent.disk) if name == b"info.json" else None
        if k == LAYERS:
            l = self._parse_number(name, self.layer_width)
            return Node(LAYER_DIR, layer=l) if l in self._layer_set else None
        if k == LAYER_DIR:
            if name == b"medoids.npy":
                return Node(MEDOIDS, layer=parent.layer)
            if name == b"clusters":
                return Node(CLUSTERS, layer=parent.layer)
            return None
        if k == CLUSTERS:
            l = parent.layer
            c = self._parse_number(name, self._cluster_width[l])
            return Node(CLUSTER_DIR, layer=l, cluster=c) \
                if 0 <= c < self._num_clusters[l] else None
        if k == CLUSTER_DIR:
            f = _CLUSTER_FILE_INDEX.get(name)
            return Node(_FILE_KIND[f], layer=parent.layer, cluster=parent.cluster) \
                if f is not None else None
        return None

    def entries(self, parent: Node, start_id: int):
        """Yield ``(name, node, next_id)`` of directory ``parent`` from the
        position ``start_id`` (0 = first).  ``next_id`` values are stable: the
        cluster id + 1 in ``clusters/``, the layer or disk number + 1, or the
        entry's fixed position."""
        k = parent.kind
        if k == ROOT:
            for i in range(start_id, len(_ROOT_ENTRIES)):
                name, kind = _ROOT_ENTRIES[i]
                yield name, Node(kind), i + 1
        elif k == DISKS:
            for i in range(start_id, self.num_disks):
                yield b"%d" % i, Node(DISK_DIR, disk=i), i + 1
        elif k == DISK_DIR:
            if start_id < 1:
                yield b"info.json", Node(DISK_INFO, disk=parent.disk), 1
        elif k == LAYERS:
            for l in self.layers:
                if l + 1 > start_id:
                    yield self.layer_name(l), Node(LAYER_DIR, layer=l), l + 1
        elif k == LAYER_DIR:
            if start_id < 1:
                yield b"medoids.npy", Node(MEDOIDS, layer=parent.layer), 1
            if start_id < 2:
                yield b"clusters", Node(CLUSTERS, layer=parent.layer), 2
        elif k == CLUSTERS:
            l = parent.layer
            w = self._cluster_width[l]
            for c in range(start_id, self._num_clusters[l]):
                yield b"%0*d" % (w, c), Node(CLUSTER_DIR, layer=l, cluster=c), c + 1
        elif k == CLUSTER_DIR:
            for f in range(start_id + 1, len(_CLUSTER_FILES) + 1):
                yield (_CLUSTER_FILES[f - 1][0].encode(),
                       Node(_FILE_KIND[f], layer=parent.layer, cluster=parent.cluster), f)

    # -- attributes -------------------------------------------------------------
    def attr(self, node: Node) -> Attr:
        """Mode, link count, exact size and preferred I/O size of a node.

        Live files (stats.json, disks/<i>/info.json) are rendered to size them;
        cluster files need the layer loaded (:meth:`load_layer`).
        """
        k = node.kind
        if k in DIR_KINDS:
            nlink = 2
            if k == ROOT:
                nlink = 4
            elif k == DISKS:
                nlink = 2 + self.num_disks
            elif k == LAYERS:
                nlink = 2 + len(self.layers)
            elif k == LAYER_DIR:
                nlink = 3
            elif k == CLUSTERS:
                nlink = 2 + self._num_clusters[node.layer]
            return Attr(stat.S_IFDIR | 0o555, nlink, 0, 4096)
        return Attr(stat.S_IFREG | 0o444, 1, self.size(node),
                    self.kv_blksize if k in KV_KINDS or k == MEDOIDS else 4096)

    def kv_npy_header(self, layer: int, cid: int) -> bytes:
        n = int(self.load_layer(layer).sizes[cid])
        h = self._hdr_cache.get(n)
        if h is None:
            h = npy_header(self.descr, (n,) + tuple(self.store.entry_shape))
            if len(self._hdr_cache) < 65536:
                self._hdr_cache[n] = h
        return h

    def size(self, node: Node) -> int:
        k = node.kind
        if k == MANIFEST:
            return len(self.manifest_bytes)
        if k in LIVE_KINDS:
            return len(self.render_live(node))
        if k == MEDOIDS:
            h = self._medoid_hdr[node.layer]
            return len(h) + self._num_clusters[node.layer] * (self.entry_bytes // 2)
        li = self.load_layer(node.layer)
        c = node.cluster
        if k == KV_BIN:
            return int(li.sizes[c]) * self.entry_bytes
        if k == KV_NPY:
            return len(self.kv_npy_header(node.layer, c)) + int(li.sizes[c]) * self.entry_bytes
        if k == TOKENS:
            return tokens_text_size(li.members[li.members_ptr[c]:li.members_ptr[c + 1]])
        if k == CLUSTER_INFO:
            sizes = self._info_size.get(node.layer)
            if sizes is None:
                sizes = self._info_size[node.layer] = np.full(
                    self._num_clusters[node.layer], -1, dtype=np.int32)
            if sizes[c] < 0:
                sizes[c] = len(self.render_small(node))
            return int(sizes[c])
        raise ValueError(f"size of a directory node {node}")

    # -- contents ---------------------------------------------------------------
    def cluster_info(self, layer: int, cid: int) -> dict:
        """``info.json`` of a cluster: ``LayerIndex.cluster_info`` plus the
        clusters that hold replicas of its entries and the sizes of its files."""
        li = self.load_layer(layer)
        info = li.cluster_info(cid)
        toks = li.members[li.members_ptr[cid]:li.members_ptr[cid + 1]]
        others = np.unique(li.copy_cluster[li.token_copies(toks)])
        info["replica_clusters"] = [int(x) for x in others[others != cid]]
        info["files"] = {"kv.bin": int(li.sizes[cid]) * self.entry_bytes,
                         "kv.npy": len(self.kv_npy_header(layer, cid))
                         + int(li.sizes[cid]) * self.entry_bytes,
                         "tokens.txt": tokens_text_size(toks)}
        info["entry_shape"] = list(self.store.entry_shape)
        info["dtype"] = self.store.dtype
        return info

    def render_small(self, node: Node) -> bytes:
        """Bytes of tokens.txt or a cluster's info.json (LRU-cached)."""
        key = encode(node)
        with self._cache_lock:
            data = self._cache.get(key)
            if data is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return data
            self.cache_misses += 1
        if node.kind == TOKENS:
            li = self.load_layer(node.layer)
            c = node.cluster
            data = tokens_text(li.members[li.members_ptr[c]:li.members_ptr[c + 1]])
        elif node.kind == CLUSTER_INFO:
            data = _json_bytes(self.cluster_info(node.layer, node.cluster))
        else:
            raise ValueError(f"not a small file: {node}")
        with self._cache_lock:
            self._cache[key] = data
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return data

    def disk_info(self, i: int) -> dict:
        st = self.store.stats().engine.disks[i]
        rec = self._disk_recs[i]
        return {"index": i, "path": self.store.disk_paths[i],
                "size": _device_size(self.store.disk_paths[i]),
                "block_size": int(self.store.block_size),
                "used_bytes": int(rec["end"]), "capacity": int(rec["capacity"]) or None,
                "bytes_read": int(st.bytes), "requests": int(st.requests),
                "busy_us": float(st.busy_us)}

    def render_live(self, node: Node) -> bytes:
        """Bytes of a live file, rendered now."""
        if node.kind == DISK_INFO:
            return _json_bytes(self.disk_info(node.disk))
        if node.kind == STATS:
            st = dataclasses.asdict(self.store.stats())
            out = {"store": self.store.path, "engine": st["engine"]["engine"],
                   "verify_checksums": st["verify_checksums"],
                   "disks": [dict(index=i, **d) for i, d in
                             enumerate(st["engine"].pop("disks"))],
                   "engine_counters": st["engine"],
                   "store_counters": {k: v for k, v in st.items()
                                      if k not in ("engine", "verify_checksums")},
                   "mount": self._mount_stats(),
                   "cache": {"entries": len(self._cache), "hits": self.cache_hits,
                             "misses": self.cache_misses}}
            return _json_bytes(out)
        raise ValueError(f"not a live file: {node}")

    def read_static(self, node: Node, off: int, size: int) -> bytes:
        """Bytes ``[off, off+size)`` of a file that is not KV data and not
        live.  Blocking only on first use of a layer."""
        k = node.kind
        if k == MANIFEST:
            return self.manifest_bytes[off:off + size]
        if k == MEDOIDS:
            h = self._medoid_hdr[node.layer]
            out = h[off:off + size]
            if off + size > len(h):
                keys = self.load_layer(node.layer).medoid_keys
                flat = keys.reshape(-1)
                a = max(off - len(h), 0)
                out += flat[a:a + size - len(out)].tobytes()
            return out
        return self.render_small(node)[off:off + size]


def _device_size(path: str) -> int | None:
    import os
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)
