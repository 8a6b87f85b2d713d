"""The figures' click commands: the shared options (:func:`command`), the
ablation figures' context (:class:`Ablation`, :func:`ablation_command`)."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import click
import numpy as np

from tools import _options as O

from .config import BLOCK_S, CACHE, DATASETS, TRACES, WARMUP_S, BenchConfig, store_dir
from .disks import Disks, ceilings, resolve_disks
from .layouts import build_layout
from .output import finish
from .runner import Bench
from .traces import Trace, context, load_trace, query_positions


def _options(disks: str) -> list:
    """The click options every figure takes (fields of :class:`BenchConfig`)."""
    return [
        click.Option(["--disks"], type=O.DiskSpec(), default=disks, show_default=True,
                     help="testbed | testbed:NAME | files:N | comma list of devices/files"),
        click.Option(["--out"], type=O.OutPath(prefix=True, path=True), default=None,
                     help="output prefix (.json, .png)"),
        click.Option(["--smoke"], is_flag=True,
                     help="tiny sizes on file disks (CI): checks the harness, not performance"),
        click.Option(["--queries"], type=O.COUNT, default=None, help="held-out queries per point"),
        click.Option(["--reps"], type=O.COUNT, default=None, help="timed repetitions per query"),
        click.Option(["--qd"], type=O.QUEUE_DEPTH, default=128, show_default=True,
                     help="engine queue depth"),
        click.Option(["--cache"], type=click.Path(path_type=pathlib.Path), default=CACHE,
                     show_default=True, help="trace/layout cache and store directories"),
        click.Option(["--trace-tokens"], type=O.COUNT, default=None,
                     help="tokens to capture (default: what the figure needs)"),
        click.Option(["--block-s"], type=O.NONNEG_FLOAT, default=None,
                     help=f"seconds per timed block (default {BLOCK_S}; smoke 0)"),
        click.Option(["--warmup-s"], type=O.NONNEG_FLOAT, default=None,
                     help=f"untimed replay before a block (default {WARMUP_S}; smoke 0)"),
        click.Option(["--trace"], type=click.Choice(TRACES), default="minilm",
                     show_default=True,
                     help="minilm: all-MiniLM-L6-v2 in 512-token windows; decoder: "
                          "swarm-llama's causal Q/K/V in 8192-token windows"),
    ]


_SHARED = ("disks", "out", "smoke", "queries", "reps", "qd", "cache", "trace_tokens",
           "block_s", "warmup_s", "trace")


def _help(doc: str) -> str:
    """A module docstring as click help: indented command examples kept as
    they are (click's ``\\b`` marker), the rest re-wrapped."""
    paras = doc.strip().split("\n\n")
    return "\n\n".join("\b\n" + p if p.startswith("    ") else p for p in paras)


def command(name: str, doc: str, *, disks: str = "testbed"):
    """Make ``f(cfg, **options)`` a figure's click command.

    The command takes the options every figure takes (``--disks --out
    --smoke --queries --reps --qd --cache --trace-tokens --block-s
    --warmup-s --trace``), frozen into a :class:`BenchConfig` passed as ``cfg``, plus
    the figure's own ``@click.option``\\ s (written below this decorator),
    passed by name.  Run it with :func:`run`.
    """
    def deco(f):
        own = list(reversed(getattr(f, "__click_params__", [])))

        def callback(**kw):
            shared = {k: kw.pop(k) for k in _SHARED}
            argv = click.get_current_context().obj or []
            smoke = shared["smoke"]
            for k, default in (("block_s", BLOCK_S), ("warmup_s", WARMUP_S)):
                if shared[k] is None:
                    shared[k] = 0.0 if smoke else default
            cfg = BenchConfig(name=name, command=" ".join(
                [f"python -m tools.bench.{name}"] + list(argv)), **shared)
            return f(cfg, **kw)

        return click.Command(name, callback=callback, params=_options(disks) + own,
                             help=_help(doc))
    return deco


def run(cmd: click.Command, argv=None):
    """Run a figure's command: from the shell (``argv`` None) as a program
    that exits; with ``argv`` (tests, run_all) it returns the payload and
    raises instead of exiting."""
    args = list(sys.argv[1:] if argv is None else argv)
    prog = f"python -m tools.bench.{cmd.name}"
    if argv is None:
        return cmd.main(args=args, prog_name=prog, obj=args)
    return cmd.main(args=args, prog_name=prog, obj=args, standalone_mode=False)


def setup(cfg: BenchConfig, name: str, *, trace_tokens: int
          ) -> tuple[Trace, Disks, pathlib.Path]:
    """Resolve the disks (file disks for a smoke run that names the
    testbed), load the trace, pick the output prefix of ``name``.  The disks
    come first, so that a testbed that is not up fails before a trace
    capture of minutes."""
    spec = "files:2" if cfg.smoke and cfg.disks.startswith("testbed") else cfg.disks
    disks = resolve_disks(spec)
    tr, out = setup_trace(cfg, name, trace_tokens=trace_tokens)
    return tr, disks, out


def setup_trace(cfg: BenchConfig, name: str, *, trace_tokens: int
                ) -> tuple[Trace, pathlib.Path]:
    """:func:`setup` without ``--disks``: for the step views, whose disks
    are their ``--step-profiles``."""
    out = cfg.prefix(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tr = load_trace(max(cfg.trace_tokens or 0, trace_tokens), kind=cfg.trace,
                    cache=cfg.cache, progress=not cfg.smoke)
    return tr, out


@dataclasses.dataclass(frozen=True)
class Ablation:
    """What an ablation figure (Figs. 12-14) starts from: its configuration,
    the trace, the disks, the output prefix, one context and the query count."""
    cfg: BenchConfig
    dataset: str
    ratio: float
    trace: Trace
    disks: Disks
    out: pathlib.Path
    start: int
    S: int
    queries: int
    reps: int

    def layout(self, method: str, **kw):
        """The context's layout by ``method`` (:func:`build_layout`; ``kw``:
        its ratio and the method's parameters)."""
        return build_layout(method, self.trace, self.start, self.S, cache=self.cfg.cache,
                            **kw)[0]

    def ceilings(self) -> dict:
        """The fio ceilings of the disks (:func:`ceilings`)."""
        return ceilings(self.disks, self.cfg.smoke)

    def bench(self, store: str, variants) -> Bench:
        """A :class:`Bench` of ``variants`` over the context, in store ``store``."""
        return Bench(store_dir(self.cfg, store), self.disks, self.trace, self.start, self.S,
                     variants, ratio=self.ratio, cfg=self.cfg)

    def positions(self) -> np.ndarray:
        """The held-out query positions (:func:`query_positions`)."""
        return query_positions(self.trace, self.start, self.S, self.queries)

    @staticmethod
    def report(res: dict, *columns) -> None:
        """A line per variant on stderr: its I/O ms, then each column
        ``(format, key, scale)`` as ``format.format(result[key] / scale)``."""
        for n, r in res.items():
            print(f"  {n:12s} I/O {r['io_us_median'] / 1e3:7.2f} ms, " +
                  ", ".join(fmt.format(r[k] / s) for fmt, k, s in columns), file=sys.stderr)

    def finish(self, figure: str, title: str, ceiling, variants: dict, ratios: dict, plot,
               **extra) -> dict:
        """Write the figure's JSON (``extra`` after the common fields) and plot."""
        payload = {"figure": figure, "title": title, "tokens": self.S,
                   "dataset": self.dataset, "ratio": self.ratio,
                   "disks": self.disks.describe(), "queries": self.queries, "reps": self.reps,
                   "ceiling": ceiling, "variants": variants, "ratios": ratios, **extra}
        return finish(self.cfg, self.out, payload, plot)


#: the figures' shared context options: ``--tokens`` (S) and ``--dataset``
tokens_option = click.option("--tokens", type=O.COUNT, default=None, help="context length S")
dataset_option = click.option("--dataset", type=click.Choice(list(DATASETS)),
                              default="wikitext2", show_default=True)


def ablation_command(name: str, doc: str):
    """:func:`command` for an ablation figure: also ``--tokens``,
    ``--dataset``, ``--ratio``; the function gets an :class:`Ablation` with
    one loaded context: 128K tokens of WikiText-2, 24 held-out queries and 3
    repetitions by default; 2K, 3 and 1 with ``--smoke``."""
    def deco(f):
        @click.option("--ratio", type=O.RATIO, default=0.1, show_default=True)
        @dataset_option
        @tokens_option
        def body(cfg, tokens, dataset, ratio):
            S = tokens or (2048 if cfg.smoke else 131072)
            trace, disks, out = setup(cfg, name, trace_tokens=4096 if cfg.smoke else 0)
            start, S = context(trace, S, dataset)
            return f(Ablation(cfg, dataset, ratio, trace, disks, out, start, S,
                              queries=cfg.queries or (3 if cfg.smoke else 24),
                              reps=cfg.reps or (1 if cfg.smoke else 3)))
        return command(name, doc)(body)
    return deco
