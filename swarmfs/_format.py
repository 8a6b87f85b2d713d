"""On-disk format: disk superblocks, the manifest, and per-layer index files.

A store is a directory plus N disks (regular files or block devices)::

    STORE/manifest.json                 the manifest (JSON, atomically replaced)
    STORE/index/layer-LLL.gGGGGGGGG.safetensors
                                        per-layer index arrays (safetensors)
    STORE/disks/disk-I.img              default location of file-backed disks

Every disk starts with a 4096-byte superblock (little-endian)::

    offset size field
         0    8 magic  b"SWARMFS\\0"
         8    4 format version (u32)
        12    4 superblock size (u32, 4096)
        16   16 store UUID
        32    4 disk index (u32)
        36    4 disk count (u32)
        40    4 store block size in bytes (u32; every extent is aligned to it)
        44    4 reserved (0)
        48    8 data start offset in bytes (u64, 4096)
        56    8 creation time (u64, ns since the epoch)
        64    8 capacity in bytes (u64, 0 = grows with the file)
        72 4016 zero
      4088    8 XXH3-64 of bytes [0, 4088)

The superblock is written once, at creation, and never changes: what lives on
the disk is described by the manifest, which is replaced atomically (temp file,
fsync, rename, directory fsync).  The data region of a disk is append-only;
data that a committed manifest references is never overwritten.
"""

from __future__ import annotations

import json
import os
import struct
import time
import uuid as _uuid

import numpy as np
import xxhash

from . import _errors as E

FORMAT_VERSION = 1
MAGIC = b"SWARMFS\0"
SUPERBLOCK_SIZE = 4096
DATA_START = 4096
MANIFEST = "manifest.json"
INDEX_DIR = "index"

_SB = struct.Struct("<8sII16sIIIIQQQ")
_SB_SUM_OFF = SUPERBLOCK_SIZE - 8

DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype of a store dtype name (bfloat16 via ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    if name not in DTYPES:
        raise E.ShapeError(f"unsupported dtype {name!r}; use one of {sorted(DTYPES)}")
    return np.dtype(name)


def pack_superblock(*, store_uuid: bytes, disk_index: int, disk_count: int,
                    block_size: int, capacity: int = 0,
                    created_ns: int | None = None) -> bytes:
    """The 4096-byte superblock of one disk (see the module docstring)."""
    head = _SB.pack(MAGIC, FORMAT_VERSION, SUPERBLOCK_SIZE, store_uuid, disk_index,
                    disk_count, block_size, 0, DATA_START,
                    created_ns if created_ns is not None else time.time_ns(), capacity)
    body = head + b"\0" * (_SB_SUM_OFF - len(head))
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def unpack_superblock(raw: bytes, *, disk=None, path=None, store=None) -> dict:
    """Parse and check a superblock.

    Raises:
        DiskMismatchError: no swarmfs magic, bad checksum, or unknown version.
    """
    kw = dict(disk=disk, path=path, store=store)
    if len(raw) < SUPERBLOCK_SIZE or raw[:8] != MAGIC:
        raise E.DiskMismatchError("no swarmfs superblock (not a swarmfs disk)", **kw)
    body = raw[:_SB_SUM_OFF]
    (want,) = struct.unpack("<Q", raw[_SB_SUM_OFF:SUPERBLOCK_SIZE])
    if xxhash.xxh3_64_intdigest(body) != want:
        raise E.DiskMismatchError("superblock checksum mismatch (corrupt superblock)", **kw)
    (magic, version, size, sid, idx, count, bs, _r, start, created,
     cap) = _SB.unpack(raw[:_SB.size])
    if version != FORMAT_VERSION:
        raise E.DiskMismatchError(f"disk format version {version} is not supported "
                                  f"(this swarmfs reads version {FORMAT_VERSION})", **kw)
    return dict(uuid=sid, disk_index=idx, disk_count=count, block_size=bs,
                data_start=start, created_ns=created, capacity=cap)


def new_uuid() -> bytes:
    return _uuid.uuid4().bytes


# -- manifest ----------------------------------------------------------------

def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename,
    directory fsync.  A crash leaves either the old or the new file."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(d)


def _manifest_checksum(m: dict) -> str:
    body = {k: v for k, v in m.items() if k != "checksum"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())


def write_manifest(store_dir: str, manifest: dict) -> dict:
    """Atomically replace ``STORE/manifest.json`` (with an XXH3-64 of its
    content in ``"checksum"``, so an edited or corrupt manifest is refused).
    Returns the manifest as written."""
    m = dict(manifest)
    m["checksum"] = _manifest_checksum(m)
    data = json.dumps(m, indent=1, sort_keys=False).encode() + b"\n"
    atomic_write(os.path.join(store_dir, MANIFEST), data)
    # leftovers of writers that crashed before their rename
    for name in os.listdir(store_dir):
        if name.startswith(f".{MANIFEST}.tmp."):
            try:
                pid = int(name.rsplit(".", 1)[1])
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError):
                try:
                    os.unlink(os.path.join(store_dir, name))
                except OSError:
                    pass
            except PermissionError:
                pass
    return m


