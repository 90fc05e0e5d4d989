"""Checks of the `optim` group's values (framework/config/validate.py calls them; optim.lr and
optim.warmup_steps are checked with the other counts there)."""

from __future__ import annotations

from omegaconf import DictConfig

from framework.config.errors import ConfigError


def check_optim(cfg: DictConfig) -> None:
    """The optimizer's and the LR schedule's values in their ranges (framework/optim.py reads them)."""
    o = cfg.optim
    steps = o.get("schedule_steps")
    for key, ok, allowed in (
        ("min_lr_ratio", 0 <= o.min_lr_ratio <= 1, "in [0, 1] (the cosine's floor, a share of optim.lr)"),
        ("weight_decay", o.weight_decay >= 0, ">= 0"),
        ("grad_clip", o.grad_clip >= 0, ">= 0 (0: no clipping)"),
        ("schedule_steps", not steps or steps >= 1, ">= 1, or 0 / null: the run's steps"),
        ("betas", all(0 <= b < 1 for b in o.get("betas") or ()), "two values in [0, 1) (Adam's decay rates)"),
        ("momentum", (o.get("momentum") or 0) >= 0, ">= 0 (0: plain SGD)"),
    ):
        if not ok:
            raise ConfigError(f"optim.{key}", f"got {o[key]}; must be {allowed}")
