"""The ``swarmfs`` command line (click)."""

from __future__ import annotations

import json
import os
import sys

import click
import numpy as np

from . import _defaults as defaults
from . import _errors as errors

ENGINE_OPT = click.option("--engine", type=click.Choice(["auto", "io_uring", "threads"]),
                          default=None, help="I/O engine (default: $SWARMFS_ENGINE or auto).")


__all__ = ["main", "FiniteFloat"]

#: exit statuses: 0 ok, 1 a user error or damaged store (SwarmError), 2 a
#: malformed command line (click), 3 an internal error (a bug in swarmfs)
EXIT_USER, EXIT_USAGE, EXIT_INTERNAL = 1, 2, 3

#: OS errors about a path the user named: their fault, not ours
_USER_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError,
                   NotADirectoryError, FileExistsError)


class FiniteFloat(click.FloatRange):
    """click's FloatRange that also refuses NaN and infinities (a NaN
    compares false with both bounds, so FloatRange lets it through).  The
    one such type: ``tools/_options`` uses it too."""

    def convert(self, value, param, ctx):
        """click's conversion and range check, then NaN and +-inf refused
        (click.BadParameter: a usage error naming the option)."""
        v = super().convert(value, param, ctx)
        if v != v or v in (float("inf"), float("-inf")):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


def _disks_arg(disk_paths, disks):
    """``--disk PATH ...`` if given, else ``--disks N`` (default 4)."""
    return list(disk_paths) or (4 if disks is None else disks)


def _fail(exc) -> None:
    click.echo(f"swarmfs: error: {exc}", err=True)
    sys.exit(EXIT_USER)


def _internal(exc: BaseException) -> None:
    what = exc.message if isinstance(exc, errors.InternalError) else \
        f"{type(exc).__name__}: {exc}"
    click.echo(f"swarmfs: internal error: {what}".splitlines()[0], err=True)
    click.echo("swarmfs: this is a bug in swarmfs, not in your input; rerun with "
               "SWARMFS_DEBUG=1 for the traceback and report it", err=True)
    sys.exit(EXIT_INTERNAL)


class _Group(click.Group):
    """Error taxonomy at the boundary: a SwarmError (the user's input or a
    damaged store) is one line on stderr and exit status 1; an OS error on a
    path the user named likewise; anything else (InternalError or any other
    exception: a bug) is reported as an internal error with a traceback hint
    and exit status 3.  SWARMFS_DEBUG=1 shows tracebacks."""

    def invoke(self, ctx):
        # text from a store may hold lone surrogates (a model name given as
        # "\ud800" in JSON, a disk path that is not UTF-8): print them
        # escaped rather than fail in the middle of a line
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="backslashreplace")
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit,
                click.exceptions.Abort):
            raise
        except BrokenPipeError:
            # the reader went away (``swarmfs info STORE | head``): stop quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(1)
        except errors.InternalError as exc:
            if os.environ.get("SWARMFS_DEBUG"):
                raise
            _internal(exc)
        except errors.SwarmError as exc:
            if os.environ.get("SWARMFS_DEBUG"):
                raise
            _fail(exc)
        except _USER_OS_ERRORS as exc:
            if os.environ.get("SWARMFS_DEBUG"):
                raise
            _fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else exc)
        except Exception as exc:
            if os.environ.get("SWARMFS_DEBUG"):
                raise
            _internal(exc)


def _write_out(path: str, write) -> None:
    """Run ``write(file)`` on the output file; an OS error names the path."""
    import errno
    try:
        with open(path, "wb") as f:
            write(f)
    except OSError as exc:
        cls = errors.DiskFullError if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) \
            else errors.IOFailedError
        raise cls(f"cannot write the output file: {exc.strerror}", path=path) from None


