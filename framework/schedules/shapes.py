"""The framework's own LR schedules: a factor of the optimizer's learning rate at each step (0-based,
the step whose update it scales), in closed form.

- `WarmupCosine`: linear warm-up, then cosine to `min_lr_ratio` of the peak;
- `WarmupConstant`: linear warm-up, then the peak;
- `WarmupStableDecay` (WSD; MiniCPM, DeepSeek LLM, OLMo 2's annealing): linear warm-up, the peak
  held, then a decay over the last `decay_ratio` of the steps to `min_lr_ratio`, its shape
  `linear`, `cosine` or `sqrt` (1 - sqrt, Hägele et al. 2024). A run can be extended or annealed
  from any checkpoint of its stable phase: only the decay depends on where it ends.

Each spans `schedule_steps` (set from `total_steps`), an attribute, so it travels in the
scheduler's state_dict: a resumed run keeps the span it started with even when `steps` is raised,
and the LR does not jump (`schedule.steps` re-plans it: framework/schedules/__init__.py).
"""

from __future__ import annotations

import math

import torch

DECAY_SHAPES = ("linear", "cosine", "sqrt")


class _Horizon(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR whose factor reads the span from the scheduler itself (saved with its state)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int):
        self.schedule_steps = total_steps
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k != "lr_lambdas"}  # a bound method: rebuilt

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict({**state, "lr_lambdas": [None] * len(self.lr_lambdas)})


def warmup(step: int, warmup_steps: int) -> float | None:
    """The warm-up's factor at `step`, or None after it."""
    return (step + 1) / warmup_steps if step < warmup_steps else None


class WarmupCosine(_Horizon):
    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.1):
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        super().__init__(optimizer, total_steps)

    @classmethod
    def check(cls, cfg) -> None:
        _check_common(cfg.schedule)

    def factor(self, step: int) -> float:
        up = warmup(step, self.warmup_steps)
        if up is not None:
            return up
        progress = (step - self.warmup_steps) / max(1, self.schedule_steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine


class WarmupConstant(_Horizon):
    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0):
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, total_steps)

    @classmethod
    def check(cls, cfg) -> None:
        _check_common(cfg.schedule)

    def factor(self, step: int) -> float:
        return warmup(step, self.warmup_steps) or 1.0


class WarmupStableDecay(_Horizon):
    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, decay_ratio: float = 0.2,
                 decay_shape: str = "sqrt", min_lr_ratio: float = 0.0):  # fmt: skip
        self.warmup_steps, self.decay_ratio = warmup_steps, decay_ratio
        self.decay_shape, self.min_lr_ratio = decay_shape, min_lr_ratio
        super().__init__(optimizer, total_steps)

    @classmethod
    def check(cls, cfg) -> None:
        s = cfg.schedule
        _check_common(s)
        if not 0 <= s.get("decay_ratio", 0.2) <= 1:
            raise ValueError(
                f"schedule.decay_ratio: got {s.decay_ratio}; must be in [0, 1] (the decay's share of the steps)"
            )
        if s.get("decay_shape", "sqrt") not in DECAY_SHAPES:
            raise ValueError(f"schedule.decay_shape: got {s.decay_shape!r}; allowed: {', '.join(DECAY_SHAPES)}")

    def decay_start(self) -> int:
        """The first step of the decay (never inside the warm-up)."""
        return max(self.warmup_steps, self.schedule_steps - round(self.decay_ratio * self.schedule_steps))

    def factor(self, step: int) -> float:
        up = warmup(step, self.warmup_steps)
        if up is not None:
            return up
        start = self.decay_start()
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, self.schedule_steps - start))
        left = {"linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
                "sqrt": 1 - math.sqrt(progress)}[self.decay_shape]  # fmt: skip
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * left


def _check_common(s) -> None:
    if s.get("warmup_steps", 0) < 0:
        raise ValueError(f"schedule.warmup_steps: got {s.warmup_steps}; must be >= 0")
    if not 0 <= s.get("min_lr_ratio", 0) <= 1:
        raise ValueError(f"schedule.min_lr_ratio: got {s.min_lr_ratio}; must be in [0, 1] (a share of optim.lr)")
    if s.get("steps") is not None and s.steps < 0:
        raise ValueError(f"schedule.steps: got {s.steps}; must be >= 1, or 0 / null: the run's steps")
