"""Configuration: the schema of every group (`schema`, its choices as Enums in `choices`), what a
config means on this machine (`resolve`), the command line's overrides checked before Hydra
composes them (`overrides`, train.py) and the checks that run before any worker starts (`validate`).

`compose(overrides)` composes conf/ as `python train.py OVERRIDES` would; `framework.doors.compose.compose_run`
(a front door above the planner) also validates and resolves it.
"""

from __future__ import annotations

from pathlib import Path

from framework.config.errors import ConfigError
from framework.config.resolve import backend_env, resolve_backend, resolve_device, resolve_nproc, world_size_of
from framework.config.run_id import register_run_id
from framework.config.schema import register_configs
from framework.config.validate import validate

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

__all__ = [
    "CONF_DIR",
    "ConfigError",
    "backend_env",
    "compose",
    "register_configs",
    "register_resolvers",
    "resolve_backend",
    "resolve_device",
    "resolve_nproc",
    "validate",
    "world_size_of",
]


def register_resolvers() -> None:
    """`${run_id:}` (hydra.run.dir) and `${data_vocab:}`: a model's vocab_size follows its data's
    tokenizer (framework.data.tokens.data_vocab), the data layer imported when a config first reads
    it, so that composing imports no torch."""
    from omegaconf import OmegaConf

    register_run_id()
    OmegaConf.register_new_resolver("data_vocab", _data_vocab, replace=True)
    OmegaConf.register_new_resolver("help_groups", help_groups, replace=True)


def help_groups() -> str:
    """`--help`'s groups: each group of conf/ a user picks from and its choices (not the schemas
    Hydra's own list shows, nor a group's part files); `${help_groups:}` in hydra.help.template."""
    groups = sorted(d for d in CONF_DIR.iterdir() if d.is_dir() and d.name != "hydra")
    lines = [f"{d.name}: {', '.join(sorted(p.stem for p in d.glob('*.yaml')))}" for d in groups]
    return "\n".join(lines)


def _data_vocab(*, _root_) -> int | None:
    from framework.data.tokens import data_vocab

    return data_vocab(_root_)


def compose(overrides: list[str] | None = None):
    """The DictConfig `python train.py OVERRIDES` composes (not validated), with the resolvers
    train.py registers: `${run_id:}` and the data's `${data_vocab:}`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides or []))
