#!/usr/bin/env python3
"""Cost of the metadata checks (issue 9): Store.open, append and write_layer.

Prints one JSON line of medians (wall µs/ms, CPU µs from getrusage).  To
compare two versions side by side, run it alternately with PYTHONPATH set to
each source tree (from a directory outside both), under /work/bench-exclusive.

    tools/dev run python -m tools.bench_metadata /tmp/bench-st
"""

import json
import resource
import shutil
import time

import click
import numpy as np

from swarmfs import Store
from tools._options import clear_store_dir


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(root: str) -> dict:
    rng = np.random.default_rng(0)
    S, H, d = 16384, 2, 64
    kv = rng.standard_normal((S, 2, H, d)).astype(np.float16)
    cl = np.array_split(rng.permutation(S), 512)
    res = {}
    clear_store_dir(root)
    s = Store.create(root, disks=4, num_layers=2, num_kv_heads=H, head_dim=d)
    t = time.perf_counter()
    s.write_layer(0, kv, cl)
    res["write_layer_ms"] = (time.perf_counter() - t) * 1e3
    wall, cpu = [], []
    for i in range(60):
        t, c = time.perf_counter(), _cpu()
        s.append(0, kv[:4], [[i % 512], [], [], []], new_cluster_size=4)
        wall.append((time.perf_counter() - t) * 1e6)
        cpu.append((_cpu() - c) * 1e6)
    res["append_us_median"] = float(np.median(wall))
    res["append_cpu_us_median"] = float(np.median(cpu))
    s.close()
    op = []
    for _ in range(30):
        t = time.perf_counter()
        Store.open(root).close()
        op.append((time.perf_counter() - t) * 1e6)
    res["open_us_median"] = float(np.median(op))
    shutil.rmtree(root, ignore_errors=True)
    return res


@click.command(help=__doc__.split("\n\n")[0])
@click.argument("root", default="/tmp/swarmfs-bench-meta",
                type=click.Path(file_okay=False))
def cli(root):
    print(json.dumps(measure(root)))


def main(argv=None):
    """Run :func:`cli` (``argv`` None: the command line, as a program)."""
    return cli.main(args=argv, obj=argv, standalone_mode=argv is None)


if __name__ == "__main__":
    main()
