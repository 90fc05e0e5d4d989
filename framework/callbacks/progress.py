"""progress=true: a progress bar on rank 0 (tqdm), its postfix the last settled step's loss."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from framework.hooks import Run


class ProgressBar:
    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.run: Run | None = None

    def on_build(self, run: Run) -> None:
        self.run = run

    def on_start(self, step: int) -> None:
        self.bar = tqdm(total=self.run.cfg.steps, initial=step, dynamic_ncols=True)

    def on_step_end(self, step: int) -> None:
        self.bar.update(1)

    def on_settled(self, step: int, figures: dict[str, Any]) -> None:
        self.bar.set_postfix(loss=f"{figures['loss']:.4f}", refresh=False)

    def on_exception(self, error: BaseException) -> None:
        self.close()

    def on_end(self, summary: dict[str, Any]) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
