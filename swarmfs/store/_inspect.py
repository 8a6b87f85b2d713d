"""What ``Store.info`` and ``Store.verify`` report, computed from a store's
public state (its committed manifest, layer indexes, disks and executor).

The ``Store`` methods check their arguments and call these; nothing here
changes the store.
"""

from __future__ import annotations

import os

import numpy as np

from .. import _errors as E
from . import _format as F
from ._engine import device_size

__all__ = ["store_info", "verify_layers"]


def verify_layers(store, layers: list[int], progress, max_batch: int) -> list[dict]:
    """The work of ``Store.verify`` over ``layers`` (checked): every extent
    read and checked, failures located (see there for the dicts)."""
    failures: list[dict] = []
    ex = store._executor
    sizes = np.array([ex.disk_size(d) for d in range(store.num_disks)], np.uint64)
    gone = np.zeros(store.num_disks, bool)
    for d, exc in store.disk_problems.items():
        gone[d] = not isinstance(exc, (E.DiskTruncatedError, E.DiskMismatchError))
    for layer in layers:
        try:
            li = store.layer(layer)
        except E.SwarmError as exc:
            failures.append(dict(layer=layer, cluster=None, disk=exc.disk,
                                 path=exc.path, offset=None, extent_offset=None,
                                 error=f"layer index unusable: {exc.message}",
                                 entries=None, tokens=[], lost=[]))
            continue
        failures += ex.verify_layer(li, sizes, gone, store.disk_problems, max_batch, progress)
    return failures


def store_info(store) -> dict:
    """The JSON-ready summary ``Store.info`` returns."""
    m = store.committed
    layers = {str(k): {x: getattr(rec, x) for x in (
        "num_tokens", "num_clusters", "num_copies", "replication", "local_window",
        "hot_clusters", "representative")} for k, rec in sorted(m.layers.items())}
    disks = [{"index": i, "path": store.disk_paths[i], "used_bytes": d.end,
              "capacity": d.capacity or None, "size": _size_or_none(store.disk_paths[i])}
             for i, d in enumerate(m.disks)]
    recs = m.layers.values()
    copies = sum(r.num_copies for r in recs)
    tokens = sum(r.num_tokens for r in recs)
    return {
        "path": store.path, "uuid": m.uuid, "format_version": F.FORMAT_VERSION,
        "generation": m.generation, "model": m.model.to_dict(),
        "block_size": store.block_size, "entry_bytes": store.entry_bytes,
        "allocated_bytes": sum(d.end - F.DATA_START for d in m.disks),
        "engine": store.engine.kind, "queue_depth": store.engine.queue_depth,
        "verify_checksums": store.verify_checksums,
        "num_disks": store.num_disks, "disks": disks,
        "num_layers_stored": len(m.layers),
        "clusters": sum(r.num_clusters for r in recs),
        "entries": tokens, "copies": copies,
        "replication": round(copies / tokens, 4) if tokens else None,
        "kv_bytes": copies * store.entry_bytes,
        "layers": layers,
    }


def _size_or_none(p):
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return None
    try:
        return device_size(fd)
    finally:
        os.close(fd)
