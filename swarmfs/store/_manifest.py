"""The manifest model: ``STORE/manifest.json`` as frozen records, with the
one validating loader (:meth:`Manifest.load`) and the one serialiser
(:meth:`Manifest.to_dict`).

The file's bytes and checksum rule are format version 2 (``_format``): the
checksum is the XXH3-64 of the JSON of every other field (``sort_keys``), so
it does not depend on key order; the serialiser writes the keys in the order
swarmfs has always written them, so a manifest swarmfs writes is
byte-identical to what earlier versions wrote.  Reading the file (bounded,
JSON, format version, checksum) is ``_format.read_manifest``; this module
checks every field's type and range and their consistency with each other,
then builds the records.  The cross-checks against the disks (superblocks,
commit records: ``_disks``) and the index files (``_format``) read these
records.

**Unknown fields are refused, not carried.**  Format version 2 is a closed
schema: the loader refuses a manifest whose top level, ``model``, ``dram``,
a disk record or a layer's ``index`` holds a key it does not know
(``ManifestError`` naming ``manifest.json`` and the key), as it refuses a
format version other than 2.  A swarmfs that adds a field writes a new
format version, so an unknown key is an edit or damage, never a field from a
newer writer; carrying it through a commit would keep a field that nothing
updates (say, a list of extents the writer would then reuse) beside data it
no longer describes.  The one open namespace is a layer record's keys beyond
:data:`LAYER_RECORD_KEYS`: the caller's ``write_layer(extra=...)`` fields,
kept verbatim (:attr:`LayerRecord.extra`) and written back where swarmfs
writes them, after ``local_window``.

Every consumer reads attributes (``m.layers[l].num_clusters``,
``m.disks[d].end``, ``m.model.dtype``); nothing reaches into the JSON by
string keys.  The records are immutable: a commit builds a new
:class:`Manifest` with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import time
import types
from typing import Mapping

import numpy as np

from .. import _defaults
from .. import _errors as E
from . import _format as F

__all__ = ["ModelIdentity", "DiskRecord", "IndexRecord", "LayerRecord", "Manifest",
           "read_manifest", "write_manifest"]

_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,5}")
_U63 = (1 << 63) - 1
_I31 = (1 << 31) - 1

#: keys of a layer record that swarmfs sets itself (the rest is the
#: caller's ``extra``)
LAYER_RECORD_KEYS = frozenset({"num_tokens", "num_clusters", "num_copies", "replication",
                               "hot_clusters", "index", "generation", "local_window"})
#: the keys format version 2 has, per object (``created``, ``model.name`` and a
#: disk's ``free`` may be absent); any other key is refused by the loader
_TOP_KEYS = frozenset({"format", "format_version", "uuid", "generation", "created", "model",
                       "block_size", "p_global", "disks", "layers", "dram", "checksum"})
_MODEL_KEYS = frozenset({"name", "num_layers", "num_kv_heads", "head_dim", "num_query_heads",
                         "dtype", "entry_bytes"})
_DISK_KEYS = frozenset({"index", "path", "end", "capacity", "free"})
_INDEX_KEYS = frozenset({"file", "xxh3", "bytes"})
_DRAM_KEYS = frozenset({"local_window"})
_EMPTY: Mapping = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """The model a store holds; pinned by every disk's superblock.

    Attributes:
        name: free text, or None.
        num_layers, num_kv_heads, head_dim, num_query_heads: model shape
            (num_query_heads a multiple of num_kv_heads: the GQA group).
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
        entry_bytes: bytes of one KV entry, 2 x num_kv_heads x head_dim x itemsize.
    """
    name: str | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_query_heads: int
    dtype: str
    entry_bytes: int

    #: the fields the superblocks pin (``_format.unpack_superblock``'s model)
    IDENTITY = ("num_layers", "num_kv_heads", "head_dim", "num_query_heads", "dtype",
                "entry_bytes")

    @classmethod
    def new(cls, *, name, num_layers, num_kv_heads, head_dim, num_query_heads,
            dtype) -> "ModelIdentity":
        """The identity of a new store, from ``Store.create``'s arguments
        (``num_query_heads`` None: as many as KV heads).

        Raises:
            ShapeError: an unknown dtype, a shape out of range, query heads
                not a multiple of the KV heads, an entry over 1 GiB.
            InvalidArgumentError: a name (``model_name``) that is not a string.
        """
        if not isinstance(dtype, str) or dtype not in F.DTYPES:
            raise E.ShapeError(f"unsupported dtype {dtype!r}; use one of {sorted(F.DTYPES)}")
        for what, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or \
                    not 0 < v <= 1 << 16:
                raise E.ShapeError(f"{what} must be a positive integer <= 65536, got {v!r}")
        if num_query_heads is not None and (
                isinstance(num_query_heads, bool) or
                not isinstance(num_query_heads, (int, np.integer)) or
                not 0 < num_query_heads <= 1 << 16 or num_query_heads % num_kv_heads):
            raise E.ShapeError(f"num_query_heads must be a positive multiple of "
                               f"num_kv_heads, got {num_query_heads!r}")
        if 2 * int(num_kv_heads) * int(head_dim) * F.DTYPES[dtype] > 1 << 30:
            raise E.ShapeError(f"an entry of 2 x {num_kv_heads} x {head_dim} {dtype} is over "
                               "1 GiB")
        if name is not None and not isinstance(name, str):
            raise E.InvalidArgumentError(f"model_name must be a string, got {name!r}")
        itemsize = F.DTYPES[dtype]
        return cls(name=name, num_layers=int(num_layers), num_kv_heads=int(num_kv_heads),
                   head_dim=int(head_dim),
                   num_query_heads=int(num_query_heads or num_kv_heads), dtype=dtype,
                   entry_bytes=2 * int(num_kv_heads) * int(head_dim) * itemsize)

    def to_dict(self) -> dict:
        """The record as the manifest's JSON object (key order as written)."""
        return {"name": self.name, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "num_query_heads": self.num_query_heads, "dtype": self.dtype,
                "entry_bytes": self.entry_bytes}


