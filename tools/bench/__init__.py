"""The paper's evaluation (SWARM §8): one module per figure or table, run as
``python -m tools.bench.<name>`` from the repository root; shared machinery in
:mod:`tools.bench._common`.  Results: docs/benchmarks.md §7."""
