"""The figures of a sweep report's table (framework.report): its columns, each formatted with
the digits that tell its values apart, the planner's worst error on a run, and the fastest run
with the noise its lead must exceed to count. Imports no torch."""

from __future__ import annotations

import math
import statistics
from typing import Any, NamedTuple

from framework.measure.plotting import MB, speed


def _memory(kind: str):
    return lambda s: _mb((s.get("memory") or {}).get(kind))


def _mb(value: float | None) -> float | None:
    return None if value is None else value / MB


def _comm_wire(s: dict[str, Any]) -> float | None:
    comm = s.get("comm") or {}
    return _mb(comm.get("wire_bytes", comm.get("bytes")))


PLAN_FIGURES = {"param_bytes": "params", "grad_bytes": "grads", "optim_bytes": "optim",
                "activation_bytes": "activations", "wire_bytes": "wire", "comm_calls": "calls",
                "step_time_s": "step time", "peak_bytes": "peak", "all_to_all_bytes": "all-to-all"}  # fmt: skip


def _plan_error(s: dict[str, Any]) -> str | None:
    """The planner's worst relative error on this run over every figure it forecast (memory by
    kind, wire bytes, calls, step time, the peak: `plan.error`), and which figure it is."""
    found = ((s.get("plan") or {}).get("error") or {}).items()
    errors = {k: v for k, v in found if isinstance(v, int | float) and math.isfinite(v)}
    if not errors:
        return None
    worst = max(errors, key=lambda k: abs(errors[k]))
    return f"{errors[worst]:+.1%} ({PLAN_FIGURES.get(worst, worst)})"


# (header, getter, better): better is "max", "min" or None (not ranked)
COLUMNS = [
    ("tokens/s", lambda s: (s.get("throughput") or {}).get("tokens_per_s"), "max"),
    ("samples/s", lambda s: (s.get("throughput") or {}).get("samples_per_s"), "max"),
    ("MFU", lambda s: s.get("mfu"), "max"),
    ("params MB", _memory("param_bytes"), "min"),
    ("grads MB", _memory("grad_bytes"), "min"),
    ("optim MB", _memory("optim_bytes"), "min"),
    ("activations MB", _memory("activation_bytes"), "min"),
    ("comm wire MB/step", _comm_wire, "min"),
    ("imbalance", lambda s: (s.get("load_balance") or {}).get("imbalance"), "min"),
    # the mean rank's all-to-all traffic (a column only where a run has one)
    (
        "all-to-all MB/step",
        lambda s: _mb(((s.get("comm_by_op") or {}).get("all_to_all") or {}).get("mean_bytes")),
        "min",
    ),
    ("final loss", lambda s: s.get("final_loss"), "min"),
    ("plan error", _plan_error, None),
]
MAX_DECIMALS = 6
DECLARED_AFTER = "imbalance"  # the runs' declared figures' columns go after this one


def columns(summaries: list[dict[str, Any]]) -> list[tuple[str, Any, str | None]]:
    """The table's columns: COLUMNS, and after DECLARED_AFTER the columns the runs' figures
    declare (summary.json `figure_columns`, framework/figures.py), each once, in the order met."""
    declared: dict[str, tuple[str, Any, str | None]] = {}
    for summary in summaries:
        for title, group, key, better in summary.get("figure_columns") or []:
            declared.setdefault(title, (title, _block_value(group, key), better))
    at = next(k for k, c in enumerate(COLUMNS) if c[0] == DECLARED_AFTER) + 1
    return [*COLUMNS[:at], *declared.values(), *COLUMNS[at:]]


def _block_value(group: str, key: str):
    return lambda s: (s.get(group) or {}).get(key)


def fmt(value: Any) -> str:
    """One figure as the table prints it: three significant digits, thousands whole."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) >= 0.001 else f"{value:.2e}"
    return str(value)


def column_texts(values: list[Any]) -> list[str]:
    """A column's cells: each value as `fmt` writes it, unless two different values would print
    alike (final losses 2.9966 and 2.9957 both as `3`, the bold best among them unreadable): then
    every number of the column at the fewest decimals (at most MAX_DECIMALS) that print its
    distinct values distinctly."""
    numbers = {v for v in values if isinstance(v, float) and math.isfinite(v)}
    if len({fmt(v) for v in numbers}) == len(numbers):
        return [fmt(v) for v in values]
    apart = (d for d in range(MAX_DECIMALS) if len({f"{v:.{d}f}" for v in numbers}) == len(numbers))
    decimals = next(apart, MAX_DECIMALS)
    return [f"{v:,.{decimals}f}" if v in numbers else fmt(v) for v in values]


# ----------------------------------------------------------------------------- the fastest, and the noise

DRIFT = 0.10  # the least noise assumed: a machine's speed drifts 10-20% between the runs of a sweep
MIN_TIMED_STEPS = 4


def noise(run: Any) -> float | None:
    """How much a run's speed wanders: half the 10th-90th percentile range of its step times over
    their median, the first step (warm-up, compilation) left out; None with fewer than
    MIN_TIMED_STEPS timed steps."""
    times = run.step_times[1:]
    if len(times) < MIN_TIMED_STEPS:
        return None
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return (deciles[-1] - deciles[0]) / 2 / statistics.median(times)


class Lead(NamedTuple):
    """The fastest run that finished, its speed over the next fastest's (None: the only one), the
    next fastest, and the noise (a share) a lead must exceed to count."""

    run: Any  # framework.report's Run
    ratio: float | None
    runner_up: Any | None
    noise: float

    @property
    def tie(self) -> bool:
        return self.ratio is not None and self.ratio - 1 <= self.noise


def fastest(runs: list) -> Lead | None:
    """The fastest run that finished and its lead over the next fastest. The noise is the larger
    of the two runs' step-time spreads (`noise`) and DRIFT: a sweep's runs run one after another,
    and the machine's speed drifts between them by more than one run's steps show."""
    ranked = sorted((r for r in runs if r.ok and speed(r)), key=speed, reverse=True)
    if not ranked:
        return None
    top, runner_up = ranked[0], (ranked[1] if len(ranked) > 1 else None)
    spreads = [n for n in (noise(top), noise(runner_up) if runner_up else None) if n is not None]
    return Lead(top, speed(top) / speed(runner_up) if runner_up else None, runner_up, max([DRIFT, *spreads]))
