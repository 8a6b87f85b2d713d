"""``python -m tools``: every developer tool as one click command.

    python -m tools bench_engine --repeats 7 --out bench-out/engine
    python -m tools bench fig11_methods --smoke --disks files:2
    python -m tools bench run_all --smoke --disks files:2

Each subcommand is the ``cli`` of its module, imported only when it runs (so
``--help`` does not load torch); ``python -m tools.bench_engine ...`` runs the
same command.
"""

from __future__ import annotations

import importlib
import sys

import click

#: subcommand -> (module, one line of help)
TOOLS = {
    "bench_decode": ("tools.bench_decode", "decoding with the KV cache on swarmfs"),
    "bench_engine": ("tools.bench_engine", "the I/O engine against fio; reader isolation"),
    "bench_layout": ("tools.bench_layout", "offline layout: scale and recall"),
    "bench_metadata": ("tools.bench_metadata", "cost of the metadata checks"),
    "bench_mount": ("tools.bench_mount", "the FUSE mount against the fast path"),
    "bench_select": ("tools.bench_select", "selection latency and planning time"),
    "fuzz_store": ("tools.fuzz_store", "fuzz a store's metadata"),
    "train_decoder": ("tools.train_decoder", "train the decoder swarm-llama"),
    "eval_decoder": ("tools.eval_decoder", "evaluate the decoder on held-out text"),
    "eval_context": ("tools.eval_context", "does the decoder use its long context (dense)"),
    "suite": ("tools.suite", "the long-context task suite, every method"),
    "frontier": ("tools.frontier", "the cost/quality frontier of cluster retrieval"),
}
#: the paper's evaluation, ``python -m tools bench NAME``
FIGURES = {
    "run_all": "every figure, then a Markdown summary",
    "fig11_methods": "Fig. 11: methods", "fig12_clustering": "Fig. 12: clustering",
    "fig13_placement": "Fig. 13: placement", "fig14_retrieval": "Fig. 14: retrieval",
    "fig16_prefix_batch": "Fig. 16: prefix and batch", "fig17_ssd_type": "Fig. 17: SSD type",
    "fig18_num_disks": "Fig. 18: number of disks", "fig19_tau": "Fig. 19: tau",
    "fig20_sparsity": "Fig. 20: sparsity", "table4_selection": "Table 4: selection",
}


class LazyGroup(click.Group):
    """A group whose subcommands are modules' ``cli`` commands, imported when
    one runs.  The subcommand's arguments become ``ctx.obj``: the command
    line the tools record in their JSON."""

    def __init__(self, *a, commands: dict[str, tuple[str, str]], **kw):
        super().__init__(*a, **kw)
        self.lazy = commands

    def list_commands(self, ctx):
        return sorted(self.lazy) + sorted(super().list_commands(ctx))

    def get_command(self, ctx, name):
        if name not in self.lazy:
            return super().get_command(ctx, name)
        return importlib.import_module(self.lazy[name][0]).cli

    def format_commands(self, ctx, formatter):
        rows = [(n, h) for n, (_, h) in sorted(self.lazy.items())]
        rows += [(n, c.get_short_help_str()) for n, c in sorted(self.commands.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def parse_args(self, ctx, args):
        ctx.obj = list(args[1:])
        return super().parse_args(ctx, args)


@click.group(cls=LazyGroup, commands=TOOLS,
             help="swarmfs's developer tools, one command each (NAME --help).")
def cli():
    pass


@cli.group(cls=LazyGroup, help="the paper's evaluation (SWARM §8), one command per figure",
           commands={n: (f"tools.bench.{n}", h) for n, h in FIGURES.items()})
def bench():
    pass


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line, as a program)."""
    return cli.main(args=argv, prog_name="python -m tools", standalone_mode=argv is None)


if __name__ == "__main__":
    sys.exit(main())