def read_manifest(store_dir: str) -> dict:
    """Read and sanity-check ``STORE/manifest.json``.

    Raises:
        StoreNotFoundError: no directory or no manifest.
        ManifestError: unreadable JSON or an unsupported format version.
    """
    path = os.path.join(store_dir, MANIFEST)
    if os.path.exists(store_dir) and not os.path.isdir(store_dir):
        raise E.StoreNotFoundError("is a file, not a store directory", store=store_dir)
    if not os.path.isdir(store_dir):
        raise E.StoreNotFoundError("store directory does not exist", store=store_dir)
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read())
    except FileNotFoundError as exc:
        hint = ""
        for sub in sorted(os.listdir(store_dir)):
            if os.path.isfile(os.path.join(store_dir, sub, MANIFEST)):
                hint = f"; did you mean {os.path.join(store_dir, sub)}?"
                break
        raise E.StoreNotFoundError("no manifest.json (not a swarmfs store)" + hint,
                                   store=store_dir) from exc
    except IsADirectoryError as exc:
        raise E.ManifestError("manifest.json is a directory", store=store_dir) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise E.ManifestError(f"manifest.json is not valid JSON: {exc}",
                              store=store_dir) from exc
    if not isinstance(m, dict) or m.get("format") != "swarmfs":
        raise E.ManifestError("manifest.json is not a swarmfs manifest", store=store_dir)
    if m.get("format_version") != FORMAT_VERSION:
        raise E.ManifestError(f"format version {m.get('format_version')} is not "
                              f"supported (this swarmfs reads {FORMAT_VERSION})",
                              store=store_dir)
    if m.get("checksum") != _manifest_checksum(m):
        raise E.ManifestError("manifest.json fails its checksum (edited or corrupt); "
                              "restore it from a backup", store=store_dir)
    check_manifest(m, store_dir)
    return m


def check_manifest(m: dict, store_dir) -> None:
    """Structural checks of a manifest: types, ranges and consistency.

    Raises:
        ManifestError: naming the first field that is wrong.
    """
    def fail(msg, **kw):
        raise E.ManifestError(f"manifest.json: {msg}", store=store_dir, **kw)

    def integer(x, what, lo=0):
        if isinstance(x, bool) or not isinstance(x, int) or x < lo:
            fail(f"{what} must be an integer >= {lo}, got {x!r}")
        return x

    model = m.get("model")
    if not isinstance(model, dict):
        fail("model is missing")
    for k in ("num_layers", "num_kv_heads", "head_dim", "num_query_heads", "entry_bytes"):
        integer(model.get(k), f"model.{k}", 1)
    if model.get("dtype") not in DTYPES:
        fail(f"model.dtype {model.get('dtype')!r} is not one of {sorted(DTYPES)}")
    if model["entry_bytes"] != 2 * model["num_kv_heads"] * model["head_dim"] * \
            DTYPES[model["dtype"]]:
        fail("model.entry_bytes does not match 2 x num_kv_heads x head_dim x itemsize")
    bs = integer(m.get("block_size"), "block_size", 512)
    if bs & (bs - 1) or bs > DATA_START:
        fail(f"block_size {bs} is not a power of two <= {DATA_START}")
    integer(m.get("generation"), "generation")
    integer(m.get("p_global"), "p_global")
    disks = m.get("disks")
    if not isinstance(disks, list) or not 1 <= len(disks) <= 256:
        fail("disks must be a list of 1 to 256 disks")
    for i, d in enumerate(disks):
        if not isinstance(d, dict) or not isinstance(d.get("path"), str) or not d["path"]:
            fail("disk record has no path", disk=i)
        end = integer(d.get("end"), f"disks[{i}].end", DATA_START)
        if end % bs:
            fail(f"disks[{i}].end is not block aligned", disk=i)
        integer(d.get("capacity"), f"disks[{i}].capacity")
    layers = m.get("layers")
    if not isinstance(layers, dict):
        fail("layers must be an object")
    for k, rec in layers.items():
        if not k.isdigit() or not 0 <= int(k) < model["num_layers"]:
            fail(f"layer key {k!r} is not a layer of the model")
        if not isinstance(rec, dict) or not isinstance(rec.get("index"), dict):
            fail("layer record has no index", layer=int(k))
        for f in ("num_tokens", "num_clusters", "num_copies", "local_window"):
            integer(rec.get(f), f"layers[{k}].{f}", 1 if f != "local_window" else 0)
        idx = rec["index"]
        if not isinstance(idx.get("file"), str) or not isinstance(idx.get("xxh3"), str) or \
                "/" in idx["file"]:
            fail("layer index record is malformed", layer=int(k))


