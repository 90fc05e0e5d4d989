"""The spike guard's calibration: settings that flag healthy training are refused.

A guard that fires on ordinary steps rolls back (or skips) runs that need nothing: the new user's
`warmup=8` rolled the smoke run back at step 12 on an ordinary early gradient norm, and a z-score
of 1 flags about a third of all steps. So before any worker starts, the guard's settings are
replayed (`replay`: its own scoring, every step at once) over the converging benchmark's
ten clean runs (every strategy family, 300 steps: the loss and gradient norm each logged,
`clean_runs.json`, written by `python benchmarks/health.py --only false_alarms`), and settings that
flag any step of them are refused in one line, with the smallest window that flags none. The
table of what each setting flags is docs/results/health.md, section 5.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

WATCHED = ("loss", "grad_norm")
MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation over its median absolute deviation
LEAST_SCALE = 0.05  # the z-score's unit is at least 5% of the median: a window of near-equal values
# (a MAD near 0) would otherwise score an ordinary wiggle of a few percent as a spike
CLEAN_RUNS = Path(__file__).with_name("clean_runs.json")
WINDOWS = (16, 32, 64, 128, 256)  # the windows a refusal proposes, smallest first


@dataclass(eq=False)
class Settings:
    """What decides whether the spike guard flags a step (framework/callbacks/health/spike.py)."""

    window: int = 128  # steps a value is scored against (OLMo-core's)
    zscore: float = 6.0  # robust z-score above which a value is a spike
    ratio: float | None = None  # instead: above ratio x the window's mean
    watch: tuple[str, ...] = WATCHED
    warmup: int | None = None  # steps seen before any is scored (None: a full window)

    def __post_init__(self) -> None:
        self.watch = tuple(self.watch)
        self.warmup = self.warmup or self.window


def scores(x: torch.Tensor, values: torch.Tensor, ratio: float | None) -> torch.Tensor:
    """Each watched value's score against its window (`values`: x's shape and a window dimension
    after it; NaN: no value): a robust z-score, or with `ratio` the value over the window's mean.
    Nan-free: a non-finite value scores 0 (the non-finite check is nonfinite's)."""
    if ratio:
        score = x / values.nanmean(dim=-1)
    else:
        median = values.nanmedian(dim=-1).values
        mad = (values - median[..., None]).abs().nanmedian(dim=-1).values
        scale = torch.maximum(MAD_TO_SIGMA * mad, median.abs() * LEAST_SCALE + 1e-12)
        score = (x - median) / scale
    return torch.where(torch.isfinite(score), score, torch.zeros_like(score))


@cache
def clean_runs() -> dict[str, list[dict[str, float]]]:
    """Each clean run's steps ({figure: value} a step), by run."""
    runs = json.loads(CLEAN_RUNS.read_text())["runs"]
    return {name: [dict(zip(run, values, strict=True)) for values in zip(*run.values(), strict=True)]
            for name, run in runs.items()}  # fmt: skip


def replay(series: list[dict[str, float]], **settings: Any) -> list[bool]:
    """Which steps of a logged series ({figure: value} a step) the guard would flag with these
    settings (Settings' fields): the guard's own scoring (`scores`), every step at once,
    each against the `window` values before it as the guard's window holds them. On the host."""
    guard = Settings(**settings)
    history = torch.tensor([[float(step[name]) for name in guard.watch] for step in series])
    history = torch.where(torch.isfinite(history), history, math.nan)
    padded = torch.cat([torch.full((guard.window, len(guard.watch)), math.nan), history])
    windows = padded.unfold(0, guard.window, 1)[: len(series)]  # [step, figure, window]: the values before it
    flags = (scores(history, windows, guard.ratio) > (guard.ratio or guard.zscore)).any(dim=1)
    flags[: guard.warmup] = False
    return flags.tolist()


def false_alarms(settings: dict[str, Any]) -> int:
    """Steps of the clean runs the guard flags with these settings (SpikeGuard's keyword arguments)."""
    return sum(sum(replay(steps, **settings)) for steps in clean_runs().values())


def refusal(settings: dict[str, Any]) -> str | None:
    """Why these settings are refused (None: they flag no step of a clean run)."""
    flagged = false_alarms(settings)
    if not flagged:
        return None
    window = settings.get("window", 128)
    fits = [w for w in WINDOWS if w > window and not false_alarms({**settings, "window": w})]
    shown = ", ".join(f"{k}=[{', '.join(v)}]" if k == "watch" else f"{k}={v}" for k, v in settings.items()
                      if v is not None)  # fmt: skip
    total = sum(len(steps) for steps in clean_runs().values())
    advice = (f"window >= {fits[0]} flags none of them, or watch [loss] alone" if fits else "no window up to 256 "
              "helps: a longer warmup (null: a full window), a higher zscore or ratio, or watch [loss] alone")  # fmt: skip
    return (f"{shown} flags {flagged} of the {total} steps of healthy training (the converging benchmark's "
            f"{len(clean_runs())} clean runs, docs/results/health.md): the guard would act on runs that need "
            f"nothing; {advice}")  # fmt: skip
