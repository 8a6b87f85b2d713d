#!/usr/bin/env python3
"""Fuzz a store's metadata: manifests, index files, superblocks and commit
records (issue 9).

Each case copies a small real store (written with ``Store.write_layer`` and
``Store.append``), damages one structure, opens it and reads everything
back.  The only acceptable outcomes are

* ``equal``: the store opens and every layer, count and byte reads back
  exactly as written, or
* ``refused``: a SwarmError (other than InternalError) is raised,

never another exception (``crash``), an InternalError (``internal``), a
store that opens with different content (``wrong``) or a case that runs
past its timeout (``hang``; cases run in a worker process that is killed
and restarted).

Damage comes in kinds: raw byte flips, truncation and extension of each
file; JSON edits of the manifest with its checksum recomputed (shallow: the
commit records on the disks then disagree; deep: the commit records are
rewritten to match, as a buggy writer would); index files edited with
their XXH3 recomputed; superblocks and commit records with their checksums
recomputed; a rolled-back manifest; special files (a FIFO, /dev/zero, a
directory, a symlink loop) in place of the manifest, an index file or a
disk; deeply nested JSON.

    tools/dev run python -m tools.fuzz_store --cases 10000 --seed 1
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import pathlib
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback

import click
import numpy as np
import xxhash

from swarmfs import Store
from swarmfs import _errors as E
from swarmfs.store import _format as F
from tools._options import COUNT, POSITIVE, OutPath

KINDS = ("manifest-bytes", "manifest-json", "manifest-json-deep", "manifest-rollback",
         "index-bytes", "index-resealed", "superblock-bytes", "superblock-resealed",
         "commit-bytes", "commit-resealed", "disk-truncate", "special-file",
         "manifest-nested")


# -- base stores ----------------------------------------------------------------

def build_base(root: str) -> list[dict]:
    """Two small real stores under ``root`` (fp16 with 3 disks, 2 of 3
    layers and an append; bf16 with 1 disk), plus what must read back."""
    rng = np.random.default_rng(7)
    bases = []
    for name, dtype, ndisks, H, d, layers, S in (("a", "float16", 3, 2, 8, (0, 2), 120),
                                                  ("b", "bfloat16", 1, 1, 16, (0,), 40)):
        path = os.path.join(root, name)
        s = Store.create(path, disks=ndisks, num_layers=max(layers) + 1, num_kv_heads=H,
                         head_dim=d, dtype=dtype)
        kv = {}
        history = []
        for layer in layers:
            x = rng.standard_normal((S, 2, H, d)).astype(np.float32)
            x = x.astype(F.numpy_dtype(dtype))
            perm = rng.permutation(S)
            cl = [np.sort(c) for c in np.array_split(perm, max(S // 10, 1))]
            cl[0] = np.unique(np.append(cl[0], cl[1][:2]))          # replicas
            s.write_layer(layer, x, cl, hot=np.arange(len(cl)) < 2)
            kv[layer] = x
            history.append(s.manifest)
        new = rng.standard_normal((6, 2, H, d)).astype(np.float32).astype(kv[layers[0]].dtype)
        s.append(layers[0], new, [[0], [1], [], [], [0, 1], []])
        kv[layers[0]] = np.concatenate([kv[layers[0]], new])
        expect = {"layers": s.layers, "generation": s.manifest["generation"]}
        for layer in layers:
            expect[layer] = dict(num_tokens=s.num_tokens(layer),
                                 num_clusters=s.num_clusters(layer),
                                 hot_clusters=int(s.layer(layer).hot.sum()),
                                 num_copies=s.committed.layers[layer].num_copies,
                                 replication=s.committed.layers[layer].replication,
                                 local_window=s.committed.layers[layer].local_window,
                                 clusters=[s.cluster_tokens(layer, c).tolist()
                                           for c in range(s.num_clusters(layer))])
        s.close()
        bases.append(dict(path=path, kv={k: v.view(np.uint8) for k, v in kv.items()},
                          expect=expect, history=history, dtype=dtype))
    return bases


# -- mutations --------------------------------------------------------------------

_ODD_VALUES = [None, True, False, 0, 1, -1, 2, 3, 4095, 4096, 12288, 2**31, 2**63, 2**64,
               -2**63, 1.5, float("nan"), float("inf"), "", "x", "\u00b2", "0x10", "a\0b",
               "../../etc/passwd", "/dev/zero", "float16", "bfloat16", "float32", [], [1],
               {}, {"a": 1}, [[[[1]]]], "layer-000.g00000001.safetensors",
               "0" * 16, "f" * 32]


def _paths(x, prefix=()):
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, prefix + (i,))


def _get(x, path):
    for p in path:
        x = x[p]
    return x


def _edit_json(m: dict, rng: random.Random) -> str:
    """One random edit of a manifest dict in place; returns a description."""
    paths = [p for p in _paths(m) if p and p[0] != "checksum"]
    op = rng.choice(["value", "value", "delete", "add", "int+-", "swap", "identity",
                     "layer-remove", "layer-copy", "disk-end", "free"])
    if op == "identity":
        model = m["model"]
        k = rng.choice(["dtype", "heads", "head_dim", "entry_bytes", "layers"])
        if k == "dtype":
            model["dtype"] = {"float16": "bfloat16", "bfloat16": "float16",
                              "float32": "float16"}[model["dtype"]]
        elif k == "heads" and model["head_dim"] % 2 == 0:
            model["num_kv_heads"] *= 2
            model["num_query_heads"] *= 2
            model["head_dim"] //= 2
        elif k == "head_dim":
            model["head_dim"] += 1
            model["entry_bytes"] = 2 * model["num_kv_heads"] * model["head_dim"] * \
                F.DTYPES[model["dtype"]]
        elif k == "entry_bytes":
            model["entry_bytes"] += rng.choice([-2, 2])
        else:
            model["num_layers"] += rng.choice([-1, 1])
        return f"identity {k}"
    if op == "layer-remove" and m["layers"]:
        k = rng.choice(sorted(m["layers"]))
        del m["layers"][k]
        return f"remove layer record {k}"
    if op == "layer-copy" and m["layers"]:
        k = rng.choice(sorted(m["layers"]))
        free = [str(i) for i in range(m["model"]["num_layers"]) if str(i) not in m["layers"]]
        if free:
            m["layers"][free[0]] = json.loads(json.dumps(m["layers"][k]))
            return f"copy layer record {k} to {free[0]}"
    if op == "disk-end":
        d = rng.randrange(len(m["disks"]))
        m["disks"][d]["end"] += rng.choice([-512, 512, -4096, 4096, -8192])
        return f"disk {d} end"
    if op == "free":
        d = rng.randrange(len(m["disks"]))
        end = m["disks"][d]["end"]
        off = rng.randrange(F.DATA_START, max(end, F.DATA_START + 1), 512)
        m["disks"][d]["free"] = sorted(m["disks"][d].get("free", []) +
                                       [[off, 512, 0]])
        return f"disk {d} free range at {off}"
    path = rng.choice(paths)
    parent, key = _get(m, path[:-1]), path[-1]
    if op == "delete":
        del parent[key]
    elif op == "add" and isinstance(_get(m, path), dict):
        _get(m, path)[rng.choice(["zz", "free", "index", "0", "99"])] = \
            rng.choice(_ODD_VALUES)
    elif op == "int+-" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] += rng.choice([-1, 1, -512, 512, 1 << 20])
    elif op == "swap":
        other = rng.choice(paths)
        try:
            a, b = _get(m, path), _get(m, other)
            oparent = _get(m, other[:-1])
            if type(oparent) is not type(parent) and not (isinstance(oparent, dict) and
                                                         isinstance(other[-1], str)):
                raise TypeError("mismatched containers")
            parent[key] = b
            oparent[other[-1]] = a
        except (KeyError, IndexError, TypeError):
            parent[key] = rng.choice(_ODD_VALUES)
    else:
        parent[key] = rng.choice(_ODD_VALUES)
    return f"{op} {'/'.join(map(str, path))}"


def _safe_edit(m: dict, rng: random.Random) -> str:
    """An edit; when an earlier edit broke the structure it relies on,
    a plain value replacement instead."""
    try:
        return _edit_json(m, rng)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        key = rng.choice(sorted(k for k in m if k != "checksum"))
        m[key] = rng.choice(_ODD_VALUES)
        return f"value {key}"


def _disk_paths(store: str, m: dict) -> list[str]:
    return [d["path"] if os.path.isabs(d["path"]) else os.path.join(store, d["path"])
            for d in m["disks"]]


def _raw_manifest(store: str) -> dict:
    with open(os.path.join(store, F.MANIFEST), "rb") as f:
        return json.loads(f.read())


def _write_manifest_raw(store: str, m: dict, *, seal: bool) -> None:
    if seal:
        body = {k: v for k, v in m.items() if k != "checksum"}
        m["checksum"] = xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())
    with open(os.path.join(store, F.MANIFEST), "w") as f:
        json.dump(m, f)


def _rewrite_commits(store: str, m: dict, paths: list[str]) -> None:
    """Rewrite every disk's commit records to match manifest ``m`` (what a
    buggy writer would leave), so only the deeper checks can refuse it."""
    try:
        uid = bytes.fromhex(m["uuid"])
        gen, msum = int(m["generation"]), int(m["checksum"], 16)
    except (KeyError, ValueError, TypeError, AttributeError, OverflowError):
        return
    if not 0 <= gen < 2**64 or len(uid) != 16:
        return
    for i, p in enumerate(paths):
        rec = F.pack_commit(store_uuid=uid, disk_index=i, generation=gen, manifest_sum=msum,
                            disk_end=0, state=F.COMMITTED)
        try:
            with open(p, "r+b") as f:
                for s in (0, 1):
                    f.seek(F.COMMIT_OFF + s * F.COMMIT_SIZE)
                    f.write(rec)
        except (OSError, ValueError, TypeError):
            pass


def reseal_manifest(store: str, m: dict, *, deep: bool = False) -> None:
    """Write manifest ``m`` with a valid checksum (someone edited it and
    recomputed it); ``deep`` also rewrites the disks' commit records to
    match (what a buggy writer would leave)."""
    paths = _disk_paths(store, _raw_manifest(store))      # where the disks really are
    _write_manifest_raw(store, m, seal=True)
    if deep:
        _rewrite_commits(store, m, paths)


def _flip(data: bytearray, rng: random.Random, n: int | None = None) -> str:
    if not data:
        return "empty"
    n = n or rng.choice([1, 1, 1, 2, 8])
    out = []
    for _ in range(n):
        i = rng.randrange(len(data))
        op = rng.choice(["xor", "zero", "ff", "rand"])
        data[i] = {"xor": data[i] ^ (1 << rng.randrange(8)), "zero": 0, "ff": 255,
                   "rand": rng.randrange(256)}[op]
        out.append(str(i))
    return "bytes " + ",".join(out)


def mutate(store: str, base: dict, rng: random.Random, kind: str) -> str:
    """Damage one structure of the store copy at ``store``; returns a
    description."""
    m = _raw_manifest(store)
    disks = _disk_paths(store, m)
    mpath = os.path.join(store, F.MANIFEST)
    idx_files = [os.path.join(store, F.INDEX_DIR, r["index"]["file"])
                 for r in m["layers"].values()]
    if kind == "manifest-bytes":
        data = bytearray(pathlib.Path(mpath).read_bytes())
        if rng.random() < 0.2:
            cut = rng.randrange(len(data))
            pathlib.Path(mpath).write_bytes(bytes(data[:cut]))
            return f"manifest cut at {cut}"
        what = _flip(data, rng)
        pathlib.Path(mpath).write_bytes(bytes(data))
        return "manifest " + what
    if kind in ("manifest-json", "manifest-json-deep"):
        what = "; ".join(_safe_edit(m, rng) for _ in range(rng.choice([1, 1, 2])))
        _write_manifest_raw(store, m, seal=True)
        if kind == "manifest-json-deep":
            _rewrite_commits(store, m, disks)
        return "manifest edit " + what
    if kind == "manifest-rollback":
        old = json.loads(json.dumps(rng.choice(base["history"])))
        _write_manifest_raw(store, old, seal=False)
        return f"manifest rolled back to generation {old['generation']}"
    if kind in ("index-bytes", "index-resealed"):
        p = rng.choice(idx_files)
        data = bytearray(pathlib.Path(p).read_bytes())
        if kind == "index-resealed" and rng.random() < 0.5:
            # edit the safetensors header's metadata or an array, keep it parseable
            n = int.from_bytes(data[:8], "little")
            head = json.loads(data[8:8 + n])
            key = rng.choice([k for k in head if k != "__metadata__"] + ["__metadata__"])
            if key == "__metadata__":
                mk = rng.choice(sorted(head[key]))
                head[key][mk] = str(rng.choice(_ODD_VALUES[:20]))
                what = f"index metadata {mk}"
            else:
                head[key]["shape"] = [max(0, x + rng.choice([-1, 1])) for x in head[key]["shape"]]
                what = f"index array {key} shape"
            hb = json.dumps(head).encode()
            hb += b" " * (-len(hb) % 8)
            data = bytearray(len(hb).to_bytes(8, "little") + hb + data[8 + n:])
        else:
            what = "index " + _flip(data, rng)
        pathlib.Path(p).write_bytes(bytes(data))
        if kind == "index-resealed":
            for r in m["layers"].values():
                if r["index"]["file"] == os.path.basename(p):
                    r["index"]["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(data))
                    r["index"]["bytes"] = len(data)
            _write_manifest_raw(store, m, seal=True)
            _rewrite_commits(store, m, disks)
        return what
    if kind in ("superblock-bytes", "superblock-resealed", "commit-bytes", "commit-resealed"):
        i = rng.randrange(len(disks))
        lo, size = ((0, F.SUPERBLOCK_SIZE) if kind.startswith("superblock") else
                    (F.COMMIT_OFF + rng.randrange(2) * F.COMMIT_SIZE, F.COMMIT_SIZE))
        with open(disks[i], "r+b") as f:
            f.seek(lo)
            data = bytearray(f.read(size))
            if kind.endswith("resealed"):
                what = _flip(data, rng) if rng.random() < 0.5 else _field(data, rng)
                body = bytes(data[:size - 8])
                data[size - 8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
            else:
                what = _flip(data, rng)
            f.seek(lo)
            f.write(data)
        return f"disk {i} {kind} {what}"
    if kind == "disk-truncate":
        i = rng.randrange(len(disks))
        size = os.path.getsize(disks[i])
        cut = rng.choice([size - 4096, size - 512, size // 2, F.DATA_START, 100, 0,
                          size + 4096])
        os.truncate(disks[i], max(cut, 0))
        return f"disk {i} truncated to {max(cut, 0)}"
    if kind == "special-file":
        target = rng.choice(["manifest", "index", "disk"])
        p = {"manifest": mpath, "index": rng.choice(idx_files),
             "disk": rng.choice(disks)}[target]
        what = rng.choice(["fifo", "dev-zero", "dir", "loop", "dangling"])
        os.unlink(p)
        if what == "fifo":
            os.mkfifo(p)
        elif what == "dev-zero":
            os.symlink("/dev/zero", p)
        elif what == "dir":
            os.mkdir(p)
        elif what == "loop":
            os.symlink(p, p)
        else:
            os.symlink(p + ".nowhere", p)
        return f"{target} replaced by {what}"
    if kind == "manifest-nested":
        depth = rng.choice([40, 1000, 100_000])
        m[rng.choice(["model", "layers", "zz"])] = json.loads("[" * 30 + "]" * 30)
        text = json.dumps(m)
        text = text[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
        pathlib.Path(mpath).write_text(text)
        return f"manifest nested {depth} deep"
    raise ValueError(kind)


def _field(data: bytearray, rng: random.Random) -> str:
    """Set one 4- or 8-byte field of a header to an odd value."""
    off = rng.choice([8, 12, 32, 36, 40, 44, 48, 56, 64, 72, 76, 80, 84, 88])
    width = 8 if off in (48, 56, 64, 88) and rng.random() < 0.7 else 4
    val = rng.choice([0, 1, 2, 3, 512, 4096, 2**31, 2**32 - 1])
    data[off:off + width] = (val % (1 << (8 * width))).to_bytes(width, "little")
    return f"field@{off}={val}"


# -- one case ----------------------------------------------------------------------

def check_store(path: str, base: dict) -> str | None:
    """Open and read everything back; None when equal, else what differs.
    SwarmErrors propagate."""
    ex = base["expect"]
    with Store.open(path) as s:
        if s.layers != ex["layers"]:
            return f"layers {s.layers} != {ex['layers']}"
        if s.dtype != base["dtype"]:
            return f"dtype {s.dtype}"
        s.info()
        for layer in ex["layers"]:
            want = ex[layer]
            if s.num_tokens(layer) != want["num_tokens"] or \
                    s.num_clusters(layer) != want["num_clusters"]:
                return f"layer {layer} counts differ"
            got = s.read_entries(layer, np.arange(want["num_tokens"]))
            if got.view(np.uint8).reshape(want["num_tokens"], -1).tobytes() != \
                    base["kv"][layer].reshape(want["num_tokens"], -1).tobytes():
                return f"layer {layer} bytes differ"
            if s.info()["layers"][str(layer)]["hot_clusters"] != want["hot_clusters"]:
                return f"layer {layer} hot_clusters differ"
            rec = s.committed.layers[layer]
            for f in ("num_copies", "replication", "local_window"):
                if getattr(rec, f) != want[f]:         # NaN too
                    return f"layer {layer} {f} {getattr(rec, f)!r} != {want[f]!r}"
            for c, toks in enumerate(want["clusters"]):
                if s.cluster_tokens(layer, c).tolist() != toks:
                    return f"layer {layer} cluster {c} members differ"
                rows = s.read_cluster(layer, c).view(np.uint8).reshape(len(toks), -1)
                if rows.tobytes() != base["kv"][layer].reshape(
                        want["num_tokens"], -1)[toks].tobytes():
                    return f"layer {layer} cluster {c} bytes differ"
    return None


def run_case(bases: list[dict], seed: int, scratch: str) -> tuple[str, str, str]:
    """One case: (outcome, kind, detail)."""
    rng = random.Random(seed)
    base = bases[seed % len(bases)]
    kind = KINDS[rng.randrange(len(KINDS))]
    path = os.path.join(scratch, f"case-{seed}")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(base["path"], path, symlinks=True)
    try:
        try:
            what = mutate(path, base, rng, kind)
        except Exception as exc:  # noqa: BLE001 - a fuzzer bug, not a store bug
            return "skipped", kind, f"mutation failed: {type(exc).__name__}: {exc}"
        try:
            diff = check_store(path, base)
        except E.InternalError as exc:
            return "internal", kind, f"{what}: {exc}"
        except E.SwarmError as exc:
            return "refused", kind, f"{what}: {type(exc).__name__}"
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            return "crash", kind, f"{what}: {type(exc).__name__}: {exc}\n" + \
                traceback.format_exc(limit=-4)
        if diff is not None:
            return "wrong", kind, f"{what}: {diff}"
        return "equal", kind, what
    finally:
        _remove(path)


def _remove(path: str) -> None:
    # special files (FIFO, loops, dirs) included
    shutil.rmtree(path, ignore_errors=True)


# -- the driver: a worker process, killed on a hang -----------------------------

def _worker(conn, root: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    bases = _load_bases(root)
    scratch = os.path.join(root, "scratch")
    while True:
        seed = conn.recv()
        if seed is None:
            return
        conn.send(run_case(bases, seed, scratch))


def _load_bases(root: str) -> list[dict]:
    import pickle
    with open(os.path.join(root, "bases.pkl"), "rb") as f:
        return pickle.load(f)


def fuzz(cases: int, seed: int, *, timeout: float = 20.0, root: str | None = None,
         log=None) -> dict:
    """Run ``cases`` cases from ``seed``; returns counts per outcome and kind,
    and the first failures."""
    import pickle
    own = root is None
    root = root or tempfile.mkdtemp(prefix="swarmfs-fuzz-")
    try:
        bases = build_base(os.path.join(root, "bases"))
        with open(os.path.join(root, "bases.pkl"), "wb") as f:
            pickle.dump(bases, f)
        os.makedirs(os.path.join(root, "scratch"), exist_ok=True)
        ctx = multiprocessing.get_context("spawn")
        outcomes = collections.Counter()
        by_kind = collections.defaultdict(collections.Counter)
        failures = []
        proc = conn = None
        t0 = time.perf_counter()
        for k in range(cases):
            if proc is None:
                conn, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(child, root), daemon=True)
                proc.start()
                child.close()           # so a dead worker reads as EOF, not a hang
            s = seed * 1_000_003 + k
            conn.send(s)
            if conn.poll(timeout):
                try:
                    outcome, kind, detail = conn.recv()
                except EOFError:
                    outcome, kind, detail = "crash", "?", "worker died"
                    proc = None
            else:
                outcome, kind, detail = "hang", "?", f"case {s} ran over {timeout} s"
                proc.kill()
                proc.join()
                proc = None
                shutil.rmtree(os.path.join(root, "scratch", f"case-{s}"),
                              ignore_errors=True)
            outcomes[outcome] += 1
            by_kind[kind][outcome] += 1
            if outcome not in ("equal", "refused", "skipped"):
                failures.append((s, outcome, kind, detail))
                if log:
                    log(f"case {s}: {outcome} {kind}: {detail}")
            if log and (k + 1) % 500 == 0:
                log(f"{k + 1}/{cases} cases, {time.perf_counter() - t0:.0f} s: "
                    f"{dict(outcomes)}")
        if proc is not None:
            conn.send(None)
            proc.join(5)
        return dict(cases=cases, seed=seed, seconds=time.perf_counter() - t0,
                    outcomes=dict(outcomes),
                    by_kind={k: dict(v) for k, v in sorted(by_kind.items())},
                    failures=failures[:50])
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--cases", type=COUNT, default=1000)
@click.option("--seed", type=int, default=1)
@click.option("--timeout", type=POSITIVE, default=20.0, help="seconds per case")
@click.option("--json", "json_out", type=OutPath(), help="write the result as JSON to this file")
def cli(cases, seed, timeout, json_out):
    """Exits 1 if a case ended other than equal, refused (a SwarmError) or skipped."""
    res = fuzz(cases, seed, timeout=timeout,
               log=lambda s: print(s, file=sys.stderr, flush=True))
    bad = sum(v for k, v in res["outcomes"].items()
              if k not in ("equal", "refused", "skipped"))
    print(json.dumps({k: v for k, v in res.items() if k != "failures"}, indent=1))
    for f in res["failures"][:20]:
        print("FAIL", f)
    if json_out:
        os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
        with open(json_out, "w") as f:
            json.dump(res, f, indent=1)
    run = cases - res["outcomes"].get("skipped", 0)
    print(f"{run} cases run: {100 * (run - bad) / max(run, 1):.2f}% correct-or-SwarmError, "
          f"{res['outcomes'].get('hang', 0)} hangs, {res['seconds']:.0f} s", file=sys.stderr)
    click.get_current_context().exit(1 if bad else 0)


def main(argv=None) -> int:
    """Run :func:`cli`: with ``argv`` it returns the exit status (0, or 1
    if a case failed); without, it parses the command line and exits."""
    return cli.main(args=argv, obj=argv, standalone_mode=argv is None)


if __name__ == "__main__":
    sys.exit(main())
