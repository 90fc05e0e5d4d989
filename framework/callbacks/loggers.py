"""logger=wandb|tensorboard|all: rank 0's trackers (framework/tracking.py) as a callback. Built
before the model, so that W&B's service starts in the background while the model is built, not
while the first steps run (on a small machine it competes with them for the cores). Each
metrics.jsonl line goes to the trackers under their names (val_loss -> val/loss; a mapping's
fields as a/b; a list's items as name/i), the summary at the end.

A run that may roll back (a callback's `rollback_reach`: the spike guard's or the checksum's
rollback) would show the abandoned steps and then the same steps again, which W&B refuses ("steps
must be monotonically increasing") and TensorBoard draws twice. So a line goes to the trackers once
no rollback can reach back past it: until then it is held, a rollback drops the held lines it
abandons, and the steps run again carry `rollback/rerun` = 1. Every step is on the dashboard once."""

from __future__ import annotations

from typing import Any

from framework.tracking import Tracker


def tracker_names(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl record as W&B/TensorBoard take it: val_loss -> val/loss, nested fields as
    a/b, a list's items as name/i."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        key = f"val/{key[4:]}" if key.startswith("val_") else key
        if isinstance(value, dict):
            out |= {f"{key}/{k}": v for k, v in tracker_names(value).items()}
        elif isinstance(value, list):
            out |= {f"{key}/{i}": v for i, v in enumerate(value)}
        else:
            out[key] = value
    return out


class Loggers:
    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.reach: Any = lambda: None  # the oldest step a rollback may still go back to (Run.reach)
        self.held: list[tuple[int, dict[str, Any]]] = []  # lines a rollback may still abandon
        self.abandoned = -1  # the last step a rollback abandoned: the steps up to it run again

    @property
    def offline_dir(self) -> str | None:
        return self.tracker.offline_dir

    def on_build(self, run: Any) -> None:
        self.reach = run.reach

    def on_log(self, step: int, record: dict[str, Any]) -> None:
        line = tracker_names(record) | ({"rollback/rerun": 1} if step <= self.abandoned else {})
        self.held.append((step, line))
        self.flush(self.reach())

    def flush(self, upto: int | None) -> None:
        """The held lines of steps up to `upto` (None: all) to the trackers."""
        while self.held and (upto is None or self.held[0][0] <= upto):
            step, line = self.held.pop(0)
            self.tracker.log(line, step=step)

    def on_rollback(self, step: int) -> None:
        self.abandoned = max([self.abandoned, *(s for s, _ in self.held)])
        self.held = [(s, line) for s, line in self.held if s <= step]

    def on_exception(self, error: BaseException) -> None:
        self.flush(None)
        self.tracker.finish(ok=False)

    def on_end(self, summary: dict[str, Any]) -> None:
        self.flush(None)
        self.tracker.summary(summary)
        self.tracker.finish(ok=True)
        if self.offline_dir:  # rank 0's: where W&B wrote the run, to upload later
            print(
                f"W&B offline run: {self.offline_dir}  (upload later with: wandb sync {self.offline_dir})", flush=True
            )
