"""A sweep's comparison: `python -m framework.report DIR` writes DIR/report.md and PNG plots.

DIR is a multirun directory (or any folder holding run directories: a folder with a
`summary.json`, at any depth). One row per run with its choices and the figures that decide
between strategies: tokens/s, MFU, per-rank memory by kind, wire bytes per step, load imbalance,
final loss, the planner's worst error. The best value of each column is in bold (a column keeps
the digits that tell its values apart); the fastest run that finished is named, with its lead
over the next one, or called a tie when the lead is within the noise of the machine's speed.
Failed runs are listed with their errors.

At the end of a multirun the report is written by `SweepReport`, a Hydra callback
(`hydra.callbacks.report` in conf/config.yaml); with W&B on it is also logged as one run of the
sweep's group. This module imports no torch: reports are quick to make anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.doors.report_table import DRIFT, column_texts, columns, fastest, fmt
from framework.measure.plotting import plot, speed
from framework.run.run_files import SUMMARY_FILE, read_summary, read_sweep_startup
from framework.tracking import quiet_settings

CHOICE_KEYS = ("parallel", "precision", "memory", "backend", "model", "data")


@dataclass
class Run:
    """One run directory as the report sees it."""

    path: Path
    name: str  # relative to the report's folder
    summary: dict[str, Any]
    overrides: list[str]
    losses: list[tuple[int, float]] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # seconds of each logged step (metrics.jsonl)
    label: str = ""  # set by label_runs

    @property
    def ok(self) -> bool:
        return self.summary.get("status") == "ok"

    @property
    def choices_label(self) -> str:
        choices = self.summary.get("choices") or {}
        return ",".join(f"{k}={choices[k]}" for k in ("parallel", "precision", "memory") if choices.get(k))


def label_runs(runs: list[Run]) -> list[str]:
    """Give each run the label that tells it apart: its overrides that not every run shares
    (the swept ones), else its choices. Returns the overrides every run shares."""
    overrides = [[o for o in r.overrides if not o.startswith("hydra")] for r in runs]
    common = [o for o in overrides[0] if all(o in other for other in overrides)] if overrides else []
    for run, own in zip(runs, overrides, strict=True):
        run.label = ",".join(o for o in own if o not in common) or run.choices_label or run.name
    return common


def find_runs(root: Path) -> list[Run]:
    """Every run directory under `root` (one that has a summary.json), in a stable order: job
    numbers numerically, then names."""
    runs = []
    for summary_path in root.rglob(SUMMARY_FILE):
        if "wandb" in summary_path.parts:
            continue
        run_dir = summary_path.parent
        found = read_summary(run_dir)
        summary = found.to_dict() if found else {"status": "failed", "error": "unreadable summary.json"}
        name = str(run_dir.relative_to(root)) or "."
        runs.append(Run(run_dir, name, summary, _overrides(run_dir), *_metrics(run_dir)))

    def order(run: Run) -> tuple:
        return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in Path(run.name).parts)

    runs.sort(key=order)
    label_runs(runs)
    return runs


def _overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    lines = [line.strip() for line in path.read_text().splitlines()]
    # the file is a YAML list of strings: "- key=value"
    return [line[2:].strip().strip("'\"") for line in lines if line.startswith("- ")]


def _metrics(run_dir: Path) -> tuple[list[tuple[int, float]], list[float]]:
    """metrics.jsonl's (step, loss) points and step times."""
    path = run_dir / "metrics.jsonl"
    losses, times = [], []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill: the rest still reports
        if record.get("loss") is not None:
            losses.append((record["step"], record["loss"]))
        if record.get("step_time_s") is not None:
            times.append(record["step_time_s"])
    return losses, times


# ----------------------------------------------------------------------------- the report


def _headline(runs: list[Run]) -> list[str]:
    """The fastest run and its lead over the next, called a tie when the lead is within the noise."""
    lead = fastest(runs)
    if lead is None:
        return []
    run, other = lead.run, lead.runner_up
    unit = "tokens/s" if (run.summary.get("throughput") or {}).get("tokens_per_s") else "samples/s"
    text = f"**Fastest:** `{run.label}` (job `{run.name}`): {fmt(speed(run))} {unit}"
    if other is None:
        return [f"{text} (the only run that finished).", ""]
    verdict = "a tie within noise" if lead.tie else "beyond the noise"
    return [f"{text}, {lead.ratio:.2f}x the next fastest (`{other.label}`, job `{other.name}`): "
            f"{verdict} (±{lead.noise:.0%}).", ""]  # fmt: skip


def _rows(ok: list[Run], columns: list[tuple], best: dict[str, Any]) -> list[str]:
    """The table's rows, one per finished run, each column's numbers formatted together."""
    texts = {header: column_texts([get(r.summary) for r in ok]) for header, get, _ in columns}
    lines = []
    for i, run in enumerate(ok):
        choices = run.summary.get("choices") or {}
        cells = [run.name, f"`{run.label}`", fmt(run.summary.get("world_size")),
                 fmt(run.summary.get("global_batch_size")), *(str(choices.get(k, "-")) for k in CHOICE_KEYS[:3])]  # fmt: skip
        for header, get, _ in columns:
            value, text = get(run.summary), texts[header][i]
            cells.append(f"**{text}**" if value is not None and best.get(header) == value else text)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


NOTES = (
    "Memory is per rank (the largest rank), model state from the tensors each rank holds and activations the "
    "live peak saved for backward; comm is wire bytes per optimizer step under ring algorithms (comm.png stacks "
    "the payload handed to each collective, and marks this wire total); imbalance is the busiest data-parallel "
    "rank's work over the mean; goodput is productive time over the job's wall time from its own start "
    "(summary.json goodput); plan error is the planner's worst relative error over the figures it forecasts "
    "(memory by kind, the peak, wire bytes, calls, step time: summary.json plan). A lead is a tie when within "
    f"the noise: the larger of the two runs' step-time spread (metrics.jsonl) and {DRIFT:.0%}, what a machine "
    "drifts between runs."
)


