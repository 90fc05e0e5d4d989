"""A run directory's files, written by rank 0: metrics.jsonl (rewritten from a restart's
checkpoint on), summary.json (atomically), and where checkpoints go.

summary.json is the run's one record, whatever its end: a `Summary`, written by `write_summary`
and read by `read_summary`, here and nowhere else. A sweep's folder holds startup.json beside its
runs: its one-time start-up, in no job's figures (write_sweep_startup, read_sweep_startup)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: framework.report reads summaries without importing torch
    from omegaconf import DictConfig

    from framework.dist import DistInfo

SUMMARY_FILE = "summary.json"
SWEEP_STARTUP_FILE = "startup.json"
STATUSES = ("ok", "failed", "preempted", "aborted")
PREEMPTION_KEYS = ("step", "checkpoint", "signal")


@dataclass
class Summary:
    """summary.json. Every status has `status` and `choices`; a failed run its `error`; a
    preempted one where it stopped; a finished one (ok) what it measured (framework.run.summary), whose
    keys sit at the top level of the file beside the others."""

    status: str  # one of STATUSES
    choices: dict[str, Any]  # the chosen name of each config group
    error: str | None = None  # failed: "ExceptionType: message" of the first failing rank
    step: int | None = None  # preempted: the optimizer steps done and saved
    checkpoint: str | None = None  # preempted: the checkpoint holding them
    signal: str | None = None  # preempted: the signal's name (SIGTERM, ...)
    figures: dict[str, Any] = field(default_factory=dict)  # ok: world_size, throughput, memory, ...

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"summary status: got {self.status!r}; allowed: {', '.join(STATUSES)}")

    @classmethod
    def failed(cls, error: BaseException | str, choices: dict[str, Any]) -> Summary:
        return cls("failed", choices, error=error if isinstance(error, str) else f"{type(error).__name__}: {error}")

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object."""
        out: dict[str, Any] = {"status": self.status}
        if self.error is not None:
            out["error"] = self.error
        out["choices"] = self.choices
        if self.status == "preempted":
            out |= {"step": self.step, "checkpoint": self.checkpoint, "signal": self.signal}
        return out | self.figures

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        rest = dict(data)
        status, choices, error = rest.pop("status"), rest.pop("choices", None) or {}, rest.pop("error", None)
        if status == "preempted":  # an ok run's `checkpoint` is a figure (saves, blocking_s)
            return cls(status, choices, error, *(rest.pop(k, None) for k in PREEMPTION_KEYS), figures=rest)
        return cls(status, choices, error, figures=rest)


def write_summary(run_dir: str, summary: Summary) -> None:
    """Write summary.json atomically: a reader never sees half a file."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, SUMMARY_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(summary.to_dict(), f, indent=2)
    os.replace(tmp, path)


def read_summary(run_dir: str | os.PathLike) -> Summary | None:
    """The run's summary.json; None when there is none, or it is not one (unreadable, no status)."""
    try:
        with open(os.path.join(run_dir, SUMMARY_FILE)) as f:
            return Summary.from_dict(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_sweep_startup(sweep_dir: str, parts: dict[str, float]) -> None:
    """A sweep's start-up, paid once by the process that runs its jobs, in seconds by part:
    `launcher_s` (the process's start to its first job: Hydra, the imports) and `workers_s` (the
    workers' forkserver, importing torch and the trainer). Each job counts from its own start."""
    os.makedirs(sweep_dir, exist_ok=True)
    path = os.path.join(sweep_dir, SWEEP_STARTUP_FILE)
    with open(f"{path}.tmp", "w") as f:
        json.dump(parts, f, indent=2)
    os.replace(f"{path}.tmp", path)


def read_sweep_startup(sweep_dir: str | os.PathLike) -> dict[str, float] | None:
    """The sweep's start-up by part (write_sweep_startup); None when it has no record of one."""
    try:
        with open(os.path.join(sweep_dir, SWEEP_STARTUP_FILE)) as f:
            parts = json.load(f)
    except (OSError, ValueError):
        return None
    return parts if isinstance(parts, dict) else None


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

    def write_summary(self, summary: Summary, any_rank: bool = False) -> None:
        """Rank 0's (`any_rank`: whichever rank calls: a failing rank that may not be rank 0)."""
        if self.is_main or any_rank:
            write_summary(self.run_dir, summary)
