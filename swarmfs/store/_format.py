"""On-disk format: disk superblocks, commit records, the manifest file (its
bytes, JSON and checksum; its fields are the model in ``_manifest``), and
per-layer index files.

A store is a directory plus N disks (regular files or block devices)::

    STORE/manifest.json                 the manifest (JSON, atomically replaced)
    STORE/index/layer-LLL.gGGGGGGGG.safetensors
                                        per-layer index arrays (safetensors)
    STORE/disks/disk-I.img              default location of file-backed disks

Every disk (format version 2) starts with a 4096-byte superblock, then two
4096-byte commit-record slots, then data (``DATA_START`` = 12288)::

    superblock (little-endian), written once at creation
    offset size field
         0    8 magic  b"SWARMFS\0"
         8    4 format version (u32, 2)
        12    4 superblock size (u32, 4096)
        16   16 store UUID
        32    4 disk index (u32)
        36    4 disk count (u32)
        40    4 store block size in bytes (u32; every extent is aligned to it)
        44    4 dtype code (u32: 1 float16, 2 bfloat16, 3 float32)
        48    8 data start offset in bytes (u64, 12288)
        56    8 creation time (u64, ns since the epoch)
        64    8 capacity in bytes (u64, 0 = grows with the file)
        72    4 num_layers (u32)
        76    4 num_kv_heads (u32)
        80    4 head_dim (u32)
        84    4 num_query_heads (u32)
        88    8 entry bytes (u64)
        96 3992 zero
      4088    8 XXH3-64 of bytes [0, 4088)

    commit record, slot (generation mod 2) at 4096 + 4096 x slot
         0    8 magic  b"SWARMCMT"
         8    4 format version (u32, 2)
        12    4 state (u32: 1 prepared, 2 committed)
        16   16 store UUID
        32    4 disk index (u32)
        36    4 zero
        40    8 generation (u64)
        48    8 manifest checksum (u64, the manifest's XXH3-64)
        56    8 disk end: first unallocated byte of this disk (u64)
        64 4024 zero
      4088    8 XXH3-64 of bytes [0, 4088)

The superblock never changes: it pins the store's identity (UUID, disk
index, model shape, dtype, entry size), so a manifest edit cannot make the
store reinterpret its bytes.  Each commit writes a *prepared* record of the
new generation to every disk (fdatasync), renames the new manifest into
place, then marks the records *committed*.  At open, the manifest's
generation and checksum must be on every disk, and no disk may hold a
committed record newer than the manifest: a rolled-back manifest, an edited
manifest with a recomputed checksum, and a disk from another generation are
refused.  The data region of a disk is never overwritten while a committed
manifest references it; space freed by a commit is reused two commits later
(see ``free`` in the manifest).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import json
import os
import re
import stat
import struct
import time
import uuid as _uuid

import numpy as np
import xxhash

from .. import _errors as E

__all__ = ["FORMAT_VERSION", "MAGIC", "COMMIT_MAGIC", "SUPERBLOCK_SIZE", "COMMIT_SIZE",
           "COMMIT_OFF", "DATA_START", "HEADER_BYTES", "MANIFEST", "INDEX_DIR",
           "MAX_MANIFEST_BYTES", "MAX_INDEX_BYTES", "MAX_JSON_DEPTH", "DTYPES", "DTYPE_CODES",
           "numpy_dtype", "to_torch", "pack_superblock", "unpack_superblock", "pack_commit",
           "unpack_commit", "new_uuid", "fsync_dir", "atomic_write", "read_bounded",
           "json_depth", "parse_json", "manifest_checksum", "seal_manifest", "write_manifest",
           "write_sealed_manifest", "check_format", "read_manifest", "INDEX_NAME_RE",
           "INDEX_ARRAYS", "index_name", "INDEX_META", "save_index", "check_index_header",
           "load_index", "check_orphan_indexes", "remove_uncommitted_indexes",
           "remove_stale_indexes"]

FORMAT_VERSION = 2
MAGIC = b"SWARMFS\0"
COMMIT_MAGIC = b"SWARMCMT"
SUPERBLOCK_SIZE = 4096
COMMIT_SIZE = 4096
COMMIT_OFF = SUPERBLOCK_SIZE          # slot s at COMMIT_OFF + s * COMMIT_SIZE
DATA_START = SUPERBLOCK_SIZE + 2 * COMMIT_SIZE
HEADER_BYTES = DATA_START             # superblock + both commit slots
MANIFEST = "manifest.json"
INDEX_DIR = "index"
MAX_MANIFEST_BYTES = 16 << 20         # metadata reads are bounded
MAX_INDEX_BYTES = 1 << 34
MAX_JSON_DEPTH = 32
PREPARED, COMMITTED = 1, 2

_SB = struct.Struct("<8sII16sIIIIQQQIIIIQ")
_SB_SUM_OFF = SUPERBLOCK_SIZE - 8
_CR = struct.Struct("<8sII16sIIQQQ")
_CR_SUM_OFF = COMMIT_SIZE - 8

DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
DTYPE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3}
_OLD_VERSION_HINT = ("written by an older swarmfs (format 1, no generation records); "
                     "rebuild it with this version (`swarmfs build`, or "
                     "Store.create + write_layer)")


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype of a store dtype name (bfloat16 via ml_dtypes).

    Raises:
        ShapeError: an unknown dtype name.
    """
    if not isinstance(name, str) or name not in DTYPES:
        raise E.ShapeError(f"unsupported dtype {name!r}; use one of {sorted(DTYPES)}")
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def pack_superblock(*, store_uuid: bytes, disk_index: int, disk_count: int,
                    block_size: int, model: dict, capacity: int = 0,
                    created_ns: int | None = None) -> bytes:
    """The 4096-byte superblock of one disk (see the module docstring);
    ``model`` is the manifest's model record (identity fields)."""
    head = _SB.pack(MAGIC, FORMAT_VERSION, SUPERBLOCK_SIZE, store_uuid, disk_index,
                    disk_count, block_size, DTYPE_CODES[model["dtype"]], DATA_START,
                    created_ns if created_ns is not None else time.time_ns(), capacity,
                    model["num_layers"], model["num_kv_heads"], model["head_dim"],
                    model["num_query_heads"], model["entry_bytes"])
    body = head + b"\0" * (_SB_SUM_OFF - len(head))
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def unpack_superblock(raw: bytes, *, disk=None, path=None, store=None) -> dict:
    """Parse and check a superblock.

    Raises:
        DiskMismatchError: no swarmfs magic, bad checksum, an unknown or old
            version, or fields out of range.
    """
    kw = dict(disk=disk, path=path, store=store)
    if len(raw) < SUPERBLOCK_SIZE or raw[:8] != MAGIC:
        raise E.DiskMismatchError("no swarmfs superblock (not a swarmfs disk)", **kw)
    body = raw[:_SB_SUM_OFF]
    (want,) = struct.unpack("<Q", raw[_SB_SUM_OFF:SUPERBLOCK_SIZE])
    if xxhash.xxh3_64_intdigest(body) != want:
        raise E.DiskMismatchError("superblock checksum mismatch (corrupt superblock)", **kw)
    (magic, version, size, sid, idx, count, bs, dcode, start, created, cap, nl, hkv, hd,
     hq, eb) = _SB.unpack(raw[:_SB.size])
    if version == 1:
        raise E.DiskMismatchError("disk " + _OLD_VERSION_HINT, **kw)
    if version != FORMAT_VERSION:
        raise E.DiskMismatchError(f"disk format version {version} is not supported "
                                  f"(this swarmfs reads version {FORMAT_VERSION})", **kw)
    dtype = {v: k for k, v in DTYPE_CODES.items()}.get(dcode)
    if size != SUPERBLOCK_SIZE or start != DATA_START or dtype is None or \
            not (512 <= bs <= DATA_START and bs & (bs - 1) == 0) or not 1 <= count <= 256 \
            or idx >= count or eb != 2 * hkv * hd * DTYPES[dtype] or 0 in (nl, hkv, hd, hq):
        raise E.DiskMismatchError("superblock fields are out of range (corrupt "
                                  "superblock)", **kw)
    return dict(uuid=sid, disk_index=idx, disk_count=count, block_size=bs,
                data_start=start, created_ns=created, capacity=cap,
                model=dict(num_layers=nl, num_kv_heads=hkv, head_dim=hd,
                           num_query_heads=hq, dtype=dtype, entry_bytes=eb))


