"""Experiment tracking: Weights & Biases from rank 0 only, one W&B run per job.

Offline by default: the run is written under the run directory (``<run dir>/wandb/offline-run-*``)
with no network and no account; ``wandb sync <that folder>`` uploads it later. Other ranks get a
tracker that does nothing, so the trainer calls the same methods on every rank.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from omegaconf import DictConfig


class Tracker(Protocol):
    offline_dir: str | None  # the local W&B run folder to `wandb sync`, when offline

    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def summary(self, summary: dict[str, Any]) -> None: ...
    def finish(self, ok: bool) -> None: ...


class NullTracker:
    offline_dir = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def summary(self, summary: dict[str, Any]) -> None:
        pass

    def finish(self, ok: bool) -> None:
        pass


class WandbTracker:
    def __init__(self, cfg: DictConfig, config: dict[str, Any], run_dir: str, choices: dict[str, str]):
        import wandb

        self._wandb = wandb
        name = "-".join(f"{choices[g]}" for g in ("parallel", "precision", "model")) + f"-{os.path.basename(run_dir)}"
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=run_dir,
            name=name,
            group=cfg.group,
            tags=list(cfg.tags) + [f"{g}={c}" for g, c in choices.items() if c],
            config={**config, "choices": choices},  # the whole resolved config (holds no secrets)
            settings=wandb.Settings(x_disable_stats=True, console="off"),
        )

    @property
    def offline_dir(self) -> str | None:
        return os.path.dirname(self.run.dir) if self.run.settings.mode == "offline" else None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(_flatten(summary))

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}/"))
        elif value is not None:
            out[f"{prefix}{key}"] = value
    return out


def build_tracker(
    cfg: DictConfig, config: dict[str, Any], run_dir: str, choices: dict[str, str], is_main: bool
) -> Tracker:
    """W&B on rank 0 when logger=wandb; a tracker that does nothing otherwise."""
    if not is_main or cfg.name == "none" or cfg.mode == "disabled":
        return NullTracker()
    return WandbTracker(cfg, config, run_dir, choices)
