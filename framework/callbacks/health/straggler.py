"""callbacks.straggler: the slow rank named while it slows the run (Megatron's --log-straggler).

Every `every` steps, each rank times its own compute before the step's first gradient collective:
from the step's start to its first backward (reading the batch and the forward; a slow device or
host shows there), on the host clock on a CPU and with CUDA events on a GPU. Each rank's wait is
what the slowest one made it wait at that collective (the slowest's time less its own). The ranks
exchange their times in one small all-gather on that step; the console and W&B name the slowest
rank and its excess over the median of the others, and summary.json's `straggler` block keeps the
history. A rank is named when it was the slow one (`warn_ratio` over the others' median) at
`patience` reports in a row: one report's noise names no one.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from omegaconf import DictConfig

from framework.config.errors import ConfigError
from framework.dist import all_gather_object
from framework.hooks import Run


class Stragglers:
    def __init__(self, every: int = 0, warn_ratio: float = 1.2, patience: int = 2):
        self.every, self.warn_ratio, self.patience = every, warn_ratio, patience
        self.streak: tuple[int, int] = (-1, 0)  # (rank, reports in a row it was the slow one)
        self.active = every > 0  # 0: off (framework/callbacks/build.py builds none)
        self.history: list[dict[str, Any]] = []
        self.marks: list[Any] | None = None

    @classmethod
    def check_config(cls, cfg: DictConfig, key: str, args: dict[str, Any]) -> None:
        every = args.get("every", 0)
        if not isinstance(every, int) or every < 0:
            raise ConfigError(f"{key}.every", f"got {every!r}; check every N steps: an integer >= 1 (0: off)")
        ratio, patience = args.get("warn_ratio", 1.2), args.get("patience", 2)
        if not isinstance(ratio, int | float) or ratio < 1:
            raise ConfigError(f"{key}.warn_ratio", f"got {ratio!r}; the slowest over the median to warn at: >= 1")
        if not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"{key}.patience", f"got {patience!r}; reports in a row before naming a rank: >= 1")

    def on_build(self, run: Run) -> None:
        self.run = run
        self.cuda = run.info.device.type == "cuda"

    def probed(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def on_step_start(self, step: int) -> None:
        if self.probed(step):
            self.run.control.sync()  # this step settles at its end on every rank: the exchange follows at once
            self.marks = [self.mark()]

    def on_before_backward(self, step: int, micro: int) -> None:
        if self.marks is not None and micro == 0 and len(self.marks) == 1:
            self.marks.append(self.mark())

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def on_settled(self, step: int, figures: dict[str, Any]) -> None:
        if self.marks is None or len(self.marks) < 2 or not self.probed(step):
            return
        start, end = self.marks
        self.marks = None
        mine = start.elapsed_time(end) / 1000 if self.cuda else end - start  # settled: the events are done
        times = all_gather_object(mine, self.run.info)  # every rank's, in rank order
        slowest = max(range(len(times)), key=times.__getitem__)
        others = [t for r, t in enumerate(times) if r != slowest] or times
        typical = statistics.median(others)
        record = {"step": step + 1, "slowest_rank": slowest, "excess_s": times[slowest] - typical,
                  "compute_s": times, "wait_s": [times[slowest] - t for t in times]}  # fmt: skip
        self.history.append(record)
        self.run.log({f"straggler/{k}": v for k, v in record.items() if k != "step"}, step + 1, False)  # W&B
        slow = typical > 0 and times[slowest] > self.warn_ratio * typical
        rank, streak = self.streak
        self.streak = (slowest, streak + 1 if rank == slowest else 1) if slow else (-1, 0)
        if self.run.info.is_main and self.streak[1] >= self.patience:
            print(f"straggler at step {step + 1}: rank {slowest} computes in {times[slowest] * 1000:.1f} ms, "
                  f"{record['excess_s'] * 1000:.1f} ms over the others' median ({typical * 1000:.1f} ms); "
                  "the rest wait for it", flush=True)  # fmt: skip

    def on_end(self, summary: dict[str, Any]) -> None:
        counts: dict[int, int] = {}
        for record in self.history:
            counts[record["slowest_rank"]] = counts.get(record["slowest_rank"], 0) + 1
        summary["straggler"] = {"every": self.every, "slowest_counts": counts, "history": self.history}
