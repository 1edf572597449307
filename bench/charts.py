"""Chart pieces the benchmarks' plots share, so each plot says only what it shows."""

from __future__ import annotations

from typing import Any


def grouped_bars(ax: Any, series: dict[str, list[float]], tick_labels: list[str]) -> None:
    """One panel of bars on the matplotlib axes ``ax``: a group per arm (``tick_labels``, in the order of
    every series' values), one bar per series in the group, and a legend when there are several."""
    width = 0.8 / len(series)
    for k, (key, values) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(tick_labels))], values, width, label=key)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(tick_labels))])
    ax.set_xticklabels(tick_labels, fontsize=8)
    if len(series) > 1:
        ax.legend(fontsize=7)


def subplots(rows: int, cols: int, figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A figure meant for a file (matplotlib's Agg backend: no display needed) and its axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=figsize)


def save(fig: Any, png: Any) -> None:
    """Lay the figure out, write it as a PNG and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
