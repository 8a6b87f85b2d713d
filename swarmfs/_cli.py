"""The ``swarmfs`` command line (click)."""

from __future__ import annotations

import json
import os
import sys

import click
import numpy as np

from . import _errors as E

ENGINE_OPT = click.option("--engine", type=click.Choice(["auto", "io_uring", "threads"]),
                          default=None, help="I/O engine (default: $SWARMFS_ENGINE or auto).")


def _fail(exc: Exception) -> None:
    click.echo(f"swarmfs: error: {exc}", err=True)
    sys.exit(1)


class _Group(click.Group):
    """Turns SwarmError into a one-line message and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except E.SwarmError as exc:
            _fail(exc)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="swarmfs")
def main():
    """swarmfs: a co-activation-aware KV-cache store striped over several SSDs."""


def _human(n):
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


@main.command()
@click.argument("store", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@ENGINE_OPT
def info(store, as_json, engine):
    """Describe a store: disks, sizes, layers, clusters, replication, engine."""
    from ._store import Store
    with Store.open(store, engine=engine) as s:
        d = s.info()
    if as_json:
        click.echo(json.dumps(d, indent=1))
        return
    from rich.console import Console
    from rich.table import Table
    con = Console()
    m = d["model"]
    con.print(f"[bold]{d['path']}[/]  uuid {d['uuid']}  format v{d['format_version']}  "
              f"generation {d['generation']}")
    con.print(f"model {m.get('name') or '-'}: {m['num_layers']} layers, {m['num_kv_heads']} KV "
              f"heads x {m['head_dim']} ({m['num_query_heads']} query heads), {m['dtype']}; "
              f"entry {d['entry_bytes']} B; block {d['block_size']} B")
    con.print(f"engine {d['engine']} (queue depth {d['queue_depth']}), checksums "
              f"{'verified' if d['verify_checksums'] else 'off'}")
    con.print(f"{d['clusters']} clusters, {d['entries']} entries, {d['copies']} copies "
              f"(replication {d['replication']}), {_human(d['kv_bytes'])} of KV")
    t = Table("disk", "path", "used", "capacity", "size")
    for x in d["disks"]:
        t.add_row(str(x["index"]), x["path"], _human(x["used_bytes"]), _human(x["capacity"]),
                  _human(x["size"]))
    con.print(t)
    t = Table("layer", "tokens", "clusters", "copies", "replication", "local window",
              "hot clusters")
    for k, x in d["layers"].items():
        t.add_row(k, str(x["num_tokens"]), str(x["num_clusters"]), str(x["num_copies"]),
                  f"{x['replication']:.3f}", str(x["local_window"]), str(x["hot_clusters"]))
    con.print(t)


@main.command()
@click.argument("store", type=click.Path())
@click.option("--layer", "layers", type=int, multiple=True, help="Only these layers.")
@click.option("--json", "as_json", is_flag=True, help="Print failures as JSON.")
@ENGINE_OPT
def verify(store, layers, as_json, engine):
    """Read every extent and check its XXH3-64 checksum.

    Exits 0 when the store is intact; otherwise lists every bad extent with
    its layer, cluster and disk and exits 1.
    """
    from tqdm import tqdm

    from ._store import Store
    with Store.open(store, engine=engine) as s:
        total = sum(int(x["end"]) for x in s.manifest["disks"])
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify",
                  disable=as_json or not sys.stderr.isatty()) as bar:
            bad = s.verify(layers=list(layers) or None, progress=bar.update)
        nlayers = len(layers or s.layers)
    if as_json:
        click.echo(json.dumps({"ok": not bad, "failures": bad}, indent=1))
    elif bad:
        for f in bad:
            click.echo(f"BAD layer {f['layer']} cluster {f['cluster']} disk {f['disk']} "
                       f"({f['path']}) offset {f['offset']}: {f['error']}")
        click.echo(f"{len(bad)} bad extent(s)", err=True)
    else:
        click.echo(f"ok: every extent of {nlayers} layer(s) matches its checksum")
    sys.exit(1 if bad else 0)


@main.command()
@click.argument("store", type=click.Path())
@click.option("--layer", type=int, required=True, help="Layer number.")
@click.option("--cluster", "cid", type=int, default=None, help="Cluster id.")
@click.option("--tokens", default=None,
              help="Comma-separated token positions instead of a cluster.")
@click.option("--out", type=click.Path(), default=None,
              help="Write a .npy file ([n, 2, H_kv, d]) instead of printing a summary.")
@click.option("--no-verify", is_flag=True, help="Skip checksum verification.")
@ENGINE_OPT
def read(store, layer, cid, tokens, out, no_verify, engine):
    """Read a cluster (or tokens) through the fast path."""
    from ._store import Store
    if (cid is None) == (tokens is None):
        raise click.UsageError("give exactly one of --cluster and --tokens")
    with Store.open(store, engine=engine, verify=not no_verify) as s:
        if cid is not None:
            arr = s.read_cluster(layer, cid)
            toks = s.cluster_tokens(layer, cid)
        else:
            try:
                toks = np.array([int(t) for t in tokens.split(",") if t.strip()])
            except ValueError:
                raise click.BadParameter("tokens must be integers", param_hint="--tokens")
            arr = s.read_entries(layer, toks)
        st = s.stats()
    if out:
        np.save(out, arr)
        click.echo(f"wrote {out}: {arr.shape} {arr.dtype}")
        return
    click.echo(f"layer {layer} " + (f"cluster {cid}" if cid is not None else "tokens") +
               f": {arr.shape[0]} entries, shape {tuple(arr.shape)}, {arr.dtype}, "
               f"{arr.nbytes} bytes in {st.engine.requests} request(s) "
               f"({st.engine.engine}, checksums {'on' if st.verify_checksums else 'off'})")
    click.echo("tokens: " + " ".join(map(str, toks[:32])) + (" ..." if len(toks) > 32 else ""))
    a = arr.astype(np.float32)
    click.echo(f"K mean {a[:, 0].mean():+.4f} std {a[:, 0].std():.4f}; "
               f"V mean {a[:, 1].mean():+.4f} std {a[:, 1].std():.4f}")


@main.command()
@click.option("--dir", "workdir", type=click.Path(), default="demo-store",
              help="Directory for the store and its disk files.")
@click.option("--disks", type=int, default=4, help="Number of disk files.")
@ENGINE_OPT
def demo(workdir, disks, engine):
    """Build a store on N disk files, verify it and read it back (interim)."""
    from ._store import Store
    rng = np.random.default_rng(0)
    S, H, d = 4096, 12, 32
    kv = rng.standard_normal((S, 2, H, d)).astype(np.float16)
    perm = rng.permutation(S)
    clusters = np.array_split(perm, 128)
    s = Store.create(workdir, disks=disks, num_layers=1, num_kv_heads=H, head_dim=d,
                     dtype="float16", engine=engine, force=True)
    with s:
        s.write_layer(0, kv, clusters)
        ok = all(np.array_equal(s.read_cluster(0, c).view(np.uint16),
                                kv[clusters[c]].view(np.uint16)) for c in range(128))
        bad = s.verify()
        st = s.stats()
    click.echo(f"store {os.path.abspath(workdir)}: {disks} disks, {S} entries in 128 clusters; "
               f"read back bit-exact: {ok}; verify: {'ok' if not bad else bad}; engine "
               f"{st.engine.engine}, {st.engine.requests} requests, {st.engine.submit_calls} "
               "submit calls")


@main.command()
@click.argument("store", type=click.Path())
@click.argument("mountpoint", type=click.Path())
@click.option("--foreground", "-f", is_flag=True, help="Serve in this process until unmounted.")
@click.option("--allow-other", is_flag=True, help="Let other users read the mount.")
@click.option("--debug", is_flag=True, help="Log every FUSE request to stderr.")
@click.option("--direct-io", is_flag=True,
              help="Bypass the page cache for KV files (faster single readers; no mmap).")
@click.option("--readahead", type=int, default=4 << 20, show_default=True,
              help="Read-ahead window for sequential readers, in bytes (0 = off).")
@click.option("--no-verify", is_flag=True, help="Do not verify checksums on read.")
@click.option("--log-file", type=click.Path(), default=None, help="Daemon log file.")
@ENGINE_OPT
def mount(store, mountpoint, foreground, allow_other, debug, direct_io, readahead,
          no_verify, log_file, engine):
    """Mount STORE read-only at MOUNTPOINT (FUSE): ls, cat and np.load the clusters.

    Without --foreground the command returns once the mount is up.  Unmount
    with `swarmfs umount MOUNTPOINT`.
    """
    try:
        from ._fuse import mount as do_mount
    except ImportError as exc:
        raise click.ClickException(f"mounting needs pyfuse3 and trio "
                                   f"(pip install 'swarmfs[mount]'): {exc}")
    pid = do_mount(store, mountpoint, foreground=foreground, allow_other=allow_other,
                   debug=debug, direct_io=direct_io, readahead=readahead,
                   verify=not no_verify, engine=engine, log_file=log_file)
    if pid:
        click.echo(f"mounted {store} at {mountpoint} (pid {pid}); "
                   f"unmount with: swarmfs umount {mountpoint}")


@main.command()
@click.argument("mountpoint", type=click.Path())
@click.option("--lazy", "-z", is_flag=True,
              help="Detach now even if busy or dead (fusermount3 -u -z).")
def umount(mountpoint, lazy):
    """Unmount a swarmfs mount (also a dead one, with --lazy)."""
    from ._fuse import umount as do_umount
    do_umount(mountpoint, lazy=lazy)


if __name__ == "__main__":
    main()
