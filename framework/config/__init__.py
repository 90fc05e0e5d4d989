"""Configuration: the schema of every group (`schema`), what a config means on this machine
(`resolve`), and the checks that run before any worker starts (`validate`).

`compose_run(overrides)` composes conf/ as `python train.py OVERRIDES` would, validates it and
returns the resolved dict that workers run with: tests and benchmarks use it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from framework.config.resolve import backend_env, resolve_backend, resolve_device, resolve_nproc, world_size_of
from framework.config.schema import register_configs
from framework.config.errors import ConfigError
from framework.config.validate import validate

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

__all__ = [
    "CONF_DIR",
    "ConfigError",
    "backend_env",
    "compose",
    "compose_run",
    "register_configs",
    "resolve_backend",
    "resolve_device",
    "resolve_nproc",
    "validate",
    "world_size_of",
]


def compose(overrides: list[str] | None = None):
    """The DictConfig `python train.py OVERRIDES` composes (not validated)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from framework.launch import register_resolvers

    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides or []))


def compose_run(overrides: list[str] | None = None) -> dict[str, Any]:
    """Compose, validate and resolve: the config dict a worker runs with."""
    from omegaconf import OmegaConf

    cfg = compose(overrides)
    if cfg.parallel.name == "auto":
        from framework.plan import resolve_auto

        resolve_auto(cfg, world_size_of(cfg))
    validate(cfg)
    return OmegaConf.to_container(cfg, resolve=True)