# -- per-layer index files ------------------------------------------------------

#: Arrays of one layer's index file, with their dtypes.
INDEX_ARRAYS = {
    "members_ptr": np.int64,    # [C+1]  CSR pointers into members
    "members": np.int32,        # [M]    token position of each copy, cluster order
    "medoid": np.int32,         # [C]    token position of each cluster's medoid
    "start_disk": np.int32,     # [C]    eq. 7 start disk of each cluster
    "extent_off": np.uint64,    # [C, N] byte offset of the cluster's extent per disk
    "extent_xxh": np.uint64,    # [C, N] XXH3-64 of each extent's entry bytes
    "token_xxh": np.uint64,     # [S]    XXH3-64 of each KV entry
    "medoid_keys": np.uint8,    # [C, H*d*itemsize] K of each medoid (raw bytes)
    "hot": np.uint8,            # [C]    1 = hot cluster kept in DRAM (eq. 6)
    "freq": np.float32,         # [C]    activation frequency f_i from the profile
}


def index_name(layer: int, generation: int) -> str:
    return f"layer-{layer:03d}.g{generation:08d}.safetensors"


def save_index(store_dir: str, layer: int, generation: int, arrays: dict) -> dict:
    """Write one layer's index file durably; returns its manifest record
    ``{"file": name, "xxh3": hex, "bytes": n}``."""
    from safetensors.numpy import save

    out = {}
    for k, dt in INDEX_ARRAYS.items():
        a = np.ascontiguousarray(arrays[k], dtype=dt)
        out[k] = a
    data = save(out, metadata={"format": "swarmfs-index", "layer": str(layer),
                               "format_version": str(FORMAT_VERSION)})
    d = os.path.join(store_dir, INDEX_DIR)
    os.makedirs(d, exist_ok=True)
    name = index_name(layer, generation)
    path = os.path.join(d, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)          # no partial index file stays behind
        except OSError:
            pass
        raise
    os.close(fd)
    fsync_dir(d)
    return {"file": name, "xxh3": xxhash.xxh3_64_hexdigest(data), "bytes": len(data)}


def load_index(store_dir: str, layer: int, record: dict) -> dict:
    """Read one layer's index file and check its XXH3-64.

    Raises:
        ManifestError: the file is missing, corrupt, or lacks an array.
    """
    from safetensors.numpy import load

    path = os.path.join(store_dir, INDEX_DIR, record["file"])
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise E.ManifestError(f"index file {record['file']} unreadable: {exc.strerror}",
                              store=store_dir, layer=layer) from exc
    if xxhash.xxh3_64_hexdigest(data) != record["xxh3"]:
        raise E.ManifestError(f"index file {record['file']} fails its checksum",
                              store=store_dir, layer=layer)
    try:
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    except (ValueError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict) or meta.get("layer") != str(layer):
        raise E.ManifestError(f"index file {record['file']} belongs to layer "
                              f"{(meta or {}).get('layer')}, not {layer}",
                              store=store_dir, layer=layer)
    try:
        arrays = load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise E.ManifestError(f"index file {record['file']} is not readable: {exc}",
                              store=store_dir, layer=layer) from exc
    missing = set(INDEX_ARRAYS) - set(arrays)
    if missing:
        raise E.ManifestError(f"index file {record['file']} lacks {sorted(missing)}",
                              store=store_dir, layer=layer)
    ndim = {"extent_off": 2, "extent_xxh": 2, "medoid_keys": 2}
    for k, dt in INDEX_ARRAYS.items():
        a = arrays[k]
        if a.dtype != np.dtype(dt) or a.ndim != ndim.get(k, 1):
            raise E.ManifestError(f"index file {record['file']}: array {k} is "
                                  f"{a.dtype} {a.ndim}-d, expected {np.dtype(dt)} "
                                  f"{ndim.get(k, 1)}-d", store=store_dir, layer=layer)
    return arrays


def remove_stale_indexes(store_dir: str, keep: set) -> None:
    """Delete index files no committed manifest references (best effort)."""
    d = os.path.join(store_dir, INDEX_DIR)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return
    for name in names:
        if name.endswith(".safetensors") and name not in keep:
            try:
                os.unlink(os.path.join(d, name))
            except OSError:
                pass
