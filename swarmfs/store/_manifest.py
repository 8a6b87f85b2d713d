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

**The schema is the records.**  :class:`ModelIdentity`, :class:`DiskRecord`,
:class:`IndexRecord` and :class:`LayerRecord` are msgspec Structs (frozen,
unknown fields forbidden) whose annotations carry each field's type and
range; :meth:`Manifest.load` converts the parsed JSON into them
(``msgspec.convert``, strict: no bool for an int, no float for an int, no
null for a string) and then checks what one field cannot say alone (entry
bytes against the model shape, extents against the block size, free ranges
against the disk's end, a layer's index file against its layer and
generation).  Every failure is a ``ManifestError`` naming ``manifest.json``
and the field (``disks[0].end``, ``layers[3].index.xxh3``).

Every consumer reads attributes (``m.layers[l].num_clusters``,
``m.disks[d].end``, ``m.model.dtype``); nothing reaches into the JSON by
string keys.  The records are immutable: a commit builds a new
:class:`Manifest` with :func:`msgspec.structs.replace`.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, NoReturn, cast

import msgspec
from msgspec import Meta

from .. import _defaults
from .. import _errors as E
from .. import _validate as V
from . import _format as F

__all__ = ["ModelIdentity", "DiskRecord", "IndexRecord", "LayerRecord", "Manifest",
           "read_manifest", "write_manifest"]

_LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,5}")
_U63 = (1 << 63) - 1
_I31 = (1 << 31) - 1
_EMPTY: Mapping = types.MappingProxyType({})

# field types of format version 2 (ranges as the writer produces them)
_Hex16 = Annotated[str, Meta(pattern=r"\A[0-9a-f]{16}\Z")]
_Hex32 = Annotated[str, Meta(pattern=r"\A[0-9a-f]{32}\Z")]
_Dim = Annotated[int, Meta(ge=1, le=1 << 16)]
_Count = Annotated[int, Meta(ge=1, le=_I31)]
_Tokens = Annotated[int, Meta(ge=0, le=_I31)]
_Gen = Annotated[int, Meta(ge=0, le=_U63)]
_Bytes62 = Annotated[int, Meta(ge=0, le=1 << 62)]
if TYPE_CHECKING:      # a Literal of F.DTYPES, which mypy cannot build
    _Dtype = str
else:
    _Dtype = Literal[tuple(sorted(F.DTYPES))]
_Path = Annotated[str, Meta(min_length=1, max_length=4096, pattern=r"\A[^\x00]*\Z")]
_FreeRange = tuple[_Gen, _Gen, _Gen]        # (offset, length, generation freed)


class ModelIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The model a store holds; pinned by every disk's superblock.

    Attributes:
        name: free text, or None.
        num_layers, num_kv_heads, head_dim, num_query_heads: model shape
            (num_query_heads a multiple of num_kv_heads: the GQA group).
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
        entry_bytes: bytes of one KV entry, 2 x num_kv_heads x head_dim x itemsize.
    """
    num_layers: _Dim
    num_kv_heads: _Dim
    head_dim: _Dim
    num_query_heads: _Dim
    dtype: _Dtype
    entry_bytes: Annotated[int, Meta(ge=1, le=1 << 30)]
    name: str | None = None

    #: the fields the superblocks pin (``_format.unpack_superblock``'s model)
    IDENTITY: ClassVar[tuple] = ("num_layers", "num_kv_heads", "head_dim", "num_query_heads",
                                 "dtype", "entry_bytes")

    @classmethod
    def new(cls, *, name, num_layers, num_kv_heads, head_dim, num_query_heads,
            dtype) -> ModelIdentity:
        """The identity of a new store, from ``Store.create``'s arguments
        (``num_query_heads`` None: as many as KV heads).

        Raises:
            InvalidDtypeError: an unknown dtype.
            InvalidIntegerError: a shape outside [1, 65536] or not an integer.
            InvalidTypeError: a name (``model_name``) that is not a string.
            ShapeError: query heads not a multiple of the KV heads, an entry
                over 1 GiB.
        """
        dtype = V.parse_dtype(dtype, "dtype", F.DTYPES)
        shape = {k: V.parse_int(v, k, 1, 1 << 16) for k, v in (
            ("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim))}
        hq = shape["num_kv_heads"] if num_query_heads is None else \
            V.parse_int(num_query_heads, "num_query_heads", 1, 1 << 16)
        if hq % shape["num_kv_heads"]:
            raise E.ShapeError(f"num_query_heads must be a positive multiple of "
                               f"num_kv_heads, got {num_query_heads!r}")
        entry_bytes = 2 * shape["num_kv_heads"] * shape["head_dim"] * F.DTYPES[dtype]
        if entry_bytes > 1 << 30:
            raise E.ShapeError(f"an entry of 2 x {num_kv_heads} x {head_dim} {dtype} is over "
                               "1 GiB")
        if name is not None:
            V.parse_instance(name, "model_name", str)
        return cls(name=name, num_query_heads=hq, dtype=dtype, entry_bytes=entry_bytes,
                   **shape)

    def to_dict(self) -> dict:
        """The record as the manifest's JSON object (key order as written)."""
        return {"name": self.name, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "num_query_heads": self.num_query_heads, "dtype": self.dtype,
                "entry_bytes": self.entry_bytes}


class DiskRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One disk of the store.

    Attributes:
        index: position in the disk list.
        path: the disk's path (relative to the store directory, or absolute).
        end: first unallocated byte (bytes, block aligned, >= DATA_START).
        capacity: bytes the disk holds; 0 = a file that grows.
        free: free ranges ``(offset, length, generation freed)`` (bytes),
            sorted, block aligned, not overlapping (generation 0: reusable).
    """
    index: Annotated[int, Meta(ge=0, le=255)]
    path: _Path
    end: Annotated[int, Meta(ge=F.DATA_START, le=1 << 62)]
    capacity: _Bytes62
    free: Annotated[tuple[_FreeRange, ...], Meta(max_length=1 << 20)] = ()

    def to_dict(self) -> dict:
        """The record as the manifest's JSON object (key order as written)."""
        return {"index": self.index, "path": self.path, "end": self.end,
                "capacity": self.capacity, "free": [list(r) for r in self.free]}


class IndexRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A layer's index file: name, XXH3-64 (16 hex digits) and size (bytes)."""
    file: str
    xxh3: _Hex16
    bytes: Annotated[int, Meta(ge=1, le=F.MAX_INDEX_BYTES)]

    def to_dict(self) -> dict:
        """The record as the manifest's JSON object (key order as written)."""
        return {"file": self.file, "xxh3": self.xxh3, "bytes": self.bytes}


class LayerRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One stored layer.

    Attributes:
        num_tokens, num_clusters, num_copies: S, C and stored copies M.
        replication: M / S rounded to 6 digits, as stored.
        local_window: DRAM local window W in tokens (SWARM §5.2).
        hot_clusters: clusters marked hot (eq. 6).
        index: the layer's index file.
        generation: the commit that wrote the index file.
        representative: what the index's ``medoid_keys`` hold per cluster:
            ``"medoid"`` (SWARM §5.2: the medoid entry's K) or ``"centroid"``
            (the mean K of the cluster's members, kept exact by appends;
            docs/deviations.md).  Written only when not ``"medoid"``.
        extra: the caller's JSON fields (``write_layer(extra=...)``); not a
            key of the JSON record but every key beyond the others.
    """
    num_tokens: _Count
    num_clusters: _Count
    num_copies: _Count
    replication: int | float
    local_window: _Tokens
    hot_clusters: _Tokens
    index: IndexRecord
    generation: Annotated[int, Meta(ge=1, le=_U63)]
    representative: Literal["medoid", "centroid"] = "medoid"
    extra: Mapping = msgspec.field(default_factory=lambda: _EMPTY)

    def to_dict(self) -> dict:
        """The record as the manifest's JSON object (key order as written)."""
        return {"local_window": self.local_window, **copy.deepcopy(dict(self.extra)),
                "num_tokens": self.num_tokens, "num_clusters": self.num_clusters,
                "num_copies": self.num_copies, "replication": self.replication,
                "hot_clusters": self.hot_clusters, "index": self.index.to_dict(),
                "generation": self.generation,
                **({"representative": self.representative}
                   if self.representative != "medoid" else {})}


#: keys of a layer record that swarmfs sets itself (the rest is the
#: caller's ``extra``)
LAYER_RECORD_KEYS = frozenset(LayerRecord.__struct_fields__) - {"extra"}


class _Dram(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    local_window: _Tokens


class _Document(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``manifest.json`` as format version 2 writes it (the layer records are
    converted one by one: their keys are partly the caller's)."""
    format: Literal["swarmfs"]
    format_version: Literal[2]
    uuid: _Hex32
    generation: _Gen
    model: ModelIdentity
    block_size: Annotated[int, Meta(ge=512, le=F.SUPERBLOCK_SIZE)]
    # the writer's placement takes p_global below 2^62 (_placement.start_disks)
    p_global: Annotated[int, Meta(ge=0, le=(1 << 62) - 1)]
    disks: Annotated[tuple[DiskRecord, ...], Meta(min_length=1, max_length=256)]
    layers: dict[str, Any]
    dram: _Dram
    checksum: _Hex16
    created: str | msgspec.UnsetType = msgspec.UNSET


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
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
            local_window: int = _defaults.LOCAL_WINDOW) -> Manifest:
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

    def sealed(self) -> Manifest:
        """This manifest with its checksum computed (the format's rule)."""
        return msgspec.structs.replace(self, checksum=F.manifest_checksum(self.to_dict()))

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
    def load(cls, m: dict, store_dir) -> Manifest:
        """Check a parsed manifest (every field's type and range, and the
        fields' consistency with each other) and build its records.  The
        one validating loader: ``Store.open`` reads through it, and every
        commit passes the manifest it is about to write through it.

        Args:
            m: the parsed JSON (its checksum is checked by
                ``_format.read_manifest`` against the file's JSON).
            store_dir: named in errors.

        Raises:
            ManifestError: naming ``manifest.json`` and the first field that
                is wrong (and the disk or layer it belongs to), or a key format
                version 2 does not have (outside a layer record's caller
                fields).
        """
        F.check_format(m, store_dir)
        doc = _convert(m, _Document, store_dir)
        _check_model(doc.model, store_dir)
        if doc.block_size & (doc.block_size - 1):
            _fail(f"block_size {doc.block_size} is not a power of two", store_dir)
        for i, d in enumerate(doc.disks):
            _check_disk(i, d, doc.block_size, doc.generation, store_dir)
        layers = {}
        for k, rec in doc.layers.items():
            layer = _layer_key(k, doc.model.num_layers, store_dir)
            layers[layer] = _load_layer(k, layer, rec, doc.generation, store_dir)
        return cls(uuid=doc.uuid, generation=doc.generation,
                   created=None if doc.created is msgspec.UNSET else doc.created,
                   model=doc.model, block_size=doc.block_size, p_global=doc.p_global,
                   disks=doc.disks, layers=types.MappingProxyType(layers),
                   local_window=doc.dram.local_window, checksum=doc.checksum)


# -- what the schema cannot say: ManifestError naming manifest.json and the field ----

def _fail(msg: str, store_dir, **where) -> NoReturn:
    raise E.ManifestError(f"manifest.json: {msg}"[:300], store=store_dir, **where)


_AT = re.compile(r"(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>.*)`", re.S)
_DISK = re.compile(r"disks\[(\d+)\]")


def _convert(obj, typ, store_dir, prefix: str = "", **where):
    """``msgspec.convert(obj, typ)`` (strict), its ValidationError as a
    ManifestError naming the field (``prefix`` + msgspec's path)."""
    try:
        return msgspec.convert(obj, typ, strict=True)
    except msgspec.ValidationError as exc:
        at = cast(re.Match, _AT.fullmatch(str(exc)))    # always matches: all optional
        field = (prefix + (at["path"] or "")).lstrip(".")
        disk = _DISK.match(field)
        if disk and "disk" not in where:
            where["disk"] = int(disk.group(1))
        unknown = _UNKNOWN.fullmatch(at["msg"])
        if unknown:
            name = f"{field}.{unknown['key']}" if field else unknown["key"]
            _fail(f"unknown field {name!r}: format version {F.FORMAT_VERSION} has no such "
                  "field", store_dir, **where)
        _fail(f"{field or 'the manifest'}: {at['msg']}", store_dir, **where)


def _check_model(model: ModelIdentity, store_dir) -> None:
    if model.num_query_heads % model.num_kv_heads:
        _fail("model.num_query_heads is not a multiple of num_kv_heads", store_dir)
    if model.entry_bytes != 2 * model.num_kv_heads * model.head_dim * F.DTYPES[model.dtype]:
        _fail("model.entry_bytes does not match 2 x num_kv_heads x head_dim x itemsize",
              store_dir)


def _check_disk(i: int, d: DiskRecord, bs: int, gen: int, store_dir) -> None:
    """A disk record against its position, the block size and the
    manifest's generation: aligned end within the capacity, free ranges
    sorted, aligned, disjoint, inside [DATA_START, end), freed no later
    than now."""
    if d.index != i:
        _fail(f"disks[{i}].index must be {i}", store_dir, disk=i)
    if d.end % bs:
        _fail(f"disks[{i}].end is not block aligned", store_dir, disk=i)
    if d.capacity and d.capacity < d.end:
        _fail(f"disks[{i}].end is beyond its capacity", store_dir, disk=i)
    prev = F.DATA_START
    for j, (off, ln, g) in enumerate(d.free):
        if not F.DATA_START <= off <= d.end or not 1 <= ln <= d.end - off:
            _fail(f"disks[{i}].free[{j}] lies outside the disk's allocated space",
                  store_dir, disk=i)
        if g > gen:
            _fail(f"disks[{i}].free[{j}] was freed after generation {gen}", store_dir, disk=i)
        if off % bs or ln % bs or off < prev:
            _fail(f"disks[{i}].free ranges are unaligned, unsorted or overlap", store_dir,
                  disk=i)
        prev = off + ln


def _layer_key(k: str, num_layers: int, store_dir) -> int:
    if not _LAYER_KEY.fullmatch(k) or not int(k) < num_layers:
        _fail(f"layer key {k!r} is not a layer of the model", store_dir)
    return int(k)


def _load_layer(k: str, layer: int, rec, gen: int, store_dir) -> LayerRecord:
    """A layer record: swarmfs's keys converted and cross-checked, the rest
    kept verbatim as the caller's ``extra``."""
    if not isinstance(rec, dict):
        _fail(f"layers[{k}] must be an object", store_dir, layer=layer)
    own = {key: v for key, v in rec.items() if key in LAYER_RECORD_KEYS}
    r = _convert(own, LayerRecord, store_dir, f"layers[{k}]", layer=layer)
    S, C, M = r.num_tokens, r.num_clusters, r.num_copies
    if r.hot_clusters > C:
        _fail(f"layers[{k}].hot_clusters is more than its {C} clusters", store_dir,
              layer=layer)
    if r.generation > gen:
        _fail(f"layers[{k}].generation is after the manifest's {gen}", store_dir, layer=layer)
    if M < S or M < C:
        _fail(f"layers[{k}] has fewer copies than tokens or clusters", store_dir, layer=layer)
    # "not <=": NaN (which Python's JSON parser accepts) compares false
    if not abs(r.replication - round(M / S, 6)) <= 1e-5:
        _fail(f"layers[{k}].replication does not match num_copies / num_tokens", store_dir,
              layer=layer)
    mm = F.INDEX_NAME_RE.fullmatch(r.index.file)
    if mm is None or int(mm.group(1)) != layer or int(mm.group(2)) != r.generation:
        _fail(f"layers[{k}].index.file is not layer-{layer:03d}.g{r.generation:08d}"
              ".safetensors", store_dir, layer=layer)
    extra = {key: v for key, v in rec.items() if key not in LAYER_RECORD_KEYS}
    return msgspec.structs.replace(r, extra=types.MappingProxyType(extra)) if extra else r


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
    return msgspec.structs.replace(m, checksum=d["checksum"])
