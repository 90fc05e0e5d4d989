"""Value ranges of the keys no group check of their own reads before a worker would (framework/
config/validate.py calls `check_ranges` with its others): the optimizer's (optim_checks), amp's scaler, the
seed, the planner's cluster, and a model's sizes. Each out of range is one line naming the key."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from framework.config.errors import ConfigError
from framework.config.optim_checks import check_optim

# a model's sizes that must be whole and positive where set (null: the model's default or derived)
MODEL_SIZES = ("n_layer", "n_layers", "n_head", "n_heads", "n_kv_heads", "n_embd", "dim", "ffn_hidden", "hidden",
               "head_dim", "sliding_window", "vocab_size", "embed_dim")  # fmt: skip


def check_ranges(cfg: DictConfig) -> None:
    check_optim(cfg)
    precision = cfg.precision
    if precision.name == "amp":
        _at_least(
            precision.get("init_scale"), 0, "precision.init_scale", "> 0 (the loss scale amp starts at)", strict=True
        )
        _at_least(
            precision.get("growth_interval"), 1, "precision.growth_interval", ">= 1 (steps between scale growths)"
        )
    _at_least(cfg.get("seed"), 0, "seed", ">= 0")
    plan = cfg.get("plan") or {}
    _at_least(plan.get("world_size"), 1, "plan.world_size", ">= 1, or null: the run's world")
    _at_least(plan.get("nodes"), 1, "plan.nodes", ">= 1")
    world, nodes = plan.get("world_size"), plan.get("nodes") or 1
    if world and world % nodes:
        raise ConfigError("plan.nodes", f"got {nodes}; the nodes must split plan.world_size={world} evenly")
    for key in MODEL_SIZES:  # a size read from elsewhere (${data.vocab_size}) is that key's check's
        if not isinstance(cfg.model, DictConfig) or key not in cfg.model or OmegaConf.is_interpolation(cfg.model, key):
            continue
        value = cfg.model[key]
        if isinstance(value, int) and not isinstance(value, bool):
            _at_least(value, 1, f"model.{key}", ">= 1" + (", or null" if key in ("head_dim", "sliding_window") else ""))


def _at_least(value, least: float, key: str, allowed: str, strict: bool = False) -> None:
    if value is not None and (value <= least if strict else value < least):
        raise ConfigError(key, f"got {value}; must be {allowed}")
