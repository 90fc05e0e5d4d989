"""The plots of a sweep's report (framework.report): loss curves (training loss per step,
validation loss per evaluation, one line per run, on integer step ticks, with each run's
difference from the runs' mean beneath), throughput, memory and communication bars, each bar
named by the run's overrides that set it apart."""

from __future__ import annotations

import logging
from pathlib import Path

MB = 1e6
MEMORY_KINDS = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes")
STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def speed(run) -> float | None:
    """The figure that ranks runs by speed: tokens/s for sequence models, else samples/s."""
    rates = run.summary.get("throughput") or {}
    return rates.get("tokens_per_s") or rates.get("samples_per_s")


def mean_by_step(series: list[list[tuple[int, float]]]) -> dict[int, float]:
    """The mean over the curves at each step that two or more of them have."""
    values: dict[int, list[float]] = {}
    for points in series:
        for step, value in points:
            values.setdefault(step, []).append(value)
    return {step: sum(v) / len(v) for step, v in values.items() if len(v) > 1}


def curves(plt, runs: list, series: list[list[tuple[int, float]]], title: str):
    """One line per run through its (step, loss) points, on integer step ticks, each run with its
    own line style and marker; beneath, each run's difference from the runs' mean at each step:
    runs whose losses agree to the second decimal draw one line above, apart below."""
    from matplotlib.ticker import MaxNLocator

    drawn = [(run, points) for run, points in zip(runs, series, strict=True) if points]
    mean = mean_by_step([points for _, points in drawn])
    fig, axes = plt.subplots(2 if mean else 1, 1, figsize=(7, 6 if mean else 4), sharex=True, squeeze=False,
                             height_ratios=(2, 1) if mean else None)  # fmt: skip
    top = axes[0][0]
    for i, (run, points) in enumerate(drawn):
        style = {"linestyle": STYLES[i % len(STYLES)], "marker": MARKERS[i % len(MARKERS)],
                 "markevery": max(1, len(points) // 12), "color": f"C{i % 10}"}  # fmt: skip
        top.plot(*zip(*points, strict=True), label=f"{run.name}: {run.label}"[:60] + ("" if run.ok else " (failed)"),
                 **style)  # fmt: skip
        apart = [(step, value - mean[step]) for step, value in points if step in mean]
        if apart:
            axes[1][0].plot(*zip(*apart, strict=True), **style)
    top.set(ylabel="loss", title=title)
    if mean:
        axes[1][0].axhline(0, color="0.6", linewidth=0.8)
        axes[1][0].set(ylabel="loss - mean of runs")
    axes[-1][0].set(xlabel="optimizer step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    if top.lines:
        top.legend(fontsize=7)
    return fig


def bars(ax, ok: list, values: list[float], bottom: list[float] | None = None, **kw) -> None:
    """One bar per finished run, named by the overrides that set it apart (framework.report's
    label_runs), one per line."""
    positions = list(range(len(ok)))
    ax.bar(positions, values, bottom=bottom, **kw)
    ax.set_xticks(positions, [r.label.replace(",", "\n") or r.name for r in ok], fontsize=7)


def stacked(ax, ok: list, series: dict[str, list[float]]) -> None:
    """Bars stacked by part (memory by kind, payload by collective), a legend naming the parts."""
    bottom = [0.0] * len(ok)
    for name, values in series.items():
        bars(ax, ok, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]


def comm(plt, ok: list):
    """The payload handed to each collective per step, stacked, and the wire total the report's
    table shows (the ring algorithms' bytes on the links for that payload) marked on each bar."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ops = sorted({op for r in ok for op in ((r.summary.get("comm") or {}).get("by_op") or {})})
    by_op = [(r.summary.get("comm") or {}).get("by_op") or {} for r in ok]
    stacked(ax, ok, {op: [held.get(op, {}).get("bytes", 0) / MB for held in by_op] for op in ops})
    wire = [(r.summary.get("comm") or {}).get("wire_bytes") for r in ok]
    if any(w is not None for w in wire):
        ax.plot(range(len(ok)), [w / MB if w is not None else float("nan") for w in wire], "k_", markersize=24,
                markeredgewidth=2, label="wire total (ring model; the report's comm wire MB)")  # fmt: skip
    ax.set(ylabel="MB per step: payload by collective", title="Communication per step")
    if ops or ax.lines:
        ax.legend(fontsize=7)
    return fig


def plot(runs: list, out_dir: Path) -> list[str]:
    """The comparison plots as PNGs in `out_dir` (loss, validation loss with eval on, throughput,
    memory, communication); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    # matplotlib's INFO lines are not the report's: a fresh font cache's "generated new fontManager"
    # reaches the console through the root logger Hydra sets to INFO
    logging.getLogger("matplotlib").setLevel(max(logging.WARNING, logging.getLogger("matplotlib").level))
    import matplotlib.pyplot as plt

    ok = [r for r in runs if r.ok]
    paths = []

    def save(fig, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(str(path))

    save(curves(plt, runs, [r.losses for r in runs], "Loss"), "loss.png")
    history = [[(h["step"], h["loss"]) for h in (r.summary.get("eval") or {}).get("history", [])] for r in runs]
    if any(history):  # runs with eval.every: their validation curves
        save(curves(plt, runs, history, "Validation loss"), "val_loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    unit = "tokens/s" if any((r.summary.get("throughput") or {}).get("tokens_per_s") for r in ok) else "samples/s"
    bars(ax, ok, [speed(r) or 0 for r in ok], color="tab:blue")
    ax.set(ylabel=unit, title=f"Throughput ({unit})")
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    memory = {
        k.removesuffix("_bytes"): [((r.summary.get("memory") or {}).get(k) or 0) / MB for r in ok] for k in MEMORY_KINDS
    }
    stacked(ax, ok, memory)
    ax.set(ylabel="MB per rank", title="Memory per rank")
    ax.legend(fontsize=7)
    save(fig, "memory.png")
    save(comm(plt, ok), "comm.png")
    return paths
