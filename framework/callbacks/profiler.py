"""profile=true: torch.profiler over a window of steady steps (framework/measure/profiling.py
builds it: profiler.wait, warmup, active), entered when training starts and stepped after every
optimizer step; each rank writes its own trace."""

from __future__ import annotations

from typing import Any

from framework.hooks import Run
from framework.measure.profiling import build_profiler


class Profiler:
    def __init__(self) -> None:
        self.profiler: Any = None
        self.running = False

    def on_build(self, run: Run) -> None:
        cfg, info = run.cfg, run.info
        self.profiler = build_profiler(True, cfg.profiler, run.run_dir, info.rank, info.device)

    def on_start(self, step: int) -> None:
        self.profiler.__enter__()
        self.running = True

    def on_step_end(self, step: int) -> None:
        self.profiler.step()

    def on_exception(self, error: BaseException) -> None:
        self.stop()

    def on_end(self, summary: dict[str, Any]) -> None:
        self.stop()

    def stop(self) -> None:
        if self.running:  # a run that failed before training started never entered it
            self.profiler.__exit__(None, None, None)
            self.running = False
