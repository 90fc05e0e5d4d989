"""A run directory's files, written by rank 0: metrics.jsonl (rewritten from a restart's
checkpoint on), summary.json (atomically), and where checkpoints go."""

from __future__ import annotations

import json
import os
from typing import Any

from omegaconf import DictConfig

from framework.dist import DistInfo


def checkpoint_root(cfg: DictConfig, run_dir: str) -> str:
    """Where a run's checkpoints go: checkpoint.dir, else <run dir>/checkpoints."""
    return cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")


class RunFiles:
    """The run directory's files, written by rank 0 only (other ranks' calls do nothing)."""

    def __init__(self, run_dir: str, info: DistInfo):
        self.run_dir = run_dir
        self.is_main = info.is_main
        self.prior_losses: list[float] = []  # losses of this run's steps before a restart
        if self.is_main:
            os.makedirs(run_dir, exist_ok=True)
            self._metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a")

    def truncate_metrics(self, start_step: int) -> None:
        """Keep only the lines of steps up to `start_step` (what a resumed run already did)."""
        if not self.is_main:
            return
        path = os.path.join(self.run_dir, "metrics.jsonl")
        self._metrics.close()
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= start_step]
        with open(path, "w") as f:
            f.writelines(kept)
        self._metrics = open(path, "a")
        self.prior_losses = [json.loads(line)["loss"] for line in kept]

    def log_step(self, record: dict[str, Any]) -> None:
        if self.is_main:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def write_summary(self, summary: dict[str, Any], any_rank: bool = False) -> None:
        if self.is_main or any_rank:
            path = os.path.join(self.run_dir, "summary.json")
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(summary, f, indent=2)
            os.replace(tmp, path)  # never a half-written summary
