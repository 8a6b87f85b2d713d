"""The namespace of a mounted store: names, inode numbers and file contents.

This module knows nothing about FUSE; ``_fuse`` turns it into a file system.
The tree mirrors the store's addressing and is read-only::

    manifest.json                              the store's committed manifest
    stats.json                                 live counters (engine, disks, mount)
    disks/<i>/info.json                        one disk: path, size, block size, bytes read
    layers/<LL>/medoids.npy                    medoid keys [C, H_kv, d]
    layers/<LL>/clusters/<CCCCCC>.npy          a cluster: npy header + entries [n, 2, H_kv, d]
    layers/<LL>/clusters/<CCCCCC>/kv.bin       the cluster file: entries in cluster order
    layers/<LL>/clusters/<CCCCCC>/kv.npy       the same file as <CCCCCC>.npy (a hard link)
    layers/<LL>/clusters/<CCCCCC>/tokens.txt   token positions, one per line
    layers/<LL>/clusters/<CCCCCC>/info.json    medoid, size, start disk, extents, replicas

``clusters/`` lists one entry per cluster, ``<CCCCCC>.npy``, so that ``ls``,
``find`` and ``du`` of a layer cost a few large READDIRPLUS requests instead
of four requests per cluster directory.  The per-cluster directories
``<CCCCCC>/`` still resolve by name (as ``/proc/<tid>`` does) but are not
listed.

A :class:`Tree` is one committed generation of the store.  A mount that
follows the store builds a new Tree for every new generation; versions tell
the generations apart in inode numbers, so an inode's contents never change
and the kernel may cache them for ever.

Inode numbers are arithmetic, so no table grows with the store:

* fixed nodes take small numbers (root 1 .. layers 5, disks from 0x100);
  ``manifest.json`` carries the generation's version in bits 12-51;
* a layer's nodes take ``(layer + 1) << 52`` plus ``version << 35`` plus an
  offset: 0 the layer directory, 1 ``medoids.npy`` (version: the layer's),
  2 ``clusters/``, ``8 + 8 * c + f`` the cluster directory (f = 0) and its
  files (version: the cluster's, which changes only when its entries do).

Lookup counts, which the kernel raises and ``forget`` lowers, live in one
small int32 array per layer (versions of one node share a counter).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import stat
import struct
import threading
from collections.abc import Callable

import numpy as np

from ..store._manifest import Manifest

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
_FIXED_BITS = 12                # fixed nodes below 1 << 12; manifest version above
LAYER_SHIFT = 52
VER_SHIFT = 35
VER_BITS = LAYER_SHIFT - VER_SHIFT          # 17: versions wrap at 131072
VER_MASK = (1 << VER_BITS) - 1
MANIFEST_VER_MASK = (1 << (LAYER_SHIFT - _FIXED_BITS)) - 1
_LOW_MASK = (1 << VER_SHIFT) - 1
_REST_MASK = (1 << LAYER_SHIFT) - 1
MAX_LAYERS = (1 << (63 - LAYER_SHIFT)) - 1    # keeps every inode below 2**63
CLUSTER_BASE = _CLUSTER_BASE = 8          # low = 8 + 8 * cluster + file
CLUSTER_STRIDE = _CLUSTER_STRIDE = 8
MAX_CLUSTERS = (_LOW_MASK - _CLUSTER_BASE) // _CLUSTER_STRIDE
_CLUSTER_FILES = (("kv.bin", KV_BIN), ("kv.npy", KV_NPY), ("tokens.txt", TOKENS),
                  ("info.json", CLUSTER_INFO))
_CLUSTER_FILE_INDEX = {name.encode(): i + 1 for i, (name, _) in enumerate(_CLUSTER_FILES)}
_FILE_KIND = {i + 1: kind for i, (_, kind) in enumerate(_CLUSTER_FILES)}
_KIND_FILE = {kind: i + 1 for i, (_, kind) in enumerate(_CLUSTER_FILES)}
KV_NPY_FILE = _KIND_FILE[KV_NPY]
_ROOT_ENTRIES = ((b"manifest.json", MANIFEST), (b"stats.json", STATS), (b"disks", DISKS),
                 (b"layers", LAYERS))
#: ``next_id`` of the first real entry: ``.`` is 1, ``..`` is 2.
DOTS = 2

DIR_KINDS = frozenset({ROOT, DISKS, LAYERS, DISK_DIR, LAYER_DIR, CLUSTERS, CLUSTER_DIR})
#: Files whose contents change while mounted (snapshot per open, no caching).
LIVE_KINDS = frozenset({STATS, DISK_INFO})
#: Files whose bytes are KV data read through the engine.
KV_KINDS = frozenset({KV_BIN, KV_NPY})
#: Cluster nodes whose inode number carries the cluster's version.
CLUSTER_KINDS = frozenset({CLUSTER_DIR, KV_BIN, KV_NPY, TOKENS, CLUSTER_INFO})


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """A decoded inode: its kind, the layer, cluster or disk it names, and the
    version of its contents (manifest: the generation's; medoids: the
    layer's; cluster nodes: the cluster's; 0 otherwise)."""
    kind: int
    layer: int = -1
    cluster: int = -1
    disk: int = -1
    ver: int = 0


def encode(node: Node) -> int:
    """Inode number of a node (the inverse of :func:`decode`)."""
    k = node.kind
    if k == MANIFEST:
        return (node.ver << _FIXED_BITS) | MANIFEST
    if k in (ROOT, STATS, DISKS, LAYERS):
        return k
    if k == DISK_DIR:
        return _DISK_BASE + 2 * node.disk
    if k == DISK_INFO:
        return _DISK_BASE + 2 * node.disk + 1
    base = ((node.layer + 1) << LAYER_SHIFT) | (node.ver << VER_SHIFT)
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
    (bounds and versions against the store are checked by :meth:`Tree.valid`)."""
    hi = ino >> LAYER_SHIFT
    if hi == 0:
        low, ver = ino & ((1 << _FIXED_BITS) - 1), ino >> _FIXED_BITS
        if low == MANIFEST:
            return Node(MANIFEST, ver=ver)
        if ver:
            return None
        if ROOT <= ino <= LAYERS:
            return Node(ino)
        if _DISK_BASE <= ino < _DISK_BASE + 2 * _MAX_DISKS:
            i, f = divmod(ino - _DISK_BASE, 2)
            return Node(DISK_INFO if f else DISK_DIR, disk=i)
        return None
    if hi > MAX_LAYERS:
        return None
    layer, rest = hi - 1, ino & _REST_MASK
    ver, low = rest >> VER_SHIFT, rest & _LOW_MASK
    if low < _CLUSTER_BASE:
        kind = {0: LAYER_DIR, 1: MEDOIDS, 2: CLUSTERS}.get(low)
        if kind is None or (ver and kind != MEDOIDS):
            return None
        return Node(kind, layer=layer, ver=ver)
    c, f = divmod(low - _CLUSTER_BASE, _CLUSTER_STRIDE)
    if f == 0:
        return Node(CLUSTER_DIR, layer=layer, cluster=c, ver=ver)
    kind = _FILE_KIND.get(f)
    return Node(kind, layer=layer, cluster=c, ver=ver) if kind is not None else None


