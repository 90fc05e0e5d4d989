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
  past every sample read since that checkpoint (the window that led to it), and goes on. A spike that
  comes back within `window` steps of a rollback to checkpoint C goes back to the checkpoint before C
  (the damage may be in C itself: the update of the step C saved), and after `max_rollbacks` in a row
  the run ends in one line naming the steps and checkpoints it tried, its checkpoints kept (PaLM and
  OLMo restart well before a spike and give up after a few).

The guard scores from step `warmup` + 1 (a full window by default); a run that ends before it is
refused (it would never score), and the guard says at start when it scores from. Settings that flag
any step of the converging benchmark's clean runs are refused (calibration.py; the table is
docs/results/health.md, section 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from framework.callbacks.health import is_run_checkpoint
from framework.callbacks.health.calibration import WATCHED, Settings, refusal, scores
from framework.config.errors import ConfigError
from framework.figures import Figure
from framework.hooks import CallbackFailure, Run

ACTIONS = ("off", "warn", "skip", "rollback")


@dataclass(eq=False)
class SpikeGuard(Settings):
    """The settings (conf/callbacks/health/spike.yaml, docs/health.md: what decides a flag in
    calibration.Settings), then the guard's state."""

    action: str = "off"
    max_rollbacks: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()  # watch a tuple, warmup a full window unless set (OLMo-core's)
        self.scored = 0  # steps scored so far (0 at the end: the run never reached warmup + 1)
        self.rollbacks: list[dict[str, Any]] = []  # every rollback asked for: {spike, to}, all of the run
        self.tried: list[dict[str, Any]] = []  # this streak's (rollbacks whose spikes came back within window)
        self.back_to: int | None = None  # the checkpoint (step) the last rollback went to
        self.active = self.action != "off"  # off: not built into the run (framework/callbacks/build.py)
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
        if action != "off":
            check_scores(cfg, key, warmup or window, "warmup" if warmup else "window")
            check_calibrated(key, {name: args[name] for name in Settings.__dataclass_fields__ if name in args})
        if action == "rollback":
            check_rollback(cfg, key, args.get("max_rollbacks", 3), window)

    def start(self, device: torch.device) -> None:
        self.values = torch.full((len(self.watch), self.window), math.nan, device=device)
        self.flag: torch.Tensor | None = None

    def on_build(self, run: Run) -> None:
        self.run = run
        self.start(run.info.device)
        declare = run.figures.declare
        declare(Figure("spike/flag", reduce="max", summary=(), group="spike", key="count", report="spikes"), "spike")
        for name in self.watch:  # the score of each watched figure, each step (max over the run in summary.json)
            declare(Figure(f"spike/score_{name}", reduce="max", summary=("max",), group="spike"), "spike")
        declare(Figure("spike/events", reduce=None, summary=()), "spike")  # in the next line written

    def on_before_update(self, step: int, figures: dict[str, torch.Tensor]) -> None:
        x = torch.stack([figures[name].detach().float().reshape(()) for name in self.watch]).to(self.values.device)
        if self.seen >= self.warmup:
            score = self.score(x)
            self.scored += 1
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
        return scores(x, self.values, self.ratio)

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
        on from where it is now (past everything read since that checkpoint). A spike within
        `window` steps of the last rollback (to C) asks for the checkpoint before C; the
        `max_rollbacks` + 1-th in a row, or one with no checkpoint left before it, ends the run
        (in one line: framework.hooks.CallbackFailure). No checkpoint before a first spike: it is only warned of. Decided from
        the saves every rank saw (on_save), alike."""
        chained = self.back_to is not None and step - self.back_to < self.window
        before = self.back_to - 1 if chained else step
        target = max((done for done in self.saved if done <= before), default=None)
        if not chained:
            self.tried = []
            if target is None:
                return {"action": "warn", "note": f"no checkpoint from before step {step + 1} to roll back to"}
        if target is None or len(self.tried) >= self.max_rollbacks:
            raise CallbackFailure(self.gave_up(step, target))
        now = self.run.parts.data.position()
        self.run.control.rollback(at_most=target, data_at=(now["epoch"], now["samples"]))
        attempt = {"spike": step + 1, "to": target, "came_back": chained}
        self.tried.append(attempt)
        self.rollbacks.append(attempt)
        return {"data_resumes_at": {"epoch": now["epoch"], "samples": now["samples"]}, "rolled_back_to": target}

    def gave_up(self, step: int, target: int | None) -> str:
        """The one line a run ends with when rolling back does not help."""
        spikes = ", ".join(str(t["spike"]) for t in self.tried) + f" and {step + 1}"
        tried = ", ".join(str(t["to"]) for t in self.tried)
        why = (f"callbacks.spike.max_rollbacks={self.max_rollbacks} allows no more in a row" if target is not None
               else f"no checkpoint before step {self.back_to} is left to go back to")  # fmt: skip
        return (f"the spike guard gave up: spikes at steps {spikes} each came back within {self.window} steps of "
                f"rolling back (to the checkpoints of steps {tried}), and {why}; the checkpoints are kept in "
                f"{self.run.checkpoint_root}: resume from one with other settings (optim.lr, data), or "
                f"callbacks.spike.action=warn")  # fmt: skip

    def on_rollback(self, step: int) -> None:
        self.back_to = step
        self.saved = {done for done in self.saved if done <= step}  # those after it are superseded when saved again

    def rollback_reach(self) -> int | None:
        """The oldest checkpoint a rollback of this guard may still go to: a streak goes one
        checkpoint further back each time, at most max_rollbacks (the loggers hold the lines after it)."""
        if self.action != "rollback":
            return None
        streak = self.back_to is not None and self.step - self.back_to < self.window
        pool = sorted(done for done in self.saved if not streak or done < self.back_to)
        left = self.max_rollbacks - (len(self.tried) if streak else 0)
        return pool[-min(len(pool), left)] if pool and left > 0 else max(self.step, 0)

    def on_start(self, step: int) -> None:
        if self.run.info.is_main:
            first = step + max(0, self.warmup - self.seen) + 1
            what = f"over {self.ratio:g}x the window's mean" if self.ratio else f"a robust z-score over {self.zscore:g}"
            print(f"spike guard: {', '.join(self.watch)} scored from step {first} against the last {self.window} "
                  f"steps ({what}); on a spike: {self.action}", flush=True)  # fmt: skip

    def on_step_start(self, step: int) -> None:
        self.step = step

    def on_save(self, step: int, path: str | None) -> None:
        if is_run_checkpoint(self.run.checkpoint_root, path):  # not a failed save, nor the best one
            self.saved.add(step)

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values.tolist(), "seen": self.seen, "scored": self.scored, "events": self.events,
                "done": self.step + 1}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.copy_(torch.tensor(state["values"], device=self.values.device))
        self.seen, self.scored = state["seen"], state.get("scored", 0)
        self.saved.add(state.get("done", 0))  # resumed or rolled back: that checkpoint exists
        self.pending += [e for e in self.rolled if e not in self.pending]  # the line that said it is gone
        self.rolled = []
        known = {e["step"] for e in self.events}  # a rollback keeps the events it came back from
        self.events += [e for e in state["events"] if e["step"] not in known]
        self.events.sort(key=lambda e: e["step"])

    def on_end(self, summary: dict[str, Any]) -> None:
        block = summary.setdefault("spike", {})
        block |= {"action": self.action, "count": len(self.events), "events": self.events,
                  "scored_steps": self.scored, "scored": self.scored > 0, "rollbacks": self.rollbacks}  # fmt: skip


def describe(event: dict[str, Any]) -> str:
    """The console's line for one spike."""
    what = ", ".join(f"{name} {f['value']:.4g} (score {f['score']:.1f})" for name, f in event["figures"].items())
    done = {"warn": "warned only", "skip": "its update skipped", "rollback": "rolled back"}[event["action"]]
    line = f"spike at step {event['step']}: {what} over {event['threshold']:g} ({event['score']}); {done}"
    if "data_resumes_at" in event:
        at = event["data_resumes_at"]
        line += f" to the checkpoint of step {event['rolled_back_to']}, the data on from epoch {at['epoch']}, " \
                f"sample {at['samples']}"  # fmt: skip
    return line + (f" ({event['note']})" if "note" in event else "")


