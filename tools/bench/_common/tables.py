"""Tables: plain columns for progress on stderr, GitHub Markdown for
``run_all``'s summary, and the cells the figures' summaries share."""

from __future__ import annotations


def table(rows, headers, *, markdown: bool = False, align=None) -> str:
    """Rows as a table (``tabulate``): GitHub Markdown (``markdown=True``,
    the summary of docs/benchmarks.md §7) or plain columns (progress on
    stderr).  Cells are written as given (format numbers before)."""
    from tabulate import tabulate
    return tabulate(rows, headers, tablefmt="pipe" if markdown else "simple",
                    colalign=align, disable_numparse=True)


# -- the cells and tables of run_all's Markdown summary ---------------------------------

def md_table(rows, headers, left: int = 1) -> str:
    """A Markdown table (:func:`table`): the first ``left`` columns
    left-aligned, the rest (numbers) right-aligned."""
    align = ("left",) * left + ("right",) * (len(headers) - left)
    return table(rows, headers, markdown=True, align=align)


def ms_cell(us) -> str:
    """Microseconds as milliseconds with two decimals; ``-`` for None."""
    return f"{us / 1e3:.2f}" if us is not None else "-"


def num_cell(v) -> str:
    """A float with three decimals, anything else as ``str``."""
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def measure_cell(key: str, v) -> str:
    """A summarised measure by its key: ``io_us*`` in ms, ``bytes*`` in MB,
    others with three decimals; ``-`` for None."""
    if v is None:
        return "-"
    if key.startswith("io_us"):
        return f"{v / 1e3:.2f} ms"
    if key.startswith("bytes"):
        return f"{v / 1e6:.2f} MB"
    return f"{v:.3f}"


def variant_table(j: dict, title: str, keys) -> str:
    """The Markdown section of an ablation figure (Figs. 12-14): a row per
    variant of ``j["variants"]`` with its ``keys`` and its ratios to SWARM
    (``j["ratios"]``, the paper's left out)."""
    rows = []
    for n, x in j["variants"].items():
        rr = j.get("ratios", {}).get(n, {})
        vs = ", ".join(f"{k} {v:.2f}" for k, v in rr.items() if isinstance(v, float)
                       and not k.startswith("paper"))
        rows.append((n, *(measure_cell(k, x.get(k)) for k in keys), vs or "-"))
    return "\n".join([f"### {title} (S = {j['tokens']}, {j['disks']['count']} disks)\n",
                      md_table(rows, ("variant", *keys, "vs SWARM")), ""])