def pack_commit(*, store_uuid: bytes, disk_index: int, generation: int,
                manifest_sum: int, disk_end: int, state: int) -> bytes:
    """One 4096-byte commit record (see the module docstring)."""
    head = _CR.pack(COMMIT_MAGIC, FORMAT_VERSION, state, store_uuid, disk_index, 0,
                    generation, manifest_sum, disk_end)
    body = head + b"\0" * (_CR_SUM_OFF - len(head))
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def unpack_commit(raw: bytes) -> dict | None:
    """Parse one commit-record slot; None when it is empty, torn or corrupt."""
    if len(raw) < COMMIT_SIZE or raw[:8] != COMMIT_MAGIC:
        return None
    body = raw[:_CR_SUM_OFF]
    (want,) = struct.unpack("<Q", raw[_CR_SUM_OFF:COMMIT_SIZE])
    if xxhash.xxh3_64_intdigest(body) != want:
        return None
    (_m, version, state, sid, idx, _z, gen, msum, end) = _CR.unpack(raw[:_CR.size])
    if version != FORMAT_VERSION or state not in (PREPARED, COMMITTED):
        return None
    return dict(state=state, uuid=sid, disk_index=idx, generation=gen,
                manifest_sum=msum, disk_end=end)


def new_uuid() -> bytes:
    """A new store UUID (16 random bytes, UUID4)."""
    return _uuid.uuid4().bytes