def _check_out(path: str) -> str:
    """Fail fast (before slow work) when an output file cannot be written."""
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    if os.path.isdir(path):
        raise click.BadParameter(f"{path} is a directory", param_hint="--out")
    if os.path.exists(path) and not os.path.isfile(path):
        raise click.BadParameter(f"{path} exists and is not a regular file (a device or "
                                 "FIFO); give a file path", param_hint="--out")
    if not os.path.isdir(d):
        raise click.BadParameter(f"directory {d} does not exist", param_hint="--out")
    if not os.access(d, os.W_OK):
        raise click.BadParameter(f"directory {d} is not writable", param_hint="--out")
    return path


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
    from .store._store import Store
    with Store.open(store, engine=engine) as s:
        d = s.info()
    if as_json:
        click.echo(json.dumps(d, indent=1))
        return
    from rich.console import Console
    from rich.table import Table
    con = Console(width=max(Console().width, 140))
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

    Works on a damaged store too (a truncated, missing or foreign disk):
    lists each disk's problem, then every damaged extent with its layer,
    cluster, disk, the byte offset of the damage, the damaged entries and
    the tokens lost (no intact replica left).  Exits 0 when the store is
    intact, 1 otherwise.
    """
    from tqdm import tqdm

    from .store._store import Store
    with Store.open(store, engine=engine, damaged=True) as s:
        total = sum(d.end for d in s.committed.disks)
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify",
                  disable=as_json or not sys.stderr.isatty()) as bar:
            bad = s.verify(layers=list(layers) or None, progress=bar.update)
        nlayers = len(layers or s.layers)
        problems = {d: {"disk": d, "path": s.disk_paths[d], "kind": type(e).__name__,
                        "error": e.message} for d, e in sorted(s.disk_problems.items())}
    if as_json:
        click.echo(json.dumps({"ok": not bad and not problems,
                               "disk_problems": list(problems.values()),
                               "failures": bad}, indent=1))
    else:
        for p in problems.values():
            click.echo(f"DISK {p['disk']} ({p['path']}): {p['error']}")
        for f in bad:
            lost = f"{len(f['lost'])} token(s) lost" if f["lost"] else "no token lost"
            click.echo(f"BAD layer {f['layer']} cluster {f['cluster']} disk {f['disk']} "
                       f"({f['path']}) offset {f['offset']}: {f['error']}; "
                       + (f"{f['entries']} entries damaged, {lost} (no intact replica)"
                          if f["entries"] is not None else "layer not checked"))
        if bad or problems:
            lost = sum(len(f["lost"]) for f in bad)
            click.echo(f"{len(bad)} damaged extent(s) in "
                       f"{len({(f['layer'], f['cluster']) for f in bad})} cluster(s), "
                       f"{lost} token(s) lost, {len(problems)} disk problem(s)", err=True)
        else:
            click.echo(f"ok: every extent of {nlayers} layer(s) matches its checksum")
    sys.exit(1 if bad or problems else 0)


@main.command()
@click.argument("store", type=click.Path())
@click.option("--layer", type=int, required=True, help="Layer number.")
@click.option("--cluster", "cid", type=int, default=None, help="Cluster id.")
@click.option("--tokens", default=None,
              help="Comma-separated token positions instead of a cluster.")
@click.option("--out", type=click.Path(), default=None,
              help="Write a .npy file ([n, 2, H_kv, d]; bfloat16 as its raw uint16 bits) "
                   "instead of printing a summary.")
@click.option("--no-verify", is_flag=True, help="Skip checksum verification.")
@ENGINE_OPT
def read(store, layer, cid, tokens, out, no_verify, engine):
    """Read a cluster (or tokens) through the fast path."""
    from .store._store import Store
    if (cid is None) == (tokens is None):
        raise click.UsageError("give exactly one of --cluster and --tokens")
    if out:
        out = _check_out(out)
    toks = _parse_tokens(tokens) if tokens is not None else None
    with Store.open(store, engine=engine, verify=not no_verify) as s:
        if cid is not None:
            arr = s.read_cluster(layer, cid)
            toks = s.cluster_tokens(layer, cid)
        else:
            arr = s.read_entries(layer, toks)
        st = s.stats()
    if out:
        if arr.dtype.name == "bfloat16":   # as the mount serves it: raw bits, exact
            arr = arr.view(np.uint16)
        _write_out(out, lambda f: np.save(f, arr))   # np.save(path) would append ".npy"
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


def _parse_tokens(text: str) -> np.ndarray:
    """``--tokens 1,2,3``: comma-separated non-negative integers, no empty items."""
    items = [t.strip() for t in text.split(",")]
    if text.strip() == "":
        raise click.BadParameter("no tokens given", param_hint="--tokens")
    if any(t == "" for t in items):
        raise click.BadParameter(f"empty item in {text!r} (write 1,2,3)",
                                 param_hint="--tokens")
    try:
        vals = [int(t) for t in items]
    except ValueError:
        raise click.BadParameter(f"tokens must be integers, got {text!r}",
                                 param_hint="--tokens") from None
    if len(items) > 1 << 24:
        raise click.BadParameter("too many tokens", param_hint="--tokens")
    return np.array(vals, dtype=object).astype(np.int64) if all(
        -2**63 <= v < 2**63 for v in vals) else _too_big()


def _too_big():
    raise click.BadParameter("a token position is beyond int64", param_hint="--tokens")


def _layout_options(f):
    """Options shared by build and demo (offline layout, SWARM §5)."""
    opts = [
        click.option("--ratio", type=float, default=defaults.RATIO, show_default=True,
                     help="Sparsity ratio r: profile top-k and retrieval budget (§8.1)."),
        click.option("--tau", type=float, default=None,
                     help="Clustering radius in (0, 1] (default: the layout's)."),
        click.option("--metric", type=click.Choice(["jaccard", "eq2"]), default=None,
                     help="Co-activation distance (default jaccard; eq2 = paper eq. 2-3)."),
        click.option("--local-window", type=int, default=defaults.LOCAL_WINDOW, show_default=True,
                     help="Tokens kept in DRAM (§5.2)."),
        click.option("--hot-fraction", type=float, default=defaults.HOT_FRACTION, show_default=True,
                     help="DRAM budget for hot clusters, fraction of a layer's KV bytes (eq. 6)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _params(ratio, tau, metric, local_window, hot_fraction):
    """The layout options as :class:`swarmfs.layout.LayoutParams`, checked
    by its rules (InvalidRatioError, InvalidFractionError, ...)."""
    from .layout._layer import LayoutParams
    return LayoutParams(ratio=ratio, tau=tau, metric=metric, local_window=local_window,
                        hot_fraction=hot_fraction)


@main.command()
@click.option("--model", type=click.Path(), default=None,
              help="Local Hugging Face model directory (default all-MiniLM-L6-v2, offline).")
@click.option("--text", "text_file", type=click.Path(), default=None,
              help="Text file (default: the Python standard library's docstrings).")
@click.option("--max-tokens", type=int, default=16384, show_default=True,
              help="Keep the first N tokens (0 = all).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16", "model"]),
              default="float32", show_default=True, help="Stored K/V/Q dtype.")
@click.option("--out", type=click.Path(), required=True, help="Output .safetensors file.")
def capture(model, text_file, max_tokens, dtype, out):
    """Run a model over a text and record K, V and Q of every layer (post-RoPE).

    Texts longer than the model's window run as consecutive windows whose K/V
    form one long context.
    """
    from .layout import _capture as C
    out = _check_out(out)
    text = C.read_text(text_file) if text_file else None
    cap = C.capture(model, text, max_tokens=max_tokens or None, dtype=dtype,
                    text_source=text_file)
    try:
        C.save_capture(out, cap)
    except OSError as exc:
        raise errors.IOFailedError(f"cannot write the capture: {exc.strerror}", path=out) from None
    click.echo(f"wrote {out}: {cap.num_layers} layers, {cap.num_tokens} tokens, "
               f"{cap.num_kv_heads} KV heads / {cap.num_query_heads} query heads x "
               f"{cap.head_dim}, {cap.k.dtype}")


@main.command()
@click.argument("kv_file", type=click.Path())
@click.argument("store", type=click.Path())
@click.option("--disks", type=int, default=None,
              help="Number of file disks under STORE/disks (default 4; not with --disk).")
@click.option("--disk", "disk_paths", multiple=True, type=click.Path(),
              help="A disk path (file or block device); repeat for each disk.")
@click.option("--context", type=int, default=None, help="Store only the first N tokens.")
@click.option("--profile-queries", type=click.Path(), default=None,
              help="Profile with the queries of another capture (dataset shift, §8.4).")
@click.option("--force", is_flag=True, help="Replace an existing store / foreign disks.")
@_layout_options
@ENGINE_OPT
def build(kv_file, store, disks, disk_paths, context, profile_queries, force, ratio, tau,
          metric, local_window, hot_fraction, engine):
    """Lay out a captured KV file (profile, cluster, place) into a new store."""
    from ._demo import build_store
    from .layout import _capture as C
    if disks is not None and disk_paths:
        raise click.UsageError("give either --disks N (disk files under STORE/disks) or "
                               "--disk PATH ..., not both")
    params = _params(ratio, tau, metric, local_window, hot_fraction)
    cap = C.load_capture(kv_file)
    pcap = C.load_capture(profile_queries) if profile_queries else None
    s, rep = build_store(cap, store, disks=_disks_arg(disk_paths, disks), params=params,
                         context=context, force=force, engine=engine, profile_cap=pcap)
    with s:
        info = s.info()
    n = info["num_disks"]
    click.echo(f"built {info['path']}: {info['clusters']} clusters over {n} "
               f"disk{'s' if n != 1 else ''}, {info['entries']} entries, "
               f"replication {info['replication']}")
    for layer, x in rep.items():
        click.echo(f"  layer {layer}: {x['clusters']} clusters, mean size "
                   f"{x['mean_size']:.1f}, replication {x['replication']:.3f}, "
                   f"{x['hot_clusters']} hot")


@main.command()
@click.option("--dir", "workdir", type=click.Path(), default="demo-store", show_default=True,
              help="The store directory (disk files under DIR/disks); a store there is "
                   "replaced.")
@click.option("--disks", type=int, default=4, show_default=True, help="Number of disk files.")
@click.option("--model", type=click.Path(), default=None,
              help="Local HF model directory (default: the decoder trained for swarmfs, "
                   "swarm-llama; with --minilm: all-MiniLM-L6-v2).")
@click.option("--kind", type=click.Choice(["python", "prose", "both"]), default="both",
              show_default=True, help="Held-out text to decode over (decoder demo).")
@click.option("--context", type=click.IntRange(min=2), default=None,
              help="Tokens of context to store (default 8192; with --minilm 16384).")
@click.option("--evaluate", type=click.IntRange(min=1), default=128, show_default=True,
              metavar="N", help="Continuation tokens decoded, one step each (decoder demo).")
@click.option("--minilm", is_flag=True,
              help="The capture example instead: MiniLM (an encoder) over 512-token "
                   "windows side by side, retrieval for held-out queries (no decoding).")
@click.option("--text", "text_file", type=click.Path(), default=None,
              help="--minilm: text file (default: the Python standard library's docstrings).")
@click.option("--eval-queries", type=int, default=64, show_default=True,
              help="--minilm: held-out queries (the tokens after the context).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_layout_options
@ENGINE_OPT
@click.pass_context
def demo(ctx, workdir, disks, model, kind, context, evaluate, minilm, text_file, eval_queries,
         as_json, ratio, tau, metric, local_window, hot_fraction, engine):
    """The main job: decode long held-out inputs with the KV cache on N disk files.

    The decoder trained for swarmfs reads a held-out context (8192 tokens of
    Python source and of prose), its KV is laid out by co-activation of the
    prompt's own queries and written to the disks, and the next N tokens are
    teacher-forced through dense attention and through swarmfs.  Prints
    perplexity, attention-mass recall against the oracle and the per-token
    step time of both.  --minilm runs the earlier capture example instead.
    (--tau, --metric, --local-window, --hot-fraction, --text and
    --eval-queries apply to --minilm; --kind and --evaluate to the decoder.)
    """
    if minilm:
        _refuse_given(ctx, ("kind", "evaluate"), "with --minilm (the capture example "
                      "decodes nothing)")
    else:
        _refuse_given(ctx, ("tau", "metric", "local_window", "hot_fraction", "text_file",
                            "eval_queries"),
                      "without --minilm (the decoder demo lays out with SwarmCache's defaults)")
    from ._validate import parse_int
    parse_int(disks, "disks", 1, 256)         # before the model loads (Store.create's rule)
    params = _params(ratio, tau, metric, local_window, hot_fraction)
    if not minilm:
        _demo_decode(workdir, disks, model, kind, context or 8192, evaluate, ratio, engine,
                     as_json)
        return
    from ._demo import render, run_capture_demo
    from .layout import _capture as C
    text = C.read_text(text_file) if text_file else None
    rep = run_capture_demo(workdir, model=model, text=text, text_source=text_file, disks=disks,
                   context=context or 16384, eval_queries=eval_queries, params=params,
                   engine=engine, progress=not as_json)
    if as_json:
        click.echo(json.dumps(rep, indent=1, default=float))
    else:
        render(rep)


def _demo_decode(workdir, disks, model, kind, context, evaluate, ratio, engine, as_json):
    from transformers.utils import logging as hf_logging

    from ._demo import run_demo
    hf_logging.disable_progress_bar()
    kinds = ("python", "prose") if kind == "both" else (kind,)

    def progress(k):
        if not as_json:
            click.echo(f"decoding held-out {k}: {context} tokens of context on {disks} "
                       f"disks, {evaluate} continuation tokens, r = {ratio} ...", err=True)
    rep = run_demo(kinds, context=context, evaluate=evaluate, model_dir=model,
                     store=workdir, disks=disks, ratio=ratio, engine=engine,
                     on_progress=progress)
    if as_json:
        click.echo(json.dumps(rep, indent=1, default=float))
        return
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"dense attention vs swarmfs ({rep['model']}, r = {ratio}, "
                    f"{rep['disks']} disks)")
    for c in ("text", "context", "steps", "ppl dense", "ppl swarmfs", "Δ ppl",
              "recall", "dense ms/token", "swarmfs ms/token", "CPU µs/step", "I/O µs/step",
              "SSD MB/step", "DRAM MB", "entries/cluster", "DRAM/KV", "mean read"):
        t.add_column(c, justify="left" if c == "text" else "right")
    for k, r in rep["runs"].items():
        s = r["summary"]
        cpu = sum(s.get(f, 0.0) or 0.0 for f in ("score_us", "select_us", "plan_us",
                                                 "assemble_us"))
        t.add_row(k, str(r["context_tokens"]), str(r["continuation_tokens"]),
                  f"{r['perplexity_dense']:.2f}", f"{r['perplexity_swarm']:.2f}",
                  f"{100 * (r['perplexity_swarm'] / r['perplexity_dense'] - 1):+.1f}%",
                  f"{r['recall']:.3f}", f"{r['dense_step_ms']:.1f}",
                  "-" if r["swarm_step_ms"] is None else f"{r['swarm_step_ms']:.1f}",
                  f"{cpu:.0f}", f"{s.get('io_us', 0.0):.0f}",
                  f"{s.get('bytes_read', 0.0) / 1e6:.2f}", f"{s['dram_bytes'] / 1e6:.1f}",
                  *_operating_point(s))
    Console(width=max(Console().width, 200)).print(t)
    click.echo("recall: attention mass of the retrieved entries / mass of the oracle's "
               "exact top-k (k = ceil(r x context)), mean over layers and steps.  Step "
               "times are medians per token over all layers (attention, MLP, retrieval); "
               "CPU µs (score + select + plan + assemble) and I/O µs are medians per "
               "step summed over layers.")


def _operating_point(summary: dict) -> tuple[str, str, str]:
    """Issue 23's operating point from ``SwarmCache.summary()``: mean entries
    per cluster (smallest layer's), DRAM as a share of the KV, mean read."""
    epc, lo = summary.get("entries_per_cluster"), summary.get("entries_per_cluster_min")
    share, read = summary.get("dram_share"), summary.get("mean_read_bytes")
    return ("-" if epc is None else f"{epc:.1f} (min {lo:.1f})",
            "-" if share is None else f"{100 * share:.1f}%",
            "-" if read is None else _human(read))


@main.command()
@click.argument("store", type=click.Path())
@click.argument("mountpoint", type=click.Path())
@click.option("--foreground", "-f", is_flag=True, help="Serve in this process until unmounted.")
@click.option("--allow-other", is_flag=True, help="Let other users read the mount.")
@click.option("--debug", is_flag=True, help="Log every FUSE request to stderr.")
@click.option("--direct-io", is_flag=True,
              help="Bypass the page cache for KV files (shared mmap then fails with ENODEV; "
                   "private mmap, np.load(mmap_mode='c'), works).")
@click.option("--snapshot", is_flag=True,
              help="Show the store as committed at mount time (default: follow it; new "
                   "generations appear without remounting).")
@click.option("--poll-interval", type=FiniteFloat(0.01, 3600), default=0.2,
              show_default=True, help="Seconds between manifest polls when following.")
@click.option("--readahead", type=click.IntRange(0, 1 << 40), default=16 << 20,
              show_default=True,
              help="Read-ahead window for sequential readers, in bytes (0 = off).")
@click.option("--no-verify", is_flag=True, help="Do not verify checksums on read.")
@click.option("--log-file", type=click.Path(), default=None,
              help="Daemon log file (default $TMPDIR/swarmfs-mount-<mountpoint>.log).")
@ENGINE_OPT
def mount(store, mountpoint, foreground, allow_other, debug, direct_io, snapshot,
          poll_interval, readahead, no_verify, log_file, engine):
    """Mount STORE read-only at MOUNTPOINT (FUSE): ls, cat and np.load the clusters.

    Without --foreground the command returns once the mount is up.  Unmount
    with `swarmfs umount MOUNTPOINT`.  The mount follows the store: a newly
    committed generation (write or append) becomes visible within about a
    poll interval, while open files keep reading the generation they were
    opened on; --snapshot keeps the mount-time view.
    """
    try:
        from .mount._fuse import default_log_file
        from .mount._fuse import mount as do_mount
    except ImportError as exc:
        raise click.ClickException(f"mounting needs pyfuse3 and trio "
                                   f"(pip install 'swarmfs[mount]'): {exc}") from None
    if not foreground and log_file is None:
        log_file = default_log_file(mountpoint)
    pid = do_mount(store, mountpoint, foreground=foreground, allow_other=allow_other,
                   debug=debug, direct_io=direct_io, readahead=readahead,
                   verify=not no_verify, engine=engine, log_file=log_file,
                   snapshot=snapshot, poll_interval=poll_interval)
    if pid:
        click.echo(f"mounted {store} at {mountpoint} (pid {pid}, log {log_file}); "
                   f"unmount with: swarmfs umount {mountpoint}")


@main.command()
@click.argument("mountpoint", type=click.Path())
@click.option("--lazy", "-z", is_flag=True,
              help="Detach now even if busy or dead (fusermount3 -u -z).")
def umount(mountpoint, lazy):
    """Unmount a swarmfs mount (also a dead one, with --lazy)."""
    from .mount._fuse import umount as do_umount
    do_umount(mountpoint, lazy=lazy)



# -- generate (swarmfs.hf): decode a causal LM with its KV on the store ------------

_STEP_COLS = (("step", "step", "{}"), ("clusters", "clusters", "{:.0f}"),
              ("hot", "hot", "{:.0f}"), ("SSD entries", "entries_ssd", "{:.0f}"),
              ("DRAM new", "pending", "{:.0f}"), ("bytes", "bytes_read", None),
              ("requests", "requests", "{:.0f}"), ("score µs", "score_us", "{:.0f}"),
              ("select µs", "select_us", "{:.0f}"), ("plan µs", "plan_us", "{:.0f}"),
              ("I/O µs", "io_us", "{:.0f}"), ("assemble µs", "assemble_us", "{:.0f}"),
              ("session µs", "session_us", "{:.0f}"), ("attend µs", "attend_us", "{:.0f}"),
              ("cache hit", "cache_hit_rate", "{:.2f}"), ("prefetch hit", "prefetch_hit",
                                                          "{:.2f}"))


def _given(ctx, name: str) -> bool:
    """Whether option ``name`` was given (command line or environment), not
    left at its default."""
    from click.core import ParameterSource
    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE,
                                              ParameterSource.ENVIRONMENT)


