"""Tables: plain columns for progress on stderr, GitHub Markdown for
``run_all``'s summary."""

from __future__ import annotations


def table(rows, headers, *, markdown: bool = False, align=None) -> str:
    """Rows as a table (``tabulate``): GitHub Markdown (``markdown=True``,
    the summary of docs/benchmarks.md §7) or plain columns (progress on
    stderr).  Cells are written as given (format numbers before)."""
    from tabulate import tabulate
    return tabulate(rows, headers, tablefmt="pipe" if markdown else "simple",
                    colalign=align, disable_numparse=True)

