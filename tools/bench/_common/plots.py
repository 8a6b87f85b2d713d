"""The figures' plots (matplotlib, Agg): one figure of panels, lines,
the ablation figures' bars, the fio ceiling lines."""

from __future__ import annotations

import contextlib
import pathlib
import sys


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_fig(fig, out: pathlib.Path) -> pathlib.Path:
    """Save ``fig`` as ``out.png`` (tight layout, 100 dpi) and say so on stderr."""
    p = out.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(p, dpi=100)
    print(f"wrote {p}", file=sys.stderr)
    return p


@contextlib.contextmanager
def figure(out: pathlib.Path, panels: int, size: tuple, title: str, *, grid: str | None = "both",
           legend: float | None = None):
    """One figure of ``panels`` side by side: yields the axes (a list); on
    exit every panel gets a light grid (``grid``: ``"both"``, ``"y"`` or
    None) and a legend of font size ``legend`` (None: none), the figure its
    title, and it is saved as ``out.png``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False)
    axes = list(axes[0])
    yield axes
    for ax in axes:
        if grid:
            ax.grid(axis=grid, alpha=.3)
        if legend:
            ax.legend(fontsize=legend)
    fig.suptitle(title, fontsize=11)
    save_fig(fig, out)


def lines(ax, x, series: dict, style: str = "o-", *, scale: float = 1.0):
    """One line per label: ``series`` is ``{label: y values}`` over ``x``
    (each y divided by ``scale``, e.g. 1e3 for µs to ms)."""
    for label, ys in series.items():
        ax.plot(x, [y / scale for y in ys], style, label=label)


def variant_bars(p: dict, out: pathlib.Path, labels: dict, panels, title: str,
                 size=(12, 3.8), *, tick_size: float | None = None):
    """The ablation figures (12-14): one bar panel per measure over the
    variants of ``p["variants"]``.  ``panels`` is ``[(key, scale, title,
    ceiling)]``: the variant's ``key`` divided by ``scale``, with the fio
    ceiling lines of ``p["ceiling"]`` when ``ceiling``."""
    names = list(p["variants"])
    lab = [labels.get(n, n) for n in names]
    with figure(out, len(panels), size, title, grid="y") as axes:
        for i, (ax, (key, scale, sub, ceil)) in enumerate(zip(axes, panels, strict=True)):
            ax.bar(lab, [p["variants"][n][key] / scale for n in names], color=f"C{i}")
            if ceil:
                ceiling_lines(ax, p["ceiling"])
                if p["ceiling"]:
                    ax.legend(fontsize=7)
            ax.set_title(sub, fontsize=10)
            if tick_size:
                ax.tick_params(axis="x", labelsize=tick_size)


def bar_plot(labels: dict, panels, title: str, **kw):
    """The ``plot(payload, out)`` of an ablation figure: :func:`variant_bars`
    with ``panels``, titled ``"<title>, S = <tokens>, <N> disks"`` (``kw``:
    its ``size``, ``tick_size``)."""
    def plot(p, out):
        variant_bars(p, out, labels, panels,
                     f"{title}, S = {p['tokens']}, {p['disks']['count']} disks", **kw)
    return plot


def ceiling_lines(ax, ceil: dict, *, unit: float = 1.0):
    """Dashed horizontal lines at the fio ceilings (GB/s)."""
    for key, style, label in (("bw_128k", "--", "fio 128 KiB"), ("iops_4k", ":", "fio 4 KiB")):
        c = (ceil or {}).get(key)
        if c:
            ax.axhline(c["gb_per_s"] * unit, ls=style, color="gray", lw=1,
                       label=f"{label} ceiling {c['gb_per_s']:.2f} GB/s")
