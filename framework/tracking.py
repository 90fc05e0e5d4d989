"""Experiment tracking from rank 0 only: Weights & Biases and/or TensorBoard, one run per job.

W&B is offline by default: the run is written under the run directory
(``<run dir>/wandb/offline-run-*``) with no network and no account; ``wandb sync <that folder>``
uploads it later. TensorBoard writes event files under ``<run dir>/tensorboard``: a local
dashboard for a sweep with ``tensorboard --logdir <sweep dir>``. Other ranks get a tracker that
does nothing, so the trainer calls the same methods on every rank.
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
        try:
            import wandb
        except ImportError:
            raise ImportError("logger=wandb needs the wandb package here (pip install wandb); "
                              "or logger=tensorboard|none (metrics.jsonl and summary.json are written either way)") from None  # fmt: skip

        self._wandb = wandb
        # a sweep job is named by its overrides (train.py sets run_name); a single run by its choices
        name = cfg.run_name or "-".join(choices[g] for g in ("parallel", "precision", "model"))
        name += f"-{os.path.basename(run_dir)}"
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=run_dir,
            name=name,
            group=cfg.group,
            tags=list(cfg.tags) + [f"{g}={c}" for g, c in choices.items() if c],
            config={**config, "choices": choices},  # the whole resolved config (holds no secrets)
            settings=quiet_settings(wandb, cfg.mode),
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


def quiet_settings(wandb: Any, mode: str) -> Any:
    """W&B prints nothing of its own offline (no history sparklines before `done:`): the run's
    closing lines name the offline folder and the `wandb sync` command. Online it keeps the
    essentials (the run's URL)."""
    return wandb.Settings(x_disable_stats=True, console="off", quiet=True, silent=mode == "offline")


class TensorBoardTracker:
    """Per-step scalars, and the summary as hparams (choices) and metrics, in TensorBoard event
    files: the HPARAMS tab of `tensorboard --logdir <sweep dir>` then compares a sweep's runs."""

    offline_dir = None

    def __init__(self, run_dir: str, choices: dict[str, str]):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = os.path.join(run_dir, "tensorboard")
        self.writer = SummaryWriter(self.logdir)
        self.choices = {k: v for k, v in choices.items() if v is not None}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and key != "step":
                self.writer.add_scalar(f"train/{key}", value, step)

    def summary(self, summary: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        figures = {
            f"summary/{k}": float(v)
            for k, v in _flatten(summary).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        # written into this run's own event file (SummaryWriter.add_hparams would open a sub-run)
        for event in hparams(self.choices, figures):
            self.writer.file_writer.add_summary(event)
        for key, value in figures.items():
            self.writer.add_scalar(key, value, summary.get("steps", 0))

    def finish(self, ok: bool) -> None:
        self.writer.close()


class Trackers:
    """Several trackers as one (logger=all)."""

    def __init__(self, *trackers: Tracker):
        self.trackers = trackers

    @property
    def offline_dir(self) -> str | None:
        return next((t.offline_dir for t in self.trackers if t.offline_dir), None)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def summary(self, summary: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.summary(summary)

    def finish(self, ok: bool) -> None:
        for tracker in self.trackers:
            tracker.finish(ok)


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
    """Rank 0: W&B (logger=wandb), TensorBoard (tensorboard) or both (all); other ranks and
    logger=none: a tracker that does nothing."""
    if not is_main:
        return NullTracker()
    trackers: list[Tracker] = []
    if cfg.name in ("wandb", "all") and cfg.mode != "disabled":
        trackers.append(WandbTracker(cfg, config, run_dir, choices))
    if cfg.name in ("tensorboard", "all"):
        trackers.append(TensorBoardTracker(run_dir, choices))
    if not trackers:
        return NullTracker()
    return trackers[0] if len(trackers) == 1 else Trackers(*trackers)
