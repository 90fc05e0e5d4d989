"""logger=wandb|tensorboard|all: rank 0's trackers (framework/tracking.py) as a callback. Built
before the model, so that W&B's service starts in the background while the model is built, not
while the first steps run (on a small machine it competes with them for the cores). Each
metrics.jsonl line goes to the trackers under their names (val_loss -> val/loss; a mapping's
fields as a/b; a list's items as name/i), the summary at the end."""

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

    @property
    def offline_dir(self) -> str | None:
        return self.tracker.offline_dir

    def on_log(self, step: int, record: dict[str, Any]) -> None:
        self.tracker.log(tracker_names(record), step=step)

    def on_exception(self, error: BaseException) -> None:
        self.tracker.finish(ok=False)

    def on_end(self, summary: dict[str, Any]) -> None:
        self.tracker.summary(summary)
        self.tracker.finish(ok=True)
        if self.offline_dir:  # rank 0's: where W&B wrote the run, to upload later
            print(
                f"W&B offline run: {self.offline_dir}  (upload later with: wandb sync {self.offline_dir})", flush=True
            )
