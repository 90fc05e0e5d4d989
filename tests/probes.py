"""Callbacks the tests configure by `_target_` to look inside a run (not part of the framework)."""

from __future__ import annotations

import json
import os

from framework.measure.comm import CommCounter


class CountCollectives:
    """Every collective of each step, from its start to the end of its figures' all-reduce (the
    step's last), counted by the framework's own counter; each rank writes
    `collectives-rank<r>.json` (a list of {op: calls}, a step each) at the end."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self.counter: CommCounter | None = None

    def on_build(self, run) -> None:
        self.path = os.path.join(run.run_dir, f"collectives-rank{run.rank}.json")

    def on_step_start(self, step: int) -> None:
        self.counter = CommCounter()
        self.counter.__enter__()

    def on_step_reduced(self, step: int, totals) -> None:
        self.counter.__exit__(None, None, None)
        self.steps.append({op: v["calls"] for op, v in self.counter.totals()["by_op"].items()})

    def on_end(self, summary) -> None:
        with open(self.path, "w") as f:
            json.dump(self.steps, f)


class Requests:
    """Asks the loop for each thing Control offers, once: a checkpoint after step 1 (asked before
    the all-reduce), step 2's update skipped, and after step 4 a rollback to the newest checkpoint;
    each rank writes the losses it saw settle, in order, to `losses-rank<r>.json`. It also sets the
    LR of each step itself (1e-3 x the step's number), as a schedule run from a callback would."""

    def __init__(self, skip_samples: int = 0) -> None:
        self.skip_samples, self.rolled, self.seen = skip_samples, False, []

    def on_build(self, run) -> None:
        self.control, self.path = run.control, os.path.join(run.run_dir, f"losses-rank{run.rank}.json")
        self.optimizer = run.parts.optimizer

    def on_step_start(self, step: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = 1e-3 * (step + 1)

    def on_step_end(self, step: int) -> None:
        if step == 0:
            self.control.save()

    def on_before_optimizer_step(self, step: int) -> None:
        if step == 1:
            self.control.skip_update()

    def on_settled(self, step: int, figures) -> None:
        self.seen.append([step + 1, figures["loss"]])
        if step == 3 and not self.rolled:
            self.rolled = True
            self.control.rollback(skip_samples=self.skip_samples)

    def on_end(self, summary) -> None:
        with open(self.path, "w") as f:
            json.dump(self.seen, f)


class StopOnOneRank:
    """Rank `rank` alone asks to stop in on_step_end of step `at` (0-based): the request rides the
    step's all-reduce, so every rank stops at the step's settle."""

    def __init__(self, at: int, rank: int = 1) -> None:
        self.at, self.rank = at, rank

    def on_build(self, run) -> None:
        self.control, self.mine = run.control, run.rank == self.rank

    def on_step_end(self, step: int) -> None:
        if self.mine and step == self.at:
            self.control.stop(f"rank {self.rank} at step {step + 1}")


class SkipAt:
    """Skips step `step`'s update (0-based) as the host decides it: the reference a device-side
    skip is compared with."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_build(self, run) -> None:
        self.control = run.control

    def on_before_optimizer_step(self, step: int) -> None:
        if step == self.step:
            self.control.skip_update()
