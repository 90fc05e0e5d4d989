"""The planner's keys (framework/plan), checked with the rest of a config before any worker:
each out of range is one line naming the key (framework/config/validate.py calls `check_plan`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from framework.config.choices import PlanProfile
from framework.config.errors import ConfigError


def check_plan(cfg: DictConfig) -> None:
    """plan.gpu a part the time model knows, plan.gpu_power_w and plan.memory_budget_mb positive,
    plan.profile a measure (probe, cache, config) or benchmarks/gpu.sh's rows.jsonl."""
    from framework.measure.datasheet import PLANNED_PARTS, is_planned_part  # torch: once a config is checked

    plan = cfg.get("plan", {})
    gpu, power, budget = plan.get("gpu"), plan.get("gpu_power_w"), plan.get("memory_budget_mb")
    if gpu is not None and not is_planned_part(gpu):
        raise ConfigError(
            "plan.gpu", f"{gpu!r} is not a part the time model knows; one of {', '.join(PLANNED_PARTS)} (SXM)"
        )
    if power is not None and power <= 0:
        raise ConfigError(
            "plan.gpu_power_w", f"got {power}; must be > 0 watts (the GPUs' power limit), or null: the TDP"
        )
    measure = str(plan.get("profile", "probe"))
    if measure not in {c.value for c in PlanProfile} and not (measure.endswith(".jsonl") and Path(measure).is_file()):
        raise ConfigError(
            "plan.profile",
            f"got {measure!r}; allowed: probe, cache, config, or a rows.jsonl of benchmarks/gpu.sh (an existing file)",
        )
    if budget is not None and budget <= 0:
        raise ConfigError(
            "plan.memory_budget_mb", f"got {budget}; must be > 0 (MB per rank), or null: the device's memory"
        )
