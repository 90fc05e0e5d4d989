"""Loss curves of a sweep's runs (framework.report): training loss per step, validation loss per
evaluation, one line per run, on integer step ticks."""

from __future__ import annotations


def curves(plt, runs: list, series: list[list[tuple[int, float]]], title: str):
    """One line per run through its (step, loss) points, on integer step ticks."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    for run, points in zip(runs, series, strict=True):
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, label=f"{run.name}: {run.label}"[:60], linestyle="-" if run.ok else ":",
                    marker="o" if len(points) < 20 else None)  # fmt: skip
    ax.set(xlabel="optimizer step", ylabel="loss", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.lines:
        ax.legend(fontsize=7)
    return fig
