"""swarmfs's developer tools: benchmarks, the testbed, the decoder's training.

Not part of the installed ``swarmfs`` package: run them from the repository
root as modules, e.g. ``python -m tools.bench_select`` or
``python -m tools.bench.fig11_methods --smoke --disks files:2``.
"""
