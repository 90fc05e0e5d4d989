"""goodput (always on): productive training time over the job's wall time, and where the rest went.

The wall time runs from the job's start to the end of training: under `python train.py` the
launcher's process start, which its restarted workers keep, and a multirun's job its own start
(the sweep's one-time start-up is in no job's: framework/doors/job_clock.py); under torchrun or
srun, which start each worker afresh, this worker's own start (an earlier attempt's time is not known to it). Every second of it is given to one part, as Google's
ml-goodput-measurement splits badput:
- `productive_s`: steps whose update counts (their compute, less the parts below);
- `startup_s`: the job's start to its first step (imports, config, workers, model build), and a
  restarted worker's own start-up; `warmup_s`: the first step's excess over the median step
  (compilation, lazy initialisation); `data_s`: waiting for batches;
- `checkpoint_save_s`, `checkpoint_load_s`, `evaluation_s`, `export_s` (checkpoint.export at the end);
- `restart_lost_s`: a restart's cost, from the last checkpoint's accounted time to the new
  worker's start (the steps redone, the failure, the relaunch); `rollback_s` (reloading) and
  `rolled_back_s` (the steps a rollback abandoned); `skipped_s`: steps whose update was skipped.

The parts come from the loop's timings (framework.hooks.Timings) read between hooks on the host
clock: no device sync. summary.json `goodput`, W&B's summary, the sweep report's `goodput` column.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from framework.dist import restart_count
from framework.hooks import Run
from framework.machine import process_start_time

TIMED = ("data", "checkpoint_save", "checkpoint_load", "evaluation", "rollback", "export")
PARTS = ("productive", "startup", "warmup", "data", "checkpoint_save", "checkpoint_load", "evaluation", "export",
         "restart_lost", "rollback", "rolled_back", "skipped")  # fmt: skip


class Goodput:
    def __init__(self) -> None:
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.steps: dict[int, float] = {}  # this attempt's steps: compute seconds (productive until moved)
        self.first: int | None = None  # this attempt's first step (its excess is warm-up)
        self.prior: dict[str, Any] | None = None  # the checkpoint's account, when this attempt resumed
        self.last = 0.0  # where the open interval began (time.time())
        self.seen: dict[str, float] = {}  # the timings at `last`
        self.step = -1
        self.rolled_to: int | None = None
        self.skipped: set[int] = set()  # steps whose update was not applied

    def on_build(self, run: Run) -> None:
        self.run = run
        self.attempt = process_start_time()
        self.job = run.started if run.started is not None else self.attempt

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.step >= 0:  # a rollback in this attempt: the steps after the checkpoint are abandoned
            self.rolled_to = state["done"]
        elif state.get("job") == self.job:  # a restart of this job: its account so far goes on
            self.prior = state

    def on_start(self, step: int) -> None:
        """Start-up ends: the job's start (a restarted worker: its own start) to here, less what
        the timings account for (resuming from a checkpoint, an evaluation at the start)."""
        begin = self.job
        if self.prior is not None:
            for part, seconds in self.prior["parts"].items():
                self.parts[part] += seconds
            self.parts["restart_lost"] += max(0.0, self.attempt - self.job - sum(self.prior["parts"].values()))
            begin = self.attempt
        elif restart_count() > 0:  # restarted with no checkpoint of this job to go on from: all of it lost
            self.parts["restart_lost"] += max(0.0, self.attempt - self.job)
            begin = self.attempt
        self.last, self.seen = begin, {}
        self.close(time.time())  # step -1: the rest is start-up

    def on_step_start(self, step: int) -> None:
        self.close(time.time())
        self.step = step
        if self.first is None:
            self.first = step

    def close(self, now: float) -> None:
        """The interval since `last`: the timed parts in it, and the rest the step's compute."""
        timings = self.run.timings.seconds
        spent = {k: timings.get(k, 0.0) - self.seen.get(k, 0.0) for k in TIMED}
        for part in TIMED:
            self.parts[part] += spent[part]
        rest = now - self.last - sum(spent.values())
        if self.step >= 0:
            self.steps[self.step] = self.steps.get(self.step, 0.0) + rest
        else:  # on_start to the first step: still starting up
            self.parts["startup"] += rest
        if self.rolled_to is not None:  # abandoned: this attempt's steps from the checkpoint on
            for step in [s for s in self.steps if s >= self.rolled_to]:
                self.parts["rolled_back"] += self.steps.pop(step)
                self.skipped.discard(step)
            self.rolled_to = None
        self.last, self.seen = now, dict(timings)

    def on_settled(self, step: int, figures: dict[str, Any]) -> None:
        if not figures.get("applied", True):
            self.skipped.add(step)

    def account(self) -> dict[str, float]:
        """The parts so far, this attempt's steps split into productive and warm-up."""
        parts = dict(self.parts)
        steps = {s: v for s, v in self.steps.items() if s not in self.skipped}
        parts["skipped"] += sum(v for s, v in self.steps.items() if s in self.skipped)
        if self.first in steps and len(steps) > 1:
            typical = statistics.median(v for s, v in steps.items() if s != self.first)
            parts["warmup"] += max(0.0, steps[self.first] - typical)
            steps[self.first] = min(steps[self.first], typical)
        parts["productive"] += sum(steps.values())
        return parts

    def state_dict(self) -> dict[str, Any]:
        self.close(time.time())  # a save ends the open interval: what the checkpoint accounts for
        return {"job": self.job, "done": self.step + 1, "parts": self.account()}

    def on_end(self, summary: dict[str, Any]) -> None:
        now = time.time()
        self.close(now)
        parts, wall = self.account(), now - self.job
        summary["goodput"] = {"goodput": parts["productive"] / wall if wall > 0 else None, "wall_s": wall,
                              **{f"{k}_s": v for k, v in parts.items()}}  # fmt: skip
        summary.setdefault("figure_columns", []).append(("goodput", "goodput", "goodput", "max"))
