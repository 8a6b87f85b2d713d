"""The paper's evaluation (SWARM §8): one module per figure or table, run as
``python -m tools.bench.<name>`` from the repository root, each with a
``summary(payload)`` that writes its section of ``run_all``'s Markdown
summary; shared machinery in the :mod:`tools.bench._common` package.
Results: docs/benchmarks.md §7."""
