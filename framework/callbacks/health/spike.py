"""callbacks.spike: loss and gradient-norm spikes, found against a rolling window on the device.

Each step, after clipping and before the update (`on_before_update`), the step's global loss and
gradient norm are scored against the last `window` steps' values: a robust z-score (the distance
from the window's median in units of its median absolute deviation, x1.4826 so that it reads as
standard deviations on normal data; OLMo-core's defaults, 128 steps and 6) or, with `ratio` set, the
value over the window's mean (LLM Foundry's 2x). The window is a device tensor and the decision a
device bool: no step waits for the host.

- `warn`: the step is flagged (`spike/flag` in its metrics.jsonl line, a console line, the event
  in summary.json's `spike` block, W&B and the sweep report's `spikes` column);
- `skip`: and its update is not applied, decided on the device (framework.optimizers.skip.step_unless);
- `rollback`: and the run goes back to its newest checkpoint from before the spike, the data moved
  past every sample read since that checkpoint (the window that led to it), and goes on.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from omegaconf import DictConfig

from framework.callbacks.health import is_run_checkpoint
from framework.config.errors import ConfigError
from framework.figures import Figure
from framework.hooks import Run

ACTIONS = ("off", "warn", "skip", "rollback")
WATCHED = ("loss", "grad_norm")
MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation over its median absolute deviation
LEAST_SCALE = 0.05  # the z-score's unit is at least 5% of the median: a window of near-equal values
# (a MAD near 0) would otherwise score an ordinary wiggle of a few percent as a spike


class SpikeGuard:
    def __init__(self, action: str = "off", window: int = 128, zscore: float = 6.0, ratio: float | None = None,
                 watch: tuple[str, ...] = WATCHED, warmup: int | None = None):  # fmt: skip
        self.action, self.window, self.zscore, self.ratio = action, window, zscore, ratio
        self.watch = tuple(watch)
        self.warmup = warmup or window  # steps seen before any is scored (OLMo-core: a full window)
        self.active = action != "off"  # off: not built into the run (framework/callbacks/build.py)
        self.seen = 0  # values written into the window (host count: no device read)
        self.events: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []  # events not yet in a metrics.jsonl line
        self.rolled: list[dict[str, Any]] = []  # a rollback's event: its line is dropped with the steps after
        self.step = -1  # the step running (0-based)
        self.saved: set[int] = set()  # the checkpoints of this run (steps), as every rank saw them saved

    @classmethod
    def check_config(cls, cfg: DictConfig, key: str, args: dict[str, Any]) -> None:
        """One line naming the key for what cannot work, before any worker starts."""
        action, window = args.get("action", "off"), args.get("window", 128)
        if action not in ACTIONS:
            raise ConfigError(f"{key}.action", f"got {action!r}; one of {', '.join(ACTIONS)}")
        if not isinstance(window, int) or window < 2:
            raise ConfigError(f"{key}.window", f"got {window!r}; the steps a spike is scored against: an integer >= 2")
        warmup = args.get("warmup")
        if warmup is not None and not (isinstance(warmup, int) and 1 <= warmup <= window):
            raise ConfigError(f"{key}.warmup", f"got {warmup!r}; steps before scoring: 1..window ({window}), or null")
        for name, low in (("zscore", 0.0), ("ratio", 1.0)):
            value = args.get(name, 6.0 if name == "zscore" else None)
            if value is not None and (not isinstance(value, int | float) or value <= low):
                raise ConfigError(f"{key}.{name}", f"got {value!r}; a number above {low:g}")
        if not args.get("watch") or set(args["watch"]) - set(WATCHED):
            raise ConfigError(f"{key}.watch", f"got {args.get('watch')!r}; a non-empty list of {', '.join(WATCHED)}")
        if action == "rollback" and not cfg.checkpoint.every:
            raise ConfigError(f"{key}.action", "rollback goes back to a checkpoint, and checkpoint.every=0 saves "
                              "none; set checkpoint.every=N (or action=skip: the spike's update is left out)")  # fmt: skip

    def on_build(self, run: Run) -> None:
        self.run = run
        self.values = torch.full((len(self.watch), self.window), math.nan, device=run.info.device)
        self.flag: torch.Tensor | None = None
        declare = run.figures.declare
        declare(Figure("spike/flag", reduce="max", summary=(), group="spike", key="count", report="spikes"), "spike")
        for name in self.watch:  # the score of each watched figure, each step (max over the run in summary.json)
            declare(Figure(f"spike/score_{name}", reduce="max", summary=("max",), group="spike"), "spike")
        declare(Figure("spike/events", reduce=None, summary=()), "spike")  # in the next line written

    def on_before_update(self, step: int, figures: dict[str, torch.Tensor]) -> None:
        x = torch.stack([figures[name].detach().float().reshape(()) for name in self.watch]).to(self.values.device)
        if self.seen >= self.warmup:
            score = self.score(x)
            self.flag = (score > (self.ratio or self.zscore)).any()
        else:
            score, self.flag = torch.zeros_like(x), torch.zeros((), dtype=torch.bool, device=x.device)
        self.score_now = score
        finite = torch.where(torch.isfinite(x), x, torch.full_like(x, math.nan))  # amp's overflow steps: no value
        self.values[:, self.seen % self.window] = finite  # spikes too: the median and MAD shrug one off
        self.seen += 1
        if self.action == "skip":
            self.run.control.skip_update(when=self.flag)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """Each watched value's score against the window (nan-free: a non-finite value scores 0;
        the non-finite check is nonfinite's)."""
        if self.ratio:
            score = x / self.values.nanmean(dim=1)
        else:
            median = self.values.nanmedian(dim=1).values
            mad = (self.values - median[:, None]).abs().nanmedian(dim=1).values
            scale = torch.maximum(MAD_TO_SIGMA * mad, median.abs() * LEAST_SCALE + 1e-12)
            score = (x - median) / scale
        return torch.where(torch.isfinite(score), score, torch.zeros_like(score))

    def on_step_end(self, step: int) -> dict[str, Any] | None:
        if self.flag is None:  # no on_before_update this step (a callback skipped it outright)
            return None
        out = {"spike/flag": self.flag.float()}
        out |= {f"spike/score_{name}": self.score_now[k] for k, name in enumerate(self.watch)}
        self.flag = None
        return out

    def on_settled(self, step: int, figures: dict[str, Any]) -> dict[str, Any] | None:
        """A flagged step: its event, said on the console and carried by every settled step until
        a metrics.jsonl line is written (metrics.log_every may skip the spike's own)."""
        if (figures.get("spike/flag") or 0) > 0:  # -inf: no score this step (a callback skipped it outright)
            event = self.event(step, figures)
            if self.action == "rollback":
                event |= self.roll_back(step)
                self.rolled.append(event)
            self.events.append(event)
            self.pending.append(event)
            if self.run.info.is_main:
                print(f"warning: {describe(event)}", flush=True)
        return {"spike/events": list(self.pending)} if self.pending else None

    def on_log(self, step: int, record: dict[str, Any]) -> None:
        if "spike/events" in record:
            self.pending = []

    def event(self, step: int, figures: dict[str, Any]) -> dict[str, Any]:
        threshold = self.ratio or self.zscore
        flagged = {name: {"value": figures[name], "score": figures[f"spike/score_{name}"]} for name in self.watch
                   if figures[f"spike/score_{name}"] > threshold}  # fmt: skip
        return {"step": step + 1, "figures": flagged, "threshold": threshold,
                "score": "ratio to the window's mean" if self.ratio else "robust z-score",
                "window": self.window, "action": self.action}  # fmt: skip

    def roll_back(self, step: int) -> dict[str, Any]:
        """Ask for the newest checkpoint saved before step `step` (0-based) was applied, the data
        on from where it is now (past everything read since that checkpoint). No such checkpoint:
        the spike is only warned of. Decided from the saves every rank saw (on_save), alike."""
        if not any(done <= step for done in self.saved):
            return {"action": "warn", "note": f"no checkpoint from before step {step + 1} to roll back to"}
        now = self.run.parts.data.position()
        self.run.control.rollback(at_most=step, data_at=(now["epoch"], now["samples"]))
        return {"data_resumes_at": {"epoch": now["epoch"], "samples": now["samples"]}}

    def on_step_start(self, step: int) -> None:
        self.step = step

    def on_save(self, step: int, path: str | None) -> None:
        if is_run_checkpoint(self.run.checkpoint_root, path):  # not a failed save, nor the best one
            self.saved.add(step)

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values.tolist(), "seen": self.seen, "events": self.events, "done": self.step + 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.copy_(torch.tensor(state["values"], device=self.values.device))
        self.seen = state["seen"]
        self.saved.add(state.get("done", 0))  # resumed or rolled back: that checkpoint exists
        for event in self.rolled:  # where the rollback went, known now
            event["rolled_back_to"] = state.get("done")
        self.pending += [e for e in self.rolled if e not in self.pending]  # the line that said it is gone
        self.rolled = []
        known = {e["step"] for e in self.events}  # a rollback keeps the events it came back from
        self.events += [e for e in state["events"] if e["step"] not in known]
        self.events.sort(key=lambda e: e["step"])

    def on_end(self, summary: dict[str, Any]) -> None:
        block = summary.setdefault("spike", {})
        block |= {"action": self.action, "count": len(self.events), "events": self.events}


def describe(event: dict[str, Any]) -> str:
    """The console's line for one spike."""
    what = ", ".join(f"{name} {f['value']:.4g} (score {f['score']:.1f})" for name, f in event["figures"].items())
    done = {"warn": "warned only", "skip": "its update skipped", "rollback": "rolled back"}[event["action"]]
    line = f"spike at step {event['step']}: {what} over {event['threshold']:g} ({event['score']}); {done}"
    if "data_resumes_at" in event:
        at = event["data_resumes_at"]
        line += f" to the newest checkpoint before it, the data on from epoch {at['epoch']}, sample {at['samples']}"
    return line + (f" ({event['note']})" if "note" in event else "")