@dataclasses.dataclass(frozen=True)
class DiskRecord:
    """One disk of the store.

    Attributes:
        index: position in the disk list.
        path: the disk's path (relative to the store directory, or absolute).
        end: first unallocated byte (bytes, block aligned, >= DATA_START).
        capacity: bytes the disk holds; 0 = a file that grows.
        free: free ranges ``(offset, length, generation freed)`` (bytes),
            sorted, block aligned, not overlapping (generation 0: reusable).
    """
    index: int
    path: str
    end: int
    capacity: int
    free: tuple = ()

    def to_dict(self) -> dict:
        """The record as the manifest's JSON object (key order as written)."""
        return {"index": self.index, "path": self.path, "end": self.end,
                "capacity": self.capacity, "free": [list(r) for r in self.free]}


@dataclasses.dataclass(frozen=True)
class IndexRecord:
    """A layer's index file: name, XXH3-64 (16 hex digits) and size (bytes)."""
    file: str
    xxh3: str
    bytes: int

    def to_dict(self) -> dict:
        """The record as the manifest's JSON object (key order as written)."""
        return {"file": self.file, "xxh3": self.xxh3, "bytes": self.bytes}


@dataclasses.dataclass(frozen=True)
class LayerRecord:
    """One stored layer.

    Attributes:
        num_tokens, num_clusters, num_copies: S, C and stored copies M.
        replication: M / S rounded to 6 digits, as stored.
        local_window: DRAM local window W in tokens (SWARM §5.2).
        hot_clusters: clusters marked hot (eq. 6).
        index: the layer's index file.
        generation: the commit that wrote the index file.
        extra: the caller's JSON fields (``write_layer(extra=...)``).
    """
    num_tokens: int
    num_clusters: int
    num_copies: int
    replication: float
    local_window: int
    hot_clusters: int
    index: IndexRecord
    generation: int
    extra: Mapping = dataclasses.field(default_factory=lambda: _EMPTY)

    def to_dict(self) -> dict:
        """The record as the manifest's JSON object (key order as written)."""
        return {"local_window": self.local_window, **copy.deepcopy(dict(self.extra)),
                "num_tokens": self.num_tokens, "num_clusters": self.num_clusters,
                "num_copies": self.num_copies, "replication": self.replication,
                "hot_clusters": self.hot_clusters, "index": self.index.to_dict(),
                "generation": self.generation}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The committed state of a store (format version 2).

    Attributes:
        uuid: store UUID, 32 hex digits.
        generation: commit counter (0 = just created).
        created: creation time (ISO 8601 UTC text), as written; None when
            the file has none (a string if present, so null is refused
            rather than dropped on the way back).
        model: the :class:`ModelIdentity`.
        block_size: extent alignment (bytes, a power of two in [512, 4096]).
        p_global: eq. 7 global placement pointer.
        disks: a :class:`DiskRecord` per disk, in disk order.
        layers: {layer: :class:`LayerRecord`} in the file's order (read-only).
        local_window: the store's default DRAM local window W (``dram``).
        checksum: XXH3-64 of the rest, 16 hex digits ("" before sealing).
    """
    uuid: str
    generation: int
    created: str | None
    model: ModelIdentity
    block_size: int
    p_global: int
    disks: tuple
    layers: Mapping
    local_window: int
    checksum: str = ""

    @classmethod
    def new(cls, store_dir, *, uuid: str, model: ModelIdentity, block_size: int,
            disk_paths: list, capacities: list,
            local_window: int = _defaults.LOCAL_WINDOW) -> "Manifest":
        """The generation-0 manifest of a new store (no layers, empty disks),
        sealed and passed through the loader (never what open() would refuse).
        ``disk_paths`` as recorded (relative to the store where inside it)."""
        m = cls(uuid=uuid, generation=0,
                created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                model=model, block_size=block_size, p_global=0,
                disks=tuple(DiskRecord(index=i, path=p, end=F.DATA_START,
                                       capacity=capacities[i])
                            for i, p in enumerate(disk_paths)),
                layers=types.MappingProxyType({}), local_window=local_window)
        return cls.load(m.sealed().to_dict(), store_dir)

    # -- serialiser ------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON form (fresh objects), keys in the order swarmfs writes."""
        d = {"format": "swarmfs", "format_version": F.FORMAT_VERSION, "uuid": self.uuid,
             "generation": self.generation}
        if self.created is not None:
            d["created"] = self.created
        d.update({"model": self.model.to_dict(), "block_size": self.block_size,
                  "p_global": self.p_global, "disks": [r.to_dict() for r in self.disks],
                  "layers": {str(k): r.to_dict() for k, r in self.layers.items()},
                  "dram": {"local_window": self.local_window}})
        if self.checksum:
            d["checksum"] = self.checksum
        return d

    def to_json(self) -> bytes:
        """The file's bytes, as ``write_manifest`` writes them."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=False).encode() + b"\n"

    def sealed(self) -> "Manifest":
        """This manifest with its checksum computed (the format's rule)."""
        return dataclasses.replace(self, checksum=F.manifest_checksum(self.to_dict()))

    @property
    def checksum_u64(self) -> int:
        """The checksum as an integer (what the commit records hold)."""
        return int(self.checksum, 16)

    def disk_path(self, store_dir: str, d: int) -> str:
        """Absolute path of disk ``d`` (relative paths are under the store)."""
        p = self.disks[d].path
        return p if os.path.isabs(p) else os.path.join(store_dir, p)

    # -- the validating loader -----------------------------------------------------
    @classmethod
    def load(cls, m: dict, store_dir) -> "Manifest":
        """Check a parsed manifest (every field's type and range, and the
        fields' consistency with each other) and build its records.  The
        one validating loader: ``Store.open`` reads through it, and every
        commit passes the manifest it is about to write through it.

        Args:
            m: the parsed JSON (its checksum is checked by
                ``_format.read_manifest`` against the file's JSON).
            store_dir: named in errors.

        Raises:
            ManifestError: naming the first field that is wrong (and the
                disk or layer it belongs to), or a key format version 2 does
                not have (outside a layer record's caller fields).
        """
        _check(m, store_dir)
        model = m["model"]
        ident = ModelIdentity(**{k: model[k] for k in ModelIdentity.IDENTITY},
                              name=model.get("name"))
        disks = tuple(DiskRecord(index=d["index"], path=d["path"], end=d["end"],
                                 capacity=d["capacity"],
                                 free=tuple(tuple(r) for r in d.get("free", [])))
                      for d in m["disks"])
        layers = {}
        for k, rec in m["layers"].items():
            idx = rec["index"]
            layers[int(k)] = LayerRecord(
                num_tokens=rec["num_tokens"], num_clusters=rec["num_clusters"],
                num_copies=rec["num_copies"], replication=rec["replication"],
                local_window=rec["local_window"], hot_clusters=rec["hot_clusters"],
                index=IndexRecord(file=idx["file"], xxh3=idx["xxh3"], bytes=idx["bytes"]),
                generation=rec["generation"],
                extra=_frozen_extra(rec, LAYER_RECORD_KEYS))
        return cls(uuid=m["uuid"], generation=m["generation"], created=m.get("created"),
                   model=ident, block_size=m["block_size"], p_global=m["p_global"],
                   disks=disks, layers=types.MappingProxyType(layers),
                   local_window=m["dram"]["local_window"], checksum=m["checksum"])


def _frozen_extra(d: dict, known) -> Mapping:
    extra = {k: v for k, v in d.items() if k not in known}
    return types.MappingProxyType(extra) if extra else _EMPTY


def _check(m: dict, store_dir) -> None:
    """The schema checks of :meth:`Manifest.load` (on the parsed JSON)."""
    def fail(msg, **kw):
        raise E.ManifestError(f"manifest.json: {msg}", store=store_dir, **kw)

    def integer(x, what, lo=0, hi=_U63, **kw):
        if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
            fail(f"{what} must be an integer in [{lo}, {hi}], got {x!r}"[:300], **kw)
        return x

    def known(d: dict, keys, where: str, **kw):
        for k in d:
            if k not in keys:
                fail(f"unknown field {where + k!r}: format version {F.FORMAT_VERSION} has "
                     f"no such field"[:300], **kw)

    F.check_format(m, store_dir)
    known(m, _TOP_KEYS, "")
    if not isinstance(m.get("uuid"), str) or not _HEX32.fullmatch(m["uuid"]):
        fail("uuid must be 32 hex digits")
    if not isinstance(m.get("checksum"), str) or not _HEX16.fullmatch(m["checksum"]):
        fail("checksum must be 16 hex digits")
    if "created" in m and not isinstance(m["created"], str):
        fail("created must be a string (ISO 8601 time)")
    model = m.get("model")
    if not isinstance(model, dict):
        fail("model is missing")
    known(model, _MODEL_KEYS, "model.")
    for k in ("num_layers", "num_kv_heads", "head_dim", "num_query_heads"):
        integer(model.get(k), f"model.{k}", 1, 1 << 16)
    integer(model.get("entry_bytes"), "model.entry_bytes", 1, 1 << 30)
    if not isinstance(model.get("dtype"), str) or model["dtype"] not in F.DTYPES:
        fail(f"model.dtype {model.get('dtype')!r} is not one of {sorted(F.DTYPES)}"[:300])
    if model.get("name") is not None and not isinstance(model["name"], str):
        fail("model.name must be a string or null")
    if model["num_query_heads"] % model["num_kv_heads"]:
        fail("model.num_query_heads is not a multiple of num_kv_heads")
    if model["entry_bytes"] != 2 * model["num_kv_heads"] * model["head_dim"] * \
            F.DTYPES[model["dtype"]]:
        fail("model.entry_bytes does not match 2 x num_kv_heads x head_dim x itemsize")
    bs = integer(m.get("block_size"), "block_size", 512, F.SUPERBLOCK_SIZE)
    if bs & (bs - 1):
        fail(f"block_size {bs} is not a power of two")
    gen = integer(m.get("generation"), "generation")
    # the writer's placement takes p_global below 2^62 (_placement.start_disks)
    integer(m.get("p_global"), "p_global", 0, (1 << 62) - 1)
    dram = m.get("dram")
    if not isinstance(dram, dict):
        fail("dram must be an object")
    known(dram, _DRAM_KEYS, "dram.")
    integer(dram.get("local_window"), "dram.local_window", 0, _I31)
    disks = m.get("disks")
    if not isinstance(disks, list) or not 1 <= len(disks) <= 256:
        fail("disks must be a list of 1 to 256 disks")
    for i, d in enumerate(disks):
        if not isinstance(d, dict) or not isinstance(d.get("path"), str) or not d["path"] \
                or "\0" in d["path"] or len(d["path"]) > 4096:
            fail("disk record has no valid path", disk=i)
        known(d, _DISK_KEYS, f"disks[{i}].", disk=i)
        if d.get("index") != i or isinstance(d.get("index"), bool):
            fail(f"disks[{i}].index must be {i}", disk=i)
        end = integer(d.get("end"), f"disks[{i}].end", F.DATA_START, 1 << 62, disk=i)
        if end % bs:
            fail(f"disks[{i}].end is not block aligned", disk=i)
        cap = integer(d.get("capacity"), f"disks[{i}].capacity", 0, 1 << 62, disk=i)
        if cap and cap < end:
            fail(f"disks[{i}].end is beyond its capacity", disk=i)
        free = d.get("free", [])
        if not isinstance(free, list) or len(free) > 1 << 20:
            fail(f"disks[{i}].free must be a list", disk=i)
        prev = F.DATA_START
        for r in free:
            if not isinstance(r, list) or len(r) != 3:
                fail(f"disks[{i}].free holds a malformed range", disk=i)
            off = integer(r[0], f"disks[{i}].free offset", F.DATA_START, end, disk=i)
            ln = integer(r[1], f"disks[{i}].free length", 1, end - off, disk=i)
            integer(r[2], f"disks[{i}].free generation", 0, gen, disk=i)
            if off % bs or ln % bs or off < prev:
                fail(f"disks[{i}].free ranges are unaligned, unsorted or overlap",
                     disk=i)
            prev = off + ln
    layers = m.get("layers")
    if not isinstance(layers, dict):
        fail("layers must be an object")
    for k, rec in layers.items():
        if not _LAYER_KEY.fullmatch(k) or not int(k) < model["num_layers"]:
            fail(f"layer key {k!r} is not a layer of the model"[:300])
        layer = int(k)
        if not isinstance(rec, dict) or not isinstance(rec.get("index"), dict):
            fail("layer record has no index", layer=layer)
        S = integer(rec.get("num_tokens"), f"layers[{k}].num_tokens", 1, _I31, layer=layer)
        C = integer(rec.get("num_clusters"), f"layers[{k}].num_clusters", 1, _I31,
                    layer=layer)
        M = integer(rec.get("num_copies"), f"layers[{k}].num_copies", 1, _I31, layer=layer)
        integer(rec.get("local_window"), f"layers[{k}].local_window", 0, _I31, layer=layer)
        integer(rec.get("hot_clusters"), f"layers[{k}].hot_clusters", 0, C, layer=layer)
        lgen = integer(rec.get("generation"), f"layers[{k}].generation", 1, gen, layer=layer)
        if M < S or M < C:
            fail(f"layers[{k}] has fewer copies than tokens or clusters", layer=layer)
        r = rec.get("replication")
        # "not <=": NaN (which Python's JSON parser accepts) compares false
        if isinstance(r, bool) or not isinstance(r, (int, float)) or \
                not abs(r - round(M / S, 6)) <= 1e-5:
            fail(f"layers[{k}].replication does not match num_copies / num_tokens",
                 layer=layer)
        idx = rec["index"]
        known(idx, _INDEX_KEYS, f"layers[{k}].index.", layer=layer)
        name = idx.get("file")
        mm = F.INDEX_NAME_RE.fullmatch(name) if isinstance(name, str) else None
        if mm is None or int(mm.group(1)) != layer or int(mm.group(2)) != lgen:
            fail(f"layers[{k}].index.file is not layer-{layer:03d}.g{lgen:08d}.safetensors",
                 layer=layer)
        if not isinstance(idx.get("xxh3"), str) or not _HEX16.fullmatch(idx["xxh3"]):
            fail(f"layers[{k}].index.xxh3 must be 16 hex digits", layer=layer)
        integer(idx.get("bytes"), f"layers[{k}].index.bytes", 1, F.MAX_INDEX_BYTES,
                layer=layer)


def read_manifest(store_dir) -> Manifest:
    """Read, check and load ``STORE/manifest.json``: the bounded read, JSON,
    format version and checksum (``_format.read_manifest``), then the schema
    (:meth:`Manifest.load`).

    Raises:
        StoreNotFoundError: no directory or no manifest.
        ManifestError: unreadable, not JSON, an unsupported format version,
            a failed checksum, or a field of the wrong type or range.
        IOFailedError: the kernel failed the read.
    """
    store_dir = os.fspath(store_dir)
    return Manifest.load(F.read_manifest(store_dir), store_dir)


def write_manifest(store_dir: str, m: Manifest) -> Manifest:
    """Atomically replace ``STORE/manifest.json`` with ``m`` (sealed with its
    checksum); returns the manifest as written."""
    d = F.write_manifest(store_dir, m.to_dict())
    return dataclasses.replace(m, checksum=d["checksum"])
