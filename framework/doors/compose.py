"""A front door for tests and benchmarks: the config dict a worker runs with, composed, planned
(parallel=auto), validated and resolved as `python train.py OVERRIDES` would make it."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from framework.config import compose, validate, world_size_of
from framework.plan import plan_auto


def compose_run(overrides: list[str] | None = None) -> dict[str, Any]:
    """Compose, validate and resolve: the config dict a worker runs with (under parallel=auto,
    with the planner's layout and knobs; its record of why is train.py's to print and summarise)."""
    cfg = compose(overrides)
    if cfg.parallel.name == "auto":
        plan_auto(cfg, world_size_of(cfg)).apply(cfg)
    validate(cfg)
    return OmegaConf.to_container(cfg, resolve=True)
