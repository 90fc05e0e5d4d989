"""Checks of the components a run is made of, before any worker starts: the optimizer, the LR
schedule and the model converters (framework/components.py checks each against its class's signature, then asks the
class's own `check`), and the optim group's own settings (framework/optimizers' OWN)."""

from __future__ import annotations

from omegaconf import DictConfig

from framework.components import ComponentError, check_component
from framework.config.errors import ConfigError
from framework.optimizers import OWN as OPTIM_OWN
from framework.optimizers import setting
from framework.schedules import OWN as SCHEDULE_OWN


def check_optim(cfg: DictConfig) -> None:
    """The optim and schedule groups: each class imports, takes its keys, and accepts their values."""
    try:
        check_component(cfg, "optim", OPTIM_OWN)
        check_component(cfg, "schedule", SCHEDULE_OWN, given=("total_steps",))
        if cfg.get("converters"):
            from framework.converters import check_converters  # torch: only where converters are listed

            check_converters(cfg)
    except ComponentError as err:
        raise ConfigError(err.key, str(err).split(": ", 1)[1]) from None
    o = cfg.optim
    for key, ok, allowed in (
        ("lr", not isinstance(o.get("lr", 1), int | float) or o.get("lr", 1) > 0, "> 0"),
        (
            "weight_decay",
            not isinstance(o.get("weight_decay", 0), int | float) or o.get("weight_decay", 0) >= 0,
            ">= 0",
        ),
        ("grad_clip", setting(o, "grad_clip") >= 0, ">= 0 (0: no clipping)"),
        ("betas", all(0 <= b < 1 for b in o.get("betas") or ()), "two values in [0, 1) (Adam's decay rates)"),
        ("momentum", (o.get("momentum") or 0) >= 0, ">= 0"),
    ):
        if not ok:
            raise ConfigError(f"optim.{key}", f"got {o[key]}; must be {allowed}")