def _refuse_given(ctx, names, why: str) -> None:
    """A usage error (exit 2, before any work) naming the given options of
    ``names`` that do not apply."""
    opts = {p.name: p.opts[0] for p in ctx.command.params}
    bad = [opts[n] for n in names if _given(ctx, n)]
    if bad:
        raise click.UsageError(f"{', '.join(bad)} {'does' if len(bad) == 1 else 'do'} not "
                               f"apply {why}")


class _PrefillBars:
    """rich progress bars (stderr) for a prefill's dense attention, layout and
    write, per layer and row: ``SwarmCache(progress=...)``.  Stopped once the
    write is done, before the decoded text streams; off unless stderr is a
    terminal."""

    LABELS = {"prefill": "prefill (dense attention)", "layout": "layout (co-activation)",
              "write": "write (disks)"}

    def __init__(self, enabled: bool, console=None):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
        self.bars = Progress(TextColumn("{task.description:<28}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(),
                             console=console or Console(stderr=True), disable=not enabled)
        self.tasks: dict = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self.tasks:
            if not self.tasks:
                self.bars.start()
            self.tasks[stage] = self.bars.add_task(self.LABELS.get(stage, stage), total=total)
        self.bars.update(self.tasks[stage], completed=done, total=total)
        if stage == "write" and done >= total:
            self.bars.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bars.stop()


def _step_table(rows, title, max_rows=24):
    from rich.table import Table
    t = Table(*(c for c, _, _ in _STEP_COLS), title=title)
    show = rows if len(rows) <= max_rows else rows[:max_rows // 2] + rows[-max_rows // 2:]
    for i, r in enumerate(show):
        if len(rows) > max_rows and i == max_rows // 2:
            t.add_row("…", *[""] * (len(_STEP_COLS) - 1))
        t.add_row(*(("-" if r.get(k) is None else _human(r[k]) if fmt is None
                     else fmt.format(r[k])) for _, k, fmt in _STEP_COLS))
    return t


@main.command()
@click.option("--model", type=click.Path(), default=None,
              help="Local transformers causal LM (Llama/Qwen2/Qwen3/Mistral; default: the "
                   "decoder trained for swarmfs, swarmfs.models.DEFAULT_DECODER).")
@click.option("--prompt-file", type=click.Path(), required=True, help="Prompt text file.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Tokens to generate (greedy).")
@click.option("--ratio", type=float, default=defaults.RATIO, show_default=True,
              help="Sparsity ratio r: profile top-k and per-step entry budget (§8.1).")
@click.option("--disks", type=int, default=None,
              help="Number of file disks under STORE/disks (default 4; not with --disk).")
@click.option("--disk", "disk_paths", multiple=True, type=click.Path(),
              help="A disk path (file or block device); repeat for each disk.")
@click.option("--store", type=click.Path(), default=None,
              help="Store directory (default: a temporary one, removed afterwards, also on "
                   "Ctrl-C or SIGTERM).  A new store keeps the prompt; an existing one is "
                   "served: the prompt must continue its stored document (checked), which "
                   "is not prefilled again.")
@click.option("--force", is_flag=True, help="Replace an existing store / foreign disks.")
@click.option("--prefetch", type=click.Choice(["none", "previous"]), default="none",
              show_default=True,
              help="§7 layer-pipelined prefetch with the previous step's query.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]),
              default="float32", show_default=True, help="Model and KV dtype.")
@click.option("--evaluate", type=click.IntRange(min=1), default=None, metavar="N",
              help="Hold out the last N tokens of the prompt file and compare perplexity "
                   "and attention-mass recall, dense against swarmfs (teacher-forced).")
@click.option("--sinks", type=click.IntRange(min=0), default=None,
              help="Attention sinks: the first N tokens stay in DRAM and are attended at "
                   f"every step (default {defaults.ATTENTION_SINKS}; 0: off).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@ENGINE_OPT
@click.pass_context
def generate(ctx, model, prompt_file, max_new_tokens, ratio, disks, disk_paths, store, force,
             prefetch, dtype, evaluate, sinks, as_json, engine):
    """Decode with the KV cache on swarmfs (swarmfs.hf.SwarmCache).

    The prompt is prefilled densely, laid out by co-activation of its own
    queries and written to the disks; each decode step retrieves per layer
    (window + hot clusters + one batched SSD read).  Streams the text, then
    prints a per-step table (sums over layers).  With --store naming an
    existing store, the stored document is served instead: the prompt must
    continue it.
    """
    from . import _generate as G
    if disks is not None and disk_paths:
        raise click.UsageError("give either --disks N (disk files under STORE/disks) or "
                               "--disk PATH ..., not both")
    from ._validate import parse_int, parse_ratio
    parse_ratio(ratio, "ratio")
    if disks is not None:             # before the model loads (Store.create's rule)
        parse_int(disks, "disks", 1, 256)
    if evaluate is not None:
        _refuse_given(ctx, ("max_new_tokens",), "with --evaluate N (it teacher-forces the "
                      "prompt file's last N tokens; nothing new is decoded)")
    if G.is_store(store) and not force:
        if evaluate is not None:
            raise click.UsageError(f"--store {store} holds a store; --evaluate lays out a "
                                   "context of its own: give a new --store, or --force to "
                                   "replace it")
        _refuse_given(ctx, ("disks", "disk_paths"), f"to the stored document in {store}: it "
                      "keeps its disks (--force replaces it)")
    try:
        with open(prompt_file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.InvalidArgumentError(f"cannot read --prompt-file {prompt_file}: "
                                          f"{exc}") from None
    dk = _disks_arg(disk_paths, disks)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    from rich.console import Console
    con = Console(width=max(Console().width, 200))

    def warn(message):
        click.echo(f"swarmfs: warning: {message}", err=True)
    bars = _PrefillBars(sys.stderr.isatty())
    if evaluate is not None:
        with bars:
            rep = G.run_evaluate(text, evaluate, model_dir=model, store=store, disks=dk,
                                 ratio=ratio, force=force, engine=engine, prefetch=prefetch,
                                 dtype=dtype, on_warning=warn, progress=bars, sinks=sinks)
        if as_json:
            click.echo(json.dumps(rep, indent=1, default=float))
            return
        con.print(f"context {rep['context_tokens']} tokens, continuation "
                  f"{rep['continuation_tokens']} tokens, r = {ratio}")
        from rich.table import Table
        t = Table("", "dense", "swarmfs")
        t.add_row("perplexity", f"{rep['perplexity_dense']:.3f}",
                  f"{rep['perplexity_swarm']:.3f}")
        t.add_row("attention-mass recall", "1.000", f"{rep['recall']:.3f}")
        t.add_row("step time (ms, median)", f"{rep['dense_step_ms']:.1f}",
                  "-" if rep["swarm_step_ms"] is None else f"{rep['swarm_step_ms']:.1f}")
        con.print(t)
        con.print("recall per layer: " + ", ".join(
            f"{k}: {v:.3f}" for k, v in rep["recall_per_layer"].items()))
        con.print(_step_table(rep["steps"], "teacher-forced decode steps (sums over layers)"))
        return
    stream = None if as_json else (lambda s: click.echo(s, nl=False))
    with bars:
        rep = G.run_generate(text, model_dir=model, store=store, disks=dk, ratio=ratio,
                             max_new_tokens=max_new_tokens, force=force, engine=engine,
                             prefetch=prefetch, dtype=dtype, on_text=stream, on_warning=warn,
                             progress=bars, sinks=sinks)
    if rep["hint"]:
        click.echo(f"swarmfs: {rep['hint']}", err=True)
    if as_json:
        click.echo(json.dumps(rep, indent=1, default=float))
        return
    click.echo()
    s = rep["summary"]
    how = (f"served the stored document ({rep['reused']['tokens']} tokens) from "
           f"{rep['reused']['store']}" if rep["reused"] else
           f"prompt {rep['prompt_tokens']} tokens on {rep['disks']} disks")
    con.print(f"{how}, r = {ratio}; {len(rep['tokens'])} tokens in {rep['wall_s']:.2f} s "
              f"(layout + write {rep['layout_write_s']:.2f} s); DRAM "
              f"{_human(s['dram_bytes'])}; cache hit rate {s.get('cache_hit_rate', 0):.2f}")
    epc, share, read = _operating_point(s)
    con.print(f"operating point: {epc} entries per cluster, DRAM {share} of the prompt's KV, "
              f"mean read {read}")
    con.print(_step_table(rep["steps"], "decode steps (sums over layers)"))


if __name__ == "__main__":
    main()