def parent_of(node: Node) -> Node:
    """The directory holding ``node`` (the root is its own parent; version
    fields are not filled in)."""
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
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    pad = -(10 + len(text) + 1) % 64
    text = text + " " * pad + "\n"
    if len(text) > 0xFFFF:
        raise ValueError("npy header too long for format 1.0")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


_POW10 = 10 ** np.arange(1, 19, dtype=np.int64)


def _digits(n: np.ndarray) -> np.ndarray:
    """Decimal digits of non-negative integers, vectorised: int64 [n]."""
    return np.searchsorted(_POW10, np.asarray(n, dtype=np.int64), side="right") + 1


def tokens_text(tokens: np.ndarray) -> bytes:
    """``tokens.txt``: decimal token positions, one per line."""
    if tokens.shape[0] == 0:
        return b""
    return ("\n".join(map(str, tokens.tolist())) + "\n").encode()


def tokens_text_size(tokens: np.ndarray) -> int:
    """``len(tokens_text(tokens))`` without rendering (tokens are >= 0)."""
    t = np.asarray(tokens, dtype=np.int64)
    return int(_digits(t).sum()) + int(t.shape[0])


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1).encode() + b"\n"


class LookupCounts:
    """Kernel lookup counts of every inode, without a per-inode dict.

    Fixed nodes (root, disks) use a small array; each layer gets an int32
    array of ``8 + 8 * C`` counters on first use, grown when the layer grows.
    Versions of one node share its counter.  Only the FUSE thread touches it.
    ``total`` is the sum of all counts (inodes the kernel holds references
    to, with multiplicity).
    """

    def __init__(self, store=None):
        self._fixed = np.zeros(1 << _FIXED_BITS, dtype=np.int64)
        self._layers: dict[int, np.ndarray] = {}
        self.total = 0
        self.underflows = 0

    def _slot(self, ino: int, create: bool):
        hi = ino >> LAYER_SHIFT
        if hi == 0:
            return self._fixed, ino & ((1 << _FIXED_BITS) - 1)
        if hi > MAX_LAYERS:
            return None, 0
        i = ino & _LOW_MASK
        arr = self._layers.get(hi - 1)
        if arr is None or i >= arr.shape[0]:
            if not create:
                return None, 0
            arr = self._grow(hi - 1, i + 1)
        return arr, i

    def _grow(self, layer: int, n: int) -> np.ndarray:
        old = self._layers.get(layer)
        have = 0 if old is None else old.shape[0]
        arr = np.zeros(max(n, 2 * have, 64), dtype=np.int32)
        if old is not None:
            arr[:have] = old
        self._layers[layer] = arr
        return arr

    def add(self, ino: int, n: int = 1) -> None:
        """Add ``n`` to the kernel's lookup count of ``ino``."""
        arr, i = self._slot(ino, True)
        if arr is not None:
            arr[i] += n
            self.total += n

    def add_clusters(self, layer: int, first: int, stop: int, f: int) -> None:
        """Add one lookup to file ``f`` of clusters ``[first, stop)`` at once
        (what a READDIRPLUS reply of ``clusters/`` does)."""
        if stop <= first:
            return
        end = _CLUSTER_BASE + _CLUSTER_STRIDE * stop
        arr = self._layers.get(layer)
        if arr is None or arr.shape[0] < end:
            arr = self._grow(layer, end)
        arr[_CLUSTER_BASE + _CLUSTER_STRIDE * first + f:end:_CLUSTER_STRIDE] += 1
        self.total += stop - first

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
        """The lookup count of ``ino`` (0 if unknown)."""
        arr, i = self._slot(ino, False)
        return int(arr[i]) if arr is not None else 0

    def known_clusters(self, layer: int, num_clusters: int) -> np.ndarray:
        """bool [num_clusters]: clusters any of whose nodes the kernel holds."""
        arr = self._layers.get(layer)
        out = np.zeros(num_clusters, dtype=bool)
        if arr is None:
            return out
        n = min(num_clusters, (arr.shape[0] - _CLUSTER_BASE) // _CLUSTER_STRIDE)
        if n > 0:
            block = arr[_CLUSTER_BASE:_CLUSTER_BASE + _CLUSTER_STRIDE * n]
            out[:n] = block.reshape(n, _CLUSTER_STRIDE).any(axis=1)
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class Attr:
    """What the file system needs to fill ``struct stat`` for a node."""
    mode: int
    nlink: int
    size: int
    blksize: int


def _cluster_signature(li) -> tuple:
    """Per-cluster arrays whose equality means the cluster's entries are
    unchanged: sizes, start disk, extent offsets and checksums, and a
    checksum of its member tokens."""
    ptr = li.members_ptr
    mix = (li.members.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    mem = np.add.reduceat(mix, ptr[:-1]) if li.num_clusters else np.zeros(0, np.uint64)
    return li.sizes, li.start_disk, li.extent_off, li.extent_xxh, mem


def changed_clusters(old, new) -> np.ndarray:
    """bool [new C]: clusters of layer index ``new`` whose entries differ from
    ``old``'s (clusters beyond ``old``'s count are changed), vectorised."""
    C = new.num_clusters
    out = np.ones(C, dtype=bool)
    k = min(old.num_clusters, C)
    if k:
        same = np.ones(k, dtype=bool)
        for a, b in zip(_cluster_signature(old), _cluster_signature(new), strict=True):
            eq = a[:k] == b[:k]
            same &= eq if eq.ndim == 1 else eq.all(axis=1)
        out[:k] = ~same
    return out


class Tree:
    """One committed generation of a store as a namespace.

    Args:
        store: the open store that serves reads (its engine, disks, shape).
        manifest: the generation's manifest (a
            :class:`~swarmfs.store._manifest.Manifest`, or ``Store.manifest``'s
            dict; default ``store.committed``).
        indexes: ``{layer: LayerIndex}`` of the generation (default: loaded
            from ``store`` now).
        prev: the previous generation's Tree, whose versions this one
            continues: nodes whose contents changed get new versions (and so
            new inode numbers), the others keep theirs.
        kv_blksize: ``st_blksize`` of KV files (bytes): the read size tools
            such as ``cat`` and ``cp`` use.
        cache_entries: rendered small files (info.json, tokens.txt) kept.
        mount_stats: callable returning the file system's own counters (a
            JSON-ready dict) for stats.json.
        store_stats: callable returning the store's counters
            (:class:`StoreStats`; default ``store.stats``), e.g. summed over
            the mount's engines.

    Everything is computed when the Tree is built (vectorised per layer), so
    its methods never block on I/O except live files and KV reads.  A Tree
    is immutable once built; several may be in use at once (open files keep
    the generation they were opened on).
    """

    def __init__(self, store, manifest=None, indexes=None, *, prev: Tree | None = None,
                 kv_blksize: int = 1 << 20, cache_entries: int = 4096, mount_stats=None,
                 mtime_ns: int = 0, store_stats=None):
        self.store = store
        self._store_stats: Callable = store_stats or \
            (prev._store_stats if prev else store.stats)
        m = store.committed if manifest is None else manifest
        if isinstance(m, dict):
            m = Manifest.load(m, store.path)
        self._mount_stats: Callable[[], dict] = mount_stats or \
            (prev._mount_stats if prev else dict)
        self.kv_blksize = int(kv_blksize)
        self.entry_bytes = int(store.entry_bytes)
        self.descr = npy_descr(store.dtype)
        self.num_disks = int(store.num_disks)
        if self.num_disks > _MAX_DISKS:
            raise ValueError(f"a mount serves at most {_MAX_DISKS} disks")
        self.generation = m.generation
        self.layers = sorted(m.layers)
        if self.layers and max(self.layers) >= MAX_LAYERS:
            raise ValueError(f"a mount serves layers below {MAX_LAYERS}")
        if indexes is None:
            indexes = {layer: store.layer(layer) for layer in self.layers}
        self._li = {layer: indexes[layer] for layer in self.layers}
        self._layer_set = set(self.layers)
        self._num_clusters = {layer: int(self._li[layer].num_clusters) for layer in self.layers}
        if any(c > MAX_CLUSTERS for c in self._num_clusters.values()):
            raise ValueError(f"a mount serves at most {MAX_CLUSTERS} clusters per layer")
        self.layer_width = max(2, len(str(max(int(store.num_layers) - 1, 0))))
        self._cluster_width = {layer: max(6, len(str(c - 1)))
                               for layer, c in self._num_clusters.items()}
        self.mtime_ns = int(mtime_ns)
        self._disk_recs = m.disks
        self.uuid = m.uuid
        #: the manifest's layer records (a new generation reuses the index of
        #: a layer whose record did not change)
        self.layer_records = {layer: m.layers[layer] for layer in self.layers}
        self.manifest_bytes = m.to_json()
        self.total_kv_bytes = sum(r.num_copies for r in m.layers.values()) * self.entry_bytes
        # versions: manifest, per layer (medoids.npy), per cluster
        if prev is None:
            self.manifest_ver = 1
            self.layer_ver = {layer: 0 for layer in self.layers}
            self.cluster_ver = {layer: np.zeros(c, dtype=np.int64)
                                for layer, c in self._num_clusters.items()}
            self.changed = {layer: np.ones(c, dtype=bool)
                            for layer, c in self._num_clusters.items()}
        else:
            same_m = prev.manifest_bytes == self.manifest_bytes
            self.manifest_ver = prev.manifest_ver if same_m else \
                (prev.manifest_ver % MANIFEST_VER_MASK) + 1
            self.layer_ver, self.cluster_ver, self.changed = {}, {}, {}
            for layer in self.layers:
                self._continue_versions(layer, prev)
        # sizes of every cluster file, vectorised
        Eb = self.entry_bytes
        shape = tuple(store.entry_shape)
        hdr_len = np.array([0] + [len(npy_header(self.descr, (10 ** (d - 1),) + shape))
                                  for d in range(1, 20)], dtype=np.int64)
        self._kv_size, self._npy_size = {}, {}
        for layer in self.layers:
            n = self._li[layer].sizes.astype(np.int64)
            self._kv_size[layer] = n * Eb
            self._npy_size[layer] = hdr_len[_digits(n)] + n * Eb
        self._hdr_cache: dict[int, bytes] = {}
        self._medoid_hdr = {layer: npy_header(self.descr, (c, store.num_kv_heads, store.head_dim))
                            for layer, c in self._num_clusters.items()}
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_entries = int(cache_entries)
        self._cache_lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0

    def _continue_versions(self, layer: int, prev: Tree) -> None:
        li, C = self._li[layer], self._num_clusters[layer]
        old = prev._li.get(layer)
        if old is li:
            self.layer_ver[layer] = prev.layer_ver[layer]
            self.cluster_ver[layer] = prev.cluster_ver[layer]
            self.changed[layer] = np.zeros(C, dtype=bool)
            return
        was = prev.cluster_ver.get(layer)
        stamp = (prev.layer_ver.get(layer, 0) + 1) & VER_MASK
        changed = changed_clusters(old, li) if old is not None else np.ones(C, dtype=bool)
        ver = np.full(C, stamp, dtype=np.int64)
        if was is not None:
            k = min(C, was.shape[0])
            ver[:k] = np.where(changed[:k], stamp, was[:k])
            # after a wrap, a changed cluster must not get back its old number
            while np.any(changed[:k] & (was[:k] == stamp)):
                stamp = (stamp + 1) & VER_MASK
                ver[:k] = np.where(changed[:k], stamp, was[:k])
                ver[k:] = stamp
        self.layer_ver[layer] = stamp
        self.cluster_ver[layer] = ver
        self.changed[layer] = changed

    # -- layers ---------------------------------------------------------------
    def num_clusters(self, layer: int) -> int:
        """Clusters of ``layer`` in the mounted generation."""
        return self._num_clusters[layer]

    def load_layer(self, layer: int):
        """The layer's index (loaded when the Tree was built)."""
        return self._li[layer]

    def cluster_width(self, layer: int) -> int:
        """Digits of the cluster directory names of ``layer`` (zero-padded)."""
        return self._cluster_width[layer]

    def npy_sizes(self, layer: int) -> np.ndarray:
        """int64 [C]: bytes of every cluster's ``.npy`` file."""
        return self._npy_size[layer]

    # -- names ----------------------------------------------------------------
    def layer_name(self, layer: int) -> bytes:
        """Directory name of ``layer`` (zero-padded decimal)."""
        return b"%0*d" % (self.layer_width, layer)

    def cluster_name(self, layer: int, cid: int) -> bytes:
        """Directory name of cluster ``cid`` of ``layer`` (zero-padded decimal)."""
        return b"%0*d" % (self._cluster_width[layer], cid)

    @staticmethod
    def _parse_number(name: bytes, width: int) -> int:
        """The number a canonical zero-padded name spells, or -1."""
        if len(name) < width or not name.isdigit() or (len(name) > width and name[:1] == b"0"):
            return -1
        return int(name)

    def current(self, node: Node) -> Node:
        """``node`` with this generation's version filled in."""
        k = node.kind
        if k == MANIFEST:
            return dataclasses.replace(node, ver=self.manifest_ver)
        if k == MEDOIDS:
            return dataclasses.replace(node, ver=self.layer_ver[node.layer])
        if k in CLUSTER_KINDS:
            return dataclasses.replace(
                node, ver=int(self.cluster_ver[node.layer][node.cluster]))
        return node

    def valid(self, node: Node | None) -> bool:
        """Whether a decoded node exists in this generation (with its version)."""
        if node is None:
            return False
        k = node.kind
        if k == MANIFEST:
            return node.ver == self.manifest_ver
        if k in (DISK_DIR, DISK_INFO):
            return 0 <= node.disk < self.num_disks
        if node.layer >= 0:
            if node.layer not in self._layer_set:
                return False
            if k == MEDOIDS:
                return node.ver == self.layer_ver[node.layer]
            if node.cluster >= 0:
                return node.cluster < self._num_clusters[node.layer] and \
                    node.ver == int(self.cluster_ver[node.layer][node.cluster])
        return True

    def lookup(self, parent: Node, name: bytes) -> Node | None:
        """The child ``name`` of directory ``parent``, or None."""
        k = parent.kind
        if name == b".":
            return parent
        if name == b"..":
            return self.current(parent_of(parent))
        if k == ROOT:
            for n, kind in _ROOT_ENTRIES:
                if n == name:
                    return self.current(Node(kind))
            return None
        if k == DISKS:
            i = self._parse_number(name, 1)
            return Node(DISK_DIR, disk=i) if 0 <= i < self.num_disks and \
                name == b"%d" % i else None
        if k == DISK_DIR:
            return Node(DISK_INFO, disk=parent.disk) if name == b"info.json" else None
        if k == LAYERS:
            layer = self._parse_number(name, self.layer_width)
            return Node(LAYER_DIR, layer=layer) if layer in self._layer_set else None
        if k == LAYER_DIR:
            if name == b"medoids.npy":
                return self.current(Node(MEDOIDS, layer=parent.layer))
            if name == b"clusters":
                return Node(CLUSTERS, layer=parent.layer)
            return None
        if k == CLUSTERS:
            layer = parent.layer
            kind = CLUSTER_DIR
            if name.endswith(b".npy"):
                name, kind = name[:-4], KV_NPY
            c = self._parse_number(name, self._cluster_width[layer])
            if not 0 <= c < self._num_clusters[layer]:
                return None
            return Node(kind, layer=layer, cluster=c, ver=int(self.cluster_ver[layer][c]))
        if k == CLUSTER_DIR:
            f = _CLUSTER_FILE_INDEX.get(name)
            return Node(_FILE_KIND[f], layer=parent.layer, cluster=parent.cluster,
                        ver=parent.ver) if f is not None else None
        return None

    def entries(self, parent: Node, start_id: int):
        """Yield ``(name, node, next_id)`` of directory ``parent`` from the
        position ``start_id`` (0 = first), ``.`` and ``..`` first.  ``next_id``
        values are stable: 1 and 2 for the dots, then 2 + the cluster id + 1
        in ``clusters/``, 2 + the layer or disk number + 1, or 2 + the entry's
        fixed position.  (``_fuse_ops`` lists ``clusters/`` itself, in bulk.)"""
        if start_id < 1:
            yield b".", parent, 1
        if start_id < 2:
            yield b"..", self.current(parent_of(parent)), 2
        start = max(start_id - DOTS, 0)
        k = parent.kind
        if k == ROOT:
            for i in range(start, len(_ROOT_ENTRIES)):
                name, kind = _ROOT_ENTRIES[i]
                yield name, self.current(Node(kind)), DOTS + i + 1
        elif k == DISKS:
            for i in range(start, self.num_disks):
                yield b"%d" % i, Node(DISK_DIR, disk=i), DOTS + i + 1
        elif k == DISK_DIR:
            if start < 1:
                yield b"info.json", Node(DISK_INFO, disk=parent.disk), DOTS + 1
        elif k == LAYERS:
            for layer in self.layers:
                if layer + 1 > start:
                    yield self.layer_name(layer), Node(LAYER_DIR, layer=layer), DOTS + layer + 1
        elif k == LAYER_DIR:
            if start < 1:
                yield b"medoids.npy", self.current(Node(MEDOIDS, layer=parent.layer)), DOTS + 1
            if start < 2:
                yield b"clusters", Node(CLUSTERS, layer=parent.layer), DOTS + 2
        elif k == CLUSTERS:
            layer = parent.layer
            w = self._cluster_width[layer]
            ver = self.cluster_ver[layer]
            for c in range(start, self._num_clusters[layer]):
                yield (b"%0*d.npy" % (w, c), Node(KV_NPY, layer=layer, cluster=c, ver=int(ver[c])),
                       DOTS + c + 1)
        elif k == CLUSTER_DIR:
            for f in range(start + 1, len(_CLUSTER_FILES) + 1):
                yield (_CLUSTER_FILES[f - 1][0].encode(),
                       Node(_FILE_KIND[f], layer=parent.layer, cluster=parent.cluster,
                            ver=parent.ver), DOTS + f)

    # -- attributes -------------------------------------------------------------
    def attr(self, node: Node) -> Attr:
        """Mode, link count, exact size and preferred I/O size of a node.
        Live files (stats.json, disks/<i>/info.json) are rendered to size them."""
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
            return Attr(stat.S_IFDIR | 0o555, nlink, 0, 4096)
        return Attr(stat.S_IFREG | 0o444, 2 if k == KV_NPY else 1, self.size(node),
                    self.kv_blksize if k in KV_KINDS or k == MEDOIDS else 4096)

    def kv_npy_header(self, layer: int, cid: int) -> bytes:
        """The ``.npy`` header of cluster ``cid``'s KV file (cached per size)."""
        n = int(self._li[layer].sizes[cid])
        h = self._hdr_cache.get(n)
        if h is None:
            h = npy_header(self.descr, (n,) + tuple(self.store.entry_shape))
            if len(self._hdr_cache) < 65536:
                self._hdr_cache[n] = h
        return h

    def size(self, node: Node) -> int:
        """File size in bytes of ``node`` (0 for directories)."""
        k = node.kind
        if k == MANIFEST:
            return len(self.manifest_bytes)
        if k in LIVE_KINDS:
            return len(self.render_live(node))
        if k == MEDOIDS:
            h = self._medoid_hdr[node.layer]
            return len(h) + self._num_clusters[node.layer] * (self.entry_bytes // 2)
        c = node.cluster
        if k == KV_BIN:
            return int(self._kv_size[node.layer][c])
        if k == KV_NPY:
            return int(self._npy_size[node.layer][c])
        li = self._li[node.layer]
        if k == TOKENS:
            return tokens_text_size(li.members[li.members_ptr[c]:li.members_ptr[c + 1]])
        if k == CLUSTER_INFO:
            return len(self.render_small(node))
        raise ValueError(f"size of a directory node {node}")

    # -- contents ---------------------------------------------------------------
    def cluster_info(self, layer: int, cid: int) -> dict:
        """``info.json`` of a cluster: ``LayerIndex.cluster_info`` plus the
        clusters that hold replicas of its entries and the sizes of its files."""
        li = self._li[layer]
        info = li.cluster_info(cid)
        toks = li.members[li.members_ptr[cid]:li.members_ptr[cid + 1]]
        others = np.unique(li.copy_cluster[li.token_copies(toks)])
        info["replica_clusters"] = [int(x) for x in others[others != cid]]
        info["files"] = {"kv.bin": int(self._kv_size[layer][cid]),
                         "kv.npy": int(self._npy_size[layer][cid]),
                         "tokens.txt": tokens_text_size(toks)}
        info["entry_shape"] = list(self.store.entry_shape)
        info["dtype"] = self.store.dtype
        info["generation"] = self.generation
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
            li = self._li[node.layer]
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
        """What ``disks/<i>/info.json`` holds: path, size, usage and counters of disk ``i``."""
        st = self._store_stats().engine.disks[i]
        rec = self._disk_recs[i]
        return {"index": i, "path": self.store.disk_paths[i],
                "size": _device_size(self.store.disk_paths[i]),
                "block_size": int(self.store.block_size),
                "used_bytes": rec.end, "capacity": rec.capacity or None,
                "bytes_read": int(st.bytes), "requests": int(st.requests),
                "busy_us": float(st.busy_us)}

    def render_live(self, node: Node) -> bytes:
        """Bytes of a live file, rendered now."""
        if node.kind == DISK_INFO:
            return _json_bytes(self.disk_info(node.disk))
        if node.kind == STATS:
            st = dataclasses.asdict(self._store_stats())
            out = {"store": self.store.path, "generation": self.generation,
                   "engine": st["engine"]["engine"],
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
        live."""
        k = node.kind
        if k == MANIFEST:
            return self.manifest_bytes[off:off + size]
        if k == MEDOIDS:
            h = self._medoid_hdr[node.layer]
            out = h[off:off + size]
            if off + size > len(h):
                flat = self._li[node.layer].medoid_keys.reshape(-1)
                a = max(off - len(h), 0)
                out += flat[a:a + size - len(out)].tobytes()
            return out
        return self.render_small(node)[off:off + size]


def sum_stats(items):
    """Field-by-field sum of dataclass counters (numbers add up, nested
    dataclasses and lists of them recursively, anything else is the first
    item's): the statistics of several engines as one."""
    first = items[0]
    if len(items) == 1:
        return first
    if dataclasses.is_dataclass(first):
        return dataclasses.replace(first, **{
            f.name: sum_stats([getattr(x, f.name) for x in items])
            for f in dataclasses.fields(first)})
    if isinstance(first, (list, tuple)):
        return type(first)(sum_stats(list(col)) for col in zip(*items, strict=False))
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(items)
    return first


def _device_size(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)
