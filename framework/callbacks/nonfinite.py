"""nonfinite=stop: a step whose loss, or gradient norm, is NaN or inf stops the run with an error
naming the step and the last good checkpoint. (nonfinite=skip leaves such updates out in the
step itself, framework.run.step.optimizer_step; amp's scaler skips its own and is not an error.)
Every rank reads the same figures after the step's all-reduce, so every rank stops alike."""

from __future__ import annotations

import math
from typing import Any

from framework.checkpoint.store import latest
from framework.hooks import Run


class NonFiniteLoss(RuntimeError):
    """nonfinite=stop: a step's loss or gradient norm was NaN or inf."""


class NonFiniteCheck:
    def __init__(self) -> None:
        self.run: Run | None = None

    def on_build(self, run: Run) -> None:
        self.run = run

    def on_settled(self, step: int, figures: dict[str, Any]) -> None:
        scaled = self.run.parts.precision.scaler.is_enabled()  # amp's inf gradients are its business
        loss, norm = figures["loss"], figures["grad_norm"]
        if not math.isfinite(loss) or (not math.isfinite(norm) and not scaled):
            raise NonFiniteLoss(
                f"step {step + 1}: loss {loss}, gradient norm {norm} (nonfinite=stop; nonfinite=skip leaves such "
                f"steps out). Last good checkpoint: {latest(self.run.checkpoint_root) or 'none (checkpoint.every=0)'}"
            )
