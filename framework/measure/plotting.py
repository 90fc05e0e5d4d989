"""The plots of a sweep's report (framework.report): loss curves (training loss per step,
validation loss per evaluation, one line per run, on integer step ticks), throughput, memory and
communication bars."""

from __future__ import annotations

from pathlib import Path

MB = 1e6
MEMORY_KINDS = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes")


def speed(run) -> float | None:
    """The figure that ranks runs by speed: tokens/s for sequence models, else samples/s."""
    rates = run.summary.get("throughput") or {}
    return rates.get("tokens_per_s") or rates.get("samples_per_s")


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


def plot(runs: list, out_dir: Path) -> list[str]:
    """The comparison plots as PNGs in `out_dir` (loss, validation loss with eval on, throughput,
    memory, communication); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    ok = [r for r in runs if r.ok]
    positions = list(range(len(ok)))
    paths = []

    def bars(ax, values, bottom=None, **kw):
        ax.bar(positions, values, bottom=bottom, **kw)
        ax.set_xticks(positions, [r.name for r in ok])

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
    bars(ax, [speed(r) or 0 for r in ok], color="tab:blue")
    ax.set(xlabel="job", ylabel=unit, title=f"Throughput ({unit})")
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(ok)
    for kind in MEMORY_KINDS:
        values = [((r.summary.get("memory") or {}).get(kind) or 0) / MB for r in ok]
        bars(ax, values, bottom=bottom, label=kind.removesuffix("_bytes"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(xlabel="job", ylabel="MB per rank", title="Memory per rank")
    ax.legend(fontsize=7)
    save(fig, "memory.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ops = sorted({op for r in ok for op in ((r.summary.get("comm") or {}).get("by_op") or {})})
    bottom = [0.0] * len(ok)
    for op in ops:
        values = [(((r.summary.get("comm") or {}).get("by_op") or {}).get(op, {}).get("bytes", 0)) / MB for r in ok]
        bars(ax, values, bottom=bottom, label=op)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(xlabel="job", ylabel="payload MB per step", title="Communication by collective")
    if ops:
        ax.legend(fontsize=7)
    save(fig, "comm.png")
    return paths
