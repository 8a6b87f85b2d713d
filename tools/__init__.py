"""swarmfs's developer tools: benchmarks, the testbed, the decoder's training.

Not part of the installed ``swarmfs`` package: run them from the repository
root as modules, e.g. ``python -m tools.bench_select`` or
``python -m tools.bench.fig11_methods --smoke --disks files:2``.  Every tool
is a click command (a module's ``cli``; its ``main(argv)`` runs it), and
``python -m tools`` gathers them in one group: ``python -m tools --help``.
"""