def _startup(parts: dict[str, float] | None) -> list[str]:
    """The sweep's one-time start-up (framework/doors/job_clock.py), which no job's goodput holds."""
    if not parts:
        return []
    named = {"launcher_s": "Hydra and the imports", "workers_s": "the workers' forkserver"}
    each = ", ".join(f"{named.get(k, k)} {v:.2f} s" for k, v in parts.items() if isinstance(v, int | float) and v)
    total = sum(v for v in parts.values() if isinstance(v, int | float))
    return [f"Sweep start-up, paid once and in no job's goodput (each job counts from its own start): "
            f"{total:.2f} s ({each})."]  # fmt: skip


def markdown(runs: list[Run], title: str, plots: list[str], startup: dict[str, float] | None = None) -> str:
    common = label_runs(runs)
    ok = [r for r in runs if r.ok]
    failed = [r for r in runs if not r.ok]
    # only the columns some run has a value for (samples/s for image models, MFU where known)
    shown = [c for c in columns([r.summary for r in ok]) if any(c[1](r.summary) is not None for r in ok)]
    if any((r.summary.get("throughput") or {}).get("tokens_per_s") for r in ok):
        shown = [c for c in shown if c[0] != "samples/s"]
    best = {}
    for header, get, better in shown:
        values = [v for v in (get(r.summary) for r in ok) if v is not None]
        if better and len(set(values)) > 1:  # a tie everywhere marks nothing
            best[header] = max(values) if better == "max" else min(values)

    lines = [f"# Sweep report: {title}", "", *_headline(runs)]
    lines += [f"{len(runs)} runs: {len(ok)} ok, {len(failed)} failed. Best value of each column in bold."]
    if common:
        lines += [f"Every run: `{' '.join(common)}`."]
    lines += _startup(startup)
    head = ["job", "overrides", "world", "global batch", *CHOICE_KEYS[:3], *(c[0] for c in shown)]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *_rows(ok, shown, best)]
    if failed:
        lines += ["", "## Failed", "", "| job | overrides | error |", "|---|---|---|"]
        for run in failed:
            error = str(run.summary.get("error") or "no error recorded").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {run.name} | `{run.label}` | {error[:300]} |")
    lines += ["", NOTES]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(root: str | os.PathLike, runs: list[Run] | None = None) -> tuple[Path, list[Run]]:
    """Write root/report.md and the plots of `runs` (None: those under root); returns the
    report's path and the runs it read."""
    root = Path(root)
    runs = find_runs(root) if runs is None else runs
    plots = plot(runs, root) if runs else []
    path = root / "report.md"
    path.write_text(markdown(runs, str(root), plots, read_sweep_startup(root)))
    return path, runs


# ----------------------------------------------------------------------------- W&B


def log_to_wandb(root: Path, runs: list[Run], logger: Any) -> str | None:
    """Log the table and plots as one W&B run of the sweep's group (offline by default).
    Returns the offline run folder (to `wandb sync`), or None."""
    import wandb

    every = columns([r.summary for r in runs])
    table = wandb.Table(columns=["job", "overrides", "status", *(c[0] for c in every)])
    for run in runs:
        table.add_data(run.name, run.label, run.summary.get("status"), *(c[1](run.summary) for c in every))
    wb = wandb.init(
        project=logger.project,
        entity=logger.entity,
        mode=logger.mode,
        dir=str(root),
        group=logger.group or root.name,
        name=f"report-{root.name}",
        job_type="report",
        settings=quiet_settings(wandb, logger.mode),  # offline: its own line below, not W&B's banner
    )
    images = {p.stem: wandb.Image(str(p)) for p in sorted(root.glob("*.png"))}
    wb.log({"report": table, **images})
    offline = os.path.dirname(wb.dir) if wb.settings.mode == "offline" else None
    wb.finish()
    return offline


# ----------------------------------------------------------------------------- Hydra callback

try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a dependency; this keeps the CLI importable
    Callback = object  # type: ignore[assignment,misc]


class SweepReport(Callback):
    """At the end of a multirun: the report in the sweep directory (and on W&B when it is on).

    A basic sweep with failed jobs then exits non-zero (after the report): the failures are listed
    and nothing is lost. A search (Optuna) scores failures as failed trials and exits 0."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        root = Path(config.hydra.sweep.dir)
        if not root.is_dir():
            return
        path, runs = write_report(root)
        print(f"sweep report: {path}", flush=True)
        if runs and config.logger.name in ("wandb", "all") and config.logger.mode != "disabled":
            offline = log_to_wandb(root, runs, config.logger)
            if offline:
                print(f"W&B offline report run: {offline}  (upload later with: wandb sync {offline})", flush=True)
        failed = [r for r in runs if not r.ok]
        searching = "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", ""))
        if failed and not searching:
            print(
                f"error: {len(failed)} of {len(runs)} jobs failed: {', '.join(r.name for r in failed)}", file=sys.stderr
            )
            sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m framework.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a multirun directory, or any folder of run directories")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"error: dir: no folder at {args.dir!r}", file=sys.stderr)
        sys.exit(2)
    runs = find_runs(Path(args.dir))
    if not runs:  # refused before anything is written: no empty report.md left behind
        print(f"error: dir: no run directories (with a summary.json) under {args.dir!r}", file=sys.stderr)
        sys.exit(2)
    path, runs = write_report(args.dir, runs)
    print(path.read_text().split("\n\n## Plots")[0])
    print(f"\nreport: {path}")


if __name__ == "__main__":
    main()