def check_calibrated(key: str, settings: dict[str, Any]) -> None:
    """Settings that flag healthy training (the converging benchmark's clean runs) are refused."""
    settings["watch"] = tuple(settings.get("watch", WATCHED))
    if why := refusal(settings):
        name = "window" if "window >=" in why else ("ratio" if settings.get("ratio") else "zscore")
        raise ConfigError(f"{key}.{name}", why)


def check_scores(cfg: DictConfig, key: str, first: int, name: str) -> None:
    """A guard that would never score: refused (its summary would read as a healthy run's)."""
    if first >= cfg.steps:
        raise ConfigError(f"{key}.{name}", f"the guard scores from step {first + 1} (after {name}={first} steps), and "
                          f"the run ends at step {cfg.steps}: it would never score; set callbacks.spike.window (and "
                          f"warmup) below {cfg.steps}, or callbacks.spike.action=off")  # fmt: skip


def check_rollback(cfg: DictConfig, key: str, max_rollbacks: Any, window: int) -> None:
    """What rollback needs: checkpoints, and enough of them kept for a streak to go back through."""
    if not cfg.checkpoint.every:
        raise ConfigError(f"{key}.action", "rollback goes back to a checkpoint, and checkpoint.every=0 saves "
                          "none; set checkpoint.every=N (or action=skip: the spike's update is left out)")  # fmt: skip
    if not isinstance(max_rollbacks, int) or max_rollbacks < 1:
        raise ConfigError(f"{key}.max_rollbacks", f"got {max_rollbacks!r}; rollbacks in a row before the run "
                          "gives up: an integer >= 1")  # fmt: skip
    need = max_rollbacks + -(-window // cfg.checkpoint.every)
    if 0 < cfg.checkpoint.keep_last < need:
        raise ConfigError("checkpoint.keep_last", f"got {cfg.checkpoint.keep_last}; a spike rollback may go back "
                          f"{max_rollbacks} checkpoints (callbacks.spike.max_rollbacks) from any of the last "
                          f"{need - max_rollbacks} (a window of {window} steps, a checkpoint every "
                          f"{cfg.checkpoint.every}): keep_last >= {need}, or 0 (all)")  # fmt: skip