# -- manifest ----------------------------------------------------------------

def fsync_dir(path: str) -> None:
    """fsync a directory, so that a rename or a new entry in it is durable.

    Raises:
        OSError: as ``os.open`` / ``os.fsync`` (callers map it to a SwarmError).
    """
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
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(d)


def read_bounded(path: str, *, cap: int, what: str, store=None, layer=None,
                 missing=None) -> bytes:
    """The bytes of a regular metadata file, read with a size cap.

    Opened with ``O_NONBLOCK`` and checked with ``fstat`` before reading, so
    a FIFO, a device or a directory never blocks or streams forever.

    Raises:
        StoreNotFoundError: (or ``missing``) the file does not exist.
        ManifestError: not a regular file, larger than ``cap``, a symlink
            loop or no permission.
        IOFailedError: the kernel failed the read (EIO ...).
    """
    kw = dict(store=store, layer=layer, path=path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError as exc:
        raise (missing or E.StoreNotFoundError(f"{what} does not exist", **kw)) from exc
    except OSError as exc:
        raise _os_error(exc, what, kw) from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise E.ManifestError(f"{what} is a directory", **kw)
        if not stat.S_ISREG(st.st_mode):
            raise E.ManifestError(f"{what} is not a regular file (a FIFO, socket or "
                                  "device)", **kw)
        if st.st_size > cap:
            raise E.ManifestError(f"{what} is {st.st_size} bytes, over the {cap}-byte "
                                  "limit (corrupt)", **kw)
        chunks, total = [], 0
        while True:
            b = os.read(fd, min(cap + 1 - total, 1 << 24))
            if not b:
                break
            chunks.append(b)
            total += len(b)
            if total > cap:
                raise E.ManifestError(f"{what} grows past the {cap}-byte limit", **kw)
        return b"".join(chunks)
    except OSError as exc:
        raise _os_error(exc, what, kw) from exc
    finally:
        os.close(fd)


def _os_error(exc: OSError, what: str, kw: dict) -> E.SwarmError:
    if exc.errno == _errno.ELOOP:
        return E.ManifestError(f"{what} is a symlink loop", **kw)
    if exc.errno in (_errno.EACCES, _errno.EPERM):
        return E.ManifestError(f"{what} cannot be read: permission denied", **kw)
    if exc.errno in (_errno.ENOTDIR, _errno.ENAMETOOLONG):
        return E.ManifestError(f"{what} cannot be opened: {exc.strerror}", **kw)
    return E.IOFailedError(f"{what} cannot be read: {exc.strerror}", errno=exc.errno,
                           **kw)


def json_depth(x, limit: int | None = None) -> int:
    """Nesting depth of a JSON-like value (dicts, lists, tuples; iterative:
    no recursion).  With ``limit``, stops at the first container deeper than
    it and returns that depth, so a value that contains itself ends too."""
    depth, stack = 0, [(x, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            depth = max(depth, d)
            if limit is not None and d > limit:
                return d
            stack.extend((w, d + 1) for w in (v.values() if isinstance(v, dict) else v))
    return depth


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def parse_json(data: bytes, what: str, **kw):
    """``json.loads`` that never raises anything but ManifestError (bad
    UTF-8, bad JSON, a key twice in one object, nesting deeper than
    ``MAX_JSON_DEPTH``).  swarmfs never writes a key twice; a parser keeps
    one of them (Python's the last), so such a file would read as whichever
    copy the reader happens to keep: it is refused."""
    try:
        v = json.loads(data, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise E.ManifestError(f"{what} holds the key {exc.args[0]!r} twice in one object "
                              "(edited or corrupt: which one counts is ambiguous)"[:300],
                              **kw) from None
    except RecursionError:
        raise E.ManifestError(f"{what} is nested too deeply (corrupt)", **kw) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise E.ManifestError(f"{what} is not valid JSON: {exc}", **kw) from None
    if json_depth(v, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise E.ManifestError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels "
                              "(corrupt)", **kw)
    return v


def manifest_checksum(m: dict) -> str:
    """The manifest's checksum rule: XXH3-64 (hex) of the JSON of every
    other field, keys sorted (so key order does not matter)."""
    body = {k: v for k, v in m.items() if k != "checksum"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())


def seal_manifest(manifest: dict) -> dict:
    """A copy of ``manifest`` with its ``checksum`` (XXH3-64 of the rest)."""
    m = dict(manifest)
    m.pop("checksum", None)
    m["checksum"] = manifest_checksum(m)
    return m


def write_manifest(store_dir: str, manifest: dict) -> dict:
    """Atomically replace ``STORE/manifest.json`` (with an XXH3-64 of its
    content in ``"checksum"``, so an edited or corrupt manifest is refused).
    Returns the manifest as written."""
    m = seal_manifest(manifest)
    write_sealed_manifest(store_dir, m)
    return m


def write_sealed_manifest(store_dir: str, m: dict) -> None:
    """Atomically replace ``STORE/manifest.json`` with ``m`` as it is (its
    ``checksum`` already computed: :func:`seal_manifest`)."""
    data = json.dumps(m, indent=1, sort_keys=False).encode() + b"\n"
    atomic_write(os.path.join(store_dir, MANIFEST), data)
    # leftovers of writers that crashed before their rename
    for name in os.listdir(store_dir):
        if name.startswith(f".{MANIFEST}.tmp."):
            try:
                pid = int(name.rsplit(".", 1)[1])
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(store_dir, name))
            except PermissionError:
                pass


def check_format(m, store_dir) -> None:
    """A parsed manifest is a swarmfs manifest of this format version.

    Raises:
        ManifestError: not a JSON object of format "swarmfs", format 1 (with
            the request to rebuild) or another version.
    """
    if not isinstance(m, dict) or m.get("format") != "swarmfs":
        raise E.ManifestError("manifest.json is not a swarmfs manifest", store=store_dir)
    version = m.get("format_version")
    if type(version) is int and version == 1:       # not True, which equals 1
        raise E.ManifestError("store " + _OLD_VERSION_HINT, store=store_dir)
    if type(version) is not int or version != FORMAT_VERSION:
        raise E.ManifestError(f"format version {m.get('format_version')!r} is not "
                              f"supported (this swarmfs reads {FORMAT_VERSION})",
                              store=store_dir)


def read_manifest(store_dir: str) -> dict:
    """Read ``STORE/manifest.json`` as JSON and check its format version and
    checksum (bounded read).  The fields are checked by the one validating
    loader, ``_manifest.Manifest.load`` (``_manifest.read_manifest`` does
    both).

    Raises:
        StoreNotFoundError: no directory or no manifest.
        ManifestError: unreadable, not JSON, an unsupported format version,
            or a failed checksum.
        IOFailedError: the kernel failed the read.
    """
    store_dir = os.fspath(store_dir)
    if "\0" in store_dir:
        raise E.StoreNotFoundError("a store path cannot contain NUL bytes",
                                   store=store_dir.replace("\0", "\\0"))
    path = os.path.join(store_dir, MANIFEST)
    try:
        st = os.stat(store_dir)
    except FileNotFoundError:
        raise E.StoreNotFoundError("store directory does not exist", store=store_dir) \
            from None
    except OSError as exc:
        raise _os_error(exc, "store directory", dict(store=store_dir)) from None
    if not stat.S_ISDIR(st.st_mode):
        raise E.StoreNotFoundError("is a file, not a store directory", store=store_dir)
    if not os.path.lexists(path):
        hint = ""
        try:
            for sub in sorted(os.listdir(store_dir))[:1000]:
                if os.path.isfile(os.path.join(store_dir, sub, MANIFEST)):
                    hint = f"; did you mean {os.path.join(store_dir, sub)}?"
                    break
        except OSError:
            pass
        raise E.StoreNotFoundError("no manifest.json (not a swarmfs store)" + hint,
                                   store=store_dir)
    data = read_bounded(path, cap=MAX_MANIFEST_BYTES, what="manifest.json",
                        store=store_dir)
    m = parse_json(data, "manifest.json", store=store_dir)
    check_format(m, store_dir)
    try:
        ok = m.get("checksum") == manifest_checksum(m)
    except (ValueError, TypeError, RecursionError):
        ok = False
    if not ok:
        raise E.ManifestError("manifest.json fails its checksum (edited or corrupt); "
                              "restore it from a backup", store=store_dir)
    return m


#: file name of a layer's index file: layer-LLL.gGGGGGGGG.safetensors
INDEX_NAME_RE = re.compile(r"layer-([0-9]{3,})\.g([0-9]{8,})\.safetensors")


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
    """File name of a layer's index at a generation, e.g. ``layer-003.g00000012.safetensors``."""
    return f"layer-{layer:03d}.g{generation:08d}.safetensors"


#: index-file metadata keys checked against the manifest and superblocks
INDEX_META = ("format", "format_version", "uuid", "layer", "generation", "num_tokens",
              "num_clusters", "num_copies", "hot_clusters", "num_disks", "dtype",
              "num_kv_heads", "head_dim", "entry_bytes")


def save_index(store_dir: str, layer: int, generation: int, arrays: dict, *,
               meta: dict) -> dict:
    """Write one layer's index file durably; returns its manifest record's
    fields ``{"file": name, "xxh3": hex, "bytes": n}``.  ``meta`` gives the store's
    identity (uuid, num_disks, dtype, num_kv_heads, head_dim, entry_bytes),
    stored in the file's own metadata with the layer's counts."""
    from safetensors.numpy import save

    out = {}
    for k, dt in INDEX_ARRAYS.items():
        a = np.ascontiguousarray(arrays[k], dtype=dt)
        out[k] = a
    md = {"format": "swarmfs-index", "format_version": str(FORMAT_VERSION),
          "layer": str(layer), "generation": str(generation),
          "num_tokens": str(out["token_xxh"].shape[0]),
          "num_clusters": str(out["members_ptr"].shape[0] - 1),
          "num_copies": str(out["members"].shape[0]),
          "hot_clusters": str(int(out["hot"].astype(np.int64).sum()))}
    md.update({k: str(meta[k]) for k in ("uuid", "num_disks", "dtype", "num_kv_heads",
                                          "head_dim", "entry_bytes")})
    data = save(out, metadata=md)
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
        with contextlib.suppress(OSError):
            os.unlink(path)          # no partial index file stays behind
        raise
    os.close(fd)
    fsync_dir(d)
    return {"file": name, "xxh3": xxhash.xxh3_64_hexdigest(data), "bytes": len(data)}


def _check_meta(meta, name: str, layer: int, expect: dict, kw: dict) -> None:
    if not isinstance(meta, dict) or meta.get("layer") != str(layer):
        got = meta.get("layer") if isinstance(meta, dict) else None
        raise E.ManifestError(f"index file {name} belongs to layer {got!r}, not {layer}",
                              **kw)
    for k in INDEX_META:
        want = {"format": "swarmfs-index", "format_version": str(FORMAT_VERSION),
                "layer": str(layer)}.get(k, expect.get(k))
        if want is not None and meta.get(k) != str(want):
            raise E.ManifestError(f"index file {name}: {k} is {meta.get(k)!r} but the "
                                  f"store says {want} (manifest edited or the file is "
                                  "from another store)", **kw)


def _header_meta(head: bytes, size: int, name: str, kw: dict):
    header_len = int.from_bytes(head[:8], "little")
    if len(head) < 8 or not 0 < header_len <= min(size - 8, 1 << 24):
        raise E.ManifestError(f"index file {name} has no valid safetensors header", **kw)
    return header_len


def check_index_header(store_dir: str, layer: int, record, *, expect: dict) -> None:
    """Read only the header of a layer's index file and check its metadata
    against ``expect`` (cheap; done for every layer at open).  ``record``
    is the manifest's :class:`~swarmfs.store._manifest.IndexRecord`.

    Raises:
        ManifestError: missing, wrong size, or metadata that disagrees.
    """
    name = record.file
    kw = dict(store=store_dir, layer=layer)
    path = os.path.join(store_dir, INDEX_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise E.ManifestError(f"index file {name} is missing", path=path, **kw) from None
    except OSError as exc:
        raise _os_error(exc, f"index file {name}", dict(kw, path=path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise E.ManifestError(f"index file {name} is not a regular file", **kw)
        if st.st_size != record.bytes:
            raise E.ManifestError(f"index file {name} is {st.st_size} bytes, the manifest "
                                  f"says {record.bytes} (corrupt or replaced)", **kw)
        head = os.pread(fd, 8, 0)
        n = _header_meta(head, st.st_size, name, kw)
        raw = os.pread(fd, n, 8)
    except OSError as exc:
        raise _os_error(exc, f"index file {name}", dict(kw, path=path)) from None
    finally:
        os.close(fd)
    meta = parse_json(raw, f"index file {name}", **kw)
    _check_meta(meta.get("__metadata__") if isinstance(meta, dict) else None, name, layer,
                expect, kw)


def load_index(store_dir: str, layer: int, record, *, expect: dict) -> dict:
    """Read one layer's index file (bounded; ``record`` is the manifest's
    :class:`~swarmfs.store._manifest.IndexRecord`), check its XXH3-64, its own
    metadata against ``expect`` (the manifest's counts and generation, the
    superblocks' identity) and its arrays' dtypes, ranks and sizes.

    Raises:
        ManifestError: the file is missing, corrupt, lacks an array, or
            disagrees with the manifest or the superblocks.
    """
    from safetensors.numpy import load

    name = record.file
    kw = dict(store=store_dir, layer=layer)
    path = os.path.join(store_dir, INDEX_DIR, name)
    data = read_bounded(path, cap=int(record.bytes or MAX_INDEX_BYTES),
                        what=f"index file {name}", store=store_dir, layer=layer,
                        missing=E.ManifestError(f"index file {name} is missing", **kw))
    if len(data) != record.bytes or xxhash.xxh3_64_hexdigest(data) != record.xxh3:
        raise E.ManifestError(f"index file {name} fails its checksum", **kw)
    n = _header_meta(data[:8], len(data), name, kw)
    meta = parse_json(data[8:8 + n], f"index file {name}", **kw)
    _check_meta(meta.get("__metadata__") if isinstance(meta, dict) else None, name, layer,
                expect, kw)
    try:
        arrays = load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise E.ManifestError(f"index file {name} is not readable: {exc}", **kw) from None
    missing = set(INDEX_ARRAYS) - set(arrays)
    if missing:
        raise E.ManifestError(f"index file {name} lacks {sorted(missing)}", **kw)
    ndim = {"extent_off": 2, "extent_xxh": 2, "medoid_keys": 2}
    for k, dt in INDEX_ARRAYS.items():
        a = arrays[k]
        if a.dtype != np.dtype(dt) or a.ndim != ndim.get(k, 1):
            raise E.ManifestError(f"index file {name}: array {k} is "
                                  f"{a.dtype} {a.ndim}-d, expected {np.dtype(dt)} "
                                  f"{ndim.get(k, 1)}-d", **kw)
    return arrays


def _index_files(store_dir: str):
    try:
        names = os.listdir(os.path.join(store_dir, INDEX_DIR))
    except OSError:
        return
    for name in names:
        mm = INDEX_NAME_RE.fullmatch(name)
        if mm:
            yield name, int(mm.group(1)), int(mm.group(2))


def check_orphan_indexes(store_dir: str, layers, generation: int) -> None:
    """Refuse a manifest that lost a layer record: a committed index file
    (generation <= the manifest's) of a layer the manifest does not list.
    Uncommitted leftovers (newer generations) are ignored.

    Raises:
        ManifestError: naming the layer and the file.
    """
    for name, layer, gen in _index_files(store_dir):
        if layer not in layers and gen <= generation:
            raise E.ManifestError(f"index file {name} holds committed data of layer "
                                  f"{layer}, which the manifest does not list (layer record "
                                  "removed?)", store=store_dir, layer=layer)


def remove_uncommitted_indexes(store_dir: str, generation: int) -> None:
    """Delete index files of generation >= ``generation``: leftovers of
    writers that crashed before their commit (best effort)."""
    for name, _layer, gen in list(_index_files(store_dir)):
        if gen >= generation:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(store_dir, INDEX_DIR, name))


def remove_stale_indexes(store_dir: str, keep: set) -> None:
    """Delete index files no committed manifest references (best effort)."""
    d = os.path.join(store_dir, INDEX_DIR)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return
    for name in names:
        if name.endswith(".safetensors") and name not in keep:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(d, name))


def to_torch(arr: np.ndarray, dtype_name: str):
    """numpy array (store dtype; ml_dtypes bfloat16 allowed) -> torch tensor,
    sharing memory."""
    import torch
    if dtype_name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)
